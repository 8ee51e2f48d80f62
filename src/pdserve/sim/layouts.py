"""Which cluster layout of N GPUs serves a workload best: each candidate layout's goodput found by
the simulator (`capacity`: the highest rate whose SLO attainment stays >= 90%), then ranked
(`recommend`). `pdserve plan --gpus N --profile P` prints the ranking.

Candidates (`candidates`): colocated:N, and disagg:P:D and hybrid:P:D at prefill shares of about
1/8, 1/4, 1/3, 1/2 and 2/3 of the GPUs (each split once), so the search stays a few dozen
simulations at any N.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTAIN = 0.9  # goodput's attainment bar (pdserve.bench.report.goodput)
SPAN_S = 10.0  # a probed rate sends at least this many seconds of requests (queues must have time to grow)
SHARES = (1 / 8, 1 / 4, 1 / 3, 1 / 2, 2 / 3)


@dataclass(frozen=True)
class Capacity:
    """One layout's predicted goodput (req/s at >= 90% attainment; 0.0 when even `floor` misses)
    and the attainment at the rate it was found at."""
    system: str
    rps: float
    attainment: float
    rate: float
    simulations: int

    @property
    def meets(self) -> bool:
        return self.rps > 0


def candidates(gpus: int, modes: tuple[str, ...] = ("colocated", "disagg", "hybrid")) -> list[str]:
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    out = [f"colocated:{gpus}"] if "colocated" in modes else []
    if gpus >= 2:
        splits = sorted({min(max(round(gpus * s), 1), gpus - 1) for s in SHARES})
        out += [f"{m}:{p}:{gpus - p}" for m in ("disagg", "hybrid") if m in modes for p in splits]
    return out


def capacity(profile, system: str, argv: list[str], floor: float, num_requests: int = 200,
             steps: int = 4) -> Capacity:
    """The highest rate of `argv`'s workload (`pdserve bench` arguments without --rates and
    --num-requests) that `system` serves at >= 90% attainment, within 1/2**steps of it: doubled
    from `floor` until it misses, then bisected. A rate is probed with `num_requests`, or SPAN_S
    seconds of them where that is more."""
    import math

    from . import predict

    runs = 0

    def attained(rate: float) -> float:
        nonlocal runs
        runs += 1
        n = max(num_requests, math.ceil(rate * SPAN_S))
        return predict(profile, system, [*argv, "--rates", f"{rate:.4g}", "--num-requests", str(n)]
                       )["runs"][0]["slo_attainment"]

    first = attained(floor)
    if first < ATTAIN:
        return Capacity(system, 0.0, first, floor, runs)
    good, good_att, bad = floor, first, None
    for _ in range(12):
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


def recommend(profile, gpus: int, argv: list[str], num_requests: int = 200, floor: float | None = None,
              progress=None) -> list[Capacity]:
    """Every candidate layout's capacity, best first (colocated included). `floor`: the rate each
    search starts at (default 0.25 req/s a GPU)."""
    floor = floor or 0.25 * gpus
    out = []
    for system in candidates(gpus):
        out.append(capacity(profile, system, argv, floor, num_requests))
        if progress is not None:
            progress(out[-1])
    return sorted(out, key=lambda c: (-c.rps, -c.attainment))
