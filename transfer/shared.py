"""A worker's KV slab as another process of its node maps it: the memory of the same-node
handoff (transfer/pull.py).

    export(kv)          -> a JSON-able description a peer can map, or None
    open_peer(desc, kv) -> the peer's slab mapped into this process, or the reason it cannot be

CUDA: a CUDA IPC handle of the slab's allocation, with its GPU's UUID (engine/base/cuda_ipc.py).
A peer opens it when that GPU is its own (workers sharing a GPU) or a GPU it can reach
peer-to-peer and sees (a pdserve worker sees its node's GPUs: cluster/workers/gpus.py); the mapping lives
as long as the peer keeps the tensor. CPU: the slab lives on a memory file (engine/exec/kv_cache.zeros_on_demand) that a
process of the same host maps through /proc/<pid>/fd/<fd>. Either way a mapping outlives the
exporter's process without faulting (the pages stay until the last mapping goes), so a reader
that lost its peer reads stale memory, never freed memory: pull.py checks the peer is alive
after each copy and discards what it copied if not.
"""

from __future__ import annotations

import mmap
import socket

import torch

from pdserve.engine.base.cuda_ipc import export_cuda, open_cuda
from pdserve.engine.exec.kv_cache import shared_file


def host_id() -> str:
    """This host, as processes on it agree: the host name and the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def export(kv: torch.Tensor) -> dict | None:
    """What a peer on this host needs to map `kv`; None if it cannot be shared."""
    if kv.device.type == "cuda":
        return {**export_cuda(kv), "host": host_id()}
    entry = shared_file(kv)
    if entry is None:
        return None
    pid, fd, nbytes = entry
    return {"kind": "file", "host": host_id(), "pid": pid, "fd": fd, "bytes": nbytes, "shape": list(kv.shape),
            "dtype": str(kv.dtype).removeprefix("torch.")}


def open_peer(desc: dict | None, kv: torch.Tensor) -> torch.Tensor | str:
    """The peer's slab (described by `export`) mapped here, to be read by this process on `kv`'s
    device; else why not (then the pair moves KV over NCCL / gloo)."""
    if not desc:
        return "the peer's KV cannot be shared"
    if desc.get("host") != host_id():
        return "the peer runs on another host"
    if desc["kind"] == "cuda":
        if kv.device.type != "cuda":
            return "the peer's KV is on a GPU, ours is not"
        return open_cuda(desc, kv.device)
    if kv.device.type != "cpu":
        return "the peer's KV is in host memory, ours on a GPU"
    try:
        with open(f"/proc/{desc['pid']}/fd/{desc['fd']}", "r+b") as f:
            buf = mmap.mmap(f.fileno(), desc["bytes"])
    except OSError as e:
        return f"cannot map the peer's KV file: {e.strerror}"
    dtype = getattr(torch, desc["dtype"])
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(desc["shape"])
