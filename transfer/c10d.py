"""KV handoff over pairwise torch.distributed process groups (NCCL on CUDA, gloo on CPU).

Pools grow and shrink, so there is no fixed world: each (sender, receiver) pair gets
its own 2-rank c10d group, built directly from a store (never init_process_group):

  rendezvous  every connector serves a TCPStore; a pair meets in its receiver's store
              under the prefix "pd/<sender>/<gen>" (sender = rank 0, receiver = rank 1)
  layout      both ranks publish their KV layout there first and refuse a mismatch
  group       ProcessGroupNCCL / ProcessGroupGloo over that PrefixStore
  ops         one thread per pair runs the pair's handoffs strictly in `seq` order:
              sender gathers the blocks into one staging buffer and sends one message,
              receiver receives into a staging buffer and scatters it into its blocks
  failure     any error, timeout or abort kills the pair: its group is aborted and set
              aside (never destroyed from a worker thread; NCCL may hang there), its
              queued handoffs fail, and the receiver moves the pair to a new `gen`, so
              the next handoff builds a fresh group. A dead peer surfaces as an error
              on the pending op (gloo) or as a timeout, and is handled the same way.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import torch
import torch.distributed as dist

from .base import (
    Channel,
    Handoff,
    KVConnector,
    TransferState,
    check_layouts,
    contiguous_run,
    gather_blocks,
    layout_of,
    scatter_blocks,
)

log = logging.getLogger(__name__)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class _Pair:
    """One (sender, receiver) process group and the thread that runs its handoffs."""

    def __init__(self, conn: C10dConnector, peer: str, peer_address: str, gen: int, is_sender: bool):
        self.conn, self.peer, self.peer_address = conn, peer, peer_address
        self.gen, self.is_sender = gen, is_sender
        self.rank = 0 if is_sender else 1
        self.ops: dict[int, Handoff] = {}
        self.next_seq = 0
        self.dead = False
        self.error: str | None = None
        self.pg = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"kv-pair-{peer}-{gen}", daemon=True)
        self.thread.start()

    # ---- called from the worker's thread --------------------------------------------------
    def submit(self, h: Handoff) -> None:
        with self.cond:
            if self.dead:
                h._finish(TransferState.FAILED, f"pair with {self.peer} is closed: {self.error}")
                return
            self.ops[h.channel.seq] = h
            self.cond.notify_all()

    def kill(self, reason: str) -> None:
        with self.cond:
            if self.dead:
                return
            self.dead, self.error = True, reason
            pending = list(self.ops.values())
            self.ops.clear()
            self.cond.notify_all()
        for h in pending:
            h._finish(TransferState.FAILED, reason)
        if self.is_sender:
            # tell the receiver, through its store, that this gen is dead: its next channel
            # for us moves to a new gen instead of meeting a group we no longer run
            self.conn._mark_dead(self.peer_address, self.gen)
        if self.pg is not None:
            if self.conn.device.type == "cuda":
                try:
                    self.pg.abort()  # unblocks NCCL kernels waiting on a dead peer
                except Exception:  # noqa: BLE001
                    pass
            self.conn._graveyard.append(self.pg)  # never destroyed here (see module doc)
        self.conn._pair_died(self)

    # ---- the pair's thread ------------------------------------------------------------------
    def _next(self) -> Handoff | None:
        with self.cond:
            while not self.dead and self.next_seq not in self.ops:
                self.cond.wait(0.05)
            return None if self.dead else self.ops.pop(self.next_seq)

    def _run(self) -> None:
        if self.conn.device.type == "cuda":
            torch.cuda.set_device(self.conn.device)
        while True:
            h = self._next()
            if h is None:
                return
            if not h.block_ids:  # an empty handoff (both sides skip it alike): keep the order
                self.next_seq += 1
                continue
            if h.state.finished:  # aborted or overdue before its turn: the peer may have posted
                self.kill(f"handoff {h.request_id} was {h.error or 'aborted'} before it ran")
                return
            try:
                if self.pg is None:
                    self.pg = self._connect(h.deadline)
                self._transfer(h)
            except Exception as e:  # noqa: BLE001 - every failure fails the handoff and the pair
                why = f"{type(e).__name__}: {e}"
                if time.monotonic() >= h.deadline - 0.1:  # e.g. the store wait ran into the deadline
                    why = f"timed out after {h.timeout_s:.1f} s ({why})"
                h._finish(TransferState.FAILED, why)
                self.kill(why)
                return
            self.next_seq += 1

    def _connect(self, deadline: float):
        conn = self.conn
        store = conn.store if not self.is_sender else conn._client_store(self.peer_address, deadline)
        sender = conn.name if self.is_sender else self.peer
        ps = dist.PrefixStore(f"pd/{sender}/{self.gen}", store)
        ps.set(f"layout{self.rank}", json.dumps(conn.layout))
        other = f"layout{1 - self.rank}"
        ps.wait([other], _td(deadline - time.monotonic()))
        check_layouts(conn.layout, json.loads(ps.get(other)), self.peer)
        timeout = _td(max(deadline - time.monotonic(), 1.0))
        if conn.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(ps, self.rank, 2, opts)
        return dist.ProcessGroupGloo(ps, self.rank, 2, timeout)

    def _transfer(self, h: Handoff) -> None:
        """Chunked so that gather of chunk i+1 overlaps the send of chunk i, and the
        scatter of chunk i overlaps the receive of chunk i+1 (a few large messages)."""
        conn = self.conn
        h.state = TransferState.TRANSFERRING
        h.t_started = time.monotonic()
        chunks = plan_chunks(len(h.block_ids), conn.block_bytes, min_chunk_bytes=conn.min_chunk_bytes)
        stream = conn.stream
        with torch.cuda.stream(stream) if stream is not None else _nullctx():
            if h._ready is not None:
                stream.wait_event(h._ready)  # the step that wrote these blocks
            posted = []
            for i, (lo, hi) in enumerate(chunks):
                tag = ((h.channel.seq << 6) + i) & 0x7FFFFFFF
                ids = h.block_ids[lo:hi]
                in_place = contiguous_run(ids)  # each side decides alone; the message is the same
                if in_place:
                    buf = conn.kv[ids[0]: ids[-1] + 1]
                elif self.is_sender:
                    buf = gather_blocks(conn.kv, ids)
                else:
                    buf = torch.empty((len(ids), *conn.kv.shape[1:]), dtype=conn.kv.dtype, device=conn.kv.device)
                work = self.pg.send([buf], 1, tag) if self.is_sender else self.pg.recv([buf], 0, tag)
                posted.append((work, buf, None if in_place else ids))
                h.nbytes += buf.numel() * buf.element_size()
            h.t_posted = time.monotonic()
            for work, buf, ids in posted:
                if stream is None:  # gloo: a host-blocking wait with the handoff's deadline
                    if not work.wait(_td(h.deadline - time.monotonic())):
                        raise TimeoutError(f"handoff {h.request_id} timed out after {h.timeout_s:.1f} s")
                else:
                    work.wait()  # NCCL: orders our stream after the op; the host does not block
                if not self.is_sender and ids is not None:
                    scatter_blocks(conn.kv, ids, buf)
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
                # poll, so that a dead peer cannot hang us past the deadline: spin for the
                # first 5 ms (a sleep costs ~0.1 ms of latency), then back off
                spin_until = time.monotonic() + 0.005
                while not done.query():
                    now = time.monotonic()
                    if now > h.deadline:
                        raise TimeoutError(f"handoff {h.request_id} timed out after {h.timeout_s:.1f} s")
                    time.sleep(0 if now < spin_until else 0.0002)
        if not h._finish(TransferState.DONE):
            # aborted or overdue while in flight: the data moved, but the owner gave up
            raise RuntimeError(f"handoff {h.request_id} finished after it was {h.state.name}")


def plan_chunks(num_blocks: int, block_bytes: int, max_chunks: int = 8, min_chunk_bytes: int = 64 << 20):
    """[lo, hi) block ranges: one message up to 128 MiB, then up to 8 of >= 64 MiB, so the
    gather/scatter of one chunk overlaps the transfer of the next. Measured on 2x H200
    (bench/results/transfer.md): 64 MiB / 8 chunks beat 256 MiB / 16 at every size."""
    total = num_blocks * block_bytes
    k = max(1, min(max_chunks, total // min_chunk_bytes, num_blocks))
    step = -(-num_blocks // k)
    return [(lo, min(lo + step, num_blocks)) for lo in range(0, num_blocks, step)]


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class C10dConnector(KVConnector):
    """One per worker. `kv` is the worker's block-major KV tensor (engine/kv_cache.py)."""

    def __init__(self, name: str, kv: torch.Tensor, host: str = "127.0.0.1", default_timeout_s: float = 30.0,
                 min_chunk_bytes: int = 64 << 20):
        self.name = name
        self.kv = kv
        self.device = kv.device
        self.layout = layout_of(kv)
        self.block_bytes = kv[0].numel() * kv.element_size()
        self.min_chunk_bytes = min_chunk_bytes
        self.layout["min_chunk_bytes"] = min_chunk_bytes  # both peers must chunk alike
        self.default_timeout_s = default_timeout_s
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_td(default_timeout_s))
        self.address = f"{host}:{self.store.port}"
        # high priority: the handoff's gather / NCCL / scatter kernels get SMs as soon as
        # blocks free up, instead of queueing behind the next prefill step's GEMM waves
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self._lock = threading.Lock()
        self._pairs: dict[tuple[str, bool], _Pair] = {}
        self._recv_gen: dict[str, int] = {}
        self._recv_seq: dict[str, int] = {}
        self._dead_send_gen: dict[str, int] = {}
        self._handoffs: dict[str, Handoff] = {}
        self._clients: dict[str, dist.TCPStore] = {}
        self._graveyard: list = []

    # ---- receiver side: channels ------------------------------------------------------------
    def new_channel(self, peer: str) -> Channel:
        gen = self._recv_gen.get(peer, 0)
        if self.store.check([f"pd/{peer}/{gen}/dead"]):  # the sender retired this pair's group
            with self._lock:
                pair = self._pairs.get((peer, False))
            if pair is not None and pair.gen == gen:
                pair.kill(f"sender {peer} closed gen {gen}")
            with self._lock:
                if self._recv_gen.get(peer, 0) == gen:
                    self._recv_gen[peer], self._recv_seq[peer] = gen + 1, 0
        with self._lock:
            gen = self._recv_gen.get(peer, 0)
            seq = self._recv_seq.get(peer, 0)
            self._recv_seq[peer] = seq + 1
            return Channel(gen, seq)

    def _mark_dead(self, peer_address: str, gen: int) -> None:
        store = self._clients.get(peer_address)
        if store is None:
            return
        try:
            store.set(f"pd/{self.name}/{gen}/dead", "1")
        except Exception:  # noqa: BLE001 - the receiver may be gone too
            pass

    def _pair_died(self, pair: _Pair) -> None:
        with self._lock:
            if pair.is_sender:
                self._dead_send_gen[pair.peer] = max(self._dead_send_gen.get(pair.peer, -1), pair.gen)
            if self._pairs.get((pair.peer, pair.is_sender)) is pair:
                del self._pairs[(pair.peer, pair.is_sender)]
            if not pair.is_sender and self._recv_gen.get(pair.peer, 0) == pair.gen:
                self._recv_gen[pair.peer] = pair.gen + 1
                self._recv_seq[pair.peer] = 0
        log.warning("kv pair %s<->%s gen %d closed: %s", self.name, pair.peer, pair.gen, pair.error)

    def _client_store(self, address: str, deadline: float) -> dist.TCPStore:
        store = self._clients.get(address)
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=_td(max(deadline - time.monotonic(), 1.0)))
            self._clients[address] = store
        return store

    def _pair(self, peer: str, peer_address: str, gen: int, is_sender: bool) -> _Pair | str:
        with self._lock:
            pair = self._pairs.get((peer, is_sender))
            if pair is not None and pair.gen == gen and not pair.dead:
                return pair
            if pair is not None and pair.gen > gen:
                return f"stale channel gen {gen} (pair with {peer} is at gen {pair.gen})"
            if is_sender and gen <= self._dead_send_gen.get(peer, -1):
                return f"stale channel gen {gen}: that pair with {peer} failed; the receiver moves to a new gen"
            old = pair
            pair = _Pair(self, peer, peer_address, gen, is_sender)
            self._pairs[(peer, is_sender)] = pair
        if old is not None:
            old.kill(f"replaced by gen {gen}")
        return pair

    # ---- the interface -------------------------------------------------------------------------
    def _start(self, is_sender: bool, peer: str, peer_address: str, request_id: str, block_ids: list[int],
               channel: Channel, timeout_s: float | None, ready=None) -> Handoff:
        h = Handoff(request_id, peer, list(block_ids), channel, is_sender, timeout_s or self.default_timeout_s)
        if is_sender and self.stream is not None:
            h._ready = ready
            if ready is None:
                h._ready = torch.cuda.Event()
                h._ready.record()  # on the caller's stream, after the step that wrote the blocks
        with self._lock:
            if request_id in self._handoffs:
                raise ValueError(f"a handoff for request {request_id!r} is already in flight")
            self._handoffs[request_id] = h
        pair = self._pair(peer, peer_address, channel.gen, is_sender)
        if not block_ids:  # everything was already on the receiver (prefix hits): nothing moves,
            h._finish(TransferState.DONE)  # but the pair's thread must still step over this seq,
            if not isinstance(pair, str):  # or every later handoff of the pair waits for it
                pair.submit(h)
            return h
        if isinstance(pair, str):
            h._finish(TransferState.FAILED, pair)
        else:
            pair.submit(h)
        return h

    def start_send(self, peer, peer_address, request_id, block_ids, channel, timeout_s=None, ready=None) -> Handoff:
        return self._start(True, peer, peer_address, request_id, block_ids, channel, timeout_s, ready)

    def start_recv(self, peer, peer_address, request_id, block_ids, channel, timeout_s=None) -> Handoff:
        return self._start(False, peer, "", request_id, block_ids, channel, timeout_s)

    def poll(self) -> list[Handoff]:
        now = time.monotonic()
        done = []
        with self._lock:
            items = list(self._handoffs.items())
        for rid, h in items:
            if not h.state.finished and now > h.deadline:
                h._finish(TransferState.FAILED, f"timed out after {h.timeout_s:.1f} s ({h.state.name} on pair)")
                self._kill_pair_of(h)
            if h.state.finished:
                done.append(h)
                with self._lock:
                    self._handoffs.pop(rid, None)
        return done

    def _kill_pair_of(self, h: Handoff) -> None:
        with self._lock:
            pair = self._pairs.get((h.peer, h.is_sender))
        if pair is not None and pair.gen == h.channel.gen:
            pair.kill(f"handoff {h.request_id}: {h.error}")

    def abort(self, request_id: str) -> bool:
        with self._lock:
            h = self._handoffs.get(request_id)
        if h is None or not h._finish(TransferState.FAILED, "aborted"):
            return False
        if h.block_ids:
            self._kill_pair_of(h)  # the peer's side of it may already be posted
        return True

    def forget_peer(self, peer: str) -> None:
        """The peer left the cluster: close both directions of its pair."""
        for key in [(peer, True), (peer, False)]:
            with self._lock:
                pair = self._pairs.get(key)
            if pair is not None:
                pair.kill(f"peer {peer} left")

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    def close(self) -> None:
        for key in list(self._pairs):
            pair = self._pairs.get(key)
            if pair is not None:
                pair.kill("connector closed")
