"""Quality of sink + window eviction (`kv_window_tokens`, `kv_sink_tokens`; engine/base/kv_window.py)
on the default model's real weights: perplexity of a long text against full attention over
the same tokens.

The text (the repository's docs, concatenated) is one prompt; its per-token log-probs
(`prompt_logprobs`) come from the engine as it prefills it in `--chunk`-token steps, each step
attending to what the cache holds then: everything (full attention), or the sinks and at
least the last `window` tokens at their cache positions (StreamingLLM). Rows: windows with
the default sinks, and one window without sinks (what the sinks are for).

    python bench/kv_window_quality.py --out bench/results/kv_window      # CPU or GPU; table last

`--h2o` measures heavy-hitter eviction instead (`kv_evict="h2o"`: the recent half of the budget and
the most attended blocks): at budgets of 1/2, 1/4 and 1/8 of the text, H2O and sink + window at
the same kv_window_tokens (the same KV held), against full attention:

    python bench/kv_window_quality.py --h2o --out bench/results/kv_h2o
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time

import torch
from tqdm import tqdm

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def nll(model: str, tokens: list[int], chunk: int, window: int | None, sinks: int,
        evict: str = "window") -> tuple[float, float]:
    """(perplexity over tokens 2..n, seconds)."""
    from pdserve import LLM, SamplingParams

    kw = dict(max_num_batched_tokens=chunk, max_model_len=len(tokens) + 16 if window is None else 8192)
    if window is not None:
        kw.update(kv_window_tokens=window, kv_sink_tokens=sinks, kv_evict=evict)
    t = time.perf_counter()
    with LLM(model, enforce_eager=True, **kw) as llm:
        out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    lps = [d[tok] for tok, d in zip(tokens[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(lps) / len(lps)), time.perf_counter() - t


def plot(rows: list[dict], full: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    sinked = [r for r in rows if r["sink_tokens"]]
    ax.plot([r["window"] for r in sinked], [r["perplexity"] for r in sinked], "o-", label="sinks + window")
    for r in rows:
        if not r["sink_tokens"]:
            ax.plot([r["window"]], [r["perplexity"]], "rx", markersize=10, label=f"window {r['window']}, no sinks")
    ax.axhline(full, color="gray", linestyle="--", label="full attention")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("kv_window_tokens")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--windows", default="256,512,1024,2048")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--no-sink-window", type=int, default=1024)
    ap.add_argument("--h2o", action="store_true", help="heavy hitters against sink + window at --budgets")
    ap.add_argument("--budgets", default="2,4,8", help="with --h2o: the KV budgets, as fractions 1/N of the text")
    ap.add_argument("--out", default="bench/results/kv_window")
    return ap


def main() -> None:
    from pdserve.engine.exec.loader import resolve_model_path
    from pdserve.engine.tokenizer import load_tokenizer

    args = parser().parse_args()
    model = resolve_model_path(args.model)
    docs = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
    text = "\n\n".join(open(p).read() for p in docs)
    tokens = load_tokenizer(model).encode(text)[: args.tokens]
    if args.h2o:
        return heavy_hitters(args, model, tokens)
    runs = [(None, 0)] + [(int(w), args.sinks) for w in args.windows.split(",")] + [(args.no_sink_window, 0)]
    rows = []
    for window, sinks in tqdm(runs, desc="runs"):
        ppl, sec = nll(model, tokens, args.chunk, window, sinks)
        rows.append({"window": window, "sink_tokens": sinks, "perplexity": ppl, "seconds": sec})
    full = rows[0]["perplexity"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    name = os.path.basename(model.rstrip("/"))
    out = {"model": name, "device": device, "text": "docs/*.md + README.md", "tokens": len(tokens),
           "chunk": args.chunk, "block_size": 16, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_window_quality.json"), "w") as f:
        json.dump(out, f, indent=2)
    plot(rows[1:], full, os.path.join(args.out, "kv_window_quality.png"),
         f"{name}, {len(tokens)} tokens, {device}")
    lines = [f"# Sink + window eviction: {name} on {device}", "",
             f"Perplexity of {len(tokens)} tokens of docs/*.md + README.md, prefilled in {args.chunk}-token steps; "
             "sinks are kept as whole 16-token blocks.", "",
             "| KV kept | perplexity | vs full | seconds |", "|---|---|---|---|"]
    for r in rows:
        kept = ("everything (full attention)" if r["window"] is None else
                f"window {r['window']}" + (f" + {r['sink_tokens']} sink tokens (1 block)" if r["sink_tokens"]
                                           else ", no sinks"))
        lines.append(f"| {kept} | {r['perplexity']:.3f} | {r['perplexity'] / full:.3f}x | {r['seconds']:.0f} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "kv_window_quality.md"), "w") as f:
        f.write(md)
    print(md)



def heavy_hitters(args, model: str, tokens: list[int]) -> None:
    """H2O against sink + window at the same budget (kv_window_tokens), each budget 1/N of the text."""
    budgets = [len(tokens) // int(n) // 16 * 16 for n in args.budgets.split(",")]
    full, _ = nll(model, tokens, args.chunk, None, 0)
    rows = []
    for budget in tqdm(budgets, desc="budgets"):
        for evict in ("window", "h2o"):
            ppl, sec = nll(model, tokens, args.chunk, budget, args.sinks, evict)
            rows.append({"budget": budget, "evict": evict, "perplexity": ppl, "vs_full": ppl / full, "seconds": sec})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    name = os.path.basename(model.rstrip("/"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_h2o_quality.json"), "w") as f:
        json.dump({"model": name, "device": device, "text": "docs/*.md + README.md", "tokens": len(tokens),
                   "chunk": args.chunk, "sink_tokens": args.sinks, "full_perplexity": full, "rows": rows}, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for evict, label in (("window", "sinks + window"), ("h2o", "H2O: sinks + recent half + heavy hitters")):
        mine = [r for r in rows if r["evict"] == evict]
        ax.plot([r["budget"] for r in mine], [r["perplexity"] for r in mine], "o-", label=label)
    ax.axhline(full, color="gray", linestyle="--", label="full attention")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV budget (kv_window_tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{name}, {len(tokens)} tokens, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "kv_h2o_quality.png"), dpi=120)
    lines = [f"# Heavy hitters (H2O) against sink + window: {name} on {device}", "",
             f"Perplexity of {len(tokens)} tokens of docs/*.md + README.md, prefilled in {args.chunk}-token steps; "
             f"{args.sinks} sink tokens (one block) in both; full attention {full:.3f}.", "",
             "| budget (tokens, of the text) | sinks + window | H2O | H2O / window |", "|---|---|---|---|"]
    for budget in budgets:
        w, h = (next(r for r in rows if r["budget"] == budget and r["evict"] == e) for e in ("window", "h2o"))
        lines.append(f"| {budget} (1/{round(len(tokens) / budget)}) | {w['perplexity']:.3f} ({w['vs_full']:.3f}x) | "
                     f"{h['perplexity']:.3f} ({h['vs_full']:.3f}x) | {h['perplexity'] / w['perplexity']:.3f} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "kv_h2o_quality.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
