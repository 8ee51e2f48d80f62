"""Peer fetch between two workers' roles in one process, over the loopback backend: a prefix one
engine cached is fetched by the other instead of recomputed, with the tokens of each prompt run
alone (the cluster path over real Ray and gloo: tests/cluster/test_faults.py)."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.decode.role import DecodeRole
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.role import Emitted, Fetching
from pdserve.prefill.role import PrefillRole
from pdserve.transfer.fetch import FetchPlan
from pdserve.transfer.loopback import LoopbackConnector, LoopbackHub

from helpers import valid

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHARED = list(range(500, 564))  # 4 blocks
PROMPTS = [SHARED + list(range(900 + 20 * i, 911 + 20 * i)) for i in range(3)]
MODELS = {"auto": "llama", "int8": "llama", "int4": "llama_hd32"}  # int4 packs head_dim 32 rows


def alone(model: str, kv_cache_dtype: str) -> list[list[int]]:
    with LLM(model, max_model_len=256, dtype="float32", kv_cache_dtype=kv_cache_dtype) as llm:
        return [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in PROMPTS]


def workers(model: str, kv_cache_dtype: str, role=DecodeRole, names=("a", "b")) -> dict:
    hub, out = LoopbackHub(), {}
    for name in names:
        e = LLMEngine(EngineConfig(model=model, max_model_len=256, dtype="float32", kv_cache_dtype=kv_cache_dtype))
        out[name] = role(e, LoopbackConnector(name, e.runner.kv, hub, kv_cache_dtype=kv_cache_dtype))
    return out


def drive(ws: dict, refuse: bool = False) -> dict:
    """Steps every role until none holds a request, as their actors would: a Fetching event is the
    holder's serve_fetch(), and a refusal comes back as refused()."""
    finals = {}
    while any(w.num_inflight or w.fetches.busy for w in ws.values()):
        for w in ws.values():
            for ev in w.step():
                if isinstance(ev, Fetching):
                    if refuse or not ws[ev.peer].fetches.serve(ev.request_id, ev.hashes, ev.target):
                        w.fetches.refused(ev.request_id, "refused")
                elif isinstance(ev, Emitted) and ev.output.finished:
                    finals[ev.output.request_id] = ev.output
    return finals


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_a_prefix_cached_on_a_is_fetched_by_b_with_the_tokens_of_recomputing(tiny_models, kv_cache_dtype):
    model = tiny_models[MODELS[kv_cache_dtype]]
    want = alone(model, kv_cache_dtype)
    ws = workers(model, kv_cache_dtype)
    ws["a"].add("r0", valid(ws["a"].engine, PROMPTS[0], PARAMS))
    assert drive(ws)["r0"].outputs[0].token_ids == want[0]
    ws["b"].add("r1", valid(ws["b"].engine, PROMPTS[1], PARAMS), None, FetchPlan("a", 4))
    b = ws["b"].engine  # waits in the engine's peer tier (engine/tiers/tier.py), not scheduled yet
    assert ws["b"].fetches.busy == 1 and b.tiers.waiting.get("r1") is ws["b"].fetches
    assert not b.scheduler.num_unfinished
    out = drive(ws)["r1"]
    assert out.outputs[0].token_ids == want[1]
    assert out.num_cached_tokens == 64  # the fetched blocks were prefix hits: only the tail was computed
    sb, sa = ws["b"].fetches.stats().as_dict(), ws["a"].fetches.stats().as_dict()
    block = ws["a"].engine.runner.layout.block_bytes
    assert sb["prefix_cache_peer_hits"] == 64 and sb["kv_peer_fetched_bytes"] == 4 * block == sa["kv_peer_served_bytes"]
    assert sb["kv_peer_fetches_failed"] == 0 and sb["kv_peer_waiting"] == 0
    assert sb["kv_peer_fetch_gbps"] is None  # the first fetch from a holder connects the pair: not measured
    # b holds the prefix now: nothing fetched
    ws["b"].add("r2", valid(ws["b"].engine, PROMPTS[2], PARAMS), None, FetchPlan("a", 4))
    assert ws["b"].fetches.busy == 0
    assert drive(ws)["r2"].outputs[0].token_ids == want[2]
    other = [list(range(700, 764)) + p[64:] for p in PROMPTS[:2]]  # another shared prefix: a's, then b's
    ws["a"].add("r3", valid(ws["a"].engine, other[0], PARAMS))
    drive(ws)
    ws["b"].add("r4", valid(ws["b"].engine, other[1], PARAMS), None, FetchPlan("a", 4))
    drive(ws)
    assert ws["b"].fetches.stats().fetch_gbps > 0  # the link's speed, what placement predicts by
    for w in ws.values():
        w.engine.kv.check_all_free()  # the holder's pins dropped, the receiver's blocks cached at ref 0
        assert not w.fetches.serving and not w.fetches.incoming


