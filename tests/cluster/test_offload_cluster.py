"""The KV tiers in the cluster: the registry learns each worker's tiers from heartbeats
and scores holders by tier; a worker's offloaded prefix is found, loaded back and gives
the same tokens; a restarted cluster finds its persisted tier; a prefix cached on another
worker's GPU is fetched from it when placement predicts that faster than recomputing."""

from __future__ import annotations

import time

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster
from pdserve.cluster.placement.routing import FETCH_FIXED_S, Holder, plan_fetch
from pdserve.cluster.records import BlockChange, BlockEvent, WorkerInfo, WorkerStats
from pdserve.cluster.registry.registry import HOST_HIT_WEIGHT, BlockRegistry
from pdserve.engine.base.hashing import hash_block_tokens

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHARED = list(range(100, 164))


@pytest.mark.slow
def test_registry_scores_holders_by_tier(shared_ray):
    reg = BlockRegistry.options(name="tier-test-registry", namespace="tier-test").remote()
    try:
        hs = [f"{i:064x}" for i in range(4)]
        for w in ("a", "b", "c"):
            ray.get(reg.register.remote(w, WorkerInfo("decode", "", "1")))
        gpu, host = BlockChange.STORED, BlockChange.HOST_STORED
        ray.get(reg.heartbeat.remote("a", WorkerStats(), [BlockEvent(gpu, hs[0]), BlockEvent(gpu, hs[1])]))  # GPU: 2
        ray.get(reg.heartbeat.remote("b", WorkerStats(), [BlockEvent(host, h) for h in hs[:3]]))  # host: 3 blocks
        ray.get(reg.heartbeat.remote("c", WorkerStats(), [BlockEvent(gpu, hs[0]), BlockEvent(host, hs[1])]))  # 1 + 1
        assert 3 * HOST_HIT_WEIGHT > 2 > 1 + HOST_HIT_WEIGHT
        assert ray.get(reg.longest_prefix.remote(hs, "decode")) == ("b", 3)
        assert ray.get(reg.longest_prefix.remote(hs[:2], "decode")) == ("a", 2)  # 2 GPU beat 2 host
        assert ray.get(reg.tiers_of.remote("c", hs)) == ["gpu", "host", "", ""]
        ray.get(reg.heartbeat.remote("b", WorkerStats(), [BlockEvent(BlockChange.HOST_REMOVED, hs[0])]))
        assert ray.get(reg.longest_prefix.remote(hs, "decode")) == ("a", 2)
        rows = {w.worker_id: w for w in ray.get(reg.list_workers.remote())}
        assert (rows["b"].num_host_blocks, rows["c"].num_cached_blocks) == (2, 1)
        assert (rows["b"].role, rows["b"].as_dict()["num_host_blocks"], rows["b"].as_dict()["role"]) == \
            ("decode", 2, "decode")  # a typed row; as_dict is its JSON status row
    finally:
        ray.kill(reg)


@pytest.mark.slow
def test_offloaded_prefix_is_found_again_and_persists_across_restart(tiny_models, tmp_path, shared_ray,
                                                                     mode="disaggregated"):
    model = tiny_models["llama"]
    prompts = [SHARED + [7, 8, 9], SHARED + [17, 18]]
    with LLM(model, max_model_len=256) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    kw = dict(max_model_len=256, num_gpu_blocks_override=12, kv_offloading_size=0.001,
              kv_persist_dir=str(tmp_path), mode=mode, decode=1, prefill=None if mode == "colocated" else 1)
    hashes = [h.hex() for h in hash_block_tokens(SHARED, 16)]
    c = Cluster.start(model, **kw)
    try:
        assert c.generate([prompts[0]], PARAMS)[0].outputs[0].token_ids == want[0]
        holder = c.generate([prompts[0]], PARAMS)[0].prefill_worker  # the worker that prefilled it
        for i in range(3):  # unrelated prompts push the prefix out of its 12 GPU blocks
            c.generate([list(range(1000 + 200 * i, 1150 + 200 * i))], PARAMS)
        deadline = time.monotonic() + 10
        while ray.get(c.registry.actor.tiers_of.remote(holder, hashes)) != ["host"] * 4:
            assert time.monotonic() < deadline, ray.get(c.registry.actor.tiers_of.remote(holder, hashes))
            time.sleep(0.2)
        out = c.generate([prompts[1]], PARAMS)[0]
        assert out.outputs[0].token_ids == want[1] and out.prefill_worker == holder
        assert next(r for r in c.status() if r["worker_id"] == holder)["prefix_cache_host_hits"] >= 64
        # /metrics reads what the monitor gathered (every second)
        from prometheus_client import generate_latest

        from pdserve.router.metrics import RouterMetrics

        deadline = time.monotonic() + 10
        while True:
            text = generate_latest(RouterMetrics(c, "m").registry).decode()
            line = next((x for x in text.splitlines() if x.startswith("pdserve:prefix_cache_host_hits_total{")
                         and f'worker="{holder}"' in x), "")
            if line and float(line.rsplit(" ", 1)[1]) >= 64:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.3)
        assert "pdserve:kv_host_blocks_total{" in text and "pdserve:kv_offloaded_blocks_total{" in text
    finally:
        c.shutdown()
    c = Cluster.start(model, **kw)  # the same worker slots read their files back
    try:
        deadline = time.monotonic() + 10
        while not any(set(ray.get(c.registry.actor.tiers_of.remote(w, hashes))) == {"host"} for w in c.workers):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        out = c.generate([prompts[1]], PARAMS)[0]
        assert out.outputs[0].token_ids == want[1] and out.num_cached_tokens == 64
    finally:
        c.shutdown()


