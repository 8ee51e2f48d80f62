"""The cluster-wide block registry: a named Ray actor.

It knows the workers (id, role, node, address, capacity, epoch, last heartbeat, the
stats they report) and which prefix-block hashes each one holds, kept current by
batched (stored, removed) events that ride on heartbeats. Placement asks it once per prompt
for every worker's run of the prompt's hashes (`runs`: on its GPU, in any tier, and the run's
score): `best_holder` picks the worker to prefill on by score, a block in a worker's host tier
(its KV offloaded to host memory, engine/tiers/offload.py) counting HOST_HIT_WEIGHT of a GPU
block (it saves the prefill but costs a PCIe load-back); the GPU runs are what a peer fetch can
send (transfer/fetch.py). Disk-tier blocks are not announced: a 4 TB tier is about 2M blocks a
worker, and a node's workers share its directory anyway. Workers whose heartbeat
is older than `stale_s` (or that re-register with a new epoch) are purged; a purged
worker that is still alive sees its next heartbeat refused (False) and registers
again with all its cached blocks.
Hashes travel as hex strings (sha256 chain, engine/base/hashing.py). In-flight handoffs are
not tracked here: each has its own deadline on both workers (transfer/pair.py), which
is what reaps a stuck one.

The registry holds only what the workers can tell it again, so it is restartable: Ray
restarts it when its process dies, a restarted (empty) registry refuses the workers'
heartbeats and they register again with every block they cache. `RegistryLink`
(registry_link.py) is the cluster's side of it: placement asks through it and gets "no hint" instead of an error
while the registry is away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import ray
from ray.exceptions import GetTimeoutError, RayError

from ..aio import within
from ..records import BlockChange, BlockEvent, RegisteredWorker, WorkerInfo, WorkerStats

log = logging.getLogger(__name__)

REGISTRY_NAME = "pdserve-registry"


def named_actor(name: str, namespace: str):
    """`ray.get_actor(name, namespace)`: the handle, or ValueError where no live actor holds the name.
    A lookup that Ray gave up on (GetTimeoutError after its 60 s: seen once on a 2-core host, the GCS
    answering every other call at once and never receiving that one) is asked once more; a second
    one raises."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except GetTimeoutError as e:
        log.warning("looking up actor %r timed out (%s): asking once more", name, " ".join(str(e).split()))
        return ray.get_actor(name, namespace=namespace)


# a host-tier block's worth against a GPU block: Llama-3-8B on H100 prefills 16 tokens in
# ~0.5 ms (30K tok/s) and loads a 2 MiB block over PCIe 5 in ~0.1 ms: most of the saving stays
HOST_HIT_WEIGHT = 0.8


class PrefixRun(NamedTuple):
    """One worker's hold on a prompt's chained hashes, from the first."""

    role: str | None
    gpu: int  # leading blocks on its GPU (what a peer fetch can send)
    tier: int  # leading blocks in any of its tiers (GPU or host)
    score: float  # the tier run scored: 1 per GPU block, HOST_HIT_WEIGHT per host block


def best_holder(runs: dict[str, PrefixRun], role: str | None = None) -> tuple[str | None, int]:
    """The worker (of `role`) with the best-scored run, and that run's length in blocks; ties go to
    the smaller worker id; (None, 0) when none holds the first block."""
    best, best_score, depth = None, 0.0, 0
    for w in sorted(runs):
        r = runs[w]
        if (role is None or r.role == role) and r.score > best_score:
            best, best_score, depth = w, r.score, r.tier
    return best, depth


@dataclass
class Member:
    """A registered worker: its registration, when it last beat and the stats of that beat."""
    info: WorkerInfo
    last_heartbeat: float
    stats: WorkerStats = field(default_factory=WorkerStats)


# The liveness probe's own thread: `ping` never queues behind the registry's other calls, so a
# registry busy with a backlog (a restart on a loaded host: every worker re-announcing its blocks
# while the router asks for runs) answers it at once, and only a process that runs nothing (frozen)
# goes silent. The registry's state is touched by the default group alone (one thread).
CONCURRENCY_GROUPS = {"probe": 1}


