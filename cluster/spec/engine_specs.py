"""Each pool's engine spec (`EngineSpecs`): the cluster's engine arguments, the prefill pool's
own overrides and each pool's tensor-parallel size, parsed into an `EngineConfig` once per role
and resolved against the model where the cluster starts; the pools' GPU memory shares checked
(ServingConfig.check_gpu_shares) before any worker starts. A spec crosses to its workers as it
is: a worker parses no argument and reads no model config again (EngineConfig.resolve_model)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.engine.base.kv_window import check_window_mode
from pdserve.engine.config import EngineConfig

from .serving_config import ServingConfig

PREFILL_CHUNK_TOKENS = 8192


def prefill_pool_args(engine_args: dict, overrides: dict | None = None) -> dict:
    """The prefill pool's engine arguments: the cluster's, then its own overrides; the
    chunk budget defaults to PREFILL_CHUNK_TOKENS, so most prompts run as one chunk
    (fewer chunks that re-read their prefix's KV; on the trace's lengths, one H200:
    2048 -> 8192 cut prefill time 17.1 -> 11.6 s, bench/results/prefill_shapes.md)."""
    out = {**engine_args, **(overrides or {})}
    if out.get("max_num_batched_tokens") is None:
        out["max_num_batched_tokens"] = PREFILL_CHUNK_TOKENS
    return out


@dataclass(frozen=True)
class EngineSpecs:
    """The resolved engine spec of each pool a cluster of `mode` has: `prefill` is None in
    colocated mode (no prefill pool). Hybrid decode workers prefill what placement lends them
    with the prefill pool's chunk budget; they and colocated engines take the serving SLO's
    TPOT target as a worker starts (Pools.spec), not here."""

    mode: str
    decode: EngineConfig
    prefill: EngineConfig | None = None

    @classmethod
    def of(cls, serving: ServingConfig, mode: str, engine_args: dict, prefill_engine_args: dict | None = None,
           prefill_tp: int | None = None, decode_tp: int | None = None) -> EngineSpecs:
        """`engine_args` name the model (a resolved path). `prefill_tp` / `decode_tp`: each pool's
        tensor-parallel size; None: the serving config's, else the engine arguments'. Raises
        ValueError (TypeError for an unknown name) naming the argument."""
        model_path = engine_args["model"]
        args = {"decode": engine_args, "prefill": prefill_pool_args(engine_args, prefill_engine_args)}
        if mode == "hybrid":
            args["decode"] = dict(args["prefill"])
        args["prefill"] = {**args["prefill"], "decode_batch_len": None}  # a prefill worker holds no decode batch
        specs = {}
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            pool = serving.pool(role)
            pool.tensor_parallel_size = tp if tp is not None else pool.tensor_parallel_size
            if pool.tensor_parallel_size is not None:
                args[role] = {**args[role], "tensor_parallel_size": pool.tensor_parallel_size}
            if role == "decode" or mode != "colocated":  # colocated has no prefill pool to check
                specs[role] = EngineConfig.from_kwargs(**args[role]).resolve_model(model_path)
        check_window_mode(specs["decode"], mode)
        serving.check_gpu_shares({role: spec.gpu_memory_utilization for role, spec in specs.items()})
        return cls(mode, specs["decode"], specs.get("prefill"))

    def get(self, role: str) -> EngineConfig | None:
        return self.prefill if role == "prefill" else self.decode

    def tp(self, role: str) -> int:
        """GPUs per worker of the pool (1 for a pool the mode lacks)."""
        spec = self.get(role)
        return spec.tensor_parallel_size if spec is not None else 1

    def worker(self, role: str, **changes) -> EngineConfig:
        """The spec a new `role` worker starts from: the pool's, with `changes` (its TPOT target,
        its persistence slot's directory). Raises ValueError for a pool the mode lacks."""
        spec = self.get(role)
        if spec is None:
            raise ValueError(f"a {self.mode} cluster has no {role} pool")
        return dataclasses.replace(spec, **changes) if changes else spec
