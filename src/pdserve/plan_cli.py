"""`pdserve plan`'s command line (the computation is plan.py)."""

from __future__ import annotations

import argparse

from pdserve.cli_common import add_engine_args


def cmd_plan(args: argparse.Namespace) -> int:
    import json
    import os

    if args.gpus is not None:
        return cmd_plan_layouts(args)

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


def parse_slo(text: str) -> tuple[float, float]:
    """--slo ttft=SECONDS,tpot=SECONDS -> (ttft, tpot)."""
    from pdserve.cli_common import CliError

    out = {"ttft": 1.0, "tpot": 0.04}
    for part in text.split(","):
        key, _, value = part.partition("=")
        try:
            if key.strip() not in out or float(value) <= 0:
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise CliError(f"--slo takes ttft=SECONDS,tpot=SECONDS (each > 0), got {text!r}") from None
    return out["ttft"], out["tpot"]


def cmd_plan_layouts(args: argparse.Namespace) -> int:
    """`pdserve plan --gpus N --profile P`: every candidate layout of N GPUs simulated on the
    workload, ranked by predicted goodput (pdserve.sim.layouts)."""
    import time

    from pdserve.cli_common import CliError
    from pdserve.sim import Profile
    from pdserve.sim.layouts import SLICE_MAX, recommend

    if args.gpus < 1:
        raise CliError(f"--gpus must be >= 1, got {args.gpus}")
    if args.profile is None:
        raise CliError("--gpus needs --profile FILE (a profile `pdserve profile` wrote, e.g. "
                       "bench/results/profiles/llama3-8b.json)")
    try:
        prof = Profile.load(args.profile)
    except (OSError, ValueError, KeyError) as e:
        raise CliError(f"--profile {args.profile}: not a profile ({e})") from None
    ttft, tpot = parse_slo(args.slo)
    if args.trace:
        work = ["--workload", "trace", *([] if args.trace == "default" else ["--trace", args.trace])]
    else:
        work = ["--workload", "synthetic", "--input-len", str(args.prompt_len or 1024),
                "--output-len", str(args.output_len or 128)]
    if args.num_requests < 1:
        raise CliError(f"--num-requests must be >= 1, got {args.num_requests}")
    argv = [*work, "--slo-ttft", str(ttft), "--slo-tpot", str(tpot), "--seed", "0"]
    t0 = time.monotonic()
    if args.jobs is not None and args.jobs < 1:
        raise CliError(f"--jobs must be >= 1, got {args.jobs}")
    ranked = recommend(prof, args.gpus, argv, args.num_requests, jobs=args.jobs,
                       slice_max=None if args.whole else SLICE_MAX, progress=lambda c: print(
                           f"  {c.system:16s} {c.rps:7.2f} req/s ({c.simulations} simulations"
                           + (f" of {c.slice}" if c.replicas > 1 else "") + ")", flush=True))
    best, colo = ranked[0], next(c for c in ranked if c.system.startswith("colocated"))
    slo = f"TTFT <= {ttft:g} s, TPOT <= {tpot * 1000:g} ms"
    if not best.meets:
        print(f"pdserve plan: no layout of {args.gpus} GPUs meets {slo} at {best.rate:g} req/s; the closest: "
              f"{best.system} ({best.attainment:.0%} attained)")
        return 1
    print(f"\n{prof.model} on {args.gpus} x {prof.device}, {slo}, {' '.join(work[1:])} "
          f"({time.monotonic() - t0:.0f} s)")
    if best.replicas > 1:
        print(f"each layout simulated as {best.replicas} replicas of its {args.gpus // best.replicas}-GPU slice, "
              f"each at 1/{best.replicas} of the traffic (--whole: the whole cluster)")
    print()
    print("| layout | goodput (req/s) | per GPU | vs colocated |\n|---|---|---|---|")
    for c in ranked[: max(args.top, 1)] + ([colo] if colo not in ranked[: max(args.top, 1)] else []):
        vs = f"{c.rps / colo.rps:.2f}x" if colo.rps else "-"
        print(f"| {c.system} | {c.rps:.2f} | {c.rps / args.gpus:.2f} | {vs} |")
    print(f"\nrecommended: {best.system} ({best.rps:.2f} req/s predicted)")
    return 0


def add_plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="KV capacity, concurrency and the prefill:decode ratio of a deployment")
    pl.add_argument("--model", default=None,
                    help="Hugging Face directory or its config.json (default: the default model)")
    pl.add_argument("--gpu", choices=("h100", "h200"), default=None, help="a measured GPU preset")
    pl.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU (instead of --gpu)")
    # the engine settings a plan sizes, their flags as `serve` has them (a plan assumes a GPU: bf16)
    add_engine_args(pl, only=("kv_cache_memory_bytes", "gpu_memory_utilization", "dtype", "kv_cache_dtype",
                              "tensor_parallel_size", "block_size", "max_model_len", "max_num_seqs"),
                    defaults={"dtype": "bfloat16", "max_num_seqs": 128})
    pl.add_argument("--prompt-len", type=int, default=None)
    pl.add_argument("--output-len", type=int, default=None)
    pl.add_argument("--trace", nargs="?", const="default", default=None,
                    help="the workload of a Mooncake-format trace (no path: the shipped one)")
    pl.add_argument("--trace-requests", type=int, default=None)
    pl.add_argument("--prefill-tok-s", type=float, default=None, help="measured prefill rate per worker")
    pl.add_argument("--decode-step-ms", type=float, default=None, help="measured decode step at the batch")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--gpus", type=int, default=None,
                    help="rank the layouts of this many GPUs (colocated, disagg and hybrid splits) by the goodput "
                         "the capacity simulator predicts from --profile")
    pl.add_argument("--profile", default=None, help="with --gpus: a profile `pdserve profile` wrote")
    pl.add_argument("--slo", default="ttft=1.0,tpot=0.04", help="with --gpus: ttft=SECONDS,tpot=SECONDS")
    pl.add_argument("--num-requests", type=int, default=200,
                    help="with --gpus: requests a simulated rate (at least 10 s of them)")
    pl.add_argument("--top", type=int, default=3, help="with --gpus: layouts shown (and colocated)")
    pl.add_argument("--whole", action="store_true",
                    help="with --gpus: simulate the whole cluster, not replicas of a slice of it (slower past 8 GPUs)")
    pl.add_argument("--jobs", type=int, default=None,
                    help="with --gpus: layouts searched at once, a process each (default: one per CPU core)")
    pl.set_defaults(func=cmd_plan)