@ray.remote(num_cpus=0, concurrency_groups=CONCURRENCY_GROUPS)
class BlockRegistry:
    """`cluster_id`: the cluster it serves; a worker of another cluster (an actor that outlived
    its own cluster, finding this registry by its name) is refused membership."""

    def __init__(self, stale_s: float = 5.0, cluster_id: str = ""):
        self.stale_s, self.cluster_id = stale_s, cluster_id
        self.workers: dict[str, Member] = {}
        self.blocks: dict[str, set[str]] = {}  # worker -> hashes it holds on its GPU
        self.holders: dict[str, set[str]] = {}  # hash -> workers (GPU)
        self.host_blocks: dict[str, set[str]] = {}  # worker -> hashes in its host tier

    @ray.method(concurrency_group="probe")
    def ping(self) -> int:
        """The registry's process id (the cluster's liveness probe, answered on its own thread:
        CONCURRENCY_GROUPS; tests kill it by pid)."""
        return os.getpid()

    # ---- membership ----------------------------------------------------------------------
    def register(self, worker_id: str, info: WorkerInfo, cluster_id: str = "") -> bool:
        """False (and nothing recorded) for a worker of another cluster."""
        if cluster_id != self.cluster_id:
            return False
        old = self.workers.get(worker_id)
        if old is not None and old.info.epoch != info.epoch:  # a restarted worker: its blocks are gone
            self._forget_blocks(worker_id)
        self.workers[worker_id] = Member(info, time.monotonic())
        return True

    def unregister(self, worker_id: str) -> bool:
        self._forget_blocks(worker_id)
        return self.workers.pop(worker_id, None) is not None

    def heartbeat(self, worker_id: str, stats: WorkerStats, events: list[BlockEvent]) -> bool:
        """Returns False if the worker is unknown (purged): it should re-register."""
        w = self.workers.get(worker_id)
        if w is None:
            return False
        w.last_heartbeat, w.stats = time.monotonic(), stats
        held = self.blocks.setdefault(worker_id, set())
        host = self.host_blocks.setdefault(worker_id, set())
        for change, h in events:
            if change is BlockChange.HOST_STORED:
                host.add(h)
            elif change is BlockChange.HOST_REMOVED:
                host.discard(h)
            elif change is BlockChange.STORED:
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
        dead = [w for w, m in self.workers.items() if now - m.last_heartbeat > self.stale_s]
        for w in dead:
            self.unregister(w)
        return dead

    # ---- queries ----------------------------------------------------------------------------
    def list_workers(self) -> list[RegisteredWorker]:
        """The members: registration, last beat's stats, blocks held."""
        self.purge_stale()
        return [RegisteredWorker(w, m.info, m.stats, m.last_heartbeat, len(self.blocks.get(w, ())),
                                 len(self.host_blocks.get(w, ()))) for w, m in self.workers.items()]

    def runs(self, hashes: list[str]) -> dict[str, PrefixRun]:
        """Each worker holding the first of these chained hashes, with its run of them: placement's
        one question per prompt (the holder to prefill on, and a peer to fetch from)."""
        self.purge_stale()
        out = {}
        for w, m in self.workers.items():
            gpu, host = self.blocks.get(w, set()), self.host_blocks.get(w, set())
            g, score, n = len(hashes), 0.0, 0
            for i, h in enumerate(hashes):
                if h in gpu:
                    score += 1.0
                elif h in host:
                    score += HOST_HIT_WEIGHT
                    g = min(g, i)
                else:
                    g = min(g, i)
                    break
                n += 1
            if n:
                out[w] = PrefixRun(m.info.role, g, n, score)
        return out

    def longest_prefix(self, hashes: list[str], role: str | None = None) -> tuple[str | None, int]:
        """The worker (of `role`) whose tiers hold the best-scored run of these hashes (best_holder)."""
        return best_holder(self.runs(hashes), role)

    def tiers_of(self, worker_id: str, hashes: list[str]) -> list[str]:
        """Where `worker_id` holds each hash: "gpu", "host" or "" (tests, `pdserve status`)."""
        gpu, host = self.blocks.get(worker_id, set()), self.host_blocks.get(worker_id, set())
        return ["gpu" if h in gpu else "host" if h in host else "" for h in hashes]

    def holders_of(self, block_hash: str) -> list[str]:
        return sorted(self.holders.get(block_hash, ()))


