"""A decode step's linear layers at one to four rows: cuBLAS (F.linear) against ops/triton_gemv.py,
each against the time its weight takes to stream from HBM at the measured copy bandwidth.

    python bench/gemv_gpu.py --out bench/results/gemv        # prints a table last

Shapes: Qwen3-30B-A3B's qkv, o and LM head, Qwen3-32B's qkv, o, gate/up and down (bf16, random).
Each call replayed in a CUDA graph (as decode steps run), medians; the GEMV at its default tiles
and at the others of --tiles, the best kept per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_gpu import ceilings  # noqa: E402
from prefill_attention_gpu import timed_graph  # noqa: E402

SHAPES = {  # name: (N, K)
    "qwen3-30b-a3b qkv": (5120, 2048), "qwen3-30b-a3b o": (2048, 4096), "qwen3-30b-a3b lm_head": (151936, 2048),
    "qwen3-32b qkv": (10240, 5120), "qwen3-32b o": (5120, 8192), "qwen3-32b gate_up": (51200, 5120),
    "qwen3-32b down": (5120, 25600),
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/gemv")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--tiles", default="4096:2048:4,8192:4096:4,16384:4096:8,8192:8192:8,16384:8192:8",
                    help="tile:max_k:warps settings of the GEMV (the first is the default)")
    return ap


def run(rows: list[int], settings: list, copy_gbs: float) -> list[dict]:
    from pdserve.engine.ops.triton_gemv import gemv_triton

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in tqdm(SHAPES.items(), desc="shapes"):
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5
        floor = n * k * 2 / (copy_gbs * 1e9) * 1e3
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            ref = F.linear(x, w)
            row = {"shape": name, "N": n, "K": k, "rows": m, "floor_ms": floor,
                   "cublas_ms": timed_graph(lambda x=x, w=w: F.linear(x, w))}
            times = {}
            for tiles in settings:
                err = ((gemv_triton(x, w, None, tiles).float() - ref.float()).norm() / ref.float().norm()).item()
                times[f"{tiles.tile}:{tiles.max_k}:{tiles.warps}"] = (timed_graph(lambda x=x, w=w, t=tiles:
                                                                                  gemv_triton(x, w, None, t)), err)
            default = next(iter(times))
            best = min(times, key=lambda s: times[s][0])
            row.update(gemv_ms=times[default][0], rel_err=times[default][1], best=best, best_ms=times[best][0],
                       all={s: t for s, (t, _) in times.items()})
            out.append(row)
    return out


def report(res: dict) -> list[str]:
    lines = [f"Few-row linear layers on {res['device']} (`{res['command']}`); copy {res['copy_GBps']:.0f} GB/s.", "",
             "| shape | N x K | rows | floor (ms) | cuBLAS (ms) | / floor | GEMV (ms) | / floor | best tiles "
             "| best (ms) | rel. error |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        f = r["floor_ms"]
        lines.append(f"| {r['shape']} | {r['N']} x {r['K']} | {r['rows']} | {f:.4f} | {r['cublas_ms']:.4f} | "
                     f"{r['cublas_ms'] / f:.2f} | {r['gemv_ms']:.4f} | {r['gemv_ms'] / f:.2f} | {r['best']} | "
                     f"{r['best_ms']:.4f} | {r['rel_err']:.1e} |")
    return lines


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = [r for r in res["rows"] if r["rows"] == 1]
    xs = range(len(one))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([x - 0.2 for x in xs], [r["cublas_ms"] / r["floor_ms"] for r in one], 0.4, label="cuBLAS")
    ax.bar([x + 0.2 for x in xs], [r["gemv_ms"] / r["floor_ms"] for r in one], 0.4, label="Triton GEMV")
    ax.axhline(1.0, color="k", ls="--", lw=1)
    ax.set_xticks(list(xs), [r["shape"] for r in one], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("time / HBM floor, 1 row")
    ax.set_title(f"Linear layers at batch 1, {res['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from pdserve.engine.ops.triton_gemv import GemvTiles

    args = parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    settings = [GemvTiles(*(int(v) for v in s.split(":"))) for s in args.tiles.split(",")]
    ceil = ceilings()
    res = {"device": torch.cuda.get_device_name(), "copy_GBps": ceil["copy_GBps"],
           "command": "python bench/gemv_gpu.py " + " ".join(sys.argv[1:]),
           "rows": run([int(m) for m in args.rows.split(",")], settings, ceil["copy_GBps"])}
    with open(os.path.join(args.out, "gemv_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = report(res)
    with open(os.path.join(args.out, "gemv_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(res, os.path.join(args.out, "gemv_gpu.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
