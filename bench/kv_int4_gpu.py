"""The attention kernels' cost per KV-cache dtype on one GPU: bf16 (auto), fp8, int8 and int4,
one layer of Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128), 16-token blocks
in shuffled order.

    python bench/kv_int4_gpu.py --out bench/results/kv_int4          # table last

decode   the paged decode kernel (engine/ops/triton_attention.py), one query per sequence, at
         batch x context; the bytes it must read (K and V rows with their scales) over its time
store    the KV store of a decode step (one token per sequence) and of a 2048-token prefill
prefill  the paged prefill kernel: a 512-token chunk over 3584 cached tokens
Medians of 50 timed launches (CUDA events) after 5 warm-ups. Each case also gives the
kernel's output error against attention over the unquantized K and V (relative L2).
"""

from __future__ import annotations

import argparse
import json
import os

import prefill_attention_gpu
import torch

from pdserve.engine.exec.kv_cache import layer_views
from pdserve.engine.ops import kv_quant
from pdserve.engine.ops.attention_ref import paged_attention_ref
from pdserve.engine.ops.kv_store import store_kv_triton
from pdserve.engine.ops.triton_attention import paged_decode_triton
from pdserve.engine.ops.triton_prefill import PrefillPlan, paged_prefill_triton

H, KVH, D, PAGE = 32, 8, 128, 16
FORMATS = ("auto", "fp8", "int8", "int4")


def timed(fn) -> float:
    return prefill_attention_gpu.timed(fn, reps=50, warmup=5) * 1000  # us


def row_bytes(fmt: str) -> int:
    return D * 2 if fmt == "auto" else kv_quant.row_bytes(fmt, D)


