"""Which cluster layout of N GPUs serves a workload best: each candidate layout's goodput found by
the simulator (`capacity`: the highest rate whose SLO attainment stays >= 90%), then ranked
(`recommend`). `pdserve plan --gpus N --profile P` prints the ranking.

Candidates (`candidates`): colocated:N, and disagg:P:D and hybrid:P:D at prefill shares of about
1/8, 1/4, 1/3, 1/2 and 2/3 of the GPUs (each split once), so the search stays a few dozen
simulations at any N.

Past SLICE_MAX GPUs a layout is simulated as `replicas` equal slices (`replicas_of`): one slice
of N / replicas GPUs takes 1 / replicas of the traffic (the same workload at that share of the
rate: a trace keeps its shared prefixes together, as the router's prefix placement does), and the
layout's goodput is replicas x the slice's. The candidates are then the slice's splits, scaled. A
slice's pools are smaller than the whole's, so their queues balance a little worse: measured
against whole-cluster simulations in bench/results/plan/slices.md. `slice_max=None` simulates
the whole cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTAIN = 0.9  # goodput's attainment bar (pdserve.bench.report.goodput)
SPAN_S = 10.0  # a probed rate sends at least this many seconds of requests (queues must have time to grow)
SHARES = (1 / 8, 1 / 4, 1 / 3, 1 / 2, 2 / 3)
SLICE_MAX = 8  # a layout of more GPUs is simulated as replicas of a slice of at most this many
SLICE_MIN = 4  # ... and at least this many (else the whole is simulated)


@dataclass(frozen=True)
class Capacity:
    """One layout's predicted goodput (req/s at >= 90% attainment; 0.0 when even `floor` misses)
    and the attainment at the rate it was found at."""
    system: str
    rps: float
    attainment: float
    rate: float
    simulations: int
    replicas: int = 1  # the layout was simulated as this many slices, each at 1/replicas of the rate

    @property
    def meets(self) -> bool:
        return self.rps > 0

    @property
    def slice(self) -> str:
        """The layout simulated: the whole, or one replica's share of it."""
        return scaled(self.system, 1 / self.replicas)


def scaled(system: str, factor: float) -> str:
    """colocated:N, disagg:P:D, hybrid:P:D with every pool's size times `factor` (whole GPUs)."""
    kind, *sizes = system.split(":")
    return ":".join([kind, *(str(round(int(n) * factor)) for n in sizes)])


