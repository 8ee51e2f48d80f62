"""`pdserve plan`'s command line (the computation is plan.py)."""

from __future__ import annotations

import argparse


def cmd_plan(args: argparse.Namespace) -> int:
    import json
    import os

    from pdserve.bench.workloads import DEFAULT_TRACE
    from pdserve.engine.exec.loader import resolve_model_path
    from pdserve.plan import plan, render, workload_lengths

    trace = (DEFAULT_TRACE if args.trace == "default" else args.trace) if args.trace else None
    lengths = workload_lengths(args.prompt_len, args.output_len, trace, args.trace_requests)
    model = os.path.dirname(os.path.abspath(args.model)) if args.model and os.path.isfile(args.model) else args.model
    p = plan(resolve_model_path(model), lengths, gpu=args.gpu, gpu_memory_gib=args.gpu_memory,
             kv_cache_memory_bytes=args.kv_cache_memory_bytes, prefill_tok_s=args.prefill_tok_s,
             decode_step_ms=args.decode_step_ms, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
             tensor_parallel_size=args.tensor_parallel_size, block_size=args.block_size,
             max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
             gpu_memory_utilization=args.gpu_memory_utilization)
    print(json.dumps(p, indent=2) if args.json else render(p))
    return 0


def add_plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="KV capacity, concurrency and the prefill:decode ratio of a deployment")
    pl.add_argument("--model", default=None,
                    help="Hugging Face directory or its config.json (default: the default model)")
    pl.add_argument("--gpu", choices=("h100", "h200"), default=None, help="a measured GPU preset")
    pl.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU (instead of --gpu)")
    pl.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="the KV budget itself")
    pl.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    pl.add_argument("--dtype", default="bfloat16")
    pl.add_argument("--kv-cache-dtype", default="auto")
    pl.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    pl.add_argument("--block-size", type=int, default=16)
    pl.add_argument("--max-model-len", type=int, default=None)
    pl.add_argument("--max-num-seqs", type=int, default=128)
    pl.add_argument("--prompt-len", type=int, default=None)
    pl.add_argument("--output-len", type=int, default=None)
    pl.add_argument("--trace", nargs="?", const="default", default=None,
                    help="the workload of a Mooncake-format trace (no path: the shipped one)")
    pl.add_argument("--trace-requests", type=int, default=None)
    pl.add_argument("--prefill-tok-s", type=float, default=None, help="measured prefill rate per worker")
    pl.add_argument("--decode-step-ms", type=float, default=None, help="measured decode step at the batch")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)
