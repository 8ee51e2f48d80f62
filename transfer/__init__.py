"""pdserve.transfer: KV-block handoff between a prefill and a decode worker.

    base.py      the KVConnector interface, the polled handoff state machine, channels and
                 targets, gather/scatter, the layout check
    c10d.py      pairwise NCCL (CUDA) / gloo (CPU) process groups formed at run time
    loopback.py  an in-process backend for unit tests
    fetch.py     peer fetch: a prompt's prefix blocks copied from a peer's GPU over the same links

The block accounting around a handoff (what to reserve, what to send) is the KV-cache
manager's (engine/core/kv_cache_manager.py).
"""

from .base import Channel, Handoff, HandoffTarget, KVConnector, LayoutMismatch, TransferError, TransferState

__all__ = ["Channel", "Handoff", "HandoffTarget", "KVConnector", "LayoutMismatch", "TransferError",
           "TransferState"]
