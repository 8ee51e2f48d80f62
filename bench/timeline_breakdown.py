"""Where a disaggregated request's time goes between "the prefill worker starts its send"
and "the first token is back at the cluster", from the per-request timelines that
`pdserve bench` saves (the server's own spans, GET /admin/timeline).

    python3 bench/timeline_breakdown.py RESULT.json [RESULT.json ...] [--plot out.png] [--json out.json]

A run is named by its file, or by its folder when the files share one name.

Segments (p50 / p90 ms over the requests of each rate):
    sender queue        send_start -> send_taken      (the pair's thread takes it up)
    sender post         send_taken -> send_posted     (order + gather + post, all chunks)
    receiver sees order send_start -> recv_taken
    receiver post       recv_taken -> recv_posted     (receive + scatter enqueued, all chunks)
    receiver wire       recv_posted -> recv_done      (the last chunk lands, stream drained)
    to the batch        recv_done -> kv_landed        (the decode loop notices, between steps)
    to the cluster      kv_landed -> first_token_at_edge (the stream through Ray)
"""

from __future__ import annotations

import argparse
import json
import os

from pdserve.bench.report import read_result

SEGMENTS = (("sender queue", "send_start", "send_taken"), ("sender post", "send_taken", "send_posted"),
            ("receiver sees order", "send_start", "recv_taken"), ("receiver post", "recv_taken", "recv_posted"),
            ("receiver wire", "recv_posted", "recv_done"), ("to the batch", "recv_done", "kv_landed"),
            ("to the cluster", "kv_landed", "first_token_at_edge"))
STACK = ("receiver sees order", "receiver post", "receiver wire", "to the batch", "to the cluster")


def pct(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    vals = sorted(vals)
    return vals[min(len(vals) - 1, int(q / 100 * len(vals)))]


def breakdown(result: dict) -> list[dict]:
    rows = []
    for r in result["runs"]:
        tl = r.get("timeline") or []
        row = {"rate": r["rate"], "kv_to_first_token": r.get("phase_ms", {}).get("kv_to_first_token")}
        for name, a, b in SEGMENTS:
            vals = [1000 * (t["spans"][b] - t["spans"][a]) for t in tl if a in t["spans"] and b in t["spans"]]
            row[name] = (pct(vals, 50), pct(vals, 90))
        rows.append(row)
    return rows


def markdown(named: list[tuple[str, list[dict]]]) -> str:
    head = "| run | rate | kv_to_first_token p50 / p90 | " + " | ".join(n for n, _, _ in SEGMENTS) + " |"
    lines = [head, "|" + " --- |" * (3 + len(SEGMENTS))]
    fmt = lambda v: "-" if v[0] is None else f"{v[0]:.1f} / {v[1]:.1f}"  # noqa: E731
    for name, rows in named:
        for row in rows:
            k = row["kv_to_first_token"]
            kv = "-" if not k else f"{k['p50']:.1f} / {k['p90']:.1f}"
            lines.append(f"| {name} | {row['rate']:g} | {kv} | " + " | ".join(fmt(row[n]) for n, _, _ in SEGMENTS)
                         + " |")
    return "\n".join(lines)


def plot(named: list[tuple[str, list[dict]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, stacks = [], []
    for name, rows in named:
        for row in rows:
            if row[STACK[0]][0] is None:
                continue  # a run from before the transfer spans existed
            labels.append(f"{name} @{row['rate']:g}")
            stacks.append([row[s][0] or 0.0 for s in STACK])
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4.5))
    bottom = [0.0] * len(labels)
    for i, seg in enumerate(STACK):
        vals = [s[i] for s in stacks]
        ax.bar(range(len(labels)), vals, bottom=bottom, label=seg)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = min(400.0, 1.15 * max(bottom, default=1.0))
    for x, top in enumerate(bottom):
        if top > cap:
            ax.annotate(f"{top:.0f} ms", (x, cap * 0.97), ha="center", va="top", fontsize=7)
    ax.set_ylim(0, cap)
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("ms (p50 of each segment)")
    ax.set_title("send start -> first token at the cluster, by segment (receiver side)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--plot")
    ap.add_argument("--json", help="write the segments (p50, p90 ms) of each run and rate here")
    args = ap.parse_args()
    named = []
    stems = [os.path.basename(p).removesuffix(".gz").removesuffix(".json") for p in args.results]
    for path, stem in zip(args.results, stems):
        name = stem.removeprefix("long_disagg").lstrip("_") or "final"
        if stems.count(stem) > 1:
            name = os.path.basename(os.path.dirname(os.path.abspath(path)))
        named.append((name, breakdown(read_result(path))))
    if args.plot:
        plot(named, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"run": n, "rows": rows} for n, rows in named], f, indent=1)
    print(markdown(named))


if __name__ == "__main__":
    main()
