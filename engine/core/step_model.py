"""The step-time model: how long an engine step takes, learned online, and from it the
prefill chunk a step may carry without breaking a time-per-output-token (TPOT) target.

Every step is timed (the model runner's call; it ends on the host copy of the sampled
tokens, so the GPU's time is in it) and kept with its shape:

    seconds ~ base + mixed + per_seq * decode_rows + per_token * prefill_tokens
              + per_kv * decode_context_tokens + per_attn * prefill_tokens x their context
              + graph * g(decode_rows)

(`scheduler.StepShape`: a request verifying d drafts is 1 + d decode rows, each reading its
context.) g is the start-up time of the decode graph the rows replay (`graphs`, timed by the
runner when speculation is configured; 0 otherwise). `mixed` is what a step with prefill
tokens costs beyond a decode-only one. The coefficients are a non-negative least-squares fit
over the last 256 decode-only and the last 256 steps with prefill tokens, refitted every 16
steps; its prefill terms count once 8 steps with prefill are in it. This is the engine's one
step-cost model: the TPOT chunk (prefill_cap, chunk_at), the prefill rate placement reads
(rate_at) and speculation's off-switch (decode_seconds; spec/switch.py) are queries on it.

With a target (`slo_tpot_s`), the decodes average at most margin x target per output token
(TPOT is a mean). While the fit sees a fixed cost for a step with prefill, decode-only steps
bank the time they leave under the target (`slack`, at most BANK_STEPS targets) and a step
carries a prefill chunk only when the banked slack pays for one of at least MIN_CHUNK tokens:
the largest that fits target + slack. The mean stays inside the target; one gap may reach
(1 + BANK_STEPS) x target. Until the fit has seen 8 steps with prefill tokens the chunk is a
probe of PROBE_TOKENS; a decode-only step banks at least MIN_ROOM of the target, so a prompt
on a worker whose decodes alone take the target still progresses; when the decodes alone take
target + a full bank, a prompt already there gets a MIN_CHUNK step each time the bank is full.
With no decodes running the step budget (`max_num_batched_tokens`) applies. The margin starts at
0.85 and follows the finished requests' TPOTs (`observe_tpot`): the SLO counts each request, so
the p90 of the last 64 is held under 0.95 x target (a request that lived through a run of
chunks averages above the steps' mean).
Why it is built so, with the measurements: docs/design/step_model.md.
"""

from __future__ import annotations

import collections
import logging
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from ..stats import PlacementStats
from .decode_capacity import DecodeCapacity
from .request import Request
from .scheduler import Scheduler, StepShape

if TYPE_CHECKING:
    from ..settings import SchedulerSettings

PROBE_TOKENS = 256
MIN_CHUNK = 256  # smaller chunks pay a mixed step's fixed cost for little prefill: bank slack instead
MIN_ROOM = 0.05  # the least slack a decode-only step banks (progress when the decodes take the target)
SMALL_FIXED = 0.1  # a mixed step's fixed cost under this share of the target: chunks need no bank
IDLE_GAP_S = 0.05
BANK_STEPS = 3.0  # slack banked at most, in targets: a step takes at most (1 + BANK_STEPS) x target
# the margin follows the finished requests' TPOTs (the SLO counts each request, not the mean step):
TPOT_WINDOW = 64  # the last finished requests' TPOTs it reads
P90_AIM = 0.95  # their p90 kept under this share of the target
MIN_MARGIN = 0.4
log = logging.getLogger(__name__)
FEATURES = ("base", "mixed", "per_seq", "per_token", "per_kv_token", "per_attn", "graph")
_SCALE = np.array([1.0, 1.0, 64.0, 1024.0, 262144.0, 4.0 * 2**20, 0.01])  # features to ~unit size


