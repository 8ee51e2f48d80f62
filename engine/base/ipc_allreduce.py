"""The tensor-parallel group's one-shot all-reduce (ops/oneshot_allreduce.py) and the buffers it
reads: each rank's two slots and flags in one CUDA allocation that every rank of the group maps
through CUDA IPC (cuda_ipc.py).

    IPCAllReduce.build(store, agree, rank, size, device) -> the all-reduce, or why the group keeps NCCL
    ipc(x)                                              -> x summed over the ranks, in place

`build` is collective (every rank calls it, after the group's stores and ctrl group exist):
each rank allocates and publishes its buffer under `tp/oneshot/<rank>` of the group's store,
maps every peer's, and the ranks agree (`agree`: the smallest of every rank's value,
TPGroup.min_int) that all of them could; one that cannot (a peer's GPU not visible, no peer
access) makes the whole group keep NCCL, saying why. The buffers live as long as the object; the
caller (exec/tp.TPGroup) checks the first result against NCCL's before it trusts the path.
"""

from __future__ import annotations

import json

import torch

from ..ops.oneshot_allreduce import MAX_PROGRAMS, MAX_RANKS, SLOT_BYTES, fits, oneshot_all_reduce
from .cuda_ipc import export_cuda, open_cuda

FLAG_BYTES = MAX_RANKS * MAX_PROGRAMS * 4


class IPCAllReduce:
    def __init__(self, rank: int, raw: list[torch.Tensor], own: torch.Tensor):
        self.rank, self.own = rank, own  # `own` keeps this rank's allocation (peers map it)
        self.data = [r[:2 * SLOT_BYTES] for r in raw]
        self.flags = [r[2 * SLOT_BYTES:].view(torch.int32).view(MAX_RANKS, MAX_PROGRAMS) for r in raw]
        self.epochs = torch.zeros(MAX_PROGRAMS + 1, dtype=torch.int32, device=own.device)  # + the error word
        self._views: dict[torch.dtype, list[torch.Tensor]] = {}

    @classmethod
    def build(cls, store, agree, rank: int, size: int, device: torch.device) -> IPCAllReduce | str:
        if not 1 < size <= MAX_RANKS:
            return f"a one-shot all-reduce spans 2 to {MAX_RANKS} ranks, not {size}"
        own = torch.zeros(2 * SLOT_BYTES + FLAG_BYTES, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)  # zeroed before any peer can write a flag into it
        store.set(f"tp/oneshot/{rank}", json.dumps(export_cuda(own)))
        raw, why = [], None
        for q in range(size):
            if q == rank:
                raw.append(own)
                continue
            store.wait([f"tp/oneshot/{q}"])
            peer = open_cuda(json.loads(store.get(f"tp/oneshot/{q}")), device)
            if isinstance(peer, str):
                why = f"rank {rank} cannot map rank {q}'s buffers: {peer}"
                break
            raw.append(peer)
        if not agree(0 if why else 1):  # every rank mapped every other's
            return why or "another rank cannot map this rank's buffers"
        return cls(rank, raw, own)

    def error(self) -> int:
        """0, or q + 1 when a launch gave up waiting for rank q (reads the device: syncs)."""
        return int(self.epochs[MAX_PROGRAMS].item())

    def fits(self, x: torch.Tensor) -> bool:
        return fits(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        views = self._views.get(x.dtype)
        if views is None:
            views = self._views[x.dtype] = [d.view(x.dtype) for d in self.data]
        return oneshot_all_reduce(x, views, self.flags, self.epochs, self.rank)
