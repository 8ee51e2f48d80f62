"""The serving config: a validated dataclass, loadable from YAML (`--config`).

    prefill: {replicas: 1, min: 1, max: 4, num_gpus: 1, resources: {pdserve_prefill: 1},
              tensor_parallel_size: 2}   # GPUs per worker (one Ray actor each, packed on one node)
    decode:  {replicas: 1, min: 1, max: 8, num_gpus: 1, resources: {pdserve_decode: 1}}
                                 # num_gpus < 1: workers share a GPU (check_gpu_shares)
    autoscale:
      enabled: true
      prefill_queue: 4          # waiting prompts per prefill worker
      ttft_p90_s: 2.0
      kv_usage: 0.8             # fraction of decode KV blocks in use
      itl_p90_s: 0.1
      cooldown_s: 30
      idle_s: 60
      switch_roles: true        # no node to add: move a calm worker from the other pool
      policy: signals           # or ratio: keep the workers there are and move them between the
                                # pools to the prefill:decode split the measured load needs (ratio.py)
      max_workers: null         # both pools together (e.g. the GPUs there are); null: no cap
    slo:                        # what hybrid placement serves (--slo-ttft, --slo-tpot)
      ttft_s: 2.0
      tpot_s: 0.05
      spill_at: 0.5             # prompts spill to decode workers past this x ttft_s predicted
    handoff:
      timeout_s: 30             # a KV handoff not done by then fails (--handoff-timeout); long
                                # prompts on a busy host may need more
      wait_s: 300               # a decode worker's reservation waits this long for its prompt's
                                # prefill (queued behind others) to start the handoff
      same_node: true           # pairs on one host pull KV through CUDA IPC / shared memory
      peer_fetch: true          # a prefix another worker's GPU caches is fetched over the same
                                # links when predicted faster than recomputing it (transfer/fetch.py)

Pools: sizes and bounds, and the Ray resources each pool's actors request. The
autoscaling targets are what the policy (autoscale.py) compares its signals with. The
SLO is what hybrid placement (routing.place_prompt) and the decode workers' step budget
(engine/core/step_model.py) hold to.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields

ROLES = ("prefill", "decode")
POLICIES = ("signals", "ratio")


@dataclass
class PoolConfig:
    replicas: int | None = None  # None: min
    min: int = 1
    max: int = 8
    num_gpus: float | None = None  # None: 1 when the Ray cluster has GPUs, else 0
    num_cpus: float | None = None
    resources: dict[str, float] | None = None  # None: pdserve_<role> when a node offers it
    # each worker's GPUs (num_gpus per rank); None: the engine's tensor_parallel_size (1)
    tensor_parallel_size: int | None = None

    def validate(self, role: str) -> None:
        for name in ("replicas", "min", "max", "tensor_parallel_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"{role}: {name} must be an integer, got {v!r}")
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise ValueError(f"{role}: tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
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
    switch_roles: bool = True  # a pool that must grow when no worker can be added takes one from the other
    max_workers: int | None = None  # prefill + decode workers at most (None: as many as Ray places)
    policy: str = "signals"  # "signals" (autoscale.py: each pool's own) or "ratio" (ratio.py: the split)

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("enabled", "switch_roles"):
                if not isinstance(v, bool):
                    raise ValueError(f"autoscale.{f.name} must be true or false, got {v!r}")
            elif f.name == "policy":
                if v not in POLICIES:
                    raise ValueError(f"autoscale.policy must be one of {', '.join(POLICIES)}, got {v!r}")
            elif f.name == "max_workers":
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 2):
                    raise ValueError(f"autoscale.max_workers must be an integer >= 2 or null, got {v!r}")
            elif not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"autoscale.{f.name} must be a number >= 0, got {v!r}")
        for name in ("prefill_queue", "ttft_p90_s", "kv_usage", "itl_p90_s", "window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"autoscale.{name} must be > 0")
        if not (0 < self.kv_usage <= 1):
            raise ValueError(f"autoscale.kv_usage is a fraction in (0, 1], got {self.kv_usage}")
        if not (0 < self.down_fraction < 1):
            raise ValueError(f"autoscale.down_fraction must be in (0, 1), got {self.down_fraction}")


@dataclass
class SloConfig:
    ttft_s: float = 2.0
    tpot_s: float = 0.05
    spill_at: float = 0.5  # fraction of ttft_s

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"slo.{f.name} must be a number > 0, got {v!r}")
        if self.spill_at > 1:
            raise ValueError(f"slo.spill_at is a fraction of slo.ttft_s in (0, 1], got {self.spill_at}")


@dataclass
class HandoffConfig:
    timeout_s: float = 30.0  # a reservation, send or receive of one request's KV
    # a reserved receive waits this long for its sender's order, i.e. for the prompt's prefill,
    # which may queue behind others (a burst): a receive that gave up would fail a request that
    # is only late, and its retry would add to the queue that made it late
    wait_s: float = 300.0
    # a pair on one host whose peer's KV maps into the receiver pulls it (CUDA IPC / shared
    # memory, transfer/pull.py); false: always NCCL (gloo on CPU)
    same_node: bool = True
    # the worker placed to prefill a prompt fetches the prefix another worker's GPU caches, over
    # the same links, when placement predicts that faster than recomputing it; false: recompute
    peer_fetch: bool = True

    def validate(self) -> None:
        for name in ("timeout_s", "wait_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"handoff.{name} must be a number > 0, got {v!r}")
        for name in ("same_node", "peer_fetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"handoff.{name} must be true or false, got {getattr(self, name)!r}")


@dataclass
class ServingConfig:
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    handoff: HandoffConfig = field(default_factory=HandoffConfig)

    def validate(self) -> ServingConfig:
        self.prefill.validate("prefill")
        self.decode.validate("decode")
        self.autoscale.validate()
        self.slo.validate()
        self.handoff.validate()
        return self

    def pool(self, role: str) -> PoolConfig:
        return getattr(self, role)

    def check_gpu_shares(self, utilization: dict[str, float]) -> None:
        """Refuses pools whose workers, packed onto one GPU as Ray may pack them (fractional
        `num_gpus`), would together claim more than all of its memory: each worker's
        `gpu_memory_utilization` is its own share of the GPU (`utilization`: per role, the roles
        that run). Whole-GPU and CPU pools share nothing."""
        def ranks(p: PoolConfig) -> int:  # the pool's processes at most: its workers' ranks
            return (p.max if self.autoscale.enabled else p.replicas) * (p.tensor_parallel_size or 1)

        sharing = {r: (self.pool(r).num_gpus, u, ranks(self.pool(r))) for r, u in utilization.items()
                   if self.pool(r).num_gpus is not None and 0 < self.pool(r).num_gpus < 1}
        if not sharing:
            return
        shares = list(sharing.values())
        packs = [c for c in itertools.product(*(range(min(n, int(1 / g + 1e-9)) + 1) for g, _, n in shares))
                 if sum(k * g for k, (g, _, _) in zip(c, shares)) <= 1 + 1e-9]
        counts = max(packs, key=lambda c: sum(k * u for k, (_, u, _) in zip(c, shares)))
        best = sum(k * u for k, (_, u, _) in zip(counts, shares))
        pack = dict(zip(sharing, counts))
        if best > 1 + 1e-9:
            who = " + ".join(f"{n} {r} worker{'s' if n > 1 else ''} (num_gpus {sharing[r][0]:g}, "
                             f"gpu_memory_utilization {sharing[r][1]:g})" for r, n in pack.items() if n)
            raise ValueError(f"GPU memory shares add up past 1.0 on one GPU: {who} = {best:.2f} of its memory; "
                             "gpu_memory_utilization is each worker's own share: lower it so the workers one GPU "
                             "holds add up to at most 1")

    @classmethod
    def from_dict(cls, d: dict | None) -> ServingConfig:
        d = dict(d or {})
        unknown = set(d) - {"prefill", "decode", "autoscale", "slo", "handoff"}
        if unknown:
            raise ValueError(f"unknown serving config keys: {sorted(unknown)} "
                             "(expected prefill, decode, autoscale, slo, handoff)")
        return cls(prefill=_build(PoolConfig, d.get("prefill"), "prefill"),
                   decode=_build(PoolConfig, d.get("decode"), "decode"),
                   autoscale=_build(AutoscaleConfig, d.get("autoscale"), "autoscale"),
                   slo=_build(SloConfig, d.get("slo"), "slo"),
                   handoff=_build(HandoffConfig, d.get("handoff"), "handoff")).validate()

    @classmethod
    def from_yaml(cls, path: str) -> ServingConfig:
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ValueError(f"cannot read the serving config {path}: {e.strerror}") from None
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