def test_fetch_is_planned_only_when_a_peer_holds_more_and_fetching_is_predicted_faster():
    runs = {"a": (6, 6), "b": (0, 2), "c": (4, 6)}  # (GPU run, run in any tier), in blocks
    links = {"a": Holder(1.0), "c": Holder(1.0)}  # the holders whose layout matches: their links' GB/s
    kw = dict(block_size=16, block_bytes=1 << 20)
    d = plan_fetch("b", runs, links, rate=1000.0, **kw)  # 64 tokens to recompute: 64 ms against ~9 ms
    assert (d.holder, d.blocks) == ("a", 6) and d.faster and list(d.explain()) == ["fetch"]
    assert round(d.fetch_s, 4) == round(FETCH_FIXED_S + 4 * (1 << 20) / 1e9, 4) and d.recompute_s == 0.064
    assert plan_fetch("b", runs, {"c": Holder(1.0)}, rate=1000.0, **kw).holder == "c"  # a: another layout
    slow = plan_fetch("b", runs, links, rate=100_000.0, **kw)  # recomputing is faster
    assert not slow.faster and slow.explain()["recompute"]["holder"] == "a"  # the timeline says why
    long_run = {"a": (600, 600)}  # 9,600 tokens: 96 ms to recompute at 100K tokens/s
    assert plan_fetch("b", long_run, {"a": Holder(100.0)}, rate=100_000.0, **kw).holder == "a"  # 11 ms, fast link
    assert plan_fetch("b", long_run, {"a": Holder(1.0)}, rate=100_000.0, **kw).faster is False  # 634 ms
    assert not plan_fetch("b", long_run, {"a": Holder(100.0, wait_s=0.1)}, rate=100_000.0, **kw).faster  # busy
    assert plan_fetch("b", runs, links, rate=None, **kw) is None  # unmeasured: nothing to weigh
    assert plan_fetch("a", runs, links, rate=1000.0, **kw) is None  # it holds the most itself
    assert plan_fetch("c", {"a": (6, 6), "c": (0, 6)}, links, rate=1000.0, **kw) is None  # its host tier has it


@pytest.mark.slow
def test_a_prefix_cached_on_a_busy_worker_is_fetched_by_the_worker_placed_instead(shared_ray):
    """Colocated, two workers of the default model. The prompt's holder A is busy, so bounded-load
    placement sends the next prompt with that prefix to B; B's prefill rate is measured, so placement
    predicts fetching the 400-token prefix over the pair's link (shared memory on this host) faster
    than recomputing it: B fetches it from A, with the tokens of a plain engine. (A 96-token prefix
    left the decision to timing: on a busy host A's half step, which a fetch waits for, came to
    about B's recompute, and placement rightly recomputed.) A registry that answers placement late
    (past its call timeout, on a loaded host) leaves that prompt without prefix hints, and its
    timeline says so: the round is played again with a new prefix, up to three rounds."""
    c = Cluster.start(mode="colocated", decode=2, max_model_len=1024)
    try:
        for i in range(12):  # prefills measured on both workers (consistent hash spreads these)
            if all(w.stats.prefill_tok_s for w in c.pools.workers.values()):
                break
            c.generate([list(range(5000 + 100 * i, 5100 + 100 * i))], PARAMS)
            time.sleep(1.2)  # the monitor gathers the workers' stats every second
        assert all(w.stats.prefill_tok_s for w in c.pools.workers.values())
        late = []
        for base in (3000, 13000, 23000):
            placement = _fetch_round(c, list(range(base, base + 400)))  # 25 blocks
            if placement.get("registry") != "no answer":
                break
            late.append(base)
        assert len(late) < 3, late
        assert c.counters["routing"].get("peer_fetch") == 1
    finally:
        c.shutdown()


