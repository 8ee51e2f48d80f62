"""`pdserve profile` and `pdserve simulate`: the capacity planner's command line (pdserve.sim).

    pdserve profile --model DIR --name llama3-8b --device-name "one H200" --out profile.json [engine flags]
    pdserve simulate --profile profile.json --system hybrid:1:1 [--one-gpu] -- BENCH ARGS...
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from pdserve.cli_common import CliError, add_engine_args, engine_kwargs


def _ints(flag: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise CliError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise CliError(f"{flag} takes integers >= 1, got {text!r}")
    return out


def cmd_profile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pdserve import LLM
    from pdserve.sim.profiler import profile

    contexts, batches = _ints("--contexts", args.contexts), _ints("--batches", args.batches)
    if args.decode_tokens < 2:
        raise CliError(f"--decode-tokens must be >= 2, got {args.decode_tokens}")
    llm = LLM(**engine_kwargs(args))
    with llm, tqdm(total=len(contexts) * len(batches), desc="profile", unit="point") as bar:
        def progress(done: int, total: int, what: str) -> None:
            bar.total = total
            bar.set_postfix_str(what)
            bar.update(done - bar.n)

        engine = llm.engine
        p = profile(engine, args.name or (args.model or "default"), args.device_name, contexts, batches,
                    args.decode_tokens, args.max_tokens_per_point, engine.config.gpu_memory_utilization,
                    "pdserve " + shlex.join(sys.argv[1:]), progress)
    p.save(args.out)
    coef = ", ".join(f"{k} {v:.3g}" for k, v in p.coefficients.items())
    print(f"profile: {p.samples} steps, fit error (median) {p.fit_error:.1%}; {coef}; "
          f"{p.num_blocks(p.profiled_share)} KV blocks at {p.profiled_share}; written to {args.out}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.sim import Profile, predict

    prof = Profile.load(args.profile)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    result = predict(prof, args.system, bench, one_gpu=args.one_gpu,
                     progress=lambda r: print(f"  rate {r['rate']:.2f}: attainment {r['slo_attainment']:.0%}, "
                                              f"TTFT p90 {r['ttft_s']['p90'] or 0:.3f} s, TPOT p90 "
                                              f"{(r['tpot_s']['p90'] or 0) * 1000:.1f} ms", flush=True))
    g = result["goodput"]
    print(f"predicted goodput: {g['rps']:.2f} req/s" + (" (a lower bound: every rate attained)"
                                                          if g["lower_bound"] else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def add_sim_parsers(sub) -> None:
    pr = sub.add_parser("profile", help="time one engine over the step shapes serving meets: a capacity profile")
    add_engine_args(pr)
    pr.add_argument("--name", default=None, help="the model shape's name in the profile (default: --model)")
    pr.add_argument("--device-name", default="CPU", help="the device, as results name it (e.g. 'one H200')")
    pr.add_argument("--contexts", default="512,2048,8000", help="prompt lengths profiled")
    pr.add_argument("--batches", default="1,8,32,64,128", help="requests per point (cut to what the KV holds)")
    pr.add_argument("--decode-tokens", type=int, default=32, help="tokens each request decodes")
    pr.add_argument("--max-tokens-per-point", type=int, default=131072,
                    help="prompt tokens of one point at most (its batch is cut to fit)")
    pr.add_argument("--out", default="profile.json")
    pr.set_defaults(func=cmd_profile)
    si = sub.add_parser("simulate", help="predict a `pdserve bench` sweep against a cluster layout from a profile")
    si.add_argument("--profile", required=True, help="a profile written by `pdserve profile`")
    si.add_argument("--system", default="hybrid:1:1", help="colocated:N | disagg:P:D | hybrid:P:D")
    si.add_argument("--one-gpu", action="store_true", help="every worker shares one GPU")
    si.add_argument("--out", default=None, help="write the predicted result (the bench's JSON) here")
    si.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `pdserve bench` arguments (workload, rates, SLO)")
    si.set_defaults(func=cmd_simulate)
