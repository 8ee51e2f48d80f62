"""Goodput against the TPOT SLO for hybrid, disaggregated 1P1D and colocated-2, from the
sweeps of bench/serving_gpu.py (md + json + PNG).

The pure modes do not depend on the SLO they are measured against: their goodput at each
TPOT SLO comes from one sweep's per-request TTFT and TPOT (`requests_detail`). A hybrid
server is told its SLO (it sizes the decode workers' prefill chunks to it), so each of its
points is its own sweep, run with that SLO.

    python bench/hybrid_report.py --runs bench/results/hybrid/runs --out bench/results/hybrid
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

from pdserve.bench.report import goodput, read_result

TPOT_SLOS_MS = (15, 20, 25, 30, 40, 50)
TTFT_SLO_S = {"long": 1.0, "trace": 2.0}
SYSTEMS = ("hybrid", "disagg", "colocated")


def attainment(run: dict, ttft: float, tpot: float) -> float:
    """Share of the run's requests (failures count as misses) inside both SLOs."""
    rows = run["requests_detail"]  # [sent, prompt tokens, output tokens, ttft, tpot, e2e]
    met = sum(1 for r in rows if r[3] is not None and r[3] <= ttft and (r[4] is None or r[4] <= tpot))
    return met / len(rows) if rows else 0.0


def curve(result: dict, ttft: float, tpot: float) -> dict:
    runs = [{"rate": r["rate"], "slo_attainment": attainment(r, ttft, tpot)} for r in result["runs"]]
    g = goodput(runs)
    return {"rps": g["rps"], "lower_bound": g["lower_bound"],
            "attainment": {f"{r['rate']:g}": round(r["slo_attainment"], 3) for r in runs}}


def collect(runs_dir: str) -> dict:
    """workload -> system -> tpot ms -> {rps, lower_bound, attainment}."""
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(runs_dir, "*.json*"))):
        m = re.fullmatch(r"(long|trace)_(hybrid|disagg|colocated)(?:-t(\d+))?\.json(?:\.gz)?", os.path.basename(path))
        if not m:
            continue
        wl, system, told = m.group(1), m.group(2), m.group(3)
        res = read_result(path)
        slos = [int(told)] if told else TPOT_SLOS_MS
        for ms in slos:
            point = curve(res, TTFT_SLO_S[wl], ms / 1000)
            point["rates"] = [r["rate"] for r in res["runs"]]
            out.setdefault(wl, {}).setdefault(system, {})[ms] = point
    return out


def fmt(p: dict | None) -> str:
    if p is None:
        return "not run"
    return f"{'>= ' if p['lower_bound'] else ''}{p['rps']:.2f}" if p["rps"] else "< lowest rate"


def markdown(data: dict) -> str:
    lines = []
    for wl, systems in data.items():
        lines += [f"### {wl}: goodput (req/s, >= 90% of requests within TTFT <= {TTFT_SLO_S[wl]:g} s and the "
                  "TPOT SLO)", "", "| TPOT SLO (ms) | " + " | ".join(SYSTEMS) + " |",
                  "| --- |" + " --- |" * len(SYSTEMS)]
        for ms in TPOT_SLOS_MS:
            lines.append(f"| {ms} | " + " | ".join(fmt(systems.get(s, {}).get(ms)) for s in SYSTEMS) + " |")
        lines.append("")
        for s in SYSTEMS:
            for ms, p in sorted(systems.get(s, {}).items()):
                if s == "hybrid" or ms == 40:
                    lines.append(f"- {s} at TPOT {ms} ms, attainment by rate: {p['attainment']}")
        lines.append("")
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 4), squeeze=False)
    for ax, (wl, systems) in zip(axes[0], data.items()):
        for s, marker in zip(SYSTEMS, ("o", "s", "^")):
            pts = sorted((ms, p["rps"] or 0.0) for ms, p in systems.get(s, {}).items())
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, label=s)
        ax.set_xlabel("TPOT SLO (ms)")
        ax.set_ylabel("goodput (req/s)")
        ax.set_title(f"{wl}: TTFT <= {TTFT_SLO_S[wl]:g} s, 2x H200, 200 req/rate", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="bench/results/hybrid/runs")
    ap.add_argument("--out", default="bench/results/hybrid")
    args = ap.parse_args()
    data = collect(args.runs)
    with open(os.path.join(args.out, "goodput_vs_tpot.json"), "w") as f:
        json.dump({wl: {s: {str(ms): p for ms, p in pts.items()} for s, pts in sy.items()}
                   for wl, sy in data.items()}, f, indent=1)
    text = markdown(data)
    with open(os.path.join(args.out, "goodput_vs_tpot.md"), "w") as f:
        f.write(text + "\n")
    plot(data, os.path.join(args.out, "goodput_vs_tpot.png"))
    print(text)


if __name__ == "__main__":
    main()