def _fetch_round(c, shared: list[int]) -> dict:
    """One round of the busy-holder fetch on `shared` (see the test above): the placement entry
    of the prompt placed on B, checked unless the registry did not answer it."""
    prompts = [shared + [7, 8, 9], shared + [17, 18, 19]]
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    hashes = [h.hex() for h in hash_block_tokens(shared, 16)]
    out = c.generate([prompts[0]], PARAMS)[0]
    a = out.decode_worker
    (b,) = set(c.pools.workers) - {a}
    deadline = time.monotonic() + 10
    while ray.get(c.registry.actor.tiers_of.remote(a, hashes)) != ["gpu"] * 25:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    busy = c.stream(prompts[0] + [1, 2], long)  # A's load: the next prompt overflows to B
    assert next(busy).decode_worker == a
    before = {r["worker_id"]: r for r in c.status()}
    out = c.generate([prompts[1]], PARAMS)[0]
    assert out.decode_worker == b
    placement = next(t.get("placement") for t in reversed(c.timeline()) if t["decode_worker"] == b) or {}
    if placement.get("registry") != "no answer":
        assert "fetch" in placement, (placement, {w: r.stats for w, r in c.pools.workers.items()},
                                      ray.get(c.registry.actor.runs.remote(hashes)))
        assert placement["fetch"]["holder"] == a and placement["fetch"]["blocks"] == 25, placement
        assert out.num_cached_tokens == 400
        deadline = time.monotonic() + 5  # the holder sees its send end at its next poll
        while (rows := {r["worker_id"]: r for r in c.status()})[a]["kv_peer_served_bytes"] == 0:
            assert time.monotonic() < deadline, rows[a]
            time.sleep(0.1)
        assert rows[b]["prefix_cache_peer_hits"] - before[b]["prefix_cache_peer_hits"] == 400, rows[b]
        assert rows[b]["kv_peer_fetches_failed"] == 0, rows[b]
        assert rows[a]["kv_peer_served_bytes"] == rows[b]["kv_peer_fetched_bytes"] > 0
    with LLM(max_model_len=1024) as llm:
        assert out.outputs[0].token_ids == llm.generate([prompts[1]], PARAMS)[0].outputs[0].token_ids
    for _ in busy:
        pass
    for r in c.status():  # nothing pinned or waiting is left behind
        assert r["request_blocks"] == 0 and r["kv_peer_waiting"] == 0 and r["open_outputs"] == 0, r
    return placement


@pytest.mark.slow
def test_two_live_workers_share_one_disk_directory(shared_ray, tmp_path):
    """Colocated, two workers of the default model on one --kv-disk-dir. A prompt served on w1, which
    then leaves (scaled down: its host tier goes to disk as it stops); the same prefix on w0, live
    all along, is read from the block files w1 wrote, with the tokens of a plain engine."""
    c = Cluster.start(mode="colocated", decode=2, max_model_len=512, kv_offloading_size=0.05,
                      kv_disk_dir=str(tmp_path), kv_disk_size=0.5)
    try:
        w0, w1 = sorted(c.pools.workers)  # scaling down to one stops the later id
        served = {}
        for i in range(12):  # prefills measured on both, and a prompt served on w1
            prompt = list(range(5000 + 100 * i, 5100 + 100 * i))
            served.setdefault(c.generate([prompt], PARAMS)[0].decode_worker, prompt)
            if w1 in served and all(w.stats.prefill_tok_s for w in c.pools.workers.values()):
                break
            time.sleep(1.2)  # the monitor gathers the workers' stats every second
        prompt = served[w1] + [7, 8, 9]
        with LLM(max_model_len=512) as llm:
            want = llm.generate([prompt], PARAMS)[0].outputs[0].token_ids
        assert next(r for r in c.status() if r["worker_id"] == w0)["kv_disk_blocks"] == 0
        c.scale(decode=1)
        assert list(c.pools.workers) == [w0]
        out = c.generate([prompt], PARAMS)[0]
        assert out.decode_worker == w0 and out.outputs[0].token_ids == want
        (row,) = c.status()
        assert row["prefix_cache_disk_hits"] == 96 and out.num_cached_tokens == 96, row
        assert row["kv_disk_refused_blocks"] == 0 and row["request_blocks"] == 0
    finally:
        c.shutdown()
