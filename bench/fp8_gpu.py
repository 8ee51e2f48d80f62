"""FP8 block-scaled linear layers (ops/triton_fp8.py) on one GPU against bf16 (cuBLAS through
F.linear): a prefill's GEMMs at the Qwen3-32B shape, and a decode step's GEMVs against the HBM
floor of the FP8 bytes (values + scales) they must read.

    python bench/fp8_gpu.py --out bench/results/fp8        # prints a table last

Prefill: qkv, o, gate/up and down of one Qwen3-32B layer at --tokens rows; FP8 is the whole layer
call as the engine makes it (activation quantization + cuBLAS's block-scaled GEMM, or the Triton
W8A8 kernel where torch lacks it); the Triton kernel also at each of --tiles, the best kept, and its
bounds (itself without scales; cuBLAS with row-wise scales). The layer's speedup is the sum of bf16
times over the sum of FP8 times. Decode: the same weights and Qwen3-30B-A3B's
qkv and o at one to four rows, the W8A16 GEMV (x in bf16, block scales in the kernel) against the
floor and against the bf16 GEMV (ops/triton_gemv.py). Random weights, e4m3 values with random block
scales; every call replayed in a CUDA graph, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_gpu import ceilings  # noqa: E402
from gemv_gpu import SHAPES  # noqa: E402
from prefill_attention_gpu import timed_graph  # noqa: E402

PREFILL = ("qwen3-32b qkv", "qwen3-32b o", "qwen3-32b gate_up", "qwen3-32b down")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/fp8")
    ap.add_argument("--tokens", default="4096", help="prefill rows (comma list)")
    ap.add_argument("--rows", default="1,2,4", help="decode rows")
    ap.add_argument("--tiles", default="64:128:16:4:4,64:128:32:4:4,64:128:8:4:4,64:256:8:8:3,128:128:8:8:3",
                    help="block_m:block_n:group_m:warps:stages of the Triton W8A8 kernel (the first is the default)")
    ap.add_argument("--gemv", default="8192:2048:4,4096:2048:4,16384:4096:8,8192:4096:4",
                    help="tile:max_k:warps of the GEMV (the first is the default)")
    return ap


def fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    wq = (torch.randn(n, k, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand((n + 127) // 128, (k + 127) // 128, device="cuda", generator=g) / (64 * k ** 0.5) + 1e-6
    return wq, ws


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def prefill(tokens: list[int], tiles: list) -> list[dict]:
    from pdserve.engine.fp8 import dequantize
    from pdserve.engine.ops.triton_fp8 import fp8_linear, fp8_linear_ref

    out, g = [], torch.Generator(device="cuda").manual_seed(0)
    for name in tqdm(PREFILL, desc="prefill GEMMs"):
        n, k = SHAPES[name]
        wq, ws = fp8_weight(n, k, g)
        w = dequantize(wq, ws, (128, 128), torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            ref = fp8_linear_ref(x[:64], wq, ws)
            bf16 = timed_graph(lambda x=x, w=w: F.linear(x, w), reps=10, calls=5)
            times = {}
            for t in tiles:
                try:
                    err = rel_err(fp8_linear(x[:64].contiguous(), wq, ws, tiles=t), ref)
                except triton.runtime.errors.OutOfResources:  # a tile too large for the GPU: not a candidate
                    continue
                call = (lambda x=x, t=t, wq=wq, ws=ws: fp8_linear(x, wq, ws, tiles=t))
                times[t] = (timed_graph(call, reps=10, calls=5), err)
            best = min(times, key=lambda t: times[t][0])
            flops = 2 * m * n * k
            fp8 = timed_graph(lambda x=x, wq=wq, ws=ws: fp8_linear(x, wq, ws), reps=10, calls=5)  # the engine's path
            out.append({"shape": name, "N": n, "K": k, "tokens": m, "bf16_ms": bf16, "fp8_ms": fp8,
                        "fp8_err": rel_err(fp8_linear(x[:64].contiguous(), wq, ws), ref),
                        "triton_best": tile_name(best), "triton_ms": times[best][0], "triton_err": times[best][1],
                        "bf16_TFLOPs": flops / bf16 / 1e9, "fp8_TFLOPs": flops / fp8 / 1e9,
                        "triton_all": {tile_name(t): v[0] for t, v in times.items()},
                        **fp8_ceilings(x, wq, ws, best)})
        del w, wq, ws
    return out


def fp8_ceilings(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, tiles) -> dict:
    """What bounds the W8A8 kernel: cuBLAS's FP8 GEMM with one scale per row and per column
    (torch._scaled_mm; no per-block scales), and the kernel's own loads and dots without scales."""
    from pdserve.engine.ops.triton_fp8 import _w8a8_kernel, quantize_groups

    xq, xs = quantize_groups(x)
    m, n, k = x.shape[0], wq.shape[0], x.shape[1]
    out = {}
    try:
        sa, sb = xs[:, :1].contiguous(), ws.repeat_interleave(128, 0)[:n, :1].t().contiguous()
        out["cublas_rowwise_ms"] = timed_graph(lambda: torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=torch.bfloat16),
                                               reps=10, calls=5)
    except (RuntimeError, TypeError) as e:  # a torch without row-wise scaled_mm
        out["cublas_rowwise_error"] = str(e)[:200]
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)

    def unscaled():
        _w8a8_kernel[grid](xq, xs, wq, ws, y, m, n, k, xq.stride(0), xs.stride(0), xs.stride(1), wq.stride(0),
                           ws.stride(0),
                           y.stride(0), BN_ROWS=128, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=128,
                           GROUP_M=tiles.group_m, SCALED=False, num_warps=tiles.warps,
                           num_stages=tiles.stages)
    out["unscaled_kernel_ms"] = timed_graph(unscaled, reps=10, calls=5)
    return out


