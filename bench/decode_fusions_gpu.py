"""The decode step's kernel fusions, one by one, on one GPU: whole overlapped `LLMEngine.step()`
calls in steady decode against the HBM floor, and the step's kernel launches (torch profiler).

Fusions (each kept only where it pays):
  v_view      v stays a view of the qkv projection; the KV store reads it by its strides
              (was: `v.contiguous()`, one copy launch a layer)
  rope_once   rope rotates q's and k's heads in one launch (was: one launch each)

Each variant builds its own engine (CUDA graphs are captured at start) with the fusions it
lacks put back by patching the model's code; "all" is the code as it is.

Model: random weights with Llama-3-8B's config in bf16 (bench/engine_gpu.py), context 1024.

    python bench/decode_fusions_gpu.py --tokenizer TOKENIZER_DIR --out bench/results/fusions
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import tempfile

import torch
from decode_overlap_gpu import steady, time_steps
from engine_gpu import LLAMA3_8B, ceilings, model_bytes, profile_step
from tqdm import tqdm

FUSIONS = ("v_view", "rope_once")
# "all" first and last: the first engine of a process ran 10% slower at batch 1 on an H200
VARIANTS = [("all", FUSIONS), ("none", ()), ("v_view", ("v_view",)), ("rope_once", ("rope_once",)), ("all", FUSIONS)]


@contextlib.contextmanager
def without(fusions: tuple[str, ...]):
    """The model's code as it was before each fusion in `fusions`."""
    from pdserve.engine.models import llama
    from pdserve.engine.ops import triton_fused

    project, launches = llama.Attention.project, triton_fused._rope_launches
    if "v_view" in fusions:
        def copied_v(self, positions, x):
            q, k, v = project(self, positions, x)
            return q, k, v.contiguous()
        llama.Attention.project = copied_v
    if "rope_once" in fusions:
        triton_fused._rope_launches = lambda q, k: [(q, q.shape[1]), (k, k.shape[1])]
    try:
        yield
    finally:
        llama.Attention.project, triton_fused._rope_launches = project, launches


def bench(model_dir: str, tokenizer: str, batches: list[int], ctx: int, steps: int, ceil: dict,
          cfg: dict) -> list[dict]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    bs, top = 16, max(batches)
    body_params, _ = model_bytes(cfg)
    rows = []
    for i, (name, have) in enumerate(tqdm(VARIANTS, desc="variants")):
        ec = EngineConfig(model=model_dir, tokenizer=tokenizer, dtype="bfloat16", load_format="dummy",
                          max_model_len=ctx + 4 * steps + 256, max_num_seqs=top, max_num_batched_tokens=8192,
                          num_gpu_blocks_override=top * ((ctx + 4 * steps + 200) // bs + 2) + 16)
        with without(tuple(f for f in FUSIONS if f not in have)):
            eng = LLMEngine(ec, load_format="dummy")
            kv_token_bytes = eng.runner.layout.block_bytes // bs
            rng = random.Random(0)
            for batch in batches:
                reqs = steady(eng, batch, ctx, rng)
                step_ms = time_steps(eng, steps) * 1e3
                prof = profile_step(eng.step, steps=10)
                mean_ctx = sum(r.num_tokens for r in reqs) / len(reqs)
                read = body_params * 2 + batch * mean_ctx * kv_token_bytes + batch * cfg["hidden_size"] * 2
                floor_ms = read / (ceil["copy_GBps"] * 1e9) * 1e3
                rows.append({"variant": name, "run": i, "fusions": list(have), "batch": batch, "context": ctx,
                             "step_ms": step_ms, "floor_ms": floor_ms, "ratio": step_ms / floor_ms,
                             "gpu_idle": max(0.0, 1 - prof["gpu_busy_us"] / prof["wall_us"]),
                             "launches": round(sum(k["launches"] for k in prof["kinds"].values())),
                             "profile": prof})
                for r in reqs:
                    eng.abort_request(r.request_id)
                eng.step()
        del eng
        torch.cuda.empty_cache()
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/fusions")
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer files (any model's)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=100)
    return ap


def main() -> None:
    args = parser().parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    os.makedirs(args.out, exist_ok=True)
    ceil = ceilings()
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(LLAMA3_8B, f)
        rows = bench(d, args.tokenizer, batches, args.ctx, args.steps, ceil, LLAMA3_8B)
    device = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "decode_fusions_gpu.json"), "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "ceilings": ceil, "rows": rows}, f, indent=2)
    lines = [f"# Decode-step fusions one by one on {device}", "",
             f"Llama-3-8B config, random bf16 weights, context {args.ctx}, greedy, overlapped steps; whole "
             f"`LLMEngine.step()` calls in steady decode, mean of {args.steps}. HBM floor: weights + KV read at "
             f"the copy bandwidth measured in the same run ({ceil['copy_GBps']:.0f} GB/s). Launches and GPU idle "
             "(1 - kernel time / wall time): torch profiler, per step over 10 steps.", "",
             "| run | variant | batch | step ms | HBM floor ms | / floor | GPU idle | launches per step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['variant']} | {r['batch']} | {r['step_ms']:.3f} | {r['floor_ms']:.2f} | "
                     f"{r['ratio']:.3f} | {r['gpu_idle']:.1%} | {r['launches']} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "decode_fusions_gpu.md"), "w") as f:
        f.write(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6))
        for ax, b in zip(axes if len(batches) > 1 else [axes], batches):
            rs = [r for r in rows if r["batch"] == b]
            ax.bar([f"{r['run']}: {r['variant']}" for r in rs], [r["step_ms"] for r in rs])
            ax.tick_params(axis="x", labelrotation=30)
            ax.axhline(rs[0]["floor_ms"], color="k", ls="--", label="HBM floor")
            ax.set(title=f"batch {b}", ylabel="ms per decode step", ylim=(0, max(r["step_ms"] for r in rs) * 1.15))
            ax.legend(loc="lower right")
        fig.suptitle(f"Fusions one by one, ctx {args.ctx}, {device}")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "decode_fusions_gpu.png"), dpi=110)
    except ImportError:
        pass
    print(md)


if __name__ == "__main__":
    main()
