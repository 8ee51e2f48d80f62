"""The disk tier on real files. Its store (engine/tiers/disk.py): blocks round-trip, a corrupt or
truncated file is refused alone, workers share one directory, a writer killed mid-write leaves
no block that reads wrongly, a restart finds the blocks, eviction is LRU within the size. In the
engine (engine/tiers/disk_tier.py, tiny models on CPU): blocks the host tier drops come back from
disk with the tokens of an unbounded cache (bf16 and int8 KV), across a restart, and a disk
predicted slower than recomputing is not read."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.base.kv_layout import KVLayout
from pdserve.engine.tiers.disk import HEADER, BlockMeaning, DiskStore

META = BlockMeaning("model-a", KVLayout(16, 2, 1, 64, "bfloat16"))
NBYTES = 4096


def block(i: int) -> tuple[bytes, np.ndarray]:
    """Block i's hash and bytes, both derived from i (a reader can tell what it should get)."""
    h = hashlib.sha256(f"block {i}".encode()).digest()
    return h, np.random.default_rng(i).integers(0, 256, NBYTES, dtype=np.uint8)


def store(root, capacity_blocks: int = 100, meta=META) -> DiskStore:
    return DiskStore(str(root), meta, NBYTES, capacity_blocks * (NBYTES + HEADER.size))


def read(s: DiskStore, h: bytes) -> np.ndarray | None:
    out = np.empty(NBYTES, dtype=np.uint8)
    return out if s.read_into(h, out) else None


def test_blocks_round_trip_and_a_restart_finds_them(tmp_path):
    s = store(tmp_path)
    for i in range(5):
        s.put(*block(i))
    s.flush()
    assert all(np.array_equal(read(s, block(i)[0]), block(i)[1]) for i in range(5))
    assert (s.stats.written_blocks, s.stats.read_blocks, s.stats.refused_blocks) == (5, 5, 0)
    assert read(s, block(9)[0]) is None and block(9)[0] not in s
    s.close()
    again = store(tmp_path)  # a restart: the directory scanned
    assert len(again.index) == 5 and all(block(i)[0] in again for i in range(5))
    assert np.array_equal(read(again, block(3)[0]), block(3)[1])
    again.close()


