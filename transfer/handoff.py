"""The block accounting around a handoff, on the engine's KV-cache manager.

Receiver (decode):  reserve() pins the prompt blocks it already holds (chained-hash
                    hits: never sent) and allocates fresh blocks for the rest; on
                    failure release() frees them all.
Sender (prefill):   blocks_to_send() is the request's prompt blocks after the
                    receiver's hits; after DONE or FAILED, release() drops the
                    request's references (full blocks stay in the prefix cache).
"""

from __future__ import annotations

from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.request import Request


def reserve(kv: KVCacheManager, request: Request) -> tuple[list[int], int] | None:
    """Receiver: (block ids to fill, number of leading blocks already held), or None
    if the pool cannot hold the request's prompt now."""
    n = request.num_prompt_tokens
    hits, hit_tokens = kv.get_computed_blocks(request)
    hits = hits[: n // kv.block_size]
    hit_tokens = len(hits) * kv.block_size
    blocks = kv.allocate_slots(request, n - hit_tokens, hits)
    if blocks is None:
        return None
    kv.record_lookup(n, hit_tokens)
    return [b.block_id for b in blocks[len(hits): cdiv(n, kv.block_size)]], len(hits)


def blocks_to_send(kv: KVCacheManager, request: Request, num_skip: int) -> list[int]:
    ids = kv.block_ids(request.request_id)
    return ids[num_skip: cdiv(request.num_prompt_tokens, kv.block_size)]


def release(kv: KVCacheManager, request: Request) -> None:
    kv.free(request)
