"""Quality of quantized KV (`kv_cache_dtype` auto / fp8 / int8 / int4) on the default model's real
weights: perplexity on a text shipped with the repository and greedy agreement with the
unquantized cache.

Perplexity: the text is fed in chunks through the engine's model runner, so each chunk
attends to the earlier chunks' KV as the cache stores it (quantized), and every next
token's loss comes from the full logits. Agreement: greedy continuations of a set of
prompts, compared token by token with kv_cache_dtype auto.

    python bench/kv_quality.py --out bench/results/kv_quality        # CPU or GPU; table last
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from tqdm import tqdm

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
    "Explain how a transformer attends to earlier tokens.", "List three prime numbers greater than 100:",
    "Once upon a time, in a small village by the mountains,", "The main causes of the French Revolution were",
    "Translate to French: The weather is nice today.", "SELECT name FROM users WHERE", "A recipe for pancakes:",
    "The difference between TCP and UDP is", "Summarize the plot of Hamlet in two sentences.",
]
TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "architecture.md")


def perplexity(model: str, fmt: str, dtype: str, device: str, tokens: list[int], chunk: int) -> float:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.exec.model_runner import ModelRunner
    from pdserve.engine.exec.runner_settings import RunnerSettings
    from pdserve.engine.models.attention import AttentionMetadata

    n = len(tokens)
    cfg = EngineConfig(model=model, dtype=dtype, device=device, kv_cache_dtype=fmt, max_model_len=n + 16,
                       num_gpu_blocks_override=n // 16 + 2, enforce_eager=True, max_num_batched_tokens=chunk)
    cfg.resolve(model)
    runner = ModelRunner(RunnerSettings.of(cfg))
    dev = runner.device
    table = torch.arange(n // 16 + 2, dtype=torch.int32, device=dev)[None]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, n - 1, chunk):
            ids = torch.tensor(tokens[start:start + chunk], device=dev)
            pos = torch.arange(start, start + len(ids), device=dev)
            lens = [start + len(ids)]
            meta = AttentionMetadata.build(pos, table, lens, [len(ids)], dev, runner.planner)
            logits = runner.model.compute_logits(runner.model(ids, pos, runner.kv_views, meta)).float()
            target = torch.tensor(tokens[start + 1:start + 1 + len(ids)], device=dev)
            nll += F.cross_entropy(logits[: len(target)], target, reduction="sum").item()
            count += len(target)
    return math.exp(nll / count)


def greedy(model: str, fmt: str, dtype: str, device: str, max_tokens: int) -> list[list[int]]:
    from pdserve import LLM, SamplingParams

    with LLM(model, dtype=dtype, device=device, kv_cache_dtype=fmt, max_model_len=512) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    from pdserve.engine.base.kv_layout import kv_layout
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.exec.loader import resolve_model_path
    from pdserve.engine.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--max-text-tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--formats", default="auto,fp8,int8,int4", help="kv_cache_dtype values, auto first")
    ap.add_argument("--out", default="bench/results/kv_quality")
    args = ap.parse_args()
    model = resolve_model_path(args.model)
    with open(args.text) as f:
        tokens = load_tokenizer(model).encode(f.read())[: args.max_text_tokens]
    rows, base = [], None
    for fmt in tqdm(args.formats.split(","), desc="kv_cache_dtype"):
        cfg = EngineConfig(model=model, dtype=args.dtype, device=args.device, kv_cache_dtype=fmt)
        cfg.resolve(model)
        ppl = perplexity(model, fmt, args.dtype, args.device, tokens, args.chunk)
        gen = greedy(model, fmt, args.dtype, args.device, args.max_tokens)
        base = base or gen
        same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) for a, b in zip(gen, base)]
        rows.append({"kv_cache_dtype": fmt, "block_bytes": kv_layout(cfg).block_bytes, "perplexity": ppl,
                     "prompts_identical": sum(s == len(b) for s, b in zip(same, base)) / len(base),
                     "tokens_before_divergence_mean": sum(same) / len(same),
                     "token_agreement": sum(x == y for a, b in zip(gen, base) for x, y in zip(a, b))
                     / sum(map(len, base))})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "CPU"
    out = {"model": os.path.basename(model.rstrip("/")), "dtype": args.dtype, "device": device,
           "text": os.path.relpath(args.text), "text_tokens": len(tokens), "chunk": args.chunk,
           "prompts": len(PROMPTS), "max_tokens": args.max_tokens, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    tag = "gpu" if device != "CPU" else "cpu"
    with open(os.path.join(args.out, f"kv_quality_{tag}.json"), "w") as f:
        json.dump(out, f, indent=2)
    b0 = rows[0]["block_bytes"]
    lines = [f"# KV quantization quality: {out['model']} ({args.dtype} weights) on {device}", "",
             f"Perplexity on `{out['text']}` ({len(tokens)} tokens, fed in {args.chunk}-token chunks); greedy "
             f"agreement with kv_cache_dtype auto on {len(PROMPTS)} prompts x {args.max_tokens} tokens.", "",
             "| kv_cache_dtype | blocks per byte vs auto | perplexity | prompts identical | tokens before divergence "
             "(mean) | token agreement |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kv_cache_dtype']} | {b0 / r['block_bytes']:.2f}x | {r['perplexity']:.3f} | "
                     f"{r['prompts_identical']:.0%} | {r['tokens_before_divergence_mean']:.1f} | "
                     f"{r['token_agreement']:.1%} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, f"kv_quality_{tag}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
