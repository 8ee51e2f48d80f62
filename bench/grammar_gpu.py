"""What structured output costs a decode step on one GPU (Llama-3-8B shape, bf16, random
weights): decode tokens/s at batch 1..64 with every request unconstrained, under a regex, or
under any-JSON (json_object), through the engine (engine/sample/structured.py: xgrammar fills each
constrained row's bitmask on the host, then one masked copy on the device).

The regex `[a-z ]{4000}` cannot complete within the run, so its requests produce exactly as
many tokens as the unconstrained ones (which ignore EOS): the same steps, plus the mask. A
json_object request may end early, so its batch thins out: the comparison is per decode step
(its wall time, mask included), which thinning only makes cheaper.

    python bench/grammar_gpu.py --tokenizer TOK --out bench/results/grammar    # table last
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_gpu import build_model, save_ratio_plot  # noqa: E402

from pdserve import SamplingParams  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402

MODES = {"none": None, "regex": {"regex": "[a-z ]{4000}"}, "json_object": {"json_object": True}}


def run(eng: LLMEngine, prompts: list[list[int]], out_len: int, spec) -> tuple[int, int, float, float]:
    """(decode steps, tokens they produced, their seconds, mean host seconds of the mask per step)"""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=spec is None, structured_outputs=spec)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
    while eng.scheduler.waiting or any(not r.is_decoding for r in eng.scheduler.running):
        eng.step()  # prefill (and its first token) first: only decode steps are timed
    grammars = eng.runner.sampler.grammars
    fill, steps, n = [0.0], 0, 0
    inner = grammars.mask

    def timed_mask(logits, reqs):
        t = time.perf_counter()
        rows = inner(logits, reqs)
        fill[0] += time.perf_counter() - t
        return rows

    grammars.mask = timed_mask
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        n += sum(len(o.outputs[0].token_ids) - 1 for o in eng.step() if o.finished)  # the first: prefill's
        steps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    grammars.mask = inner
    return steps, n, seconds, fill[0] / max(1, steps)


def plot(path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        res = json.load(f)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in [m for m in MODES if m != "none"]:
        bs = sorted({r["batch"] for r in res["rows"]})
        rel = {b: [r["step_rel"] for r in res["rows"] if r["batch"] == b and r["mode"] == mode] for b in bs}
        ax.plot(bs, [sum(v) / len(v) for v in rel.values()], marker="o", label=mode)
        ax.fill_between(bs, [min(v) for v in rel.values()], [max(v) for v in rel.values()], alpha=0.2)
    return save_ratio_plot(fig, ax, path, "batch (decoding requests, all constrained)",
                           "decode step time vs unconstrained",
                           f"Structured output (xgrammar), Llama-3-8B shape, {res['device']}")


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer")
    ap.add_argument("--shape", choices=("llama3-8b", "tiny"), default="llama3-8b")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/grammar")
    return ap


def main() -> None:
    args = parser().parse_args()
    cuda, rows, rng = torch.cuda.is_available(), [], random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        if args.shape == "tiny":  # a check of the script on CPU, not a result
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from helpers import save_tiny

            model = save_tiny("llama", d, args.tokenizer)
        else:
            model = build_model(d, args.tokenizer)
        eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16" if cuda else "float32", load_format="dummy",
                                     max_model_len=2048, max_num_seqs=64))
        for b in [int(x) for x in args.batches.split(",")]:
            for rep in range(args.repeats):
                prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(b)]
                base = None
                for mode, spec in MODES.items():
                    steps, n, s, fill = run(eng, prompts, args.out_len, spec)
                    row = {"batch": b, "repeat": rep, "mode": mode, "steps": steps, "tokens": n, "seconds": s,
                           "tok_s": n / s, "step_ms": s / steps * 1e3, "mask_ms_per_step": fill * 1e3}
                    base = base or row["step_ms"]
                    row["step_rel"] = row["step_ms"] / base
                    rows.append(row)
                    print(row, flush=True)
        eng.close()
    device = torch.cuda.get_device_name() if cuda else "CPU"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"grammar_{args.shape}.json")
    with open(path, "w") as f:
        json.dump({"device": device, "out_len": args.out_len, "rows": rows}, f, indent=2)
    lines = [f"# Structured output's cost in decode, {args.shape} on {device} ({args.out_len} tokens, prompts 256, "
             f"{args.repeats} runs each: mean [min, max])", "",
             "| batch | constraint | tokens / run | ms per decode step | vs unconstrained | host mask ms / step |",
             "|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["batch"], r["mode"]) for r in rows):
        g = [r for r in rows if (r["batch"], r["mode"]) == key]
        rel = [r["step_rel"] for r in g]
        lines.append(f"| {key[0]} | {key[1]} | {sum(r['tokens'] for r in g) / len(g):.0f} | "
                     f"{sum(r['step_ms'] for r in g) / len(g):.2f} | "
                     f"{sum(rel) / len(rel):.3f} [{min(rel):.3f}, {max(rel):.3f}] | "
                     f"{sum(r['mask_ms_per_step'] for r in g) / len(g):.2f} |")
    with open(path[: -len(".json")] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(plot(path))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
