"""Shared fixtures: the default model's directory and tiny random Llama-family models
saved to temp dirs (so the real loading path is what tests exercise)."""

from __future__ import annotations

import faulthandler
import os
import time

import pytest
import torch
from _pytest.faulthandler import fault_handler_stderr_fd_key

# On CPU the Triton kernels run under Triton's interpreter; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `-n 2` on 2 cores: each test process one torch thread. Two processes of two threads each
# (torch's default) made engine tests 10-20x slower than alone (OpenMP threads spinning on a
# core the other process holds): test_seeded_sampling_is_reproducible took 36 s instead of 2 s.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    # ... and the processes tests start (benches' tiny shapes, docs' `LLM(` blocks, servers): the
    # tiny kv_capacity bench took 66 s beside one busy core with torch's two threads, 37 s with one
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from helpers import save_tiny


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """Every thread's Python stack on the real stderr if the test process dies of a signal (SIGABRT
    from native code, SIGSEGV): ray.init installs its own handler for those, which logs only program
    counters to a file, so pytest's faulthandler is put back in front of it (it chains to Ray's)."""
    fd = item.config.stash.get(fault_handler_stderr_fd_key, None)
    if fd is not None:
        faulthandler.enable(file=fd, all_threads=True)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from pdserve.engine.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, request) -> dict[str, str]:
    # PDSERVE_TEST_TOKENIZER: a directory with just tokenizer files, for machines that
    # cannot convert the default model (no gguf package)
    tok_dir = os.environ.get("PDSERVE_TEST_TOKENIZER") or request.getfixturevalue("default_model_dir")
    root = tmp_path_factory.mktemp("tiny")
    return {k: save_tiny(k, str(root / k), tok_dir) for k in ("llama", "qwen2", "mistral", "llama_hd32")}


@pytest.fixture(scope="module")
def tok_dir(request) -> str:
    """Tokenizer files for tiny random models (PDSERVE_TEST_TOKENIZER, else the default model's)."""
    return os.environ.get("PDSERVE_TEST_TOKENIZER") or request.getfixturevalue("default_model_dir")


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray per test process (an xdist worker), started on first use and left running:
    a Ray start and stop costs ~5 s on 2 cores, and ~25 cluster tests each paid it. A
    `Cluster` joins the Ray its process runs and leaves it running when it shuts down."""
    import ray

    from pdserve.cluster.health.local_ray import ray_init_options, ray_on_loopback

    if not ray.is_initialized():
        with ray_on_loopback():  # as pdserve starts its own: nothing listens beyond this machine
            ray.init(address="local", namespace="pdserve", **ray_init_options())


@pytest.fixture
def own_ray():
    """For tests of how a `Cluster` starts or joins a Ray: none runs in this process."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


# The longest files first (`--durations=0` summed per file on 2 cores, 2026-12-07: 255 s down to
# 31 s, every file of 30 s or more): scripts/test.sh runs `-n 2 --dist loadfile
# --no-loadscope-reorder`, which hands out files in collection order, and one of these started last
# kept the other worker idle for minutes. The rest keep their order.
LONGEST_FIRST = ("test_faults.py", "test_docs.py", "test_hosts.py", "test_cli.py", "test_openai_parity.py",
                 "test_cluster.py", "test_spec_decode.py", "test_deepseek.py", "test_serve_models.py",
                 "test_triton_prefill.py", "test_moe_cluster.py", "test_ray_up.py", "test_hybrid.py",
                 "test_correctness_hf.py", "test_prefill_decode_roles.py", "test_offload_cluster.py",
                 "test_triton_moe.py", "test_autoscale_policy.py", "test_simulator.py", "test_fp8_checkpoints.py",
                 "test_vllm_clients.py", "test_router.py", "test_fake_multinode.py", "test_triton_attention.py",
                 "test_aborts.py", "test_worker_grammar.py", "test_models_hf.py", "test_ratio.py",
                 "test_graph_layouts.py", "test_c10d_transfer.py", "test_tensor_parallel.py", "test_gpu_benches.py",
                 "test_bench.py", "test_tensor_parallel_cluster.py", "test_engine.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With PDSERVE_TEST_TIMELINE=FILE, each test's process, file, start and end (wall seconds) go
    to FILE, one line each: which files ran beside which, to set LONGEST_FIRST's order by."""
    path = os.environ.get("PDSERVE_TEST_TIMELINE")
    t0 = time.time()
    yield
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {item.path.name} {t0:.2f} {time.time():.2f}\n")