def tile_name(t) -> str:
    return f"{t.block_m}:{t.block_n}:{t.group_m}:{t.warps}:{t.stages}"


def decode(rows: list[int], gemv_tiles: list, copy_gbs: float) -> list[dict]:
    from pdserve.engine.fp8 import dequantize
    from pdserve.engine.ops.triton_fp8 import fp8_linear, fp8_linear_ref
    from pdserve.engine.ops.triton_gemv import gemv_triton

    out, g = [], torch.Generator(device="cuda").manual_seed(1)
    for name, (n, k) in tqdm([(s, v) for s, v in SHAPES.items() if "lm_head" not in s], desc="decode GEMVs"):
        wq, ws = fp8_weight(n, k, g)
        w = dequantize(wq, ws, (128, 128), torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            floor = (n * k + ws.numel() * 4 + m * k * 2 + m * n * 2) / (copy_gbs * 1e9) * 1e3
            ref = fp8_linear_ref(x, wq, ws)
            times = {}
            for t in gemv_tiles:
                times[t] = (timed_graph(lambda x=x, t=t, wq=wq, ws=ws: fp8_linear(x, wq, ws, tiles=t)), rel_err(
                    fp8_linear(x, wq, ws, tiles=t), ref))
            best = min(times, key=lambda t: times[t][0])
            out.append({"shape": name, "N": n, "K": k, "rows": m, "floor_ms": floor, "fp8_ms": times[gemv_tiles[0]][0],
                        "best": f"{best.gemv_tile}:{best.gemv_max_k}:{best.gemv_warps}", "best_ms": times[best][0],
                        "rel_err": times[best][1], "bf16_gemv_ms": timed_graph(lambda x=x, w=w: gemv_triton(x, w)),
                        "bf16_floor_ms": n * k * 2 / (copy_gbs * 1e9) * 1e3})
        del w, wq, ws
    return out


def summarize(res: dict) -> dict:
    by = {}
    for r in res["prefill"]:
        s = by.setdefault(r["tokens"], [0.0, 0.0])
        s[0] += r["bf16_ms"]
        s[1] += r["fp8_ms"]
    one = [r for r in res["decode"] if r["rows"] == 1]
    return {"prefill_layer_speedup": {m: b / f for m, (b, f) in by.items()},
            "decode_b1_floor_ratio_worst": max(r["best_ms"] / r["floor_ms"] for r in one),
            "decode_b1_floor_ratio_sum": sum(r["best_ms"] for r in one) / sum(r["floor_ms"] for r in one)}


def report(res: dict) -> list[str]:
    s = res["summary"]
    lines = [f"FP8 block-scaled linear layers on {res['device']} (`{res['command']}`); "
             f"copy {res['copy_GBps']:.0f} GB/s, bf16 matmul {res['matmul_TFLOPs']:.0f} TFLOP/s.", "",
             "Prefill (one Qwen3-32B layer's GEMMs): FP8 is what `fp8_linear` runs (activation quantization + "
             "cuBLAS's block-scaled GEMM where torch has it); Triton is the W8A8 kernel at its best tile; the "
             "Triton kernel without scales and cuBLAS with row-wise scales bound what block scales cost.", "",
             "| GEMM | N x K | tokens | bf16 (ms) | TFLOP/s | FP8 (ms) | TFLOP/s | speedup | rel. error | Triton (ms) "
             "| tile | Triton unscaled (ms) | cuBLAS row-wise (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["prefill"]:
        lines.append(f"| {r['shape']} | {r['N']} x {r['K']} | {r['tokens']} | {r['bf16_ms']:.3f} "
                     f"| {r['bf16_TFLOPs']:.0f} | {r['fp8_ms']:.3f} | {r['fp8_TFLOPs']:.0f} "
                     f"| {r['bf16_ms'] / r['fp8_ms']:.2f} | {r['fp8_err']:.1e} | {r['triton_ms']:.3f} "
                     f"| {r['triton_best']} | {r['unscaled_kernel_ms']:.3f} "
                     f"| {r.get('cublas_rowwise_ms', float('nan')):.3f} |")
    lines += ["", "Decode (W8A16 GEMV; floor: FP8 values + scales + x + y over the copy bandwidth):", "",
              "| shape | N x K | rows | FP8 floor (ms) | FP8 (ms) | / floor | bf16 GEMV (ms) | bf16 / its floor "
              "| tiles |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["decode"]:
        lines.append(f"| {r['shape']} | {r['N']} x {r['K']} | {r['rows']} | {r['floor_ms']:.4f} | {r['best_ms']:.4f} | "
                     f"{r['best_ms'] / r['floor_ms']:.2f} | {r['bf16_gemv_ms']:.4f} | "
                     f"{r['bf16_gemv_ms'] / r['bf16_floor_ms']:.2f} | {r['best']} |")
    sp = ", ".join(f"{m} tokens {v:.2f}x" for m, v in s["prefill_layer_speedup"].items())
    lines += ["", f"Layer GEMMs FP8 over bf16: {sp}; decode b1 over the FP8 floor: worst "
              f"{s['decode_b1_floor_ratio_worst']:.2f}, all shapes' time over their floors' "
              f"{s['decode_b1_floor_ratio_sum']:.2f}."]
    return lines


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    pre = [r for r in res["prefill"] if r["tokens"] == res["prefill"][0]["tokens"]]
    xs = range(len(pre))
    for i, (label, key) in enumerate([("bf16 (cuBLAS)", "bf16_ms"), ("FP8 block-scaled (fp8_linear)", "fp8_ms"),
                                      ("FP8 block-scaled (Triton kernel)", "triton_ms")]):
        a.bar([x + 0.27 * (i - 1) for x in xs], [2 * r["tokens"] * r["N"] * r["K"] / r[key] / 1e9 for r in pre], 0.27,
              label=label)
    a.set_xticks(list(xs), [r["shape"].split()[-1] for r in pre])
    a.set_ylabel("TFLOP/s")
    a.set_title(f"Qwen3-32B layer GEMMs, {pre[0]['tokens']} tokens")
    a.legend(fontsize=8)
    one = [r for r in res["decode"] if r["rows"] == 1]
    xs = range(len(one))
    b.bar([x - 0.2 for x in xs], [r["bf16_gemv_ms"] / r["bf16_floor_ms"] for r in one], 0.4, label="bf16 GEMV")
    b.bar([x + 0.2 for x in xs], [r["best_ms"] / r["floor_ms"] for r in one], 0.4, label="FP8 GEMV")
    b.axhline(1.0, color="k", ls="--", lw=1)
    b.set_xticks(list(xs), [r["shape"] for r in one], rotation=25, ha="right", fontsize=7)
    b.set_ylabel("time / its HBM floor, 1 row")
    b.set_title("Decode GEMVs at batch 1")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from pdserve.engine.ops.triton_fp8 import Fp8Tiles

    args = parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    tiles = [Fp8Tiles(*(int(v) for v in s.split(":")), cublas=False) for s in args.tiles.split(",")]
    gemv = [Fp8Tiles(gemv_tile=int(a), gemv_max_k=int(b), gemv_warps=int(c))
            for a, b, c in (s.split(":") for s in args.gemv.split(","))]
    ceil = ceilings()
    res = {"device": torch.cuda.get_device_name(), "command": "python bench/fp8_gpu.py " + " ".join(sys.argv[1:]),
           **ceil, "prefill": prefill([int(m) for m in args.tokens.split(",")], tiles),
           "decode": decode([int(m) for m in args.rows.split(",")], gemv, ceil["copy_GBps"])}
    res["summary"] = summarize(res)
    with open(os.path.join(args.out, "fp8_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = report(res)
    with open(os.path.join(args.out, "fp8_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(res, os.path.join(args.out, "fp8_gpu.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
