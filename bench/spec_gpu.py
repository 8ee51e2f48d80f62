"""Speculative decoding on one GPU (Llama-3-8B shape, bf16): decode tokens/s at batch
1..32 with and without speculation, against the acceptance rate, and with the engine's own
off-switch (cost model, engine/spec/decode.py).

Random weights make acceptance meaningless, so the draft is controlled: each request's own
greedy continuation (from the run without speculation), each draft token replaced by a
random one with probability 1 - a. For that to control anything the target's greedy
continuation must not flip on rounding: `--target chain` (default) makes the random model a
deterministic chain (the LM head is the embedding, permuted, and the layers' output
projections are scaled by 1e-4, so the next token is perm(current) with a large margin);
every matmul still runs at full size, so step times are those of the 8B shape. `--target
random` keeps the plain random weights (flat logits: any rounding difference flips the argmax).
`--shape tiny` runs on CPU (a check of the script, not a result).

    python bench/spec_gpu.py --tokenizer TOK --out bench/results/spec        # table last
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_gpu import build_model, save_ratio_plot  # noqa: E402

from pdserve import SamplingParams  # noqa: E402
from pdserve.engine.base.speculative import DISABLE_BY_BATCH_SIZE  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.core.step_model import StepModel  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.spec.switch import SpecSwitch  # noqa: E402


def run(eng: LLMEngine, prompts: list[list[int]], out_len: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    while eng.scheduler.waiting or any(not r.is_decoding for r in eng.scheduler.running):
        for o in eng.step():  # prefill first: only decode steps are timed
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [done[f"r{i}"] for i in range(len(prompts))], time.perf_counter() - t


def make_chain(model: torch.nn.Module, seed: int = 0) -> None:
    """Next token = a fixed permutation of the current one, by a wide margin (see the top)."""
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-4)
            layer.mlp.down_proj.weight.mul_(1e-4)
        emb = model.embed_tokens.weight
        perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed)).to(emb.device)
        if model.lm_head.weight is emb:  # tied (the tiny shape, CPU): untie; a CUDA graph would keep the old one
            model.lm_head.weight = torch.nn.Parameter(emb.detach().clone())
        model.lm_head.weight.copy_(emb[perm])  # in place: the captured graphs read this memory


def spec_runs(eng, prompts, out_len, want, accs, rng, auto: bool) -> list[dict]:
    """One row per acceptance: speculation forced on (auto False) or left to the engine's
    off-switch (auto True: its default batch cap and step-time model, with a fresh acceptance
    estimate)."""
    d, rows, cfg = eng.drafter, [], eng.drafter.config
    cont = {f"r{i}": w for i, w in enumerate(want)}
    for a in accs:
        def oracle(req, room, a=a):
            c, m = cont[req.request_id], req.num_output_tokens
            return [t if rng.random() < a else rng.randrange(100, 40000) for t in c[m:m + room]]

        d.proposer = oracle
        # a fresh step-time model for the engine, learnt as it runs, which the off-switch asks
        eng.step_model = StepModel(eng.config.max_num_batched_tokens, graphs=eng.runner.graph_seconds)
        d.switch = SpecSwitch(eng.step_model if auto else None)
        d.config = replace(cfg, disable_by_batch_size=DISABLE_BY_BATCH_SIZE if auto else 1 << 20)
        before = d.stats().as_dict()
        got, t = run(eng, prompts, out_len)
        after = d.stats().as_dict()
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        rows.append({"batch": len(prompts), "acceptance_target": a, "auto": auto,
                     "acceptance": accepted / max(1, drafted), "tok_s": len(prompts) * out_len / t,
                     "seconds": t, "steps_off": after["spec_decode_steps_off"] - before["spec_decode_steps_off"],
                     "same_output": sum(g == w for g, w in zip(got, want)) / len(want)})
        print(rows[-1], flush=True)
    return rows


def plot(path: str) -> str:
    """Speedup vs batch per acceptance, forced on (solid) and left to the off-switch (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        res = json.load(f)
    rows = [r for r in res["rows"] if r["acceptance_target"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for auto, style in ((False, "-"), (True, "--")):
        accs = sorted({r["acceptance_target"] for r in rows if r["auto"] == auto})
        for a in accs:
            g = [r for r in rows if r["auto"] == auto and r["acceptance_target"] == a]
            bs = sorted({r["batch"] for r in g})
            mean = [sum(r["speedup"] for r in g if r["batch"] == b) / sum(r["batch"] == b for r in g) for b in bs]
            lo = [min(r["speedup"] for r in g if r["batch"] == b) for b in bs]
            hi = [max(r["speedup"] for r in g if r["batch"] == b) for b in bs]
            color = plt.cm.viridis(a / 0.9 * 0.85)
            ax.plot(bs, mean, style, marker="o", color=color,
                    label=f"{'off-switch' if auto else 'always'}, acceptance {a:.0%}")
            ax.fill_between(bs, lo, hi, color=color, alpha=0.15)
    return save_ratio_plot(fig, ax, path, "batch (decoding requests)", "decode tokens/s vs no speculation",
                           f"Speculative decoding, k={res['k']}, Llama-3-8B shape, {res['device']}", fontsize=7, ncol=2)


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer")
    ap.add_argument("--shape", choices=("llama3-8b", "tiny"), default="llama3-8b")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--acceptance", default="0,0.3,0.5,0.7,0.9")
    ap.add_argument("--auto-acceptance", default="0,0.3,0.7", help="runs left to the engine's off-switch")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/spec")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--target", choices=("chain", "random"), default="chain")
    ap.add_argument("--plot", metavar="JSON", help="only draw the plot of a saved result")
    ap.add_argument("--name", default=None, help="file stem after spec_ (default: SHAPE_TARGET[_DTYPE])")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    cuda = torch.cuda.is_available()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        if args.shape == "tiny":
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from helpers import save_tiny

            model = save_tiny("llama", d, args.tokenizer)
            os.environ["PDSERVE_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # random weights: untrained positions change nothing
        else:
            model = build_model(d, args.tokenizer)
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "disable_by_batch_size": 1 << 20}
        dtype = args.dtype or ("bfloat16" if cuda else "float32")
        eng = LLMEngine(EngineConfig(model=model, dtype=dtype, load_format="dummy",
                                     max_model_len=2048, max_num_seqs=64, speculative_config=spec))
        if args.target == "chain":
            make_chain(eng.runner.model)  # in place: the CUDA graphs read the same memory
        cfg, rng = eng.drafter.config, random.Random(0)
        for b in [int(x) for x in args.batches.split(",")]:
            for rep in range(args.repeats):  # fresh prompts and corruption each time: the spread
                prompts = [[rng.randrange(100, 40000) for _ in range(512)] for _ in range(b)]
                eng.drafter.config = None  # plain decoding (CUDA graphs)
                want, t_base = run(eng, prompts, args.out_len)
                rows.append({"batch": b, "repeat": rep, "acceptance_target": None, "auto": False,
                             "tok_s": b * args.out_len / t_base, "seconds": t_base, "speedup": 1.0})
                eng.drafter.config = cfg
                for auto, accs in ((False, args.acceptance), (True, args.auto_acceptance)):
                    rates = [float(x) for x in accs.split(",") if x]
                    got = spec_runs(eng, prompts, args.out_len, want, rates, rng, auto)
                    for r in got:
                        r["speedup"], r["repeat"] = t_base / r["seconds"], rep
                    rows += got
        graph_seconds = eng.runner.graph_seconds
        eng.close()
    device = torch.cuda.get_device_name() if cuda else "CPU"
    os.makedirs(args.out, exist_ok=True)
    tag = args.name or f"{args.shape}_{args.target}" + (f"_{args.dtype}" if args.dtype else "")
    with open(os.path.join(args.out, f"spec_{tag}.json"), "w") as f:
        json.dump({"device": device, "k": args.k, "out_len": args.out_len, "target": args.target, "rows": rows,
                   "graph_seconds": graph_seconds}, f, indent=2)
    lines = [f"# Speculative decoding, {args.shape} ({args.target} target) on {device} "
             f"(k={args.k}, {args.out_len} tokens, prompts 512, {args.repeats} runs each: mean [min, max])", "",
             "| batch | drafts | per-token acceptance (set) | accepted / drafted | tok/s | vs no speculation | "
             "steps turned off | outputs identical to plain |", "|---|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["batch"], r["auto"], r["acceptance_target"]) for r in rows):
        g = [r for r in rows if (r["batch"], r["auto"], r["acceptance_target"]) == key]
        sp = [r["speedup"] for r in g]
        tok = sum(r["tok_s"] for r in g) / len(g)
        if key[2] is None:
            lines.append(f"| {key[0]} | none | - | - | {tok:.0f} | 1.00x | - | - |")
            continue
        acc = sum(r["acceptance"] for r in g) / len(g)
        lines.append(f"| {key[0]} | {'off-switch' if key[1] else 'always'} | {key[2]:.0%} | {acc:.0%} | {tok:.0f} | "
                     f"{sum(sp) / len(sp):.2f}x [{min(sp):.2f}, {max(sp):.2f}] | "
                     f"{sum(r['steps_off'] for r in g) / len(g):.0f} | {min(r['same_output'] for r in g):.0%} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, f"spec_{tag}.md"), "w") as f:
        f.write(md)
    try:
        plot(os.path.join(args.out, f"spec_{tag}.json"))
    except ImportError:
        pass  # no matplotlib on the GPU machine: --plot JSON afterwards
    print(md)


if __name__ == "__main__":
    main()
