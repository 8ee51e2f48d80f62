"""Can the paged-prefill kernel take all-decode steps at the decode kernel's speed? One layer's
attention for B decode rows, each over C tokens of context, on one GPU: the decode kernel
(engine/ops/triton_attention.py, flash-decoding splits) against the paged-prefill kernel
(engine/ops/triton_prefill.py) given the same rows as one-token sequences (its MIXED tiles and
key splits, as a mixed step launches it).

    python bench/attention_core_gpu.py --out bench/results/attention

Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16), 16-token blocks in
shuffled order; each kernel captured 10 times in a CUDA graph, the median of 20 replays per call
(prefill_attention_gpu.timed_graph: kernel time without the host launch work, as decode graphs run); the prefill
kernel's plan is built once per case, as a step builds it. Each case also gives the largest
difference between the two kernels' outputs and each one's relative L2 error against the
torch reference (fp32). HBM GB/s counts the K and V bytes the rows read once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from pdserve.engine.ops.attention_core import sm_count, split_count
from pdserve.engine.ops.attention_ref import paged_attention_ref
from pdserve.engine.ops.triton_attention import DECODE_SPLITS, paged_decode_triton
from pdserve.engine.ops.triton_prefill import MIXED, PrefillPlan, paged_prefill_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_attention_gpu import timed_graph  # noqa: E402  (kernel time, replayed in a CUDA graph)

H, KVH, D, PAGE = 32, 8, 128, 16
BATCHES = (1, 8, 32, 64, 128)
CONTEXTS = (1024, 4096, 16384, 32768)


def case(batch: int, context: int, gen: torch.Generator, check: bool) -> dict:
    width = context // PAGE
    num_blocks = batch * width + 8
    kv = torch.randn(num_blocks, 2, PAGE, KVH, D, dtype=torch.bfloat16, device="cuda")
    kc, vc = kv[:, 0], kv[:, 1]
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width).to(torch.int32).cuda()
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    scale = D ** -0.5
    plan = PrefillPlan.build([1] * batch, [context] * batch, H // KVH, "cuda", MIXED)
    dec = paged_decode_triton(q, kc, vc, tables, lens, scale)
    pre = paged_prefill_triton(q, kc, vc, tables, plan, scale)
    row = {"batch": batch, "context": context,
           "decode_ms": timed_graph(lambda: paged_decode_triton(q, kc, vc, tables, lens, scale, out=dec)),
           "prefill_kernel_ms": timed_graph(lambda: paged_prefill_triton(q, kc, vc, tables, plan, scale, out=pre)),
           "decode_splits": split_count(batch * KVH, width * PAGE, sm_count(q.device), **DECODE_SPLITS),
           "prefill_splits": split_count(plan.tiles.shape[0] * KVH, context, sm_count(q.device), MIXED.per_sm),
           "max_abs_diff": (dec.float() - pre.float()).abs().max().item()}
    row["ratio"] = row["prefill_kernel_ms"] / row["decode_ms"]
    kv_bytes = 2 * batch * context * KVH * D * 2
    row["decode_gbs"] = kv_bytes / row["decode_ms"] / 1e6
    row["prefill_kernel_gbs"] = kv_bytes / row["prefill_kernel_ms"] / 1e6
    if check:
        ref = paged_attention_ref(q.float(), kc.float(), vc.float(), tables, [context] * batch, [1] * batch, scale)
        for name, out in (("decode", dec), ("prefill_kernel", pre)):
            row[f"{name}_rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
    del kv
    torch.cuda.empty_cache()
    return row


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/attention")
    return ap


def plot(rows: list[dict], device: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for c in CONTEXTS:
        pts = [r for r in rows if r["context"] == c]
        ax.plot([r["batch"] for r in pts], [r["ratio"] for r in pts], marker="o", label=f"context {c}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode rows")
    ax.set_ylabel("prefill kernel / decode kernel time")
    ax.set_title(f"all-decode steps through the paged-prefill kernel, {device}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parser().parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in BATCHES:
        for c in CONTEXTS:
            r = case(b, c, gen, check=b * c <= 64 * 4096)
            rows.append(r)
            print(r, file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name()
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, "attention_core")
    with open(base + ".json", "w") as f:
        json.dump({"device": device, "shape": {"heads": H, "kv_heads": KVH, "head_dim": D, "block": PAGE},
                   "command": "python bench/attention_core_gpu.py --out " + args.out, "rows": rows}, f, indent=1)
    lines = [f"All-decode attention, one layer: the decode kernel against the paged-prefill kernel, {device}, "
             "Llama-3-8B attention shape, bf16, 16-token blocks (`python bench/attention_core_gpu.py`)", "",
             "| rows | context | decode kernel (ms) | splits | prefill kernel (ms) | splits | prefill / decode | "
             "decode GB/s | prefill GB/s | max abs diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['context']} | {r['decode_ms']:.3f} | {r['decode_splits']} | "
              f"{r['prefill_kernel_ms']:.3f} | {r['prefill_splits']} | {r['ratio']:.2f}x | {r['decode_gbs']:.0f} | "
              f"{r['prefill_kernel_gbs']:.0f} | {r['max_abs_diff']:.1e} |" for r in rows]
    text = "\n".join(lines)
    with open(base + ".md", "w") as f:
        f.write(text + "\n")
    plot(rows, device, base + ".png")
    print(text)


if __name__ == "__main__":
    main()
