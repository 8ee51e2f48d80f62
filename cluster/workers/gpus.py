"""Which GPUs a worker process sees: its own first, then the rest of its node's.

Ray narrows `CUDA_VISIBLE_DEVICES` to the GPUs it assigned an actor, which hides every other GPU
of the node from it, and a CUDA IPC handle of a peer on another GPU cannot be opened where that
GPU is not visible: same-node pairs on different GPUs would move KV over NCCL. So pdserve's GPU
actors ask Ray not to set the variable (`runtime_env()`: Ray still accounts the GPUs it assigned,
and still places by them), and set it themselves, first thing in the actor, before CUDA starts
(`see_node_gpus()`): the assigned GPUs first, the node's others after. `cuda:0` stays the actor's
own GPU in every thread (nothing else in the process changes), and a peer's GPU is visible for
the same-node pull (transfer/shared.py) and for a TP worker's own all-reduce buffers.

    runtime_env()        the `runtime_env` a GPU actor starts with
    see_node_gpus()      in the actor: sets CUDA_VISIBLE_DEVICES; returns what it set, or None
    visible_order(...)   the order itself (pure: what the two above agree on)
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
NODE_GPUS_DIR = "/proc/driver/nvidia/gpus"  # one entry per GPU the NVIDIA driver of this host has


def runtime_env() -> dict:
    """What a GPU actor's options carry so that Ray leaves CUDA_VISIBLE_DEVICES to it."""
    return {"env_vars": {NOSET: "1"}}


def visible_order(assigned: list[str], inherited: str | None, node_gpus: int) -> list[str]:
    """The actor's CUDA_VISIBLE_DEVICES entries: `assigned` (Ray's GPU ids: entries of the node's
    own CUDA_VISIBLE_DEVICES when it had one, else device indices) first, then the node's others in
    their order. `inherited`: the variable as the node's Ray started with it (None: unset, every
    one of the `node_gpus` GPUs)."""
    node = [d.strip() for d in inherited.split(",") if d.strip()] if inherited is not None \
        else [str(i) for i in range(node_gpus)]
    own = [str(a) for a in assigned]
    return own + [d for d in node if d not in own]


def _node_gpus() -> int:
    try:
        return len(os.listdir(NODE_GPUS_DIR))
    except OSError:
        return 0


def see_node_gpus() -> str | None:
    """In a GPU actor started with `runtime_env()`: makes its assigned GPUs cuda:0.. and the node's
    others visible after them. Returns the value set; None where there is nothing to do (no GPU
    assigned, Ray set the variable itself, or CUDA already started in this process: the view Ray
    gave stays, and a pair across GPUs moves KV over NCCL, naming why in its `kv_links`)."""
    import ray

    if os.environ.get(NOSET) != "1" or not ray.is_initialized():
        return None
    assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if not assigned:
        return None
    import torch

    if torch.cuda.is_initialized():
        log.warning("CUDA started before the actor chose its GPUs; it keeps the view it has")
        return None
    value = ",".join(visible_order(assigned, os.environ.get("CUDA_VISIBLE_DEVICES"), _node_gpus()))
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    return value
