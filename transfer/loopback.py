"""In-process loopback backend for unit tests: connectors that share a hub move
blocks by a direct gather/scatter when both sides of a handoff are posted. Same
state machine, channels and layout check as the c10d backend."""

from __future__ import annotations

import threading
import time

import torch

from .base import (
    Channel,
    Handoff,
    KVConnector,
    LayoutMismatch,
    TransferState,
    check_layouts,
    gather_blocks,
    layout_of,
    scatter_blocks,
)


class LoopbackHub:
    def __init__(self):
        self.lock = threading.Lock()
        self.connectors: dict[str, LoopbackConnector] = {}
        self.posted: dict[tuple, Handoff] = {}


class LoopbackConnector(KVConnector):
    def __init__(self, name: str, kv: torch.Tensor, hub: LoopbackHub, default_timeout_s: float = 30.0):
        self.name, self.kv, self.hub = name, kv, hub
        self.address = f"loopback:{name}"
        self.layout = layout_of(kv)
        self.default_timeout_s = default_timeout_s
        self._handoffs: dict[str, Handoff] = {}
        self._seq: dict[str, int] = {}
        hub.connectors[name] = self

    def new_channel(self, peer: str) -> Channel:
        seq = self._seq.get(peer, 0)
        self._seq[peer] = seq + 1
        return Channel(0, seq)

    def _start(self, is_sender: bool, peer: str, request_id: str, block_ids: list[int], channel: Channel,
               timeout_s: float | None) -> Handoff:
        h = Handoff(request_id, peer, list(block_ids), channel, is_sender, timeout_s or self.default_timeout_s)
        self._handoffs[request_id] = h
        if not block_ids:
            h._finish(TransferState.DONE)
            return h
        sender, receiver = (self.name, peer) if is_sender else (peer, self.name)
        key = (sender, receiver, channel)
        with self.hub.lock:
            other = self.hub.posted.pop(key, None)
            if other is None or other.state.finished:
                self.hub.posted[key] = h
                return h
        send, recv = (h, other) if is_sender else (other, h)
        src, dst = self.hub.connectors[sender], self.hub.connectors[receiver]
        try:
            check_layouts(dst.layout, src.layout, sender)
            if len(send.block_ids) != len(recv.block_ids):
                raise ValueError(f"sender offers {len(send.block_ids)} blocks, receiver expects {len(recv.block_ids)}")
        except (LayoutMismatch, ValueError) as e:
            for x in (send, recv):
                x._finish(TransferState.FAILED, str(e))
            return h
        buf = gather_blocks(src.kv, send.block_ids)
        scatter_blocks(dst.kv, recv.block_ids, buf)
        send.nbytes = recv.nbytes = buf.numel() * buf.element_size()
        send._finish(TransferState.DONE)
        recv._finish(TransferState.DONE)
        return h

    def start_send(self, peer, peer_address, request_id, block_ids, channel, timeout_s=None, ready=None) -> Handoff:
        return self._start(True, peer, request_id, block_ids, channel, timeout_s)

    def start_recv(self, peer, peer_address, request_id, block_ids, channel, timeout_s=None) -> Handoff:
        return self._start(False, peer, request_id, block_ids, channel, timeout_s)

    def poll(self) -> list[Handoff]:
        now = time.monotonic()
        done = []
        for rid, h in list(self._handoffs.items()):
            if not h.state.finished and now > h.deadline:
                h._finish(TransferState.FAILED, f"timed out after {h.timeout_s:.1f} s")
            if h.state.finished:
                done.append(self._handoffs.pop(rid))
        return done

    def abort(self, request_id: str) -> bool:
        h = self._handoffs.get(request_id)
        return h is not None and h._finish(TransferState.FAILED, "aborted")
