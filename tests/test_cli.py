import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_generate_prints_a_coherent_answer(default_model_dir):
    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "What is the capital of France?",
                          "--max-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


@pytest.mark.slow
def test_generate_reports_bad_input():
    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "hi", "--model", "/no/such/dir"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "does not exist" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--max-tokens" in out.stdout


def test_serve_flags_layer_over_the_serving_config(tmp_path):
    from pdserve.cli import build_parser
    from pdserve.serve_cli import serving_config

    cfg_file = tmp_path / "serving.yaml"
    cfg_file.write_text("decode: {min: 2, max: 6}\nautoscale: {itl_p90_s: 0.2, cooldown_s: 5}\n")
    args = build_parser().parse_args(["serve", "--config", str(cfg_file), "--autoscale", "--max-decode", "4",
                                      "--target-kv-usage", "0.7", "--pool-resources", "on"])
    cfg = serving_config(args).validate()
    assert cfg.autoscale.enabled and cfg.autoscale.kv_usage == 0.7 and cfg.autoscale.itl_p90_s == 0.2
    assert (cfg.decode.min, cfg.decode.max, cfg.decode.replicas) == (2, 4, 2)
    assert cfg.prefill.resources == {"pdserve_prefill": 1} and cfg.decode.resources == {"pdserve_decode": 1}
    assert not serving_config(build_parser().parse_args(["serve"])).autoscale.enabled
    assert serving_config(build_parser().parse_args(["serve"])).handoff.timeout_s == 30
    cfg_file.write_text("handoff: {timeout_s: 90}\n")
    args = ["serve", "--config", str(cfg_file)]
    assert serving_config(build_parser().parse_args(args)).handoff.timeout_s == 90
    assert serving_config(build_parser().parse_args([*args, "--handoff-timeout", "120"])).handoff.timeout_s == 120


@pytest.mark.slow
def test_a_busy_port_and_the_version_answer_in_one_line_before_anything_starts():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = pdserve("serve", "--port", str(s.getsockname()[1]))
    assert out.returncode == 2 and "Address already in use" in out.stderr and "Traceback" not in out.stderr
    assert "serving" not in out.stdout  # refused before any worker started
    assert pdserve("--version").stdout.strip().startswith("pdserve 0.")


