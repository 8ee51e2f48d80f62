"""One (sender, receiver) pair of a C10dConnector: its 2-rank process group and the
thread that runs its handoffs, in an order the SENDER decides.

The receiver reserves blocks and posts its receive as soon as the request is placed,
long before the prompt is prefilled; prompts finish in any order. So the order of the
pair's messages is the order in which the sender's sends start, announced through the
receiver's store (the pair's PrefixStore "pd/<sender>/<gen>"; a pulled pair's over its
doorbell, pull.Bell):

    sender    takes its queued sends in start order; for the k-th, writes
              "order/<k>" = {rid, nblocks, meta} (meta: the first token, spans), then
              posts the KV (chunked, tags (k << 6) + i) and waits for it to leave
    receiver  waits for "order/<k>", finds its posted receive for rid, posts the matching
              receive and scatters the chunks; `meta` is the handoff's meta once DONE.
              A receive nobody ordered (its prefill was aborted) just times out, stalling
              nothing; an order for a receive it no longer has (aborted here) is drained
              into a scratch buffer, so the pair stays in step.
    failure   an error on a posted message kills the pair: its group is aborted and set
              aside (never destroyed from a worker thread; NCCL may hang there), its queued
              handoffs fail, and the connector moves the receiver to a new `gen`; a receiver
              waiting for orders also dies when the sender marks the gen dead (every 50 ms
              it looks), failing what was posted on it
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Protocol

import torch
import torch.distributed as dist

from .base import Handoff, HandoffMeta, StagingPool, TransferState
from .pull import PullLink, accept, offer, post, take
from .records import WireLayout
from .wire import C10dLink, td, width


class PairHost(Protocol):
    """What a pair uses of the connector that owns it (c10d.C10dConnector): its KV slab and
    wire layout, its staging ring and side stream, its stores, and the calls that report a
    pair's end. Nothing else of the connector is read."""
    name: str
    host: str
    device: torch.device
    kv: torch.Tensor
    layout: WireLayout
    block_bytes: int
    min_chunk_bytes: int
    default_timeout_s: float
    same_node: bool  # pull from a peer of this host whose KV maps here (pull.py), else c10d
    address: str
    staging: StagingPool
    stream: torch.cuda.Stream | None
    store: dist.TCPStore
    graveyard: list  # aborted process groups, destroyed by the owner's thread, never a pair's
    peer_addresses: dict[str, str]  # peer -> its store's address, as each pair's connect learns it

    def client_store(self, address: str, deadline: float) -> dist.TCPStore: ...

    def mark_dead(self, peer_address: str, gen: int, connect: bool = False) -> None: ...

    def pair_died(self, pair: Pair) -> None: ...


