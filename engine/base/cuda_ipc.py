"""A CUDA tensor of one process opened in another of the same node, by its CUDA IPC handle.

    export_cuda(t)        -> a JSON-able description: torch's own reduction of the tensor (the
                             handle of its allocation, its offset, shape and dtype) and its GPU's UUID
    open_cuda(desc, dev)  -> the tensor mapped into this process, or why it cannot be

The opener finds the GPU by UUID among those it sees (CUDA_VISIBLE_DEVICES), so the two may
number their GPUs differently; a tensor on another GPU needs peer access from `dev` to it, and is
mapped into `dev`'s address space: torch sees it on `dev`, and kernels launched there read it
over NVLink / PCIe. The
mapping lives as long as the opener keeps the tensor, and outlives the exporter's process
without faulting (the memory stays until the last mapping goes). Users: the same-node KV pull
(transfer/shared.py) and the tensor-parallel one-shot all-reduce (ipc_allreduce.py).
"""

from __future__ import annotations

import base64

import torch

# the classes a CUDA handle names (data, never code: a handle is JSON, not a pickle)
_CLASSES = {"Tensor": torch.Tensor, "UntypedStorage": torch.UntypedStorage, "TypedStorage": torch.TypedStorage}


def _to_wire(a):
    if isinstance(a, type):
        if _CLASSES.get(a.__name__) is not a:
            raise TypeError(f"cannot describe {a!r} in a CUDA IPC handle")
        return {"class": a.__name__}
    if isinstance(a, bytes):
        return {"bytes": base64.b64encode(a).decode()}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, tuple):  # torch.Size, strides
        return {"tuple": list(a)}
    return a


def _from_wire(a):
    if not isinstance(a, dict):
        return a
    if "class" in a:
        return _CLASSES[a["class"]]
    if "bytes" in a:
        return base64.b64decode(a["bytes"])
    if "dtype" in a:
        return getattr(torch, a["dtype"])
    return tuple(a["tuple"])


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_cuda(t: torch.Tensor) -> dict:
    """What a process of this node needs to map `t` (a CUDA tensor of the caching allocator)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)  # rebuild_cuda_tensor's arguments
    return {"kind": "cuda", "uuid": gpu_uuid(t.device), "handle": [_to_wire(a) for a in args]}


def open_cuda(desc: dict, device: torch.device) -> torch.Tensor | str:
    """The tensor `desc` (export_cuda) describes, mapped here to be read from `device`; else why not."""
    local = [i for i in range(torch.cuda.device_count()) if gpu_uuid(torch.device("cuda", i)) == desc["uuid"]]
    if not local:
        return "the peer's GPU is not visible to this process"
    index = local[0]
    mine = device.index if device.index is not None else torch.cuda.current_device()
    if index != mine and not torch.cuda.can_device_access_peer(mine, index):
        return f"no peer access from GPU {mine} to the peer's GPU {index}"
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = [_from_wire(a) for a in desc["handle"]]
    # opened in OUR device's context (CUDA maps another GPU's memory into the current device's
    # address space, enabling peer access): a kernel launched on `device` may read it, and Triton
    # accepts the pointer (opened in its own GPU's context, Triton refused it: "cannot be accessed")
    args[6] = mine
    try:
        with torch.cuda.device(mine):
            return rebuild_cuda_tensor(*args)
    except RuntimeError as e:
        return f"cannot open the peer's CUDA IPC handle: {e}"
