"""The KV tiers below the GPU's block pool, behind one protocol, and the engine's list of them.

Every tier keeps KV blocks by chained block hash (engine/base/hashing.py), whatever its medium:

    tier    its blocks                  load: up a level                     store: a copy kept of
    host    pinned host slots           queued copies into fresh GPU blocks, a cached GPU block the
            (offload.HostIndex)         made when the request's GPU lookup   pool frees
                                        runs (nothing waits)
    disk    block files                 reader threads into host slots; the  a block the host tier
            (disk_tier.DiskTier)        request waits outside the scheduler  drops

    peer    another worker's GPU        a fetch over the pair's link into    (nothing: the holder
            (transfer/fetch.PeerFetches) reserved GPU blocks; the request      serves its own GPU
                                        waits outside the scheduler          blocks, never stores)

The engine composes the tiers it runs (host, then disk) in one `Tiers` list; a worker of the
cluster adds its peer tier after the host (`Tiers.add`: a fetch is faster than a disk read). A new
request's prompt is looked up in each after the GPU's hits, and the first tier whose run must be
waited for holds the request until ready() hands it to the scheduler. The peer tier holds a run only
for a request that placement planned a fetch for (its holder and link are the cluster's to know:
`PeerFetches.expect`), which is why `lookup` is given the request; the other tiers answer by hashes
alone.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..base.hashing import BlockHash
from ..core.request import Request
from ..stats import Tier


@runtime_checkable
class KVTier(Protocol):
    name: str
    waits: bool  # whether load() can make a request wait (the disk's reads), or never (the host's copies)

    def lookup(self, hashes: list[BlockHash], request: Request | None = None) -> int:
        """How many of `hashes`, from the first, this tier holds now for `request` (nothing moves)."""

    def load(self, request: Request, hashes: list[BlockHash]) -> bool:
        """Starts bringing the blocks of `hashes` (a run lookup() found) up a level for `request`:
        True when the request must wait for them (ready() returns it once they landed), False when
        there is nothing to wait for (they come up with the request's GPU lookup, or reading
        them was predicted slower than recomputing)."""

    def ready(self) -> list[Request]:
        """The requests whose loads landed, in the order they did."""

    def store(self, block_hash: BlockHash, source: int) -> None:
        """Keeps a copy of the block the tier above lets go (`source`: where its bytes are now,
        the GPU block or the host slot)."""

    def evict(self, block_hash: BlockHash) -> bool:
        """Drops this tier's copy of a block; False if it had none."""

    def wait(self, timeout: float = 0.05) -> None:
        """Blocks until one of its loads may have landed, at most `timeout` (an engine with nothing
        else to run waits here rather than spinning)."""

    def forget(self, request_id: str) -> None:
        """An aborted request: what it still loads for it lands unclaimed."""

    def close(self) -> None:
        """Keeps what it holds for a restart where it can (the disk tier writes the host tier's blocks)."""

    def stats(self) -> Tier:
        """Its counters (engine/stats.py; the engine's stats carry them)."""


class Tiers:
    """The engine's tiers below its GPU pool, in lookup order, and the requests waiting on one."""

    def __init__(self, kv, tiers: list[KVTier]):
        self.kv, self.tiers = kv, tiers
        self.waiting: dict[str, KVTier] = {}  # request id -> the tier it waits on

    def get(self, name: str) -> KVTier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def add(self, tier: KVTier, after: str | None = None) -> None:
        """Adds a tier to the lookup order: right after the tier named `after` (where the engine
        runs one), else first."""
        if self.get(tier.name) is not None:
            raise ValueError(f"a {tier.name} tier is already in the list")
        names = [t.name for t in self.tiers]
        self.tiers.insert(names.index(after) + 1 if after in names else 0, tier)

    def hold(self, request: Request) -> bool:
        """Looks a new request's prompt up past the GPU's hits, tier by tier; True if a tier now
        loads a run of it and the request waits (ready() hands it to the scheduler)."""
        kv = self.kv
        if not any(t.waits for t in self.tiers) or not kv.enable_caching or request.scoring_prompt:
            return False  # nothing could make it wait: its lookup happens once, when it is scheduled
        hashes = kv.block_hashes(request)[:(request.num_tokens - 1) // kv.block_size]
        i = kv.gpu_run(hashes)
        for tier in self.tiers:
            n = tier.lookup(hashes[i:], request)
            if n and tier.load(request, hashes[i:i + n]):
                self.waiting[request.request_id] = tier
                return True
            i += n
        return False

    def ready(self) -> list[Request]:
        """The held requests whose runs landed (their blocks now in a tier the GPU lookup reads)."""
        out = []
        for tier in self.tiers:
            for req in tier.ready():
                if self.waiting.pop(req.request_id, None) is not None:
                    out.append(req)
        return out

    def forget(self, request_id: str) -> None:
        """An aborted request: whatever its tier still reads for it lands unclaimed."""
        tier = self.waiting.pop(request_id, None)
        if tier is not None:
            tier.forget(request_id)

    def wait(self) -> None:
        """Waits on the tiers some request waits on (the engine has nothing else to run)."""
        for tier in {id(t): t for t in self.waiting.values()}.values():
            tier.wait()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def stats(self) -> list[Tier]:
        return [tier.stats() for tier in self.tiers]
