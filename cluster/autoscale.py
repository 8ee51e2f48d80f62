"""Serving config (a validated dataclass, loadable from YAML) and the autoscaling policy.

    prefill: {replicas: 1, min: 1, max: 4, num_gpus: 1, resources: {pdserve_prefill: 1}}
    decode:  {replicas: 1, min: 1, max: 8, num_gpus: 1, resources: {pdserve_decode: 1}}
    autoscale:
      enabled: true
      prefill_queue: 4          # waiting prompts per prefill worker
      ttft_p90_s: 2.0
      kv_usage: 0.8             # fraction of decode KV blocks in use
      itl_p90_s: 0.1
      cooldown_s: 30
      idle_s: 60

The policy grows a pool when any of its signals exceeds its target (prefill: waiting
prompts per worker, TTFT p90; decode: KV-cache usage, inter-token latency p90), by the
ratio of the worst signal to its target (at most doubling), and shrinks it by one when
every signal has stayed below `down_fraction` of its target for `idle_s` -- for usage
signals, as they would be with one worker fewer. Sizes stay within [min, max]; after a
change the pool waits `cooldown_s`. `decide` is a pure function; the cluster's monitor
feeds it and applies its answer through the same drain-then-remove path as `scale`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field, fields

ROLES = ("prefill", "decode")


@dataclass
class PoolConfig:
    replicas: int | None = None  # None: min
    min: int = 1
    max: int = 8
    num_gpus: float | None = None  # None: 1 when the Ray cluster has GPUs, else 0
    num_cpus: float | None = None
    resources: dict[str, float] | None = None  # None: pdserve_<role> when a node offers it

    def validate(self, role: str) -> None:
        for name in ("replicas", "min", "max"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"{role}: {name} must be an integer, got {v!r}")
        if not (1 <= self.min <= self.max):
            raise ValueError(f"{role}: need 1 <= min <= max, got min={self.min} max={self.max}")
        if self.replicas is None:
            self.replicas = self.min
        if not (self.min <= self.replicas <= self.max):
            raise ValueError(f"{role}: replicas={self.replicas} is outside [min={self.min}, max={self.max}]")
        for name in ("num_gpus", "num_cpus"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{role}: {name} must be >= 0, got {v}")
        if self.resources is not None:
            if not isinstance(self.resources, dict):
                raise ValueError(f"{role}: resources must be a mapping of name -> amount")
            for k, v in self.resources.items():
                if not isinstance(v, (int, float)) or v <= 0:
                    raise ValueError(f"{role}: resource {k!r} needs a positive amount, got {v!r}")


@dataclass
class AutoscaleConfig:
    enabled: bool = False
    prefill_queue: float = 4.0
    ttft_p90_s: float = 2.0
    kv_usage: float = 0.8
    itl_p90_s: float = 0.1
    cooldown_s: float = 30.0
    idle_s: float = 60.0
    down_fraction: float = 0.5
    window_s: float = 30.0  # latency samples older than this are forgotten

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "enabled" and (not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0):
                raise ValueError(f"autoscale.{f.name} must be a number >= 0, got {v!r}")
        for name in ("prefill_queue", "ttft_p90_s", "kv_usage", "itl_p90_s", "window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"autoscale.{name} must be > 0")
        if not (0 < self.kv_usage <= 1):
            raise ValueError(f"autoscale.kv_usage is a fraction in (0, 1], got {self.kv_usage}")
        if not (0 < self.down_fraction < 1):
            raise ValueError(f"autoscale.down_fraction must be in (0, 1), got {self.down_fraction}")


@dataclass
class ServingConfig:
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)

    def validate(self) -> ServingConfig:
        self.prefill.validate("prefill")
        self.decode.validate("decode")
        self.autoscale.validate()
        return self

    def pool(self, role: str) -> PoolConfig:
        return getattr(self, role)

    @classmethod
    def from_dict(cls, d: dict | None) -> ServingConfig:
        d = dict(d or {})
        unknown = set(d) - {"prefill", "decode", "autoscale"}
        if unknown:
            raise ValueError(f"unknown serving config keys: {sorted(unknown)} (expected prefill, decode, autoscale)")
        return cls(prefill=_build(PoolConfig, d.get("prefill"), "prefill"),
                   decode=_build(PoolConfig, d.get("decode"), "decode"),
                   autoscale=_build(AutoscaleConfig, d.get("autoscale"), "autoscale")).validate()

    @classmethod
    def from_yaml(cls, path: str) -> ServingConfig:
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f)
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"{path}: a serving config is a mapping, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _build(kind, d: dict | None, where: str):
    d = dict(d or {})
    names = {f.name for f in fields(kind)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown {where} keys: {sorted(unknown)} (expected {sorted(names)})")
    return kind(**d)


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