def test_a_ray_address_nobody_answers_is_one_line_not_a_hang():
    """`--address` where no Ray head listens: one line naming the address and what to check, exit 2
    (ray.init retried it for minutes, with Ctrl-C and SIGTERM held until it gave up)."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = pdserve("serve", "--address", f"127.0.0.1:{port}", "--port", "0")
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"pdserve: error: cannot reach the Ray cluster at 127.0.0.1:{port}" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "serving" not in out.stdout


def test_serve_refuses_a_bad_serving_config(tmp_path):
    cfg_file = tmp_path / "serving.yaml"
    cfg_file.write_text("autoscale: {kv_usage: 3}\n")
    out = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--config", str(cfg_file)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "kv_usage" in out.stderr


def test_serve_refuses_pools_whose_memory_shares_overfill_a_gpu(tmp_path):
    """Workers that share a GPU (fractional num_gpus) each claim gpu_memory_utilization of it:
    shares past 1.0 are refused in one line before any worker starts."""
    cfg_file = tmp_path / "serving.yaml"
    cfg_file.write_text("prefill: {num_gpus: 0.5}\ndecode: {num_gpus: 0.5}\n")
    out = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--config", str(cfg_file),
                          "--gpu-memory-utilization", "0.6"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "pdserve: error: GPU memory shares add up past 1.0 on one GPU: 1 prefill worker (num_gpus 0.5, "
        "--gpu-memory-utilization 0.6) + 1 decode worker (num_gpus 0.5, --gpu-memory-utilization 0.6) = 1.20 of its "
        "memory; --gpu-memory-utilization is each worker's own share: lower it so the workers one GPU holds add up "
        "to at most 1"]


@pytest.mark.slow
def test_serve_refuses_a_decode_worker_whose_kv_room_cannot_hold_its_batch(default_model_dir):
    """A real cluster (Ray, the default model): 32 MiB of KV hold 45 blocks, 2 sequences of 256
    tokens, against a decode batch of 8. The decode worker refuses in one line with the numbers,
    in the flags' words, and the server stops before serving (exit 2, no traceback)."""
    out = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--port", "0", "--kv-cache-memory-bytes",
                          str(32 << 20), "--max-num-seqs", "8", "--decode-batch-len", "256"],
                         capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stderr.splitlines() if line.startswith("pdserve: error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr and "serving" not in out.stdout, out.stderr
    assert errors == ["pdserve: error: decode worker: --decode-batch-len 256: this worker's KV room, 45 blocks of 16 "
                      "= 720 tokens, holds 2 sequences of 256 tokens, fewer than its decode batch (--max-num-seqs 8): "
                      "lower --max-num-seqs to 2, or give the worker more room (--gpu-memory-utilization, more GPUs "
                      "by --tensor-parallel-size, a smaller --kv-cache-dtype)"], out.stderr


def test_prefill_pool_chunk_budget():
    from pdserve.cli import build_parser
    from pdserve.cli_common import engine_kwargs
    from pdserve.cluster.spec.engine_specs import PREFILL_CHUNK_TOKENS, prefill_pool_args
    from pdserve.serve_cli import prefill_engine_kwargs

    args = build_parser().parse_args(["serve"])
    assert prefill_pool_args(engine_kwargs(args), prefill_engine_kwargs(args))["max_num_batched_tokens"] == \
        PREFILL_CHUNK_TOKENS == 8192
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "1024"])  # both pools
    assert prefill_pool_args(engine_kwargs(args), prefill_engine_kwargs(args))["max_num_batched_tokens"] == 1024
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "1024",
                                      "--prefill-max-num-batched-tokens", "4096"])
    assert engine_kwargs(args)["max_num_batched_tokens"] == 1024  # the decode pool keeps its own
    assert prefill_pool_args(engine_kwargs(args), prefill_engine_kwargs(args))["max_num_batched_tokens"] == 4096


def test_fused_ops_flag_defaults_to_the_engine(default_model_dir):
    from pdserve.cli import build_parser
    from pdserve.cli_common import engine_kwargs
    from pdserve.engine.config import EngineConfig

    parse = build_parser().parse_args
    assert engine_kwargs(parse(["serve"]))["fused_ops"] is None  # auto: the engine decides
    assert engine_kwargs(parse(["serve", "--fused-ops"]))["fused_ops"] is True
    assert engine_kwargs(parse(["serve", "--no-fused-ops"]))["fused_ops"] is False
    # auto is on only where Triton runs on CUDA: off on CPU, even with the interpreter's Triton backend
    assert EngineConfig(device="cpu").resolve(default_model_dir).fused_ops is False
    assert EngineConfig(device="cpu", attention_backend="triton").resolve(default_model_dir).fused_ops is False


def test_the_disk_tier_flags_reach_the_engine_and_a_bad_pair_is_refused(default_model_dir):
    from pdserve.cli import build_parser
    from pdserve.cli_common import engine_kwargs
    from pdserve.engine.config import EngineConfig

    kw = engine_kwargs(build_parser().parse_args(["serve", "--kv-offloading-size", "1", "--kv-disk-dir", "/d",
                                                  "--kv-disk-size", "2.5"]))
    assert (kw["kv_offloading_size"], kw["kv_disk_dir"], kw["kv_disk_size"]) == (1.0, "/d", 2.5)
    with pytest.raises(ValueError, match="set kv_offloading_size"):
        EngineConfig(device="cpu", kv_disk_dir="/d", kv_disk_size=1.0).resolve(default_model_dir)