def test_a_refused_or_aborted_fetch_recomputes_and_leaks_no_block(tiny_models):
    """A holder that no longer caches the run refuses: the request recomputes (same tokens); one
    aborted while its fetch is posted frees its blocks at once. On a prefill role too."""
    model = tiny_models["llama"]
    want = alone(model, "auto")
    ws = workers(model, "auto", PrefillRole, names=("a", "b", "c"))
    one = SamplingParams(temperature=0, max_tokens=1)
    ws["b"].add("r0", valid(ws["b"].engine, PROMPTS[0], one), None, FetchPlan("a", 4))  # a caches nothing: refused
    out = drive(ws)["r0"]
    assert out.outputs[0].token_ids == want[0][:1] and out.num_cached_tokens == 0
    s = ws["b"].fetches.stats().as_dict()
    assert s["kv_peer_fetches_failed"] == 1 and s["prefix_cache_peer_hits"] == 0
    ws["a"].add("r1", valid(ws["a"].engine, PROMPTS[1], one), None)
    drive(ws)
    c = ws["c"]
    c.add("r2", valid(c.engine, PROMPTS[2], one), None, FetchPlan("a", 4))
    assert c.engine.kv.num_blocks - c.engine.kv.num_free_blocks == 4  # reserved for the fetch
    c.abort("r2")
    assert c.num_inflight == 0 and c.fetches.busy == 0 and c.engine.kv.num_free_blocks == c.engine.kv.num_blocks
    assert drive(ws) == {}
    c.add("r3", valid(c.engine, PROMPTS[2], one), None, FetchPlan("a", 4))  # the holder refuses (a dead or drained one)
    assert drive(ws, refuse=True)["r3"].outputs[0].token_ids == want[2][:1]
    assert c.fetches.stats().failed == 1
    for w in ws.values():
        w.engine.kv.check_all_free()


def test_the_peer_tier_joins_the_engines_tier_list_after_the_host_tier(tiny_models, tmp_path):
    """One list of KV tiers in lookup order: host (pinned memory), then peer (another worker's GPU,
    a fetch), then disk; the peer tier keeps the tier protocol, and a second one is refused."""
    from pdserve.engine.tiers.tier import KVTier
    from pdserve.transfer.fetch import PeerFetches

    e = LLMEngine(EngineConfig(model=tiny_models["llama"], max_model_len=256, dtype="float32",
                               kv_offloading_size=0.001, kv_disk_dir=str(tmp_path), kv_disk_size=0.01))
    conn = LoopbackConnector("w", e.runner.kv, LoopbackHub())
    role = DecodeRole(e, conn)
    assert [t.name for t in e.tiers.tiers] == ["host", "peer", "disk"]
    assert isinstance(role.fetches, KVTier) and e.tiers.get("peer") is role.fetches
    assert PrefillRole(e, conn).fetches is role.fetches  # the roles of one worker share it
    with pytest.raises(ValueError, match="already"):
        PeerFetches(e, conn)