class StepModel:
    def __init__(self, max_tokens: int, slo_tpot_s: float | None = None, margin: float = 0.85,
                 graphs: dict[int, float] | None = None, window: int = 256):
        """`window`: the steps of each kind (decode-only, with prefill) the fit keeps."""
        self.max_tokens = max_tokens  # the engine's max_num_batched_tokens
        self.slo_tpot_s = slo_tpot_s
        self.margin = self.base_margin = margin
        self.tpots: collections.deque = collections.deque(maxlen=TPOT_WINDOW)  # finished requests' TPOTs
        self.tpot_p90: float | None = None  # their p90 when last measured (kept across a window's restart)
        self._since_adapt = 0
        # decode-graph rows -> seconds per replay, every row at 512 tokens of context, timed by the
        # runner at start (exec/graphs.py; empty without graphs): the `graph` feature, and the spec
        # off-switch's prior until steps are fitted
        self.graphs = dict(graphs or {})
        self.decode_steps: collections.deque = collections.deque(maxlen=window)
        self.mixed_steps: collections.deque = collections.deque(maxlen=window)
        self.learning = True  # False: the coefficients stay as they are (a profile's, in the simulator)
        self.record: list | None = None  # a list: every observed (StepShape, seconds) is appended (a profile)
        self.coef: np.ndarray | None = None  # per feature, in _SCALE units, once 12 steps are seen
        self.prefill_fitted = False  # the fit has seen steps with prefill and a cost per prefill token
        self._since_fit = 0
        self.step_s = 0.0  # EWMA of every step's seconds
        self.prefill_tok_s = 0.0  # EWMA of prefill tokens / second over steps with >= 64 of them
        self.last: dict = {}  # the last step: decodes, prefill_tokens, cap, seconds (tests, stats)
        self._cap: int | None = None
        self.slack = 0.0  # seconds the decodes ran under the target, banked for a prefill chunk
        self._last_end: float | None = None

    @classmethod
    def of(cls, settings: SchedulerSettings, graphs: dict[int, float] | None = None) -> StepModel:
        """The engine's step model: its step budget and TPOT target (the scheduler's settings,
        resolved), `graphs` the runner's decode-graph times."""
        return cls(settings.max_num_batched_tokens, settings.slo_tpot_s, graphs=graphs)

    # ---- features ------------------------------------------------------------------------
    def graph_seconds(self, rows: int) -> float | None:
        """The decode graph that `rows` rows replay: its start-up time (0 without graphs or rows;
        None beyond the largest graph: such a step runs eagerly)."""
        if not self.graphs or rows <= 0:
            return 0.0
        fits = [k for k in self.graphs if k >= rows]
        return self.graphs[min(fits)] if fits else None

    def _x(self, decodes: int, prefill: int, kv: int, attn: float) -> np.ndarray:
        g = self.graph_seconds(decodes)
        if g is None:  # beyond the largest graph: the largest, scaled by rows
            top = max(self.graphs)
            g = self.graphs[top] * decodes / top
        return np.array([1.0, 1.0 if prefill else 0.0, decodes, prefill, kv, attn, g]) / _SCALE

    def predict(self, decodes: int, prefill: int, kv: int, attn: float) -> float | None:
        if self.coef is None:
            return None
        return float(self._x(decodes, prefill, kv, attn) @ self.coef)

    def decode_seconds(self, rows: int, kv: int) -> float | None:
        """An all-decode step of `rows` rows (decodes and draft rows) reading `kv` context tokens
        (the spec off-switch's query, spec/switch.py): the fit, or the start-up graph time
        before it; None beyond the largest decode graph."""
        g = self.graph_seconds(rows)
        if g is None:
            return None
        return g if self.coef is None else self.predict(rows, 0, kv, 0)

    def coefficients(self) -> dict[str, float]:
        """The fit in seconds per unit of each feature (empty before it)."""
        return {} if self.coef is None else dict(zip(FEATURES, (self.coef / _SCALE).tolist()))

    def set_coefficients(self, coefficients: dict[str, float]) -> None:
        """Takes a fit made elsewhere (a profile: pdserve.sim.profile) and stops learning: the
        chunk, the rate and the capacity answer from it alone."""
        self.coef = np.array([coefficients.get(k, 0.0) for k in FEATURES]) * _SCALE
        self.prefill_fitted = bool(self.coef[3] > 0 or self.coef[5] > 0)
        self.learning = False

    def fit_all(self) -> None:
        """Fits the steps kept now (every one, with a window as large as them)."""
        self._fit()

    # ---- observing steps ----------------------------------------------------------------------
    @contextmanager
    def timed(self, shape: StepShape | None):
        """Times one step and learns from it. The time is the step's wall time from the end
        of the previous one (what a decode waits between its tokens: scheduling, the
        model, outputs, the role's work around it), unless the engine was idle between
        them (a gap over IDLE_GAP_S more than the model's call). `shape`: the step whose
        time the block ends with: an overlapped launch on an asynchronous device only queues
        its own step and waits for the one in flight, so the time is that one's (the engine
        passes its shape; None when nothing was in flight: the clock restarts, nothing is
        learnt)."""
        t0 = time.perf_counter()
        yield
        end = time.perf_counter()
        wall = end - self._last_end if self._last_end is not None else end - t0
        self._last_end = end
        if shape is not None:
            self.observe(shape, wall if wall - (end - t0) < IDLE_GAP_S else end - t0)

    def observe(self, step: StepShape, seconds: float) -> None:
        if self.record is not None:
            self.record.append((step, seconds))
        shape = (step.rows, step.prefill_tokens, step.kv_tokens, step.attn)
        (self.mixed_steps if shape[1] else self.decode_steps).append((shape, seconds))
        self.step_s = seconds if not self.step_s else 0.9 * self.step_s + 0.1 * seconds
        if shape[1] >= 64 and seconds > 0:  # prefill throughput as measured (before the fit)
            rate = shape[1] / seconds
            self.prefill_tok_s = rate if not self.prefill_tok_s else 0.8 * self.prefill_tok_s + 0.2 * rate
        if shape[0] and self.slo_tpot_s is not None:  # decodes ran: bank (or spend) slack
            target = self.margin * self.slo_tpot_s
            earned = target - seconds
            if not shape[1]:
                earned = max(earned, MIN_ROOM * target)
            self.slack = min(self.slack + earned, self._bank_cap(target))
        elif not shape[0]:
            self.slack = 0.0  # nothing decoding: nothing to protect, nothing banked
        self.last = {"decodes": shape[0], "prefill_tokens": shape[1], "cap": self._cap, "seconds": seconds,
                     "slack": self.slack}
        self._since_fit += 1
        if not self.learning:
            return
        seen = len(self.decode_steps) + len(self.mixed_steps)
        if self._since_fit >= 16 or (self.coef is None and seen >= 12) or \
                (not self.prefill_fitted and len(self.mixed_steps) >= 8):
            self._fit()

    def calibrate(self, samples: list[tuple[StepShape, float]]) -> None:
        """Learns from timed steps run before serving (ModelRunner.calibration), so that the chunk
        and the advertised rate come from a fit from the first request; logs what it learned."""
        for shape, seconds in samples:
            self.observe(shape, seconds)
        self.slack = 0.0  # nothing was decoding for real
        log.info("step model: %d calibration steps (%.2f s of steps), prefill fitted: %s, %.0f prefill tok/s",
                 len(samples), sum(s for _, s in samples), self.prefill_fitted, self.prefill_tok_s)

    def observe_tpot(self, seconds: float) -> None:
        """A finished request's TPOT (the mean gap between its tokens here). Every 8 requests, with
        16 or more in the window: a p90 over P90_AIM x target lowers the margin in proportion (by
        at most a fifth, to MIN_MARGIN) and starts the window afresh; a p90 well under it raises the
        margin by 5%, back to where it started at most. The steps' mean (what the margin bounds)
        then sits where the requests' p90 (what the SLO counts) meets the target."""
        if self.slo_tpot_s is None or seconds <= 0:
            return
        self.tpots.append(seconds)
        self._since_adapt += 1
        if len(self.tpots) < 16 or self._since_adapt < 8:
            return
        self._since_adapt = 0
        p90, aim = float(np.percentile(self.tpots, 90)), P90_AIM * self.slo_tpot_s
        self.tpot_p90 = p90
        if p90 > aim:
            self.margin = max(MIN_MARGIN, self.margin * max(0.8, aim / p90))
            self.tpots.clear()
        elif p90 < 0.9 * aim and self.margin < self.base_margin:
            self.margin = min(self.base_margin, self.margin * 1.05)

    @property
    def tpot_over(self) -> bool:
        """Its requests' TPOT p90, when last measured, was above P90_AIM x target: hybrid placement
        lends it no prompt until a later measure is back under (cluster/placement/routing.place_prompt)."""
        return self.tpot_p90 is not None and self.slo_tpot_s is not None and \
            self.tpot_p90 > P90_AIM * self.slo_tpot_s

    def _fit(self) -> None:
        """Fits every step kept; the prefill terms count once 8 steps with prefill are among them
        (until then a chunk is a probe). A refit that finds no cost per prefill token keeps the
        fit before it."""
        self._since_fit = 0
        rows = list(self.decode_steps) + list(self.mixed_steps)
        if len(rows) < 12:
            return
        x = np.stack([self._x(*shape) for shape, _ in rows])
        y = np.array([s for _, s in rows])
        coef = _nnls(x, y)
        # once more without the outliers (a step that compiled a kernel, a GC pause)
        res = np.abs(x @ coef - y)
        keep = res <= max(4.0 * float(np.median(res)), 1e-4)
        if keep.sum() >= 12 and not keep.all():
            coef = _nnls(x[keep], y[keep])
        prefill = len(self.mixed_steps) >= 8 and (coef[3] > 0 or coef[5] > 0)
        if self.prefill_fitted and not prefill:
            return
        self.coef, self.prefill_fitted = coef, prefill

    # ---- the cap ------------------------------------------------------------------------------
    def prefill_cap(self, running: list[Request], waiting=()) -> int | None:
        """Prefill tokens the next step may carry (None: no limit beyond the step budget)."""
        self._cap = None
        if self.slo_tpot_s is None:
            return None
        decodes = [r for r in running if r.is_decoding]
        if not decodes:
            return None
        kv = sum(r.num_tokens for r in decodes)
        nxt = next((r for r in running if not r.is_decoding), waiting[0] if waiting else None)
        if nxt is None:
            return None  # nothing to prefill
        self._cap = self.chunk_for(len(decodes), kv, nxt.num_computed_tokens, self.slack,
                                   nxt.num_tokens - nxt.num_computed_tokens)
        return self._cap

    def _room(self, decodes: int, kv: int) -> tuple[float, float]:
        """(the step's target, the slack one decode-only step leaves under it)."""
        target = self.margin * self.slo_tpot_s
        return target, max(target - self.predict(decodes, 0, kv, 0), MIN_ROOM * target)

    def _largest(self, decodes: int, kv: int, ctx: int, limit: float) -> int:
        """The largest chunk n at context `ctx` whose step with these decodes takes <= limit:
        per_token x n + per_attn x n x (ctx + n / 2) <= what the decodes leave, solved exactly
        (a fit that puts the whole prefill cost on attention has per_token 0)."""
        c = self.coef / _SCALE
        avail = limit - self.predict(decodes, 1, kv, 0)
        if avail <= 0:
            return 0
        a, b = c[5] / 2, c[3] + c[5] * ctx
        if a <= 0:
            n = avail / max(b, 1e-12)
        else:
            n = 2 * avail / (b + (b * b + 4 * a * avail) ** 0.5)  # the positive root, stable when b >> a
        return int(min(self.max_tokens, n))

    def chunk_for(self, decodes: int, kv: int, ctx: int, slack: float, remaining: int) -> int:
        """The prefill chunk for the next step. When a step with prefill costs a fixed amount
        over a decode-only one (eager mixed steps: ~20 ms), the full-bank chunk (or the
        `remaining` prompt, if less) once the banked slack pays for it, else 0 (bank more):
        the fixed cost is paid once per chunk_at() tokens. When it costs next to nothing
        (mixed steps in piecewise CUDA graphs: < SMALL_FIXED of the target), whatever fits the
        target and the slack now, every step: no long gap between a decode's tokens."""
        if not self.prefill_fitted:
            return min(PROBE_TOKENS, self.max_tokens) if slack >= 0 else 0
        target, _ = self._room(decodes, kv)
        now = self._largest(decodes, kv, ctx, target + min(slack, self._bank_cap(target)))
        if self.coef[1] < SMALL_FIXED * target:
            return min(now, remaining)
        full = self._largest(decodes, kv, ctx, target + self._bank_cap(target))
        if full <= 0:  # the decodes alone take target + a full bank: a minimal chunk each time it is
            return min(MIN_CHUNK, remaining, self.max_tokens) if slack >= self._bank_cap(target) - 1e-9 else 0
        want = max(min(full, remaining), min(MIN_CHUNK, self.max_tokens))
        return min(now, remaining) if now >= want else 0

    def _bank_cap(self, target: float) -> float:
        return BANK_STEPS * target

    def chunk_now(self, running: list[Request]) -> int:
        """The largest chunk one step may carry with the decodes running now (at full slack)."""
        decodes = [r for r in running if r.is_decoding]
        return self.chunk_at(len(decodes), sum(r.num_tokens for r in decodes))

    def prefill_rate(self, running: list[Request]) -> float | None:
        decodes = [r for r in running if r.is_decoding]
        return self.rate_at(len(decodes), sum(r.num_tokens for r in decodes))

    def chunk_at(self, decodes: int, kv: int) -> int:
        """chunk_now() for `decodes` decoding requests holding `kv` tokens."""
        if not decodes or self.slo_tpot_s is None:
            return self.max_tokens
        if not self.prefill_fitted:
            return PROBE_TOKENS
        target, _ = self._room(decodes, kv)
        return self._largest(decodes, kv, 0, target + self._bank_cap(target))

    def decode_capacity(self, ctx: int, max_seqs: int) -> int | None:
        """The most decoding requests of `ctx` context tokens each whose decode-only step fits
        margin x target (at most `max_seqs`; the ratio planner's decode capacity, cluster/pools/ratio.py).
        None before the fit or without a target."""
        if self.coef is None or self.slo_tpot_s is None or max_seqs < 1:
            return None
        limit = self.margin * self.slo_tpot_s
        lo, hi = 0, max_seqs  # the step's time grows with its rows: the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(mid, 0, mid * ctx, 0) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def capacity_table(self, max_model_len: int, max_seqs: int) -> DecodeCapacity:
        """decode_capacity() at contexts of 512, 2048, 8192 tokens and max_model_len, and the
        predicted decode-only step of that many sequences (of `max_seqs` without a target) at each
        (the engine's stats; the planner interpolates at its workload's mean). Empty before the fit."""
        if self.coef is None or max_seqs < 1:
            return DecodeCapacity()
        ctxs = sorted({c for c in (512, 2048, 8192) if c < max_model_len} | {max_model_len})
        table = {c: self.decode_capacity(c, max_seqs) for c in ctxs}
        steps = {c: self.predict(n or max_seqs, 0, (n or max_seqs) * c, 0) for c, n in table.items()}
        return DecodeCapacity.of({} if None in table.values() else table, steps)

    def rate_at(self, decodes: int, kv: int) -> float | None:
        """Prefill tokens per second this engine offers. While it decodes: one chunk of
        chunk_at() each time the decode steps have banked the slack it needs; else full
        chunks. None until measured."""
        n = self.chunk_at(decodes, kv)
        if not self.prefill_fitted:
            if decodes and self.slo_tpot_s is not None:
                return n / (self.margin * self.slo_tpot_s)
            return self.prefill_tok_s or None
        t_mixed = self.predict(decodes, n, kv, n * n / 2)
        if not decodes or self.slo_tpot_s is None:
            return n / t_mixed if t_mixed > 0 else None
        if n <= 0:
            return 0.0
        target, room = self._room(decodes, kv)
        steps = max(0.0, t_mixed - target) / room  # decode-only steps that bank one chunk's slack
        return n / (steps * self.predict(decodes, 0, kv, 0) + t_mixed)


def placement_stats(model: StepModel, scheduler: Scheduler) -> PlacementStats:
    """What placement reads of an engine (WorkerStats' fields; cluster/placement/routing.py), from its step
    model and scheduler: the live engine's stats and the capacity simulator's report the same."""
    kv = scheduler.kv
    return PlacementStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                          kv_blocks_total=kv.num_blocks, kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
                          step_s=model.step_s, slo_tpot_s=model.slo_tpot_s, tpot_margin=model.margin,
                          tpot_over=model.tpot_over, prefill_tok_s=model.prefill_rate(scheduler.running),
                          prefill_chunk=model.chunk_now(scheduler.running))


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (drops the most negative and refits)."""
    active = list(range(x.shape[1]))
    sol = np.zeros(0)
    for _ in range(x.shape[1]):
        lhs = x[:, active].T @ x[:, active] + 1e-9 * np.eye(len(active))
        sol = np.linalg.solve(lhs, x[:, active].T @ y)
        if (sol >= 0).all():
            break
        active.pop(int(np.argmin(sol)))
    coef = np.zeros(x.shape[1])
    coef[active] = np.maximum(sol, 0.0)
    return coef
