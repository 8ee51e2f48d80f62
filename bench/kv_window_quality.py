"""Quality of sink + window eviction (`kv_window_tokens`, `kv_sink_tokens`; engine/base/kv_window.py)
on the default model's real weights: perplexity of a long text against full attention over
the same tokens.

The text (the repository's docs, concatenated) is one prompt; its per-token log-probs
(`prompt_logprobs`) come from the engine as it prefills it in `--chunk`-token steps, each step
attending to what the cache holds then: everything (full attention), or the sinks and at
least the last `window` tokens at their cache positions (StreamingLLM). Rows: windows with
the default sinks, and one window without sinks (what the sinks are for).

    python bench/kv_window_quality.py --out bench/results/kv_window      # CPU or GPU; table last
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


def nll(model: str, tokens: list[int], chunk: int, window: int | None, sinks: int) -> tuple[float, float]:
    """(perplexity over tokens 2..n, seconds)."""
    from pdserve import LLM, SamplingParams

    kw = dict(max_num_batched_tokens=chunk, max_model_len=len(tokens) + 16 if window is None else 8192)
    if window is not None:
        kw.update(kv_window_tokens=window, kv_sink_tokens=sinks)
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


def main() -> None:
    from pdserve.engine.exec.loader import resolve_model_path
    from pdserve.engine.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--windows", default="256,512,1024,2048")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--no-sink-window", type=int, default=1024)
    ap.add_argument("--out", default="bench/results/kv_window")
    args = ap.parse_args()
    model = resolve_model_path(args.model)
    docs = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
    text = "\n\n".join(open(p).read() for p in docs)
    tokens = load_tokenizer(model).encode(text)[: args.tokens]
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


if __name__ == "__main__":
    main()
