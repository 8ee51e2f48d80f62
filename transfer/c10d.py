"""KV handoff over pairwise torch.distributed process groups (NCCL on CUDA, gloo on CPU).

Pools grow and shrink, so there is no fixed world: each (sender, receiver) pair gets
its own 2-rank c10d group, built directly from a store (never init_process_group):

  rendezvous  every connector serves a TCPStore; a pair meets in its receiver's store
              under the prefix "pd/<sender>/<gen>" (sender = rank 0, receiver = rank 1)
  layout      both ranks publish their KV layout there first and refuse a mismatch
  order       the sender decides the order of the pair's messages (the order its sends
              start) and announces each, with its small JSON meta (the first token), in
              that store; the receiver follows (pair.py)
  group       ProcessGroupNCCL / ProcessGroupGloo over that PrefixStore, one thread per
              pair: sender gathers the blocks into one staging buffer and sends a few
              large messages; receiver receives and scatters them into its blocks
  failure     an error, timeout or abort of a handoff on the wire kills the pair: its
              group is aborted and set aside, its queued handoffs fail, and the receiver
              moves the pair to a new `gen`, so the next handoff builds a fresh group. The
              sender marks the gen dead in the receiver's store; the receiver's pair thread
              sees the mark while it waits for orders and fails the receives posted on that
              gen at once (a channel handed out just before the sender retired it would
              otherwise wait out its deadline). A handoff aborted or overdue before it
              reached the wire is just dropped. A dead peer surfaces as an error on the
              pending op (gloo) or as a timeout.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.distributed as dist

from pdserve.engine.base.stores import BoundStore

from .base import Abort, Channel, Handoff, HandoffMeta, HandoffTarget, PairConnector, StagingPool
from .pair import Pair
from .probe import PROBE_S, STALL_S, answers
from .records import PairLink, WireLayout
from .wire import td

log = logging.getLogger(__name__)



class C10dConnector(PairConnector):
    """One per worker. `kv` is the worker's block-major KV tensor (engine/exec/kv_cache.py)."""

    def __init__(self, name: str, kv: torch.Tensor, host: str = "127.0.0.1", default_timeout_s: float = 30.0,
                 min_chunk_bytes: int = 64 << 20, tp: int = 1, kv_heads_total: int | None = None,
                 kv_cache_dtype: str = "auto", same_node: bool = True):
        self.name = name
        # a pair whose peer runs on this host and whose KV maps here pulls it (pull.py)
        self.same_node = same_node
        self.kv = kv
        self.device = kv.device
        # both peers must also chunk alike; tensor-parallel ranks may hold different head counts
        self.layout = WireLayout.of(kv, min_chunk_bytes, tp, kv_heads_total, kv_cache_dtype)
        self.block_bytes = kv[0].numel() * kv.element_size()
        self.min_chunk_bytes = min_chunk_bytes
        self.staging = StagingPool(kv, min_chunk_bytes)
        self.default_timeout_s = default_timeout_s
        self.host = host
        # peers reach it at `host`, and only there (engine/base/stores.py)
        self.bound = BoundStore(host, default_timeout_s)
        self.store, self.address = self.bound.store, self.bound.address
        # high priority: the handoff's gather / NCCL / scatter kernels get SMs as soon as
        # blocks free up, instead of queueing behind the next prefill step's GEMM waves
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self._lock = threading.Lock()
        self._pairs: dict[tuple[str, bool], Pair] = {}
        self._recv_gen: dict[str, int] = {}
        self._dead_send_gen: dict[str, int] = {}
        self._handoffs: dict[str, Handoff] = {}
        self._clients: dict[str, dist.TCPStore] = {}
        self.graveyard: list = []  # aborted process groups (never destroyed from a worker thread)
        self._watchdog: threading.Thread | None = None  # started with the first pair (watch())
        self.peer_addresses: dict[str, str] = {}  # peer -> its store's address, set by its pairs' connects
        self._closed = False

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
                    self._recv_gen[peer] = gen + 1
        with self._lock:
            return Channel(self._recv_gen.get(peer, 0))

    # ---- called by pairs ------------------------------------------------------------------------
    def mark_dead(self, peer_address: str, gen: int, connect: bool = False) -> None:
        """Marks this sender's `gen` dead in the receiver's store. `connect`: reach a receiver this
        connector never talked to (it is alive: it just gave us a target); a dying pair only
        tells one it reached (a store client to a gone receiver would wait out its timeout)."""
        try:
            store = self._clients.get(peer_address) or \
                (self.client_store(peer_address, time.monotonic() + 5) if connect else None)
            if store is not None:
                store.set(f"pd/{self.name}/{gen}/dead", "1")
        except Exception:  # noqa: BLE001 - the receiver may be gone too
            pass

    def pair_died(self, pair: Pair) -> None:
        with self._lock:
            if pair.is_sender:
                self._dead_send_gen[pair.peer] = max(self._dead_send_gen.get(pair.peer, -1), pair.gen)
            if self._pairs.get((pair.peer, pair.is_sender)) is pair:
                del self._pairs[(pair.peer, pair.is_sender)]
            if not pair.is_sender and self._recv_gen.get(pair.peer, 0) == pair.gen:
                self._recv_gen[pair.peer] = pair.gen + 1
        log.warning("kv pair %s<->%s gen %d closed: %s", self.name, pair.peer, pair.gen, pair.error)

    def client_store(self, address: str, deadline: float) -> dist.TCPStore:
        store = self._clients.get(address)
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=td(max(deadline - time.monotonic(), 1.0)))
            self._clients[address] = store
        return store

    def _pair(self, peer: str, peer_address: str, gen: int, is_sender: bool) -> Pair | str:
        with self._lock:
            pair = self._pairs.get((peer, is_sender))
            if pair is not None and pair.gen == gen and not pair.dead:
                return pair
            if pair is not None and pair.gen > gen:
                return f"stale channel gen {gen} (pair with {peer} is at gen {pair.gen})"
            if is_sender and gen <= self._dead_send_gen.get(peer, -1):
                return f"stale channel gen {gen}: that pair with {peer} failed; the receiver moves to a new gen"
            old = pair
            pair = Pair(self, peer, peer_address, gen, is_sender)
            self._pairs[(peer, is_sender)] = pair
            if is_sender and self._watchdog is None:
                self._watchdog = threading.Thread(target=self.watch, name=f"kv-watch-{self.name}", daemon=True)
                self._watchdog.start()
        if old is not None:
            old.kill(f"replaced by gen {gen}")
        return pair

    # ---- the interface -------------------------------------------------------------------------
    def _start(self, is_sender: bool, peer: str, peer_address: str, request_id: str, block_ids: list[int],
               channel: Channel, timeout_s: float | None, ready=None, meta: HandoffMeta | None = None,
               heads=None, wait_s: float | None = None) -> Handoff:
        h = Handoff(request_id, peer, list(block_ids), channel, is_sender, timeout_s or self.default_timeout_s,
                    meta=meta, heads=None if heads is None else tuple(heads), wait_s=wait_s)
        if self.stream is not None:
            # on the caller's stream: a sender's blocks are written by the steps before it; a
            # receiver's blocks may still be written by the step in flight (a request that ended
            # while its next step was queued, engine/core/overlap.py, left them free under it)
            h._ready = ready
            if ready is None:
                h._ready = torch.cuda.Event()
                h._ready.record()
        with self._lock:
            if request_id in self._handoffs:
                raise ValueError(f"a handoff for request {request_id!r} is already in flight")
            self._handoffs[request_id] = h
        pair = self._pair(peer, peer_address, channel.gen, is_sender)
        if isinstance(pair, str):
            h.fail(pair, pair_lost=True)
            if is_sender:  # a channel of a gen we retired: say so again, so that the receive
                self.mark_dead(peer_address, channel.gen, connect=True)  # fails now and the next channel moves on
        else:
            pair.submit(h)
        return h

    def start_send(self, target: HandoffTarget, request_id: str, block_ids: list[int],
                   timeout_s: float | None = None, ready=None, meta: HandoffMeta | None = None,
                   heads=None) -> Handoff:
        return self._start(True, target.peer, target.address, request_id, block_ids, target.channel, timeout_s,
                           ready, meta, heads)

    def start_recv(self, peer: str, request_id: str, block_ids: list[int], channel: Channel,
                   timeout_s: float | None = None, heads=None, wait_s: float | None = None) -> Handoff:
        return self._start(False, peer, "", request_id, block_ids, channel, timeout_s, heads=heads, wait_s=wait_s)

    def poll(self) -> list[Handoff]:
        now = time.monotonic()
        done = []
        with self._lock:
            items = list(self._handoffs.items())
        for rid, h in items:
            if not h.state.finished and now > h.deadline:
                state = h.state.name
                if h.fail(f"timed out after {h.timeout_s:.1f} s ({state} on pair)"):
                    self._drop(h)
            if h.state.finished:
                done.append(h)
                with self._lock:
                    self._handoffs.pop(rid, None)
        return done

    def _drop(self, h: Handoff) -> None:
        """A handoff given up on: forgotten if it never reached the wire, else its pair dies."""
        with self._lock:
            pair = self._pairs.get((h.peer, h.is_sender))
        if pair is not None and pair.gen == h.channel.gen and not pair.forget(h):
            pair.kill(f"handoff {h.request_id}: {h.error}")

    def abort(self, request_id: str, settle: bool = False) -> Abort:
        with self._lock:
            h = self._handoffs.get(request_id)
            pair = None if h is None else self._pairs.get((h.peer, h.is_sender))
        if h is None or h.state.finished:
            return Abort.NONE
        if settle and pair is not None and pair.gen == h.channel.gen and not pair.forget(h):
            # on the wire: let its messages finish (a pair cut here fails every handoff queued
            # on it, and a retry of those meets a new group); complete() then ends it "aborted"
            h.cancelled = True  # (if it ended just now, poll() returns it all the same)
            return Abort.SETTLING
        if not h.fail("aborted"):
            return Abort.NONE
        self._drop(h)
        return Abort.ENDED

    def forget_peer(self, peer: str, sends: bool = True) -> None:
        """Closes the pairs with `peer` (with each of its ranks, "<peer>#<r>", when it is
        tensor-parallel): those receiving from it, and with `sends` those sending to it. A
        receiving pair's end moves the peer to a new gen (pair_died)."""
        with self._lock:
            pairs = [p for (name, is_sender), p in self._pairs.items()
                     if (name == peer or name.startswith(f"{peer}#")) and (sends or not is_sender)]
        for pair in pairs:
            pair.kill(f"peer {peer} left")

    @property
    def num_pending(self) -> int:
        return len(self._handoffs)

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    def links(self) -> list[PairLink]:
        """Each connected pair's link (what it is, why, both ends' addresses)."""
        with self._lock:
            pairs = list(self._pairs.values())
        return [PairLink(p.peer, "send" if p.is_sender else "recv", p.link.name, p.why, p.gen, self.address,
                         p.peer_address, getattr(p.link, "liveness", None)) for p in pairs if p.link is not None]

    def peer_address(self, peer: str) -> str | None:
        return self.peer_addresses.get(peer)

    def watch(self, every_s: float = 0.5) -> None:
        """The watchdog's loop (one thread, from the first send): a send on the wire past STALL_S
        whose receiver's host does not answer a connect in PROBE_S fails with its pair, marked
        `unreachable` (transfer/probe.py). A pair is probed at most once per STALL_S."""
        probed: dict[int, float] = {}
        while not self._closed:
            time.sleep(every_s)
            now = time.monotonic()
            with self._lock:
                pairs = [p for p in self._pairs.values() if p.is_sender and not p.dead]
            for pair in pairs:
                h = pair.current
                if h is None or h.t_started is None or now - h.t_started < STALL_S or h.state.finished:
                    continue
                if now - probed.get(id(pair), 0.0) < STALL_S or not pair.peer_address:
                    continue
                probed[id(pair)] = now
                if not answers(pair.peer_address):
                    why = f"peer {pair.peer} at {pair.peer_address} unreachable (no TCP answer in {PROBE_S:.0f} s)"
                    log.warning("kv pair %s->%s gen %d: %s", self.name, pair.peer, pair.gen, why)
                    pair.kill(why, unreachable=True)
            if len(probed) > 4 * max(len(pairs), 1):
                probed.clear()

    def close(self) -> None:
        self._closed = True
        for key in list(self._pairs):
            pair = self._pairs.get(key)
            if pair is not None:
                pair.kill("connector closed")
