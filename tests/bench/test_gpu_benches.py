"""The GPU benchmarks stay runnable from main on a machine without a GPU as far as they can:
every bench/*_gpu.py imports, parses its command line, and the parts that drive the engine
by hand run on a tiny CPU engine (a bench that rots is caught here, not on a lent GPU)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pathlib
import sys

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
GPU_BENCHES = sorted(p.stem for p in BENCH.glob("*_gpu.py"))


def bench(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def required_args(ap: argparse.ArgumentParser) -> list[str]:
    """A value for each required option (its type's reading of "1", or its first choice)."""
    out = []
    for a in ap._actions:
        if a.required and a.option_strings:
            out += [a.option_strings[0], str(a.choices[0]) if a.choices else "1"]
    return out


def test_every_gpu_bench_is_covered():
    assert len(GPU_BENCHES) >= 15, GPU_BENCHES


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_what_a_bench_imports_of_pdserve_exists_even_where_it_imports_late(script):
    """The imports inside a bench's functions run only on a GPU: each `from pdserve... import
    name` of every bench script names a module and an attribute that exist (a moved module is
    caught here, not on a lent GPU)."""
    import ast
    for node in ast.walk(ast.parse((BENCH / script).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pdserve"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"bench/{script}: from {node.module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pdserve"):
                    importlib.import_module(alias.name)


@pytest.mark.parametrize("name", GPU_BENCHES)
def test_gpu_bench_imports_and_parses_its_command_line(name, capsys):
    mod = bench(name)
    ap = mod.parser()
    args = ap.parse_args(required_args(ap))
    assert vars(args), name
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.fixture(scope="module")
def engine(tiny_models):
    """A tiny CPU engine with overlapped steps (async scheduling, the default)."""
    eng = LLMEngine(EngineConfig(model=tiny_models["llama"], max_model_len=512, max_num_batched_tokens=64,
                                 kv_cache_memory_bytes=8 << 20))
    assert eng.overlaps
    return eng


def test_prefill_prefix_counts_the_chunks_not_the_overlapped_tail(engine):
    """bench/prefill_prefix_gpu.py's chunked prefill: a 256-token prompt in 64-token chunks is
    4 timed steps (the overlapped engine's last step() only resolves the 4th: it was timed as a
    5th "last chunk" of ~0 ms, and last / first read 0.02 on an H200)."""
    prefix = bench("prefill_prefix_gpu")
    engine.add_request(list(range(100, 356)), SamplingParams(max_tokens=1, temperature=0))
    assert len(prefix.steps(engine)) == 4


def test_a_manual_step_over_an_overlapped_engine(engine):
    """What bench/mixed_step_gpu.py does (and an embedding user of LLMEngine may): schedule and
    execute by hand after the engine's own overlapped steps. The runner refuses while a step is
    in flight, naming the way out, instead of sampling from a placeholder token (a device-side
    assert on CUDA); after LLMEngine.resolve() the manual step runs, and the bench resolves
    first itself."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(list(range(200 + i, 230 + i)), params)
    for _ in range(4):
        engine.step()
    assert engine.pending is not None  # a step in flight
    sched = engine.scheduler.schedule()
    with pytest.raises(RuntimeError, match=r"LLMEngine\.resolve\(\)"):
        engine.runner.execute(sched)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.resolve()
    for i in range(3):
        engine.add_request(list(range(300 + i, 330 + i)), params)
    for _ in range(4):
        engine.step()
    mixed = bench("mixed_step_gpu")
    scheduled, dt = mixed.run_step(engine, 0)
    assert len(scheduled) == 3 and dt > 0
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.check_all_free()


def test_mixed_step_variants_reach_the_planner_each_step_reads(engine, monkeypatch):
    """bench/mixed_step_gpu.py --variants times each AttentionTuning: the step it runs must plan its
    attention with that tuning. It set the engine config's field, which the runner had read into
    its planner once at start, so every column measured the default (flat tables on H100 and H200)."""
    mixed = bench("mixed_step_gpu")
    seen = []

    def step(eng, cap):
        seen.append(eng.runner.planner.tuning)  # what runner.forward plans this step's attention with
        return [], 1e-3

    monkeypatch.setattr(mixed, "run_step", step)
    monkeypatch.setattr(mixed, "cache_prefixes", lambda *a: None)
    monkeypatch.setattr(mixed, "ids", lambda n: list(range(100, 100 + min(n, 8))))
    before = engine.runner.planner
    mixed.compare_variants(engine, reps=1, chunks=(64,))
    assert set(seen) == set(mixed.VARIANTS.values())
    assert engine.runner.planner is before  # the engine's own tuning back
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.kv.check_all_free()


def test_tp_bench_times_served_steps_and_leaves_the_engine_empty(engine):
    """bench/tp_gpu.py's served decode: b requests prefilled, then engine.step() timed while they
    decode (overlapped), then aborted: no block is left held for the next batch."""
    t = bench("tp_gpu").served_step(engine, 3, 40, engine.model_config.vocab_size)
    assert t > 0 and not engine.has_unfinished_requests()
    engine.kv.check_all_free()


def test_every_headline_key_names_its_device_and_date():
    """bench/results/summary.json: each key says where and when it was measured (bench/summary.py
    keeps both while a value stands)."""
    import json
    import re

    summary = json.loads((BENCH / "results" / "summary.json").read_text())
    for key, entry in summary.items():
        assert entry.get("device") and re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry.get("date", "")), key


def test_gpu_suite_names_its_groups(tmp_path):
    """bench/gpu_suite.sh parses, and refuses a group it does not have (exit 1, naming it)."""
    import subprocess

    script = BENCH / "gpu_suite.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    r = subprocess.run(["bash", str(script), str(tmp_path), "nosuch"], capture_output=True, text=True)
    assert r.returncode == 1 and "nosuch (unknown)" in r.stderr, r.stderr


def test_suite_ab_refuses_a_commit_it_cannot_check_out(tmp_path):
    """bench/suite_ab.sh parses, and a base that is no commit stops it at once (exit 2, naming it),
    with no worktree left behind."""
    import subprocess

    script = BENCH / "suite_ab.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    before = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, cwd=BENCH).stdout
    r = subprocess.run(["bash", str(script), str(tmp_path), "no-such-commit"], capture_output=True, text=True)
    assert r.returncode == 2 and "no commit no-such-commit" in r.stderr, r.stderr
    assert subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, cwd=BENCH).stdout == before


@pytest.mark.parametrize("system, want", [
    ("hybrid:1:1:tp2", {"prefill_tp": 2, "decode_tp": 2, "mode": "hybrid"}),
    ("disagg:1:1:dtp2", {"prefill_tp": None, "decode_tp": 2, "mode": "disagg"}),
    ("colocated:2:tp2", {"tensor_parallel_size": 2, "mode": "colocated", "decode": 2}),
    ("disagg:2:1:c4096", {"prefill_tp": None, "prefill": 2, "prefill_max_num_batched_tokens": 4096}),
])
def test_serving_bench_servers_are_commands_pdserve_takes(system, want):
    """The servers bench/serving_gpu.py starts, TP workers included: pdserve's own parser takes
    each command as the bench builds it."""
    from pdserve.cli import build_parser

    cmd = bench("serving_gpu").server_cmd(system, "MODEL", 8000)
    args = build_parser().parse_args(cmd[cmd.index("serve"):])
    assert {k: getattr(args, k) for k in want} == want, cmd


def test_every_sweep_on_a_server_has_its_own_seed_and_systems_share_them():
    """A repeat sweep replayed the sweep before it on the same server, so its prefix cache served
    it (100% hits, TTFT 36 ms): each sweep of a server takes its own seed, and the systems' first
    sweeps of each workload take the same ones."""
    plan = bench("serving_gpu").sweeps
    hybrid = plan("hybrid:2:2", "long,trace", "20,trace:40", 2)
    disagg = plan("disagg:2:2", "long,trace", "20,trace:40", 2)
    assert [(wl, t, r) for wl, t, r, _ in hybrid] == [("long", "20", 1), ("long", "20", 2), ("trace", "20", 1),
                                                      ("trace", "20", 2), ("trace", "40", 1), ("trace", "40", 2)]
    assert [(wl, t, r) for wl, t, r, _ in disagg] == [("long", None, 1), ("long", None, 2), ("trace", None, 1),
                                                      ("trace", None, 2)]
    for sweeps in (hybrid, disagg):
        assert len({seed for *_, seed in sweeps}) == len(sweeps)
    first = {(wl, seed) for wl, _, r, seed in disagg}
    assert first <= {(wl, seed) for wl, _, _, seed in hybrid}  # the same prompts, in the same order


def test_a_benchs_model_has_its_shape_when_tok_is_a_whole_model_directory(default_model_dir, tmp_path):
    """TOK given as a model's directory (config.json and weights beside the tokenizer): the bench's
    model keeps the shape it wrote and takes only the tokenizer (a 2-GPU run served SmolLM2-135M
    as "llama3-8b" when TOK's config.json replaced the shape's)."""
    import json

    from pdserve.engine.config import EngineConfig

    out = bench("serving_gpu").build_model(str(tmp_path / "m"), default_model_dir, "llama3-8b")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (4096, 32)
    assert not list((tmp_path / "m").glob("*.safetensors"))
    assert EngineConfig(model=out, device="cpu").resolve(out).model_config.hidden_size == 4096


def test_the_grid_report_reads_the_sweeps_laid_out_per_gpu_count(tmp_path):
    """bench/grid_report.py: a hybrid sweep told its SLO counts at that SLO only, a disagg sweep at
    each SLO from its requests; repeats give a mean and a range; the first rate's gap is read; gzipped
    runs are read like plain ones; a system that met the SLO at every rate is a lower bound, one that
    met it at none is below the lowest rate, and neither gives a ratio that means nothing."""
    import gzip
    import json

    def sweep(path, attainment_by_rate: dict, tpot_s=0.015):
        runs = []
        for rate, ok in attainment_by_rate.items():
            rows = [[0, 4096, 256, 0.5 if i < ok * 100 else 5.0, tpot_s, 9.0] for i in range(100)]
            runs.append({"rate": rate, "slo_attainment": ok, "requests_detail": rows})
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"runs": runs, "goodput": {}})
        if path.suffix == ".gz":
            with gzip.open(path, "wt") as f:
                f.write(text)
        else:
            path.write_text(text)

    g = tmp_path / "runs" / "gpus4"
    sweep(g / "long_colocated-4-t20.json", {8: 1.0, 10: 0.95, 12: 0.5})
    sweep(g / "long_disagg-2-2.json.gz", {8: 1.0, 10: 0.8}, tpot_s=0.030)  # inside 40 ms, outside 20
    sweep(g / "long_hybrid-2-2-t20.json", {8: 0.8, 10: 1.0, 12: 0.9})  # its first sweep: cold at 8
    sweep(g / "long_hybrid-2-2-t20-r2.json", {8: 1.0, 10: 1.0, 12: 0.9})
    sweep(g / "long_hybrid-2-2-t20_status.json", {8: 1.0})  # not a sweep of the grid
    grid = bench("grid_report")
    rows = grid.summarize(grid.collect(str(tmp_path / "runs")))
    t20, t40 = rows
    assert (t20["gpus"], t20["workload"], t20["tpot_ms"], t40["tpot_ms"]) == (4, "long", 20, 40)
    assert t20["colocated"]["rps"] == pytest.approx(10 + 0.05 / 0.45 * 2, abs=1e-3)
    assert t20["disagg"]["rps"] == 0.0 and t40["disagg"]["rps"] == pytest.approx(9.0)
    assert t20["hybrid"]["repeats"] == [0.0, 12.0] and t20["hybrid"]["rps"] == 6.0
    assert t20["first_rate_gap"] == {"hybrid-2-2": 20.0}
    assert t40["hybrid"] is None and "hybrid_vs_best_pure" not in t40
    assert t20["hybrid_vs_best_pure"] == pytest.approx(6.0 / t20["colocated"]["rps"], abs=1e-3)
    assert "hybrid-2-2: 6.00 (0.00-12.00)" in grid.markdown(rows)
    assert "disagg-2-2: < 8 (the lowest rate swept)" in grid.markdown(rows)

    two = tmp_path / "runs" / "gpus2"
    sweep(two / "long_colocated-2-t40.json", {8: 1.0, 10: 0.95})  # met at its top rate: >= 10
    sweep(two / "long_hybrid-2-2-t40.json", {8: 1.0, 10: 1.0})
    rows = grid.summarize(grid.collect(str(tmp_path / "runs")))
    (two40,) = [r for r in rows if r["gpus"] == 2]
    assert two40["colocated"]["lower_bound"] and two40["hybrid"]["lower_bound"]
    assert "hybrid_vs_best_pure" not in two40  # >= 10 against >= 10 says nothing
    assert "colocated-2: >= 10.00" in grid.markdown(rows)

    # a later part of a sweep (its own server, higher rates) extends the curve: >= 10 becomes 13
    sweep(two / "long_colocated-2-t40.p2.json.gz", {10: 0.5, 12: 1.0, 14: 0.5})  # 10 counts once, from part 1
    sweep(two / "long_hybrid-2-2-t40.p2.json", {12: 1.0, 14: 0.9, 16: 0.5})
    rows = grid.summarize(grid.collect(str(tmp_path / "runs")))
    (two40,) = [r for r in rows if r["gpus"] == 2]
    assert two40["colocated"]["rps"] == pytest.approx(12 + 0.1 / 0.5 * 2) and "lower_bound" not in two40["colocated"]
    assert two40["hybrid"]["rps"] == pytest.approx(14 + 0.0 / 0.4 * 2)
    assert two40["hybrid_vs_best_pure"] == pytest.approx(14 / 12.4, abs=1e-3)


def test_every_system_of_the_multi_gpu_grid_is_a_server_pdserve_takes(tmp_path):
    """bench/multi_gpu_grid.sh parses and refuses an unknown part; each system it names is a server
    command pdserve's parser takes (the adaptive one with the ratio policy in its serving config)."""
    import re
    import subprocess

    from pdserve.cli import build_parser
    from pdserve.cluster.spec.serving_config import ServingConfig

    script = BENCH / "multi_gpu_grid.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    check = BENCH / "multi_gpu_check.sh"  # its one-call companion: parses, and names what it needs
    assert subprocess.run(["bash", "-n", str(check)]).returncode == 0
    r = subprocess.run(["bash", str(check)], capture_output=True, text=True)
    assert r.returncode != 0 and "usage: bash bench/multi_gpu_check.sh TOKENIZER_DIR OUT" in r.stderr
    r = subprocess.run(["bash", str(script), str(tmp_path), "nosuch"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown part nosuch" in r.stderr
    systems = {s for line in re.findall(r"\) serve \d+ (\S+) ", script.read_text()) for s in line.split(",")}
    assert {"colocated:4", "hybrid:2:2:adaptive", "hybrid:1:1:tp2"} <= systems
    for system in systems:
        cmd = bench("serving_gpu").server_cmd(system, "MODEL", 8000)
        args = build_parser().parse_args(cmd[cmd.index("serve"):])
        cfg = ServingConfig.from_yaml(args.config)
        assert (cfg.autoscale.enabled and cfg.autoscale.policy == "ratio") == system.endswith("adaptive"), system


@pytest.mark.parametrize("script, args", [
    ("peer_fetch_gpu", ["--tokens", "512"]),
    ("kv_capacity_gpu", ["--requests", "12", "--parts", "concurrency,restart", "--burst", "24"]),
    ("kv_tiers_gpu", ["--tokens", "256"]),
])
def test_a_tier_bench_runs_its_tiny_shape_on_cpu(script, args, tok_dir, tmp_path):
    """The tier benches' `--shape tiny` (their CPU check) runs to its table: its model's positions
    reach the prompts' lengths (the engine refuses a max_model_len past max_position_embeddings)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--shape", "tiny", "--tokenizer", tok_dir,
                        "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "|---|" in r.stdout or "| --- |" in r.stdout, r.stdout[-2000:]


def test_tp_bench_counts_a_moe_ranks_experts_apart(tmp_path, tok_dir):
    """bench/tp_gpu.py's floor for a mixture-of-experts shape: one rank's dense weights plus the
    experts a batch is expected to touch, each at the bytes one local expert holds; its prefill
    FLOPs count a token's top_k experts, not all of them."""
    from helpers import save_hf

    E, k, H, inter, L = 8, 2, 64, 32, 2
    save_hf("qwen3_moe", dict(vocab_size=49152, hidden_size=H, intermediate_size=64, moe_intermediate_size=inter,
                              num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_experts=E, num_experts_per_tok=k, max_position_embeddings=256),
            str(tmp_path), tok_dir)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=128))
    try:
        rank = bench("tp_gpu").RankBytes(eng.runner.model, k, E)
        one = 3 * H * inter * 4  # gate, up and down of one expert, float32
        assert (rank.local, rank.layers, rank.one, rank.expert_bytes) == (E, L, one, L * E * one)
        assert rank.touched(1) == pytest.approx(k) and rank.touched(10 ** 4) == pytest.approx(E)
        dense = rank.weights - rank.expert_bytes
        assert rank.decode_bytes(1) == pytest.approx(dense + L * k * one)
        assert rank.active_params() == pytest.approx((dense + L * k * one) / 4)
    finally:
        eng.close()


def test_sharing_factors_go_only_into_a_profile_of_the_same_card():
    """profile_gpu --sharing wrote one H100's factors into the H200 profile (its source line named
    the H100); now another card's profile is refused."""
    same_card = bench("profile_gpu").same_card
    assert same_card("one H200", "NVIDIA H200") and same_card("one H100", "NVIDIA H100 80GB HBM3")
    assert not same_card("one H200", "NVIDIA H100 80GB HBM3") and not same_card("one H100", "NVIDIA H200")
    assert not same_card("", "NVIDIA H200")
