"""The disaggregated cluster on a real local Ray cluster with real gloo transfer:
outputs equal the colocated engine's, prefix-affine routing, scaling while serving,
a decode actor killed mid-generation, joining an existing Ray cluster."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster
from pdserve.cluster.pools.pool_monitor import PROBE_S
from pdserve.cluster.spec.serving_config import HandoffConfig
from pdserve.engine.base.hashing import hash_block_tokens

from helpers import PROMPTS, RayHead, role_of

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # a real-model or multi-actor cluster per module

GREEDY = SamplingParams(temperature=0, max_tokens=16)
PROMPTS16 = PROMPTS[:8] + [p + " Explain." for p in PROMPTS[:8]]


# The pools, handoffs and failures are under test, not the model: a tiny random model with the
# default model's tokenizer (the real model ran this module in ~200 s on 2 cores); the test of
# joining a Ray cluster below keeps the real model and its answer.
@pytest.fixture(scope="module")
def reference(tiny_models):
    llm = LLM(tiny_models["llama"], max_model_len=512)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS16, llm.generate(PROMPTS16, GREEDY))}


def no_request_blocks(cluster: Cluster) -> None:
    for row in cluster.status():
        assert row["request_blocks"] == 0 and row["inflight"] == 0 and row["open_outputs"] == 0, row


@pytest.fixture(scope="class")
def cluster22(tiny_models, shared_ray):
    c = Cluster.start(tiny_models["llama"], prefill=2, decode=2, max_model_len=512)
    yield c
    c.shutdown()


@pytest.fixture(scope="class")
def cluster11(tiny_models, shared_ray):
    c = Cluster.start(tiny_models["llama"], prefill=1, decode=1, max_model_len=512)
    yield c
    c.shutdown()


class TestTwoByTwo:
    @pytest.fixture
    def cluster(self, cluster22):
        return cluster22

    def test_outputs_equal_colocated(self, cluster, reference):
        before = dict(cluster.counters["outputs"])
        outs = cluster.generate(PROMPTS16, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in PROMPTS16]
        # every decode worker's outputs came over the output pipe, none through Ray's stream
        assert cluster.counters["outputs"] == {"pipe": before["pipe"] + 16, "ray": before["ray"]}
        assert all(row["output_pipe"] for row in cluster.status())
        assert {o.prefill_worker for o in outs} <= {w for w in cluster.workers if role_of(cluster, w) == "prefill"}
        # both decode workers took requests (a request that ends on its first token never leaves prefill)
        assert len({o.decode_worker for o in outs if role_of(cluster, o.decode_worker) == "decode"}) == 2
        no_request_blocks(cluster)

    def test_seeded_sampled_outputs_equal_colocated(self, cluster, tiny_models):
        """Sampled with a seed (temperature, top-k, min-p, a presence penalty, log-probs, n = 2):
        prefilled on one worker and decoded on another, each copy's tokens and log-probs equal
        the colocated engine's."""
        sp = SamplingParams(temperature=0.9, top_k=40, min_p=0.02, presence_penalty=0.4, logprobs=2, n=2,
                            max_tokens=16, seed=2024, ignore_eos=True)
        ref = LLM(tiny_models["llama"], max_model_len=512).generate(PROMPTS[:4], sp)
        copies = sp.samples()  # the cluster takes one sequence per request, as the HTTP server sends them
        outs = cluster.generate([p for p in PROMPTS[:4] for _ in copies], copies * 4)
        got = [o.outputs[0] for o in outs]
        want = [c for r in ref for c in r.outputs]
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for c, rc in zip(got, want):
            assert [sorted(d) for d in c.logprobs] == [sorted(d) for d in rc.logprobs]
        assert any(role_of(cluster, o.decode_worker) == "decode" for o in outs)
        assert len({tuple(c.token_ids) for o in ref for c in o.outputs}) == 8  # sampled: all differ
        no_request_blocks(cluster)

    def test_one_round_trip_timeline(self, cluster):
        """Prefill and decode are asked at once: the decode reservation is made while the
        prompt is prefilled, the prefill worker sends as soon as both are ready, and the
        first token arrives with the KV (the server's own spans say so)."""
        outs = cluster.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        ids = {o.request_id for o in outs}
        rows = [t for t in cluster.timeline(100) if t["request_id"] in ids]
        assert len(rows) == 4
        for t in rows:
            s = t["spans"]
            assert s["arrival"] <= s["prefill_queued"] <= s["prefill_done"] <= s["send_start"] <= s["kv_landed"] \
                <= s["relayed"] <= s["first_token_at_edge"]
            assert s["decode_queued"] <= s["reserved"] <= s["send_start"]  # reserved before the send, never after
            assert s["target_known"] <= s["send_start"]
            assert set(t["phases"]) == {"prefill", "decode_reserve", "kv_to_first_token"}
            roles = (role_of(cluster, t["prefill_worker"]), role_of(cluster, t["decode_worker"]))
            assert roles == ("prefill", "decode")

    def test_stream_equals_non_stream(self, cluster):
        p = "Write a sentence about the ocean."
        final = cluster.generate(p, GREEDY)[0].outputs[0]
        chunks = list(cluster.stream(p, GREEDY))  # outputs a slow consumer missed come merged
        assert chunks[-1].finished and 1 < len(chunks) <= len(final.token_ids)
        assert [t for c in chunks for t in c.delta_token_ids] == final.token_ids
        assert "".join(c.delta_text for c in chunks) == final.text == chunks[-1].outputs[0].text
        assert chunks[-1].outputs[0].token_ids == final.token_ids

    def test_shared_prefix_goes_to_one_prefill_worker(self, cluster):
        prefix = ("You are a meticulous assistant for a shipping company. Answer questions about "
                  "parcels, customs and delivery times precisely, and say so when you do not know. ") * 3
        tok = cluster.tokenizer
        assert len(tok.encode(prefix)) >= 64
        first = cluster.generate(prefix + "Question 0?", GREEDY)[0]
        time.sleep(2.5)  # a heartbeat carries the new blocks to the registry
        holder = first.prefill_worker
        hashes = [h.hex() for h in hash_block_tokens(tok.encode(prefix), 16)]
        assert holder in ray.get(cluster.registry.actor.holders_of.remote(hashes[0]))
        hits0 = {r["worker_id"]: r["prefix_cache_hits"] for r in cluster.status()}
        outs = [cluster.generate(prefix + f"Question {i}?", GREEDY)[0] for i in range(1, 7)]
        assert all(o.prefill_worker == holder for o in outs)
        hits1 = {r["worker_id"]: r["prefix_cache_hits"] for r in cluster.status()}
        assert hits1[holder] - hits0[holder] >= 6 * 64
        no_request_blocks(cluster)

    def test_the_registry_holds_registrations_stats_and_blocks_without_torch(self, cluster):
        """What the block registry receives (each worker's registration with its KV layout and
        startup times, its stats, its block events) unpickles without torch: the registry starts,
        and a fault restarts it, without loading it (~1.5 s of a core and ~250 MB each time)."""
        prompt = "Without torch, the registry keeps the map of which worker holds which prefix. " * 2
        out = cluster.generate(prompt, GREEDY)[0]
        first = hash_block_tokens(cluster.tokenizer.encode(prompt), 16)[0].hex()
        deadline = time.monotonic() + 30
        while out.prefill_worker not in ray.get(cluster.registry.actor.holders_of.remote(first)):
            assert time.monotonic() < deadline, "the prefill worker's blocks never reached the registry"
            time.sleep(0.2)
        loaded = ray.get(cluster.registry.actor.__ray_call__.remote(
            lambda registry: sorted(m for m in ("torch", "triton", "transformers") if m in sys.modules)))
        assert loaded == []

    def test_bad_input_is_a_clear_error(self, cluster):
        with pytest.raises(ValueError, match="empty"):
            cluster.generate("", GREEDY)
        with pytest.raises(ValueError, match="max_model_len"):
            cluster.generate("hi " * 600, GREEDY)
        assert cluster.generate("Hi", GREEDY)[0].finished
        no_request_blocks(cluster)


