"""The host tier (tiers/offload.py) and its persistence (tiers/persist.py), on CPU with tiny models:
exact slots of the LRU index, outputs identical to an unbounded GPU cache, tensor-parallel
shards following rank 0's copies, a restart that finds its prefix on disk, and refusals."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.base.hashing import hash_block_tokens
from pdserve.engine.tiers import disk
from pdserve.engine.tiers.offload import HostIndex
from pdserve.engine.tiers.tier import KVTier

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHARED = list(range(100, 164))  # 4 full blocks every prompt starts with
PROMPTS = [SHARED + [i, i + 1, i + 2] for i in range(300, 330, 3)]
H = [bytes([i]) * 32 for i in range(6)]


def test_host_index_lru_slots_events_and_ops():
    idx = HostIndex(3)
    idx.record_events = True
    for block, h in ((5, H[0]), (6, H[1]), (7, H[2])):
        idx.store(h, block)
    idx.store(H[0], 9)  # already there: no copy, just recently used
    assert idx.entries() == [(H[1], 1), (H[2], 2), (H[0], 0)]
    assert idx.slot_of(H[1]) == 1 and idx.slot_of(H[5]) is None
    idx.store(H[3], 8)  # full: reuses the least recently used slot (H[2]'s)
    assert idx.entries() == [(H[0], 0), (H[1], 1), (H[3], 2)]
    idx.queue_load(1, 40)
    idx.reallocated(6)  # its offload is still queued: the step must wait for it
    ops = idx.take()
    assert ops.offloads == [(5, 0), (6, 1), (7, 2), (8, 2)] and ops.loads == [(1, 40)] and ops.wait
    assert idx.drain_events() == [("host_stored", H[0]), ("host_stored", H[1]), ("host_stored", H[2]),
                                  ("host_removed", H[2]), ("host_stored", H[3])]
    idx.reallocated(7)  # offloaded last step: may still run on the side stream
    assert idx.take().wait and idx.take() is None
    with pytest.raises(ValueError, match="at least one block slot"):
        HostIndex(0)


def test_the_host_tier_as_a_kv_tier_looks_up_runs_and_evicts():
    """tiers/tier.py's protocol on the host index: a run from the first hash, nothing to wait for
    on load (the GPU lookup copies), an evicted block's slot free again and its queued copy dropped."""
    idx = HostIndex(3)
    idx.record_events = True
    assert isinstance(idx, KVTier) and idx.name == "host" and not idx.waits
    idx.store(H[0], 5)
    idx.store(H[1], 6)
    assert idx.lookup([H[0], H[1], H[2], H[0]]) == 2 and idx.lookup([H[2], H[0]]) == 0
    assert idx.load(None, [H[0], H[1]]) is False and idx.ready() == []
    assert idx.evict(H[1]) and not idx.evict(H[1]) and H[1] not in idx
    assert idx.drain_events()[-1] == ("host_removed", H[1])
    assert idx.take().offloads == [(5, 0)]  # H[1]'s copy into its slot is no longer made
    idx.store(H[2], 7)
    assert idx.slot_of(H[2]) == 1  # the evicted block's slot, reused first
    assert idx.stats().blocks_used == 2


