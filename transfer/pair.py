"""One (sender, receiver) pair of a C10dConnector: its 2-rank process group and the
thread that runs its handoffs, in an order the SENDER decides.

The receiver reserves blocks and posts its receive as soon as the request is placed,
long before the prompt is prefilled; prompts finish in any order. So the order of the
pair's messages is the order in which the sender's sends start, announced through the
receiver's store (the pair's PrefixStore "pd/<sender>/<gen>"):

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
import datetime
import json
import threading
import time
from typing import Protocol

import torch
import torch.distributed as dist

from .base import (
    Handoff,
    StagingPool,
    TransferState,
    block_index,
    check_layouts,
    contiguous_run,
    gather_blocks,
    scatter_blocks,
)


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def plan_chunks(num_blocks: int, block_bytes: int, chunk_bytes: int = 64 << 20):
    """[lo, hi) block ranges: one message up to 2 x chunk_bytes, else chunks of chunk_bytes,
    so that the gather/scatter of one chunk overlaps the transfer of the next and a staged
    chunk fits a slot of the connector's staging ring (2 x chunk_bytes each)."""
    if num_blocks == 0:
        return []
    if num_blocks * block_bytes <= 2 * chunk_bytes:
        return [(0, num_blocks)]
    step = max(1, chunk_bytes // block_bytes)
    return [(lo, min(num_blocks, lo + step)) for lo in range(0, num_blocks, step)]


def _width(heads) -> int | None:
    return None if heads is None else heads[1] - heads[0]


def _sliced(heads, num_heads: int) -> tuple[int, int] | None:
    """A head range that is less than all of this rank's heads, else None."""
    if heads is None or (heads[0] == 0 and heads[1] == num_heads):
        return None
    return tuple(heads)


def _index(ids: list[int], index, lo: int, hi: int, conn) -> torch.Tensor:
    return index[lo:hi] if index is not None else block_index(ids, conn.kv.device)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class PairHost(Protocol):
    """What a pair uses of the connector that owns it (c10d.C10dConnector): its KV slab and
    wire layout, its staging ring and side stream, its stores, and the calls that report a
    pair's end. Nothing else of the connector is read."""
    name: str
    host: str
    device: torch.device
    kv: torch.Tensor
    layout: dict
    block_bytes: int
    min_chunk_bytes: int
    default_timeout_s: float
    staging: StagingPool
    stream: torch.cuda.Stream | None
    store: dist.TCPStore
    graveyard: list  # aborted process groups, destroyed by the owner's thread, never a pair's

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
        self.pg = None
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

    def kill(self, reason: str) -> None:
        with self.cond:
            if self.dead:
                return
            self.dead, self.error = True, reason
            pending = list(self.sends) + list(self.recvs.values())
            self.sends.clear()
            self.recvs.clear()
            self.cond.notify_all()
        for h in pending:
            h.fail(reason)
        if self.is_sender:
            # tell the receiver, through its store, that this gen is dead: its next channel
            # for us moves to a new gen instead of meeting a group we no longer run
            self.conn.mark_dead(self.peer_address, self.gen)
        if self.pg is not None:
            if self.conn.device.type == "cuda":
                try:
                    self.pg.abort()  # unblocks NCCL kernels waiting on a dead peer
                except Exception:  # noqa: BLE001
                    pass
            self.conn.graveyard.append(self.pg)  # never destroyed here (see module doc)
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
                    h.fail(why)
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

    def _connect(self, deadline: float):
        conn = self.conn
        ps = self._store(deadline)
        ps.set(f"layout{self.rank}", json.dumps(conn.layout))
        other = f"layout{1 - self.rank}"
        ps.wait([other], td(deadline - time.monotonic()))
        check_layouts(conn.layout, json.loads(ps.get(other)), self.peer)
        timeout = td(max(deadline - time.monotonic(), 1.0))
        if conn.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(ps, self.rank, 2, opts)
        return dist.ProcessGroupGloo(ps, self.rank, 2, timeout)

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
        order = {"rid": h.request_id, "nblocks": len(h.block_ids), "meta": h.meta, "heads": h.heads}
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
        k = self.next_seq
        key = f"order/{k}"
        if not ps.check([key]):  # the sender has not started its k-th send yet (~25 us a check)
            now = time.monotonic()
            if now >= self._dead_check_at:  # the sender retired this gen: no order will come
                self._dead_check_at = now + 0.05
                if ps.check(["dead"]):
                    raise RuntimeError(f"sender {self.peer} closed gen {self.gen}")
            with self.cond:
                self.cond.wait(0.0005)
            return
        order = json.loads(ps.get(key))
        ps.delete_key(key)
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
            if order["nblocks"]:
                drain = Handoff(order["rid"], self.peer, [], None, False, self.conn.default_timeout_s)
                width = _width(order.get("heads"))  # what the sender sends: a slice this wide, or whole blocks
                drain.heads = None if width is None else (0, width)
                self._move(drain, k, None, scratch=order["nblocks"])
            return
        if len(h.block_ids) != order["nblocks"]:
            raise ValueError(f"handoff {h.request_id}: the sender sends {order['nblocks']} blocks, "
                             f"{len(h.block_ids)} were reserved")
        if _width(order.get("heads")) != _width(h.heads):
            raise ValueError(f"handoff {h.request_id}: the sender sends KV heads {order.get('heads')}, "
                             f"this rank expects {h.heads}")
        h.meta = order["meta"]
        self._move(h, k, h.block_ids)

    def _move(self, h: Handoff, k: int, block_ids: list[int] | None, scratch: int = 0) -> None:
        """Posts the k-th message's chunks and waits for them. A run of consecutive block ids
        goes from / into the KV tensor in place; other chunks are staged through a ring of
        two slots (on CUDA, preallocated: allocating under a full KV cache can force the
        caching allocator to free and synchronize the device, which cost the receiver
        ~20 ms a handoff on 2x H200). Stream order makes the ring safe: a slot is refilled
        only after the op that used it two chunks earlier."""
        conn = self.conn
        n = scratch or len(block_ids)
        if n and self.pg is None:
            self.pg = self._connect(h.deadline)
        stream = conn.stream
        ring = conn.staging.acquire() if n else None
        try:
            with torch.cuda.stream(stream) if stream is not None else _nullctx():
                if h._ready is not None:
                    stream.wait_event(h._ready)  # steps that wrote (sender) or may write (receiver) them
                posted: list = []
                # one index tensor for the whole message (one pinned copy; the chunks slice it):
                # the fewer calls this thread makes, the fewer times it waits for the GIL
                index = block_index(block_ids, conn.kv.device) if block_ids and not contiguous_run(block_ids) \
                    else None
                heads = _sliced(h.heads, conn.kv.shape[4])
                block_bytes = conn.block_bytes if heads is None else \
                    conn.block_bytes // conn.kv.shape[4] * (heads[1] - heads[0])
                for i, (lo, hi) in enumerate(plan_chunks(n, block_bytes, conn.min_chunk_bytes)):
                    ids = block_ids[lo:hi] if block_ids is not None else None
                    if heads is not None:  # a head slice (tensor parallel): always staged
                        buf, staged = self._head_slice(h, ring, i, ids, index, lo, hi, heads), False
                    elif ids is not None and contiguous_run(ids):  # each side decides alone
                        buf, staged = conn.kv[ids[0]: ids[-1] + 1], False
                    else:
                        if i >= 2 and posted[i - 2][1]:  # the slot's previous user must be done
                            self._wait(posted[i - 2], h, stream)
                        buf, staged = ring.slot(i % 2, hi - lo), True
                        if self.is_sender:
                            gather_blocks(conn.kv, index[lo:hi], out=buf)
                    tag = ((k << 6) + i) & 0x7FFFFFFF
                    work = self.pg.send([buf], 1, tag) if self.is_sender else self.pg.recv([buf], 0, tag)
                    posted.append([work, staged])
                    if i == 0:
                        h.t_first_post = time.monotonic()
                    if not self.is_sender and (staged or heads is not None):
                        self._wait(posted[-1], h, stream)
                        if ids is not None and heads is not None:
                            conn.kv[:, :, :, :, heads[0]:heads[1]].index_copy_(0, _index(ids, index, lo, hi, conn), buf)
                        elif ids is not None:
                            scatter_blocks(conn.kv, index[lo:hi], buf)
                    h.nbytes += buf.numel() * buf.element_size()
                h.t_posted = time.monotonic()
                for op in posted:
                    self._wait(op, h, stream)
                if stream is not None:
                    self._wait_stream(stream, h)
        finally:
            if ring is not None:
                conn.staging.release(ring)
        if scratch:
            return
        if not h.complete():
            # aborted or overdue while in flight: the data moved, but the owner gave up
            raise RuntimeError(f"handoff {h.request_id} finished after it was {h.state.name}")

    def _head_slice(self, h: Handoff, ring, i: int, ids, index, lo: int, hi: int, heads) -> torch.Tensor:
        """The buffer of a chunk that moves only KV heads [heads) of each block: the sender
        gathers the blocks and cuts the slice out; the receiver receives into a fresh one."""
        kv = self.conn.kv
        shape = (hi - lo, *kv.shape[1:4], heads[1] - heads[0], kv.shape[5])
        if not self.is_sender or ids is None:
            return torch.empty(shape, dtype=kv.dtype, device=kv.device)
        full = gather_blocks(kv, _index(ids, index, lo, hi, self.conn))
        return full[:, :, :, :, heads[0]:heads[1]].contiguous()

    @staticmethod
    def _wait(op: list, h: Handoff, stream) -> None:
        """op: [work, staged]; waits once (a gloo work waited twice blocks)."""
        work = op[0]
        if work is None:
            return
        if stream is None:  # gloo: a host-blocking wait with the handoff's deadline
            if not work.wait(td(h.deadline - time.monotonic())):
                raise TimeoutError(f"handoff {h.request_id} timed out after {h.timeout_s:.1f} s")
        else:
            work.wait()  # NCCL: orders our stream after the op; the host does not block
        op[0] = None

    @staticmethod
    def _wait_stream(stream, h: Handoff) -> None:
        """Polls, so that a dead peer cannot hang us past the deadline: spin for the first
        5 ms (a sleep costs ~0.1 ms of latency), then back off."""
        done = torch.cuda.Event()
        done.record(stream)
        spin_until = time.monotonic() + 0.005
        while not done.query():
            now = time.monotonic()
            if now > h.deadline:
                raise TimeoutError(f"handoff {h.request_id} timed out after {h.timeout_s:.1f} s")
            time.sleep(0 if now < spin_until else 0.0002)
