"""`pdserve plan`: what one worker holds and serves, computed before deploying.

From a model (a Hugging Face directory or its config.json), the GPU (a preset or its
memory), dtype, KV dtype, tensor-parallel size, block size and a workload (prompt and
output lengths, or the Mooncake trace's):

    KV bytes per token       per rank and for the whole model
    weights per rank         from the model built on the meta device (exact parameter bytes)
    KV blocks per worker     the engine's own budget: memory x utilization - weights - the
                             activation bound (engine/exec/kv_cache.py), or kv_cache_memory_bytes
    max concurrent requests  paged: blocks / blocks a request ends with (prompt + output - 1
                             tokens, 16 per block); contiguous: each reserves max_model_len
    prefill:decode ratio     prefill workers per decode worker so that both keep up: a
                             prefill worker finishes prefill_tok_s / mean prompt requests/s;
                             a decode worker batch / (mean output x step time)
    layouts                  the same worker at TP 1, 2, 4 and 8 on the GPU: which hold a full
                             decode batch of the workload, the smallest that does

Rates: given (`prefill_tok_s`, `decode_step_ms`, e.g. from `bench/engine_gpu.py`), or
estimated from the GPU preset's measured ceilings and this engine's measured efficiency
on them (bench/results/engine_gpu*.md, bench/results/tp/): prefill at 80% of the bf16
matmul ceiling, decode steps at 1.25x the HBM floor of one rank's bytes. A mixture-of-experts
model counts the parameters a token activates (top_k experts of each sparse layer) for prefill,
and for a decode step the experts its batch is expected to touch under uniform routing.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass

import torch

from pdserve.engine.base.kv_layout import kv_layout
from pdserve.engine.config import EngineConfig
from pdserve.engine.exec.kv_cache import activation_bytes
from pdserve.engine.exec.runner_settings import RunnerSettings


@dataclass(frozen=True)
class Gpu:
    memory_bytes: int  # as the driver reports it
    copy_bytes_s: float  # measured device-to-device copy, read + write
    matmul_flops: float  # measured 8192^3 bf16 matmul


GPUS = {  # measured with bench/engine_gpu.py and bench/tp_gpu.py
    "h100": Gpu(81559 << 20, 2940e9, 734e12),
    "h200": Gpu(143771 << 20, 4204e9, 794e12),
}
PREFILL_EFFICIENCY = 0.8  # of the matmul ceiling (Llama-3-8B 4K prefill: 80% on H100)
DECODE_OVER_FLOOR = 1.25  # step time / HBM floor (Llama-3-8B: 1.25-1.28x on H100)


def weight_bytes(config: EngineConfig) -> int:
    """One rank's parameter and buffer bytes, from the model built on the meta device. An FP8
    block-scaled checkpoint's layers that a GPU holds in FP8 (loader.fp8_layers: linears and fused
    experts) count one byte a value and a float32 scale a block; the rest the model's dtype."""
    from pdserve.engine.base.tp import TPGroup
    from pdserve.engine.exec.loader import build_on_meta, fp8_layers
    from pdserve.engine.models.layers import hold_fp8

    run = RunnerSettings.of(config)  # the model as a runner builds it
    model = build_on_meta(run, TPGroup(0, config.tensor_parallel_size))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    model.to(dtype=config.torch_dtype)  # on meta, as the loader casts before it allocates
    quant = config.model_config.weight_quant
    # a directory of a config alone (no weights to read) is planned as its random model would load
    weights = glob.glob(os.path.join(config.model, "*.safetensors"))
    for name in fp8_layers(model, run, "auto" if weights else "dummy") if quant else ():
        hold_fp8(model.get_submodule(name), quant.block)  # e4m3 values and float32 scales, as the loader holds them
    return sum(p.numel() * p.element_size() for p in model.parameters()) + buffers


def expert_bytes(config: EngineConfig) -> tuple[int, int, float]:
    """A mixture-of-experts model's (sparse layers, experts per layer on one rank, bytes of one
    expert on one rank: gate, up and down); (0, 0, 0) for a dense model. Tensor parallel: every
    expert, I / N of each; expert parallel: E / N experts, whole."""
    moe = config.model_config.moe
    if moe is None:
        return 0, 0, 0.0
    elem = torch.empty((), dtype=config.torch_dtype).element_size()
    n = config.tensor_parallel_size
    if moe.expert_parallel:
        return sum(moe.layers), moe.num_experts // n, 3 * config.model_config.hidden_size * moe.intermediate_size * elem
    return sum(moe.layers), moe.num_experts, 3 * config.model_config.hidden_size * moe.intermediate_size // n * elem


