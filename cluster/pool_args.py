"""Each pool's engine arguments: the cluster's, the prefill pool's own overrides, the pools'
tensor-parallel sizes; validated, and the pools' GPU memory shares checked
(ServingConfig.check_gpu_shares), before any worker starts."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig

from .serving_config import ROLES, ServingConfig

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


def pool_engine_args(serving: ServingConfig, mode: str, engine_args: dict, prefill_engine_args: dict | None,
                     prefill_tp: int | None, decode_tp: int | None) -> dict[str, dict]:
    """{role: engine arguments} for `mode`'s pools; `engine_args` name the model."""
    model_path = engine_args["model"]
    # the prefill pool's own engine settings (a larger chunk budget: no decodes there to delay)
    role_engine_args = {"decode": engine_args, "prefill": prefill_pool_args(engine_args, prefill_engine_args)}
    # hybrid decode workers prefill what placement lends them, with the prefill pool's budget;
    # they and colocated engines carry the TPOT target too (Pools.engine_args)
    if mode == "hybrid":
        role_engine_args["decode"] = dict(role_engine_args["prefill"])
    # each pool's tensor-parallel size: the argument, else the serving config's, else the engine's
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        pool = serving.pool(role)
        pool.tensor_parallel_size = tp if tp is not None else pool.tensor_parallel_size
        if pool.tensor_parallel_size is not None:
            role_engine_args[role] = {**role_engine_args[role], "tensor_parallel_size": pool.tensor_parallel_size}
        if role == "decode" or mode != "colocated":  # colocated has no prefill pool to check
            EngineConfig.from_kwargs(**role_engine_args[role]).resolve(model_path)
    serving.check_gpu_shares({role: EngineConfig.from_kwargs(**role_engine_args[role]).gpu_memory_utilization
                              for role in (("decode",) if mode == "colocated" else ROLES)})
    return role_engine_args