def test_kv_directories_are_checked_before_any_worker_starts(tmp_path):
    """An uncreatable --kv-disk-dir (or --kv-persist-dir) is one line naming the flag, exit 2,
    before any worker starts (it was a 71-line traceback from the workers); --kv-disk-size alone
    is refused instead of ignored."""
    import os
    import time

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for flag in ("--kv-disk-dir", "--kv-persist-dir"):
        t = time.monotonic()
        out = pdserve("serve", "--port", "0", "--kv-offloading-size", "0.05", flag, str(blocker / "sub"),
                      *(["--kv-disk-size", "1"] if flag == "--kv-disk-dir" else []),
                      env={"RAY_AUTH_MODE": "disabled"})
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert f"{flag} {blocker / 'sub'}: cannot create or write it" in out.stderr
        assert time.monotonic() - t < 60  # no cluster was started
    out = pdserve("generate", "hi", "--kv-offloading-size", "0.05", "--kv-disk-size", "1")
    assert out.returncode == 2 and "--kv-disk-size 1 needs --kv-disk-dir DIR" in out.stderr
    fresh = tmp_path / "new" / "tier"
    from pdserve.cli import build_parser
    from pdserve.cli_common import check_kv_dirs

    check_kv_dirs(build_parser().parse_args(["serve", "--kv-disk-dir", str(fresh), "--kv-disk-size", "1"]))
    assert fresh.is_dir() and os.listdir(fresh) == []  # made, written, left empty


