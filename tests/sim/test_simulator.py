"""The capacity simulator runs the cluster's own placement and the engine's own scheduler."""

import pathlib

import pytest

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


def test_plan_ranks_the_layouts_of_n_gpus_and_names_the_closest_when_none_meets_the_slo(capsys):
    """`pdserve plan --gpus 2 --profile P`: colocated:2, disagg:1:1 and hybrid:1:1 simulated on the
    workload, ranked by predicted goodput, the best named; an SLO no layout meets is one line naming
    the closest layout (exit 1); a malformed --slo is one line naming the flag (exit 2)."""
    from pdserve.cli import main
    from pdserve.sim.layouts import candidates

    assert candidates(2) == ["colocated:2", "disagg:1:1", "hybrid:1:1"]
    assert candidates(64)[0] == "colocated:64" and len(candidates(64)) == 11
    base = ["plan", "--gpus", "2", "--profile", str(PROFILES / "llama3-8b.json"), "--prompt-len", "512",
            "--output-len", "8", "--num-requests", "20"]
    assert main(base) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "req/s" not in line
            and "layout" not in line]
    assert {r.split("|")[1].strip() for r in rows} == {"colocated:2", "disagg:1:1", "hybrid:1:1"}
    goodputs = [float(r.split("|")[2]) for r in rows]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > 0
    assert f"recommended: {rows[0].split('|')[1].strip()}" in out

    assert main([*base, "--slo", "ttft=0.001,tpot=0.0001"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("pdserve plan: no layout of 2 GPUs meets TTFT <= 0.001 s") and "the closest: " in last

    assert main([*base, "--slo", "ttft=fast"]) == 2
    assert "--slo takes ttft=SECONDS,tpot=SECONDS" in capsys.readouterr().err


def test_a_rate_that_misses_is_given_up_early_and_one_that_meets_runs_whole():
    """The capacity search stops a rate once its attainment is sure to miss 90%: the same verdict
    as the whole run at both rates, the run that meets unchanged, the one that misses cut short."""
    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    whole = predict(p, "colocated:1", ARGV)["runs"]
    cut = predict(p, "colocated:1", ARGV, give_up_below=0.9)["runs"]
    assert whole[0]["slo_attainment"] == cut[0]["slo_attainment"] >= 0.9
    assert whole[0]["duration_s"] == cut[0]["duration_s"]
    assert whole[1]["slo_attainment"] < 0.9 and cut[1]["slo_attainment"] < 0.9
    assert cut[1]["duration_s"] < whole[1]["duration_s"]
    assert cut[1]["completed"] < whole[1]["completed"] == 40


def test_layouts_searched_in_processes_rank_as_in_one():
    from pdserve.sim.layouts import recommend

    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    argv = ["--workload", "synthetic", "--input-len", "4096", "--output-len", "16", "--slo-ttft", "1.0",
            "--slo-tpot", "0.04", "--seed", "0"]
    def found(ranked):  # each search's start follows the layouts done before it: the probes it took differ
        return [(c.system, c.rps, c.attainment, c.rate) for c in ranked]

    assert found(recommend(p, 2, argv, 20, jobs=2)) == found(recommend(p, 2, argv, 20, jobs=1))


def test_a_search_in_processes_from_a_ray_driver_leaves_its_ray_working(shared_ray):
    """In a process that runs a Ray driver (a pytest worker after a cluster test, a notebook) the
    search's processes do not fork it: its gRPC state does not survive a fork. The driver reaches
    the GCS afterwards: a lookup of a name no actor holds answers ValueError, not a timeout."""
    import ray

    from pdserve.sim.layouts import pool_context, recommend

    assert ray.is_initialized() and pool_context().get_start_method() != "fork"
    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    argv = ["--workload", "synthetic", "--input-len", "4096", "--output-len", "16", "--slo-ttft", "1.0",
            "--slo-tpot", "0.04", "--seed", "0"]
    assert recommend(p, 2, argv, 20, jobs=2)
    with pytest.raises(ValueError):
        ray.get_actor("no-actor-holds-this-name", namespace="pdserve")


def test_a_search_started_near_its_goodput_finds_the_same_rate_in_fewer_probes():
    """capacity's `start` (where recommend begins a layout: where the layouts before it met their
    SLOs) saves probes and changes nothing else, from below, at, or above the goodput."""
    from pdserve.sim.layouts import capacity, doublings

    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    argv = ["--workload", "synthetic", "--input-len", "4096", "--output-len", "16", "--slo-ttft", "1.0",
            "--slo-tpot", "0.04", "--seed", "0"]
    floor = 0.25
    base = capacity(p, "hybrid:1:1", argv, floor, 20)
    k = doublings(base, floor)
    assert base.meets and k >= 3 and floor * 2 ** k <= base.rps < floor * 2 ** (k + 1)
    for start in (1, k, k + 2):
        c = capacity(p, "hybrid:1:1", argv, floor, 20, start=start)
        assert (c.rps, c.attainment, c.rate) == (base.rps, base.attainment, base.rate), start
        assert c.simulations < base.simulations, (start, c.simulations, base.simulations)
    assert capacity(p, "disagg:1:1", argv, 50.0, 20, start=1).rps == 0.0  # none met: halved down to the floor


def test_past_eight_gpus_a_layout_is_simulated_as_replicas_of_its_slice(capsys, monkeypatch):
    """Past SLICE_MAX GPUs each layout is replicas of its slice, each at 1/replicas of the traffic
    (named at the whole's size, its goodput replicas x the slice's). Shown at 4 GPUs with slices
    of 2 allowed, so the search stays small."""
    from pdserve.cli import main
    from pdserve.sim import layouts
    from pdserve.sim.layouts import capacity, recommend, replicas_of

    assert [replicas_of(n) for n in (2, 8, 12, 16, 61, 64)] == [1, 1, 2, 2, 1, 8]
    assert replicas_of(64, None) == 1 and replicas_of(8, 4) == 2 and replicas_of(4, 2) == 1
    monkeypatch.setattr(layouts, "SLICE_MIN", 2)
    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    argv = ["--workload", "synthetic", "--input-len", "4096", "--output-len", "16", "--slo-ttft", "1.0",
            "--slo-tpot", "0.04", "--seed", "0"]
    ranked = recommend(p, 4, argv, 20, slice_max=2)
    assert sorted(c.system for c in ranked) == ["colocated:4", "disagg:2:2", "hybrid:2:2"]
    colo = next(c for c in ranked if c.system == "colocated:4")
    assert colo.replicas == 2 and colo.slice == "colocated:2"
    alone = capacity(p, "colocated:2", argv, 0.25 * 2, 20)
    assert colo.rps == 2 * alone.rps and colo.rate == 2 * alone.rate

    monkeypatch.setattr(layouts, "SLICE_MAX", 2)
    base = ["plan", "--gpus", "4", "--profile", str(PROFILES / "llama3-8b.json"), "--prompt-len", "4096",
            "--output-len", "16", "--num-requests", "20"]
    assert main(base) == 0
    assert "each layout simulated as 2 replicas of its 2-GPU slice" in capsys.readouterr().out


def test_the_ratio_policy_moves_a_prefill_starved_cluster_to_the_split_its_load_needs():
    """disagg:1:3:adaptive: the live RatioPlanner on the simulated clock, long prompts and short outputs
    (prefill-bound): it moves decode workers to prefill (drained, then switched) and serves a rate that
    static 1:3 misses; each move is logged with its reason, and no request is lost on the way."""
    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    argv = ["--workload", "synthetic", "--input-len", "4096", "--output-len", "32", "--slo-ttft", "1.0",
            "--slo-tpot", "0.04", "--num-requests", "600", "--rates", "10"]
    static = predict(p, "disagg:1:3", argv)["runs"][0]
    moved = predict(p, "disagg:1:3:adaptive", argv)["runs"][0]
    assert moved["completed"] == 600 and "moves" not in static
    tos = [m["to"] for m in moved["moves"]]
    assert tos and tos[0] == "prefill" and all(m["serving"] is None or m["serving"] > m["asked"]
                                                for m in moved["moves"])
    assert "should prefill" in moved["moves"][0]["why"]
    assert moved["slo_attainment"] > static["slo_attainment"] + 0.2, (moved["slo_attainment"], static["slo_attainment"])


def test_an_adaptive_layout_is_disagg_or_hybrid_and_a_switch_takes_the_new_pools_budget_and_target():
    """The ratio policy moves whole-GPU workers of a disagg or hybrid cluster. A worker switching
    pools takes the new pool's step budget and TPOT target, as the live actor's switch_role does:
    a hybrid decode engine prefills beside its decodes in the prefill chunk under the TPOT target;
    a disagg one decodes in 2048-token steps with none; a prefill worker has none."""
    import pytest

    from pdserve.cluster.spec.serving_config import SloConfig
    from pdserve.sim.cluster import COLOCATED_CHUNK, Layout, Simulation

    assert Layout.of("disagg:2:2:adaptive").adaptive and not Layout.of("disagg:2:2").adaptive
    assert Layout.of("hybrid:2:2:adaptive").adaptive
    for system in ("colocated:2:adaptive",):
        with pytest.raises(ValueError, match="moves the workers of a disagg or hybrid cluster"):
            Layout.of(system)
    with pytest.raises(ValueError, match="one GPU each"):
        Layout.of("disagg:1:1:adaptive", one_gpu=True)
    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    for mode, decode_budget, decode_target in (("hybrid", "chunk", 0.04), ("disagg", COLOCATED_CHUNK, None)):
        layout = Layout.of(f"{mode}:1:1:adaptive")
        sim = Simulation(p, layout, SloConfig(2.0, 0.04))
        e = sim.engines["prefill-0"]
        assert e.model.slo_tpot_s is None and e.holds
        e.switch_role("decode", layout, sim.engine_tpot)
        want = layout.prefill_chunk if decode_budget == "chunk" else decode_budget
        assert (e.record.role, e.holds, e.scheduler.max_num_batched_tokens, e.model.max_tokens,
                e.model.slo_tpot_s) == ("decode", False, want, want, decode_target)
        e.switch_role("prefill", layout, sim.engine_tpot)
        assert (e.holds, e.scheduler.max_num_batched_tokens, e.model.slo_tpot_s) == (True, layout.prefill_chunk, None)


def test_the_cpu_validation_runs_rates_apart_and_merges_them_into_one_sweep(tmp_path):
    """bench/plan_validate_cpu.py --profile-each-rate: one live sweep and one prediction per rate, each
    after a profile of its own; the rates merge into one sweep whose goodput is read across them."""
    import importlib.util

    path = PROFILES.parents[1] / "plan_validate_cpu.py"
    spec = importlib.util.spec_from_file_location("plan_validate_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.parser().parse_args(["--rates", "0.5,1", "--profile-each-rate", "--out", str(tmp_path)])
    assert mod.rounds(args) == [("0.5", "_0.5", 0), ("1", "_1", 1)]  # a seed each: no prompt sent twice
    assert mod.rounds(mod.parser().parse_args(["--rates", "0.5,1"])) == [("0.5,1", "", 0)]
    assert mod.bench_argv(args, "1", 1)[-2:] == ["--seed", "1"]
    parts = [{"label": "live", "runs": [{"rate": r, "slo_attainment": a}]} for r, a in ((0.5, 1.0), (1.0, 0.8))]
    whole = mod.merged(parts)
    assert [r["rate"] for r in whole["runs"]] == [0.5, 1.0]
    assert whole["goodput"]["rps"] == pytest.approx(0.75) and not whole["goodput"]["lower_bound"]  # 90%: halfway
