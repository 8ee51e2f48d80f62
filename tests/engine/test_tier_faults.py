"""A tier directory that stops taking writes never stops serving (engine/tiers/write_health.py).

Real file systems, not mocks: a tmpfs the test mounts (root), remounted read-only as an operator
would (EROFS), or too small for what is written (ENOSPC). The persisted host tier under an
engine that keeps generating; a worker started again on the read-only directory (a replacement);
the disk tier's block store on a full disk. Nothing leaves a temporary file behind.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from pdserve import LLM, SamplingParams
from pdserve.engine.base.kv_layout import KVLayout
from pdserve.engine.tiers.disk import HEADER, BlockMeaning, DiskStore

from helpers import Tmpfs

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHARED = list(range(100, 164))
PROMPTS = [SHARED + [i, i + 1, i + 2] for i in range(300, 330, 3)]
NBYTES = 4096
META = BlockMeaning("model-a", KVLayout(16, 2, 1, 64, "bfloat16"))


def churn(llm: LLM, p: list[int]) -> list[int]:
    """`p` after an unrelated prompt that pushes the shared prefix out of a 12-block GPU cache."""
    llm.generate([list(range(1000 + 3 * p[-1], 1150 + 3 * p[-1]))], PARAMS)
    return llm.generate([p], PARAMS)[0].outputs[0].token_ids


def temporaries(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if ".tmp-" in f]


def block(i: int) -> tuple[bytes, np.ndarray]:
    return i.to_bytes(4, "little") * 8, np.random.default_rng(i).integers(0, 256, NBYTES, dtype=np.uint8)


def test_a_persist_dir_turned_read_only_fails_no_request_and_a_worker_restarts_on_it(tiny_models, tmp_path):
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, kv_offloading_size=0.001, kv_persist_interval_s=0.01)
    with LLM(tiny_models["llama"], max_model_len=256) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS[:6], PARAMS)]
    with Tmpfs(tmp_path / "persist") as fs, LLM(tiny_models["llama"], kv_persist_dir=fs.path, **kw) as llm:
        assert churn(llm, PROMPTS[0]) == want[0]
        assert os.path.exists(os.path.join(fs.path, "host_tier.json"))
        (digest,) = [d for d in os.listdir(fs.path) if os.path.isdir(os.path.join(fs.path, d))]
        dead = os.path.join(fs.path, digest, "ab", "ab" * 32 + ".kvb.tmp-999999999-x-1")  # a killed writer's
        os.makedirs(os.path.dirname(dead), exist_ok=True)
        open(dead, "wb").close()
        fs.read_only()
        # the engine thread died here before: OSError [Errno 30] on host_tier.json.tmp-<pid>
        assert [churn(llm, p) for p in PROMPTS[1:3]] == want[1:3]
        assert llm.engine.persist_host_tier() is None
        s = llm.engine.stats().as_dict()
        assert s["kv_persist_unwritable"] == 1 and s["kv_persist_write_error"].startswith("EROFS"), s
        assert s["kv_persist_write_errors"] >= 1
        # a replacement worker on the same read-only directory starts, with what is there
        with LLM(tiny_models["llama"], kv_persist_dir=fs.path, **kw) as again:
            assert again.engine.persist_status.startswith("restored "), again.engine.persist_status
            assert churn(again, PROMPTS[3]) == want[3]
        fs.read_only(False)  # writable again: the next write after its retry time succeeds
        llm.engine.tier_file.files.health.retry_s = 0.0
        assert churn(llm, PROMPTS[4]) == want[4] and llm.engine.persist_host_tier() is not None
        s = llm.engine.stats().as_dict()
        assert s["kv_persist_unwritable"] == 0 and "kv_persist_write_error" not in s
        llm.generate([PROMPTS[5]], PARAMS)
        llm.engine.kv.check_all_free()
        assert temporaries(fs.path) == [dead]  # its writer's pid is not alive, but the scan ran read-only


def test_a_read_only_disk_tier_is_skipped_logged_once_and_still_read(tmp_path, caplog):
    with Tmpfs(tmp_path / "disk") as fs:
        s = DiskStore(fs.path, META, NBYTES, 100 * (NBYTES + HEADER.size))
        for i in range(3):
            s.put(*block(i))
        s.flush()
        fs.read_only()
        with caplog.at_level(logging.WARNING, logger="pdserve.engine.tiers.write_health"):
            for i in range(3, 20):
                s.put(*block(i))
            s.flush()
        assert not s.health.writable and s.health.errors == 1 and s.health.skipped == 16
        assert len([r for r in caplog.records if "EROFS" in r.getMessage()]) == 1  # once per cause
        out = np.empty(NBYTES, dtype=np.uint8)
        assert s.read_into(block(1)[0], out) and np.array_equal(out, block(1)[1])  # reads go on
        assert not s.read_into(block(5)[0], out)
        assert temporaries(fs.path) == []
        s.close()


def test_a_full_disk_makes_the_tier_evict_to_make_room_and_leaves_no_temporary_file(tmp_path):
    with Tmpfs(tmp_path / "disk", size="96k") as fs:  # ~11 block files (2 pages each), not the 100 configured
        s = DiskStore(fs.path, META, NBYTES, 100 * (NBYTES + HEADER.size))
        for i in range(40):
            s.put(*block(i))
        s.flush()
        assert s.health.writable, s.health.cause  # each ENOSPC made room, then the write succeeded
        assert s.capacity < 20 and s.stats.evicted_blocks > 0 and s.stats.written_blocks == 40
        out = np.empty(NBYTES, dtype=np.uint8)
        assert s.read_into(block(39)[0], out) and np.array_equal(out, block(39)[1])  # the newest are kept
        assert temporaries(fs.path) == []
        s.close()
    with Tmpfs(tmp_path / "other", size="64k") as fs:  # full of someone else's file: nothing to evict
        with open(os.path.join(fs.path, "other"), "wb") as f:
            try:
                f.write(b"\0" * (64 << 10))
            except OSError:
                pass
        s = DiskStore(fs.path, META, NBYTES, 100 * (NBYTES + HEADER.size))
        s.put(*block(0))
        s.flush()
        assert not s.health.writable and s.health.cause.startswith("ENOSPC") and temporaries(fs.path) == []
        s.close()
