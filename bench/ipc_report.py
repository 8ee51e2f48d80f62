"""Where a handed-off request's first token spends its time after the prefill worker starts
sending, through Ray's stream and through the output pipe (one H200, both workers on it):
stacked p50s of the timeline's handoff parts per rate, from two serving runs' results.

    python bench/ipc_report.py bench/results/ipc/serving/trace_disagg-1-1-one-gpu.json \\
        bench/results/ipc/serving/trace_disagg-1-1-one-gpu-pipe.json --out bench/results/ipc/first_token_parts.png
"""

from __future__ import annotations

import argparse

from pdserve.bench.report import read_result

PARTS = (("kv_transfer", "KV transfer", "#4c72b0"), ("kv_pickup", "decode worker takes it", "#dd8452"),
         ("first_token_emit", "to the worker's outlet", "#8172b3"),
         ("first_token_relay", "relay to the cluster", "#c44e52"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ray", help="a serving result whose outputs came through Ray's stream")
    ap.add_argument("pipe", help="the same run with the output pipe")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(label, r) for label, path in (("Ray stream", args.ray), ("output pipe", args.pipe))
            for r in read_result(path)["runs"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels, bottom = [], [0.0] * len(runs)
    for key, name, color in PARTS:
        vals = [r["phase_ms"][key]["p50"] for _, r in runs]
        ax.bar(range(len(runs)), vals, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    labels = [f"{label}\n{r['rate']:g} req/s" for label, r in runs]
    ax.set_xticks(range(len(runs)), labels, fontsize=8)
    ax.set_ylabel("ms (p50 of each part)")
    ax.set_title("A handoff's send start -> first token at the cluster, one H200 shared by both workers", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
