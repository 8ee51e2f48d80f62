"""pdserve.transfer: KV-block handoff between a prefill and a decode worker.

    base.py      the polled handoff state machine, channels, gather/scatter, layout check
    c10d.py      pairwise NCCL (CUDA) / gloo (CPU) process groups formed at run time
    loopback.py  an in-process backend for unit tests
    handoff.py   block accounting around a handoff on the engine's KV-cache manager
"""

from .base import Channel, Handoff, KVConnector, LayoutMismatch, TransferError, TransferState

__all__ = ["Channel", "Handoff", "KVConnector", "LayoutMismatch", "TransferError", "TransferState"]
