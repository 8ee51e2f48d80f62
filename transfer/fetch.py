"""Peer fetch: a prompt's prefix blocks copied from the worker whose GPU caches them, instead of
recomputed (docs/design/peer_fetch.md).

Placement decides (cluster/placement/routing.plan_fetch: the run's bytes over the link's measured
bandwidth against the placed worker's predicted recompute time) and hands the placed worker
`FetchPlan(holder, blocks, holder_tp)`. On the receiver, `PeerFetches` is one of the engine's KV
tiers (engine/tiers/tier.py: lookup, load, ready, forget), after the host tier. One fetch's way, by
side, over the pair's ordinary link (CUDA IPC / shared-memory pull, NCCL, gloo: the handoff's own
machinery, transfer/base.py):

    receiver  add(request, plan)     the engine's add_request; its tier lookup (lookup, load)
                                     takes the run of hashes past its own hits (GPU or host),
                                     fresh blocks for them, the receive posted; the request waits
                                     in the engine, outside the scheduler -> a Fetching event: the
                                     driver asks the holder to send (actor to actor)
    holder    serve(id, hashes, target)  pins the run on its GPU and sends it; False (refused) if
                                     it no longer holds all of it
    holder    take(): the send ended  the pins dropped
    receiver  take(): the receive ended, or refused()
                                     DONE: the blocks are cached under their hashes; FAILED: freed.
                                     Either way ready() hands the request to the scheduler, whose
                                     prefix lookup finds what landed: a failed fetch costs time,
                                     never an answer

A fetch's handoff id is `<request id>/fetch` on both workers. `take()` keeps the fetches'
handoffs from the role that polled the connector, so a role sees only its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pdserve.engine.core.request import Request
from pdserve.engine.role import Fetching
from pdserve.engine.stats import PeerTierStats

from .base import Handoff, HandoffTarget, KVConnector, TransferState

log = logging.getLogger(__name__)

SUFFIX = "/fetch"
TIMEOUT_S = 5.0  # a fetch is worth only what recomputing would take: never wait a handoff's 30 s


@dataclass(frozen=True)
class FetchPlan:
    """Placement's choice: fetch the prompt's first `blocks` blocks from `holder` (of TP `tp`)."""

    holder: str
    blocks: int
    tp: int = 1


@dataclass
class _Incoming:
    request: Request
    holder: str
    blocks: list  # the engine's Block objects reserved for the run
    hashes: list[bytes]
    started: float = field(default_factory=time.monotonic)


class PeerFetches:
    """One per worker, beside its role: both the receiver's side (the engine's peer tier, which it
    joins after the host tier when made) and the holder's."""

    name = "peer"
    waits = True  # a fetched run is waited for

    def __init__(self, engine, connector: KVConnector, timeout_s: float = TIMEOUT_S):
        self.engine, self.connector, self.timeout_s = engine, connector, timeout_s
        self.expected: dict[str, FetchPlan] = {}  # request id -> placement's plan, until the engine looks it up
        self.incoming: dict[str, _Incoming] = {}  # fetch id -> what waits for it here
        self.landed: list[Request] = []  # requests whose fetch ended, for ready()
        self.serving: dict[str, list] = {}  # fetch id -> the blocks pinned for its send
        self.gone: set[str] = set()  # fetch ids aborted here: their handoff's end is swallowed
        self.asks: list[Fetching] = []
        self.hit_tokens = 0  # prompt tokens whose KV came from a peer
        self.fetched_bytes = self.served_bytes = 0
        self.fetch_seconds = 0.0
        self.fetches = self.failed = 0
        self.gbps: float | None = None  # EWMA of landed fetches' bytes / (order to landing): what placement predicts by
        self.paired: set[str] = set()  # holders a fetch has landed from: the pair's link is connected

        engine.tiers.add(self, after="host")

    # ---- receiver: the engine's peer tier (engine/tiers/tier.py) -----------------------------------
    def add(self, request: Request, plan: FetchPlan | None) -> None:
        """The engine's add_request, with placement's fetch plan (if any) for its tier lookup: the
        run `plan.holder` holds and this worker does not is fetched before the request is
        scheduled. The plan lives only for this call."""
        if plan is not None:
            self.expected[request.request_id] = plan
        try:
            self.engine.add_request(request)
        finally:
            self.expected.pop(request.request_id, None)

    def lookup(self, hashes: list[bytes], request: Request | None = None) -> int:
        """The part of `hashes` (the prompt's run past this worker's GPU and host hits) that the
        request's planned holder holds; 0 without a plan."""
        plan = self.expected.get(request.request_id) if request is not None else None
        if plan is None or not hashes:
            return 0
        before = self.engine.kv.block_hashes(request).index(hashes[0])  # blocks cached here
        return max(0, min(plan.blocks - before, len(hashes)))

    def load(self, request: Request, run: list[bytes]) -> bool:
        """Posts the fetch of `run` into fresh blocks; True if the request now waits for it (ready()
        hands it to the scheduler once it ended), False if no blocks are free for it."""
        blocks = self.engine.kv.reserve_run(len(run))
        if not blocks:
            return False
        plan = self.expected[request.request_id]
        fid = request.request_id + SUFFIX
        if hasattr(self.connector, "peer_tp"):
            self.connector.peer_tp[plan.holder] = plan.tp
        _, target = self.connector.receive(plan.holder, fid, [b.block_id for b in blocks], 0, self.timeout_s)
        self.incoming[fid] = _Incoming(request, plan.holder, blocks, list(run))
        self.asks.append(Fetching(fid, plan.holder, [h.hex() for h in run], target))
        return True

    def refused(self, fetch_id: str, why: str) -> None:
        """The holder would not send (it no longer holds the run, or is gone): the receive fails
        now rather than at its deadline; take() then hands the request to the engine."""
        if fetch_id in self.incoming:
            log.info("%s: fetch %s refused: %s; recomputing", self.connector.name, fetch_id, why)
            self.connector.abort(fetch_id)  # its FAILED end comes through the next poll

    def _land(self, fetch_id: str, h: Handoff) -> Request:
        inc = self.incoming.pop(fetch_id)
        ok = h.state == TransferState.DONE
        self.engine.kv.publish_run(inc.blocks, inc.hashes if ok else None)
        took = time.monotonic() - inc.started
        self.fetches += 1
        self.fetch_seconds += took
        if ok:
            self.hit_tokens += len(inc.blocks) * self.engine.kv.block_size
            self.fetched_bytes += h.nbytes
            # the link's part: from the holder's order (it had pinned the run) to landing; the wait for
            # the holder's engine thread is placement's to predict (its step time), not the link's
            # (the first fetch from a holder also maps its KV in: not the link's speed, left out)
            moved = h.finished_at - h.t_started if h.t_started and h.finished_at else took
            rate = h.nbytes / max(moved, 1e-6) / 1e9
            if inc.holder in self.paired:
                self.gbps = rate if self.gbps is None else 0.7 * self.gbps + 0.3 * rate
            self.paired.add(inc.holder)
        else:
            self.failed += 1
        self.landed.append(inc.request)
        return inc.request

    def ready(self) -> list[Request]:
        """The requests whose fetch ended (landed or failed: the scheduler's lookup finds what came)."""
        out, self.landed = self.landed, []
        return out

    def wait(self, timeout: float = 0.05) -> None:
        """A fetch lands through the role's poll of the connector, on this same thread: a moment's
        pause, not a wait for the landing (the engine had nothing else to run)."""
        time.sleep(min(timeout, 0.001))

    def forget(self, request_id: str) -> None:
        """An aborted request still waiting for its fetch: the receive is aborted and its blocks
        freed; its handoff's end, whenever a poll returns it, is nobody's."""
        fid = request_id + SUFFIX
        inc = self.incoming.pop(fid, None)
        if inc is None:
            return
        self.connector.abort(fid)
        self.gone.add(fid)
        self.engine.kv.publish_run(inc.blocks, None)
        self.asks = [a for a in self.asks if a.request_id != fid]

    def store(self, block_hash: bytes, source: int) -> None:
        """Nothing: a peer's blocks are its own GPU's (it serves them; it never keeps a copy for us)."""

    def evict(self, block_hash: bytes) -> bool:
        return False

    def close(self) -> None:
        pass

    # ---- holder ------------------------------------------------------------------------------------
    def serve(self, fetch_id: str, hashes: list[str], target: HandoffTarget) -> bool:
        """Sends the GPU blocks of `hashes` (hex) to `target`; False if this worker no longer holds
        every one of them on its GPU (nothing is sent)."""
        kv, blocks = self.engine.kv, []
        try:
            if fetch_id in self.serving:
                raise ValueError("a fetch with this id is being served")
            blocks = kv.pin_run([bytes.fromhex(h) for h in hashes])
            if len(blocks) < len(hashes):
                raise LookupError(f"{len(blocks)} of {len(hashes)} blocks cached")
            self.connector.start_send(target, fetch_id, [b.block_id for b in blocks], self.timeout_s)
        except Exception as e:  # noqa: BLE001 - refused (never raised into the driver): the receiver recomputes
            log.info("%s: fetch %s refused: %s", self.connector.name, fetch_id, e)
            kv.unpin(blocks)
            return False
        self.serving[fetch_id] = blocks
        return True

    # ---- both ----------------------------------------------------------------------------------------
    def take(self, finished: list[Handoff]) -> list[Handoff]:
        """Ends the fetches among `finished` (a connector's poll()); returns the other handoffs."""
        rest = []
        for h in finished:
            rid = h.request_id
            if rid in self.serving:
                self.engine.kv.unpin(self.serving.pop(rid))
                self.served_bytes += h.nbytes if h.state == TransferState.DONE else 0
            elif rid in self.incoming:
                self._land(rid, h)
            elif rid in self.gone:
                self.gone.discard(rid)
            else:
                rest.append(h)
        return rest

    def events(self) -> list[Fetching]:
        asks, self.asks = self.asks, []
        return asks

    @property
    def busy(self) -> int:
        return len(self.incoming) + len(self.serving)

    def stats(self) -> PeerTierStats:
        return PeerTierStats(hit_tokens=self.hit_tokens, fetched_bytes=self.fetched_bytes,
                             served_bytes=self.served_bytes, fetches=self.fetches, failed=self.failed,
                             waiting=len(self.incoming), fetch_seconds=self.fetch_seconds / max(1, self.fetches),
                             fetch_gbps=self.gbps)
