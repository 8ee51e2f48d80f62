"""In-process loopback backend for unit tests: connectors that share a hub move
blocks by a direct gather/scatter when both sides of a handoff are posted. Same
state machine, channels and layout check as the c10d backend."""

from __future__ import annotations

import threading
import time

import torch

from .base import (
    Abort,
    Channel,
    Handoff,
    HandoffMeta,
    HandoffTarget,
    PairConnector,
    gather_blocks,
    scatter_blocks,
)
from .records import LayoutMismatch, WireLayout


class LoopbackHub:
    def __init__(self):
        self.lock = threading.Lock()
        self.connectors: dict[str, LoopbackConnector] = {}
        self.posted: dict[tuple, Handoff] = {}


class LoopbackConnector(PairConnector):
    def __init__(self, name: str, kv: torch.Tensor, hub: LoopbackHub, default_timeout_s: float = 30.0,
                 kv_cache_dtype: str = "auto"):
        self.name, self.kv, self.hub = name, kv, hub
        self.address = f"loopback:{name}"
        self.layout = WireLayout.of(kv, 0, kv_cache_dtype=kv_cache_dtype)
        self.default_timeout_s = default_timeout_s
        self._handoffs: dict[str, Handoff] = {}
        hub.connectors[name] = self

    def new_channel(self, peer: str) -> Channel:
        return Channel(0)

    def _start(self, is_sender: bool, peer: str, request_id: str, block_ids: list[int], channel: Channel,
               timeout_s: float | None, meta: HandoffMeta | None = None, heads=None,
               wait_s: float | None = None) -> Handoff:
        h = Handoff(request_id, peer, list(block_ids), channel, is_sender, timeout_s or self.default_timeout_s,
                    meta=meta, heads=heads, wait_s=wait_s)
        self._handoffs[request_id] = h
        sender, receiver = (self.name, peer) if is_sender else (peer, self.name)
        key = (sender, receiver, request_id)
        with self.hub.lock:
            other = self.hub.posted.pop(key, None)
            if other is None or other.state.finished:
                self.hub.posted[key] = h
                return h
        send, recv = (h, other) if is_sender else (other, h)
        src, dst = self.hub.connectors[sender], self.hub.connectors[receiver]
        try:
            dst.layout.check(src.layout, sender)
            if len(send.block_ids) != len(recv.block_ids):
                raise ValueError(f"sender offers {len(send.block_ids)} blocks, receiver expects {len(recv.block_ids)}")
        except (LayoutMismatch, ValueError) as e:
            for x in (send, recv):
                x.fail(str(e))
            return h
        if send.block_ids:
            buf = gather_blocks(src.kv, send.block_ids)
            if send.heads is None and recv.heads is None:
                scatter_blocks(dst.kv, recv.block_ids, buf)
            else:  # tensor parallel: a slice of the sender's heads into a slice of the receiver's
                (slo, shi), (dlo, dhi) = send.heads or (0, src.kv.shape[4]), recv.heads or (0, dst.kv.shape[4])
                buf = buf[:, :, :, :, slo:shi].contiguous()
                dst.kv[:, :, :, :, dlo:dhi].index_copy_(0, torch.tensor(recv.block_ids), buf)
            send.nbytes = recv.nbytes = buf.numel() * buf.element_size()
        recv.meta = send.meta
        send.complete()
        recv.complete()
        return h

    def start_send(self, target: HandoffTarget, request_id: str, block_ids: list[int],
                   timeout_s: float | None = None, ready=None, meta: HandoffMeta | None = None,
                   heads=None) -> Handoff:
        return self._start(True, target.peer, request_id, block_ids, target.channel, timeout_s, meta, heads)

    def start_recv(self, peer: str, request_id: str, block_ids: list[int], channel: Channel,
                   timeout_s: float | None = None, heads=None, wait_s: float | None = None) -> Handoff:
        return self._start(False, peer, request_id, block_ids, channel, timeout_s, heads=heads, wait_s=wait_s)

    def poll(self) -> list[Handoff]:
        now = time.monotonic()
        done = []
        for rid, h in list(self._handoffs.items()):
            if not h.state.finished and now > h.deadline:
                h.fail(f"timed out after {h.timeout_s:.1f} s")
            if h.state.finished:
                done.append(self._handoffs.pop(rid))
        return done

    def abort(self, request_id: str, settle: bool = False) -> Abort:
        """A loopback handoff is never on a wire: it ends at once."""
        h = self._handoffs.get(request_id)
        return Abort.ENDED if h is not None and h.fail("aborted") else Abort.NONE

    @property
    def num_pending(self) -> int:
        return len(self._handoffs)

    def forget_peer(self, peer: str, sends: bool = True) -> None:
        for h in list(self._handoffs.values()):
            if h.peer == peer and (sends or not h.is_sender):
                h.fail(f"peer {peer} left")

    def close(self) -> None:
        for h in list(self._handoffs.values()):
            h.fail("connector closed")
