"""Placement, pure functions over worker snapshots (`Candidate`):

    pick_prefill   the prefill worker: cached prefix, then consistent hash, bounded load
    pick_decode    the decode worker: free KV capacity and load
    place_prompt   hybrid mode: prefill this prompt on the prefill pool or on a decode
                   worker, from predicted TTFTs (see its docstring)
    plan_fetch     the worker placed to prefill a prompt lacks a prefix a peer's GPU holds:
                   fetch it (transfer/fetch.py) when that is predicted faster than recomputing
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from dataclasses import dataclass

from ..api import NoWorker


@dataclass
class Candidate:
    worker_id: str
    load: int  # requests in flight, as the placing process counts them
    free_blocks: int = 0
    total_blocks: int = 1
    queued_tokens: int = 0  # prompt tokens placed here and not yet prefilled (the placer's count)
    prefill_tok_s: float | None = None  # the worker's prefill rate now (engine step model); None: unmeasured
    prefill_chunk: int = 0  # prefill tokens one of its steps may carry now (TPOT-bounded on decode workers)
    step_s: float = 0.0  # its mean step time
    cached_tokens: int = 0  # of the prompt being placed, tokens cached there
    seats: int = 1 << 30  # more requests its engine admits (max_num_seqs - running): 0 queues a prompt
    tpot_over: bool = False  # its requests' TPOT p90 is above its aim: it takes no prompt of the pool's


@dataclass
class PromptPlacement:
    """Where a prompt is prefilled, and why (counted by reason, kept in the timeline)."""

    local: bool  # True: on the decode worker `decode`; False: on the prefill pool, sent to `decode`
    reason: str
    decode: str
    ttft_pool_s: float | None = None  # predicted TTFT through the prefill pool (its chosen worker)
    ttft_local_s: float | None = None  # predicted TTFT prefilled on `decode`

    def explain(self) -> dict:
        r = {k: v for k, v in self.__dict__.items() if v is not None}
        for k in ("ttft_pool_s", "ttft_local_s"):
            if k in r:
                r[k] = round(r[k], 4)
        return r


def _point(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


@functools.lru_cache(maxsize=256)
def ring_of(worker_ids: tuple[str, ...]) -> HashRing:
    """The ring of these workers, built once per set of them: 64 sha256 points a worker, which,
    built for every placement, were the router's largest cost per request (and the capacity
    simulator's: 69 of 553 s planning 8 GPUs)."""
    return HashRing(list(worker_ids))


class HashRing:
    VNODES = 64

    def __init__(self, worker_ids: list[str]):
        self.points = sorted((_point(f"{w}#{i}"), w) for w in worker_ids for i in range(self.VNODES))
        self.keys = [p for p, _ in self.points]

    def walk(self, key: str):
        """Workers in ring order from `key`'s point, each once."""
        if not self.points:
            return
        start = bisect.bisect(self.keys, _point(key))
        seen = set()
        for i in range(len(self.points)):
            w = self.points[(start + i) % len(self.points)][1]
            if w not in seen:
                seen.add(w)
                yield w


def bounded(c: Candidate, cands: list[Candidate], eps: float) -> bool:
    """No worker above (1 + eps) x the mean load (counting the request being placed)."""
    total = sum(x.load for x in cands) + 1
    return c.load + 1 <= max(1.0, (1 + eps) * total / len(cands))


def pick_prefill(cands: list[Candidate], prefix_key: str, cached: tuple[str | None, int],
                 eps: float = 0.25, role: str = "prefill") -> tuple[str, str]:
    """(worker id, reason). `cached` is the registry's (holder, depth) for the prompt."""
    if not cands:
        raise NoWorker(role)
    by_id = {c.worker_id: c for c in cands}
    holder, depth = cached
    if holder in by_id and depth > 0 and bounded(by_id[holder], cands, eps):
        return holder, "prefix_hit"
    first = None
    for w in ring_of(tuple(sorted(by_id))).walk(prefix_key):
        first = first or w
        if bounded(by_id[w], cands, eps):
            return w, "hash" if w == first else "hash_overflow"
    return min(cands, key=lambda c: c.load).worker_id, "least_loaded"


def pick_decode(cands: list[Candidate]) -> str:
    if not cands:
        raise NoWorker("decode")
    return max(cands, key=lambda c: (c.free_blocks / max(c.total_blocks, 1) - 0.02 * c.load, -c.load)).worker_id


def predicted_ttft(c: Candidate, prompt_tokens: int, rate: float | None, extra_s: float = 0.0) -> float | None:
    """Seconds until this worker has prefilled the prompt: its queue plus the prompt's
    uncached tokens, at `rate` tokens/s."""
    if not rate or rate <= 0:
        return None
    return (c.queued_tokens + max(0, prompt_tokens - c.cached_tokens)) / rate + extra_s