def test_a_corrupt_or_truncated_file_is_refused_alone(tmp_path):
    s = store(tmp_path)
    for i in range(4):
        s.put(*block(i))
    s.flush()
    with open(s.path(block(0)[0]), "r+b") as f:  # one byte of the data flipped
        f.seek(HEADER.size + 100)
        b = f.read(1)
        f.seek(HEADER.size + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(s.path(block(1)[0]), "r+b") as f:  # cut short
        f.truncate(HEADER.size + NBYTES // 2)
    os.makedirs(os.path.dirname(s.path(block(7)[0])), exist_ok=True)
    os.replace(s.path(block(2)[0]), s.path(block(7)[0]))  # block 2's file under another block's name
    s.index[block(7)[0]] = None
    assert read(s, block(0)[0]) is None and read(s, block(1)[0]) is None and read(s, block(7)[0]) is None
    assert s.stats.refused_blocks == 3 and not os.path.exists(s.path(block(0)[0]))
    assert np.array_equal(read(s, block(3)[0]), block(3)[1])  # the others still read
    s.close()


def test_workers_share_one_directory_and_another_layout_is_never_found(tmp_path):
    a, b = store(tmp_path), store(tmp_path)
    other = store(tmp_path, meta=replace(META, layout=replace(META.layout, dtype="int8")))
    a.put(*block(1))
    b.put(*block(1))  # the same block from two writers: one rename wins, the bytes are the same
    b.put(*block(2))
    a.flush()
    b.flush()
    assert np.array_equal(read(b, block(1)[0]), block(1)[1]) and np.array_equal(read(a, block(2)[0]), block(2)[1])
    assert block(1)[0] not in other and read(other, block(2)[0]) is None
    for s in (a, b, other):
        s.close()


def test_eviction_is_lru_within_the_size(tmp_path):
    s = store(tmp_path, capacity_blocks=3)
    for i in range(3):
        s.put(*block(i))
    s.flush()
    time.sleep(0.01)
    assert read(s, block(0)[0]) is not None  # block 0 used again: block 1 is now the oldest
    s.put(*block(3))
    s.flush()
    assert block(1)[0] not in s and all(block(i)[0] in s for i in (0, 2, 3))
    assert s.stats.evicted_blocks == 1 and len(os.listdir(os.path.dirname(s.path(block(0)[0])))) >= 1
    s.scan()  # a rescan rebuilds the same order from the files' times
    s.put(*block(4))
    s.flush()
    assert block(2)[0] not in s and block(0)[0] in s
    s.close()


WRITER = """
import hashlib, sys
import numpy as np
from pdserve.engine.base.kv_layout import KVLayout
from pdserve.engine.tiers.disk import BlockMeaning, DiskStore
meta = BlockMeaning("model-a", KVLayout(16, 2, 1, 64, "bfloat16"))
n = int(sys.argv[2])
s = DiskStore(sys.argv[1], meta, n, 10**12)
print("ready", flush=True)
i = 0
while True:
    h = hashlib.sha256(f"block {i}".encode()).digest()
    s.put(h, np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8))
    i += 1
    if s.queue.qsize() > 8:
        s.flush()
"""


def test_a_writer_killed_mid_write_leaves_no_block_that_reads_wrongly(tmp_path):
    nbytes = 4 << 20  # big blocks: the kill lands inside a write
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(nbytes)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    s = DiskStore(str(tmp_path), META, nbytes, 10**12)  # its scan removes the dead writer's temporary file
    assert len(s.index) > 0
    files = [e for d in os.scandir(s.dir) for e in os.scandir(d.path)]
    assert all(".tmp-" not in e.name for e in files), [e.name for e in files]
    out = np.empty(nbytes, dtype=np.uint8)
    for h in list(s.index):
        i = next(i for i in range(10_000) if hashlib.sha256(f"block {i}".encode()).digest() == h)
        assert s.read_into(h, out) and np.array_equal(out, np.random.default_rng(i).integers(0, 256, nbytes,
                                                                                             dtype=np.uint8))
    s.close()


def test_a_size_below_one_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no block"):
        DiskStore(str(tmp_path), META, NBYTES, NBYTES - 1)


# ---- the tier in the engine (tiers/disk_tier.py) ------------------------------------------------------

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHARED = list(range(100, 164))  # 4 full blocks every prompt starts with
PROMPTS = [SHARED + [i, i + 1, i + 2] for i in range(300, 330, 3)]


def churn(llm: LLM, prompt: list[int]) -> list[int]:
    """`prompt` after an unrelated 150-token one that pushes the shared prefix out of a 12-block GPU
    cache and a 4-slot host tier (to disk)."""
    llm.generate([list(range(1000 + 3 * prompt[-1], 1150 + 3 * prompt[-1]))], PARAMS)
    return llm.generate([prompt], PARAMS)[0].outputs[0].token_ids


def alone(model: str, **kw) -> list[list[int]]:
    """Each prompt's tokens from an unbounded cache, one request at a time (float32), as the
    tiered engine runs them (a tiny random model's near-flat logits follow any rounding)."""
    with LLM(model, max_model_len=256, dtype="float32", **kw) as llm:
        return [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in PROMPTS]


def tiered(model: str, disk: str, **kw) -> LLM:
    """An engine with a 12-block GPU cache, a host tier of 4 blocks and the disk tier in `disk`
    (float32 on a GPU too: a prefix hit changes the tail's GEMM shapes, and bf16 rounds them apart)."""
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, dtype="float32", **kw)
    with LLM(model, **kw) as probe:
        block = probe.engine.runner.layout.block_bytes
    return LLM(model, kv_offloading_size=4.5 * block / (1 << 30), kv_disk_dir=disk, kv_disk_size=0.01, **kw)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_blocks_go_down_to_disk_and_back_with_the_same_tokens_and_survive_a_restart(tiny_models, tmp_path,
                                                                                  kv_cache_dtype):
    model = tiny_models["llama_hd32" if kv_cache_dtype == "int4" else "llama"]  # int4 packs head_dim 32 rows
    want = alone(model, kv_cache_dtype=kv_cache_dtype)
    with tiered(model, str(tmp_path), kv_cache_dtype=kv_cache_dtype) as llm:
        assert [churn(llm, p) for p in PROMPTS[:3]] == want[:3]
        s = llm.engine.stats().as_dict()
        assert s["kv_host_blocks_total"] == 4 and s["kv_disk_blocks"] > 0 and s["kv_disk_written_bytes"] > 0
        assert s["prefix_cache_disk_hits"] >= 64, s  # the shared prefix came back from disk
        out = llm.generate([PROMPTS[5]], PARAMS)[0]
        assert out.outputs[0].token_ids == want[5]
        llm.engine.kv.check_all_free()
    with tiered(model, str(tmp_path), kv_cache_dtype=kv_cache_dtype) as llm:  # a restart finds the disk tier
        assert llm.engine.stats().disk.blocks > 0
        llm.generate([list(range(3000, 3100))], PARAMS)  # a prefill measured: the disk is weighed against it
        out = llm.generate([PROMPTS[7]], PARAMS)[0]
        assert out.outputs[0].token_ids == want[7] and out.num_cached_tokens == 64
        assert llm.engine.stats().disk.hit_tokens == 64


def test_a_slow_disk_is_not_read_when_recomputing_is_faster(tiny_models, tmp_path):
    """Once the step model predicts recomputing the prefix faster than reading it at the measured
    bandwidth, the request is scheduled at once and recomputes (same tokens). A restart finds the
    prefill rate measured before it, saved with the tier: its first request reads the disk (it
    recomputed, for want of a rate). Where no prefill was ever measured, it recomputes (a disk of
    unknown worth is not waited on)."""
    model = tiny_models["llama"]
    want = alone(model)
    with tiered(model, str(tmp_path)) as llm:
        assert churn(llm, PROMPTS[0]) == want[0]
        for p in PROMPTS[1:4]:  # steps enough for the step model's fit
            llm.generate([list(range(2000 + p[-1], 2100 + p[-1]))], PARAMS)
        assert llm.engine.step_model.prefill_tok_s > 0
        llm.engine.tiers.get("disk").read_gbps = 1e-9  # a disk that would take ages
        before = llm.engine.stats().disk.hit_tokens
        assert churn(llm, PROMPTS[4]) == want[4]
        s = llm.engine.stats().as_dict()
        assert s["prefix_cache_disk_hits"] == before and s["kv_disk_skipped_tokens"] >= 64, s
        rate = llm.engine.step_model.prefill_tok_s
    with tiered(model, str(tmp_path)) as llm:  # restarted: the rate came back with the tier
        assert llm.engine.step_model.prefill_tok_s == pytest.approx(rate)
        assert llm.generate([PROMPTS[4]], PARAMS)[0].outputs[0].token_ids == want[4]
        s = llm.engine.stats().as_dict()
        assert s["prefix_cache_disk_hits"] == 64 and s["kv_disk_skipped_tokens"] == 0, s
    (saved,) = tmp_path.glob("*/prefill_rate.json")
    saved.unlink()
    with tiered(model, str(tmp_path)) as llm:  # restarted with no rate known: recompute
        assert llm.engine.step_model.prefill_tok_s == 0
        assert llm.generate([PROMPTS[4]], PARAMS)[0].outputs[0].token_ids == want[4]
        s = llm.engine.stats().as_dict()
        assert s["prefix_cache_disk_hits"] == 0 and s["kv_disk_skipped_tokens"] >= 64, s


def test_the_disk_tier_needs_the_host_tier_and_one_rank(tiny_models, tmp_path):
    for kw, why in ((dict(kv_disk_dir=str(tmp_path), kv_disk_size=1.0), "set kv_offloading_size"),
                    (dict(kv_disk_dir=str(tmp_path), kv_offloading_size=0.01), "kv_disk_size must be"),
                    (dict(kv_disk_dir=str(tmp_path), kv_disk_size=1.0, kv_offloading_size=0.01,
                          kv_persist_dir=str(tmp_path)), "drop kv_persist_dir")):
        with pytest.raises(ValueError, match=why):
            LLM(tiny_models["llama"], max_model_len=256, **kw)


def test_every_worker_metric_the_router_prints_is_a_field_of_the_typed_stats(tiny_models, tmp_path):
    """The row /metrics reads (WorkerStats.as_dict) is made from typed records alone: every
    engine metric the router names comes out of a tiered, speculating engine's EngineStats, with
    the value of the field that carries it, and a worker's own counters add the rest."""
    from pdserve.cluster.records import WorkerCounters, WorkerStats
    from pdserve.engine.stats import EngineStats
    from pdserve.router.metrics import WORKER_COUNTERS, WORKER_GAUGES

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with tiered(tiny_models["llama"], str(tmp_path), speculative_config=spec) as llm:
        churn(llm, PROMPTS[0])
        churn(llm, PROMPTS[1])
        st = llm.engine.stats()
    assert isinstance(st, EngineStats) and st.host is not None and st.disk is not None and st.spec is not None
    row = st.as_dict()
    assert row["prefix_cache_hits"] == st.cache.prefix_hits and row["kv_host_blocks_used"] == st.host.blocks_used
    assert row["prefix_cache_disk_hits"] == st.disk.hit_tokens > 0 and row["num_running"] == st.placement.num_running
    assert row["spec_decode_acceptance_rate"] == st.spec.acceptance_rate and row["kv_disk_unwritable"] == 0
    named = {k for _, k in (*WORKER_GAUGES.values(), *WORKER_COUNTERS.values())}
    # a cluster's worker's own counters, a persisting one's rows
    worker_only = {"kernel_compiles_serving"} | {k for k in named if "peer" in k or "persist" in k}
    missing = named - set(row) - worker_only
    assert not missing, missing
    ws = WorkerStats.of(st, WorkerCounters("decode", "decode-0", kernel_compiles_serving=2), inflight=1,
                        held_for_handoff=0)
    printed = ws.as_dict()
    assert printed["kernel_compiles_serving"] == 2 and printed["inflight"] == 1 and printed["role"] == "decode"
    assert (ws.num_running, ws.kv_blocks_total) == (st.placement.num_running, st.placement.kv_blocks_total)
    assert ws.engine.cache.config.block_size == 16  # the cluster reads a pool's block size from its spec
    assert printed["cache_config"]["num_gpu_blocks"] == 12 and printed["kv_links"] == {}
