"""A pdserve cluster in simulated time (discrete events, CPU), driven by profiles.

What decides is the live cluster's own code, not a copy of it:

    placement    cluster/placement/placement.Placer over a PoolView of simulated workers (placement/pool_view.py):
                 prefix hits, the consistent hash with bounded load, free KV, hybrid's predicted TTFTs
                 (routing.place_prompt) and its own correction of them (observe_first_token)
    registry     the workers' prefix runs, read from each simulated engine's own prefix cache at the
                 moment of placement (the live registry lags by a heartbeat; that lag is not modelled)
    engines      engine/core's Scheduler, KVCacheManager and StepModel (engine.py), each step's
                 seconds predicted by the profile's fit
    handoff      the decode worker reserves the prompt's blocks at placement (or waits for free ones);
                 the prefill worker's KV goes when both its prompt is done and the reservation is made,
                 taking the profile's link time for the blocks the receiver lacks; the first token
                 arrives with it
    stats        each worker's WorkerStats (placement_stats) refreshed every STATS_S, as the live
                 workers' heartbeats refresh them

The ratio autoscale policy moves workers between the pools in `disagg:P:D:adaptive` and
`hybrid:P:D:adaptive` (adaptive.py).
Not modelled: failures and retries, the signals autoscaler adding workers, peer fetch, network
contention between handoffs, the host tiers. One `Simulation` serves one rate of one workload;
`run()` gives the bench client's records (pdserve.bench.client.Record), summarised by the bench's
own report.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pdserve.bench.client import Record
from pdserve.bench.workloads import BenchRequest
from pdserve.cluster.api import NoWorker
from pdserve.cluster.placement.placement import Charges, Placer
from pdserve.cluster.placement.pool_view import PoolView
from pdserve.cluster.registry.registry import PrefixRun
from pdserve.cluster.spec.engine_specs import PREFILL_CHUNK_TOKENS
from pdserve.cluster.spec.serving_config import ServingConfig, SloConfig
from pdserve.engine.base.hashing import hash_block_tokens
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import SamplingParams

from .adaptive import Mover
from .engine import SimEngine, SimGpu
from .profile import Profile

STATS_S = 1.0  # how often a worker's stats reach placement (the live heartbeat's interval)
COLOCATED_CHUNK = 2048  # an engine's default step budget with chunked prefill (EngineConfig)


@dataclass(frozen=True)
class Layout:
    """A cluster to simulate: `mode` (colocated, disagg, hybrid), the pools' sizes, and whether
    every worker shares one GPU (the one-GPU runs: two workers at `share` of its memory each)."""

    mode: str
    prefill: int = 0
    decode: int = 1
    one_gpu: bool = False
    share: float = 0.85  # gpu_memory_utilization of each worker
    prefill_chunk: int = PREFILL_CHUNK_TOKENS
    max_num_seqs: int = 128
    max_model_len: int = 8704
    adaptive: bool = False  # disagg, hybrid: the ratio policy moves workers between the pools (adaptive.py)

    @classmethod
    def of(cls, system: str, one_gpu: bool = False) -> Layout:
        """From a serving run's system name: colocated:N, disagg:P:D, hybrid:P:D; disagg:P:D:adaptive
        (or hybrid:P:D:adaptive) starts at P:D and lets the ratio policy move workers."""
        kind, *sizes = system.split(":")
        adaptive = "adaptive" in sizes
        sizes = [int(x) for x in sizes if x.isdigit()]
        share = 0.42 if one_gpu else 0.85
        if adaptive and (kind == "colocated" or one_gpu):
            raise ValueError(f"{system!r}: the ratio policy moves the workers of a disagg or hybrid cluster of one "
                             "GPU each")
        if kind == "colocated":
            return cls("colocated", 0, sizes[0] if sizes else 2, one_gpu, share)
        if kind in ("disagg", "hybrid"):
            p, d = (sizes + [1, 1])[:2]
            return cls(kind, p, d, one_gpu, share, adaptive=adaptive)
        raise ValueError(f"unknown system {system!r}: colocated:N | disagg:P:D | hybrid:P:D")

    @property
    def gpus(self) -> int:
        return 1 if self.one_gpu else self.prefill + self.decode

    def describe(self) -> str:
        pools = f"{self.decode}" if self.mode == "colocated" else f"{self.prefill}:{self.decode}"
        return f"{self.mode}:{pools}" + (" on one GPU" if self.one_gpu else "") + (" adaptive" if self.adaptive else "")


@dataclass(frozen=True)
class _Spec:
    """What PoolView reads of a pool's engine spec: its scheduling policy (fcfs here) and batch size."""

    max_num_seqs: int
    block_size: int
    scheduling_policy: str = "fcfs"


