"""Priority scheduling under overload, on CPU: one engine (the default model), Poisson arrivals
at 1.5x the rate it can serve, 20% of requests at priority 0 (high) and 80% at priority 1 (low),
a KV cache small enough that requests are preempted. The same arrivals run under
`scheduling_policy` fcfs and priority; per class: TTFT p50 / p90, preemptions per request.

The engine's capacity is measured first (a closed batch of the same requests: requests / s);
each policy runs `--repeats` times (arrivals of a different seed each time, the same for both
policies) to show the spread.

    python bench/priority_cpu.py --out bench/results/priority
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

from tqdm import tqdm

HIGH, LOW = 0, 1


def workload(n: int, seed: int, rate: float, vocab: int = 30000) -> list[dict]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randrange(32, 97))]
        out.append({"t": t, "prompt": prompt, "priority": HIGH if rng.random() < 0.2 else LOW,
                    "max_tokens": rng.randrange(16, 33)})
    return out


def make_engine(policy: str, blocks: int):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(max_model_len=512, max_num_seqs=32, num_gpu_blocks_override=blocks,
                                  scheduling_policy=policy))


def run(eng, reqs: list[dict]) -> list[dict]:
    """Adds each request at its arrival time, steps until all finish; per request its class,
    TTFT and preemptions."""
    from pdserve.engine.sampling_params import SamplingParams

    start, pending, live, done = time.monotonic(), list(reqs), {}, []
    while pending or eng.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0]["t"] <= now:
            r = pending.pop(0)
            sp = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, priority=r["priority"])
            req = eng.add_request(r["prompt"], sp)
            live[req.request_id] = {"priority": r["priority"], "arrival": start + r["t"], "first": None}
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, pending[0]["t"] - now))
            continue
        for out in eng.step():
            row = live[out.request_id]
            if row["first"] is None and out.outputs and out.outputs[0].token_ids:
                row["first"] = time.monotonic()
            if out.finished:
                done.append({"priority": row["priority"], "ttft_s": row["first"] - row["arrival"],
                             "preemptions": out.metrics.num_preemptions})
    return done


def capacity(blocks: int, n: int = 48) -> float:
    """Requests / s of a closed batch of n requests (all queued at once)."""
    eng = make_engine("fcfs", blocks)
    reqs = [dict(r, t=0.0) for r in workload(n, 999, 1.0)]
    t = time.monotonic()
    run(eng, reqs)
    return n / (time.monotonic() - t)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[max(0, min(len(xs) - 1, round(q * (len(xs) - 1))))]


def summarize(done: list[dict]) -> dict:
    out = {}
    for name, cls in (("high", HIGH), ("low", LOW)):
        rows = [d for d in done if d["priority"] == cls]
        ttft = [d["ttft_s"] for d in rows]
        out[name] = {"requests": len(rows), "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
                     "preemptions_per_request": sum(d["preemptions"] for d in rows) / max(1, len(rows))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/priority")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--overload", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=96, help="KV blocks of 16 tokens (small: requests get preempted)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cap = capacity(args.blocks)
    rate = args.overload * cap
    print(f"capacity {cap:.2f} req/s; arrivals at {rate:.2f} req/s")
    runs = []
    with tqdm(total=2 * args.repeats, desc="runs") as bar:
        for rep in range(args.repeats):
            reqs = workload(args.requests, rep, rate)
            for policy in ("fcfs", "priority"):
                res = summarize(run(make_engine(policy, args.blocks), reqs))
                runs.append({"policy": policy, "repeat": rep, **res})
                bar.update()
    meta = {"device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "model": "SmolLM2-135M-Instruct (the default model), float32", "capacity_rps": cap, "rate_rps": rate,
            "overload": args.overload, "requests": args.requests, "kv_blocks": args.blocks,
            "workload": "prompts 32-96 tokens, 16-32 output tokens, greedy; 20% priority 0, 80% priority 1"}
    with open(os.path.join(args.out, "priority_cpu.json"), "w") as f:
        json.dump({**meta, "runs": runs}, f, indent=2)
    lines = [f"# Priority scheduling at {args.overload}x overload, {meta['device']}", "",
             f"{meta['model']}, one engine, {args.blocks} KV blocks; {meta['workload']}; {args.requests} Poisson "
             f"arrivals at {rate:.2f} req/s ({args.overload}x the {cap:.2f} req/s a closed batch is served at); "
             f"each repeat draws new arrivals and runs them under both policies.", "",
             "| policy | repeat | high: TTFT p50 s | high: TTFT p90 s | high: preemptions / req | low: TTFT p50 s | "
             "low: TTFT p90 s | low: preemptions / req |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        h, lo = r["high"], r["low"]
        lines.append(f"| {r['policy']} | {r['repeat']} | {h['ttft_p50_s']:.2f} | {h['ttft_p90_s']:.2f} | "
                     f"{h['preemptions_per_request']:.2f} | {lo['ttft_p50_s']:.2f} | {lo['ttft_p90_s']:.2f} | "
                     f"{lo['preemptions_per_request']:.2f} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "priority_cpu.md"), "w") as f:
        f.write(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.8))
        for i, (policy, cls) in enumerate((("fcfs", "high"), ("priority", "high"), ("fcfs", "low"),
                                           ("priority", "low"))):
            vals = [r[cls]["ttft_p90_s"] for r in runs if r["policy"] == policy]
            ax.bar(i, statistics.mean(vals), color="C0" if policy == "fcfs" else "C1")
            ax.plot([i] * len(vals), vals, "k.", ms=8)
        ax.set_xticks(range(4), ["high, fcfs", "high, priority", "low, fcfs", "low, priority"])
        ax.set(ylabel="TTFT p90 (s); dots: repeats", title=f"{args.overload}x overload, {meta['device']}")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "priority_cpu.png"), dpi=110)
    except ImportError:
        pass
    print(md)


if __name__ == "__main__":
    main()
