"""The cluster-wide block registry: a named Ray actor.

It knows the workers (id, role, node, address, capacity, epoch, last heartbeat, the
stats they report) and which prefix-block hashes each one holds, kept current by
batched (stored, removed) events that ride on heartbeats. The router asks it for
the worker holding the longest cached prefix of a prompt. Workers whose heartbeat
is older than `stale_s` (or that re-register with a new epoch) are purged; a purged
worker that is still alive sees its next heartbeat refused (False) and registers
again with all its cached blocks.
Hashes travel as hex strings (sha256 chain, engine/hashing.py). In-flight handoffs are
not tracked here: each has its own deadline on both workers (transfer/pair.py), which
is what reaps a stuck one.
"""

from __future__ import annotations

import time

import ray

REGISTRY_NAME = "pdserve-registry"


@ray.remote(num_cpus=0)
class BlockRegistry:
    def __init__(self, stale_s: float = 5.0):
        self.stale_s = stale_s
        self.workers: dict[str, dict] = {}
        self.blocks: dict[str, set[str]] = {}  # worker -> hashes it holds
        self.holders: dict[str, set[str]] = {}  # hash -> workers

    # ---- membership ----------------------------------------------------------------------
    def register(self, worker_id: str, info: dict) -> None:
        old = self.workers.get(worker_id)
        if old is not None and old.get("epoch") != info.get("epoch"):
            self._forget_blocks(worker_id)
        self.workers[worker_id] = {**info, "worker_id": worker_id, "last_heartbeat": time.monotonic()}

    def unregister(self, worker_id: str) -> bool:
        self._forget_blocks(worker_id)
        return self.workers.pop(worker_id, None) is not None

    def heartbeat(self, worker_id: str, stats: dict, events: list[tuple[str, str]]) -> bool:
        """Returns False if the worker is unknown (purged): it should re-register."""
        w = self.workers.get(worker_id)
        if w is None:
            return False
        w["last_heartbeat"] = time.monotonic()
        w["stats"] = stats
        held = self.blocks.setdefault(worker_id, set())
        for kind, h in events:
            if kind == "stored":
                held.add(h)
                self.holders.setdefault(h, set()).add(worker_id)
            else:
                held.discard(h)
                s = self.holders.get(h)
                if s is not None:
                    s.discard(worker_id)
                    if not s:
                        del self.holders[h]
        return True

    def _forget_blocks(self, worker_id: str) -> None:
        for h in self.blocks.pop(worker_id, set()):
            s = self.holders.get(h)
            if s is not None:
                s.discard(worker_id)
                if not s:
                    del self.holders[h]

    def purge_stale(self) -> list[str]:
        now = time.monotonic()
        dead = [w for w, info in self.workers.items() if now - info["last_heartbeat"] > self.stale_s]
        for w in dead:
            self.unregister(w)
        return dead

    # ---- queries ----------------------------------------------------------------------------
    def list_workers(self) -> list[dict]:
        self.purge_stale()
        return [dict(w, num_cached_blocks=len(self.blocks.get(w["worker_id"], ()))) for w in self.workers.values()]

    def longest_prefix(self, hashes: list[str], role: str | None = None) -> tuple[str | None, int]:
        """The worker (of `role`) holding the longest run of these chained hashes from the start."""
        self.purge_stale()
        candidates = {w for w, i in self.workers.items() if role is None or i.get("role") == role}
        best, depth = None, 0
        for i, h in enumerate(hashes):
            candidates &= self.holders.get(h, set())
            if not candidates:
                break
            best, depth = min(candidates), i + 1
        return best, depth

    def holders_of(self, block_hash: str) -> list[str]:
        return sorted(self.holders.get(block_hash, ()))
