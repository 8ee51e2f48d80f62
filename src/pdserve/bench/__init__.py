"""`pdserve bench`: load any OpenAI-compatible endpoint and report TTFT, TPOT, ITL,
throughput, prefix hit rate, SLO attainment and goodput (JSON, markdown, PNG).

    pdserve bench --url http://127.0.0.1:8000 --workload synthetic --input-len 4096 --output-len 256 \\
        --num-requests 100 --rates 1,2,4,8 --slo-ttft 1.0 --slo-tpot 0.04 --out bench/results --label pdserve
    pdserve bench --workload trace --length-scale 0.25 ...   # the shipped Mooncake trace (--trace FILE: another)
    pdserve bench plot a.json b.json --out DIR --name compare      # several systems in one plot

Each rate runs the workload afresh (a new salt, so no rate reuses another's prefixes)
with open-loop Poisson arrivals; for the trace, its own timestamps are stretched to
each rate's mean, and `--rates trace` replays them as they are (`--time-scale` speeds
them up). The trace records time in 3 s ticks; the requests of one tick are spread
over it unless `--trace-bursts` asks for them all at the tick's instant.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time

__all__ = ["add_parser", "main"]


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint (latency, throughput, goodput)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("plot_files", nargs="*", metavar="plot FILE.json",
                   help="'plot' followed by result files: draw them together instead of running")
    b.add_argument("--url", default="http://127.0.0.1:8000")
    b.add_argument("--model", default=None, help="model name to send (default: the endpoint's first)")
    b.add_argument("--api-key", default=None)
    b.add_argument("--admin-key", default=None, help="a pdserve server's admin key, for its timelines "
                                                     "(or env PDSERVE_ADMIN_KEY)")
    b.add_argument("--workload", choices=("trace", "synthetic", "shared-prefix"), default="synthetic")
    b.add_argument("--num-requests", type=int, default=100,
                   help="requests a rate sends (trace: past its end it goes round again, fresh prefixes each lap)")
    b.add_argument("--trace", default=None,
                   help="Mooncake-format JSONL (timestamp, input/output_length, hash_ids); default: the Mooncake "
                        "conversation trace shipped in pdserve/bench/data")
    b.add_argument("--trace-start", type=int, default=0, help="first trace line to replay")
    b.add_argument("--length-scale", type=float, default=1.0, help="trace: scale input lengths (and blocks)")
    b.add_argument("--output-scale", type=float, default=None, help="trace: scale outputs (default: length scale)")
    b.add_argument("--time-scale", type=float, default=1.0, help="trace: speed-up of the trace's own timestamps")
    b.add_argument("--trace-bursts", action="store_true", help="trace: send the requests that share a "
                   "recorded timestamp at once (default: spread over the trace's time resolution)")
    b.add_argument("--max-input-len", type=int, default=None)
    b.add_argument("--max-output-len", type=int, default=None)
    b.add_argument("--input-len", type=int, default=1024)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--system-len", type=int, default=1024, help="shared-prefix: tokens of each system prompt")
    b.add_argument("--question-len", type=int, default=128)
    b.add_argument("--num-prefixes", type=int, default=4)
    b.add_argument("--token-range", default="100:30000", help="LO:HI, token ids drawn from [LO, HI)")
    b.add_argument("--rate", type=float, default=None, help="arrival rate (req/s): Poisson, or the trace's "
                   "timestamps stretched to it; inf: all at once")
    b.add_argument("--rates", default=None, help="sweep: comma-separated rates, or 'trace' (trace timestamps)")
    b.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight: a request due while all are busy waits for one")
    b.add_argument("--slo-ttft", type=float, default=None,
                   help="seconds (default: the pdserve server's own SLO, else `pdserve serve`'s default)")
    b.add_argument("--slo-tpot", type=float, default=None, help="seconds per output token after the first "
                   "(default: the pdserve server's own SLO, else `pdserve serve`'s default)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--label", default=None, help="name of the system under test (legend, file names)")
    b.add_argument("--out", default=None, help="directory for JSON, markdown and PNG (default: print only)")
    b.add_argument("--name", default=None, help="file stem (default: label + workload)")
    b.set_defaults(func=main)
    return b


def _rates(args) -> list[float]:
    if args.rates:
        if args.rates == "trace":
            return [math.nan]
        try:
            return [float(x) for x in args.rates.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--rates must be comma-separated numbers or 'trace', got {args.rates!r}") from None
    if args.rate is not None:
        return [args.rate]
    return [math.nan] if args.workload == "trace" else [float("inf")]


def _workload(args, salt: int):
    from .workloads import DEFAULT_TRACE, shared_prefix_workload, synthetic_workload, trace_workload

    try:
        lo, hi = (int(x) for x in args.token_range.split(":"))
    except ValueError:
        raise ValueError(f"--token-range must be LO:HI, got {args.token_range!r}") from None
    if not 0 <= lo < hi:
        raise ValueError(f"--token-range needs 0 <= LO < HI, got {args.token_range!r}")
    if args.workload == "trace":
        reqs = trace_workload(args.trace or DEFAULT_TRACE, args.num_requests, args.length_scale, args.output_scale,
                              args.time_scale, args.max_input_len, args.max_output_len, (lo, hi), salt,
                              args.trace_start, spread=not args.trace_bursts)
        desc = (f"Mooncake trace x{len(reqs)} (lines {args.trace_start}+), lengths x{args.length_scale}, "
                f"mean in {sum(len(r.prompt) for r in reqs) / len(reqs):.0f} / out "
                f"{sum(r.max_tokens for r in reqs) / len(reqs):.0f} tokens")
    elif args.workload == "synthetic":
        reqs = synthetic_workload(args.num_requests, args.input_len, args.output_len, (lo, hi), salt)
        desc = f"synthetic {args.input_len} in / {args.output_len} out, {args.num_requests} requests"
    else:
        reqs = shared_prefix_workload(args.num_requests, args.system_len, args.question_len, args.output_len,
                                      args.num_prefixes, (lo, hi), salt)
        desc = (f"shared prefix: {args.num_prefixes} system prompts x {args.system_len} + {args.question_len} "
                f"question / {args.output_len} out, {args.num_requests} requests")
    return reqs, desc


def slo_targets(args, server: dict | None) -> tuple[float, float]:
    """The SLO attainment is measured against: the flags, else the server's own (a pdserve
    server), else `pdserve serve`'s default (its one home: SloConfig)."""
    from pdserve.cluster.spec.serving_config import SloConfig

    default = server or {"ttft_s": SloConfig.ttft_s, "tpot_s": SloConfig.tpot_s}
    return (args.slo_ttft if args.slo_ttft is not None else default["ttft_s"],
            args.slo_tpot if args.slo_tpot is not None else default["tpot_s"])


