"""Seeded sampling on the GPU: the noise's bits against the CPU's, and what a step's sampler
costs with seeded rows, unseeded rows and greedy rows (Llama-3's 128,256-token vocabulary,
float32 logits, temperature 0.8 and top-p 0.95 so the sort runs too).

A seeded row's noise is a pure function of (seed, output index, token id)
(engine/sample/sampling_noise.py): the same bits on CPU and CUDA are what lets a request sample the
same tokens wherever it runs. Its cost is about 30 int64 operations per [row, token].

    python bench/sampling_gpu.py --out bench/results/sampling        # table last
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from pdserve import SamplingParams
from pdserve.engine.core.request import Request
from pdserve.engine.sample.sampler import Sampler
from pdserve.engine.sample.sampling_noise import seeded_exponentials

VOCAB = 128256


def bits_match(device: str) -> dict:
    """Draws of 24 (seed, index) pairs over the whole vocabulary, on `device` and on CPU."""
    pairs = [(s, i) for s in (0, 1, -7, 2 ** 40 + 3, 2 ** 63 - 1, 1234) for i in (0, 1, 255, 2 ** 33)]
    same = total = 0
    for seed, index in pairs:
        a = seeded_exponentials(seed, index, 2, VOCAB, device).cpu()
        b = seeded_exponentials(seed, index, 2, VOCAB, "cpu")
        same += int((a.view(torch.int32) == b.view(torch.int32)).sum())
        total += a.numel()
    return {"pairs": len(pairs), "values": total, "bitwise_equal": same}


def step_ms(sampler: Sampler, rows: int, kind: str, device: str, reps: int) -> float:
    """Median time of one sampler call over `rows` rows, all of one kind."""
    params = {"greedy": SamplingParams(temperature=0),
              "unseeded": SamplingParams(temperature=0.8, top_p=0.95),
              "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=42)}[kind]
    reqs = [Request(f"r{i}", [1, 2, 3], params) for i in range(rows)]
    logits = torch.randn(rows, VOCAB, device=device) * 3
    times = []
    for i in range(reps + 3):
        x = logits.clone()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sampler(x, reqs)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            import time
            t0 = time.perf_counter()
            sampler(x, reqs)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 3:
            times.append(ms)
    return statistics.median(times)


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    return ap


def main() -> None:
    args = parser().parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (a check of the script, not a result)"
    bits = bits_match(device)
    sampler = Sampler(torch.device(device))
    rows = [int(r) for r in args.rows.split(",")]
    table = [{"rows": r, **{k: round(step_ms(sampler, r, k, device, args.reps), 3)
                             for k in ("greedy", "unseeded", "seeded")}} for r in rows]
    res = {"device": name, "vocab": VOCAB, "torch": torch.__version__, "bits": bits, "sampler_ms": table}
    lines = [f"# Seeded sampling on {name}", "",
             f"Noise bits, {device} vs CPU: {bits['bitwise_equal']:,} of {bits['values']:,} float32 values equal "
             f"({bits['pairs']} (seed, index) pairs, 2 rows each, vocabulary {VOCAB:,}).", "",
             "Sampler call (temperature 0.8, top-p 0.95; greedy: temperature 0), median ms:", "",
             "| rows | greedy | unseeded | seeded | seeded - unseeded |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {t['rows']} | {t['greedy']:.3f} | {t['unseeded']:.3f} | {t['seeded']:.3f} | "
              f"{t['seeded'] - t['unseeded']:+.3f} |" for t in table]
    lines += ["", "Command: `python bench/sampling_gpu.py --out bench/results/sampling`"]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sampling_gpu.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "README.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
