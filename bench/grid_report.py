"""The multi-GPU serving grid (issue: disaggregation that pays): colocated, disaggregated and
hybrid (and the adaptive ratio) on the same GPUs, per workload and TPOT SLO, with the spread of
repeated sweeps, from the runs of bench/serving_gpu.py (bench/multi_gpu_grid.sh lays them out):

    RUNS/gpus<N>/<workload>_<system>[-t<ms>][-r<k>][.p<j>].json[.gz]   e.g. gpus4/long_hybrid-2-2-t20-r2.json.gz

(committed runs are gzipped: their per-request records are most of a result's bytes). `.p<j>`
(j >= 2) is a later part of the same sweep: the same system and repeat, run on its own server at
higher rates when the first part met the SLO at its top rate. A sweep's parts are one curve: their
rates merged in order (a rate two parts share counts once, from the earlier part); the first-rate
check reads the first part.

A server told its TPOT SLO (hybrid, colocated: `-t<ms>`) gives the point at that SLO; one that is
not (disagg) gives every SLO from one sweep's per-request TTFT and TPOT (hybrid_report.curve).

    python bench/grid_report.py --runs bench/results/multi_gpu/runs --out bench/results/multi_gpu

Writes grid.md, grid.json and grid.png to --out and prints the table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hybrid_report import TTFT_SLO_S, curve  # noqa: E402

from pdserve.bench.report import read_result  # noqa: E402

TPOT_SLOS_MS = (20, 40)
FAMILIES = ("colocated", "disagg", "hybrid", "adaptive")
NAME = re.compile(r"(long|trace)_((?:colocated|disagg|hybrid)[-\w]*?)(?:-t(\d+))?(?:-r(\d+))?(?:\.p(\d+))?"
                  r"\.json(?:\.gz)?")


def family(system: str) -> str:
    return "adaptive" if "adaptive" in system else system.split("-", 1)[0]


def sweeps(runs_dir: str) -> dict:
    """(gpus, workload, system, told tpot ms or None, repeat) -> the sweep: its parts' runs merged
    by rate, and its first part's first rate."""
    parts: dict = {}
    for path in sorted(glob.glob(os.path.join(runs_dir, "gpus*", "*.json*"))):
        m = NAME.fullmatch(os.path.basename(path))
        if not m or "_status.json" in path or "_handoff.json" in path:
            continue
        res = read_result(path)
        if "runs" not in res:
            continue
        gpus = int(os.path.basename(os.path.dirname(path))[4:])
        wl, system, told, rep, part = m.group(1), m.group(2), m.group(3), int(m.group(4) or 1), int(m.group(5) or 1)
        parts.setdefault((gpus, wl, system, told and int(told), rep), []).append((part, res["runs"]))
    out = {}
    for key, got in parts.items():
        merged: dict = {}
        for _, runs in sorted(got, key=lambda g: g[0]):
            for r in runs:
                merged.setdefault(r["rate"], r)
        out[key] = {"runs": [merged[rate] for rate in sorted(merged)]}
    return out


def collect(runs_dir: str) -> dict:
    """(gpus, workload, tpot ms) -> family -> system -> repeat -> its point (goodput, whether a lower
    bound, the first rate's attainment, the rates swept)."""
    out: dict = {}
    for (gpus, wl, system, told, rep), res in sweeps(runs_dir).items():
        for ms in [told] if told else TPOT_SLOS_MS:
            p = curve(res, TTFT_SLO_S[wl], ms / 1000)
            cell = out.setdefault((gpus, wl, ms), {}).setdefault(family(system), {}).setdefault(system, {})
            cell[rep] = {"rps": p["rps"] or 0.0, "lower_bound": p["lower_bound"],
                         "first_rate": next(iter(p["attainment"].items()), None),
                         "rates": [r["rate"] for r in res["runs"]]}
    return out


def best(systems: dict) -> tuple[str, float, list[float]] | None:
    """A family's best system: (name, mean goodput over its repeats, the repeats)."""
    rows = [(s, statistics.mean(r["rps"] for r in reps.values()), [reps[k]["rps"] for k in sorted(reps)])
            for s, reps in systems.items()]
    return max(rows, key=lambda r: r[1]) if rows else None


def bounds(reps: dict) -> dict:
    """What a best system's sweeps could not resolve: `lower_bound` when every sweep met the SLO at its
    top rate (goodput is at least that), `below` the lowest rate when no sweep met it anywhere."""
    out = {}
    if all(r["lower_bound"] for r in reps.values()):
        out["lower_bound"] = True
    if not any(r["rps"] for r in reps.values()):
        out["below"] = min(min(r["rates"]) for r in reps.values())
    return out