class TestScalingAndFailures:
    @pytest.fixture
    def cluster(self, cluster11):
        return cluster11

    def test_1p1d_equals_colocated(self, cluster, reference):
        outs = cluster.generate(PROMPTS16, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in PROMPTS16]

    def test_handoff_with_nothing_to_send_keeps_the_pair_in_order(self, cluster):
        # a block-aligned prompt the decode worker already holds entirely: its handoff moves
        # no block; the handoff after it on the same pair must not wait for it
        aligned = list(range(1000, 1032))
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        first = cluster.generate([aligned], params)[0]
        retries = cluster.counters["retries"]
        t0 = time.monotonic()
        again = cluster.generate([aligned], params)[0]
        other = cluster.generate([list(range(2000, 2040))], params)[0]
        # waiting for the empty handoff would have taken its deadline (the code's bound)
        assert time.monotonic() - t0 < HandoffConfig().timeout_s, "the next handoff waited for the empty one"
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert other.outputs[0].finish_reason == "length" and cluster.counters["retries"] == retries

    def test_worker_purged_from_the_registry_comes_back_with_its_blocks(self, cluster):
        # a worker whose heartbeats stalled past the registry's stale_s is purged; once it
        # beats again it must re-register and re-announce its cached blocks, or prefix
        # routing never sees it again
        cluster.generate("A prompt long enough to fill a few blocks of the prefix cache. " * 3, GREEDY)
        d = next(w for w in cluster.workers.values() if w.role == "decode")
        for _ in range(50):  # a heartbeat carries the new blocks to the registry
            held = {w.worker_id: w.num_cached_blocks for w in cluster.registry_workers()}
            if held[d.worker_id] >= 3:
                break
            time.sleep(0.1)
        assert held[d.worker_id] >= 3
        assert ray.get(cluster.registry.actor.unregister.remote(d.worker_id))
        for _ in range(100):
            back = {w.worker_id: w.num_cached_blocks for w in cluster.registry_workers()}
            if back.get(d.worker_id, 0) >= held[d.worker_id]:
                break
            time.sleep(0.1)
        assert back.get(d.worker_id, 0) >= held[d.worker_id], back

    def test_scale_up_and_down_while_serving(self, cluster, reference):
        results, stop = [], threading.Event()

        def traffic():
            i = 0
            while not stop.is_set():
                p = PROMPTS16[i % 16]
                out = cluster.generate(p, GREEDY)[0]
                results.append((p, out))
                i += 1

        threads = [threading.Thread(target=traffic) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(2)
        assert cluster.scale(prefill=2, decode=3) == {"prefill": 2, "decode": 3}
        time.sleep(4)
        assert cluster.scale(prefill=1, decode=1) == {"prefill": 1, "decode": 1}
        time.sleep(2)
        stop.set()
        for t in threads:
            t.join(120)
        assert len(results) > 10
        bad = [(p, o.outputs[0].finish_reason) for p, o in results if o.outputs[0].token_ids != reference[p]]
        assert not bad  # zero failed requests, every output exact
        served_by = {o.decode_worker for _, o in results}
        assert len(served_by) >= 2  # the added workers took traffic
        assert len(cluster.workers) == 2
        registered = {w.worker_id for w in cluster.registry_workers()}
        assert registered == set(cluster.workers)
        no_request_blocks(cluster)

    def test_killed_decode_actor(self, cluster):
        cluster.scale(decode=2)
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # running when the kill comes
        outs: list = []
        ts = [threading.Thread(target=lambda i=i: outs.append(cluster.generate(f"Story {i}: once", long)[0]))
              for i in range(6)]
        for t in ts:
            t.start()
        victim = None
        for _ in range(600):  # wait until both decode workers are generating (slow under load)
            rows = {r["worker_id"]: r for r in cluster.status() if r["role"] == "decode"}
            busy = [w for w, r in rows.items() if r.get("num_running", 0) > 0]
            if len(busy) == 2:
                victim = busy[0]
                break
            time.sleep(0.1)
        assert victim is not None
        t_kill = time.monotonic()
        ray.kill(cluster.workers[victim].actor)
        for t in ts:
            t.join(300)
        assert len(outs) == 6
        reasons = sorted(o.outputs[0].finish_reason for o in outs)
        errors = [o for o in outs if o.outputs[0].finish_reason == "error"]
        assert all("died" in str(o.outputs[0].stop_reason) for o in errors)
        assert reasons.count("length") >= 1 and all(r in ("length", "error") for r in reasons)
        assert all(len(o.outputs[0].token_ids) == 400 for o in outs if o.outputs[0].finish_reason == "length")
        while victim in {w.worker_id for w in cluster.registry_workers()}:
            # the monitor's probe (every second, answered within PROBE_S) finds the dead actor and purges it
            assert time.monotonic() - t_kill < 4 * PROBE_S
            time.sleep(0.2)
        for _ in range(150):  # the pool refills to its size
            if cluster.pool_sizes() == {"prefill": 1, "decode": 2} and victim not in cluster.workers:
                break
            time.sleep(0.2)
        assert cluster.pool_sizes() == {"prefill": 1, "decode": 2}
        assert cluster.generate("After the crash,", GREEDY)[0].outputs[0].finish_reason in ("length", "stop")
        no_request_blocks(cluster)


def test_own_ray_without_an_address_and_joining_one_with_it(own_ray, tiny_models):
    """A Ray already running on the machine is neither joined nor touched without an address;
    given its address, the cluster joins it, and a second pdserve in its namespace is refused."""
    port = 6391
    model = tiny_models["llama"]
    head = RayHead(port, "--num-cpus=2")
    try:
        c = Cluster.start(model, decode=1, mode="colocated", max_model_len=256)
        try:
            assert not ray.get_runtime_context().gcs_address.endswith(f":{port}")
            want = c.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids
        finally:
            c.shutdown()
        assert head.proc.poll() is None  # the other Ray still runs
        c = Cluster.start(model, prefill=1, decode=1, address=f"127.0.0.1:{port}", max_model_len=256)
        try:
            assert c.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids == want
            assert ray.get_runtime_context().gcs_address.endswith(str(port))
            with pytest.raises(RuntimeError, match="another pdserve cluster serves namespace 'pdserve'"):
                Cluster.start(model, prefill=1, decode=1, address=f"127.0.0.1:{port}", max_model_len=256)
            assert c.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids == want  # untouched
        finally:
            c.shutdown()
    finally:
        head.stop()


def test_a_colocated_cluster_serves_a_session_past_max_model_len_with_a_window(tiny_models):
    """kv_window_tokens (engine/base/kv_window.py): a 300-token prompt and 200 new tokens on
    max_model_len 128 give the tokens of a local engine with the same window; the
    disaggregated mode is refused by name before anything starts."""
    model = tiny_models["llama"]
    kw = dict(max_model_len=128, max_num_batched_tokens=16, kv_window_tokens=64, kv_sink_tokens=4)
    with pytest.raises(ValueError, match="kv_window_tokens runs in colocated mode"):
        Cluster.start(model, prefill=1, decode=1, namespace="pdserve-window", **kw)
    prompt, sp = list(range(500, 800)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with LLM(model, **kw) as llm:
        want = llm.generate([prompt], sp)[0].outputs[0].token_ids
    c = Cluster.start(model, decode=1, mode="colocated", namespace="pdserve-window", **kw)
    try:
        assert c.generate([prompt], sp)[0].outputs[0].token_ids == want
    finally:
        c.shutdown()


def no_output_pipe():
    """A worker that never connects its output pipe (a router it cannot reach)."""
    from pdserve.cluster.workers.worker_actor import WorkerActor

    class NoPipe(WorkerActor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "output_pipe": None})

    return NoPipe


def test_workers_without_an_output_pipe_stream_through_ray(tiny_models, reference, shared_ray):
    """A worker whose pipe is not connected is streamed through Ray: the same tokens, streamed
    the same way, and the status says which way its outputs go."""
    c = Cluster.start(tiny_models["llama"], prefill=1, decode=1, max_model_len=512, worker_cls=no_output_pipe())
    try:
        outs = c.generate(PROMPTS16[:6], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in PROMPTS16[:6]]
        chunks = list(c.stream(PROMPTS16[0], GREEDY))
        assert [t for ch in chunks for t in ch.delta_token_ids] == reference[PROMPTS16[0]] and chunks[-1].finished
        assert c.counters["outputs"] == {"pipe": 0, "ray": 7}
        assert [row["output_pipe"] for row in c.status()] == [False, False]
        no_request_blocks(c)
    finally:
        c.shutdown()
