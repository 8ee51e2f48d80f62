"""The cluster-wide block registry: a named Ray actor.

It knows the workers (id, role, node, address, capacity, epoch, last heartbeat, the
stats they report) and which prefix-block hashes each one holds, kept current by
batched (stored, removed) events that ride on heartbeats. The router asks it for
the worker holding the longest cached prefix of a prompt, scored by tier: a block in a
worker's host tier (its KV offloaded to host memory, engine/offload.py) counts
HOST_HIT_WEIGHT of a GPU block: it saves the prefill but costs a PCIe load-back. Workers whose heartbeat
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
# a host-tier block's worth against a GPU block: Llama-3-8B on H100 prefills 16 tokens in
# ~0.5 ms (30K tok/s) and loads a 2 MiB block over PCIe 5 in ~0.1 ms: most of the saving stays
HOST_HIT_WEIGHT = 0.8


@ray.remote(num_cpus=0)
class BlockRegistry:
    def __init__(self, stale_s: float = 5.0):
        self.stale_s = stale_s
        self.workers: dict[str, dict] = {}
        self.blocks: dict[str, set[str]] = {}  # worker -> hashes it holds on its GPU
        self.holders: dict[str, set[str]] = {}  # hash -> workers (GPU)
        self.host_blocks: dict[str, set[str]] = {}  # worker -> hashes in its host tier

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
        host = self.host_blocks.setdefault(worker_id, set())
        for kind, h in events:
            if kind == "host_stored":
                host.add(h)
            elif kind == "host_removed":
                host.discard(h)
            elif kind == "stored":
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
        self.host_blocks.pop(worker_id, None)
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
        return [dict(w, num_cached_blocks=len(self.blocks.get(w["worker_id"], ())),
                     num_host_blocks=len(self.host_blocks.get(w["worker_id"], ()))) for w in self.workers.values()]

    def longest_prefix(self, hashes: list[str], role: str | None = None) -> tuple[str | None, int]:
        """The worker (of `role`) whose tiers hold the best-scored run of these chained hashes
        from the start (a GPU block 1, a host block HOST_HIT_WEIGHT), and that run's length
        in blocks; ties go to the smaller worker id."""
        self.purge_stale()
        best, best_score, depth = None, 0.0, 0
        for w in sorted(w for w, i in self.workers.items() if role is None or i.get("role") == role):
            gpu, host = self.blocks.get(w, set()), self.host_blocks.get(w, set())
            score, n = 0.0, 0
            for h in hashes:
                if h in gpu:
                    score += 1.0
                elif h in host:
                    score += HOST_HIT_WEIGHT
                else:
                    break
                n += 1
            if score > best_score:
                best, best_score, depth = w, score, n
        return best, depth

    def tiers_of(self, worker_id: str, hashes: list[str]) -> list[str]:
        """Where `worker_id` holds each hash: "gpu", "host" or "" (tests, `pdserve status`)."""
        gpu, host = self.blocks.get(worker_id, set()), self.host_blocks.get(worker_id, set())
        return ["gpu" if h in gpu else "host" if h in host else "" for h in hashes]

    def holders_of(self, block_hash: str) -> list[str]:
        return sorted(self.holders.get(block_hash, ()))