def replicas_of(gpus: int, slice_max: int | None = SLICE_MAX) -> int:
    """Into how many equal slices `gpus` is cut for simulation: the fewest whose slice has at most
    `slice_max` GPUs, when that slice has at least SLICE_MIN; else 1 (the whole; also for
    slice_max None)."""
    if slice_max is None or gpus <= slice_max:
        return 1
    g = next(g for g in range(2, gpus + 1) if gpus % g == 0 and gpus // g <= slice_max)
    return g if gpus // g >= SLICE_MIN else 1


def candidates(gpus: int, modes: tuple[str, ...] = ("colocated", "disagg", "hybrid")) -> list[str]:
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    out = [f"colocated:{gpus}"] if "colocated" in modes else []
    if gpus >= 2:
        splits = sorted({min(max(round(gpus * s), 1), gpus - 1) for s in SHARES})
        out += [f"{m}:{p}:{gpus - p}" for m in ("disagg", "hybrid") if m in modes for p in splits]
    return out


def capacity(profile, system: str, argv: list[str], floor: float, num_requests: int = 200,
             steps: int = 4, start: int = 0) -> Capacity:
    """The highest rate of `argv`'s workload (`pdserve bench` arguments without --rates and
    --num-requests) that `system` serves at >= 90% attainment, within 1/2**steps of it: on the
    rates floor x 2**k, the last k that meets it (doubled up, or halved down, from k = `start`),
    then bisected between it and the next. A rate is probed with `num_requests`, or SPAN_S
    seconds of them where that is more.

    `start` only saves probes: where attainment falls as the rate grows, every start finds the
    same rate (the one a search doubling from `floor` finds). `recommend` starts each layout
    where the layouts searched before it met their SLOs, so most searches take two probes to
    bracket their goodput instead of one per doubling from the floor."""
    import math

    from . import predict

    runs = 0

    def attained(rate: float) -> float:
        nonlocal runs
        runs += 1
        n = max(num_requests, math.ceil(rate * SPAN_S))
        return predict(profile, system, [*argv, "--rates", f"{rate:.4g}", "--num-requests", str(n)],
                       give_up_below=ATTAIN)["runs"][0]["slo_attainment"]

    k = max(0, min(start, 12))
    first = attained(floor * 2 ** k)
    while first < ATTAIN and k > 0:  # halved down to the first rate that meets it
        k -= 1
        bad, first = floor * 2 ** (k + 1), attained(floor * 2 ** k)
        if first >= ATTAIN:
            good, good_att = floor * 2 ** k, first
            break
    else:
        if first < ATTAIN:
            return Capacity(system, 0.0, first, floor, runs)
        good, good_att, bad = floor * 2 ** k, first, None
        for _ in range(12 - k):
            a = attained(good * 2)
            if a < ATTAIN:
                bad = good * 2
                break
            good, good_att = good * 2, a
    if bad is not None:
        for _ in range(steps):
            mid = (good + bad) / 2
            a = attained(mid)
            if a >= ATTAIN:
                good, good_att = mid, a
            else:
                bad = mid
    return Capacity(system, good, good_att, good, runs)


def doublings(c: Capacity, floor: float) -> int:
    """The k of the last rate floor x 2**k that `c`'s layout met (0 where none did)."""
    import math

    return max(0, int(math.floor(math.log2(c.rps / floor) + 1e-9))) if c.rps > 0 else 0


def recommend(profile, gpus: int, argv: list[str], num_requests: int = 200, floor: float | None = None,
              progress=None, jobs: int | None = None, slice_max: int | None = SLICE_MAX,
              systems: list[str] | None = None) -> list[Capacity]:
    """Every candidate layout's capacity, best first (colocated included). `floor`: the rate each
    search starts at (default 0.25 req/s a GPU). `jobs`: layouts searched at once, each in its own
    process (default: one per CPU core; 1: in this process); `progress` is called here with
    each layout's capacity as it comes. `slice_max`: see the module's doc (None: the whole).
    `systems`: these layouts of the whole cluster instead of the candidates (simulated whole)."""
    import os

    g = 1 if systems is not None else replicas_of(gpus, slice_max)
    floor = (floor or 0.25 * gpus) / g
    systems = systems if systems is not None else candidates(gpus // g)
    jobs = min(jobs or os.cpu_count() or 1, len(systems))
    out = []

    def whole(c: Capacity) -> Capacity:
        return Capacity(scaled(c.system, g), c.rps * g, c.attainment, c.rate * g, c.simulations, g)

    start = 0  # where the next search starts: the highest k a searched layout met (capacity's start)

    def seen(c: Capacity) -> None:
        nonlocal start
        out.append(whole(c))
        start = max(start, doublings(c, floor))
        if progress is not None:
            progress(out[-1])

    if jobs <= 1:
        for system in systems:
            seen(capacity(profile, system, argv, floor, num_requests, start=start))
    else:
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        todo = list(systems)
        with ProcessPoolExecutor(jobs, mp_context=pool_context()) as pool:
            running = {pool.submit(capacity, profile, todo.pop(0), argv, floor, num_requests) for _ in range(jobs)}
            while running:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    seen(f.result())
                while todo and len(running) < jobs:
                    running.add(pool.submit(capacity, profile, todo.pop(0), argv, floor, num_requests, start=start))
    return sorted(out, key=lambda c: (-c.rps, -c.attainment, c.system))


def pool_context():
    """How the search's worker processes start. Fork, where it is safe: a worker starts with what
    this process imported (spawn would import torch again). Not in a process that runs a Ray
    driver: its core worker's gRPC channels and threads do not survive a fork (gRPC's fork support
    is off), and a pytest worker that had forked a search found its next `ray.get_actor` never
    reaching the GCS (GetTimeoutError after 60 s, twice in a row). There the workers come from a
    fork server, a fresh process that never held Ray's state."""
    import multiprocessing
    import sys

    methods = multiprocessing.get_all_start_methods()
    ray = sys.modules.get("ray")
    driver = ray is not None and getattr(ray, "is_initialized", lambda: False)()
    if "fork" in methods and not driver:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else None)
