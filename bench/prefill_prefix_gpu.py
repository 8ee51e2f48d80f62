"""Prefill steps on one GPU, whole engine: what a prefix-cache hit saves, and how a long
prompt's chunks cost as its context grows.

    python3 bench/prefill_prefix_gpu.py --tokenizer TOK --out bench/results/attention

- prefix_hit_prefill_ratio: the step that prefills 2048 new tokens over a 2048-token cached
  prefix / the step that prefills a fresh 4096-token prompt (ideal ~0.5: half the tokens;
  attention over the cached half is the extra)
- chunked_prefill_last_over_first: an 8K prompt alone in 1024-token chunks: the last chunk's
  step / the first's (its attention reads 8K keys instead of 1K)

Llama-3-8B's shape with random bf16 weights (as bench/mixed_step_gpu.py); medians of 5.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from serving_gpu import build_model  # noqa: E402

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0)


def ids(n: int) -> list[int]:
    return [random.randrange(100, 40000) for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def steps(engine: LLMEngine) -> list[float]:
    """Runs the engine until idle; the wall time of each step that carried tokens (synchronized).
    Overlapped, the last call only resolves the step before it: it carries none and is not one
    of the prompt's chunks."""
    out = []
    while engine.has_unfinished_requests():
        sync()
        carried = engine.iteration_tokens.sum
        t = time.perf_counter()
        engine.step()
        sync()
        if engine.iteration_tokens.sum > carried:
            out.append(time.perf_counter() - t)
    return out


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default="bench/results/attention")
    ap.add_argument("--reps", type=int, default=5)
    return ap


def main() -> None:
    args = parser().parse_args()
    random.seed(0)
    model = build_model(os.path.join(tempfile.mkdtemp(), "llama3-8b-shape"), args.tokenizer)
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", dtype="bfloat16", max_model_len=8704,
                                    max_num_batched_tokens=8192, gpu_memory_utilization=0.85))
    fresh, hit, first, last = [], [], [], []
    for i in range(args.reps + 1):
        engine.add_request(ids(4096), ONE)
        t_fresh = steps(engine)
        prefix = ids(2048)
        engine.add_request(prefix, ONE)
        steps(engine)  # caches the prefix
        engine.add_request(prefix + ids(2048), ONE)
        t_hit = steps(engine)
        engine.retune(None, 1024)
        engine.add_request(ids(8192), ONE)
        t_chunks = steps(engine)
        engine.retune(None, 8192)
        if i:  # the first compiles
            fresh.append(t_fresh[0])
            hit.append(t_hit[0])
            first.append(t_chunks[0])
            last.append(t_chunks[-1])
        print({"fresh_ms": 1000 * t_fresh[0], "hit_ms": 1000 * t_hit[0],
               "chunks_ms": [round(1000 * t, 1) for t in t_chunks]}, file=sys.stderr, flush=True)
    med = {k: 1000 * statistics.median(v) for k, v in
           (("fresh_4096_ms", fresh), ("hit_2048_over_2048_ms", hit), ("chunk_first_ms", first),
            ("chunk_last_ms", last))}
    res = {"device": torch.cuda.get_device_name(), **med,
           "prefix_hit_prefill_ratio": med["hit_2048_over_2048_ms"] / med["fresh_4096_ms"],
           "chunked_prefill_last_over_first": med["chunk_last_ms"] / med["chunk_first_ms"],
           "command": f"python3 bench/prefill_prefix_gpu.py --tokenizer TOK --out {args.out}"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill_prefix.json"), "w") as f:
        json.dump(res, f, indent=1)
    text = "\n".join([
        f"Prefill steps, {res['device']}, Llama-3-8B shape, bf16, medians of {args.reps} "
        "(`python3 bench/prefill_prefix_gpu.py`)", "",
        "| step | ms |", "| --- | --- |",
        f"| a fresh 4096-token prompt | {med['fresh_4096_ms']:.1f} |",
        f"| 2048 new tokens over a 2048-token cached prefix | {med['hit_2048_over_2048_ms']:.1f} |",
        f"| an 8K prompt in 1024-token chunks: the first | {med['chunk_first_ms']:.1f} |",
        f"| ... the last | {med['chunk_last_ms']:.1f} |", "",
        f"prefix_hit_prefill_ratio {res['prefix_hit_prefill_ratio']:.2f} (goal <= 0.55); "
        f"chunked_prefill_last_over_first {res['chunked_prefill_last_over_first']:.2f} (goal <= 1.2)"])
    with open(os.path.join(args.out, "prefill_prefix.md"), "w") as f:
        f.write(text + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = ["fresh 4096", "2048 over 2048 cached", "8K: first 1024 chunk", "8K: last 1024 chunk"]
    ax.barh(names, list(med.values()))
    ax.set_xlabel("step (ms)")
    ax.set_title(f"prefill steps, Llama-3-8B shape, {res['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "prefill_prefix.png"), dpi=120)
    print(text)


if __name__ == "__main__":
    main()