def sweep(args):
    """The requests, arrival times, rate and description of each rate of the sweep `args` asks
    for, in order: what the client sends (run) and what the capacity simulator replays."""
    from .workloads import poisson_arrivals

    for i, rate in enumerate(_rates(args)):
        reqs, desc = _workload(args, salt=args.seed * 1000 + i)
        if args.workload == "trace" and math.isfinite(rate) or math.isnan(rate):
            # the trace's own arrival times, stretched to the asked mean rate
            arrivals = [r.arrival for r in reqs]
            span = max(arrivals)
            natural = (len(reqs) - 1) / span if len(reqs) > 1 and span > 0 else float("inf")
            if math.isfinite(rate) and math.isfinite(natural):
                arrivals = [a * natural / rate for a in arrivals]
            rate_value = natural if math.isnan(rate) else rate
        else:
            arrivals = poisson_arrivals(len(reqs), rate, seed=args.seed)
            rate_value = rate
        yield reqs, arrivals, rate_value, desc


def run(args) -> dict:
    from tqdm import tqdm

    from .client import Endpoint, run_load
    from .report import goodput, summarize
    from .timeline import phase_stats

    ep = Endpoint(args.url, args.model, args.api_key, admin_key=args.admin_key or os.environ.get("PDSERVE_ADMIN_KEY"))
    args.slo_ttft, args.slo_tpot = slo_targets(args, ep.slo())
    runs, desc = [], ""
    for reqs, arrivals, rate_value, desc in sweep(args):  # noqa: B007 (the last one is reported)
        before = ep.metrics()
        with tqdm(total=len(reqs), desc=f"{args.label or 'bench'} @ {rate_value:.2f} req/s", unit="req") as bar:
            records, duration = run_load(ep, reqs, arrivals, bar, args.max_concurrency)
        summary = summarize(records, duration, rate_value, args.slo_ttft, args.slo_tpot, before,
                            settled_metrics(ep))
        tl = ep.timeline(len(reqs))  # pdserve: the server's own per-request spans
        if tl:
            summary["timeline"], summary["phase_ms"] = tl, phase_stats(tl)
        runs.append(summary)
        t, p = summary["ttft_s"], summary["tpot_s"]
        print(f"  rate {rate_value:.2f}: {summary['completed']}/{summary['requests']} done, TTFT p90 "
              f"{t['p90'] or 0:.3f} s, TPOT p90 {(p['p90'] or 0) * 1000:.1f} ms, "
              f"attainment {summary['slo_attainment']:.0%}" +
              (f", errors: {summary['errors']}" if summary["errors"] else ""), flush=True)
    return {"label": args.label or ep.model, "model": ep.model, "url": args.url,
            "config": {"workload": args.workload, "workload_desc": desc, "ttft_slo": args.slo_ttft,
                       "tpot_slo": args.slo_tpot, "num_requests": args.num_requests, "seed": args.seed,
                       "max_concurrency": args.max_concurrency},
            "runs": runs, "goodput": goodput(runs)}


def settled_metrics(ep, key: str = "vllm:prefix_cache_queries", quiet_s: float = 1.2,
                    timeout_s: float = 6.0) -> dict:
    """The server's counters after a run. Worker-side ones (pdserve's prefix-cache counts)
    reach /metrics with the router's next stats poll (~1 s), so read until `key` has not
    moved for `quiet_s`; servers without it are read once."""
    last = ep.metrics()
    if key not in last:
        return last
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        cur = ep.metrics()
        if cur.get(key) == last.get(key):
            return cur
        last = cur
    return last


def main(args) -> int:
    from . import report

    if args.plot_files:
        if args.plot_files[0] != "plot":
            raise ValueError(f"unexpected arguments {args.plot_files}: did you mean 'pdserve bench plot FILE...'?")
        import json

        results = []
        for path in args.plot_files[1:]:
            with open(path) as f:
                results.append(json.load(f))
        if not results:
            raise ValueError("pdserve bench plot needs result JSON files")
        for p in report.plot(results, args.out or ".", args.name or "compare", required=True):
            print(p)
        return 0
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    result = run(args)
    print(report.markdown(result))
    if args.out:
        stem = args.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{result['label']}_{args.workload}")
        for p in report.write(result, args.out, stem):
            print(p)
    failed = sum(r["failed"] for r in result["runs"])
    return 1 if failed == sum(r["requests"] for r in result["runs"]) else 0
