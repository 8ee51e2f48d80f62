"""Speculative decoding on one GPU (Llama-3-8B shape, random bf16 weights): decode tokens/s
at batch 1, 8 and 32 with and without speculation, against the acceptance rate.

Random weights make ngram acceptance meaningless, so the draft is controlled: each request's
own greedy continuation (from the run without speculation), each draft token replaced by a
random one with probability 1 - a. The share of requests whose greedy output equals the run
without speculation is reported (exact on CPU in float32; bf16 kernels round differently).
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

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_gpu import build_model  # noqa: E402

from pdserve import SamplingParams  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402


def run(eng: LLMEngine, prompts: list[list[int]], out_len: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
    while eng.scheduler.waiting or any(not r.is_decoding for r in eng.scheduler.running):
        eng.step()  # prefill first: only decode steps are timed
    done: dict[str, list[int]] = {}
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", choices=("llama3-8b", "tiny"), default="llama3-8b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--acceptance", default="0,0.5,0.7,0.9")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--out", default="bench/results/spec")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--logit-scale", type=float, default=1.0,
                    help="scale the LM head: a random model's flat logits flip their argmax on any rounding "
                         "difference between kernels; sharper ones let the controlled draft mean what it says")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        if args.shape == "tiny":
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from helpers import save_tiny

            model = save_tiny("llama", d, args.tokenizer)
        else:
            model = build_model(d, args.tokenizer)
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "disable_by_batch_size": 1 << 20}
        dtype = args.dtype or ("bfloat16" if cuda else "float32")
        eng = LLMEngine(EngineConfig(model=model, dtype=dtype, load_format="dummy",
                                     max_model_len=2048, max_num_seqs=64, speculative_config=spec))
        eng.runner.model.lm_head.weight.data.mul_(args.logit_scale)  # in place: the CUDA graphs still see it
        cfg, rng = eng.drafter.config, random.Random(0)
        for b in [int(x) for x in args.batches.split(",")]:
            prompts = [[rng.randrange(100, 40000) for _ in range(512)] for _ in range(b)]
            eng.drafter.config = None  # plain decoding (CUDA graphs)
            want, t_base = run(eng, prompts, args.out_len)
            rows.append({"batch": b, "acceptance_target": None, "tok_s": b * args.out_len / t_base})
            eng.drafter.config = cfg
            cont = {f"r{i}": w for i, w in enumerate(want)}
            for a in [float(x) for x in args.acceptance.split(",")]:
                def oracle(req, room, a=a, cont=cont):
                    c, m = cont[req.request_id], req.num_output_tokens
                    return [t if rng.random() < a else rng.randrange(100, 40000) for t in c[m:m + room]]

                eng.drafter.proposer = oracle
                before = eng.drafter.stats()
                got, t = run(eng, prompts, args.out_len)
                # bf16 on GPU: the verification's attention (k+1 queries, eager) and the plain decode
                # kernel (CUDA graph) round differently; near-ties of a random model's flat logits flip
                same = sum(g == w for g, w in zip(got, want)) / len(want)
                after = eng.drafter.stats()
                drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
                accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                rows.append({"batch": b, "acceptance_target": a, "acceptance": accepted / max(1, drafted),
                             "tok_s": b * args.out_len / t, "speedup": t_base / t, "same_output": same})
                print(rows[-1], flush=True)
        eng.close()
    device = torch.cuda.get_device_name() if cuda else "CPU"
    os.makedirs(args.out, exist_ok=True)
    tag = args.shape + (f"_{args.dtype}" if args.dtype else "")
    with open(os.path.join(args.out, f"spec_{tag}.json"), "w") as f:
        json.dump({"device": device, "k": args.k, "out_len": args.out_len, "rows": rows}, f, indent=2)
    lines = [f"# Speculative decoding, {args.shape} on {device} (k={args.k}, {args.out_len} tokens, prompts 512)", "",
             "| batch | draft acceptance (target) | measured acceptance | tok/s | vs no speculation | "
             "outputs identical to plain |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["acceptance_target"] is None:
            lines.append(f"| {r['batch']} | off | - | {r['tok_s']:.0f} | 1.00x | - |")
        else:
            lines.append(f"| {r['batch']} | {r['acceptance_target']:.0%} | {r['acceptance']:.0%} | {r['tok_s']:.0f} | "
                         f"{r['speedup']:.2f}x | {r['same_output']:.0%} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, f"spec_{tag}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