def pdserve(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_cli_errors_are_one_line_and_exit_2(capsys):
    """In-process (main() is what the console script runs), and one case as a real process."""
    from pdserve.cli import main

    out = pdserve("status", "--url", "http://127.0.0.1:9")
    assert out.returncode == 2 and out.stderr.startswith("pdserve: error: no pdserve server at http://127.0.0.1:9")
    assert len(out.stderr.strip().splitlines()) == 1
    for args, expect in ((("scale",), "give --prefill N and/or --decode M"),
                         (("scale", "--decode", "2", "--url", "http://127.0.0.1:9"), "no pdserve server at"),
                         (("status", "--url", "http://127.0.0.1:9"), "no pdserve server at http://127.0.0.1:9"),
                         (("serve", "--enable-auto-tool-choice"), "--tool-call-parser NAME go together"),
                         (("serve", "--max-model-len", "10100"),  # the default model has 8192 positions
                          "exceeds the model's max_position_embeddings (8192)"),
                         (("serve", "--config", "nope.yaml"), "cannot read the serving config nope.yaml"),
                         (("serve", "--port", "99999"), "--port must be in 0..65535"),
                         (("serve", "--prefill", "0"), "--prefill must be >= 1, got 0"),
                         (("serve", "--handoff-timeout", "0"), "handoff.timeout_s must be a number > 0"),
                         (("plan", "--prompt-len", "100", "--output-len", "10"), "give the GPU: --gpu NAME")):
        assert main(list(args)) == 2, args
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1, (args, err)


def test_engine_flags_are_made_from_the_settings_fields(monkeypatch):
    """Each engine setting with a Flag is one flag of `generate` and `serve` with the field's
    default, its value reaches the engine under the field's name, and a refusal names it as the
    flag; a setting added to a group is all it takes (shown with a group made here)."""
    import dataclasses

    from pdserve.cli import build_parser
    from pdserve.cli_common import engine_kwargs, in_flags
    from pdserve.engine import settings
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.settings import Flag, setting

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    flagged = [(f.name, f.metadata["flag"]) for f in fields.values() if "flag" in f.metadata]
    assert len(flagged) >= 28 and {"max_num_seqs", "kv_persist_interval_s", "fused_ops"} <= dict(flagged).keys()
    for command in ("generate", "serve"):
        base = [command, "hi"] if command == "generate" else [command]
        kw = engine_kwargs(build_parser().parse_args(base))
        for key, flag in flagged:
            assert (key in kw) == (not flag.given_only), key  # given_only: absent until given
            if key in kw:
                assert kw[key] == fields[key].default, key
    kw = engine_kwargs(build_parser().parse_args(["serve", "--kv-persist-interval", "5", "-tp", "2",
                                                  "--max-num-seqs", "7", "--no-async-scheduling"]))
    assert (kw["kv_persist_interval_s"], kw["tensor_parallel_size"], kw["max_num_seqs"], kw["async_scheduling"]) \
        == (5.0, 2, 7, False)
    assert EngineConfig.from_kwargs(**kw).max_num_seqs == 7
    assert in_flags("kv_persist_interval_s must be > 0") == "--kv-persist-interval must be > 0"

    @dataclasses.dataclass
    class Extra(settings._Group):
        new_knob_tokens: int = setting(3, flag=Flag("a knob a test adds", kind="int"))

    monkeypatch.setattr(settings, "GROUPS", (*settings.GROUPS, Extra))
    args = build_parser().parse_args(["serve", "--new-knob-tokens", "9"])
    assert engine_kwargs(args)["new_knob_tokens"] == 9
    assert in_flags("new_knob_tokens must be even") == "--new-knob-tokens must be even"


def test_engine_refusals_name_the_flags_typed(capsys, tmp_path):
    """The engine's refusals name the flag the user typed, not the engine keyword behind it, and
    a flag not given is never quoted as "got 0.0" (--kv-disk-dir without --kv-disk-size)."""
    from pdserve.cli import main

    kvd = str(tmp_path / "kvd")
    for args, expect in ((("serve", "--kv-disk-dir", kvd, "--kv-disk-size", "1"),
                          "--kv-disk-dir sits behind the host tier: set --kv-offloading-size (GiB) too"),
                         (("serve", "--kv-offloading-size", "1", "--kv-disk-dir", kvd),
                          f"--kv-disk-dir {kvd} needs --kv-disk-size GiB"),
                         (("serve", "--mode", "colocated", "--kv-window-tokens", "2048", "--max-num-batched-tokens",
                           "8192"), "lower --kv-window-tokens or --max-num-batched-tokens")):
        assert main(list(args)) == 2, args
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1 and "got 0.0" not in err, (args, err)
        assert "kv_offloading_size" not in err and "max_num_batched_tokens" not in err, err


def test_help_shows_defaults():
    text = pdserve("serve", "--help").stdout
    assert "--host HOST           default: 127.0.0.1" in text and "default: 8000" in " ".join(text.split())
    assert "(default: hybrid)" in " ".join(text.split())
    assert "(default: 256)" in text  # an option with help keeps it and gains the default
    assert "(default: None)" not in text
    assert all(" ".join(o.split()).count("default:") <= 1 for o in text.split("\n  -"))  # once per option


def test_tensor_parallel_flags_and_config_keys(tmp_path):
    from pdserve.cli import build_parser
    from pdserve.cli_common import engine_kwargs
    from pdserve.cluster.spec.serving_config import ServingConfig
    from pdserve.serve_cli import serving_config

    cfg_file = tmp_path / "serving.yaml"
    cfg_file.write_text("prefill: {tensor_parallel_size: 4}\ndecode: {tensor_parallel_size: 1}\n")
    args = build_parser().parse_args(["serve", "--config", str(cfg_file), "--decode-tp", "2", "-tp", "8"])
    cfg = serving_config(args).validate()
    assert (cfg.prefill.tensor_parallel_size, cfg.decode.tensor_parallel_size) == (4, 2)
    assert engine_kwargs(args)["tensor_parallel_size"] == 8  # what a pool without its own size takes
    try:
        ServingConfig.from_dict({"decode": {"tensor_parallel_size": 0}})
    except ValueError as e:
        assert "decode: tensor_parallel_size must be >= 1, got 0" in str(e)
    else:
        raise AssertionError("tensor_parallel_size 0 was accepted")


@pytest.mark.slow
def test_generate_with_tensor_parallelism_prints_tp1s_text(tiny_models):
    def run(tp: str) -> str:
        out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "Once upon a time", "--model",
                              tiny_models["llama"], "--no-chat", "--max-tokens", "8", "-tp", tp],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert run("2") == run("1")
    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "hi", "--model", tiny_models["llama"],
                          "-tp", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--tensor-parallel-size 3 must divide the model's 4 attention heads" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_the_server_without_replacing_its_workers(tiny_models, sig):
    """Ctrl-C reaches the whole process group, workers included: the server ends them, and its
    monitor does not take them for failures to purge and replace; SIGTERM stops it the same way
    (exit 0, no traceback). With --port 0 its serving line names the port the OS chose, printed
    once that port is bound."""
    import os
    import signal
    import time
    import urllib.request

    from helpers import group_processes, listening_sockets, serving_port

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model", tiny_models["llama"], "--mode",
                             "colocated", "--decode", "1", "--max-model-len", "128", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own group: the signal reaches only what it started
    try:
        port = serving_port(proc)  # --port 0: the line names the port the OS chose, once it is bound
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:  # no retry: it listens
            assert r.status == 200
        time.sleep(3)  # the monitor has seen the worker
        if sig == "SIGINT":  # the Ray it started for itself, its workers and the router: on loopback only
            listening = listening_sockets(proc.pid)
            assert {"gcs_server", "raylet"} <= {name for _, _, name in listening}, listening
            assert all(ip == "127.0.0.1" for ip, _, _ in listening), listening
        os.killpg(proc.pid, getattr(signal, sig)) if sig == "SIGINT" else proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "purging and replacing" not in err and "Traceback" not in err, err[-2000:]
    # nothing of its own is left running: the Ray it started, that Ray's agents and workers (stopped
    # together, local_ray.shutdown_own_ray, within STOP_GRACE_S of its end). An agent that exited with
    # the raylet may still be a zombie for a moment, until init reaps it: that one has ended
    assert not group_processes(proc.pid), f"outlived the server: {group_processes(proc.pid)}"
    # the start showed its stages, each worker as it became ready
    for stage in ("config and tokenizer read (max_model_len 128)", "starting a local Ray cluster",
                  "starting 1 decode worker(s); each loads the model", "decode worker w0-"):
        assert stage in err, err[-2000:]
    assert re.search(r"decode worker w0-\w+ ready \([\d.]+ s: load [\d.]+ s", err), err[-2000:]  # what the start took