class Pair:
    def __init__(self, conn: PairHost, peer: str, peer_address: str, gen: int, is_sender: bool):
        self.conn, self.peer, self.peer_address = conn, peer, peer_address
        self.gen, self.is_sender = gen, is_sender
        self.rank = 0 if is_sender else 1
        self.sends: collections.deque[Handoff] = collections.deque()  # sender: in start order
        self.recvs: dict[str, Handoff] = {}  # receiver: posted, waiting for their order
        self.orphans: dict[str, float] = {}  # receiver: aborted here, maybe still ordered (-> deadline)
        self.next_seq = 0
        self._dead_check_at = 0.0  # receiver: when to look for the sender's dead mark next
        self.current: Handoff | None = None  # the one on the wire
        self.dead = False
        self.error: str | None = None
        self.link: C10dLink | PullLink | None = None  # set when the pair connects
        self.why: str | None = None  # why the link is what it is
        self.ps = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"kv-pair-{peer}-{gen}", daemon=True)
        self.thread.start()

    # ---- called from the worker's threads ---------------------------------------------------
    def submit(self, h: Handoff) -> None:
        with self.cond:
            if self.dead:
                h.fail(f"pair with {self.peer} is closed: {self.error}")
                return
            if self.is_sender:
                self.sends.append(h)
            else:
                self.recvs[h.request_id] = h
            self.cond.notify_all()

    def forget(self, h: Handoff) -> bool:
        """Drops a handoff that never started on the wire (aborted or overdue): True if it
        had not; then nothing else is needed. False: it is on the wire; kill the pair."""
        with self.cond:
            if h.t_started is not None:  # taken up by the pair's thread: on the wire
                return False
            if self.is_sender:
                if h in self.sends:
                    self.sends.remove(h)
            elif self.recvs.pop(h.request_id, None) is not None:  # its order may still come: drain it
                self.orphans[h.request_id] = time.monotonic() + self.conn.default_timeout_s
            return True

    def kill(self, reason: str, unreachable: bool = False) -> None:
        """Ends the pair and fails what waits on it (`unreachable`: the peer's host does not answer,
        and the handoff on the wire fails now too, not when its blocked op times out)."""
        with self.cond:
            if self.dead:
                return
            self.dead, self.error = True, reason
            pending = list(self.sends) + list(self.recvs.values())
            self.sends.clear()
            self.recvs.clear()
            self.cond.notify_all()
        for h in pending:
            h.fail(reason, pair_lost=True, unreachable=unreachable)
        if self.current is not None:  # on the wire when the pair died (it may have ended already)
            self.current.pair_lost = True
            if unreachable:
                self.current.fail(reason, pair_lost=True, unreachable=True)
        if self.is_sender and not unreachable:  # (a store we cannot reach would hold this thread)
            # tell the receiver, through its store, that this gen is dead: its next channel
            # for us moves to a new gen instead of meeting a group we no longer run
            self.conn.mark_dead(self.peer_address, self.gen)
        if self.link is not None:
            self.link.close()
        self.conn.pair_died(self)

    # ---- the pair's thread ------------------------------------------------------------------
    def _run(self) -> None:
        if self.conn.device.type == "cuda":
            torch.cuda.set_device(self.conn.device)
        while not self.dead:
            self.current = None
            try:
                if self.is_sender:
                    h = self._next_send()
                    if h is not None:
                        self._send(h)
                else:
                    self._receive_next()
            except Exception as e:  # noqa: BLE001 - every failure on the wire fails the pair
                why = f"{type(e).__name__}: {e}"
                h = self.current
                if h is not None:
                    if time.monotonic() >= h.deadline - 0.1:
                        why = f"timed out after {h.timeout_s:.1f} s ({why})"
                    h.fail(why, pair_lost=True)
                self.kill(why)
                return

    def _store(self, deadline: float) -> dist.PrefixStore:
        if self.ps is None:
            conn = self.conn
            # the receiver's thread polls through a client of its own (a store client is
            # not shared between threads)
            store = conn.client_store(self.peer_address, deadline) if self.is_sender else \
                dist.TCPStore(conn.host, conn.store.port, is_master=False, timeout=td(conn.default_timeout_s))
            sender = conn.name if self.is_sender else self.peer
            self.ps = dist.PrefixStore(f"pd/{sender}/{self.gen}", store)
        return self.ps

    def _connect(self, deadline: float) -> None:
        """Both ranks: the layouts checked, then the link chosen by the receiver (pull.accept): the
        sender's slab mapped here (same node), else the pair's process group."""
        conn = self.conn
        ps = self._store(deadline)
        ps.set(f"layout{self.rank}", conn.layout.to_json())
        other = f"layout{1 - self.rank}"
        ps.wait([other], td(deadline - time.monotonic()))
        conn.layout.check(WireLayout.from_json(ps.get(other)), self.peer)
        link = None
        if self.is_sender:
            ps.set("offer", offer(conn))
            ps.wait(["link"], td(deadline - time.monotonic()))
            choice = json.loads(ps.get("link"))
        else:
            ps.wait(["offer"], td(deadline - time.monotonic()))
            offered = ps.get("offer")
            self.peer_address = self.peer_address or json.loads(offered)["address"]  # for links()
            conn.peer_addresses[self.peer] = self.peer_address  # what a stalled receive probes
            choice, link = accept(conn, offered)
            ps.set("link", json.dumps(choice))
        self.why = choice["why"]
        if choice["link"] == "pull":
            self.link = link or PullLink(conn)
            if self.is_sender:
                self.link.ring_at(choice.get("bell"))
        else:
            self.link = C10dLink.connect(conn, self.rank, ps, deadline)

    def _next_send(self) -> Handoff | None:
        with self.cond:
            while not self.dead and not self.sends:
                self.cond.wait(0.05)
            while self.sends:
                h = self.sends.popleft()
                if not h.state.finished:  # aborted / overdue before its turn: never ordered, skip
                    h.state, h.t_started = TransferState.TRANSFERRING, time.monotonic()
                    self.current = h
                    return h
            return None

    def _send(self, h: Handoff) -> None:
        k = self.next_seq
        self.next_seq += 1
        order = {"rid": h.request_id, "nblocks": len(h.block_ids), "heads": h.heads,
                 "meta": None if h.meta is None else h.meta.to_wire()}
        if h.block_ids and self.link is None:
            self._connect(h.deadline)
        h.link = self.link.name if h.block_ids else None
        if isinstance(self.link, PullLink) and h.block_ids:
            self.link.send(self._store(h.deadline), h, k, order, lambda: self.dead)
            return
        self._store(h.deadline).set(f"order/{k}", json.dumps(order))
        self._move(h, k, h.block_ids)

    def _expecting(self) -> bool:
        now = time.monotonic()
        for rid in [r for r, t in self.orphans.items() if t < now]:
            del self.orphans[rid]
        return bool(self.recvs or self.orphans)

    def _receive_next(self) -> None:
        with self.cond:  # nothing posted: nothing can be ordered (the receiver posts first)
            while not self.dead and not self._expecting():
                self.cond.wait(0.05)
            if self.dead:
                return
        ps = self._store(time.monotonic() + self.conn.default_timeout_s)
        if self.link is None and ps.check(["layout0"]):  # the sender connects before its first order
            self._connect(time.monotonic() + self.conn.default_timeout_s)
        k = self.next_seq
        bell = self.link.bell if isinstance(self.link, PullLink) else None
        raw = take(ps, f"order/{k}", bell)
        if raw is None:  # the sender has not started its k-th send yet (~25 us a check)
            now = time.monotonic()
            if now >= self._dead_check_at:  # the sender retired this gen: no order will come
                self._dead_check_at = now + 0.05
                if ps.check(["dead"]):
                    raise RuntimeError(f"sender {self.peer} closed gen {self.gen}")
            if isinstance(self.link, PullLink):  # woken by the sender's doorbell, or polls
                self.link.wait_order(0.05 if self.link.bell is not None else 0.0005)
            else:
                with self.cond:
                    self.cond.wait(0.0005)
            return
        order = json.loads(raw)
        self.next_seq += 1
        with self.cond:
            self.orphans.pop(order["rid"], None)
            h = self.recvs.pop(order["rid"], None)
            if h is not None and not h.state.finished:
                h.state, h.t_started = TransferState.TRANSFERRING, time.monotonic()
                self.current = h
            else:
                h = None
        if h is None:  # aborted here: drain the message so the pair stays in step
            if order.get("src") is not None:  # pulled: nothing on a wire, just let the sender go
                post(ps, f"ack/{k}", "gone", bell)
            elif order["nblocks"]:
                drain = Handoff(order["rid"], self.peer, [], None, False, self.conn.default_timeout_s)
                wide = width(order.get("heads"))  # what the sender sends: a slice this wide, or whole blocks
                drain.heads = None if wide is None else (0, wide)
                self._move(drain, k, None, scratch=order["nblocks"])
            return
        if len(h.block_ids) != order["nblocks"]:
            raise ValueError(f"handoff {h.request_id}: the sender sends {order['nblocks']} blocks, "
                             f"{len(h.block_ids)} were reserved")
        if width(order.get("heads")) != width(h.heads):
            raise ValueError(f"handoff {h.request_id}: the sender sends KV heads {order.get('heads')}, "
                             f"this rank expects {h.heads}")
        h.meta = None if order["meta"] is None else HandoffMeta.from_wire(order["meta"])
        h.link = self.link.name if order["nblocks"] else None
        if order.get("src") is not None:
            self.link.receive(ps, h, k, order, self.peer)
            return
        self._move(h, k, h.block_ids)

    def _move(self, h: Handoff, k: int, block_ids: list[int] | None, scratch: int = 0) -> None:
        """The k-th message over the process group (wire.py); one with no blocks just ends."""
        if (scratch or block_ids) and self.link is None:
            self._connect(h.deadline)
        if isinstance(self.link, C10dLink):
            self.link.move(h, k, block_ids, scratch)
        elif not h.complete():  # no blocks: the order carried all there was (the meta)
            raise RuntimeError(f"handoff {h.request_id} finished after it was {h.state.name}")
