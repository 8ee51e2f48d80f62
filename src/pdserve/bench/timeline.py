"""Per-request timelines from a pdserve server's own spans (`GET /admin/timeline`): where
each request's time went before its first token, and a plot of them.

Spans (wall-clock seconds, by the workers' clocks on one host): arrival (at the
cluster), prefill_queued, target_known (the decode reservation reached the prefill
worker), prefill_done (first token sampled), send_start, decode_queued, reserved,
kv_landed, relayed (the worker's stream hands the first token to Ray), first_token_at_edge
(back at the cluster). Phases: prefill (queue + compute),
decode_reserve (the finished prefill waiting for the reservation: 0 when it came
first), kv_to_first_token (send start -> first token at the cluster: wire + admission +
relay); for a prompt prefilled on its decode worker (hybrid placement): local_queued,
local_prefill_done, and the phases local_prefill (queue + chunked prefill there) and
local_to_first_token; local_first_token (a request served by one worker, no spans).
"""

from __future__ import annotations

import os

from .report import percentile

PHASES = ("prefill", "decode_reserve", "kv_to_first_token", "local_prefill", "local_to_first_token",
          "local_first_token")
# bars of the plot: (label, start span, end span)
BARS = (("to prefill worker", "arrival", "prefill_queued"), ("prefill (queue + compute)", "prefill_queued",
                                                              "prefill_done"),
        ("waiting for the reservation", "prefill_done", "send_start"),
        ("KV + first token to the client", "send_start", "first_token_at_edge"),
        ("to the decode worker", "arrival", "local_queued"),
        ("prefill on the decode worker (queue + chunks)", "local_queued", "local_prefill_done"),
        ("first token to the client", "local_prefill_done", "first_token_at_edge"))
# a handoff's kv_to_first_token, cut at its spans: (name, start span, end span)
HANDOFF_PARTS = (("kv_transfer", "send_start", "recv_done"), ("kv_pickup", "recv_done", "kv_landed"),
                 ("first_token_emit", "kv_landed", "relayed"), ("first_token_relay", "relayed", "first_token_at_edge"),
                 ("kv_to_first_token_over_transfer", "recv_done", "first_token_at_edge"))
COLORS = ("#bbbbbb", "#4c72b0", "#dd8452", "#55a868", "#bbbbbb", "#8172b3", "#55a868")


def _ms(vals: list[float]) -> dict:
    return {"p50": 1000 * percentile(vals, 50), "p90": 1000 * percentile(vals, 90),
            "mean": 1000 * sum(vals) / len(vals), "n": len(vals)}


def phase_stats(timeline: list[dict]) -> dict:
    """phase (and a handoff's parts, HANDOFF_PARTS) -> {p50, p90, mean, n} in ms, plus the share of
    requests with a reservation wait."""
    out = {}
    for ph in PHASES:
        vals = [t["phases"][ph] for t in timeline if ph in t.get("phases", {})]
        if vals:
            out[ph] = _ms(vals)
    for name, a, b in HANDOFF_PARTS:  # per request, so parts of one request add up
        vals = [t["spans"][b] - t["spans"][a] for t in timeline if a in t["spans"] and b in t["spans"]]
        if vals:
            out[name] = _ms(vals)
    waits = [t["phases"]["decode_reserve"] for t in timeline if "decode_reserve" in t.get("phases", {})]
    if waits:
        out["reserve_on_critical_path_share"] = sum(1 for w in waits if w > 0.001) / len(waits)
    return out


def plot(timeline: list[dict], path: str, title: str, max_requests: int = 60) -> str | None:
    """A Gantt chart of consecutive requests (by arrival), one row each; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = sorted((t for t in timeline if "send_start" in t["spans"] or "local_queued" in t["spans"]),
                  key=lambda t: t["spans"]["arrival"])
    rows = rows[len(rows) // 2 - max_requests // 2:][:max_requests] if len(rows) > max_requests else rows
    if not rows:
        return None
    t0 = rows[0]["spans"]["arrival"]
    fig, ax = plt.subplots(figsize=(11, 0.16 * len(rows) + 1.6))
    labelled = set()
    for y, t in enumerate(rows):
        s = t["spans"]
        for (label, a, b), color in zip(BARS, COLORS):
            if a in s and b in s and not (b == "first_token_at_edge" and "send_start" in s and a != "send_start"):
                ax.barh(y, 1000 * max(0.0, s[b] - s[a]), left=1000 * (s[a] - t0), color=color, height=0.8,
                        label=None if label in labelled else label)
                labelled.add(label)
    ax.set_xlabel("ms since the first request shown arrived")
    ax.set_ylabel("request (by arrival)")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
