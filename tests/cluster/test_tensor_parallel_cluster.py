"""Tensor-parallel workers in the real cluster (Ray actors in placement groups, gloo):
handoffs between prefill and decode pools of different TP sizes give `LLM`'s tokens,
the registry sees one worker per TP group, and a dead rank takes its worker out."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster
from pdserve.cluster.records import DecodeCall

from helpers import PROMPTS, role_of

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # a real-model or multi-actor cluster per module

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS8 = PROMPTS[:4] + [p + " And then, in more words than before, explain." for p in PROMPTS[:4]]


def reference(model: str, **kw) -> list[list[int]]:
    with LLM(model, max_model_len=512, **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS8, GREEDY)]


def no_request_blocks(cluster: Cluster) -> None:
    for row in cluster.status():
        assert row["request_blocks"] == 0 and row["inflight"] == 0, row


@pytest.fixture(scope="module")
def p1_d2(tiny_models, shared_ray):
    c = Cluster.start(tiny_models["llama"], prefill=1, decode=1, prefill_tp=1, decode_tp=2, max_model_len=512)
    yield c
    c.shutdown()


def test_prefill_tp1_to_decode_tp2_equals_llm(p1_d2, tiny_models):
    outs = p1_d2.generate(PROMPTS8, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference(tiny_models["llama"])
    assert all(role_of(p1_d2, o.decode_worker) == "decode" and role_of(p1_d2, o.prefill_worker) == "prefill"
               for o in outs)
    rows = {r["worker_id"]: r for r in p1_d2.status()}
    assert sorted(r["tensor_parallel_size"] for r in rows.values()) == [1, 2]
    # the registry and routing see one worker per TP group, its ranks are its own actors
    assert {w.worker_id for w in p1_d2.registry_workers()} == set(rows)
    dec = next(w for w in rows if rows[w]["role"] == "decode")
    assert ray.get(ray.get_actor(f"{dec}#1", namespace="pdserve").address.remote())
    no_request_blocks(p1_d2)


def test_a_killed_rank_takes_its_worker_out_and_it_is_replaced(p1_d2):
    dec = next(w for w in p1_d2.workers if role_of(p1_d2, w) == "decode")
    long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    outs: list = []

    def one(i: int) -> None:
        try:
            outs.append(p1_d2.generate(f"Story {i}: once", long)[0])
        except RuntimeError as e:  # the retry found no live decode worker: the pool's only one is refilling
            outs.append(e)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for _ in range(300):
        if any(r.get("num_running", 0) for r in p1_d2.status() if r["worker_id"] == dec):
            break
        time.sleep(0.05)
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(f"{dec}#1", namespace="pdserve"))
    for t in ts:
        t.join(240)
    assert len(outs) == 3  # none hangs: each finished, or failed with the worker's death as its reason
    for o in outs:
        if isinstance(o, RuntimeError):
            assert "no healthy decode worker" in str(o)
            continue
        c = o.outputs[0]
        assert (c.finish_reason == "length" and len(c.token_ids) == 150) or \
            (c.finish_reason == "error" and "died" in str(c.stop_reason)), (c.finish_reason, c.stop_reason)
    for _ in range(300):
        if dec not in p1_d2.workers and p1_d2.pool_sizes() == {"prefill": 1, "decode": 1}:
            break
        time.sleep(0.2)
    assert dec not in p1_d2.workers and dec not in {w.worker_id for w in p1_d2.registry_workers()}
    assert time.monotonic() - t_kill < 60
    new = next(w for w in p1_d2.workers if role_of(p1_d2, w) == "decode")
    out = p1_d2.generate(PROMPTS8[:2], GREEDY)
    assert all(o.decode_worker == new and len(o.outputs[0].token_ids) == 12 for o in out)
    assert next(r for r in p1_d2.status() if r["worker_id"] == new)["tensor_parallel_size"] == 2
    no_request_blocks(p1_d2)


def test_prefill_tp2_replicated_kv_head_to_decode_tp1_equals_llm(tiny_models):
    """qwen2 has one KV head: both prefill ranks hold it; one of them sends it. The KV is
    int8 with its per-row scales inside the slab: they travel with the head slices."""
    c = Cluster.start(tiny_models["qwen2"], prefill=1, decode=1, prefill_tp=2, decode_tp=1, max_model_len=512,
                      kv_cache_dtype="int8", namespace="pdserve-int8")  # beside the module's cluster
    try:
        outs = c.generate(PROMPTS8, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference(tiny_models["qwen2"], kv_cache_dtype="int8")
        assert all(role_of(c, o.prefill_worker) == "prefill" for o in outs)
        no_request_blocks(c)
    finally:
        c.shutdown()


def test_a_tp2_worker_fetches_a_prefix_from_a_tp1_peer_head_slice_by_head_slice(p1_d2, tiny_models):
    """A peer fetch between workers of different TP sizes goes through the handoff's routes: the TP2
    decode worker's ranks each pull their KV heads of the prefix the TP1 prefill worker caches."""
    from pdserve.transfer.fetch import FetchPlan

    shared, prompt = list(range(300, 364)), list(range(300, 364)) + [5, 6, 7]
    with LLM(tiny_models["llama"], max_model_len=512) as llm:
        want = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    p1_d2.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1))  # prefilled on P alone
    rows = {r["role"]: r for r in p1_d2.status()}
    p, d = rows["prefill"]["worker_id"], rows["decode"]["worker_id"]
    gen = p1_d2.pools.workers[d].actor.generate.options(num_returns="streaming").remote(
        DecodeCall("tp-fetch-0", p1_d2.validate(prompt, GREEDY), fetch=FetchPlan(p, 4, 1)))
    tokens = []
    for ref in gen:
        out = ray.get(ref)
        tokens += out.outputs[0].token_ids
    assert tokens == want
    deadline = time.monotonic() + 5  # the holder sees its send end at its next poll (an idle worker: 0.2 s)
    while (rows := {r["worker_id"]: r for r in p1_d2.status()})[p]["kv_peer_served_bytes"] == 0:
        assert time.monotonic() < deadline, rows[p]
        time.sleep(0.1)
    assert rows[d]["prefix_cache_peer_hits"] == 64 and rows[d]["kv_peer_fetches_failed"] == 0, rows[d]
    no_request_blocks(p1_d2)


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)])
def test_handoffs_between_tp_sizes_on_gpus_give_llms_tokens(tiny_models, prefill_tp, decode_tp):
    """On CUDA (three GPUs: one worker of TP 1, one of TP 2; float32, so the all-reduces' order
    moves nothing): every rank's head slice goes rank to rank, over CUDA IPC on one node."""
    import torch

    if torch.cuda.device_count() < 3:
        pytest.skip("needs three CUDA GPUs")
    want = reference(tiny_models["llama"], dtype="float32", gpu_memory_utilization=0.3)
    c = Cluster.start(tiny_models["llama"], prefill=1, decode=1, prefill_tp=prefill_tp, decode_tp=decode_tp,
                      max_model_len=512, dtype="float32", gpu_memory_utilization=0.3)
    try:
        outs = c.generate(PROMPTS8, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
        no_request_blocks(c)
    finally:
        c.shutdown()


@pytest.mark.gpu
def test_a_tp2_worker_on_two_gpus_gives_llms_tokens(tiny_models):
    """A colocated worker of TP 2 on two GPUs (Ray places its ranks; each rank's actor sees
    its own GPU first: cluster/workers/gpus.py), float32: the tokens of one process on one GPU."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    want = reference(tiny_models["llama"], dtype="float32", gpu_memory_utilization=0.3)
    c = Cluster.start(tiny_models["llama"], mode="colocated", decode=1, decode_tp=2, max_model_len=512,
                      dtype="float32", gpu_memory_utilization=0.3)
    try:
        outs = c.generate(PROMPTS8, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
        (row,) = c.status()
        assert row["tensor_parallel_size"] == 2
        no_request_blocks(c)
    finally:
        c.shutdown()


@pytest.mark.gpu
def test_pdserve_serve_tensor_parallel_size_2_answers_on_two_gpus(tiny_models, tmp_path):
    """The command a user runs: `pdserve serve --mode colocated --tensor-parallel-size 2` starts
    its own Ray on this host's GPUs and answers a completion over HTTP."""
    import os
    import subprocess
    import sys
    import urllib.request

    import torch

    from helpers import serving_port, stop_server

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    server = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model", tiny_models["llama"],
                               "--mode", "colocated", "--decode", "1", "--tensor-parallel-size", "2",
                               "--max-model-len", "512", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                              start_new_session=True)
    try:
        url = f"http://127.0.0.1:{serving_port(server)}/v1/completions"
        body = b'{"prompt": "The capital of France is", "max_tokens": 4}'
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200 and b'"choices"' in r.read()
    finally:
        err = stop_server(server)
    assert server.returncode == 0, err[-3000:]
