"""The engine's decode step with and without the overlapped step (engine/core/overlap.py), on one
GPU: whole LLMEngine.step() calls (scheduling, inputs, the model, sampling, outputs,
detokenizing), per step in steady decode, against the HBM floor; and the GPU's idle share of
a step (torch profiler: kernel time over wall time).

Model: random weights with Llama-3-8B's config in bf16 (bench/engine_gpu.py), context 1024.

    python bench/decode_overlap_gpu.py --tokenizer TOKENIZER_DIR --out bench/results/overlap
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch
from engine_gpu import LLAMA3_8B, ceilings, model_bytes, profile_step
from tqdm import tqdm


def steady(eng, batch: int, ctx: int, rng: random.Random) -> list:
    """`batch` requests of `ctx` prompt tokens, prefilled, every one decoding."""
    from pdserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=eng.config.max_model_len - ctx, ignore_eos=True)
    reqs = [eng.add_request([rng.randrange(100, 30000) for _ in range(ctx)], sp) for _ in range(batch)]
    while not all(r.is_decoding for r in reqs):
        eng.step()
    return reqs


def time_steps(eng, n: int) -> float:
    """Seconds per engine step over n steps (the GPU drained at both ends)."""
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def bench(model_dir: str, tokenizer: str, batches: list[int], ctx: int, steps: int, ceil: dict,
          cfg: dict = LLAMA3_8B) -> list[dict]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    bs = 16
    top = max(batches)
    ec = EngineConfig(model=model_dir, tokenizer=tokenizer, dtype="bfloat16", load_format="dummy",
                      max_model_len=ctx + 4 * steps + 256, max_num_seqs=top, max_num_batched_tokens=8192,
                      num_gpu_blocks_override=top * ((ctx + 4 * steps + 200) // bs + 2) + 16)
    eng = LLMEngine(ec, load_format="dummy")
    body_params, _ = model_bytes(cfg)
    kv_token_bytes = eng.runner.layout.block_bytes // bs
    rng = random.Random(0)
    rows = []
    for batch in tqdm(batches, desc="batches"):
        reqs = steady(eng, batch, ctx, rng)
        row = {"batch": batch, "context": ctx}
        for overlap in (False, True):
            eng.config.async_scheduling = overlap
            key = "on" if overlap else "off"
            row[f"step_ms_{key}"] = time_steps(eng, steps) * 1e3
            prof = profile_step(eng.step, steps=10)
            row[f"gpu_idle_{key}"] = max(0.0, 1 - prof["gpu_busy_us"] / prof["wall_us"])
            row[f"profile_{key}"] = prof
        mean_ctx = sum(r.num_tokens for r in reqs) / len(reqs)
        read = body_params * 2 + batch * mean_ctx * kv_token_bytes + batch * cfg["hidden_size"] * 2
        row["floor_ms"] = read / (ceil["copy_GBps"] * 1e9) * 1e3
        row["ratio_off"] = row["step_ms_off"] / row["floor_ms"]
        row["ratio_on"] = row["step_ms_on"] / row["floor_ms"]
        rows.append(row)
        for r in reqs:
            eng.abort_request(r.request_id)
        eng.step()  # the step still in flight, if any
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/overlap")
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer files (any model's)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--vocab", type=int, default=LLAMA3_8B["vocab_size"],
                    help="the model's vocabulary (49152: SmolLM2's tokenizer, the served benchmark's model)")
    return ap


def main() -> None:
    args = parser().parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    os.makedirs(args.out, exist_ok=True)
    ceil = ceilings()
    torch.cuda.empty_cache()
    cfg = dict(LLAMA3_8B, vocab_size=args.vocab)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        rows = bench(d, args.tokenizer, batches, args.ctx, args.steps, ceil, cfg)
    device = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "decode_overlap_gpu.json"), "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "vocab": args.vocab, "ceilings": ceil, "rows": rows},
                  f, indent=2)
    lines = [f"# Decode steps with and without overlap on {device}", "",
             f"Llama-3-8B config (vocabulary {args.vocab}), random bf16 weights, context {args.ctx}, greedy; "
             "whole `LLMEngine.step()` "
             f"calls in steady decode, mean of {args.steps}. HBM floor: weights + KV read at the copy "
             f"bandwidth measured in the same run ({ceil['copy_GBps']:.0f} GB/s). GPU idle: 1 - kernel time / "
             "wall time over 10 steps (torch profiler).", "",
             "| batch | step ms, in turn | step ms, overlapped | HBM floor ms | / floor, in turn | "
             "/ floor, overlapped | GPU idle, in turn | GPU idle, overlapped |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['step_ms_off']:.2f} | {r['step_ms_on']:.2f} | {r['floor_ms']:.2f} | "
                     f"{r['ratio_off']:.2f} | {r['ratio_on']:.2f} | {r['gpu_idle_off']:.1%} | {r['gpu_idle_on']:.1%} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "decode_overlap_gpu.md"), "w") as f:
        f.write(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = range(len(rows))
        for off, key, label in ((-0.27, "step_ms_off", "in turn"), (0, "step_ms_on", "overlapped"),
                                (0.27, "floor_ms", "HBM floor")):
            ax.bar([x + off for x in xs], [r[key] for r in rows], 0.27, label=label)
        ax.set_xticks(list(xs), [str(r["batch"]) for r in rows])
        ax.set(xlabel="batch", ylabel="ms per decode step", title=f"LLMEngine.step(), ctx {args.ctx}, {device}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "decode_overlap_gpu.png"), dpi=110)
    except ImportError:
        pass
    print(md)


if __name__ == "__main__":
    main()
