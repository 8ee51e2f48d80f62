"""Host time to build one CUDA-graph decode step's inputs (`decode_inputs`), per batch size:
the part of a decode step that the GPU waits for. CPU only.

    python bench/decode_host.py --out bench/results      # prints a table last
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from tqdm import tqdm

from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler import ScheduledRequest
from pdserve.engine.exec.step_inputs import decode_inputs
from pdserve.engine.sampling_params import SamplingParams


def batch_of(n: int, ctx: int, block_size: int) -> list[ScheduledRequest]:
    out = []
    nblocks = ctx // block_size + 1
    for i in range(n):
        r = Request(f"r{i}", list(range(ctx)), SamplingParams(temperature=0, max_tokens=8), max_tokens=8)
        r.append_token(1)
        r.num_computed_tokens = ctx
        out.append(ScheduledRequest(r, 1, list(range(i * nblocks, (i + 1) * nblocks))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8704)
    ap.add_argument("--batches", default="1,8,64,256")
    args = ap.parse_args()
    bs, max_blocks = 16, -(-args.max_model_len // 16)
    rows = []
    for n in tqdm([int(b) for b in args.batches.split(",")], desc="batch sizes"):
        batch = batch_of(n, args.ctx, bs)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            decode_inputs(batch, n, bs, max_blocks)
            times.append(time.perf_counter() - t)
        rows.append((n, statistics.median(times) * 1e6))
    lines = [f"# Host time of a decode step's graph inputs ({platform.processor() or platform.machine()}, "
             f"context {args.ctx}, block tables {max_blocks} wide)", "",
             "| batch | decode_inputs us (median of 200) |", "|---|---|"]
    lines += [f"| {n} | {us:.0f} |" for n, us in rows]
    md = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_host.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
