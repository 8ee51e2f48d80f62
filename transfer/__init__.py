"""pdserve.transfer: KV-block handoff between a prefill and a decode worker.

    base.py      the KVConnector interface (what roles use) and PairConnector (one process's
                 pairs), the polled handoff state machine, channels and targets, gather/scatter
    records.py   what a worker announces of its transfers (WireLayout, PairLink) and their errors (no torch)
    c10d.py      C10dConnector: a worker's pairs with its peers, met through TCPStores at run time
    pair.py      one (sender, receiver) pair: its link chosen on connect and the thread that runs it
    pull.py      the same-node link: the receiver copies from the sender's KV mapped into it
    shared.py    a KV slab as another process of the node maps it (CUDA IPC, shared memory files)
    wire.py      the link over a 2-rank process group (NCCL on CUDA, gloo on CPU)
    tp.py        TPConnector: handoffs between tensor-parallel workers of any sizes, rank to rank
    loopback.py  an in-process backend for unit tests
    fetch.py     peer fetch: a prompt's prefix blocks copied from a peer's GPU over the same links
    probe.py     whether a peer's host answers (a TCP connect): what waits on a lost link fails now

The block accounting around a handoff (what to reserve, what to send) is the KV-cache
manager's (engine/core/kv_cache_manager.py).

The names below load on first use: a process that unpickles only a worker's `WireLayout` (the
block registry's actor) loads neither torch nor the connectors.
"""

__all__ = ["Channel", "Handoff", "HandoffTarget", "KVConnector", "LayoutMismatch", "TransferError",
           "TransferState"]


def __getattr__(name: str):
    if name in ("LayoutMismatch", "TransferError"):
        from .records import LayoutMismatch, TransferError

        return {"LayoutMismatch": LayoutMismatch, "TransferError": TransferError}[name]
    if name in __all__:
        from .base import Channel, Handoff, HandoffTarget, KVConnector, TransferState

        return {"Channel": Channel, "Handoff": Handoff, "HandoffTarget": HandoffTarget, "KVConnector": KVConnector,
                "TransferState": TransferState}[name]
    raise AttributeError(f"module 'pdserve.transfer' has no attribute {name!r}")
