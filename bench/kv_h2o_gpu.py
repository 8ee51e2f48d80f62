"""What heavy-hitter eviction's score tracking (`kv_evict="h2o"`) costs a decode step on one GPU.

Model: random weights with Llama-3-8B's config in bf16, contexts of `--ctx` tokens. Per batch, one
decode step through the model runner, in CUDA graphs and eager, each without and with scores (the
paged-decode kernel's per-block mass, its normalizing kernel, the host copy and the requests'
per-block sums: everything an h2o engine adds to a step). The overhead is the scored graph step
over the plain one. Also the decode attention kernel alone, one layer, with and without scores.

    python bench/kv_h2o_gpu.py --out bench/results/kv_h2o        # prints a table last
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile

import torch
from engine_gpu import LLAMA3_8B, timed
from tqdm import tqdm


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out", default="bench/results/kv_h2o")
    return ap


def steps(model_dir: str, batches: list[int], ctx: int) -> list[dict]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core.request import Request
    from pdserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
    from pdserve.engine.exec.graphs import StepGraphs
    from pdserve.engine.exec.model_runner import ModelRunner
    from pdserve.engine.exec.runner_settings import RunnerSettings
    from pdserve.engine.ops.triton_attention import paged_decode_triton
    from pdserve.engine.sampling_params import SamplingParams

    bs, vocab = 16, LLAMA3_8B["vocab_size"]
    per_seq = ctx // bs + 1
    ec = EngineConfig(model=model_dir, dtype="bfloat16", num_gpu_blocks_override=max(batches) * per_seq + 8,
                      max_model_len=ctx + 64, max_num_seqs=max(batches))
    ec.resolve(model_dir)
    runner = ModelRunner(RunnerSettings.of(ec), load_format="dummy")
    runner.kv.normal_()  # never time on zeros
    plain, scoring = runner.planner, dataclasses.replace(runner.planner, scoring=True)
    graphs = {plain: runner.graphs,
              scoring: StepGraphs(runner.model, runner.kv_views, runner.settings, runner.num_blocks, scoring)}
    rows = []
    for B in tqdm(batches, desc="decode"):
        sched = []
        for i in range(B):
            toks = torch.randint(0, vocab, (ctx + 1,)).tolist()
            r = Request(f"d{B}-{i}", toks[:ctx], SamplingParams(temperature=0, max_tokens=16), max_tokens=16)
            r.append_token(toks[ctx])
            r.num_computed_tokens = ctx
            sched.append(ScheduledRequest(r, 1, list(range(i * per_seq, (i + 1) * per_seq))))

        def step(s=sched):
            runner.execute(SchedulerOutput(s))

        ms = {}
        for planner in (plain, scoring):
            runner.planner = planner
            for graphed in (True, False):
                runner.graphs = graphs[planner] if graphed else None
                ms[planner.scoring, graphed] = timed(step, 10, warmup=3) * 1e3
        runner.planner, runner.graphs = plain, graphs[plain]
        k, v = runner.kv_views[0]
        q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device=k.device)
        tables = torch.arange(B * per_seq, dtype=torch.int32, device=k.device).view(B, per_seq)
        lens = torch.full((B,), ctx + 1, dtype=torch.int32, device=k.device)
        sc = torch.zeros(B, 8, per_seq, dtype=torch.float32, device=k.device)

        def attention(scores=None, args=(q, k, v, tables, lens, 128 ** -0.5)):
            paged_decode_triton(*args, scores=scores)

        kernel_us = timed(attention, 50, warmup=5) * 1e6
        kernel_scored_us = timed(lambda sc=sc: attention(sc), 50, warmup=5) * 1e6
        rows.append({"batch": B, "context": ctx, "graph_ms": ms[False, True], "graph_scored_ms": ms[True, True],
                     "eager_ms": ms[False, False], "eager_scored_ms": ms[True, False],
                     "overhead": ms[True, True] / ms[False, True] - 1,
                     "overhead_eager": ms[True, False] / ms[False, False] - 1,
                     "kernel_us": kernel_us, "kernel_scored_us": kernel_scored_us})
    return rows


def main() -> None:
    args = parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(LLAMA3_8B, f)
        rows = steps(d, [int(b) for b in args.batches.split(",")], args.ctx)
    device = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "kv_h2o_gpu.json"), "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(rows))
    for off, key, label in ((-0.3, "graph_ms", "CUDA graph"), (-0.1, "graph_scored_ms", "CUDA graph, h2o scores"),
                            (0.1, "eager_ms", "eager"), (0.3, "eager_scored_ms", "eager, h2o scores")):
        ax.bar([i + off for i in x], [r[key] for r in rows], width=0.2, label=label)
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("decode step, ms")
    ax.set_title(f"Llama-3-8B shape, context {args.ctx}, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "kv_h2o_gpu.png"), dpi=120)
    lines = [f"# Heavy-hitter score tracking on a decode step: {device}", "",
             f"Llama-3-8B config, random bf16 weights, context {args.ctx}; `python bench/kv_h2o_gpu.py`.", "",
             "| batch | graph ms | graph + scores ms | overhead | eager ms | eager + scores ms | overhead, eager | "
             "attention kernel us | with scores us |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['graph_ms']:.2f} | {r['graph_scored_ms']:.2f} | {r['overhead']:+.1%} | "
                     f"{r['eager_ms']:.2f} | {r['eager_scored_ms']:.2f} | {r['overhead_eager']:+.1%} | "
                     f"{r['kernel_us']:.0f} | {r['kernel_scored_us']:.0f} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "kv_h2o_gpu.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
