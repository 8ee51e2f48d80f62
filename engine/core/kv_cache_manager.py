"""Per-request KV block bookkeeping on top of the block pool.

Lifecycle of a request's blocks:
  get_computed_blocks()  longest run of full prompt blocks already cached (prefix hit)
  allocate_slots()       pins the hits and adds fresh blocks so that the tokens about
                         to be computed have slots; fails (None) if the pool is short
  cache_blocks()         after the forward pass wrote them, publishes newly full blocks
                         under their chained hash
  free()                 releases every block of the request (tail first)
A KV handoff: the receiver reserve_prompt()s (its own hits pinned, fresh blocks for
the rest, the number of hits tells the sender what to skip); the sender sends
prompt_blocks_after(skip); both free() when the handoff is over.
With a host tier (tiers/offload.py): freed cached blocks are offloaded, and a lookup goes on
past the GPU hits into the host tier, loading those blocks back into fresh GPU blocks.
Counters for metrics: prefix-cache queries/hits in tokens (host hits included), host hits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..base.hashing import ROOT_HASH, BlockHash, hash_block_tokens, held_run
from .block_pool import Block, BlockPool
from .request import Request

if TYPE_CHECKING:
    from ..tiers.offload import HostIndex


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 extra_keys: tuple = (), host: HostIndex | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_keys = extra_keys
        self.pool = BlockPool(num_blocks, enable_caching)
        # each request's blocks; a list is never changed in place (a change stores a new one), so
        # `block_ids` can hand out one id list for as long as its blocks stay the same
        self.req_blocks: dict[str, list[Block]] = {}
        self._req_ids: dict[str, tuple[list[Block], list[int]]] = {}
        # chained hashes of each request's full blocks, extended as it grows
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_published: dict[str, int] = {}  # per request, its leading blocks cache_blocks has published
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.host = host if enable_caching else None
        self.host_hit_tokens = 0  # of prefix_hits, tokens loaded back from the host tier
        if self.host is not None:
            self.pool.on_free = lambda b: self.host.store(b.block_hash, b.block_id)
            self.pool.on_realloc = lambda b: self.host.reallocated(b.block_id)

    # ---- hashing -------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        if (len(hashes) + 1) * self.block_size <= len(tokens):
            hashes += hash_block_tokens(tokens, self.block_size, self.extra_keys, len(hashes),
                                        hashes[-1] if hashes else ROOT_HASH)
        return hashes

    # ---- allocation ------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Cached blocks for the longest prefix of `request`, and the tokens they cover.

        At least one token is always left to compute (its logits are needed), so a fully
        cached, block-aligned prompt gives back its last block; a request scoring its prompt
        (prompt_logprobs) takes no hit.
        """
        if not self.enable_caching or request.scoring_prompt:  # every prompt position's logits are needed
            return [], 0
        hits: list[Block] = []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request)[:max_blocks]
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.host is not None and len(hits) < len(hashes):
            hits += self._load_from_host(hashes[len(hits):], hits)
        return hits, len(hits) * self.block_size

    def _load_from_host(self, hashes: list[BlockHash], pinned: list[Block]) -> list[Block]:
        """The host tier's run of `hashes`, each loaded back into a fresh GPU block that is
        then cached like any GPU block (so a request that cannot be admitted now finds them
        on the GPU next time). The GPU hits before them are pinned meanwhile."""
        self.pool.touch(pinned)
        loaded = []
        try:
            for h in hashes:
                slot = self.host.slot_of(h)
                if slot is None or self.pool.num_free_blocks == 0:
                    break
                block = self.pool.allocate(1)[0]
                self.pool.cache_block(block, h)
                self.host.queue_load(slot, block.block_id)
                loaded.append(block)
        finally:
            self.pool.free(reversed(pinned + loaded))
        self.host_hit_tokens += len(loaded) * self.block_size
        return loaded

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted request's prefix-cache query (metrics, in tokens)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def can_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[Block] | None = None) -> list[Block] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones.

        Returns the request's full block list, or None (nothing changed) if the pool
        cannot supply the blocks; the scheduler then preempts or waits.
        """
        blocks = self.req_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:  # a running request (most calls: a decode)
            end = request.num_computed_tokens - request.kv_shift + num_new_tokens
            if end <= len(blocks) * self.block_size:
                return blocks
        blocks = blocks or []
        new_computed_blocks = new_computed_blocks or []
        num_computed = request.num_computed_tokens - request.kv_shift + len(new_computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_fresh = needed - len(blocks) - len(new_computed_blocks)
        # hits sitting in the free queue are taken out of it by touch(): they count
        # against the free blocks too
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_fresh + evictable_hits > self.pool.num_free_blocks:
            return None
        if new_computed_blocks or num_fresh > 0 or request.request_id not in self.req_blocks:
            self.pool.touch(new_computed_blocks)
            blocks = blocks + new_computed_blocks
            if num_fresh > 0:
                blocks += self.pool.allocate(num_fresh)
            self.req_blocks[request.request_id] = blocks
        return blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publishes the request's blocks that are full and computed. Each block is looked at once:
        `req_published` keeps how many of the request's blocks were (a decode step costs one
        block at most, not a scan of its whole context)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        start = self.req_published.get(rid, 0)
        if num_computed_tokens // self.block_size <= start:  # no block filled since (most decode steps)
            return
        blocks = self.req_blocks.get(rid, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        end = min(num_full, len(hashes))
        for i in range(start, end):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], hashes[i])
        self.req_published[rid] = max(start, end)

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Keeps the blocks the first `num_tokens` tokens need; frees the rest (the slots of a
        step's rejected draft tokens), tail first."""
        blocks = self.req_blocks.get(request.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        if len(blocks) > keep:
            self.pool.free(reversed(blocks[keep:]))
            self.req_blocks[request.request_id] = blocks[:keep]
            if self.req_published.get(request.request_id, 0) > keep:
                self.req_published[request.request_id] = keep

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._req_ids.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        self.req_hashes.pop(request.request_id, None)
        self.req_published.pop(request.request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table. The same list comes back while its blocks stay the same (a
        decode step adds a block once in `block_size` tokens, not a copy of its whole context each
        step): callers read it, never change it."""
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            return []
        cached = self._req_ids.get(request_id)
        if cached is not None and cached[0] is blocks:
            return cached[1]
        ids = [b.block_id for b in blocks]
        self._req_ids[request_id] = (blocks, ids)
        return ids

    # ---- metrics ---------------------------------------------------------------------
    # ---- a KV handoff's accounting (decode: receiver, prefill: sender) -------------------------
    def reserve_prompt(self, request: Request) -> tuple[list[int], int] | None:
        """Receiver: (block ids to fill, number of leading blocks already held), or None if
        the pool cannot hold the request's prompt now. The held blocks (chained-hash hits)
        are pinned and never sent; fresh blocks are allocated for the rest. kv.free()
        undoes it."""
        n = request.num_prompt_tokens
        hits, _ = self.get_computed_blocks(request)
        hits = hits[: n // self.block_size]
        blocks = self.allocate_slots(request, n - len(hits) * self.block_size, hits)
        if blocks is None:
            return None
        self.record_lookup(n, len(hits) * self.block_size)
        return [b.block_id for b in blocks[len(hits): cdiv(n, self.block_size)]], len(hits)

    def prompt_blocks_after(self, request: Request, num_skip: int) -> list[int]:
        """Sender: the request's prompt blocks after the receiver's `num_skip` leading hits."""
        return self.block_ids(request.request_id)[num_skip: cdiv(request.num_prompt_tokens, self.block_size)]

    # ---- a peer fetch's accounting (transfer/fetch.py: holder and receiver) ---------------------
    def gpu_run(self, hashes: list[BlockHash]) -> int:
        """How many of `hashes`, from the first, are cached on this GPU."""
        return held_run(hashes, lambda h: self.pool.lookup(h) is not None)

    def pin_run(self, hashes: list[BlockHash]) -> list[Block]:
        """Holder: the GPU blocks of the run of `hashes` from the first, pinned (a reference
        each) until `unpin`; it stops at the first hash not cached on this GPU."""
        run = []
        for h in hashes:
            block = self.pool.lookup(h) if self.enable_caching else None
            if block is None:
                break
            run.append(block)
        self.pool.touch(run)
        return run

    def unpin(self, blocks: list[Block]) -> None:
        self.pool.free(reversed(blocks))

    def reserve_run(self, num_blocks: int) -> list[Block] | None:
        """Receiver: fresh blocks for a fetched run (None if the pool cannot spare them now)."""
        if num_blocks > self.pool.num_free_blocks:
            return None
        return self.pool.allocate(num_blocks)

    def publish_run(self, blocks: list[Block], hashes: list[BlockHash] | None) -> None:
        """Receiver: a fetch landed (`hashes`: each block's) or failed (None); either way the
        blocks are released, the landed ones cached under their hashes (ref 0, most recent)."""
        for block, h in zip(blocks, hashes or ()):
            self.pool.cache_block(block, h)
        self.pool.free(reversed(blocks))

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_all_free(self) -> None:
        """Raises if any block is still referenced (used by tests and on shutdown)."""
        self.pool.check_invariants()
        if self.req_blocks or self.pool.num_used_blocks:
            raise AssertionError(
                f"{self.pool.num_used_blocks} KV blocks still held by {list(self.req_blocks)}")
