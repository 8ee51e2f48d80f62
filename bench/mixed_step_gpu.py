"""What a decode worker's step costs when it also carries a prefill chunk (hybrid placement),
on one GPU: decode-only steps (a decode graph) vs the same decodes plus a prefill chunk of c
tokens, run either through the piecewise CUDA graphs of its token bucket (engine/exec/graphs.py)
or eagerly (the same kernels launched from Python). From these the step-time model
(engine/core/step_model.py) is fitted and its chunk for a TPOT target checked against what was
measured.

    python bench/mixed_step_gpu.py --tokenizer DIR --out bench/results/hybrid

Model: Llama-3-8B's shape with random bf16 weights (as bench/serving_gpu.py), decodes at
a context of ~4K tokens (the long workload's), the chunk from an 8K-token prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from pdserve.engine.core.scheduler import StepShape  # noqa: E402
from pdserve.engine.core.step_model import StepModel  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.settings import AttentionTuning  # noqa: E402

CHUNKS = (0, 64, 256, 512, 1024, 2048)
PIECES = 0  # the engine's largest piecewise-graph bucket (eager mode sets it to 0)


def ids(n: int) -> list[int]:
    return [random.randrange(100, 40000) for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_step(engine: LLMEngine, cap: int) -> tuple[list, float]:
    """One step this bench schedules itself, timed: after the engine's own overlapped steps the
    step in flight is resolved first (its requests' newest tokens reach the host)."""
    engine.resolve()
    sched = engine.scheduler.schedule(prefill_cap=cap)
    sync()
    t = time.perf_counter()
    result = engine.runner.execute(sched)
    sync()
    dt = time.perf_counter() - t
    scheduled = list(sched.scheduled)
    engine.scheduler.update_after_step(sched)
    engine._postprocess(sched, result)
    return scheduled, dt


def cache_prefixes(engine: LLMEngine, prompt: list[int], chunks) -> None:
    """Prefills prompt[: 8192 - c] for each chunk size c, so that a request of that prefix plus c
    new tokens is a prefix-cache hit whose step carries exactly the c tokens."""
    for c in chunks:
        engine.add_request(prompt[: 8192 - c], SamplingParams(max_tokens=1, temperature=0))
    while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def measure(engine: LLMEngine, batch: int, reps: int, samples: dict) -> list[dict]:
    """`batch` decodes at ~4K context; then per chunk size c, steps of those decodes plus the
    last c tokens of an 8K prompt whose first 8192 - c are a prefix-cache hit, so every mode
    measures the same chunk at the same context. Modes alternate within each repetition
    (graphs: the runner's route; eager: the same kernels launched from Python)."""
    for rid in list(engine.requests):
        engine.abort_request(rid)
    long = SamplingParams(max_tokens=4500, ignore_eos=True, temperature=0)
    for _ in range(batch):
        engine.add_request(ids(4000), long)
    while not all(r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    prompt = ids(8192)
    cache_prefixes(engine, prompt, CHUNKS[1:])
    rows = []
    graphs = engine.runner.graphs
    for c in CHUNKS:
        times = {"graphs": [], "eager": []}
        for i in range(reps + 1):
            for mode in times:
                graphs.max_piece_tokens = PIECES if mode == "graphs" else 0
                if c:
                    engine.add_request(prompt[: 8192 - c] + ids(c), SamplingParams(max_tokens=1, temperature=0))
                scheduled, dt = run_step(engine, c)
                assert not c or sum(s.num_new_tokens for s in scheduled) == batch + c, "the chunk missed its prefix"
                if i:  # the first may compile
                    times[mode].append(dt)
                    samples[mode].append((scheduled, dt))
        graphs.max_piece_tokens = PIECES
        row = {"decodes": batch, "chunk": c, "context": 8192 if c else 0,
               **{f"{m}_ms": 1000 * statistics.median(t) for m, t in times.items()},
               **{f"{m}_spread_ms": [round(1000 * min(t), 2), round(1000 * max(t), 2)] for m, t in times.items()}}
        rows.append(row)
        print(row, flush=True)
    return rows


def profile(engine: LLMEngine, chunks=(64, 256)) -> dict:
    """GPU kernel time by kind of one step of the decodes plus each chunk (graphs mode)."""
    from engine_gpu import profile_step

    prompt = ids(8192)
    cache_prefixes(engine, prompt, chunks)
    out = {}
    for c in chunks:
        def one(c=c):
            engine.add_request(prompt[: 8192 - c] + ids(c), SamplingParams(max_tokens=1, temperature=0))
            run_step(engine, c)
        out[c] = profile_step(one)
        print(c, json.dumps(out[c]["kinds"]), json.dumps(out[c]["top"][:8]), flush=True)
    return out


VARIANTS = {  # AttentionTuning for steps that are not all decodes (engine/config.py, models/attention.py)
    "one launch, mixed tiles": AttentionTuning(decodes_apart=False, prefill_tiles="mixed"),
    "one launch, prefill tiles": AttentionTuning(decodes_apart=False, prefill_tiles="prefill"),
    "decodes apart, mixed tiles": AttentionTuning(decodes_apart=True, prefill_tiles="mixed"),
    "decodes apart, prefill tiles": AttentionTuning(decodes_apart=True, prefill_tiles="prefill"),
}


def compare_variants(engine: LLMEngine, reps: int, chunks=(64, 256, 512, 1024, 2048)) -> list[dict]:
    """The mixed step (graphs mode) under each attention variant, alternating within each
    repetition, the chunk at the end of an 8K prompt as in measure(). Each variant is the runner's
    planner's tuning (the planner plans every step's attention; its settings' tuning was read once,
    when the runner was built, so setting that field changed nothing: until 2026-12-07 every column
    measured the default)."""
    default = engine.runner.planner
    prompt = ids(8192)
    cache_prefixes(engine, prompt, chunks)
    rows = []
    for c in (0, *chunks):
        times = {name: [] for name in VARIANTS}
        for i in range(reps + 1):
            for name, tuning in VARIANTS.items():
                engine.runner.planner = dataclasses.replace(default, tuning=tuning)
                if c:
                    engine.add_request(prompt[: 8192 - c] + ids(c), SamplingParams(max_tokens=1, temperature=0))
                _, dt = run_step(engine, c)
                if i:
                    times[name].append(dt)
        rows.append({"chunk": c, **{name: 1000 * statistics.median(t) for name, t in times.items()}})
        print(rows[-1], flush=True)
    engine.runner.planner = default
    return rows


def fit_report(samples: list, rows: list[dict], mode: str) -> dict:
    out = {}
    for slo in (0.015, 0.02, 0.03, 0.04, 0.05):
        m = StepModel(8192, slo)
        for scheduled, dt in samples:
            m.observe(StepShape.of(scheduled), dt)
        m._fit()
        out[f"{slo * 1000:g}"] = {str(b): [m.chunk_at(b, b * 4000), round(m.rate_at(b, b * 4000) or 0)]
                                  for b in sorted({r["decodes"] for r in rows})}
    m = StepModel(8192, 0.04)
    for scheduled, dt in samples:
        m.observe(StepShape.of(scheduled), dt)
    m._fit()
    return {"mode": mode, "coef_s": m.coefficients(), "chunk_for_tpot_ms": out}


def _figure(out_dir: str, tag: str, figsize: tuple):
    """mixed_step{tag}.json and a fresh figure for it: (result, figure, axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(out_dir, f"mixed_step{tag}.json")) as f:
        res = json.load(f)
    fig, ax = plt.subplots(figsize=figsize)
    return res, fig, ax


def _save(fig, ax, out_dir: str, tag: str, ylabel: str, title: str, legend_size: int) -> str:
    """Labels the chunk axis, saves mixed_step{tag}.png; returns its path."""
    ax.set_xlabel("prefill chunk (tokens) beside 16 decodes at ~4K context")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    out = os.path.join(out_dir, f"mixed_step{tag}.png")
    fig.savefig(out, dpi=120)
    return out


def plot(out_dir: str, tag: str = "") -> str:
    """mixed_step{tag}.json: the step's time over the decodes alone, per chunk, through the
    piecewise graphs and eagerly (one run, one machine). Returns the PNG's path."""
    res, fig, ax = _figure(out_dir, tag, (6, 3.5))
    rows = [r for r in res["rows"] if r["decodes"] == 16]
    for key, label in (("eager_ms", "eager (kernels launched from Python)"), ("graphs_ms", "piecewise CUDA graphs")):
        base = next(r[key] for r in rows if r["chunk"] == 0)
        pts = [(r["chunk"], r[key] - base) for r in rows if r["chunk"]]
        ax.plot([c for c, _ in pts], [ms for _, ms in pts], marker="o", label=label)
    goals = {64: 2, 256: 5, 1024: 26}
    ax.scatter(list(goals), list(goals.values()), marker="_", s=200, color="k", label="goal")
    ax.set_xscale("log", base=2)
    return _save(fig, ax, out_dir, tag, "step time over the decodes alone (ms)",
                 f"a mixed step's extra cost, Llama-3-8B shape, {res['device']}", 8)


def plot_variants(out_dir: str, tag: str = "_variants") -> str:
    """mixed_step{tag}.json's attention variants: the step per chunk, one bar per variant."""
    res, fig, ax = _figure(out_dir, tag, (6.5, 3.5))
    rows = res["variants"]
    width = 0.8 / len(VARIANTS)
    for j, name in enumerate(VARIANTS):
        ax.bar([i + j * width for i in range(len(rows))], [r[name] for r in rows], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [str(r["chunk"]) for r in rows])
    return _save(fig, ax, out_dir, tag, "step (ms), piecewise graphs",
                 f"attention variants for mixed steps, Llama-3-8B shape, {res['device']}", 7)


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None, help="a directory with the tokenizer files (required unless --plot)")
    ap.add_argument("--out", default="bench/results/hybrid")
    ap.add_argument("--batches", default="16,48")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill-attention", choices=("paged", "reference"), default="paged",
                    help="reference: chunks through the torch path it replaced (gather, mask, SDPA), to compare")
    ap.add_argument("--variants", action="store_true", help="the mixed step under each attention variant")
    ap.add_argument("--profile", action="store_true", help="kernel time by kind of a step with a 64 / 256 chunk")
    ap.add_argument("--graph-tokens", type=int, default=2048,
                    help="cuda_graph_max_tokens: every chunk up to it is measured through the piecewise graphs too")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--plot", action="store_true", help="only plot mixed_step{tag}.json in --out")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.plot:
        print(plot_variants(args.out, args.tag) if args.tag == "_variants" else plot(args.out, args.tag))
        return
    random.seed(0)
    model = build_model(os.path.join(tempfile.mkdtemp(), "llama3-8b-shape"), args.tokenizer)
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", dtype="bfloat16", max_model_len=8704,
                                    max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
                                    cuda_graph_max_tokens=args.graph_tokens))
    if args.prefill_attention == "reference":
        for m in engine.runner.model.modules():
            if hasattr(m, "attn") and hasattr(m.attn, "_prefill"):
                m.attn._prefill = None
    global PIECES
    PIECES = engine.runner.graphs.max_piece_tokens
    samples = {"graphs": [], "eager": []}
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        rows += measure(engine, b, args.reps, samples)
    fits = [fit_report(samples[m], rows, m) for m in ("graphs", "eager")]
    profiles = profile(engine) if args.profile else None
    variants = compare_variants(engine, args.reps) if args.variants else None
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"mixed_step{args.tag}.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "prefill_attention": args.prefill_attention,
                   "rows": rows, "fits": fits, "profiles": profiles,
                   "variants": variants}, f, indent=1)
    lines = [f"{torch.cuda.get_device_name()}, prefill attention: {args.prefill_attention}", "",
             f"Medians of {args.reps} (min-max); modes alternate within each repetition; the chunk is the last c "
             "tokens of an 8K prompt (its first 8192 - c cached), graphs up to "
             f"{args.graph_tokens} tokens (`python3 bench/mixed_step_gpu.py --batches {args.batches} "
             f"--reps {args.reps} --graph-tokens {args.graph_tokens}`)", "",
             "| decodes | chunk | step, piecewise graphs (ms) | step, eager (ms) |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['decodes']} | {r['chunk']} | {r['graphs_ms']:.1f} ({r['graphs_spread_ms'][0]:.1f}-"
              f"{r['graphs_spread_ms'][1]:.1f}) | {r['eager_ms']:.1f} ({r['eager_spread_ms'][0]:.1f}-"
              f"{r['eager_spread_ms'][1]:.1f}) |" for r in rows]
    for fit in fits:
        coef = {k: float(f"{v:.3g}") for k, v in fit["coef_s"].items()}
        lines.append(f"\n{fit['mode']}: coefficients (s) {json.dumps(coef)}; "
                     f"TPOT target (ms) -> {{decodes: [chunk tokens, prefill tok/s]}} "
                     f"{json.dumps(fit['chunk_for_tpot_ms'])}")
    if variants:
        lines += ["", "Attention variants, 16 decodes + chunk, piecewise graphs (median ms):", "",
                  "| chunk | " + " | ".join(VARIANTS) + " |", "| --- " * (len(VARIANTS) + 1) + "|"]
        lines += [f"| {r['chunk']} | " + " | ".join(f"{r[n]:.1f}" for n in VARIANTS) + " |" for r in variants]
    text = "\n".join(lines)
    with open(os.path.join(args.out, f"mixed_step{args.tag}.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