def churn(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt after an unrelated 150-token one that pushes the shared prefix out of
    a 12-block GPU cache."""
    out = []
    for p in prompts:
        llm.generate([list(range(1000 + 3 * p[-1], 1150 + 3 * p[-1]))], PARAMS)
        out.append(llm.generate([p], PARAMS)[0].outputs[0].token_ids)
    return out


@pytest.fixture(scope="module")
def reference(tiny_models):
    with LLM(tiny_models["llama"], max_model_len=256) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_offload_then_hit_equals_an_unbounded_gpu_cache(tiny_models, reference):
    small = dict(max_model_len=256, num_gpu_blocks_override=12, max_num_seqs=2)
    with LLM(tiny_models["llama"], **small) as gpu_only:
        assert churn(gpu_only, PROMPTS) == reference
        base = gpu_only.engine.stats().as_dict()
    with LLM(tiny_models["llama"], kv_offloading_size=0.001, **small) as llm:
        assert churn(llm, PROMPTS) == reference
        st = llm.engine.stats().as_dict()
        llm.engine.kv.check_all_free()
    assert "prefix_cache_host_hits" not in base
    # with the tier every prompt after the first finds its 64-token prefix in one tier or the other
    assert base["prefix_cache_hits"] < 9 * 64 <= st["prefix_cache_hits"], (base, st)
    assert st["prefix_cache_host_hits"] >= 4 * 64
    assert st["kv_host_loaded_blocks"] * 16 == st["prefix_cache_host_hits"]
    assert st["kv_offloaded_blocks"] >= st["kv_host_blocks_used"] > 0
    assert st["kv_host_blocks_total"] == int(0.001 * (1 << 30)) // llm.engine.runner.layout.block_bytes


@pytest.mark.slow
def test_offload_under_preemption_and_tensor_parallel_shards(tiny_models):
    """8 requests of 40 tokens on 10 blocks preempt each other; at TP=2 the shard applies
    the same copies to its own KV slice and host buffer."""
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(tiny_models["llama"], max_model_len=256) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, long)]
    for tp in (1, 2):
        with LLM(tiny_models["llama"], max_model_len=256, num_gpu_blocks_override=10, max_num_seqs=4,
                 kv_offloading_size=0.001, tensor_parallel_size=tp) as llm:
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:8], long)] == want[:8]
            for p, w in zip(PROMPTS[8:], want[8:]):
                llm.generate([list(range(1000 + 3 * p[-1], 1150 + 3 * p[-1]))], PARAMS)
                assert llm.generate([p], long)[0].outputs[0].token_ids == w
            st = llm.engine.stats().as_dict()
            assert st["num_preemptions"] > 0 and st["prefix_cache_host_hits"] > 0, st
            llm.engine.kv.check_all_free()


@pytest.mark.slow
def test_int8_kv_and_its_scales_go_through_the_host_tier_and_tp_shards(tiny_models):
    """Scales live in the slab (ops/kv_quant.py): offloaded, loaded back and split by head with
    the values. TP=2 with a small GPU cache and the tier gives TP=1's unbounded tokens."""
    with LLM(tiny_models["llama"], max_model_len=256, kv_cache_dtype="int8") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    with LLM(tiny_models["llama"], max_model_len=256, num_gpu_blocks_override=12, max_num_seqs=2,
             kv_offloading_size=0.001, kv_cache_dtype="int8", tensor_parallel_size=2) as llm:
        assert churn(llm, PROMPTS) == want
        assert llm.engine.stats().cache.host_hit_tokens > 0


@pytest.mark.slow
def test_int4_kv_goes_through_the_host_tier_tp_shards_and_the_persisted_file(tiny_models, tmp_path):
    """int4's packed codes and (scale, min) pairs live in the slab (ops/kv_quant.py): offloaded,
    loaded back, split by head under TP=2, written to disk and restored, they give the tokens of
    an unbounded int4 cache."""
    model = tiny_models["llama_hd32"]
    with LLM(model, max_model_len=256, kv_cache_dtype="int4") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, max_num_seqs=2, kv_offloading_size=0.001,
              kv_cache_dtype="int4")
    with LLM(model, tensor_parallel_size=2, **kw) as llm:
        assert churn(llm, PROMPTS) == want
        assert llm.engine.stats().cache.host_hit_tokens > 0
    with LLM(model, kv_persist_dir=str(tmp_path), **kw) as llm:
        assert churn(llm, PROMPTS[:2]) == want[:2]
    with LLM(model, kv_persist_dir=str(tmp_path), **kw) as llm:
        assert llm.engine.persist_status.startswith("restored ") and "refused" not in llm.engine.persist_status
        out = llm.generate([PROMPTS[5]], PARAMS)[0]
        assert out.outputs[0].token_ids == want[5] and out.num_cached_tokens == 64


