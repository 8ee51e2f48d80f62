"""Smoke run of the cluster on GPUs: 1 prefill + 1 decode Ray actor, one GPU each,
KV over NCCL, against the colocated engine on the same weights (bf16).

    python bench/cluster_gpu.py --tokenizer DIR --out bench/results
Builds a small random Llama (saved to a temp dir, loaded through the real path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_gpu import copy_tokenizer  # noqa: E402


def build_model(out_dir: str, tokenizer_dir: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                      initializer_range=0.05, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out_dir)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default="bench/results")
    return ap


def main() -> None:
    args = parser().parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from pdserve import LLM, SamplingParams
    from pdserve.cluster import Cluster

    from helpers import PROMPTS

    d = tempfile.mkdtemp()
    path = build_model(d, args.tokenizer)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = PROMPTS * 4
    t = time.time()
    c = Cluster.start(model=path, prefill=1, decode=1, max_model_len=1024, gpu_memory_utilization=0.5)
    start_s = time.time() - t
    c.generate(prompts[:2], sp)  # warm up the pair's NCCL communicator
    t = time.time()
    outs = c.generate(prompts, sp)
    gen_s = time.time() - t
    status = c.status()
    c.shutdown()
    ref = LLM(path, max_model_len=1024, gpu_memory_utilization=0.5).generate(prompts, sp)
    same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o.outputs[0].token_ids, r.outputs[0].token_ids))
    total = sum(len(r.outputs[0].token_ids) for r in ref)
    first = sum(o.outputs[0].token_ids[:1] == r.outputs[0].token_ids[:1] for o, r in zip(outs, ref))
    result = {"gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0),
              "requests": len(prompts), "new_tokens_each": 64, "cluster_start_s": start_s,
              "generate_s": gen_s, "tokens_per_s": total / gen_s, "tokens_equal_frac": same / total,
              "first_token_equal": f"{first}/{len(prompts)}",
              "finish_reasons": sorted({o.outputs[0].finish_reason for o in outs}),
              "workers": [{k: r.get(k) for k in ("worker_id", "role", "kv_blocks_used", "kv_blocks_total",
                                                 "prefix_cache_hits", "request_blocks")} for r in status]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cluster_gpu.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
