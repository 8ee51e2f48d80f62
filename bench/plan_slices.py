"""`pdserve plan`'s slices against the whole: each candidate layout of N GPUs searched both as
replicas of a slice (what `pdserve plan --gpus N` does past 8 GPUs) and as the whole cluster
(`--whole`), on one workload, from one profile. CPU only.

    python bench/plan_slices.py --gpus 16,32,64 --out bench/results/plan

Writes slices.{md,json,png} and prints the table last: per layout both goodputs and their
difference, per N whether both rank the same layout first, and each search's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = ["--workload", "synthetic", "--input-len", "4096", "--output-len", "16", "--slo-ttft", "1.0",
            "--slo-tpot", "0.04", "--seed", "0"]  # docs/performance.md's `pdserve plan` command


def compare(profile, gpus: int, num_requests: int, jobs: int | None) -> dict:
    from pdserve.sim.layouts import SLICE_MAX, recommend

    t0 = time.monotonic()
    sliced = recommend(profile, gpus, WORKLOAD, num_requests, jobs=jobs, slice_max=SLICE_MAX)
    t1 = time.monotonic()
    # the whole cluster, for the same layouts (the slices' splits scaled)
    whole = {c.system: c for c in recommend(profile, gpus, WORKLOAD, num_requests, jobs=jobs,
                                            systems=[c.system for c in sliced])}
    t2 = time.monotonic()
    rows = [{"system": c.system, "slice": c.slice, "replicas": c.replicas, "sliced_rps": c.rps,
             "whole_rps": whole[c.system].rps,
             "diff": (c.rps - whole[c.system].rps) / whole[c.system].rps if whole[c.system].rps else None}
            for c in sliced]
    best_whole = max(whole.values(), key=lambda c: (c.rps, c.attainment)).system
    return {"gpus": gpus, "rows": rows, "best_sliced": sliced[0].system, "best_whole": best_whole,
            "sliced_s": round(t1 - t0, 1), "whole_s": round(t2 - t1, 1)}


def table(points: list[dict]) -> str:
    out = ["| GPUs | layout | simulated as | sliced (req/s) | whole (req/s) | sliced vs whole |",
           "|---|---|---|---|---|---|"]
    for p in points:
        for r in p["rows"]:
            d = f"{r['diff']:+.1%}" if r["diff"] is not None else "-"
            out.append(f"| {p['gpus']} | {r['system']} | {r['replicas']} x {r['slice']} | {r['sliced_rps']:.1f} "
                       f"| {r['whole_rps']:.1f} | {d} |")
    out += ["", "| GPUs | best, sliced | best, whole | median abs diff | worst | plan time sliced | whole |",
            "|---|---|---|---|---|---|---|"]
    for p in points:
        diffs = [abs(r["diff"]) for r in p["rows"] if r["diff"] is not None]
        out.append(f"| {p['gpus']} | {p['best_sliced']} | {p['best_whole']} | {statistics.median(diffs):.1%} "
                   f"| {max(diffs):.1%} | {p['sliced_s']:.0f} s | {p['whole_s']:.0f} s |")
    return "\n".join(out)


def plot(points: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 5))
    for p in points:
        ax.scatter([r["whole_rps"] for r in p["rows"]], [r["sliced_rps"] for r in p["rows"]], label=f"{p['gpus']} GPUs")
    top = max(max(r["whole_rps"], r["sliced_rps"]) for p in points for r in p["rows"]) * 1.05
    ax.plot([0, top], [0, top], color="gray", lw=1, ls="--")
    ax.set_xlabel("whole cluster simulated: goodput (req/s)")
    ax.set_ylabel("replicas of a slice: goodput (req/s)")
    ax.set_title("pdserve plan: slices against the whole, per layout", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from pdserve.sim import Profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=os.path.join(HERE, "results", "profiles", "llama3-8b.json"))
    ap.add_argument("--gpus", default="16,32,64")
    ap.add_argument("--num-requests", type=int, default=40, help="the least a probed rate sends (the docs' plan: 40)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prof = Profile.load(args.profile)
    points = []
    for n in [int(x) for x in args.gpus.split(",")]:
        points.append(compare(prof, n, args.num_requests, args.jobs))
        p = points[-1]
        print(f"{n} GPUs: best {p['best_sliced']} sliced, {p['best_whole']} whole; {p['sliced_s']:.0f} s against "
              f"{p['whole_s']:.0f} s", flush=True)
    md = (f"# `pdserve plan`: replicas of a slice against the whole cluster\n\n{prof.model}, {prof.device} "
          f"profile; workload `{' '.join(WORKLOAD)}` (docs/performance.md's plan), at least "
          f"{args.num_requests} requests or 10 s a probed rate. `python bench/plan_slices.py --gpus {args.gpus}` "
          f"(CPU, {os.cpu_count()} cores, one process per core).\n\n{table(points)}\n\n![plot](slices.png)\n")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "slices.json"), "w") as f:
            json.dump({"model": prof.model, "device": prof.device, "workload": WORKLOAD,
                       "num_requests": args.num_requests, "points": points}, f, indent=1)
        with open(os.path.join(args.out, "slices.md"), "w") as f:
            f.write(md)
        plot(points, os.path.join(args.out, "slices.png"))
    print()
    print(table(points))


if __name__ == "__main__":
    main()