def summarize(data: dict) -> list[dict]:
    rows = []
    for (gpus, wl, ms), fams in sorted(data.items()):
        row = {"gpus": gpus, "workload": wl, "tpot_ms": ms}
        for fam in FAMILIES:
            b = best(fams.get(fam, {}))
            row[fam] = None if b is None else {"system": b[0], "rps": round(b[1], 3), "repeats": b[2],
                                               **bounds(fams[fam][b[0]])}
        pure = [row[f] for f in ("colocated", "disagg") if row[f]]
        top = max(pure, key=lambda c: c["rps"]) if pure else None
        for fam in ("hybrid", "adaptive"):
            # a ratio of two lower bounds says nothing: both met the SLO at every rate swept
            if row[fam] and top and top["rps"] > 0 and not (row[fam].get("lower_bound") and top.get("lower_bound")):
                row[f"{fam}_vs_best_pure"] = round(row[fam]["rps"] / top["rps"], 3)
        row["first_rate_gap"] = first_rate_gaps(fams)
        rows.append(row)
    return rows


def first_rate_gaps(fams: dict) -> dict:
    """Per system with repeats: attainment at the first rate of its first sweep minus its second's
    (points; a server that is not warm when healthy misses more in the first)."""
    gaps = {}
    for systems in fams.values():
        for s, reps in systems.items():
            if 1 in reps and 2 in reps and reps[1]["first_rate"] and reps[2]["first_rate"]:
                gaps[s] = round(100 * (reps[2]["first_rate"][1] - reps[1]["first_rate"][1]), 1)
    return gaps


def fmt(cell: dict | None) -> str:
    if cell is None:
        return "not run"
    if "below" in cell:
        return f"{cell['system']}: < {cell['below']:g} (the lowest rate swept)"
    spread = "" if len(cell["repeats"]) < 2 else f" ({min(cell['repeats']):.2f}-{max(cell['repeats']):.2f})"
    return f"{cell['system']}: {'>= ' if cell.get('lower_bound') else ''}{cell['rps']:.2f}{spread}"


def markdown(rows: list[dict]) -> str:
    lines = ["| GPUs | workload | TPOT SLO | colocated | disagg | hybrid | adaptive | hybrid / best pure |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = r.get("hybrid_vs_best_pure")
        lines.append(f"| {r['gpus']} | {r['workload']} | {r['tpot_ms']} ms | " +
                     " | ".join(fmt(r[f]) for f in FAMILIES) + f" | {'-' if ratio is None else f'{ratio:.2f}'} |")
    gaps = [f"{s} {g:+.1f}" for r in rows for s, g in r["first_rate_gap"].items()]
    lines += ["", "Goodput: req/s with >= 90% of requests inside TTFT (long 1 s, trace 2 s) and the TPOT SLO; "
              "the mean over repeats, their range in brackets; '>=': every sweep met the SLO at its top rate.",
              "First rate, attainment of a repeat minus the first sweep's (points): " + (", ".join(gaps) or "-")]
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    width = 0.8 / len(FAMILIES)
    for i, fam in enumerate(FAMILIES):
        xs, ys, lo, hi = [], [], [], []
        for j, r in enumerate(rows):
            if r[fam]:
                xs.append(j + (i - 1.5) * width)
                ys.append(r[fam]["rps"])
                lo.append(r[fam]["rps"] - min(r[fam]["repeats"]))
                hi.append(max(r[fam]["repeats"]) - r[fam]["rps"])
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=fam)
    ax.set_xticks(range(len(rows)), [f"{r['gpus']} GPUs\n{r['workload']} t{r['tpot_ms']}" for r in rows], fontsize=8)
    ax.set_ylabel("goodput (req/s)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="bench/results/multi_gpu/runs")
    ap.add_argument("--out", default="bench/results/multi_gpu")
    args = ap.parse_args()
    rows = summarize(collect(args.runs))
    with open(os.path.join(args.out, "grid.json"), "w") as f:
        json.dump(rows, f, indent=1)
    text = markdown(rows)
    with open(os.path.join(args.out, "grid.md"), "w") as f:
        f.write(text + "\n")
    if rows:
        plot(rows, os.path.join(args.out, "grid.png"))
    print(text)


if __name__ == "__main__":
    main()