def caches(fmt: str, num_blocks: int, k: torch.Tensor, v: torch.Tensor):
    """One layer's (K, V) caches in `fmt`, every slot filled from k, v through the Triton store."""
    shape = (num_blocks, 1, 2, PAGE, KVH)
    if fmt == "auto":
        kv = torch.zeros(*shape, D, dtype=torch.bfloat16, device="cuda")
    else:
        kv = torch.zeros(*shape, kv_quant.row_bytes(fmt, D), dtype=torch.uint8, device="cuda")
    kc, vc = layer_views(kv, fmt)[0]
    slots = torch.arange(num_blocks * PAGE, device="cuda")
    for i in range(0, len(slots), 1 << 16):
        store_kv_triton(k[i:i + (1 << 16)], v[i:i + (1 << 16)], kc, vc, slots[i:i + (1 << 16)])
    return kv, kc, vc


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def decode_case(batch: int, ctx: int) -> list[dict]:
    nb = batch * ctx // PAGE
    g = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(nb * PAGE, KVH, D, device="cuda", dtype=torch.bfloat16)
    k = k * torch.linspace(0.2, 3.0, D, device="cuda", dtype=torch.bfloat16)  # uneven channels, as K has
    v = torch.randn(nb * PAGE, KVH, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(nb, generator=g).view(batch, -1).to(torch.int32).cuda()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    ref = None
    rows = []
    for fmt in FORMATS:
        kv, kc, vc = caches(fmt, nb, k, v)
        out = paged_decode_triton(q, kc, vc, tables, lens, D ** -0.5)
        if ref is None:  # the unquantized cache: the reference for every format
            ref = paged_attention_ref(q.float(), kc, vc, tables, [ctx] * batch, [1] * batch, D ** -0.5)
        us = timed(lambda kc=kc, vc=vc, out=out: paged_decode_triton(q, kc, vc, tables, lens, D ** -0.5, out=out))
        last = tables[:, -1].long() * PAGE + PAGE - 1  # each sequence's last slot
        store_us = timed(lambda kc=kc, vc=vc, last=last: store_kv_triton(k[:batch], v[:batch], kc, vc, last))
        nbytes = batch * ctx * KVH * 2 * row_bytes(fmt)
        rows.append({"case": "decode", "batch": batch, "context": ctx, "kv_cache_dtype": fmt, "us": us,
                     "bytes": nbytes, "gb_s": nbytes / us / 1e3, "store_us": store_us, "rel_err": rel_err(out, ref)})
    return rows


def prefill_case(chunk: int = 512, ctx: int = 4096) -> list[dict]:
    nb = ctx // PAGE
    k = torch.randn(nb * PAGE, KVH, D, device="cuda", dtype=torch.bfloat16)
    k = k * torch.linspace(0.2, 3.0, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(nb * PAGE, KVH, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(nb).view(1, -1).to(torch.int32).cuda()
    q = torch.randn(chunk, H, D, device="cuda", dtype=torch.bfloat16)
    plan = PrefillPlan.build([chunk], [ctx], H // KVH, "cuda")
    slots = torch.arange(2048, device="cuda")
    ref, rows = None, []
    for fmt in FORMATS:
        kv, kc, vc = caches(fmt, nb, k, v)
        out = paged_prefill_triton(q, kc, vc, tables, plan, D ** -0.5)
        if ref is None:
            ref = paged_attention_ref(q.float(), kc, vc, tables, [ctx], [chunk], D ** -0.5)
        us = timed(lambda kc=kc, vc=vc, out=out: paged_prefill_triton(q, kc, vc, tables, plan, D ** -0.5, out=out))
        store_us = timed(lambda kc=kc, vc=vc: store_kv_triton(k[:2048], v[:2048], kc, vc, slots))
        rows.append({"case": "prefill", "batch": 1, "context": ctx, "chunk": chunk, "kv_cache_dtype": fmt,
                     "us": us, "store_us": store_us, "store_tokens": 2048, "rel_err": rel_err(out, ref)})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = [r for r in rows if r["case"] == "decode"]
    cases = sorted({(r["batch"], r["context"]) for r in dec})
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.2
    for i, fmt in enumerate(FORMATS):
        ys = [next(r["us"] for r in dec if (r["batch"], r["context"]) == c and r["kv_cache_dtype"] == fmt)
              for c in cases]
        ax.bar([j + (i - 1.5) * w for j in range(len(cases))], ys, w, label=fmt)
    ax.set_xticks(range(len(cases)), [f"b{b} x {c}" for b, c in cases])
    ax.set_ylabel("decode kernel, us (one layer)")
    ax.set_title(f"Paged decode attention per KV dtype, {torch.cuda.get_device_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--out", default="bench/results/kv_int4")
    return ap


def main() -> None:
    args = parser().parse_args()
    rows = []
    for b in map(int, args.batches.split(",")):
        for c in map(int, args.contexts.split(",")):
            rows += decode_case(b, c)
            torch.cuda.empty_cache()
    rows += prefill_case()
    gpu = torch.cuda.get_device_name()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_int4_gpu.json"), "w") as f:
        json.dump({"gpu": gpu, "shape": {"heads": H, "kv_heads": KVH, "head_dim": D, "block_size": PAGE},
                   "rows": rows}, f, indent=2)
    plot(rows, os.path.join(args.out, "kv_int4_gpu.png"))
    lines = [f"# Attention kernels per KV dtype on {gpu}", "",
             "One layer of Llama-3-8B's attention (32 / 8 heads, head_dim 128), medians of 50 launches.", "",
             "| case | kv_cache_dtype | kernel us | bytes read | GB/s | store us | rel. error vs bf16 K/V |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        case = (f"decode b{r['batch']} x {r['context']}" if r["case"] == "decode"
                else f"prefill {r['chunk']} at {r['context']}")
        gbs = f"{r['gb_s']:.0f}" if "gb_s" in r else ""
        nbytes = f"{r['bytes'] / 2**20:.1f} MiB" if "bytes" in r else ""
        lines.append(f"| {case} | {r['kv_cache_dtype']} | {r['us']:.1f} | {nbytes} | {gbs} | {r['store_us']:.1f} | "
                     f"{r['rel_err']:.4f} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "kv_int4_gpu.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
