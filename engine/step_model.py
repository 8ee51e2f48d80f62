"""The step-time model: how long an engine step takes, learned online, and from it the
prefill chunk a step may carry without breaking a time-per-output-token (TPOT) target.

Every step is timed (the model runner's call; it ends on the host copy of the sampled
tokens, so the GPU's time is in it) and kept with its shape:

    seconds ~ base + mixed + per_seq * decodes + per_token * prefill_tokens
              + per_kv * decode_context_tokens + per_attn * prefill_tokens x their context

`mixed` is what a step with prefill tokens costs beyond a decode-only one (on CUDA a
decode-only step replays a CUDA graph; a mixed step runs eagerly). The coefficients are
a least-squares fit (non-negative) over the last 256 decode-only and the last 256 steps
with prefill tokens, refitted every 16 steps.

With a target (`slo_tpot_s`), a step that runs decodes may carry at most

    prefill_cap = the largest chunk whose predicted step time <= margin x target

tokens of prefill (chunked prefill does the rest in later steps), so the decodes of that
step keep their TPOT while the worker also prefills: this is what lets a decode worker
take prompts from a deep prefill queue (hybrid placement, cluster/dispatch.py). Until the
fit has seen 8 steps with prefill tokens the cap is a probe of PROBE_TOKENS; when the
decodes alone already take the target it is MIN_TOKENS (progress, and the cluster's
placement sees the small rate and sends no more prompts there). With no decodes running
there is nothing to protect: the step budget (`max_num_batched_tokens`) applies.
"""

from __future__ import annotations

import collections
import time
from contextlib import contextmanager

import numpy as np

from .request import Request

PROBE_TOKENS = 256
MIN_TOKENS = 16
_SCALE = np.array([1.0, 1.0, 64.0, 1024.0, 262144.0, 4.0 * 2**20])  # features to ~unit size


class StepModel:
    def __init__(self, max_tokens: int, slo_tpot_s: float | None = None, margin: float = 0.85):
        self.max_tokens = max_tokens  # the engine's max_num_batched_tokens
        self.slo_tpot_s = slo_tpot_s
        self.margin = margin
        self.decode_steps: collections.deque = collections.deque(maxlen=256)
        self.mixed_steps: collections.deque = collections.deque(maxlen=256)
        self.coef: np.ndarray | None = None  # per feature, in _SCALE units
        self._since_fit = 0
        self.step_s = 0.0  # EWMA of every step's seconds
        self.prefill_tok_s = 0.0  # EWMA of prefill tokens / second over steps with >= 64 of them
        self.last: dict = {}  # the last step: decodes, prefill_tokens, cap, seconds (tests, stats)
        self._cap: int | None = None

    # ---- features ------------------------------------------------------------------------
    @staticmethod
    def _shape(scheduled) -> tuple[int, int, int, int]:
        decodes = prefill = kv = attn = 0
        for s in scheduled:
            r = s.request
            if s.num_new_tokens == 1 and r.is_decoding:
                decodes += 1
                kv += r.num_tokens
            else:
                prefill += s.num_new_tokens
                attn += s.num_new_tokens * (r.num_computed_tokens + s.num_new_tokens // 2)
        return decodes, prefill, kv, attn

    @staticmethod
    def _x(decodes: int, prefill: int, kv: int, attn: float) -> np.ndarray:
        return np.array([1.0, 1.0 if prefill else 0.0, decodes, prefill, kv, attn]) / _SCALE

    def predict(self, decodes: int, prefill: int, kv: int, attn: float) -> float | None:
        if self.coef is None:
            return None
        return float(self._x(decodes, prefill, kv, attn) @ self.coef)

    # ---- observing steps ----------------------------------------------------------------------
    @contextmanager
    def timed(self, scheduled):
        """Times the model's part of one step and learns from it."""
        t0 = time.perf_counter()
        yield
        self.observe(scheduled, time.perf_counter() - t0)

    def observe(self, scheduled, seconds: float) -> None:
        shape = self._shape(scheduled)
        (self.mixed_steps if shape[1] else self.decode_steps).append((shape, seconds))
        self.step_s = seconds if not self.step_s else 0.9 * self.step_s + 0.1 * seconds
        if shape[1] >= 64 and seconds > 0:  # prefill throughput as measured (before the fit)
            rate = shape[1] / seconds
            self.prefill_tok_s = rate if not self.prefill_tok_s else 0.8 * self.prefill_tok_s + 0.2 * rate
        self.last = {"decodes": shape[0], "prefill_tokens": shape[1], "cap": self._cap, "seconds": seconds}
        self._since_fit += 1
        if self._since_fit >= 16 or (self.coef is None and len(self.mixed_steps) >= 8):
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        rows = list(self.decode_steps) + list(self.mixed_steps)
        if len(self.mixed_steps) < 8 or len(rows) < 12:
            return
        x = np.stack([self._x(*shape) for shape, _ in rows])
        y = np.array([s for _, s in rows])
        coef = _nnls(x, y)
        # once more without the outliers (a step that compiled a kernel, a GC pause)
        res = np.abs(x @ coef - y)
        keep = res <= max(4.0 * float(np.median(res)), 1e-4)
        if keep.sum() >= 12 and not keep.all():
            coef = _nnls(x[keep], y[keep])
        if coef[3] <= 0 and coef[5] <= 0:
            return  # no cost per prefill token seen yet: keep probing
        self.coef = coef

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
        ctx = next((r.num_computed_tokens for r in running if not r.is_decoding),
                   waiting[0].num_computed_tokens if waiting else 0)
        self._cap = self.chunk_for(len(decodes), kv, ctx)
        return self._cap

    def chunk_for(self, decodes: int, kv: int, ctx: int) -> int:
        """The largest prefill chunk (at context `ctx`) that keeps a step with these decodes
        inside margin x the TPOT target."""
        if self.coef is None:
            return min(PROBE_TOKENS, self.max_tokens)
        avail = self.margin * self.slo_tpot_s - self.predict(decodes, 1, kv, 0)
        c = self.coef / _SCALE
        per_token = c[3]  # seconds per prefill token, before attention
        if avail <= 0:
            return MIN_TOKENS
        n = avail / max(per_token + c[5] * ctx, 1e-12)
        n = avail / max(per_token + c[5] * (ctx + n / 2), 1e-12)  # the chunk's own attention
        return int(max(MIN_TOKENS, min(self.max_tokens, n)))

    def chunk_now(self, running: list[Request]) -> int:
        """The prefill chunk a step may carry with the decodes running now."""
        decodes = [r for r in running if r.is_decoding]
        if not decodes or self.slo_tpot_s is None:
            return self.max_tokens
        return self.chunk_for(len(decodes), sum(r.num_tokens for r in decodes), 0)

    def prefill_rate(self, running: list[Request]) -> float | None:
        """Prefill tokens per second this engine offers now: at the cap while it decodes
        (one capped chunk per step of ~margin x target), else at full chunks. None until
        it has been measured."""
        decodes = [r for r in running if r.is_decoding]
        n = self.chunk_now(running)
        if self.coef is not None:
            t = self.predict(len(decodes), n, sum(r.num_tokens for r in decodes), n * n / 2)
            if t and t > 0:
                return n / t
        if decodes and self.slo_tpot_s is not None:
            return n / (self.margin * self.slo_tpot_s)
        return self.prefill_tok_s or None


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
