"""FP8 block-scaled weights in the engine on one GPU: a whole model's prefill and decode step with
its decoder linears held in FP8 (e4m3 + 128 x 128 block scales, engine/ops/triton_fp8.py), against
the same model in bf16, in one run.

    python bench/fp8_engine_gpu.py --out bench/results/fp8        # prints a table last

    python bench/fp8_engine_gpu.py --shape qwen3-30b-a3b --name fp8_moe_engine --out bench/results/fp8

Model: random weights (`dummy`) with Qwen3-32B's config (--shape; or Qwen3-30B-A3B's, a sparse
model whose fused experts are held in FP8 too: ops/triton_moe's FP8 path); the FP8 run's
config.json carries the `quantization_config` the -FP8 releases ship, so the loader holds every
decoder linear in FP8 as it does a checkpoint's. Prefill: one prompt of --prefill tokens
(tokens/s, bf16 against FP8). Decode: --batches rows at --ctx tokens of context, replayed as the
engine's CUDA graph, against the HBM floor of the bytes the step must read (every parameter but
the embedding table and the experts no row of the batch routes to, in its stored dtype and with
its scales, plus the batch's KV), the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_gpu import ceilings, decode_batch, profile_lines, profile_step, timed  # noqa: E402
from moe_gpu import QWEN3_30B_A3B, expert_counter  # noqa: E402
from serving_gpu import FP8  # noqa: E402

QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120,
    "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
SHAPES = {"qwen3-32b": ("Qwen3-32B", QWEN3_32B), "qwen3-30b-a3b": ("Qwen3-30B-A3B", QWEN3_30B_A3B)}
KEYS = {"qwen3-32b": ("fp8_prefill_speedup_32b", "fp8_decode_floor_ratio_b1"),
        "qwen3-30b-a3b": ("fp8_moe_prefill_speedup", "fp8_moe_decode_floor_ratio_b1")}


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/fp8")
    ap.add_argument("--name", default="fp8_engine", help="file stem of the results")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-32b", help="the model's config")
    ap.add_argument("--prefill", type=int, default=4096, help="prompt tokens of the prefill step")
    ap.add_argument("--batches", default="1,64", help="decode rows (comma list)")
    ap.add_argument("--ctx", type=int, default=1024, help="each decode row's context")
    ap.add_argument("--profile", action="store_true", help="kernel time by kind of the prefill and b1 decode steps")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a quick look; the keys need all)")
    return ap


def run(cfg: dict, fp8: bool, args, copy_gbs: float) -> dict:
    """One model in one format: its prefill and decode timings and the bytes a decode step reads."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core.request import Request
    from pdserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
    from pdserve.engine.exec.model_runner import ModelRunner
    from pdserve.engine.exec.runner_settings import RunnerSettings
    from pdserve.engine.sampling_params import SamplingParams

    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, **({"quantization_config": FP8} if fp8 else {})}, f)
    batches = [int(b) for b in args.batches.split(",")]
    bs, ctx = 16, args.ctx
    per_seq = ctx // bs + 1
    ec = EngineConfig(model=d, dtype="bfloat16", max_model_len=max(args.prefill, ctx) + 64,
                      max_num_batched_tokens=args.prefill, max_num_seqs=max(batches),
                      num_gpu_blocks_override=max(max(batches) * per_seq, args.prefill // bs + 1) + 8)
    ec.resolve(d)
    runner = ModelRunner(RunnerSettings.of(ec), load_format="dummy")
    runner.kv.normal_()  # never time on zeros
    params = dict(runner.model.named_parameters())
    held = sum(p.dtype == torch.float8_e4m3fn for p in params.values())
    if fp8 and not held:
        raise SystemExit("the FP8 model holds no FP8 weight: the loader dequantized it (loader.holds_fp8)")
    body = sum(p.numel() * p.element_size() for n, p in params.items() if "embed_tokens" not in n)
    # the experts' bytes (values and scales), and one expert's: a step reads only those routed to
    experts = sum(p.numel() * p.element_size() for n, p in params.items() if ".w_gate_up" in n or ".w_down" in n)
    moe = ec.model_config.moe
    one_expert = experts / (moe.num_experts * sum(".w_down" in n and "scale" not in n for n in params)) if moe else 0
    kv_token = runner.layout.block_bytes // bs
    greedy, vocab = SamplingParams(temperature=0, max_tokens=16), cfg["vocab_size"]
    out = {"format": "fp8" if fp8 else "bf16", "fp8_params": held, "weights_GB": body / 1e9, "decode": []}
    toks = torch.randint(0, vocab, (args.prefill,)).tolist()
    req = Request("p", toks, greedy, max_tokens=16)
    step = [ScheduledRequest(req, args.prefill, list(range(-(-args.prefill // bs))))]
    t = timed(lambda: runner.execute(SchedulerOutput(step)), 5, warmup=2)
    out["prefill"] = {"tokens": args.prefill, "ms": t * 1e3, "tokens_per_s": args.prefill / t}
    if args.profile:
        out["prefill"]["profile"] = profile_step(lambda: runner.execute(SchedulerOutput(step)), steps=2)
    for b in tqdm(batches, desc=f"decode {out['format']}"):
        sched = decode_batch(b, ctx, vocab, per_seq)
        t = timed(lambda s=sched: runner.execute(SchedulerOutput(s)), 10, warmup=3)
        touched = 0
        if moe:  # the experts this batch routes to, per layer, counted in an eager step
            graphs, runner.graphs = runner.graphs, None
            seen, handles = expert_counter(runner.model)
            runner.execute(SchedulerOutput(sched))
            for h in handles:
                h.remove()
            runner.graphs, touched = graphs, sum(seen)
        read = body - experts + touched * one_expert + b * (ctx + 1) * kv_token
        floor = read / (copy_gbs * 1e9)
        out["decode"].append({"batch": b, "context": ctx, "step_ms": t * 1e3, "floor_ms": floor * 1e3,
                              "ratio_to_floor": t / floor, "experts_read": touched, "bytes_read_GB": read / 1e9})
        if args.profile and b == 1:
            out["decode"][-1]["profile"] = profile_step(lambda s=sched: runner.execute(SchedulerOutput(s)))
    return out  # the runner and its KV cache are freed on return (main collects them)


def plot(result: dict, path: str) -> None:
    """Prefill tokens/s, and each decode step against its HBM floor, bf16 beside FP8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].bar([r["format"] for r in runs], [r["prefill"]["tokens_per_s"] for r in runs], color=["#888", "#2a7"])
    ax[0].set_title(f"prefill, {runs[0]['prefill']['tokens']} tokens (FP8 {result['prefill_speedup']:.2f}x)")
    ax[0].set_ylabel("tokens / s")
    batches = [d["batch"] for d in runs[0]["decode"]]
    for i, r in enumerate(runs):
        xs = [j + 0.4 * i for j in range(len(batches))]
        ax[1].bar(xs, [d["step_ms"] for d in r["decode"]], 0.38, color=["#888", "#2a7"][i], label=r["format"])
        ax[1].scatter(xs, [d["floor_ms"] for d in r["decode"]], marker="_", s=400, color="k",
                      label="HBM floor" if i else None)
    ax[1].set_xticks([j + 0.2 for j in range(len(batches))], [f"b{b}" for b in batches])
    ax[1].set_ylabel("decode step ms")
    ax[1].set_title(f"decode at {runs[0]['decode'][0]['context']} tokens of context")
    ax[1].legend()
    fig.suptitle(f"{result['model']} ({result['layers']} layers), {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parser().parse_args()
    model, base = SHAPES[args.shape]
    cfg = dict(base, **({"num_hidden_layers": args.layers} if args.layers else {}))
    os.makedirs(args.out, exist_ok=True)
    ceil = ceilings()
    rows = []
    for fp8 in (False, True):
        rows.append(run(cfg, fp8, args, ceil["copy_GBps"]))
        gc.collect()
        torch.cuda.empty_cache()
    bf16, fp8 = rows
    speedup = fp8["prefill"]["tokens_per_s"] / bf16["prefill"]["tokens_per_s"]
    keys = {}
    if not args.layers:
        prefill_key, b1_key = KEYS[args.shape]
        keys = {prefill_key: round(speedup, 3),
                b1_key: round(next(r["ratio_to_floor"] for r in fp8["decode"] if r["batch"] == 1), 3)}
    result = {"gpu": torch.cuda.get_device_name(), "model": f"{model} shape", "layers": cfg["num_hidden_layers"],
              "ceilings": ceil, "runs": rows, "prefill_speedup": speedup, "keys": keys,
              "command": "python bench/fp8_engine_gpu.py " + " ".join(sys.argv[1:])}
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# FP8 weights in the engine: {result['model']} ({cfg['num_hidden_layers']} layers), {result['gpu']}",
             "", f"`{result['command']}`; copy {ceil['copy_GBps']:.0f} GB/s.", "",
             "| format | weights GB | prefill tok/s | " + " | ".join(
                 f"b{r['batch']} step ms (floor, ratio)" for r in bf16["decode"]) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in bf16["decode"]) + " |"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['weights_GB']:.1f} | {r['prefill']['tokens_per_s']:.0f} | " + " | ".join(
            f"{d['step_ms']:.2f} ({d['floor_ms']:.2f}, {d['ratio_to_floor']:.2f})" for d in r["decode"]) + " |")
    lines += ["", f"FP8 prefill {speedup:.2f}x bf16's tokens/s at {args.prefill} tokens."]
    table_end = len(lines)
    for r in rows if args.profile else ():
        lines += profile_lines(f"{r['format']} prefill of {args.prefill} tokens", r["prefill"]["profile"],
                               f"{r['prefill']['ms'] * 1e3:.0f} us timed")
        b1 = next(d for d in r["decode"] if d["batch"] == 1)
        lines += profile_lines(f"{r['format']} decode step, b1", b1["profile"],
                               f"HBM floor {b1['floor_ms'] * 1e3:.0f} us")
    plot(result, os.path.join(args.out, f"{args.name}.png"))
    lines.insert(2, f"![FP8 against bf16]({args.name}.png)\n")
    table_end += 1
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:table_end] if args.profile else lines))  # the short table last


if __name__ == "__main__":
    main()