def test_persisted_tier_serves_a_known_prefix_after_restart(tiny_models, reference, tmp_path):
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, kv_offloading_size=0.001, kv_persist_dir=str(tmp_path))
    with LLM(tiny_models["llama"], **kw) as llm:
        assert churn(llm, PROMPTS[:2]) == reference[:2]
        used = llm.engine.stats().host.blocks_used
    index = json.loads((tmp_path / "host_tier.json").read_text())
    assert len(index["hashes"]) == used == len(block_files(tmp_path))  # one disk-tier block file each
    with LLM(tiny_models["llama"], **kw) as llm:
        assert llm.engine.persist_status == f"restored {used} blocks from {tmp_path}"
        assert llm.engine.stats().host.blocks_used == used
        out = llm.generate([PROMPTS[5]], PARAMS)[0]
        assert out.outputs[0].token_ids == reference[5]
        assert out.num_cached_tokens == 64 and llm.engine.stats().cache.host_hit_tokens == 64


def test_an_engine_persists_once_when_closed_twice(tiny_models, tmp_path):
    """`with LLM(...)` closes the engine and the LLM's finalizer closes it again later (after a
    newer engine may have written the directory): only the first close writes the file."""
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, kv_offloading_size=0.001, kv_persist_dir=str(tmp_path))
    with LLM(tiny_models["llama"], **kw) as llm:
        churn(llm, PROMPTS[:1])
    path = tmp_path / "host_tier.json"
    assert path.exists()
    path.unlink()
    llm.close()
    assert not path.exists()


def test_blocks_freed_after_the_last_step_are_copied_before_the_tier_is_saved(tiny_models, reference, tmp_path):
    """The prompt's blocks are freed by its last step; their offloads are only queued when
    the engine closes. Saving must copy them first, else the file holds their hashes over
    slots never written, and the restarted engine serves garbage for a prefix hit."""
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, kv_offloading_size=0.001, kv_persist_dir=str(tmp_path))
    with LLM(tiny_models["llama"], **kw) as llm:
        assert llm.generate([PROMPTS[0]], PARAMS)[0].outputs[0].token_ids == reference[0]
        assert len(llm.engine.kv.host.ops.offloads) >= 4  # queued, not copied: no step ran since
    with LLM(tiny_models["llama"], **kw) as llm:
        out = llm.generate([PROMPTS[0]], PARAMS)[0]
        assert out.num_cached_tokens == 64 and llm.engine.stats().cache.host_hit_tokens == 64
        assert out.outputs[0].token_ids == reference[0]


def block_files(d) -> dict[bytes, pathlib.Path]:
    """The persisted tier's block files (tiers/disk.py's format), by block hash."""
    return {bytes.fromhex(p.stem): p for p in pathlib.Path(d).rglob("*" + disk.SUFFIX)}


def test_blocks_that_fail_their_checksum_or_hold_nan_are_refused_one_by_one(tiny_models, reference, tmp_path):
    """One block file with flipped bits (its checksum fails: refused, the file removed), one whose
    values are NaN under a checksum that matches them (refused), one missing: the rest restore."""
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, kv_offloading_size=0.001, kv_persist_dir=str(tmp_path))
    with LLM(tiny_models["llama"], **kw) as llm:
        churn(llm, PROMPTS[:1])
        used = llm.engine.stats().host.blocks_used
    files = block_files(tmp_path)
    head, second, third = hash_block_tokens(SHARED, 16)[:3]
    raw = bytearray(files[head].read_bytes())
    raw[disk.HEADER.size + 123] ^= 0x40  # flipped bits inside the block's bytes
    files[head].write_bytes(bytes(raw))
    nan = np.full(len(raw) - disk.HEADER.size, 0xFF, dtype=np.uint8)  # float32 NaNs, checksummed as such
    files[second].write_bytes(disk.HEADER.pack(disk.MAGIC, second, nan.nbytes, disk.checksum(second, nan)) +
                              nan.tobytes())
    files[third].unlink()
    with LLM(tiny_models["llama"], **kw) as llm:
        assert llm.engine.persist_status == (f"restored {used - 3} blocks from {tmp_path}; refused 3 "
                                             "(2 missing or failed their checksum, 1 hold NaN or Inf)")
        assert llm.engine.stats().persist_status == llm.engine.persist_status
        assert not files[head].exists()
        out = llm.generate([PROMPTS[0]], PARAMS)[0]
        assert out.outputs[0].token_ids == reference[0] and out.num_cached_tokens == 0  # recomputed


