"""Where disaggregation pays, predicted: `pdserve plan --gpus N` (pdserve.sim.layouts.recommend)
over a grid of GPU counts, workloads and TPOT SLOs, from one profile. CPU only.

    python bench/plan_grid.py --gpus 8,16 --out bench/results/plan/grid

For each point: the best layout and its predicted goodput, the best colocated, disaggregated and
hybrid layouts, and the best split's gain over colocated on the same GPUs. The workloads are the
serving runs' (bench/serving_gpu.py's WORKLOADS) with the TPOT SLO of the point. Writes
grid.{md,json,png} and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from serving_gpu import WORKLOADS  # noqa: E402


def with_tpot(argv: list[str], tpot_s: float) -> list[str]:
    out = list(argv)
    out[out.index("--slo-tpot") + 1] = f"{tpot_s:g}"
    return out


def best_of(ranked, mode: str):
    return next((c for c in ranked if c.system.startswith(mode)), None)


def point(profile, gpus: int, workload: str, tpot_s: float, num_requests: int, jobs: int | None) -> dict:
    from pdserve.sim.layouts import recommend

    argv = [*with_tpot(WORKLOADS[workload], tpot_s), "--seed", "0"]
    t0 = time.monotonic()
    ranked = recommend(profile, gpus, argv, num_requests, jobs=jobs)
    colo, dis, hyb = (best_of(ranked, m) for m in ("colocated", "disagg", "hybrid"))
    split = max((c for c in (dis, hyb) if c is not None), key=lambda c: c.rps)
    return {"gpus": gpus, "workload": workload, "tpot_ms": round(tpot_s * 1000), "best": ranked[0].system,
            "best_rps": ranked[0].rps, "colocated_rps": colo.rps, "disagg": dis.system, "disagg_rps": dis.rps,
            "hybrid": hyb.system, "hybrid_rps": hyb.rps,
            "split_gain": split.rps / colo.rps if colo.rps else None,
            "layouts": [{"system": c.system, "rps": c.rps, "simulations": c.simulations} for c in ranked],
            "seconds": round(time.monotonic() - t0, 1)}


def table(points: list[dict]) -> str:
    rows = ["| GPUs | workload | TPOT SLO | best | colocated | best disagg | best hybrid | split vs colocated "
            "| plan time |", "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        gain = f"{p['split_gain']:.2f}x" if p["split_gain"] else "-"
        rows.append(f"| {p['gpus']} | {p['workload']} | {p['tpot_ms']} ms | {p['best']} ({p['best_rps']:.1f}) "
                    f"| {p['colocated_rps']:.1f} | {p['disagg']} ({p['disagg_rps']:.1f}) "
                    f"| {p['hybrid']} ({p['hybrid_rps']:.1f}) | {gain} | {p['seconds']:.0f} s |")
    return "\n".join(rows)


def plot(points: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{p['gpus']} GPUs\n{p['workload']}\nTPOT {p['tpot_ms']}" for p in points]
    xs = range(len(points))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(points)), 4))
    for k, (key, name) in enumerate((("colocated_rps", "colocated"), ("disagg_rps", "best disagg"),
                                     ("hybrid_rps", "best hybrid"))):
        ax.bar([x + (k - 1) * 0.27 for x in xs], [p[key] / p["gpus"] for p in points], 0.27, label=name)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("predicted goodput per GPU (req/s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from pdserve.sim import Profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=os.path.join(HERE, "results", "profiles", "llama3-8b.json"))
    ap.add_argument("--gpus", default="8,16")
    ap.add_argument("--workloads", default="long,trace")
    ap.add_argument("--tpots", default="0.02,0.04", help="TPOT SLOs, seconds")
    ap.add_argument("--num-requests", type=int, default=200, help="requests a probed rate (at least 10 s of them)")
    ap.add_argument("--jobs", type=int, default=None, help="layouts searched at once (default: one per core)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prof = Profile.load(args.profile)
    grid = [(int(g), w, float(t)) for g in args.gpus.split(",") for w in args.workloads.split(",")
            for t in args.tpots.split(",")]
    for w in {w for _, w, _ in grid}:
        if w not in WORKLOADS:
            ap.error(f"--workloads: {w!r} is not one of {', '.join(WORKLOADS)}")
    points = []
    for i, (gpus, wl, tpot) in enumerate(grid, 1):
        points.append(point(prof, gpus, wl, tpot, args.num_requests, args.jobs))
        p = points[-1]
        print(f"[{i}/{len(grid)}] {gpus} GPUs, {wl}, TPOT {p['tpot_ms']} ms: {p['best']} {p['best_rps']:.1f} req/s, "
              f"colocated {p['colocated_rps']:.1f} ({p['seconds']:.0f} s)", flush=True)
    title = f"{prof.model} on {prof.device} x N, predicted (pdserve plan): goodput per GPU at >= 90% attainment"
    md = (f"# Where disaggregation pays, predicted\n\n{title}.\n\n`python bench/plan_grid.py --gpus {args.gpus} "
          f"--workloads {args.workloads} --tpots {args.tpots}` (CPU; {os.cpu_count()} cores). Workloads: "
          f"bench/serving_gpu.py's (long: 4096 in / 256 out, TTFT 1 s; trace: the Mooncake conversation trace "
          f"scaled as the serving runs, TTFT 2 s). Goodput in req/s.\n\n{table(points)}\n\n![plot](grid.png)\n")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "grid.json"), "w") as f:
            json.dump({"profile": os.path.relpath(args.profile, os.path.dirname(HERE)), "model": prof.model,
                       "device": prof.device, "num_requests": args.num_requests, "points": points}, f, indent=1)
        with open(os.path.join(args.out, "grid.md"), "w") as f:
            f.write(md)
        plot(points, os.path.join(args.out, "grid.png"), title)
    print()
    print(table(points))


if __name__ == "__main__":
    main()