def workload_lengths(prompt_len: int | None, output_len: int | None, trace: str | None,
                     trace_requests: int | None) -> list[tuple[int, int]]:
    if trace:
        out = []
        with open(trace) as f:
            for line in f:
                rec = json.loads(line)
                out.append((int(rec["input_length"]), max(1, int(rec["output_length"]))))
                if trace_requests and len(out) >= trace_requests:
                    break
        return out
    if not prompt_len or not output_len or prompt_len < 1 or output_len < 1:
        raise ValueError("give a workload: --prompt-len and --output-len (>= 1 each), or --trace")
    return [(prompt_len, output_len)]


TP_SIZES = (1, 2, 4, 8)  # the worker layouts `layouts` compares


def plan(model: str, lengths: list[tuple[int, int]], gpu: str | None = None, gpu_memory_gib: float | None = None,
         kv_cache_memory_bytes: int | None = None, prefill_tok_s: float | None = None,
         decode_step_ms: float | None = None, compare_layouts: bool = True, **engine_args) -> dict:
    """The plan as a dict (what `pdserve plan --json` prints). `engine_args`: EngineConfig's
    (dtype, kv_cache_dtype, tensor_parallel_size, block_size, max_model_len, max_num_seqs, ...).
    With a GPU (not a fixed KV budget) and `compare_layouts`, also `layouts`: the same worker at
    each tensor-parallel size (layouts())."""
    if os.path.isfile(model):
        model = os.path.dirname(os.path.abspath(model))
    spec = None
    if gpu is not None:
        if gpu not in GPUS:
            raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {gpu!r} (or give --gpu-memory)")
        spec = GPUS[gpu]
    engine_args.setdefault("dtype", "bfloat16")
    cfg = EngineConfig(model=model, device="cpu", kv_cache_memory_bytes=kv_cache_memory_bytes, **engine_args)
    cfg.resolve(model)
    layout, bs = kv_layout(cfg), cfg.block_size
    weights = weight_bytes(cfg)
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
    else:
        mem = int(gpu_memory_gib * (1 << 30)) if gpu_memory_gib is not None else spec.memory_bytes if spec else 0
        if not mem:
            raise ValueError("give the GPU: --gpu NAME, --gpu-memory GiB, or --kv-cache-memory-bytes")
        budget = int(mem * cfg.gpu_memory_utilization) - weights - activation_bytes(RunnerSettings.of(cfg))
    blocks = max(0, budget // layout.block_bytes)
    cap = cfg.max_model_len
    fits = [(p, o) for p, o in lengths if p + o <= cap]
    if not fits:
        raise ValueError(f"no request of the workload fits max_model_len {cap} (prompt + output); "
                         "raise --max-model-len")
    left_out, lengths = len(lengths) - len(fits), fits
    per_req = [math.ceil((p + o - 1) / bs) for p, o in lengths]
    mean_blocks = sum(per_req) / len(per_req)
    paged = int(blocks // mean_blocks) if len(set(per_req)) > 1 else blocks // per_req[0]
    contiguous = blocks // math.ceil(cap / bs)
    batch = min(paged, cfg.max_num_seqs)
    mean_p = sum(p for p, _ in lengths) / len(lengths)
    mean_o = sum(o for _, o in lengths) / len(lengths)
    kv_tok = layout.block_bytes // bs
    # a token runs top_k experts of each sparse layer; a decode step reads the experts its batch touches
    # (expected distinct experts under uniform routing), every other weight once
    sparse, experts, one = expert_bytes(cfg)
    top_k = cfg.model_config.moe.top_k if sparse else 0
    # a token's share of one rank's experts: top_k of all E (expert parallel: E / N of them here)
    pick = top_k / cfg.model_config.moe.num_experts if sparse else 0.0
    active = weights - sparse * experts * (1 - pick) * one
    params = active / torch.empty((), dtype=cfg.torch_dtype).element_size()
    if prefill_tok_s is None and spec is not None:
        prefill_tok_s = PREFILL_EFFICIENCY * spec.matmul_flops / (2 * params)
    if decode_step_ms is None and spec is not None:
        touched = experts * (1 - (1 - pick) ** batch) if sparse else 0
        step_weights = weights - sparse * (experts - touched) * one
        floor = (step_weights + batch * (mean_p + mean_o / 2) * kv_tok) / spec.copy_bytes_s
        decode_step_ms = DECODE_OVER_FLOOR * floor * 1e3
    ratio = None
    if prefill_tok_s and decode_step_ms and batch:
        prefill_rps = prefill_tok_s / mean_p
        decode_rps = batch / (mean_o * decode_step_ms / 1e3)
        ratio = decode_rps / prefill_rps
    out = {
        "model": model, "tensor_parallel_size": cfg.tensor_parallel_size, "dtype": str(cfg.torch_dtype)[6:],
        "kv_cache_dtype": layout.dtype, "block_size": bs, "max_model_len": cap,
        "kv_bytes_per_token_rank": kv_tok,
        "kv_bytes_per_token": kv_tok * cfg.tensor_parallel_size,
        "weight_bytes_rank": weights, "kv_budget_bytes_rank": budget, "kv_blocks": blocks,
        "kv_tokens": blocks * bs, "requests": len(lengths), "left_out_too_long": left_out,
        "mean_prompt": mean_p, "mean_output": mean_o,
        "max_concurrency_paged": paged, "max_concurrency_contiguous": contiguous,
        "paged_over_contiguous": paged / contiguous if contiguous else None,
        "max_num_seqs": cfg.max_num_seqs, "decode_batch": batch,
        "prefill_tok_s": prefill_tok_s, "decode_step_ms": decode_step_ms, "prefill_per_decode_worker": ratio,
        "moe": None if not sparse else {
            "sparse_layers": sparse, "experts": experts, "top_k": top_k,
            "params_total": weights / torch.empty((), dtype=cfg.torch_dtype).element_size(),
            "params_activated": params,  # what one token runs: prefill's FLOPs
            "experts_touched_at_batch": experts * (1 - (1 - pick) ** batch),  # per layer and rank, uniform routing
            "decode_weight_bytes_at_batch": weights - sparse * experts * (1 - pick) ** batch * one,
            "expert_parallel": cfg.model_config.moe.expert_parallel,
        },
    }
    if compare_layouts and kv_cache_memory_bytes is None:
        out["layouts"] = layouts(model, lengths, gpu, gpu_memory_gib, engine_args)
    return out


def layouts(model: str, lengths: list[tuple[int, int]], gpu: str | None, gpu_memory_gib: float | None,
            engine_args: dict) -> list[dict]:
    """The worker at each tensor-parallel size of TP_SIZES on this GPU, for the workload: its GPUs,
    weights per rank, KV room (tokens per worker), the workload's sequences it holds, the decode
    batch it runs (those, up to max_num_seqs) and `fits`: its weights leave KV room and the room
    holds a full decode batch (max_num_seqs sequences); a size the model cannot split to has
    `why_not`. The smallest size that fits is `best`. Experts are split by intermediate size under
    TP, or kept whole with E / N on each rank (`expert_parallel` rows, for a mixture-of-experts
    model): the same bytes per rank, a different share of them a small decode batch reads."""
    fixed = ("tensor_parallel_size", "enable_expert_parallel")  # what the rows vary
    rows, args = [], {k: v for k, v in engine_args.items() if k not in fixed}
    sparse = EngineConfig(model=model, device="cpu").resolve_model(model).model_config.moe is not None
    for tp, ep in [(tp, False) for tp in TP_SIZES] + ([(tp, True) for tp in TP_SIZES[1:]] if sparse else []):
        row = {"tensor_parallel_size": tp, "expert_parallel": ep}
        try:
            p = plan(model, lengths, gpu=gpu, gpu_memory_gib=gpu_memory_gib, compare_layouts=False,
                     tensor_parallel_size=tp, enable_expert_parallel=ep, **args)
        except ValueError as e:
            rows.append({**row, "why_not": str(e).split("\n")[0]})
            continue
        held = p["max_concurrency_paged"]
        rows.append({**row, "weight_bytes_rank": p["weight_bytes_rank"], "kv_tokens": p["kv_tokens"],
                     "sequences_held": held, "decode_batch": p["decode_batch"], "decode_step_ms": p["decode_step_ms"],
                     "fits": p["kv_blocks"] > 0 and held >= p["max_num_seqs"], "best": False})
    best = next((r for r in rows if r.get("fits")), None)
    if best is not None:
        best["best"] = True
    return rows


def render(p: dict) -> str:
    gb = 1e9
    rows = [
        ("KV per token", f"{p['kv_bytes_per_token'] / 1024:.1f} KiB ({p['kv_bytes_per_token_rank'] / 1024:.1f} "
                         f"KiB per rank, {p['kv_cache_dtype']})"),
        ("weights per rank", f"{p['weight_bytes_rank'] / gb:.2f} GB ({p['dtype']}, TP={p['tensor_parallel_size']})"),
        ("KV budget per rank", f"{p['kv_budget_bytes_rank'] / gb:.2f} GB"),
        ("KV blocks per worker", f"{p['kv_blocks']} x {p['block_size']} tokens = {p['kv_tokens']} tokens"),
        ("workload", f"{p['requests']} request(s), mean prompt {p['mean_prompt']:.0f}, "
                     f"mean output {p['mean_output']:.0f}"
                     + (f" ({p['left_out_too_long']} longer than max_model_len left out)"
                        if p["left_out_too_long"] else "")),
        ("max concurrent (paged)", f"{p['max_concurrency_paged']} (engine batch: {p['decode_batch']}, "
                                   f"max_num_seqs {p['max_num_seqs']})"),
        ("max concurrent (contiguous)", f"{p['max_concurrency_contiguous']} (each reserves max_model_len "
                                        f"{p['max_model_len']})"),
    ]
    moe = p.get("moe")
    if moe:
        rows += [("experts", f"{moe['experts']} per sparse layer ({moe['sparse_layers']} layers), {moe['top_k']} "
                             f"per token: {moe['params_activated'] / 1e9:.2f}B of {moe['params_total'] / 1e9:.2f}B "
                             "parameters a token activates (prefill's FLOPs)"),
                 ("decode batch reads", f"~{moe['experts_touched_at_batch']:.1f} of {moe['experts']} experts per "
                                        f"layer at batch {p['decode_batch']} (uniform routing): "
                                        f"{moe['decode_weight_bytes_at_batch'] / gb:.2f} GB of weights a step")]
    if p["paged_over_contiguous"]:
        rows.append(("paged / contiguous", f"{p['paged_over_contiguous']:.2f}x"))
    if p["prefill_per_decode_worker"] is not None:
        rows += [("prefill rate", f"{p['prefill_tok_s']:.0f} tok/s per worker"),
                 ("decode step", f"{p['decode_step_ms']:.2f} ms at batch {p['decode_batch']}"),
                 ("prefill : decode workers", f"{p['prefill_per_decode_worker']:.2f} : 1")]
    w = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)
    if p.get("layouts"):
        text += "\n\nlayouts (one worker on this GPU; full batch: the KV room holds max_num_seqs of these requests)"
        for r in p["layouts"]:
            if "why_not" in r:
                text += f"\n  {'EP' if r['expert_parallel'] else 'TP'}={r['tensor_parallel_size']}: not possible " \
                        f"({r['why_not']})"
                continue
            verdict = ("fits" + (" (the smallest that does)" if r["best"] else "")) if r["fits"] else \
                "does not hold a full batch" if r["kv_tokens"] else "no KV room after the weights"
            name = f"{'EP' if r['expert_parallel'] else 'TP'}={r['tensor_parallel_size']}"
            step = f", step ~{r['decode_step_ms']:.1f} ms" if r["decode_step_ms"] and r["kv_tokens"] else ""
            text += (f"\n  {name}: weights {r['weight_bytes_rank'] / gb:.2f} GB per rank, "
                     f"KV {r['kv_tokens']} tokens, holds {r['sequences_held']} requests, decode batch "
                     f"{r['decode_batch']} of {p['max_num_seqs']}{step}: {verdict}")
    return text
