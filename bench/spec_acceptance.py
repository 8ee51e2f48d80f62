"""ngram speculation's acceptance with real weights (the default model): prompts that make
the model repeat its input (edits, summaries that quote, code changes) against ordinary
chat. Acceptance depends on the model and the text, not on the hardware, so this runs on
CPU too; tokens/s here is the host's, not a GPU's.

    python bench/spec_acceptance.py --out bench/results/spec        # table last
"""

from __future__ import annotations

import argparse
import json
import os
import time

CODE = '''def total(items):
    result = 0
    for item in items:
        result = result + item.price * item.count
    return result
'''
REPEATING = [
    f"Rename the variable result to acc in this function and print the whole function:\n{CODE}",
    f"Add a docstring to this function and repeat the full code:\n{CODE}",
    "Correct the spelling and repeat the sentence: The quick brwn fox jumps over the lazzy dog while the "
    "farmer watches from the porch of his old wooden house.",
    "Copy this list exactly: apples, pears, plums, cherries, apricots, peaches, grapes, melons, figs.",
]
CHAT = [
    "What is the capital of France?", "Write a haiku about autumn.", "Give me three tips for better sleep.",
    "Explain what a hash table is in two sentences.",
]


def measure(prompts: list[str], spec: dict | None, max_tokens: int) -> dict:
    from pdserve import LLM, SamplingParams

    with LLM(max_model_len=1024, speculative_config=spec) as llm:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens)
        t = time.perf_counter()
        outs = [llm.chat([{"role": "user", "content": p}], sp)[0] for p in prompts]  # batch 1
        wall = time.perf_counter() - t
        st = llm.engine.stats().as_dict()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": n, "tok_s": n / wall, "ids": [o.outputs[0].token_ids for o in outs],
            **{k: v for k, v in st.items() if k.startswith("spec_decode")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="bench/results/spec")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    rows = []
    for name, prompts in (("repeating", REPEATING), ("chat", CHAT)):
        base, fast = measure(prompts, None, args.max_tokens), measure(prompts, spec, args.max_tokens)
        rows.append({"prompts": name, "acceptance": fast["spec_decode_acceptance_rate"],
                     "mean_accepted_length": fast["spec_decode_mean_accepted_length"],
                     "identical": base["ids"] == fast["ids"], "tok_s_plain": base["tok_s"],
                     "tok_s_spec": fast["tok_s"]})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "spec_acceptance_cpu.json"), "w") as f:
        json.dump({"k": args.k, "max_tokens": args.max_tokens, "rows": rows}, f, indent=2)
    lines = [f"# ngram speculation on the default model (real weights), k={args.k}, batch 1, greedy, CPU", "",
             "| prompts | acceptance | mean accepted length | output identical | tok/s plain -> spec (CPU) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompts']} | {r['acceptance']:.0%} | {r['mean_accepted_length']:.2f} | "
                     f"{'yes' if r['identical'] else 'no'} | {r['tok_s_plain']:.1f} -> {r['tok_s_spec']:.1f} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "spec_acceptance_cpu.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