class _Specs:
    def __init__(self, spec: _Spec):
        self.decode = spec

    def get(self, role: str) -> _Spec:
        return self.decode


class SimPools(PoolView):
    def __init__(self, mode: str, serving: ServingConfig, spec: _Spec):
        self.mode, self.serving, self.specs = mode, serving, _Specs(spec)
        self.workers = {}


class _Registry:
    """The registry's answer to placement: per worker, its run of the prompt's hashes on its GPU
    (read from its engine's prefix cache now)."""

    def __init__(self, engines: dict[str, SimEngine]):
        self.engines = engines

    async def runs(self, hashes: list[str]) -> dict[str, PrefixRun]:
        raw = [bytes.fromhex(h) for h in hashes]
        out = {}
        for wid, e in self.engines.items():
            n = e.kv.gpu_run(raw)
            if n:
                out[wid] = PrefixRun(e.record.role, n, n, float(n))
        return out


def _now(coro):
    """Runs a coroutine that never suspends (placement over the simulated registry) to its result."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a simulated placement suspended")


@dataclass
class _Flight:
    """One request in the simulated cluster."""

    record: Record
    bench: BenchRequest
    hashes: list[str]
    charges: Charges
    predicted: tuple | None = None
    prefill: SimEngine | None = None
    decode: SimEngine | None = None
    on_decode: Request | None = None  # the decode side's request (reserved blocks), disagg
    first: Request | None = None  # the request that computes its prompt (its prefix cache hits)
    reserved: bool = False
    held_blocks: int = 0  # of the prompt's blocks, those the decode worker had cached (never sent)
    prompt_done: bool = False
    first_token: int | None = None
    times: list[float] = field(default_factory=list)


class Simulation:
    def __init__(self, profile: Profile, layout: Layout, slo: SloConfig, engine_slo_tpot_s: float | None = None,
                 prefill_profile: Profile | None = None):
        """`slo`: what placement serves (the server's); `engine_slo_tpot_s`: the TPOT target the
        colocated and hybrid decode engines size their chunks by (None: the server's SLO)."""
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.layout, self.profile = layout, profile
        serving = ServingConfig(slo=slo)
        self.pools = SimPools(layout.mode, serving, _Spec(layout.max_num_seqs, profile.block_size))
        self.engines: dict[str, SimEngine] = {}
        tpot = self.engine_tpot = engine_slo_tpot_s if engine_slo_tpot_s is not None else slo.tpot_s
        shared = SimGpu(self, "gpu0", profile.sharing) if layout.one_gpu else None
        gpus = itertools.count()

        def add(role: str, prof: Profile, budget: int, target: float | None) -> None:
            wid = f"{role}-{sum(1 for w in self.engines.values() if w.record.role == role)}"
            gpu = shared or SimGpu(self, f"gpu{next(gpus)}")
            e = SimEngine(self, wid, role, gpu, prof, prof.num_blocks(layout.share), layout.max_num_seqs, budget,
                          target)
            self.engines[wid] = e
            self.pools.workers[wid] = e.record

        pprof = prefill_profile or profile
        for _ in range(layout.prefill if layout.mode != "colocated" else 0):
            add("prefill", pprof, layout.prefill_chunk, None)
        for _ in range(layout.decode):
            if layout.mode == "colocated":
                add("decode", profile, COLOCATED_CHUNK, tpot)
            elif layout.mode == "hybrid":
                add("decode", profile, layout.prefill_chunk, tpot)
            else:
                add("decode", profile, COLOCATED_CHUNK, None)
        self.placer = Placer(self.pools, _Registry(self.engines), profile.block_size, clock=lambda: self.now)
        self.link = profile.link("same_gpu" if layout.one_gpu else "same_host")
        self.flights: dict[str, _Flight] = {}
        self.backlog: dict[str, list[_Flight]] = {wid: [] for wid in self.engines}
        self.routing = self.placer.routing
        self.handoffs: list[float] = []
        self.done: list[_Flight] = []
        if layout.adaptive and prefill_profile not in (None, profile):
            raise ValueError("an adaptive cluster's workers change pools: one profile serves both")
        self.mover = Mover(self) if layout.adaptive else None

    # ---- the event loop ------------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, requests: list[BenchRequest], arrivals: list[float],
            give_up: tuple[float, float, float] | None = None) -> tuple[list[Record], float]:
        """Every request sent at its arrival; (their records, the run's duration) as the bench
        client gives them.

        `give_up` (attainment, TTFT SLO, TPOT SLO): the run stops as soon as so many requests
        missed an SLO (an error, a first token past the TTFT SLO, a TPOT past its SLO) that its
        attainment is sure to stay under `attainment`; the requests not finished then are records
        with an error ("given up"), so the run's attainment is under `attainment` as it would have
        been (a capacity search needs only that, not by how much).

        Python's cyclic garbage collector is paused for the run: a run makes hundreds of thousands
        of blocks, requests and events that live until it ends, and the collector's passes over
        them were ~40% of a run's time; it runs again as the run returns, the engines' KV caches
        already gone (`SimEngine.close`). The simulation is spent then: one `run` per Simulation."""
        import gc

        paused = gc.isenabled()
        gc.disable()
        try:
            return self._run(requests, arrivals, give_up)
        finally:
            for e in self.engines.values():
                e.close()
            if paused:
                gc.enable()

    def _run(self, requests: list[BenchRequest], arrivals: list[float],
             give_up: tuple[float, float, float] | None) -> tuple[list[Record], float]:
        self.give_up = None
        if give_up is not None:
            level, self.slo_ttft, self.slo_tpot = give_up
            self.give_up = int(len(requests) * (1.0 - level)) + 1  # misses that settle it
        self.misses = 0
        for i, (req, t) in enumerate(zip(requests, arrivals)):
            self.at(t, self._arrive, i, req)
        self.at(0.0, self._report)
        if self.mover is not None:
            self.mover.start()
        while self._events and len(self.done) < len(requests):
            if self.give_up is not None and self.misses >= self.give_up:
                return self._given_up(requests, arrivals)
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)
        if len(self.done) < len(requests):
            raise RuntimeError(f"the simulation stalled with {len(requests) - len(self.done)} requests unfinished")
        records = [f.record for f in self.done]
        end = max((r.sent + (r.e2e or 0.0) for r in records), default=0.0)
        return sorted(records, key=lambda r: r.sent), end

    def _given_up(self, requests: list[BenchRequest], arrivals: list[float]) -> tuple[list[Record], float]:
        records = [f.record for f in self.done] + [f.record for f in self.flights.values()]
        for r in records[len(self.done):]:
            r.error = "given up: the rate missed its SLOs"
        sent = len(records)
        for req, t in list(zip(requests, arrivals))[sent:]:
            records.append(Record(len(req.prompt), req.max_tokens, sent=t, error="given up: the rate missed its SLOs"))
        return sorted(records, key=lambda r: r.sent), self.now

    def _report(self) -> None:
        for e in self.engines.values():
            e.report()
        self.at(self.now + STATS_S, self._report)

    # ---- a request's way ---------------------------------------------------------------------
    def _arrive(self, i: int, req: BenchRequest) -> None:
        rec = Record(len(req.prompt), req.max_tokens, sent=self.now)
        hashes = [h.hex() for h in hash_block_tokens(req.prompt, self.profile.block_size)]
        f = _Flight(rec, req, hashes, Charges())
        rid = f"r{i}"
        if self.mover is not None:
            self.mover.arrived(len(req.prompt), req.max_tokens)
        try:
            placed = _now(self.placer.plan(hashes, req.prompt, f.charges))
        except NoWorker as e:
            rec.error = f"503: {e}"
            self.done.append(f)
            self.misses += 1
            return
        self.flights[rid] = f
        f.predicted = placed.predicted
        f.decode = self.engines[placed.decode.worker_id]
        f.decode.record.load += 1
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        f.first = Request(rid, list(req.prompt), params, max_tokens=req.max_tokens, arrival_time=self.now)
        if placed.prefill is None:
            f.decode.add(f.first)
            return
        f.prefill = self.engines[placed.prefill.worker_id]
        f.prefill.record.load += 1
        f.prefill.add(f.first)
        f.on_decode = Request(rid, list(req.prompt), params, max_tokens=req.max_tokens, arrival_time=self.now)
        self._reserve(rid, f)

    def _reserve(self, rid: str, f: _Flight) -> None:
        """The decode worker's reservation of the prompt's blocks (its backlog when none are free)."""
        got = f.decode.kv.reserve_prompt(f.on_decode)
        if got is None:
            self.backlog[f.decode.worker_id].append(f)
            return
        f.reserved, f.held_blocks = True, got[1]
        self._maybe_send(rid, f)

    def _maybe_send(self, rid: str, f: _Flight) -> None:
        if not (f.reserved and f.prompt_done):
            return
        sent = max(0, -(-len(f.bench.prompt) // self.profile.block_size) - f.held_blocks)
        seconds = self.link.seconds(sent * self.profile.block_bytes)
        self.handoffs.append(seconds)
        self.at(self.now + seconds, self._landed, rid, f, seconds)

    def _landed(self, rid: str, f: _Flight, seconds: float) -> None:
        f.prefill.release(rid)
        f.prefill.record.load -= 1
        self._free_happened(f.prefill)
        self.placer.observe_handoff(seconds)
        req = f.on_decode
        req.append_token(f.first_token if f.first_token is not None else 0)
        req.first_token_time = self.now
        self._first(f)
        self._token(f)
        f.decode.admit_prefilled(req)
        if req.finished:
            self._end(rid, f)

    def on_token(self, engine: SimEngine, req: Request, now: float) -> None:
        """A step's sample for `req` on `engine` (SimEngine's callback)."""
        f = self.flights.get(req.request_id)
        if f is None:
            return
        if engine is f.prefill:  # the prompt is done: its KV goes once the decode side has its blocks
            f.prompt_done, f.first_token = True, req.output_token_ids[-1]
            self._maybe_send(req.request_id, f)
            return
        if f.record.ttft is None:
            self._first(f)
        self._token(f)
        if req.finished:
            self._end(req.request_id, f)

    def _first(self, f: _Flight) -> None:
        f.record.ttft = self.now - f.record.sent
        if self.give_up is not None and f.record.ttft > self.slo_ttft:
            self.misses += 1
        f.charges.settle()
        self.placer.observe_first_token(f.predicted, f.record.ttft)

    def _token(self, f: _Flight) -> None:
        f.record.output_tokens += 1
        f.record.chunk_times.append(self.now - f.record.sent)

    def _end(self, rid: str, f: _Flight) -> None:
        f.record.e2e = self.now - f.record.sent
        if self.give_up is not None and f.record.ttft <= self.slo_ttft and (f.record.tpot or 0.0) > self.slo_tpot:
            self.misses += 1
        f.decode.record.load -= 1
        self.flights.pop(rid, None)
        self.done.append(f)
        if self.mover is not None:
            self.mover.finished(f)
        self.at(self.now, self._free_happened, f.decode)

    def _free_happened(self, engine: SimEngine) -> None:
        """Blocks came free on `engine`: its backlog's reservations go first, then its own work."""
        waiting = self.backlog.get(engine.worker_id)
        while waiting:
            f = waiting[0]
            rid = f.on_decode.request_id
            got = engine.kv.reserve_prompt(f.on_decode)
            if got is None:
                break
            waiting.pop(0)
            f.reserved, f.held_blocks = True, got[1]
            self._maybe_send(rid, f)
        if engine.has_work:
            engine.gpu.want(engine)
