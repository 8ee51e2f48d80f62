"""A worker's KV slab as another process of its node maps it: the memory of the same-node
handoff (transfer/pull.py).

    export(kv)          -> a JSON-able description a peer can map, or None
    open_peer(desc, kv) -> the peer's slab mapped into this process, or the reason it cannot be

CUDA: a CUDA IPC handle of the slab's allocation (torch's own reduction of a CUDA tensor), with
its GPU's UUID. A peer opens it when that GPU is its own (workers sharing a GPU) or a GPU it can
reach peer-to-peer and sees (CUDA_VISIBLE_DEVICES); the mapping lives as long as the peer keeps
the tensor. CPU: the slab lives on a memory file (engine/exec/kv_cache.zeros_on_demand) that a
process of the same host maps through /proc/<pid>/fd/<fd>. Either way a mapping outlives the
exporter's process without faulting (the pages stay until the last mapping goes), so a reader
that lost its peer reads stale memory, never freed memory: pull.py checks the peer is alive
after each copy and discards what it copied if not.
"""

from __future__ import annotations

import base64
import mmap
import socket

import torch

from pdserve.engine.exec.kv_cache import shared_file


def host_id() -> str:
    """This host, as processes on it agree: the host name and the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


# the classes a CUDA handle names (data, never code: a handle is JSON, not a pickle)
_CLASSES = {"Tensor": torch.Tensor, "UntypedStorage": torch.UntypedStorage, "TypedStorage": torch.TypedStorage}


def _to_wire(a):
    if isinstance(a, type):
        if _CLASSES.get(a.__name__) is not a:
            raise TypeError(f"cannot describe {a!r} in a KV handle")
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


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export(kv: torch.Tensor) -> dict | None:
    """What a peer on this host needs to map `kv`; None if it cannot be shared."""
    if kv.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(kv)  # rebuild_cuda_tensor's arguments
        return {"kind": "cuda", "host": host_id(), "uuid": _uuid(kv.device), "handle": [_to_wire(a) for a in args]}
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
        return _open_cuda(desc, kv.device)
    if kv.device.type != "cpu":
        return "the peer's KV is in host memory, ours on a GPU"
    try:
        with open(f"/proc/{desc['pid']}/fd/{desc['fd']}", "r+b") as f:
            buf = mmap.mmap(f.fileno(), desc["bytes"])
    except OSError as e:
        return f"cannot map the peer's KV file: {e.strerror}"
    dtype = getattr(torch, desc["dtype"])
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(desc["shape"])


def _open_cuda(desc: dict, device: torch.device) -> torch.Tensor | str:
    local = [i for i in range(torch.cuda.device_count()) if _uuid(torch.device("cuda", i)) == desc["uuid"]]
    if not local:
        return "the peer's GPU is not visible to this process"
    index = local[0]
    mine = device.index if device.index is not None else torch.cuda.current_device()
    if index != mine and not torch.cuda.can_device_access_peer(mine, index):
        return f"no peer access from GPU {mine} to the peer's GPU {index}"
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = [_from_wire(a) for a in desc["handle"]]
    args[6] = index  # the storage's device, as this process numbers it
    try:
        with torch.cuda.device(index):
            return rebuild_cuda_tensor(*args)
    except RuntimeError as e:
        return f"cannot open the peer's CUDA IPC handle: {e}"