@pytest.mark.slow
def test_a_killed_server_leaves_no_process_of_the_ray_it_started(tiny_models):
    """SIGKILL of the server process alone, so no handler of its runs: the Ray it started for
    itself ends with it, that Ray's agents and workers too (cluster/health/reaper.py; the agents outlived
    a killed server by minutes), within the reaper's own bound."""
    import os
    import signal
    import time

    from pdserve.cluster.health import reaper

    from helpers import group_processes, serving_port

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model", tiny_models["llama"], "--mode",
                             "colocated", "--decode", "1", "--max-model-len", "128", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        serving_port(proc)
        started = group_processes(proc.pid)
        assert any(name == "raylet" for name in started.values()) and any(
            name.startswith("ray::") for name in started.values()), started
        # none of the head processes its Ray does not use (local_ray.UNUSED_HEAD_PROCESSES): ~1.4 s of CPU
        # each start, and their polling after
        scripts = {pid: _cmdline(pid) for pid in started}
        unused = ("log_monitor.py", "autoscaler/_private/monitor.py", "dashboard/dashboard.py")
        assert not [c for c in scripts.values() if any(u in c for u in unused)], scripts
        proc.kill()  # the server alone, not its group
        proc.wait(30)
        deadline = time.monotonic() + 5 * (reaper.TRACK_S + reaper.GRACE_S)
        while group_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_processes(proc.pid), f"left running: {group_processes(proc.pid)}"
    finally:
        if group_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def test_argparse_refusals_are_one_line():
    """argparse's own refusals (a bad choice, a missing value, an unknown option): one line naming
    the problem and where the options are, not the whole usage first."""
    for args, expect in ((("serve", "--mode", "hybird"), "invalid choice: 'hybird'"),
                         (("serve", "--port"), "expected one argument"),
                         (("generate", "hi", "--no-such-flag"), "unrecognized arguments: --no-such-flag")):
        out = pdserve(*args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and expect in lines[0], (args, out.stderr)
        assert "--help" in lines[0]


def test_generate_help_names_no_default_for_no_chat():
    opts = [" ".join(o.split()) for o in pdserve("generate", "--help").stdout.split("\n  -")]
    no_chat = next(o for o in opts if o.startswith("-no-chat"))
    assert no_chat == "-no-chat prompts as plain text, without the chat template", no_chat


def test_the_window_command_of_the_docs_passes_the_pools_checks(default_model_dir):
    """docs/kv-cache.md's `pdserve serve --mode colocated --kv-window-tokens 2048 --kv-sink-tokens 4`
    was refused: colocated has no prefill pool, yet its 8192-token chunk budget was checked against
    the window. Colocated checks its one pool; disagg still refuses the window by name."""
    from pdserve.cli import build_parser
    from pdserve.cli_common import engine_kwargs
    from pdserve.cluster.spec.engine_specs import EngineSpecs
    from pdserve.cluster.spec.serving_config import ServingConfig

    args = build_parser().parse_args(["serve", "--mode", "colocated", "--kv-window-tokens", "2048",
                                      "--kv-sink-tokens", "4"])
    kw = {**engine_kwargs(args), "model": default_model_dir}
    specs = EngineSpecs.of(ServingConfig(), "colocated", kw)
    assert specs.decode.kv_window_tokens == 2048 and specs.prefill is None
    with pytest.raises(ValueError, match="kv_window_tokens 2048"):
        EngineSpecs.of(ServingConfig(), "disagg", kw)


@pytest.mark.slow
@pytest.mark.parametrize("sig,when", [("SIGINT", "ray"), ("SIGTERM", "ray"), ("SIGINT", "imports")])
def test_a_signal_while_the_server_starts_stops_it_cleanly(tiny_models, sig, when):
    """A server started with SIGINT ignored (what a script's `pdserve serve ... &` does) stops on
    Ctrl-C while it is still starting, as uvicorn and Ray's CLI do; SIGTERM then too, without
    Ray's crash dump: exit 0, no traceback, nothing left of the process group. `imports`: Ctrl-C
    as soon as the process catches SIGINT (its handler is the first thing `pdserve serve` installs),
    while it still imports what it runs on: a handler installed after those imports (5-13 s on a
    loaded host) lost a Ctrl-C sent at 1 s, and the server went on to serve."""
    import os
    import signal
    import time

    from helpers import _group_alive

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model", tiny_models["llama"], "--mode",
                             "colocated", "--decode", "1", "--max-model-len", "128", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 120
        seen = ""
        # inside ray.init, as the driver connects: the window where Ray's C++ crash handler took the
        # signal and the process, though it printed that it stopped, aborted at exit (-6)
        while when == "ray" and "Started a local Ray instance" not in seen:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, seen[-2000:]
            seen += line
        while when == "imports" and not _catches(proc.pid, signal.SIGINT):
            assert proc.poll() is None and time.monotonic() < deadline, "SIGINT never caught"
            time.sleep(0.01)
        if when == "imports":  # caught before torch loaded: the Ctrl-C comes while the heavy imports run
            assert "libtorch" not in open(f"/proc/{proc.pid}/maps").read(), "SIGINT caught only once torch loaded"
        time.sleep(0.08 if when == "ray" else 0.0)
        os.kill(proc.pid, getattr(signal, sig))
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = seen + err
    assert proc.returncode == 0, err[-3000:]
    assert "pdserve: serving" not in out and "Traceback" not in err and "Aborted" not in err, err[-3000:]
    assert "received at time" not in err, err[-3000:]  # Ray's crash dump
    if when == "imports":
        assert "stopped before serving" in err and "Started a local Ray" not in err, err[-3000:]
    deadline = time.monotonic() + 60
    while _group_alive(proc.pid):  # the workers and the Ray it started end with it
        assert time.monotonic() < deadline, "processes of the server outlived it"
        time.sleep(0.5)


def test_a_start_broken_off_by_a_signal_as_another_error_is_a_stop(tiny_models, monkeypatch, capsys):
    """SIGTERM while the cluster starts raises KeyboardInterrupt where the main thread is; inside an
    import that Ray's Cython code runs (its first serialization context importing pydantic.v1 as
    the registry actor is created) that came out as `TypeError: expected a message argument`, and
    the server exited 1 with a traceback (CI, test_a_signal_while_the_server_starts_stops_it_cleanly
    [SIGTERM-ray]). The real signal and handler here; the start that turns the interrupt into
    another error stands in for that import. After a stop signal a failed start is a stop: exit 0,
    one line."""
    import os
    import signal
    import time

    import pdserve.cluster
    from pdserve import serve_cli
    from pdserve.cli import build_parser

    class BrokenOff:
        def __init__(self, spec, progress=None):
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # serve's handler: KeyboardInterrupt at the next bytecode
                time.sleep(5)
            except KeyboardInterrupt:
                raise TypeError("expected a message argument") from None

    monkeypatch.setattr(pdserve.cluster, "Cluster", BrokenOff)
    monkeypatch.setattr(serve_cli, "STOPS", [])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        args = build_parser().parse_args(["serve", "--model", tiny_models["llama"], "--port", "0"])
        assert serve_cli.cmd_serve(args) == 0
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    assert "stopped before serving (TypeError" in capsys.readouterr().err


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler of its own for `sig` (SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (sig - 1) & 1)


def test_a_model_directory_without_tokenizer_files_is_refused_naming_them(tmp_path):
    """A model saved with save_pretrained alone (no tokenizer files) was served with an empty
    tokenizer: every prompt tokenized to nothing. It is refused at start, in one line."""
    from helpers import save_hf

    empty = tmp_path / "no-tokenizer-here"
    empty.mkdir()
    model = save_hf("llama", dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1), str(tmp_path / "m"), str(empty))
    del model
    out = pdserve("generate", "hello", "--model", str(tmp_path / "m"), "--max-tokens", "2")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "has no tokenizer files (none of tokenizer.json, tokenizer.model" in out.stderr


@pytest.mark.slow
def test_a_server_that_fails_once_its_workers_are_up_stops_them_and_names_the_cause(tiny_models, tmp_path):
    """The router failing to build after the workers started (here swagger-ui-bundle, one of its
    dependencies, missing: a machine that installed pdserve's wheel without them) ends the server
    with that error, exit 1, and stops what it started; the stop raised UnboundLocalError over it
    and left the cluster to the reaper."""
    import os
    import signal
    import time

    from helpers import group_processes

    missing = "raise ModuleNotFoundError(\"No module named 'swagger_ui_bundle'\")\n"
    (tmp_path / "swagger_ui_bundle.py").write_text(missing)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model", tiny_models["llama"], "--mode",
                             "colocated", "--decode", "1", "--max-model-len", "128", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and "ready" in err, err[-3000:]
    assert "No module named 'swagger_ui_bundle'" in err and "UnboundLocalError" not in err, err[-3000:]
    assert "pdserve: serving" not in out
    deadline = time.monotonic() + 15
    while group_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_processes(proc.pid), f"left running: {group_processes(proc.pid)}"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""
