"""Prefix reuse on the whole Mooncake conversation trace through the engine's own cache
code (KVCacheManager, BlockPool, HostIndex), no model: how much of the input a GPU cache
serves, with the host tier off and on, a disk tier behind it (fed by HostIndex.on_evict,
read back through HostIndex.admit as the engine's disk tier does; its index an LRU of
hashes here), and peer fetch (a prefix that continues on another worker's GPU, host or disk
is fetched into this worker's host tier instead of recomputed), with tier-aware routing or
round-robin over the workers.

One "token" is one of the trace's 512-token hash blocks and the cache's block size is 1,
so a block is 512 tokens (the trace's own granularity). Requests run one at a time per
worker (each finishes before the next arrives: no concurrency, which flatters the GPU
cache). Capacities in tokens: the GPU's KV (Llama-3-8B bf16 on one H200: ~100 GB of KV
at 128 KiB per token ~ 760K tokens) and the host tier per worker.

    python bench/tier_sim.py --out bench/results/kv_capacity      # table last; md + json + png
    python bench/tier_sim.py --disk --out bench/results/kv_tiers  # + disk tier and peer fetch
"""

from __future__ import annotations

import argparse
import json
import os
from collections import OrderedDict

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


class DiskIndex:
    """A worker's disk tier as hashes, LRU within `blocks` (tiers/disk.DiskStore's order)."""

    def __init__(self, blocks: int):
        self.blocks, self.lru = blocks, OrderedDict()

    def add(self, h, _slot=None) -> None:
        self.lru[h] = None
        self.lru.move_to_end(h)
        if len(self.lru) > self.blocks:
            self.lru.popitem(last=False)

    def __contains__(self, h) -> bool:
        return h in self.lru


def has(kv: KVCacheManager, disk: DiskIndex | None, h) -> bool:
    return kv.pool.lookup(h) is not None or (kv.host is not None and h in kv.host) or (disk is not None and h in disk)


def bring_up(kvs: list[KVCacheManager], disks: list, w: int, req: Request, peer: bool) -> tuple[int, int, int]:
    """Before the lookup: the request's run past its GPU and host hits read from this worker's disk
    (into its host tier, as DiskTier does), then, with `peer`, the run past that fetched from the
    worker whose tiers continue it furthest. -> (its own host hits, blocks from disk, from a peer)."""
    kv = kvs[w]
    hashes = kv.block_hashes(req)[:req.num_tokens - 1]
    i = 0
    while i < len(hashes) and kv.pool.lookup(hashes[i]) is not None:
        i += 1
    gpu = i
    while i < len(hashes) and hashes[i] in kv.host:
        i += 1
    own, d = i - gpu, 0
    while disks[w] is not None and i < len(hashes) and hashes[i] in disks[w]:
        kv.host.admit(hashes[i])
        i, d = i + 1, d + 1
    p = 0
    if peer:
        best = i
        for o, other in enumerate(kvs):
            j = i
            while o != w and j < len(hashes) and has(other, disks[o], hashes[j]):
                j += 1
            best = max(best, j)
        for h in hashes[i:best]:
            kv.host.admit(h)
        p = best - i
    return own, d, p


