"""The ratio autoscale policy against the best static split in hindsight, in the simulator (CPU).

    python bench/plan_adaptive.py --gpus 8,16 --out bench/results/plan/adaptive

For each GPU count N: the goodput (>= 90% attainment) of every static disaggregated split P:D
of N whole GPUs (no slices) on the Mooncake trace at its own arrival times (stretched to each
probed rate, as the serving runs do), and of the same cluster started at an even split with the
ratio policy moving workers between the pools (`disagg:P:D:adaptive`: cluster/pools/ratio.py
run on the simulated clock as a live planner runs on the replay's, pdserve.sim.adaptive). The
ratio is adaptive over the best static one. Writes adaptive.{md,json,png}, prints the table last.

    python bench/plan_adaptive.py --gpus 16 --static 10:6,11:5,12:4 --start-split 11:5 --steps 6

starts the adaptive cluster at a given split instead (here the best static one: whether the policy
keeps a split that is right, where `pdserve plan` put it) and searches each goodput to 1/64.
`--mode hybrid` runs hybrid clusters (the server's default mode), static and adaptive alike: a
decode worker prefills a prompt itself where the prefill pool's predicted TTFT is past the spill
point. More requests than the trace holds go round it again (bench/workloads.trace_workload).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from plan_grid import with_tpot  # noqa: E402
from serving_gpu import WORKLOADS  # noqa: E402


def one(profile_path: str, system: str, argv: list[str], floor: float, num_requests: int, start: int,
        steps: int = 4) -> dict:
    from pdserve.sim import predict
    from pdserve.sim.layouts import capacity
    from pdserve.sim.profile import Profile

    profile = Profile.load(profile_path)
    t0 = time.perf_counter()
    c = capacity(profile, system, argv, floor, num_requests, steps=steps, start=start)
    row = {"system": system, "goodput": c.rps, "attainment": c.attainment, "probes": c.simulations,
           "seconds": round(time.perf_counter() - t0, 1)}
    if system.endswith(":adaptive") and c.rps > 0:  # the moves at the goodput rate
        run = predict(profile, system, [*argv, "--rates", f"{c.rps:.4g}", "--num-requests", str(num_requests)])
        row["moves"] = run["runs"][0].get("moves", [])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=os.path.join(HERE, "results", "profiles", "llama3-8b.json"))
    ap.add_argument("--gpus", default="8,16")
    ap.add_argument("--tpot", type=float, default=0.04)
    ap.add_argument("--num-requests", type=int, default=3000, help="requests a probe sends (the trace from its start)")
    ap.add_argument("--floor", type=float, default=8.0, help="the capacity search's lowest rate (req/s) per 8 GPUs")
    ap.add_argument("--static", default=None,
                    help="the static splits to search, P:D,... (default: P from N/4 to N - N/8); one GPU count")
    ap.add_argument("--start-split", default=None,
                    help="P:D the adaptive cluster starts at (default: an even split); one GPU count")
    ap.add_argument("--steps", type=int, default=4,
                    help="bisection steps of each goodput search: within 1/2**steps of the last rate met (4: 1/16)")
    ap.add_argument("--mode", choices=("disagg", "hybrid"), default="disagg",
                    help="the cluster's mode, static and adaptive alike (hybrid: decode workers prefill a prompt "
                         "where the prefill pool's predicted TTFT is past the SLO's spill point)")
    ap.add_argument("--baseline", default=None,
                    help="an earlier run's adaptive.json: its static splits' rows stand for these (a static split's "
                         "goodput does not depend on the policy; same profile, workload, probe and steps asked)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "plan", "adaptive"))
    args = ap.parse_args()
    baseline = {}
    if args.baseline:
        with open(args.baseline) as f:
            base = json.load(f)
        if (base["num_requests"], base["tpot_slo_s"], base.get("mode", "disagg"), base.get("steps", 4)) != \
                (args.num_requests, args.tpot, args.mode, args.steps):
            sys.exit(f"--baseline {args.baseline}: another probe (requests, TPOT, mode or steps) than this run's")
        baseline = {r["system"]: r for p in base["points"] for r in p["rows"] if not r["system"].endswith(":adaptive")}
    argv = [*with_tpot(WORKLOADS["trace"], args.tpot), "--seed", "0"]
    os.makedirs(args.out, exist_ok=True)
    points = []
    for n in [int(x) for x in args.gpus.split(",")]:
        t0 = time.perf_counter()
        floor = args.floor * n / 8
        mode = args.mode
        systems = [f"{mode}:{p}:{n - p}" for p in range(max(1, n // 4), n - max(1, n // 8) + 1)] \
            if args.static is None else [f"{mode}:{s}" for s in args.static.split(",")]
        systems.append(f"{mode}:{args.start_split}:adaptive" if args.start_split else
                       f"{mode}:{n // 2}:{n - n // 2}:adaptive")
        todo = [s for s in systems if s not in baseline]
        with ProcessPoolExecutor(args.jobs) as pool:
            done = dict(zip(todo, pool.map(one, [args.profile] * len(todo), todo, [argv] * len(todo),
                                           [floor] * len(todo), [args.num_requests] * len(todo), [3] * len(todo),
                                           [args.steps] * len(todo))))
        rows = [done.get(s) or {**baseline[s], "from": args.baseline} for s in systems]
        static = [r for r in rows if not r["system"].endswith(":adaptive")]
        best = max(static, key=lambda r: r["goodput"])
        adaptive = rows[-1]
        ratio = adaptive["goodput"] / best["goodput"] if best["goodput"] else None
        points.append({"gpus": n, "rows": rows, "best_static": best["system"], "best_static_goodput": best["goodput"],
                       "adaptive": adaptive["system"], "adaptive_goodput": adaptive["goodput"],
                       "adaptive_vs_best_static": round(ratio, 3) if ratio else None,
                       "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{n} GPUs: best static {best['system']} {best['goodput']:.1f} req/s, adaptive from "
              f"{adaptive['system']} {adaptive['goodput']:.1f} req/s ({ratio:.3f}x) in {points[-1]['seconds']} s",
              file=sys.stderr, flush=True)
    meta = {"command": "python bench/plan_adaptive.py " + " ".join(sys.argv[1:]),
            "profile": os.path.relpath(args.profile, os.path.dirname(HERE)),
            "workload": "trace", "mode": args.mode, "tpot_slo_s": args.tpot, "num_requests": args.num_requests,
            "steps": args.steps, "points": points}
    with open(os.path.join(args.out, "adaptive.json"), "w") as f:
        json.dump(meta, f, indent=1)
    lines = [f"# The ratio policy against the best static split, simulated ({args.mode})", "",
             f"`{meta['command']}` (CPU). Llama-3-8B profile on one H200 per worker, the Mooncake trace at its own "
             f"arrival times stretched to each rate, {args.num_requests} requests a probe, TTFT 2 s, TPOT "
             f"{args.tpot * 1000:g} ms; goodput in req/s at >= 90% attainment, within 1/{2 ** args.steps} of the "
             "last rate met. Adaptive: the cluster starts at "
             + (f"{args.start_split}" if args.start_split else "an even split")
             + " and the ratio policy (cluster/pools/ratio.py: window 30 s, cooldown 30 s) moves workers.", "",
             "| GPUs | best static | adaptive (from) | adaptive / best static | moves at its goodput |",
             "|---|---|---|---|---|"]
    for p in points:
        ad = next(r for r in p["rows"] if r["system"] == p["adaptive"])
        moves = ", ".join(f"{m['worker']}->{m['to']} at {m['asked']:.1f}s" for m in ad.get("moves", [])[:6])
        lines.append(f"| {p['gpus']} | {p['best_static']} ({p['best_static_goodput']:.1f}) | "
                     f"{p['adaptive_goodput']:.1f} ({p['adaptive'].rsplit(':', 1)[0]}) | "
                     f"{p['adaptive_vs_best_static']} | {moves or 'none'} |")
    lines += ["", "Every static split:", "", "| GPUs | split | goodput | probes |", "|---|---|---|---|"]
    lines += [f"| {p['gpus']} | {r['system']} | {r['goodput']:.1f} | {r['probes']}"
              f"{' (' + r['from'] + ')' if r.get('from') else ''} |"
              for p in points for r in p["rows"]]
    lines += ["", "![goodput by split](adaptive.png)"]
    with open(os.path.join(args.out, "adaptive.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in points:
        st = [r for r in p["rows"] if not r["system"].endswith(":adaptive")]
        xs = [int(r["system"].split(":")[1]) / p["gpus"] for r in st]
        line, = ax.plot(xs, [r["goodput"] for r in st], marker="o", label=f"{p['gpus']} GPUs, static P:D")
        ax.axhline(p["adaptive_goodput"], color=line.get_color(), ls="--", label=f"{p['gpus']} GPUs, adaptive")
    ax.set_xlabel("prefill share of the GPUs")
    ax.set_ylabel("goodput (req/s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "adaptive.png"), dpi=110)
    print("\n".join(lines[4:4 + len(points) + 2]))


if __name__ == "__main__":
    main()
