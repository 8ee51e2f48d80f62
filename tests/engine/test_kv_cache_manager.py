"""Block pool and KV-cache manager: exact block ids, reference counts, LRU eviction,
prefix hits; every block free at the end."""

import pytest

from pdserve.engine.core.block_pool import BlockPool
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), max_tokens=4)


def admit(kv, r):
    hits, n = kv.get_computed_blocks(r)
    blocks = kv.allocate_slots(r, r.num_tokens - n, hits)
    assert blocks is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r, r.num_tokens)
    return [b.block_id for b in blocks], n


def test_pool_lru_and_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    pool.free(reversed(a))
    assert pool.eviction_order() == [2, 3, 1, 0]  # freed tail first: 1 evicted before 0
    b = pool.allocate(3)
    assert [x.block_id for x in b] == [2, 3, 1]
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate(2)
    pool.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(b[:1])
    pool.check_invariants()
    assert pool.num_free_blocks == 4


def test_allocation_exact_ids_and_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", range(10))  # 3 blocks: 2 full + 1 partial
    ids, n = admit(kv, r)
    assert (ids, n) == ([0, 1, 2], 0)
    # decoding 2 more tokens fits in block 2; the third needs a new block
    r.append_token(100)
    r.append_token(101)
    assert [b.block_id for b in kv.allocate_slots(r, 0)] == [0, 1, 2]
    r.num_computed_tokens = 12
    r.append_token(102)
    assert [b.block_id for b in kv.allocate_slots(r, 1)] == [0, 1, 2, 3]
    kv.free(r)
    kv.check_all_free()


def test_prefix_hits_share_blocks_and_survive_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(10))
    ids_a, _ = admit(kv, a)
    b = req("b", list(range(8)) + [50, 51, 52])
    ids_b, hit = admit(kv, b)
    assert hit == 8 and ids_b[:2] == ids_a[:2] and ids_b[2] not in ids_a
    assert kv.pool.blocks[0].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    kv.check_all_free()
    # freed blocks keep their hashes: a new request still hits them
    c = req("c", list(range(8)) + [7])
    ids_c, hit = admit(kv, c)
    assert hit == 8 and ids_c[:2] == ids_a[:2]
    kv.free(c)
    kv.check_all_free()


def test_fully_cached_prompt_recomputes_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(8))
    admit(kv, a)
    kv.free(a)
    b = req("b", range(8))
    hits, n = kv.get_computed_blocks(b)
    assert n == 4  # block-aligned prompt: the last block is recomputed for its logits
    kv.allocate_slots(b, 4, hits)
    kv.free(b)
    kv.check_all_free()


def test_eviction_drops_hash_and_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = req("a", range(8))
    admit(kv, a)
    kv.free(a)
    assert len(kv.pool.cached) == 2 and kv.pool.num_evicted == 0
    big = req("big", range(100, 112))
    admit(kv, big)  # takes all 3 blocks, evicting a's cached blocks
    assert len(kv.pool.cached) == 3 and kv.get_computed_blocks(req("x", range(9)))[1] == 0
    assert kv.pool.num_evicted == 2  # the never-cached third block is not an eviction
    other = req("o", range(200, 204))
    assert kv.allocate_slots(other, 4) is None
    assert kv.num_free_blocks == 0 and "o" not in kv.req_blocks
    kv.free(big)
    kv.check_all_free()
