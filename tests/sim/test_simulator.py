"""The capacity simulator runs the cluster's own placement and the engine's own scheduler."""

import pathlib

from pdserve.sim import Profile, predict

PROFILES = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results" / "profiles"
ARGV = ["--workload", "synthetic", "--input-len", "4096", "--output-len", "32", "--slo-ttft", "1.0",
        "--slo-tpot", "0.04", "--num-requests", "40", "--rates", "2,200"]


def test_a_profile_round_trips(tmp_path):
    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    p.save(str(tmp_path / "p.json"))
    assert Profile.load(str(tmp_path / "p.json")) == p
    assert p.num_blocks(0.42) < p.num_blocks(0.85)


def test_hybrid_is_placed_by_the_placer_and_a_flood_misses_the_slo():
    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    res = predict(p, "hybrid:1:1", ARGV, one_gpu=True)
    low, flood = res["runs"]
    assert low["completed"] == flood["completed"] == 40
    assert low["slo_attainment"] > flood["slo_attainment"]
    assert set(low["routing"]) & {"prefill_pool", "fits_decode_step", "decode_spare"}


def test_blocks_regrown_after_a_rollback_are_published_again():
    from pdserve.engine.core.kv_cache_manager import KVCacheManager
    from pdserve.engine.core.request import Request
    from pdserve.engine.sampling_params import SamplingParams

    kv = KVCacheManager(16, 4)
    req = Request("r", list(range(12)), SamplingParams(max_tokens=8))
    kv.allocate_slots(req, 12)
    kv.cache_blocks(req, 12)
    assert kv.req_published["r"] == 3
    kv.rollback(req, 4)  # keeps one block: the cursor follows
    assert kv.req_published["r"] == 1
    req.num_computed_tokens = 4
    kv.allocate_slots(req, 8)
    kv.cache_blocks(req, 12)
    assert kv.req_published["r"] == 3
    assert kv.gpu_run(kv.block_hashes(req)) == 3  # every full block is in the prefix cache
