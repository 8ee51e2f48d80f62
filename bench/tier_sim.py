"""Prefix reuse on the whole Mooncake conversation trace through the engine's own cache
code (KVCacheManager, BlockPool, HostIndex), no model: how much of the input a GPU cache
serves, with the host tier off and on, with tier-aware routing or round-robin over the
workers.

One "token" is one of the trace's 512-token hash blocks and the cache's block size is 1,
so a block is 512 tokens (the trace's own granularity). Requests run one at a time per
worker (each finishes before the next arrives: no concurrency, which flatters the GPU
cache). Capacities in tokens: the GPU's KV (Llama-3-8B bf16 on one H200: ~100 GB of KV
at 128 KiB per token ~ 760K tokens) and the host tier per worker.

    python bench/tier_sim.py --out bench/results/kv_capacity      # table last; md + json + png
"""

from __future__ import annotations

import argparse
import json
import os

from tqdm import tqdm

from pdserve.bench.workloads import DEFAULT_TRACE
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiers.offload import HostIndex

BLOCK = 512
PARAMS = SamplingParams(max_tokens=1)


def score(kv: KVCacheManager, req: Request) -> float:
    s = 0.0
    for h in kv.block_hashes(req):
        if kv.pool.lookup(h) is not None:
            s += 1.0
        elif kv.host is not None and h in kv.host:
            s += 0.8
        else:
            break
    return s


def simulate(trace: list[list[int]], workers: int, gpu_tokens: int, host_tokens: int, routing: str) -> dict:
    kvs = [KVCacheManager(gpu_tokens // BLOCK, 1, True, host=HostIndex(host_tokens // BLOCK) if host_tokens else None)
           for _ in range(workers)]
    for i, ids in enumerate(trace):
        req = Request(str(i), ids + [0], PARAMS)  # one more token: every hash block can hit
        if routing == "tiers":  # the registry's score; ties (e.g. only the shared system prompt
            # cached everywhere) by the first block past the common prefix, as a consistent hash
            scores = [score(kv, req) for kv in kvs]
            best = max(scores)
            tied = [k for k in range(workers) if scores[k] == best]
            w = tied[ids[min(len(ids) - 1, int(best))] % len(tied)]
        else:
            w = i % workers
        kv = kvs[w]
        hits, n_hit = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - n_hit, hits) is None:
            raise RuntimeError(f"request {i} ({len(ids)} blocks) does not fit {gpu_tokens} GPU tokens")
        kv.record_lookup(len(ids), n_hit)
        kv.cache_blocks(req, req.num_tokens)
        kv.free(req)
        if kv.host is not None:
            kv.host.take()  # no runner: the copies are only counted
    q, h = sum(kv.prefix_queries for kv in kvs), sum(kv.prefix_hits for kv in kvs)
    return {"workers": workers, "gpu_tokens": gpu_tokens, "host_tokens": host_tokens, "routing": routing,
            "hit_rate": h / q, "host_hit_rate": sum(kv.host_hit_tokens for kv in kvs) / q}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--gpu-tokens", type=int, default=760_000)
    ap.add_argument("--host-tokens", default="0,800000,3200000,1000000000",
                    help="per worker (3.2M ~ 400 GB for 8B bf16; 1e9: unbounded, the trace's ceiling)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="bench/results/kv_capacity")
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = [json.loads(line)["hash_ids"] for line in f]
    rows = []
    for host in tqdm([int(x) for x in args.host_tokens.split(",")], desc="host tier sizes"):
        for routing in ("tiers", "round_robin"):
            rows.append(simulate(trace, args.workers, args.gpu_tokens, host, routing))
    os.makedirs(args.out, exist_ok=True)
    res = {"trace": os.path.basename(args.trace), "requests": len(trace), "block_tokens": BLOCK, "rows": rows}
    with open(os.path.join(args.out, "tier_sim.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = [f"# Prefix reuse on the whole trace ({len(trace)} requests), {args.workers} workers, "
             f"GPU cache {args.gpu_tokens:,} tokens each", "",
             "| host tier per worker (tokens) | routing | input tokens from cache | of which from the host tier |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['host_tokens']:,} | {r['routing']} | {r['hit_rate']:.1%} | {r['host_hit_rate']:.1%} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "tier_sim.md"), "w") as f:
        f.write(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        hosts = sorted({r["host_tokens"] for r in rows})
        for k, routing in enumerate(("tiers", "round_robin")):
            ys = [next(r["hit_rate"] for r in rows if r["host_tokens"] == h and r["routing"] == routing) for h in hosts]
            ax.bar([i + 0.4 * k - 0.2 for i in range(len(hosts))], [y * 100 for y in ys], 0.4, label=routing)
        ax.set_xticks(range(len(hosts)), [f"{h / 1e6:.1f}M" for h in hosts])
        ax.set(xlabel="host tier per worker (tokens)", ylabel="% of input tokens from cache",
               title="Mooncake trace, real cache code")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "tier_sim.png"), dpi=120)
    except ImportError:
        pass
    print(md)


if __name__ == "__main__":
    main()
