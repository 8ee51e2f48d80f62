"""The handoff between tensor-parallel workers of any sizes: rank to rank, head slices.

A worker of TP=N holds its KV heads split across its ranks (engine/base/tp.py: evenly, or one
head per rank replicated when the model has fewer KV heads than ranks). A handoff from a
prefill worker of TP=P to a decode worker of TP=D is a set of routes, one per (prefill
rank, decode rank) that share heads: each decode rank receives every head it holds from
exactly one prefill rank that holds it (a replicated head from the holder whose turn it
is, so replicas share the sending), and each route is an ordinary pairwise handoff of
that head slice (transfer/pair.py). Nothing is gathered onto one rank.

    routes(kv_heads, P, D) -> [Route(src, dst, src_heads, dst_heads)]

`TPConnector` is a worker's KVConnector over its ranks' own connectors: rank 0's in this
process, the others reached through `RankLink`s (the cluster's shard actors). A handoff
is DONE when every route is; the first route to fail fails it and aborts the rest. The
receiver learns the sender's TP from the caller (`peer_tp`), the sender the receiver's
from the target (`HandoffTarget.ranks`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdserve.engine.base.tp import kv_head_range

from .base import (
    Abort,
    Channel,
    Handoff,
    HandoffMeta,
    HandoffTarget,
    KVConnector,
    PairConnector,
    RankTarget,
    TransferState,
)


@dataclass(frozen=True)
class Route:
    src: int  # sender rank
    dst: int  # receiver rank
    src_heads: tuple[int, int]  # [lo, hi) of the sender rank's local heads
    dst_heads: tuple[int, int]  # the same heads, in the receiver rank's local numbering


def routes(kv_heads: int, src_tp: int, dst_tp: int) -> list[Route]:
    out = []
    for d in range(dst_tp):
        glo, ghi = kv_head_range(kv_heads, dst_tp, d)
        for h in range(glo, ghi):
            holders = [s for s in range(src_tp) if kv_head_range(kv_heads, src_tp, s)[0] <= h
                       < kv_head_range(kv_heads, src_tp, s)[1]]
            if not holders:
                raise ValueError(f"KV head {h} of {kv_heads} has no holder among {src_tp} sender ranks "
                                 f"(prefill TP={src_tp}, decode TP={dst_tp})")
            s = holders[d % len(holders)]
            slo = kv_head_range(kv_heads, src_tp, s)[0]
            last = out[-1] if out else None
            if last is not None and last.src == s and last.dst == d and last.dst_heads[1] == h - glo:
                out[-1] = Route(s, d, (last.src_heads[0], h - slo + 1), (last.dst_heads[0], h - glo + 1))
            else:
                out.append(Route(s, d, (h - slo, h - slo + 1), (h - glo, h - glo + 1)))
    return out


@dataclass
class RecvPart:
    """One route's receive on one rank: the KV heads `heads` of `block_ids` from the sender
    rank `peer`, on `channel`."""

    request_id: str  # the route's id (route_id)
    block_ids: list[int]
    heads: tuple[int, int] | None
    timeout_s: float | None
    peer: str
    channel: Channel
    wait_s: float | None = None  # for the sender's order (Handoff.wait_s)

    def start(self, conn: PairConnector) -> Handoff:
        return conn.start_recv(self.peer, self.request_id, self.block_ids, self.channel, self.timeout_s,
                               heads=self.heads, wait_s=self.wait_s)

    def for_wire(self) -> RecvPart:
        """What crosses to another process (a rank's actor): all of it."""
        return self


@dataclass
class SendPart:
    """One route's send on one rank: the KV heads `heads` of `block_ids` to `target`, with the
    handoff's meta (JSON) and, on rank 0, the CUDA event the blocks are ready at."""

    request_id: str
    block_ids: list[int]
    heads: tuple[int, int] | None
    timeout_s: float | None
    target: HandoffTarget
    meta: HandoffMeta | None = None
    ready: object = None

    def start(self, conn: PairConnector) -> Handoff:
        return conn.start_send(self.target, self.request_id, self.block_ids, self.timeout_s, self.ready, self.meta,
                               heads=self.heads)

    def for_wire(self) -> SendPart:
        """What crosses to another process: all but the CUDA event, which belongs to rank 0's
        stream (another rank's blocks are ready when its own step ends)."""
        return dataclasses.replace(self, ready=None)


Part = RecvPart | SendPart


class RankLink(ABC):
    """Rank r (>= 1) of this worker, as rank 0 reaches it: its connector's operations."""

    name: str
    address: str

    @abstractmethod
    def new_channels(self, peers: list[str]) -> list[Channel]: ...

    @abstractmethod
    def start(self, parts: list[Part]) -> None:
        """Starts these routes' handoffs on the rank (each part as `Part.for_wire()` gives it)."""

    @abstractmethod
    def finished(self) -> list[tuple[str, TransferState, str | None]]:
        """(request_id, state, error) of its handoffs that finished since last asked."""

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def forget_peer(self, peer: str, sends: bool = True) -> None: ...


class LocalRankLink(RankLink):
    """A rank whose connector lives in this process (tests; in-process ranks)."""

    def __init__(self, connector: PairConnector):
        self.connector, self.name, self.address = connector, connector.name, connector.address

    def new_channels(self, peers: list[str]) -> list[Channel]:
        return [self.connector.new_channel(p) for p in peers]

    def start(self, parts: list[Part]) -> None:
        for part in parts:
            part.start(self.connector)

    def finished(self) -> list[tuple[str, TransferState, str | None]]:
        return [(h.request_id, h.state, h.error) for h in self.connector.poll()]

    def abort(self, request_id: str) -> None:
        self.connector.abort(request_id)

    def forget_peer(self, peer: str, sends: bool = True) -> None:
        self.connector.forget_peer(peer, sends)


def rank_name(worker: str, rank: int) -> str:
    return worker if rank == 0 else f"{worker}#{rank}"


def route_id(request_id: str, r: Route, single: bool) -> str:
    """The id a route's handoff has on both of its ranks (a rank may take part in several
    routes of one request)."""
    return request_id if single else f"{request_id}#{r.src}.{r.dst}"


class TPConnector(KVConnector):
    def __init__(self, local: PairConnector, links: list[RankLink], kv_heads: int):
        self.local, self.links, self.kv_heads = local, links, kv_heads
        self.name, self.address, self.layout = local.name, local.address, local.layout
        self.size = 1 + len(links)
        self.peer_tp: dict[str, int] = {}  # sender worker -> its TP (the caller sets it)
        self._lock = threading.Lock()
        self._open: dict[str, _Composite] = {}
        self._route_of: dict[str, str] = {}  # route id -> request id

    def _addr(self, r: int) -> str:
        return self.local.address if r == 0 else self.links[r - 1].address

    # ---- receiver --------------------------------------------------------------------------------
    def receive(self, peer: str, request_id: str, block_ids: list[int], num_skip: int,
                timeout_s: float | None = None, wait_s: float | None = None) -> tuple[Handoff, HandoffTarget]:
        """Posts the receive of every route from `peer` (of TP peer_tp[peer]) on this
        worker's ranks; the target tells each sender rank where and on which channel."""
        rs = routes(self.kv_heads, self.peer_tp.get(peer, 1), self.size)
        single = len(rs) == 1
        comp = _Composite(request_id, peer, list(block_ids), Channel(0), False, timeout_s or 30.0, wait_s=wait_s)
        ranks = []
        for d in range(self.size):
            mine = [r for r in rs if r.dst == d]
            senders = [rank_name(peer, r.src) for r in mine]
            chans = [self.local.new_channel(p) for p in senders] if d == 0 else \
                (self.links[d - 1].new_channels(senders) if senders else [])
            ranks.append(RankTarget(rank_name(self.name, d), self._addr(d), {p: c.gen for p, c in zip(senders, chans)}))
            for r, c in zip(mine, chans):
                self._start_part(comp, r.dst, RecvPart(route_id(request_id, r, single), list(block_ids), r.dst_heads,
                                                       timeout_s, rank_name(peer, r.src), c, wait_s))
        self._track(comp)
        gen0 = next(iter(ranks[0].gens.values()), 0)
        return comp, HandoffTarget(self.name, self.address, Channel(gen0), num_skip, tuple(ranks))

    # ---- sender ------------------------------------------------------------------------------------
    def start_send(self, target: HandoffTarget, request_id: str, block_ids: list[int],
                   timeout_s: float | None = None, ready=None, meta: HandoffMeta | None = None,
                   heads=None) -> Handoff:
        ranks = target.ranks or (RankTarget(target.peer, target.address),)
        rs = routes(self.kv_heads, self.size, len(ranks))
        single = len(rs) == 1
        comp = _Composite(request_id, target.peer, list(block_ids), target.channel, True, timeout_s or 30.0,
                          meta=meta)
        for r in rs:
            dst = ranks[r.dst]
            gen = target.channel.gen if dst.gens is None else dst.gens[rank_name(self.name, r.src)]
            to = HandoffTarget(dst.name, dst.address, Channel(gen), target.num_skip)
            self._start_part(comp, r.src, SendPart(route_id(request_id, r, single), list(block_ids), r.src_heads,
                                                   timeout_s, to, meta, ready))
        self._track(comp)
        return comp

    # ---- both --------------------------------------------------------------------------------------
    def _start_part(self, comp: _Composite, rank: int, part: Part) -> None:
        rid = part.request_id
        comp.waiting.add(rid)
        with self._lock:
            self._route_of[rid] = comp.request_id
        if rank == 0:
            h = part.start(self.local)
            comp.local.append(h)
            if h.state == TransferState.FAILED:
                comp.settle(rid, TransferState.FAILED, h.error)
        else:
            self.links[rank - 1].start([part.for_wire()])

    def _track(self, comp: _Composite) -> None:
        with self._lock:
            if comp.request_id in self._open:
                raise ValueError(f"a handoff for request {comp.request_id!r} is already in flight")
            self._open[comp.request_id] = comp

    def poll(self) -> list[Handoff]:
        # (route, state, error, when it ended): this rank's routes carry their own end; another
        # rank's is known from the moment its link reports it
        finished = [(h.request_id, h.state, h.error, h.finished_at) for h in self.local.poll()]
        for link in self.links:
            finished += [(*f, None) for f in link.finished()]
        for route, state, error, ended in finished:
            with self._lock:
                rid = self._route_of.pop(route, None)
                comp = self._open.get(rid)
            if comp is not None:
                comp.settle(route, state, error, ended)
        done = []
        with self._lock:
            items = list(self._open.items())
        for rid, comp in items:
            if not comp.state.finished and comp.timed_out():
                comp.fail(f"timed out after {comp.timeout_s:.1f} s")
            if comp.state == TransferState.FAILED and comp.waiting:
                self._abort_parts(comp)
            if comp.state.finished:
                done.append(comp)
                with self._lock:
                    self._open.pop(rid, None)
        return done

    def _abort_parts(self, comp: _Composite) -> None:
        for route in list(comp.waiting):
            self.local.abort(route)
            for link in self.links:
                link.abort(route)
            with self._lock:
                self._route_of.pop(route, None)
        comp.waiting.clear()

    def abort(self, request_id: str, settle: bool = False) -> Abort:
        """With `settle`, a handoff whose routes all run on this rank lets a route on the wire
        finish (Abort.SETTLING: the composite ends "aborted" with its last route). Routes on
        other ranks are cut: their blocks are freed here, where no answer from them can wait."""
        with self._lock:
            comp = self._open.get(request_id)
        if comp is None or comp.state.finished:
            return Abort.NONE
        if settle and not self.links:
            wired = [r for r in list(comp.waiting) if self.local.abort(r, settle=True) is Abort.SETTLING]
            if wired:
                comp.cancelled = True
                comp.waiting = set(wired)
                return Abort.SETTLING
        if not comp.fail("aborted"):
            return Abort.NONE
        self._abort_parts(comp)
        return Abort.ENDED

    @property
    def num_pending(self) -> int:
        return len(self._open)

    def forget_peer(self, peer: str, sends: bool = True) -> None:
        self.local.forget_peer(peer, sends)
        for link in self.links:
            link.forget_peer(peer, sends)

    def peer_address(self, peer: str) -> str | None:
        return self.local.peer_address(peer)

    def close(self) -> None:
        self.local.close()


class _Composite(Handoff):
    """One request's handoff over its routes: DONE when all are, FAILED at the first failure
    (its other routes are aborted). The receiver's meta comes from a route of rank 0. Its
    `finished_at` is when its last route ended, not when a poll noticed it (the decode loop polls
    between steps: that wait is the handoff's pickup, not its transfer)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.waiting: set[str] = set()
        self.local: list[Handoff] = []
        self._last_end: float | None = None

    def timed_out(self) -> bool:
        """Past its routes' longest possible deadline (theirs come first: this covers a rank that
        never reports)."""
        wait = self.timeout_s if self.wait_s is None else self.wait_s
        return time.monotonic() > self.created + wait + self.timeout_s + 1.0

    def settle(self, route: str, state: TransferState, error: str | None, ended: float | None = None) -> None:
        """Route `route` ended in `state` at `ended` (monotonic; None: now). One no longer waited
        for (aborted, while another route settles) changes nothing."""
        if route not in self.waiting:
            return
        self.waiting.discard(route)
        ended = time.monotonic() if ended is None else ended
        self._last_end = ended if self._last_end is None else max(self._last_end, ended)
        if self.state.finished:
            return
        if state is not TransferState.DONE:
            # a route of this rank says whether its pair was lost; another rank's failure is taken
            # as one (closing a receiver's side of a live pair costs only a fresh group)
            lost = next((h.pair_lost for h in self.local if h.request_id == route), error != "aborted")
            self.fail(f"route {route}: {error}", pair_lost=lost)
            return
        if not self.is_sender:
            self.meta = next((h.meta for h in self.local if h.meta is not None), self.meta)
        if not self.waiting:
            self.nbytes = sum(h.nbytes for h in self.local)
            self.link = next((h.link for h in self.local if h.link), None)
            for h in self.local:
                for k in ("t_started", "t_first_post", "t_posted"):
                    if getattr(self, k) is None:
                        setattr(self, k, getattr(h, k))
            if self.complete():
                self.finished_at = self._last_end