def simulate(trace: list[list[int]], workers: int, gpu_tokens: int, host_tokens: int, routing: str,
             disk_tokens: int = 0, peer: bool = False) -> dict:
    kvs = [KVCacheManager(gpu_tokens // BLOCK, 1, True, host=HostIndex(host_tokens // BLOCK) if host_tokens else None)
           for _ in range(workers)]
    disks = [DiskIndex(disk_tokens // BLOCK) if disk_tokens else None for _ in range(workers)]
    for kv, disk in zip(kvs, disks):
        if disk is not None:
            kv.host.on_evict = disk.add
    disk_hits = peer_hits = 0
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
        own = d = p = 0
        if disks[w] is not None or peer:
            own, d, p = bring_up(kvs, disks, w, req, peer)
        before = kv.host_hit_tokens
        hits, n_hit = kv.get_computed_blocks(req)
        loaded = kv.host_hit_tokens - before  # in order: its own host run, the disk's, the peer's
        disk_hits += max(0, min(d, loaded - own))
        peer_hits += max(0, min(p, loaded - own - d))
        if kv.allocate_slots(req, req.num_tokens - n_hit, hits) is None:
            raise RuntimeError(f"request {i} ({len(ids)} blocks) does not fit {gpu_tokens} GPU tokens")
        kv.record_lookup(len(ids), n_hit)
        kv.cache_blocks(req, req.num_tokens)
        kv.free(req)
        if kv.host is not None:
            kv.host.take()  # no runner: the copies are only counted
    q, h = sum(kv.prefix_queries for kv in kvs), sum(kv.prefix_hits for kv in kvs)
    host = sum(kv.host_hit_tokens for kv in kvs)
    return {"workers": workers, "gpu_tokens": gpu_tokens, "host_tokens": host_tokens, "disk_tokens": disk_tokens,
            "peer": peer, "routing": routing, "hit_rate": h / q, "gpu_hit_rate": (h - host) / q,
            "host_hit_rate": (host - disk_hits - peer_hits) / q, "disk_hit_rate": disk_hits / q,
            "peer_hit_rate": peer_hits / q}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--gpu-tokens", type=int, default=760_000)
    ap.add_argument("--host-tokens", default="0,800000,3200000,1000000000",
                    help="per worker (3.2M ~ 400 GB for 8B bf16; 1e9: unbounded, the trace's ceiling)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="bench/results/kv_capacity")
    ap.add_argument("--disk", action="store_true", help="the disk tier and peer fetch (tier_sim_disk.*)")
    ap.add_argument("--disk-host-tokens", type=int, default=3_200_000, help="with --disk: the host tier per worker")
    ap.add_argument("--disk-tokens", type=int, default=32_000_000, help="per worker (32M ~ 4 TB for 8B bf16)")
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = [json.loads(line)["hash_ids"] for line in f]
    if args.disk:
        return disk_main(args, trace)
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


def disk_main(args, trace: list[list[int]]) -> None:
    host, disk = args.disk_host_tokens, args.disk_tokens
    configs = [(host, 0, False), (host, disk, False), (host, disk, True), (10**9, 0, False)]
    rows = [simulate(trace, args.workers, args.gpu_tokens, h, routing, d, p)
            for h, d, p in tqdm(configs, desc="tiers") for routing in ("tiers", "round_robin")]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tier_sim_disk.json"), "w") as f:
        json.dump({"trace": os.path.basename(args.trace), "requests": len(trace), "block_tokens": BLOCK,
                   "command": "python bench/tier_sim.py --disk --out " + args.out, "rows": rows}, f, indent=2)
    lines = [f"# Input tokens served from cache by tier, the whole trace ({len(trace)} requests), {args.workers} "
             f"workers, GPU cache {args.gpu_tokens:,} tokens each", "",
             "| host / disk per worker (tokens) | peer fetch | routing | from cache | GPU | host | disk | peer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tiers = "unbounded (the ceiling)" if r["host_tokens"] >= 10**9 else \
            f"{r['host_tokens']:,} / {r['disk_tokens']:,}"
        lines.append(f"| {tiers} | {'yes' if r['peer'] else 'no'} | {r['routing']} | {r['hit_rate']:.1%} | "
                     f"{r['gpu_hit_rate']:.1%} | {r['host_hit_rate']:.1%} | {r['disk_hit_rate']:.1%} | "
                     f"{r['peer_hit_rate']:.1%} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "tier_sim_disk.md"), "w") as f:
        f.write(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tiered = [r for r in rows if r["routing"] == "tiers"]
        names = ["host", "host + disk", "+ peer fetch", "unbounded"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        bottom = [0.0] * len(tiered)
        for key, label in (("gpu_hit_rate", "GPU"), ("host_hit_rate", "host"), ("disk_hit_rate", "disk"),
                           ("peer_hit_rate", "peer")):
            ys = [r[key] * 100 for r in tiered]
            ax.bar(names, ys, bottom=bottom, label=label)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.set(ylabel="% of input tokens from cache", title="Mooncake trace by tier (tier-aware routing)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "tier_sim_disk.png"), dpi=120)
    except ImportError:
        pass
    print(md)


if __name__ == "__main__":
    main()
