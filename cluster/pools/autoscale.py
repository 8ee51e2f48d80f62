"""The autoscaling policy: when a pool grows or shrinks, from its signals.

The policy grows a pool when any of its signals exceeds its target (prefill: waiting
prompts per worker, TTFT p90; decode: KV-cache usage, inter-token latency p90), by the
ratio of the worst signal to its target (at most doubling), and shrinks it by one when
every signal has stayed below `down_fraction` of its target for `idle_s` -- for usage
signals, as they would be with one worker fewer. Sizes stay within [min, max]; after a
change the pool waits `cooldown_s`. `decide` is a pure function; the pools' monitor
(pools.py) feeds it and applies its answer through the same drain-then-remove path as
`scale`. Targets and bounds: serving_config.py.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from ..spec.serving_config import ROLES, AutoscaleConfig, PoolConfig


class LatencyWindow:
    """Samples (time, seconds) kept for `window_s`; p90 of the recent ones."""

    def __init__(self, window_s: float = 30.0, maxlen: int = 20000):
        self.window_s = window_s
        self.samples: deque = deque(maxlen=maxlen)

    def add(self, value: float, now: float | None = None) -> None:
        self.samples.append((time.monotonic() if now is None else now, value))

    def quantile(self, q: float, now: float | None = None) -> float:
        """0.0 when there are no recent samples (an idle pool has no latency problem)."""
        now = time.monotonic() if now is None else now
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()
        vals = sorted(v for _, v in self.samples)
        if not vals:
            return 0.0
        return vals[max(0, math.ceil(q * len(vals)) - 1)]  # nearest-rank


@dataclass
class PoolSignals:
    """What the policy sees of one pool. For prefill: queue = waiting prompts per worker,
    latency = TTFT p90. For decode: usage = KV blocks used / total, latency = ITL p90."""

    size: int
    queue: float = 0.0
    usage: float = 0.0
    latency: float = 0.0


@dataclass
class PoolState:
    last_change: float = -math.inf
    calm_since: float | None = None


def decide(role: str, s: PoolSignals, cfg: AutoscaleConfig, pool: PoolConfig, state: PoolState,
           now: float) -> tuple[int, str]:
    """The size this pool should have now, and why ("" when unchanged)."""
    if role == "prefill":
        ratios = {"queue": s.queue / cfg.prefill_queue, "ttft_p90": s.latency / cfg.ttft_p90_s}
        # per-worker queue scales with 1/size; TTFT is not a per-worker quantity
        shrunk = {"queue": ratios["queue"] * s.size / max(1, s.size - 1), "ttft_p90": ratios["ttft_p90"]}
    else:
        ratios = {"kv_usage": s.usage / cfg.kv_usage, "itl_p90": s.latency / cfg.itl_p90_s}
        shrunk = {"kv_usage": ratios["kv_usage"] * s.size / max(1, s.size - 1), "itl_p90": ratios["itl_p90"]}
    worst = max(ratios, key=ratios.get)
    size = min(max(s.size, pool.min), pool.max)
    if size != s.size:  # outside its bounds (e.g. bounds changed): fix first
        return size, "bounds"
    cooling = now - state.last_change < cfg.cooldown_s
    if ratios[worst] > 1.0:
        state.calm_since = None
        if cooling or size >= pool.max:
            return size, ""
        want = min(pool.max, max(size + 1, min(2 * size, math.ceil(size * ratios[worst]))))
        return want, f"{worst} {ratios[worst]:.2f}x target"
    if max(shrunk.values()) < cfg.down_fraction:
        if state.calm_since is None:
            state.calm_since = now
        if size > pool.min and not cooling and now - state.calm_since >= cfg.idle_s:
            return size - 1, "idle"
    else:
        state.calm_since = None
    return size, ""


def pool_signals(workers, ttft: LatencyWindow, itl: LatencyWindow, now: float) -> dict[str, PoolSignals]:
    """The policy's inputs, from the workers' records (their last stats) and the latency windows."""
    out = {}
    for role in ROLES:
        live = [w for w in workers if w.role == role and not w.draining and not w.switching_to]
        n = max(1, len(live))
        if role == "prefill":
            waiting = sum(w.stats.num_waiting for w in live)
            out[role] = PoolSignals(len(live), queue=waiting / n, latency=ttft.quantile(0.9, now))
        else:
            used = sum(w.stats.kv_blocks_used for w in live)
            total = sum(w.blocks_total for w in live)
            out[role] = PoolSignals(len(live), usage=used / total if total else 0.0, latency=itl.quantile(0.9, now))
    return out