def local_rate(c: Candidate, pool_rate: float | None) -> float | None:
    """A decode worker's prefill rate: its own measure; before it has one, the prefill
    pool's (the same engine and model)."""
    return c.prefill_tok_s or pool_rate


def place_prompt(prompt_tokens: int, p: Candidate, decodes: list[Candidate], slo_ttft_s: float,
                 spill_at: float, handoff_s: float) -> PromptPlacement:
    """Hybrid placement of one prompt. The prefill pool's worker `p` predicts
    TTFT = (its queued tokens + the uncached prompt) / its prefill rate + the handoff; each
    decode worker predicts the same at the rate its TPOT-bounded chunks allow (its step
    model's, engine/core/step_model.py), with no handoff; decode workers whose engine admits no
    more requests (max_num_seqs), or whose requests' TPOT p90 is over its aim (`tpot_over`: a
    prompt there would break it further), are skipped. The prompt is prefilled on the best decode worker when

      fits_decode_step  its uncached tokens fit one TPOT-bounded step there and that is no
                        slower than the pool (short prompts, mostly cached prompts: the old
                        length and cached-fraction rules, measured in live tokens), or
      decode_spare      the pool's prediction passes spill_at x the TTFT SLO (its queue is
                        deep) and the decode worker's is lower;

    else on the prefill pool (`prefill_pool`), its KV sent to the decode worker with the
    most free blocks. An unmeasured prefill pool keeps the prompt (`prefill_pool`)."""
    recv = pick_decode(decodes)
    ttft_pool = predicted_ttft(p, prompt_tokens, p.prefill_tok_s, handoff_s)
    best, best_t = None, None
    for d in decodes:
        if d.seats <= 0 or d.tpot_over:  # no new prompt until a request ends / its TPOT is back in target
            continue
        t = predicted_ttft(d, prompt_tokens, local_rate(d, p.prefill_tok_s))
        if t is not None and (best_t is None or t < best_t):
            best, best_t = d, t
    if best is None or ttft_pool is None:
        return PromptPlacement(False, "prefill_pool", recv, ttft_pool, best_t)
    uncached = prompt_tokens - best.cached_tokens
    if best_t <= ttft_pool and best.queued_tokens + uncached <= best.prefill_chunk:
        return PromptPlacement(True, "fits_decode_step", best.worker_id, ttft_pool, best_t)
    if ttft_pool > spill_at * slo_ttft_s and best_t < ttft_pool:
        return PromptPlacement(True, "decode_spare", best.worker_id, ttft_pool, best_t)
    return PromptPlacement(False, "prefill_pool", recv, ttft_pool, best_t)


FETCH_FIXED_S = 0.005  # a fetch's cost beside its bytes: the ask, actor to actor, and the pair's order


@dataclass
class Holder:
    """A worker a prefix could be fetched from, as placement predicts it."""
    gbps: float  # the fetch's bandwidth into the placed worker
    wait_s: float = 0.0  # until its engine thread takes the ask up (between its steps)


@dataclass
class FetchDecision:
    holder: str
    blocks: int  # the prompt's leading blocks the holder's GPU has (the placed worker fetches those it lacks)
    fetch_s: float  # predicted: FETCH_FIXED_S + the holder's wait + the missing blocks' bytes over the link
    recompute_s: float  # predicted: their tokens at the placed worker's prefill rate

    @property
    def faster(self) -> bool:
        """Fetching is predicted to land sooner than recomputing: the fetch is planned."""
        return self.fetch_s < self.recompute_s

    def explain(self) -> dict:
        """The timeline's `placement` entry for this decision (`fetch` when planned, else `recompute`)."""
        return {"fetch" if self.faster else "recompute": {
            "holder": self.holder, "blocks": self.blocks, "fetch_s": round(self.fetch_s, 4),
            "recompute_s": round(self.recompute_s, 4)}}


def plan_fetch(placed: str, runs: dict[str, tuple[int, int]], holders: dict[str, Holder], block_size: int,
               block_bytes: int, rate: float | None) -> FetchDecision | None:
    """`runs`: per worker, (leading blocks of the prompt on its GPU, in any of its tiers) (the
    registry's). `holders`: the workers whose KV layout matches the placed worker's. The holder with
    the longest GPU run, if it passes the placed worker's own run in any tier and its wait plus the
    missing blocks' bytes over its link come sooner than their tokens at the placed worker's prefill
    `rate`; an unmeasured rate is no fetch (nothing to weigh it against)."""
    own = runs.get(placed, (0, 0))[1]
    best = max(((runs[w][0], w) for w in sorted(runs) if w in holders and w != placed and runs[w][0] > own),
               key=lambda x: x[0], default=None)  # ties: the smaller worker id
    if best is None or not rate or rate <= 0:
        return None
    n = best[0] - own
    h = holders[best[1]]
    d = FetchDecision(best[1], best[0], FETCH_FIXED_S + h.wait_s + n * block_bytes / (h.gbps * 1e9),
                      n * block_size / rate)
    return d