@pytest.mark.parametrize("edit,why", [
    (lambda p: p.update(hashes=[h[:16] for h in p["hashes"]]), "32-byte digests"),
    (lambda p: p.update(hashes=[p["hashes"][0]] * 2), "distinct"),
    (lambda p: p.update(layout={**p["layout"], "dtype": "float64"}), "another layout"),
    (lambda p: p.pop("hashes"), "is corrupt (KeyError"),
], ids=["short hashes", "a hash twice", "another layout", "no hashes"])
def test_a_malformed_persist_index_is_refused_whole_and_the_engine_serves(tiny_models, reference, tmp_path, edit, why):
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, kv_offloading_size=0.001, kv_persist_dir=str(tmp_path))
    with LLM(tiny_models["llama"], **kw) as llm:
        churn(llm, PROMPTS[:1])
    path = tmp_path / "host_tier.json"
    payload = json.loads(path.read_text())
    edit(payload)
    path.write_text(json.dumps(payload))
    with LLM(tiny_models["llama"], **kw) as llm:
        assert why in llm.engine.persist_status and llm.engine.stats().host.blocks_used == 0
        assert llm.generate([PROMPTS[0]], PARAMS)[0].outputs[0].token_ids == reference[0]


def test_the_tier_is_also_written_every_interval(tiny_models, tmp_path):
    with LLM(tiny_models["llama"], max_model_len=256, num_gpu_blocks_override=12, kv_offloading_size=0.001,
             kv_persist_dir=str(tmp_path), kv_persist_interval_s=0.01) as llm:
        churn(llm, PROMPTS[:1])
        assert (tmp_path / "host_tier.json").exists()  # before close
        llm.engine.persist_host_tier()


def test_a_corrupt_or_mismatched_persist_file_is_refused_and_the_server_starts_empty(tiny_models, tmp_path):
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, kv_offloading_size=0.001, kv_persist_dir=str(tmp_path))
    with LLM(tiny_models["llama"], **kw) as llm:
        churn(llm, PROMPTS[:1])
    with LLM(tiny_models["mistral"], **kw) as llm:  # the same shapes, other weights and config
        assert "was written for another fingerprint" in llm.engine.persist_status
        assert llm.engine.stats().host.blocks_used == 0
        assert len(llm.generate([PROMPTS[0]], PARAMS)[0].outputs[0].token_ids) == 8
    (tmp_path / "host_tier.json").write_bytes(b"not json")
    with LLM(tiny_models["llama"], **kw) as llm:
        assert "host_tier.json is corrupt" in llm.engine.persist_status
        assert llm.engine.stats().host.blocks_used == 0
    (tmp_path / "host_tier.json").unlink()  # an earlier version's snapshot alone: refused by name
    torch.save({"format": 2, "hashes": [], "blocks": torch.zeros(0)}, tmp_path / "kv_host_tier.pt")
    with LLM(tiny_models["llama"], **kw) as llm:
        assert "kv_host_tier.pt is a host tier saved by an earlier version" in llm.engine.persist_status
        assert llm.engine.stats().host.blocks_used == 0
    with pytest.raises(ValueError, match="set kv_offloading_size"):
        LLM(tiny_models["llama"], kv_persist_dir=str(tmp_path))
    with pytest.raises(ValueError, match="kv_offloading_size must be a number of GiB >= 0, got -1"):
        LLM(tiny_models["llama"], kv_offloading_size=-1)
