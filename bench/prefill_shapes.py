"""Prefill on the trace's mixed prompt lengths, on one GPU: where the time goes.

The served disaggregated TTFT on the Mooncake trace was ~4x what an ideal FCFS queue
at the measured 4K-token prefill rate predicts, while fixed 4K prompts were served at
that rate. This measures the two differences the trace brings, outside any server:

1. SDPA on a sequence length it has not seen: first call vs repeat, per backend
   (some backends build an execution plan per shape).
2. The prefill engine on the trace's first N prompt lengths (lengths x0.25, <= 8000),
   one at a time, cold (first time each length is seen) then warm, for chunk budgets
   (`max_num_batched_tokens`) 2048 and 8192: ms per request against tokens / 4K rate.

    python bench/prefill_shapes.py --trace mooncake_conversation_trace.jsonl --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_gpu import build_model  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def sdpa_cold_warm(lengths: list[int]) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"default": None, "flash": [SDPBackend.FLASH_ATTENTION],
                "efficient": [SDPBackend.EFFICIENT_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION]}
    rows = []
    for name, allowed in backends.items():
        cold = warm = 0.0
        try:
            for i, n in enumerate(lengths):
                n = n + 7 * i + {"default": 1, "flash": 2, "efficient": 3, "cudnn": 5}[name]  # unseen
                q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)

                def run(q=q, k=k, allowed=allowed):
                    if allowed is None:
                        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
                    else:
                        with sdpa_kernel(allowed):
                            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
                cold += timed(run)
                warm += timed(run)
            rows.append({"backend": name, "cold_ms": 1e3 * cold / len(lengths), "warm_ms": 1e3 * warm / len(lengths)})
        except RuntimeError as e:
            rows.append({"backend": name, "error": str(e).splitlines()[0][:120]})
    return rows


def trace_lengths(path: str, n: int, scale: float, cap: int) -> list[int]:
    out = []
    with open(path) as f:
        for line in f:
            out.append(min(cap, max(1, int(json.loads(line)["input_length"] * scale))))
            if len(out) == n:
                break
    return out


def engine_pass(engine, lengths: list[int], salt: int) -> list[float]:
    from pdserve.engine.sampling_params import SamplingParams

    rng = random.Random(salt)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i, n in enumerate(lengths):
        req = engine.make_request([rng.randrange(100, 40000) for _ in range(n)], sp, f"s{salt}-{i}")
        engine.add_request(req)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--num", type=int, default=96)
    ap.add_argument("--budgets", default="2048,8192")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    lengths = trace_lengths(args.trace, args.num, 0.25, 8000)
    sdpa = sdpa_cold_warm(lengths[:24])
    model = build_model(os.path.join(tempfile.mkdtemp(), "llama3-8b-shape"), args.tokenizer)
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "lengths": lengths,
              "sdpa": sdpa, "engine": []}
    for budget in [int(b) for b in args.budgets.split(",")]:
        engine = LLMEngine(EngineConfig.from_kwargs(
            model=model, load_format="dummy", dtype="bfloat16", max_model_len=8704,
            gpu_memory_utilization=0.5, max_num_batched_tokens=budget))
        engine_pass(engine, [4096] * 4, 0)  # warm-up at the synthetic shape
        t4k = min(engine_pass(engine, [4096] * 3, 1))
        cold = engine_pass(engine, lengths, 2)
        warm = engine_pass(engine, lengths, 3)
        ideal = [n / 4096 * t4k for n in lengths]
        result["engine"].append({"budget": budget, "ms_4k": 1e3 * t4k, "cold_s": sum(cold), "warm_s": sum(warm),
                                 "ideal_s": sum(ideal), "cold": cold, "warm": warm,
                                 "worst": sorted(zip(cold, lengths), reverse=True)[:5]})
        del engine
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill_shapes.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = table(result)
    with open(os.path.join(args.out, "prefill_shapes.md"), "w") as f:
        f.write(text)
    print(text)


def table(result: dict) -> str:
    lengths = result["lengths"]
    lines = [f"# Prefill on the trace's prompt lengths ({result['gpu']}, torch {result['torch']})", "",
             f"{len(lengths)} trace prompts (lengths x0.25, <= 8000), {sum(lengths)} tokens "
             f"(mean {sum(lengths) / len(lengths):.0f}); `python3 bench/prefill_shapes.py`", "",
             "| SDPA backend (causal, GQA 32:8, d 128) | unseen length ms | repeat ms |", "| --- | --- | --- |"]
    for r in result["sdpa"]:
        if "error" in r:
            lines.append(f"| {r['backend']} | - | - ({r['error']}) |")
        else:
            lines.append(f"| {r['backend']} | {r['cold_ms']:.2f} | {r['warm_ms']:.2f} |")
    lines += ["", "Engine, one prompt at a time (cold: each length seen for the first time):", "",
              "| chunk budget | 4K prompt ms | trace cold s | trace warm s | ideal at the 4K rate s |",
              "| --- | --- | --- | --- | --- |"]
    for e in result["engine"]:
        lines.append(f"| {e['budget']} | {e['ms_4k']:.1f} | {e['cold_s']:.2f} | {e['warm_s']:.2f} "
                     f"| {e['ideal_s']:.2f} |")
    for e in result["engine"]:
        worst = ", ".join(f"{a * 1e3:.0f} ms ({b} tok)" for a, b in e["worst"])
        lines.append(f"\nslowest cold prompts at budget {e['budget']}: {worst}")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
