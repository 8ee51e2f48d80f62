"""The pool of KV blocks: integer ids, reference counts, an LRU free queue, and the
prefix-cache map from chained block hash to block.

Blocks are made on first use: ids `[made, num_blocks)` are fresh (never allocated, no hash, no
contents) and are handed out first, in id order, before the free queue; a large CPU pool (the
default 1 GiB of a tiny model: 131,072 blocks) costs nothing until it fills.

Invariants (checked by `check_invariants`, which tests call):
  - a made block is in the free queue  <=>  its ref_cnt == 0;
  - a block with a hash is in the cache map under that hash, and the map holds
    nothing else;
  - fresh + free + referenced == num_blocks.
A freed block keeps its hash and contents: it stays a prefix-cache hit until it
reaches the front of the free queue and is reused (then its hash is dropped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from ..base.hashing import BlockHash


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[Block] = []  # the made ones: blocks[i].block_id == i
        # LRU order of the made free blocks: the front is evicted first (after the fresh ones).
        # OrderedDict gives O(1) removal from the middle when a cached free block is hit again.
        self.free_queue: OrderedDict[int, Block] = OrderedDict()
        self.cached: dict[BlockHash, Block] = {}
        # optional observer of cache membership, (stored, removed) hashes; the
        # registry of the cluster subscribes through it
        self.events: list[tuple[str, BlockHash]] = []
        self.record_events = False
        # the host tier (tiers/offload.py) watches cached blocks being freed and blocks reallocated
        self.on_free = None  # (block) -> None: a cached block's last reference went
        self.on_realloc = None  # (block) -> None: a free block is about to be overwritten
        self.num_evicted = 0  # cached blocks reused for other tokens (their prefix is gone from this tier)

    # ---- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.blocks) + len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def eviction_order(self) -> list[int]:
        """The free blocks' ids in the order allocate() takes them: the fresh ones, then the
        free queue from its front."""
        return [*range(len(self.blocks), self.num_blocks), *self.free_queue]

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    # ---- allocation ----------------------------------------------------------------
    def allocate(self, n: int) -> list[Block]:
        """Takes n blocks: fresh ones first, then from the front of the free queue (evicting
        their hashes)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: asked for {n}, {self.num_free_blocks} free")
        made = len(self.blocks)
        fresh = min(n, self.num_blocks - made)
        out = [Block(i, 1) for i in range(made, made + fresh)]
        self.blocks += out
        # the rest from the free queue's front, each block's hash evicted (_evict, inlined: a
        # 4K-token prompt takes 256 blocks, and this loop was the capacity simulator's top cost)
        pop, cached, realloc = self.free_queue.popitem, self.cached, self.on_realloc
        events = self.events if self.record_events else None
        for _ in range(n - fresh):
            _, block = pop(last=False)
            if realloc is not None:
                realloc(block)
            h = block.block_hash
            if h is not None:
                self.num_evicted += 1
                if cached.get(h) is block:
                    del cached[h]
                    if events is not None:
                        events.append(("removed", h))
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Adds a reference to each block (a prefix-cache hit or a shared block)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drops a reference from each block; blocks reaching 0 join the free queue's
        tail in the given order (callers pass a request's blocks tail first, so a
        prefix's last blocks are evicted before its first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if self.on_free is not None and block.block_hash is not None:
                    self.on_free(block)

    def cache_block(self, block: Block, block_hash: BlockHash) -> None:
        """Publishes a full block under its hash. If another block already holds that
        hash (two requests computed the same prefix at once) the first one stays."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.record_events:
            self.events.append(("stored", block_hash))

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.record_events:
                    self.events.append(("removed", block.block_hash))
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; only allowed when no block is referenced."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def drain_events(self) -> list[tuple[str, BlockHash]]:
        events, self.events = self.events, []
        return events

    def check_invariants(self) -> None:
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            assert in_free == (block.ref_cnt == 0), block
            assert block.ref_cnt >= 0, block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
