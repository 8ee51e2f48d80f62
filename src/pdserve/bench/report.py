"""Benchmark statistics, goodput, markdown tables and plots.

SLO attainment at a rate: the fraction of all sent requests (failures count as misses)
with TTFT <= ttft_slo and TPOT <= tpot_slo. Goodput (DistServe): the highest request
rate at which attainment stays >= 90%, interpolated linearly between the swept rates
around the first rate that falls below; when every rate attains, the highest swept
rate (a lower bound, flagged).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re

from .client import Record

ATTAINMENT = 0.9


def read_result(path: str) -> dict:
    """A result file as `write` left it, or gzipped (committed runs are: their per-request records
    are most of their bytes): `path` itself, else `path` + ".gz"."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    k = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def _dist(values: list[float]) -> dict:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {
        "mean": (sum(values) / len(values)) if values else None}


def summarize(records: list[Record], duration: float, rate: float, ttft_slo: float, tpot_slo: float,
              metrics_before: dict | None = None, metrics_after: dict | None = None) -> dict:
    ok = [r for r in records if r.ok]
    met = sum(1 for r in ok if r.ttft <= ttft_slo and (r.tpot is None or r.tpot <= tpot_slo))
    itls = [g for r in ok for g in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    hit_rate = None
    if metrics_before is not None and metrics_after:
        q = counter_increase(metrics_before, metrics_after, "vllm:prefix_cache_queries_total")
        h = counter_increase(metrics_before, metrics_after, "vllm:prefix_cache_hits_total")
        hit_rate = h / q if q and h is not None else None
    phases = _phase_means(metrics_before or {}, metrics_after or {})
    errors = sorted({r.error for r in records if r.error})[:5]
    return {
        "rate": rate, "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": errors, "duration_s": duration,
        "ttft_s": _dist([r.ttft for r in ok]), "tpot_s": _dist([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _dist(itls), "e2e_s": _dist([r.e2e for r in ok]),
        "throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "output_tok_s": out_tokens / duration if duration > 0 else 0.0,
        "input_tok_s": sum(r.prompt_tokens for r in ok) / duration if duration > 0 else 0.0,
        "slo_attainment": met / len(records) if records else 0.0,
        "slo_goodput_rps": met / duration if duration > 0 else 0.0,
        "prefix_hit_rate": hit_rate,
        "phase_mean_s": phases,  # pdserve only: where the time before the first token went
        # per request, in send order: [sent s, prompt tokens, output tokens, ttft s, tpot s, e2e s]
        "requests_detail": [[round(r.sent, 4), r.prompt_tokens, r.output_tokens, _r(r.ttft), _r(r.tpot), _r(r.e2e)]
                            for r in sorted(records, key=lambda r: r.sent)],
    }


def counter_increase(before: dict, after: dict, name: str) -> float | None:
    """How much a counter grew over a run, as Prometheus' increase() counts it: per series
    (per worker), a series that starts during the run counts from 0, one that fell (its
    worker restarted) from 0 again, and one that is gone (its worker left: scaled down, or
    switched roles) adds nothing. Summing the totals instead gave a negative hit rate after a
    scale-down. None when the server has no such counter."""
    series = [k for k in after if k.startswith(name + "{")]
    if not series:
        if name not in after:
            return None
        inc = after[name] - before.get(name, 0.0)
        return after[name] if inc < 0 else inc
    total = 0.0
    for k in series:
        inc = after[k] - before.get(k, 0.0)
        total += after[k] if inc < 0 else inc
    return total


def _phase_means(before: dict, after: dict) -> dict:
    """Mean seconds per request phase over the run, from pdserve:request_phase_seconds."""
    prefix = "pdserve:request_phase_seconds_sum{"
    out = {}
    for key, total in after.items():
        m = re.search(r'[{,]phase="([^"]*)"', key) if key.startswith(prefix) else None
        if m:
            phase = m.group(1)
            ckey = key.replace("_sum{", "_count{")
            n = after.get(ckey, 0) - before.get(ckey, 0)
            if n > 0:
                out[phase] = (total - before.get(key, 0.0)) / n
    return out


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 5)


def goodput(runs: list[dict], level: float = ATTAINMENT) -> dict:
    """{"rps": ..., "lower_bound": bool} from runs at increasing rates."""
    pts = sorted((r["rate"], r["slo_attainment"]) for r in runs if math.isfinite(r["rate"]))
    if not pts:
        return {"rps": None, "lower_bound": False}
    if pts[0][1] < level:  # misses at the lowest swept rate: below what the sweep can tell
        return {"rps": 0.0, "lower_bound": False}
    for (r0, a0), (r1, a1) in zip(pts, pts[1:]):
        if a1 < level:
            return {"rps": r0 + (a0 - level) / (a0 - a1) * (r1 - r0), "lower_bound": False}
    return {"rps": pts[-1][0], "lower_bound": True}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [f"### {result['label']}: {cfg['workload_desc']}", "",
             f"SLOs: TTFT <= {cfg['ttft_slo']} s, TPOT <= {cfg['tpot_slo'] * 1000:.0f} ms; goodput "
             f"(>= {ATTAINMENT:.0%} attainment): **{_fmt_goodput(result['goodput'])} req/s**", "",
             "| rate (req/s) | done/sent | TTFT p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) | ITL p90 (ms) "
             "| out tok/s | SLO attainment | prefix hit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    phases = [(r["rate"], r.get("phase_mean_s")) for r in result["runs"] if r.get("phase_mean_s")]
    for r in result["runs"]:
        t, p = r["ttft_s"], r["tpot_s"]
        hit = "-" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.0%}"
        lines.append(f"| {r['rate']:g} | {r['completed']}/{r['requests']} | {_ms(t['p50'])}/{_ms(t['p90'])}/"
                     f"{_ms(t['p99'])} | {_ms(p['p50'])}/{_ms(p['p90'])}/{_ms(p['p99'])} | {_ms(r['itl_s']['p90'])} "
                     f"| {r['output_tok_s']:.0f} | {r['slo_attainment']:.0%} | {hit} |")
    timed = [(r["rate"], r["phase_ms"]) for r in result["runs"]
             if any(n in r.get("phase_ms", {}) for n in ("prefill", "local_prefill", "local_first_token"))]
    if timed:
        from .timeline import HANDOFF_PARTS, PHASES

        names = [n for n in (*PHASES, *(p[0] for p in HANDOFF_PARTS)) if any(n in ph for _, ph in timed)]
        lines += ["", "Phases before the first token, p50 / p90 (ms, from the server's per-request timeline):",
                  "", "| rate | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for rate, ph in timed:
            cells = [f"{ph[n]['p50']:.1f} / {ph[n]['p90']:.1f}" if n in ph else "-" for n in names]
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    elif phases:
        lines += ["", "Mean time per phase before the first token (ms, from the server's metrics):", "",
                  "| rate | " + " | ".join(sorted(phases[0][1])) + " |",
                  "| --- |" + " --- |" * len(phases[0][1])]
        for rate, ph in phases:
            lines.append(f"| {rate:g} | " + " | ".join(_ms(ph.get(k)) for k in sorted(phases[0][1])) + " |")
    return "\n".join(lines) + "\n"


def _fmt_goodput(g: dict) -> str:
    if g["rps"] is None:
        return "-"
    return f"{'>= ' if g['lower_bound'] else ''}{g['rps']:.2f}"


def write(result: dict, out_dir: str, stem: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(result))
    paths += plot([result], out_dir, stem)
    from .timeline import plot as plot_timeline

    for r in result["runs"]:
        if r.get("timeline"):
            title = f"{result['label']} @ {r['rate']:g} req/s: {result['config']['workload_desc']}"
            p = plot_timeline(r["timeline"], os.path.join(out_dir, f"{stem}_timeline_{r['rate']:g}.png"), title)
            paths += [p] if p else []
    return paths


NO_MATPLOTLIB = "matplotlib is not installed: pip install 'pdserve[bench]' for the plots"


def plot(results: list[dict], out_dir: str, stem: str, required: bool = False) -> list[str]:
    """latency vs rate and SLO attainment vs rate, one line per result. Without matplotlib:
    [] and a notice, or a ValueError (exit 2) when the plot is all that was asked for."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if required:
            raise ValueError(NO_MATPLOTLIB) from None
        print(f"pdserve bench: {NO_MATPLOTLIB}; skipping them")
        return []
    os.makedirs(out_dir, exist_ok=True)
    cfg = results[0]["config"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for res in results:
        runs = sorted(res["runs"], key=lambda r: r["rate"])
        rates = [r["rate"] for r in runs]
        axes[0].plot(rates, [r["ttft_s"]["p90"] for r in runs], "o-", label=res["label"])
        axes[1].plot(rates, [(r["tpot_s"]["p90"] or 0) * 1000 for r in runs], "o-", label=res["label"])
        axes[2].plot(rates, [100 * r["slo_attainment"] for r in runs], "o-", label=res["label"])
    axes[0].axhline(cfg["ttft_slo"], color="gray", ls="--", lw=1, label="SLO")
    axes[1].axhline(cfg["tpot_slo"] * 1000, color="gray", ls="--", lw=1, label="SLO")
    axes[2].axhline(100 * ATTAINMENT, color="gray", ls="--", lw=1, label="90%")
    for ax, title, ylabel in zip(axes, ("TTFT p90", "TPOT p90", "SLO attainment"), ("s", "ms", "%")):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.suptitle(cfg["workload_desc"], fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
