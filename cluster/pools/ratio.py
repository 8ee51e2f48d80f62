"""The prefill:decode ratio planner (autoscale.policy "ratio"): with the workers there are, how
many should prefill and how many decode, from the load measured under traffic.

Every look (the pools' monitor, once a second; it plans every LOOK_S) it reads the requests
that arrived at the edge in the last `window_s` (`on_arrive`), those that finished there
(`on_finish`) and the workers' own measures:

    prefill load   rho_p = prompt tokens arrived / s, less the share a prefix cache held (the
                           finished requests')
                           /  (one prefill worker's prefill tok/s x UTIL_P)
    decode load    rho_d = sequences decoding at once (Little: requests arrived / s x their
                           decode time: the tokens they will decode x the time a token takes)
                           /  (one decode worker's sequences at the TPOT target x UTIL_D)
    the split      prefill workers = N x rho_p / (rho_p + rho_d), within the pools' bounds

The load is what arrives, priced by what the finished requests cost: not how it is served now.
The tokens a request decodes are its max_tokens (known as it arrives) times the share of their
max_tokens the finished requests used; the time a token takes, a decode step of the batch the
plan counts on (the decode workers' step models: `DecodeCapacity.step_at`; the finished requests'
decode seconds a token until they are fitted). The finished requests' own mean decode time
undercounts twice where the window starts with the traffic: only the short ones have finished
yet, and they decoded in small batches (a 16-GPU cluster's first look on the Mooncake trace read
0.8 s for requests that decode 4.4 s, asked for 14.7 of 16 workers to prefill where 10.8 was
right, and took 70 s and two more moves to come back).
A saturated pool's queue does not hide it, and a queue drained after a move does not count
twice (requests finishing faster than they arrive, as the backlog of a starved prefill pool
clears, are not new load; counted by their ends, such a drain once moved a 16-GPU cluster one
worker past its best split and back). A prefill worker's rate is its step model's
(`prefill_tok_s`, measured at start and from every step); a decode worker's sequences at the
target are the most whose decode-only step its step model fits in margin x TPOT
(`decode_capacity`, interpolated at the window's mean context), and no more than its KV holds
at the window's mean request length.

The live correction: what the workers' own models say is checked against what the requests
got. A side whose p90 in the window misses the SLO (TTFT for prefill, TPOT for decode) counts
its load that many times over (the measured p90 over the target, at most MAX_CORRECTION): a
prefill rate or a decode capacity that the models overrate shows as missed targets, and the
split leans to the side that misses. Where both meet their targets the models' estimate stands.
A move that only the correction asks for (the load alone would not) takes no worker from a side
whose own load the move would leave short (both sides then miss: the correction would trade one
side's misses for the other's; a 16-GPU cluster at 11:5, its window's TTFTs still long from the
backlog of its first seconds, was moved to 12:4 at 35 s and missed every TPOT after).

It moves drain-safe (Pools.scale with switch_roles), only when the split is more than
HYSTERESIS past the pools' sizes on two looks in a row, LOOK_S apart (more in the first SETTLE_S
seconds of traffic, or the window if shorter: HYSTERESIS x sqrt(SETTLE_S / the seconds watched),
as a mean's noise shrinks with the square root of what it averages; traffic's first seconds meet
a cold prefix cache and only the short requests finished, and a 16-GPU cluster started at its
best split moved a worker off it 6 s in and back 35 s later), half the gap at a time (one worker
in a small cluster; a 64-GPU cluster 10 workers off the split closes it in a few moves, not
ten). After a move it waits `cooldown_s` before a move the other way. A move the same way may
follow within the cooldown, and while the last one's workers still drain (two looks again, on
the load without the live correction, the switching workers counted in the pool they go to):
the load is priced by what arrives, not by how the pools serve it, so a move does not change
what the next look measures, except the window's latencies, which still hold the misses from
before it. A 16-GPU cluster started at 8:8 on the Mooncake trace (the best split 11:5) reached
11:5 at 41 s with a cooldown after each move and looks 5 s apart, at 17 s going on the same way
once the last move had finished, at 14 s looking every second (its first move at 2 s, not 6),
and at 9 s going on while the last move drains: 0.875, 0.875, 0.909 and 0.909 of the best static
split's goodput (bench/results/plan/adaptive_fine and adaptive_guarded, searched to 1/64; what
holds the last two is placement's: docs/design/ratio_planner.md). Fewer
than MIN_REQUESTS finished requests in the window: no plan (too little to measure). As Dynamo's
planner sizes its pools from the prefill and decode throughput one GPU gives at the SLO, with
correction factors from the live latencies, at a fixed total.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

from ..api import RequestObserver
from ..records import WorkerStats
from ..spec.serving_config import ROLES

UTIL_P = 0.8  # a prefill pool planned to 80% busy keeps a queue short enough for TTFT
UTIL_D = 0.9
HYSTERESIS = 0.2  # workers past the half-way point before a move counts
MIN_REQUESTS = 16
LOOK_S = 1.0  # as often as the pools' monitor looks: a first move at 2 s of traffic, not 6
MAX_CORRECTION = 2.0  # the most a missed target multiplies its side's load by
SETTLE_S = 30.0  # the seconds of traffic (or the window, if shorter) before the usual hysteresis holds


class Arrived(NamedTuple):
    """A request the window holds: when it arrived (the planner's clock), its prompt and its
    max_tokens (None: not told)."""

    t: float
    prompt: int
    max_tokens: int | None = None


class Finished(NamedTuple):
    """A request the window holds: when it ended (the planner's clock), its sizes and times."""

    t: float
    prompt: int
    output: int
    decode_s: float
    ttft_s: float | None = None
    max_tokens: int | None = None
    cached: int = 0  # of its prompt, the tokens a prefix cache held

    @property
    def tpot_s(self) -> float | None:
        return self.decode_s / (self.output - 1) if self.output > 1 else None


@dataclass
class RatioLoad:
    """The window's load and one worker's capacity for each side."""

    prefill_tok_s: float  # prompt tokens per second to prefill
    decoding: float  # sequences decoding at once
    prefill_rate: float  # one prefill worker's prefill tokens per second
    decode_seqs: float  # sequences one decode worker holds at the TPOT target
    requests: int
    prefill_correction: float = 1.0  # the live correction of each side (>= 1: its target missed)
    decode_correction: float = 1.0

    def uncorrected(self) -> RatioLoad:
        """The same load without the live correction (each side's measured rate as it is)."""
        return dataclasses.replace(self, prefill_correction=1.0, decode_correction=1.0)

    def needs(self) -> tuple[float, float]:
        """The workers each side needs at its planned busy share, as measured (no correction)."""
        return (self.prefill_tok_s / max(self.prefill_rate * UTIL_P, 1e-9),
                self.decoding / max(self.decode_seqs * UTIL_D, 1e-9))

    def split(self, total: int, min_prefill: int, min_decode: int) -> float:
        """The prefill workers this load needs out of `total` (fractional, within the bounds)."""
        rho_p = self.prefill_correction * self.prefill_tok_s / max(self.prefill_rate * UTIL_P, 1e-9)
        rho_d = self.decode_correction * self.decoding / max(self.decode_seqs * UTIL_D, 1e-9)
        frac = total * rho_p / (rho_p + rho_d) if rho_p + rho_d > 0 else total / 2
        return min(max(frac, float(min_prefill)), float(total - min_decode))

    def describe(self) -> str:
        fixed = "".join(f", {side} x{k:.2f}" for side, k in (("prefill", self.prefill_correction),
                                                            ("decode", self.decode_correction)) if k != 1.0)
        return (f"prefill {self.prefill_tok_s:.0f} tok/s at {self.prefill_rate:.0f} a worker, "
                f"{self.decoding:.1f} decoding at {self.decode_seqs:.0f} a worker{fixed}")


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x)
    return xs[len(xs) // 2] if xs else None


def correction(measured: list[float | None], target: float | None) -> float:
    """How far the window's p90 of `measured` passes `target`: p90 / target within [1,
    MAX_CORRECTION]; 1 with no target or too few samples."""
    xs = sorted(x for x in measured if x is not None)
    if not target or len(xs) < MIN_REQUESTS:
        return 1.0
    return min(max(xs[int(0.9 * (len(xs) - 1))] / target, 1.0), MAX_CORRECTION)


class RatioPlanner(RequestObserver):
    """Feeds on finished requests (`on_finish`, the dispatcher's observer) and plans the split."""

    def __init__(self, window_s: float, cooldown_s: float, clock=time.monotonic, look_s: float = LOOK_S):
        """`clock`: the seconds its window, looks and cooldown run by (the simulator passes its own)."""
        self.window_s, self.cooldown_s, self.clock, self.look_s = window_s, cooldown_s, clock, look_s
        self.finished: collections.deque[Finished] = collections.deque(maxlen=100_000)
        self.arrived: collections.deque[Arrived] = collections.deque(maxlen=100_000)
        self.since: float | None = None  # when it started to watch (the first request that arrived)
        self.last_move = -math.inf
        self.next_look = 0.0
        self.leaning = 0  # the last look's direction (+1: more prefill, -1: more decode, 0: none)
        self.last_way = 0  # the last move's direction (0: none yet)
        self.last: dict = {}  # the last plan, for status

    def on_arrive(self, prompt_tokens: int, max_tokens: int | None = None) -> None:
        now = self.clock()
        self.since = self.since if self.since is not None else now
        self.arrived.append(Arrived(now, prompt_tokens, max_tokens))

    def on_finish(self, done) -> None:
        if done.decode_s is not None and done.num_output_tokens > 0:
            now = self.clock()
            self.finished.append(Finished(now, done.num_prompt_tokens, done.num_output_tokens, done.decode_s,
                                          done.ttft_s, done.max_tokens, done.num_cached_tokens))

    def outputs(self, reqs: list[Finished]) -> float:
        """The tokens a request of the window decodes, on average: the arrivals' max_tokens times
        the share of their max_tokens the finished requests used (the finished requests' mean
        where the arrivals' max_tokens are not known)."""
        told = [a.max_tokens for a in self.arrived if a.max_tokens]
        used = [(r.output, r.max_tokens) for r in reqs if r.max_tokens]
        if not told or not used:
            return sum(r.output for r in reqs) / len(reqs)
        return sum(told) / len(told) * min(sum(o for o, _ in used) / sum(m for _, m in used), 1.0)

    def measure(self, prefill_stats: list[WorkerStats], decode_stats: list[WorkerStats], now: float,
                decode_spec, slo=None) -> RatioLoad | None:
        """The window's load, or None when too little finished or a worker's rate is unknown.
        `decode_spec`: the decode pool's engine spec (its max_num_seqs and block size); `slo`
        (ttft_s, tpot_s): the targets the live correction checks the window's p90s against."""
        while self.finished and self.finished[0].t < now - self.window_s:
            self.finished.popleft()
        while self.arrived and self.arrived[0][0] < now - self.window_s:
            self.arrived.popleft()
        reqs = list(self.finished)
        if len(reqs) < MIN_REQUESTS or not self.arrived:
            return None
        span = min(self.window_s, max(now - (self.since if self.since is not None else now), 1.0))
        rate = _median([s.prefill_tok_s or 0.0 for s in prefill_stats])
        prompt = sum(a.prompt for a in self.arrived) / len(self.arrived)
        out = self.outputs(reqs)
        ctx, whole = prompt + out / 2, prompt + out
        seqs = []
        for s in decode_stats:
            at_target = s.decode_capacity.at(ctx) or decode_spec.max_num_seqs
            kv = (s.kv_blocks_total or 0) * decode_spec.block_size / max(whole, 1.0)
            seqs.append(min(at_target or kv, kv) if kv else at_target)
        cap = _median(seqs)
        if not rate or not cap:
            return None
        # a decoded token's time at the batch planned on: the workers' step models' decode step of
        # their capacity; before they are fitted, the finished requests' decode seconds a token
        per_token = _median([s.decode_capacity.step_at(ctx) or 0.0 for s in decode_stats]) \
            or sum(r.decode_s for r in reqs) / max(sum(r.output - 1 for r in reqs), 1)
        k_p = correction([r.ttft_s for r in reqs], slo.ttft_s) if slo is not None else 1.0
        k_d = correction([r.tpot_s for r in reqs], slo.tpot_s) if slo is not None else 1.0
        per_s = len(self.arrived) / span
        # the prompt tokens to compute: those a prefix cache does not hold (the finished requests' share)
        computed = 1.0 - min(sum(r.cached for r in reqs) / max(sum(r.prompt for r in reqs), 1), 1.0)
        return RatioLoad(prompt * per_s * computed, per_s * max(out - 1, 0.0) * per_token, rate, cap, len(reqs),
                         k_p, k_d)

    def plan(self, workers: list, serving, decode_spec, now: float) -> tuple[dict, str] | None:
        """Pools' call (their records, config and decode spec): the new sizes and why, or None.
        Nothing is planned while a worker drains out of the cluster; while workers switch pools
        (a move still being applied) only a move the same way, each switching worker counted in
        the pool it goes to."""
        if any(w.draining for w in workers):
            return None
        stats = {r: [w.stats for w in workers if w.role == r] for r in ROLES}
        sizes = {r: sum(1 for w in workers if (w.switching_to or w.role) == r) for r in ROLES}
        bounds = {r: (serving.pool(r).min, serving.pool(r).max) for r in ROLES}
        load = self.measure(stats["prefill"], stats["decode"], now, decode_spec, serving.slo)
        return self.want(load, sizes, bounds, now, moving=any(w.switching_to for w in workers))

    @staticmethod
    def _short_donor(load: RatioLoad, lean: int, frac: float, p: int, total: int, lo: int, hi: int,
                     past: float) -> bool:
        """Whether a move `lean` asks for only through the live correction would leave the side
        that gives the workers short of what its own load needs: both sides then miss, and the
        correction would only trade one side's misses for the other's (a 16-GPU cluster at 11:5,
        its window's TTFTs still long from the backlog of its first seconds, moved to 12:4 and
        missed every TPOT after)."""
        plain = load.uncorrected().split(total, lo, total - hi)
        if (1 if plain > p + past else -1 if plain < p - past else 0) == lean:
            return False  # the load alone asks for it
        step = max(1, round(abs(frac - p) / 2))
        need_p, need_d = load.needs()
        return (need_d > total - p - step) if lean > 0 else (need_p > p - step)

    def want(self, load: RatioLoad | None, sizes: dict, bounds: dict, now: float,
             moving: bool = False) -> tuple[dict, str] | None:
        """The pools' new sizes and why, or None (no move now). `bounds`: role -> (min, max);
        `moving`: workers are still switching pools (`sizes` counts them where they go)."""
        if load is None or now < self.next_look:
            return None
        cooling = moving or now - self.last_move < self.cooldown_s
        if cooling and not self.last_way:
            return None
        self.next_look = now + self.look_s
        if cooling:  # only on the way the last move went; the window's latencies are from before it
            load = load.uncorrected()
        total, p = sizes["prefill"] + sizes["decode"], sizes["prefill"]
        lo = max(bounds["prefill"][0], total - bounds["decode"][1])
        hi = min(bounds["prefill"][1], total - bounds["decode"][0])
        frac = load.split(total, lo, total - hi)
        self.last = {"prefill": round(frac, 2), "of": total, "load": load.describe()}
        settle = min(self.window_s, SETTLE_S)
        watched = now - self.since if self.since is not None else settle
        past = 0.5 + HYSTERESIS * math.sqrt(settle / min(max(watched, 1e-9), settle))
        lean = 1 if frac > p + past else -1 if frac < p - past else 0
        if cooling and lean != self.last_way:
            lean = 0
        if lean and not cooling and self._short_donor(load, lean, frac, p, total, lo, hi, past):
            lean = 0
        twice, self.leaning = lean != 0 and lean == self.leaning, lean
        if not twice:
            return None
        self.last_move, self.leaning, self.last_way = now, 0, lean
        lean *= max(1, round(abs(frac - p) / 2))  # half the gap, rounded: one worker in a small cluster
        why = f"ratio: {frac:.2f} of {total} workers should prefill ({load.describe()})"
        return {"prefill": p + lean, "decode": total - p - lean}, why
