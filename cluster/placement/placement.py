"""Placement: which workers serve one request attempt, from the pools' live state, the
block registry's cached prefixes and the pure rules of routing.py, and a check of its own
predictions against what happened.

    plan(hashes, ids, charges) -> Placement (decode alone, or prefill sending to decode); the
        prompt tokens it places are charged to the workers' queues until charges.settle()
        colocated    the engine with the prompt's cached prefix, else its consistent hash
        explicit     local rules (short prompt, mostly cached on a decode worker): d alone
        hybrid       routing.place_prompt: d prefills it (local) or p does and sends to d;
                     with no prefill worker at all, d prefills it (`no_prefill_worker`)
        otherwise    p by cached prefix / consistent hash, d by free KV blocks
    A pool with no worker to place on raises NoWorker (the router's 503 + Retry-After).

Links that are down: a handoff whose receiver's host stopped answering (HandoffResult.unreachable)
takes its (prefill, decode) pair out of placement. Every monitor pass the prefill worker probes the
receiver's KV address (Dispatcher.check_links): an answer takes the pair back at once (`link_up`), a
refusal keeps it out (`link_down`); with no verdict it is tried again after LINK_DOWN_S.
Disagg places on the pairs left, or answers 503 + Retry-After when none is; hybrid prefills on the
decode worker. /health names the pairs (`kv_links_down`) and says degraded.

Checking itself: each hybrid placement predicts the time to the first token on the worker it
picks; when the first token comes, `observe_first_token` keeps an EWMA of observed /
predicted per worker and divides that worker's advertised prefill rate by it at the next
placement; an error not observed again fades toward 1 (half-life 30 s), so a worker placement
stopped choosing is tried again (why: docs/design/placement.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.transfer.fetch import FetchPlan
from pdserve.transfer.records import LayoutMismatch

from ..api import NoWorker
from ..records import WorkerRecord
from ..registry.registry import PrefixRun, best_holder
from ..spec.cluster_spec import LocalRules
from .handoff_cost import LINK_GBPS_START, HandoffCost
from .pool_view import PoolView
from .routing import Holder, pick_decode, pick_prefill, place_prompt, plan_fetch

FLOOR_S = 0.05  # added to both sides of observed / predicted: a few ms of overhead is no error
ERROR_BOUNDS = (0.05, 1000.0)
HALF_LIFE_S = 30.0  # an error not observed again fades toward 1: a worker placement stopped using gets retried
LINK_DOWN_S = 10.0  # a pair whose receiver's host did not answer stays out of placement this long


@dataclass
class Placement:
    """Where one attempt runs: `decode` alone when `prefill` is None (it prefills the prompt
    itself), else `prefill` computes the prompt and sends its KV to `decode`. A hybrid placement
    says why (`explain`, the timeline's `placement` entry) and predicts its first token
    (`predicted`: the chosen worker and its TTFT, checked by Placer.observe_first_token)."""
    decode: WorkerRecord
    prefill: WorkerRecord | None = None
    explain: dict | None = None
    predicted: tuple[str, float | None] | None = None
    fetch: FetchPlan | None = None  # the worker that prefills fetches the prompt's prefix from a peer first

    @property
    def prefills_on(self) -> WorkerRecord:
        return self.decode if self.prefill is None else self.prefill

    @property
    def local(self) -> bool:
        return self.prefill is None


class Charges:
    """The prompt tokens one attempt has queued on workers (their `queued_tokens` and
    `queued_by_priority`, what placement predicts TTFT from), released by settle() at its first
    token or its end."""

    def __init__(self, priority: int = 0):
        self.priority = priority
        self._charged: list[tuple[WorkerRecord, int]] = []

    def charge(self, w: WorkerRecord, tokens: int) -> None:
        w.queued_tokens += tokens
        w.queued_by_priority[self.priority] += tokens
        self._charged.append((w, tokens))

    def settle(self) -> None:
        for w, n in self._charged:
            w.queued_tokens -= n
            w.queued_by_priority[self.priority] -= n
            if not w.queued_by_priority[self.priority]:
                del w.queued_by_priority[self.priority]
        self._charged = []


class Placer:
    def __init__(self, pools: PoolView, registry, block_size: int, local: LocalRules | None = None,
                 routing_counts: dict | None = None, clock=time.monotonic):
        """`clock`: the seconds its corrections fade and its links come back by (the capacity
        simulator passes its simulated time)."""
        self.pools, self.registry, self.block_size = pools, registry, block_size
        self.clock = clock
        self.handoff = HandoffCost()  # hybrid placement's cost of a handoff, per link, as measured
        self.local = local or LocalRules()
        self.routing = routing_counts if routing_counts is not None else {}
        self._error: dict[str, tuple[float, float]] = {}  # worker id -> (EWMA of observed / predicted, when)
        self._down: dict[tuple[str, str], float] = {}  # (prefill id, decode id) -> out of placement until

    def link_down(self, prefill: str, decode: str) -> None:
        """A handoff from `prefill` found `decode`'s host unreachable (or a probe of the pair's link
        did): the pair is out of placement for LINK_DOWN_S from now, or until `link_up`."""
        if (prefill, decode) not in self._down:
            self.count("link_down")
        self._down[(prefill, decode)] = self.clock() + LINK_DOWN_S

    def link_up(self, prefill: str, decode: str) -> None:
        """`decode`'s KV address answers from `prefill`'s host again: the pair is back now, not
        when its LINK_DOWN_S are up (a verdict taken in a partition's last second held a healed
        pair out for 10 s more)."""
        if self._down.pop((prefill, decode), None) is not None:
            self.count("link_up")

    def down_pairs(self) -> list[tuple[str, str]]:
        """The (prefill, decode) pairs out of placement now."""
        now = self.clock()
        return [pair for pair, until in self._down.items() if until > now]

    def links_down(self) -> dict[str, float]:
        """The pairs out of placement now: "prefill->decode" -> seconds left."""
        now = self.clock()
        for key in [k for k, until in self._down.items() if until <= now]:
            del self._down[key]
        return {f"{p}->{d}": round(until - now, 1) for (p, d), until in self._down.items()}

    def _linked(self, prefill: str, decode: str) -> bool:
        until = self._down.get((prefill, decode))
        return until is None or until <= self.clock()

    @property
    def slo(self):
        """The SLO placement serves: read from `serving.slo`, its one home, at every decision
        (POST /admin/slo replaces it there; a copy kept here went stale)."""
        return self.pools.serving.slo

    async def plan(self, hashes: list[str], ids: list[int], charges: Charges) -> Placement:
        """One registry call (the workers' runs of the prompt's hashes) serves both decisions; a
        registry that does not answer in time leaves both without prefix hints (`registry: no
        answer` in the timeline's `placement` entry)."""
        runs = await self.registry.runs(hashes) if hashes else {}
        late = runs is None
        placed = self._place(runs or {}, hashes, ids, charges)
        if late:  # no prefix hints: the timeline says why a prefix held elsewhere was not used
            placed.explain = {**(placed.explain or {}), "registry": "no answer"}
            return placed
        info = placed.prefills_on.info
        if runs and self.pools.serving.handoff.peer_fetch and info is not None and info.layout is not None:
            self._plan_fetch(placed, runs)
        return placed

    def _plan_fetch(self, placed: Placement, runs: dict[str, PrefixRun]) -> None:
        """A peer fetch for the worker that prefills, when a peer's GPU holds more of the prompt
        and fetching it is predicted faster (routing.plan_fetch); its decision, either way, goes
        into the timeline's `placement` entry."""
        w = placed.prefills_on
        own = runs[w.worker_id].tier if w.worker_id in runs else 0
        if max(r.gpu for r in runs.values()) <= own:
            return
        holders = {h: self._holder(w, self.pools.workers[h]) for h in runs
                   if h in self.pools.workers and self._same_kv(w, h)}
        d = plan_fetch(w.worker_id, {h: (r.gpu, r.tier) for h, r in runs.items()}, holders, self.block_size,
                       w.info.layout.block_bytes, w.stats.prefill_tok_s)
        if d is None:
            return
        placed.explain = {**(placed.explain or {}), **d.explain()}
        if not d.faster:
            return
        placed.fetch = FetchPlan(d.holder, d.blocks, self.pools.workers[d.holder].tp)
        self.count("peer_fetch")

    @staticmethod
    def _holder(w: WorkerRecord, h: WorkerRecord) -> Holder:
        """A fetch from `h` into `w`: the bandwidth `w`'s own fetches measured, else the start value
        of the link a pair on one node or across nodes takes; a busy holder answers between its steps
        (half its mean step on average)."""
        same = w.info is not None and h.info is not None and w.info.same_node(h.info)
        gbps = w.stats.kv_peer_fetch_gbps or LINK_GBPS_START["same_node" if same else "network"]
        return Holder(gbps, h.stats.step_s / 2 if h.load else 0.0)

    def _same_kv(self, w: WorkerRecord, other: str) -> bool:
        try:
            theirs = self.pools.workers[other].info
            w.info.layout.check(theirs.layout if theirs is not None else None, other)
            return True
        except LayoutMismatch:
            return False

    def _place(self, runs: dict[str, PrefixRun], hashes: list[str], ids: list[int], charges: Charges) -> Placement:
        try:
            if self.pools.mode == "colocated":
                w = self._pick_prefill(runs, hashes, ids, "decode")
                charges.charge(w, len(ids))
                return Placement(w)
            local, reason = self._local_decode(runs, hashes, ids)
            if local is not None:
                self.count(reason)
                charges.charge(local, len(ids))
                return Placement(local)
            if self.pools.mode == "hybrid":
                return self._hybrid(runs, hashes, ids, charges)
            decodes = self.pools.candidates("decode")
            p = self._pick_prefill(runs, hashes, ids, "prefill", decodes)
            d = self.pools.worker(pick_decode([c for c in decodes if self._linked(p.worker_id, c.worker_id)]))
            charges.charge(p, len(ids))
            return Placement(d, p)
        except NoWorker as e:
            e.retry_after_s = max(e.retry_after_s, self.pools.start_s)
            raise

    def _hybrid(self, runs: dict[str, PrefixRun], hashes: list[str], ids: list[int], charges: Charges) -> Placement:
        """The decode worker, and the prefill worker unless the decode worker prefills the prompt
        itself (routing.place_prompt, from live queues, corrected rates and cached prefixes)."""
        (ph, pd), (dh, dd) = best_holder(runs, "prefill"), best_holder(runs, "decode")
        decodes = self.pools.candidates("decode", charges.priority)
        for c in decodes:
            c.cached_tokens = dd * self.block_size if c.worker_id == dh else 0
        prefills = self.pools.candidates("prefill", charges.priority)
        if not prefills:  # the pool lost its workers: the decode workers prefill until it refills
            d = self.pools.worker(pick_decode(decodes))
            self.count("no_prefill_worker")
            charges.charge(d, len(ids) - next(c.cached_tokens for c in decodes if c.worker_id == d.worker_id))
            return Placement(d, explain={"local": True, "reason": "no_prefill_worker", "decode": d.worker_id})
        key = hashes[0] if hashes else str(ids[: self.block_size])
        pid, why = pick_prefill(prefills, key, (ph, pd))
        p = next(c for c in prefills if c.worker_id == pid)
        p.cached_tokens = pd * self.block_size if pid == ph else 0
        pool_rate = p.prefill_tok_s
        for c in (p, *decodes):  # what each worker's own predictions turned out to be worth
            base = c.prefill_tok_s or (pool_rate if c is not p else None)
            if base and c.worker_id in self._error:
                c.prefill_tok_s = base / self.error(c.worker_id)
        linked = [c for c in decodes if self._linked(pid, c.worker_id)]
        if not linked:  # no KV can go from that prefill worker to a decode worker: they prefill
            d = self.pools.worker(pick_decode(decodes))
            self.count("link_down_local")
            charges.charge(d, len(ids) - next(c.cached_tokens for c in decodes if c.worker_id == d.worker_id))
            return Placement(d, explain={"local": True, "reason": "link_down", "decode": d.worker_id})
        recv = next(c for c in linked if c.worker_id == pick_decode(linked))  # place_prompt's receiver
        handoff_s = self.handoff.predict(self.pools.worker(pid), self.pools.worker(recv.worker_id),
                                         len(ids) - recv.cached_tokens, self.block_size)
        pl = place_prompt(len(ids), p, linked, self.slo.ttft_s, self.slo.spill_at, handoff_s)
        self.count(pl.reason)
        chosen = pl.decode if pl.local else pid
        placed = Placement(self.pools.worker(pl.decode),
                           explain={**pl.explain(), "prefill": pid, "handoff_s": round(handoff_s, 4)},
                           predicted=(chosen, pl.ttft_local_s if pl.local else pl.ttft_pool_s))
        if chosen in self._error:
            placed.explain["correction"] = round(self.error(chosen), 3)
        if pl.local:
            charges.charge(placed.decode, len(ids) - next(c.cached_tokens for c in decodes
                                                          if c.worker_id == pl.decode))
            return placed
        self.count(why)
        placed.prefill = self.pools.worker(pid)
        charges.charge(placed.prefill, len(ids) - p.cached_tokens)
        return placed

    def observe_first_token(self, predicted: tuple[str, float | None] | None, seconds: float) -> None:
        """A placed prompt's first token came after `seconds`: fold observed / predicted into
        the chosen worker's error (EWMA, bounded)."""
        if predicted is None or predicted[1] is None:
            return
        wid, want = predicted
        ratio = min(max((seconds + FLOOR_S) / (want + FLOOR_S), ERROR_BOUNDS[0]), ERROR_BOUNDS[1])
        self._error[wid] = (0.7 * self.error(wid) + 0.3 * ratio, self.clock())
        if len(self._error) > 4 * max(len(self.pools.workers), 1):  # workers that left
            for gone in [w for w in self._error if w not in self.pools.workers]:
                del self._error[gone]

    def error(self, worker_id: str) -> float:
        """Observed / predicted TTFT of the worker's placements (1: exact), fading toward 1."""
        value, at = self._error.get(worker_id, (1.0, 0.0))
        return 1.0 + (value - 1.0) * 0.5 ** ((self.clock() - at) / HALF_LIFE_S)

    def observe_handoff(self, seconds: float) -> None:
        """A handed-off request's kv_to_first_token phase (send start -> first token here)."""
        self.handoff.observe_first_token(seconds)

    def observe_transfer(self, prefill: str, decode: str, nbytes: int, seconds: float | None) -> None:
        """A finished handoff's bytes and seconds on its (prefill, decode) link (HandoffCost)."""
        self.handoff.observe_transfer(prefill, decode, nbytes, seconds)
        if len(self.handoff.links()) > 4 * max(len(self.pools.workers), 1) ** 2:  # workers that left
            self.handoff.forget(set(self.pools.workers))

    def _pick_prefill(self, runs: dict[str, PrefixRun], hashes: list[str], ids: list[int],
                      role: str, decodes: list | None = None) -> WorkerRecord:
        """The worker to run this prompt's prefill: of the prefill pool, or (colocated mode)
        of the decode pool: longest cached prefix, else consistent hash, bounded load. With
        `decodes`: only a prefill worker whose link to one of them is up (none: NoWorker, 503)."""
        key = hashes[0] if hashes else str(ids[: self.block_size])
        cands = self.pools.candidates(role)
        if decodes is not None and cands and decodes:
            cands = [c for c in cands if any(self._linked(c.worker_id, d.worker_id) for d in decodes)]
            if not cands:
                raise NoWorker("decode", LINK_DOWN_S, "no decode worker is reachable from a prefill worker "
                               f"(KV links down: {', '.join(self.links_down())}): retry shortly")
        wid, reason = pick_prefill(cands, key, best_holder(runs, role), role=role)
        self.count(reason)
        return self.pools.worker(wid)

    def _local_decode(self, runs: dict[str, PrefixRun], hashes: list[str],
                      ids: list[int]) -> tuple[WorkerRecord | None, str]:
        """Conditional disaggregation: the decode worker to prefill on, if any."""
        rules = self.local
        if len(ids) <= rules.prefill_tokens:
            return self.pools.worker(pick_decode(self.pools.candidates("decode"))), "local_short"
        if hashes and rules.cached_fraction <= 1.0 and \
                rules.cached_fraction * len(ids) <= len(hashes) * self.block_size:
            holder, depth = best_holder(runs, "decode")
            w = self.pools.workers.get(holder)
            if w is not None and not w.draining and depth * self.block_size >= rules.cached_fraction * len(ids):
                return w, "local_cached"
        return None, ""

    def count(self, reason: str) -> None:
        self.routing[reason] = self.routing.get(reason, 0) + 1
