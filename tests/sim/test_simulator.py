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
