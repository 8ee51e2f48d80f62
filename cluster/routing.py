"""Placement: prefill by cached prefix, then consistent hash with bounded load;
decode by free KV capacity and load. Pure functions over worker snapshots, shared
by the Cluster API and the HTTP router."""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass


@dataclass
class Candidate:
    worker_id: str
    load: int  # requests in flight, as the placing process counts them
    free_blocks: int = 0
    total_blocks: int = 1


def _point(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


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
                 eps: float = 0.25) -> tuple[str, str]:
    """(worker id, reason). `cached` is the registry's (holder, depth) for the prompt."""
    if not cands:
        raise RuntimeError("no healthy prefill worker")
    by_id = {c.worker_id: c for c in cands}
    holder, depth = cached
    if holder in by_id and depth > 0 and bounded(by_id[holder], cands, eps):
        return holder, "prefix_hit"
    for w in HashRing(sorted(by_id)).walk(prefix_key):
        if bounded(by_id[w], cands, eps):
            return w, "hash" if w == next(HashRing(sorted(by_id)).walk(prefix_key)) else "hash_overflow"
    return min(cands, key=lambda c: c.load).worker_id, "least_loaded"


def pick_decode(cands: list[Candidate]) -> str:
    if not cands:
        raise RuntimeError("no healthy decode worker")
    return max(cands, key=lambda c: (c.free_blocks / max(c.total_blocks, 1) - 0.02 * c.load, -c.load)).worker_id