class Membership:
    """A worker's side of the registry, driven by its engine thread (`beat`, every second) and
    its actor (`join`, at start and after a role switch).

    A beat sends the worker's stats and the prefix caches' news. A registry that refused the
    last beat (it purged us, or came back empty after a restart) or died under it gets a full
    registration with every cached block instead; one that died for good is looked up again
    by name (the cluster creates a new one). A registry that refuses us serves another cluster
    (ours is gone, and a new one took its namespace): the worker is an orphan and stops announcing
    itself (`orphaned`), so that the new cluster never places on it. Nothing here raises into the
    engine thread."""

    def __init__(self, worker_id: str, namespace: str, cluster_id: str = ""):
        self.worker_id, self.namespace, self.cluster_id = worker_id, namespace, cluster_id
        self.actor = named_actor(REGISTRY_NAME, namespace)
        self._beat = None  # the last beat's reply: False means the registry does not know us
        self._joined = None  # the last re-registration's reply: False means another cluster's registry
        self._rejoin = False  # the next beat registers again, with every cached block
        self._lost = False  # the actor died under a call: the next beat looks the name up again
        self.orphaned = False

    async def join(self, info: WorkerInfo) -> None:
        """Registers now, or (the registry is away) at a beat once it is back."""
        try:
            self._orphan_if(await within(self.actor.register.remote(self.worker_id, info, self.cluster_id), 5))
        except (RayError, asyncio.TimeoutError) as e:
            log.warning("%s: the registry is away (%s): joining at a later heartbeat", self.worker_id,
                        type(e).__name__)
            self._rejoin = True

    def beat(self, info, stats: WorkerStats, news: list[BlockEvent], everything) -> None:
        """`info()`: the registration; `everything()`: events announcing every cached block."""
        if self.orphaned:
            return
        try:
            if self._lost:  # it died under a call: the name may hold a new actor by now (ValueError: not yet)
                self.actor = named_actor(REGISTRY_NAME, self.namespace)
                self._lost, self._rejoin = False, True
            rejoin = self._rejoin
            if self._joined is not None and ray.wait([self._joined], timeout=0)[0]:
                joined, self._joined = self._joined, None
                if self._orphan_if(self._reply(joined)):
                    return
            if self._beat is not None and ray.wait([self._beat], timeout=0)[0]:
                done, self._beat = self._beat, None
                rejoin = self._reply(done) is False or rejoin
            if self._lost:
                self._rejoin = True
                return
            if rejoin:
                self._joined = self.actor.register.remote(self.worker_id, info(), self.cluster_id)
                news = everything()
            self._beat = self.actor.heartbeat.remote(self.worker_id, stats, news)
            self._rejoin = False
        except Exception:  # noqa: BLE001 - the registry restarting must not stop the engine
            self._beat, self._rejoin = None, True

    def _reply(self, ref):
        """A settled call's answer; None, and the actor marked lost, if it died under the call."""
        try:
            return ray.get(ref)
        except RayError:
            self._lost = True
            return None

    def _orphan_if(self, refused_or_joined: bool) -> bool:
        if refused_or_joined is False:
            self.orphaned = True
            log.error("%s: the registry in namespace %r serves another cluster (this worker's cluster is gone): "
                      "it stops announcing itself", self.worker_id, self.namespace)
        return self.orphaned
