"""`ClusterSpec`: what a cluster is, parsed once from what the serving config and the flags say.

    spec = ClusterSpec.of(model, prefill=1, decode=2, mode="hybrid", serving_config="pools.yaml",
                          **engine_args)      # every argument checked, the model's config read
    Cluster(spec)                             # starts it (cluster.py); nothing is parsed again

It holds the pools (`serving`, a validated ServingConfig: sizes, bounds, SLO, autoscaling, the
handoff), each pool's engine spec (`engines`, EngineSpecs: the mode and a resolved EngineConfig
per pool), where the cluster runs (`address`, `namespace`), the local-prefill placement rules and
the start's limits. The cluster's parts read the values it set here (a pool's batch size, its
block size, its SLO) rather than from what its workers report back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.exec.loader import resolve_model_path

from .engine_specs import EngineSpecs
from .serving_config import ServingConfig

MODES = ("disaggregated", "hybrid", "colocated")
MODE_ALIASES = {"disagg": "disaggregated"}


@dataclass(frozen=True)
class LocalRules:
    """Conditional disaggregation: a prompt of at most `prefill_tokens` tokens, or one with at
    least `cached_fraction` of its tokens cached on a decode worker, prefills on that decode
    worker (defaults: off; a fraction above 1 turns the cached rule off)."""

    prefill_tokens: int = 0
    cached_fraction: float = 2.0


@dataclass
class ClusterSpec:
    serving: ServingConfig
    engines: EngineSpecs
    address: str | None = None  # None: a Ray of the cluster's own on this machine
    namespace: str = "pdserve"
    placement: LocalRules = field(default_factory=LocalRules)
    start_timeout: float = 900.0  # seconds a worker's start may take
    actor_options: dict | None = None  # Ray options for every worker actor (None: by pool, Cluster)

    @property
    def mode(self) -> str:
        return self.engines.mode

    @classmethod
    def of(cls, model: str | None = None, prefill: int | None = None, decode: int | None = None, *,
           mode: str = "disaggregated", serving_config: ServingConfig | str | None = None,
           address: str | None = None, namespace: str = "pdserve", local_prefill_tokens: int = 0,
           local_cached_fraction: float = 2.0, start_timeout: float = 900.0, actor_options: dict | None = None,
           prefill_engine_args: dict | None = None, prefill_tp: int | None = None, decode_tp: int | None = None,
           **engine_args) -> ClusterSpec:
        """`prefill` / `decode` default to the serving config's replicas (1 each without one).
        mode="disaggregated": every prompt on the prefill pool (bar the explicit local rules).
        mode="hybrid": per prompt, the prefill pool or a decode worker, whichever is predicted
        to serve the serving config's SLO (`slo`) better; decode steps keep the TPOT target.
        mode="colocated" is the baseline: `decode` engines that each prefill (chunked) and
        decode their own requests, placed by cached prefix then consistent hash; no handoff.
        `prefill_tp` / `decode_tp`: GPUs per worker of each pool (tensor parallelism; a
        handoff works between any two sizes whose KV heads divide); `tensor_parallel_size`
        sets both (colocated engines are the decode pool). Every argument is checked, and the
        model's config read, here: ValueError (TypeError for an unknown engine argument) names
        the argument, before Ray or any worker starts."""
        mode = MODE_ALIASES.get(mode, mode)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)} (or 'disagg'), got {mode!r}")
        if mode == "colocated" and prefill:
            raise ValueError("colocated mode has no prefill pool: size it with decode=N (N colocated engines)")
        serving = sized(serving_config, prefill, decode)
        engines = EngineSpecs.of(serving, mode, {**engine_args, "model": resolve_model_path(model)},
                                 prefill_engine_args, prefill_tp, decode_tp)
        return cls(serving, engines, address, namespace, LocalRules(local_prefill_tokens, local_cached_fraction),
                   start_timeout, actor_options)


def sized(cfg: ServingConfig | str | None, prefill: int | None, decode: int | None) -> ServingConfig:
    """The serving config (a path is read) with explicit pool sizes over its replicas, validated."""
    if isinstance(cfg, str):
        cfg = ServingConfig.from_yaml(cfg)
    cfg = cfg or ServingConfig()
    for role, n in (("prefill", prefill), ("decode", decode)):
        if n is not None:  # explicit sizes win over the config's replicas; bounds widen to fit
            pool = cfg.pool(role)
            pool.replicas = n
            if not cfg.autoscale.enabled:
                pool.min, pool.max = min(pool.min, n), max(pool.max, n)
    return cfg.validate()
