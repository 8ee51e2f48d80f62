"""Prefill and decode as roles of one engine, joined by the loopback transfer backend
in one process: the disaggregated path gives the colocated engine's greedy tokens."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.decode.role import DecodeRole
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.role import Reserved
from pdserve.prefill.role import PrefillRole
from pdserve.transfer.loopback import LoopbackConnector, LoopbackHub

from helpers import PROMPTS, run_disagg, valid

SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def pair():
    hub = LoopbackHub()
    pe = LLMEngine(EngineConfig(max_model_len=512))
    de = LLMEngine(EngineConfig(max_model_len=512, num_gpu_blocks_override=16))  # small: forces preemption
    return (PrefillRole(pe, LoopbackConnector("prefill-0", pe.runner.kv, hub)),
            DecodeRole(de, LoopbackConnector("decode-0", de.runner.kv, hub)))


@pytest.mark.slow
def test_disaggregated_equals_colocated(pair):
    pw, dw = pair
    ref = LLM(max_model_len=512).generate(PROMPTS[:8], SP)
    outs, _ = run_disagg(pw, dw, PROMPTS[:8], SP)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert [o.outputs[0].text for o in outs] == [r.outputs[0].text for r in ref]
    assert dw.engine.stats().num_preemptions > 0  # the small decode pool recomputed on itself
    for w in pair:
        w.engine.kv.check_all_free()
        assert w.num_inflight == 0 and not w.has_work()


@pytest.mark.slow
def test_int4_kv_travels_with_its_scales_in_the_handoff(tiny_models):
    """An int4 slab's packed codes and (scale, min) pairs move as its bytes: the disaggregated
    tokens equal a colocated int4 engine's, through preemption on the small decode side."""
    hub, model = LoopbackHub(), tiny_models["llama_hd32"]
    kw = dict(model=model, max_model_len=256, kv_cache_dtype="int4")
    pe, de = LLMEngine(EngineConfig(**kw)), LLMEngine(EngineConfig(**kw, num_gpu_blocks_override=10))
    pw = PrefillRole(pe, LoopbackConnector("prefill-0", pe.runner.kv, hub))
    dw = DecodeRole(de, LoopbackConnector("decode-0", de.runner.kv, hub))
    with LLM(model, max_model_len=256, kv_cache_dtype="int4") as llm:
        ref = llm.generate(PROMPTS[:6], SP)
    outs, sent = run_disagg(pw, dw, PROMPTS[:6], SP)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    row = 32 // 2 + 4  # 16 bytes of codes + one (scale, min) pair per (token, head) row
    assert all(b % (16 * 2 * 2 * 2 * row) == 0 and b > 0 for b, _ in sent.values())  # whole blocks of 2 layers
    for w in (pw, dw):
        w.engine.kv.check_all_free()


@pytest.mark.slow
def test_seeded_sampling_is_the_same_across_the_handoff_and_preemption(pair):
    """A seeded, sampled request gives the colocated engine's tokens when one worker prefills it
    and another decodes it (whose small pool also preempts and recomputes): its noise is a
    function of (seed, output index), not of a generator the decode worker restarted."""
    pw, dw = pair
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.02, presence_penalty=0.5,
                        max_tokens=24, ignore_eos=True, seed=1234)
    ref = LLM(max_model_len=512).generate(PROMPTS[:8], sp)
    before = dw.engine.stats().num_preemptions
    outs, _ = run_disagg(pw, dw, PROMPTS[:8], sp)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert len({tuple(r.outputs[0].token_ids) for r in ref}) == 8  # sampled, not one greedy answer
    assert dw.engine.stats().num_preemptions > before
    for w in pair:
        w.engine.kv.check_all_free()


def random_request(rng: random.Random) -> tuple[str, SamplingParams]:
    """A prompt of random words and a random sampled parameter set (some greedy)."""
    words = ("sea", "wind", "blue", "count", "1,", "2,", "the", "fox", "story", "def", "x", "=", "Once")
    prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 40)))
    sp = SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9, 0.6]),
                        top_k=rng.choice([0, 1, 8, 100]), min_p=rng.choice([0.0, 0.05]),
                        presence_penalty=rng.choice([0.0, 0.8]), frequency_penalty=rng.choice([0.0, -0.5, 1.0]),
                        repetition_penalty=rng.choice([1.0, 1.3]), logprobs=rng.choice([None, 0, 3]),
                        n=rng.choice([1, 1, 2]), seed=rng.randrange(-2 ** 40, 2 ** 40),
                        max_tokens=rng.randrange(2, 20), ignore_eos=rng.random() < 0.7)
    return prompt, sp


@pytest.mark.slow
def test_random_seeded_requests_give_the_same_tokens_everywhere(pair):
    """A property over 16 random parameter sets and prompts: each seeded request's tokens and
    log-prob candidates are the same in one colocated batch, disaggregated one by one through
    a preempting decode pool, and with ngram speculation on."""
    rng = random.Random(31)
    cases = [random_request(rng) for _ in range(16)]
    prompts, params = [p for p, _ in cases], [sp for _, sp in cases]

    def flat(outs):
        return [(c.token_ids, [sorted(d) for d in c.logprobs or []]) for o in outs for c in o.outputs]

    ref = flat(LLM(max_model_len=512).generate(prompts, params))
    with LLM(max_model_len=512, speculative_config=NGRAM) as llm:
        assert flat(llm.generate(prompts, params)) == ref
    pw, dw = pair
    copies = [(p, c) for p, sp in cases for c in sp.samples()]
    outs, _ = run_disagg(pw, dw, [p for p, _ in copies], [c for _, c in copies])
    assert flat(outs) == ref
    assert len({tuple(t) for t, _ in ref}) > 12  # sampled: not one answer
    for w in pair:
        w.engine.kv.check_all_free()


def test_decode_prefix_hits_are_not_sent(pair):
    pw, dw = pair
    system = "You are a helpful assistant that answers briefly and precisely. " * 3
    first, sent1 = run_disagg(pw, dw, [system + "Why is the sky blue?"], SP)
    second, sent2 = run_disagg(pw, dw, [system + "What is rust?"], SP)
    nbytes, skip = sent2["r0"]
    assert sent1["r0"][1] == 0 and skip >= 2  # the shared system prompt was already on decode
    assert second[0].num_cached_tokens == skip * 16
    for w in pair:
        w.engine.kv.check_all_free()


def test_first_token_can_end_at_prefill(pair):
    pw, dw = pair
    outs, sent = run_disagg(pw, dw, ["Hello"], SamplingParams(temperature=0, max_tokens=1))
    assert len(outs[0].outputs[0].token_ids) == 1 and not sent
    pw.engine.kv.check_all_free()


def test_a_priority_decode_worker_reserves_for_handoffs_in_priority_order(tiny_models):
    """Handoffs waiting for 6 free blocks on a decode worker, arriving big (priority 5, 5
    blocks), small (5, 1 block), urgent (0, 3 blocks): fcfs reserves big and small and leaves
    urgent waiting; priority reserves urgent first, then big does not fit, and small, behind
    it, does not pass it."""
    ids = {"big": list(range(100, 180)), "small": list(range(200, 216)), "urgent": list(range(300, 340))}
    prio = {"big": 5, "small": 5, "urgent": 0}
    for policy, want in (("fcfs", ["big", "small"]), ("priority", ["urgent"])):
        eng = LLMEngine(EngineConfig(model=tiny_models["llama"], max_model_len=128, num_gpu_blocks_override=6,
                                     scheduling_policy=policy))
        dw = DecodeRole(eng, LoopbackConnector("decode-0", eng.runner.kv, LoopbackHub()))
        for rid in ("big", "small", "urgent"):
            dw.add(rid, valid(dw.engine, ids[rid], SamplingParams(max_tokens=4, priority=prio[rid])), "prefill-0")
        got = [ev.request_id for ev in dw._reserve() if isinstance(ev, Reserved)]
        assert got == want, policy
        for rid in list(dw.receiving) + [i.request.request_id for i in dw.backlog]:
            dw.abort(rid)
        eng.kv.check_all_free()


def test_a_prompt_whose_decode_worker_never_reserves_is_released_after_the_handoff_timeout(tiny_models):
    """The decode side aborted the request before it reserved (its client left): no target
    ever comes. The prefill side releases the prompt's blocks and fails the handoff after
    the handoff timeout, instead of holding them for good."""
    import time

    from pdserve.engine.role import Failed

    hub = LoopbackHub()
    pe = LLMEngine(EngineConfig(model=tiny_models["llama"], max_model_len=256))
    pw = PrefillRole(pe, LoopbackConnector("prefill-0", pe.runner.kv, hub), handoff_timeout_s=0.5)
    pw.add("r0", valid(pw.engine, list(range(10, 60)), SP), peer="decode-0")
    events = []
    deadline = time.monotonic() + 30
    while not any(isinstance(e, Failed) for e in events):
        assert time.monotonic() < deadline, "the unclaimed prompt was held for good"
        events += pw.step()
        time.sleep(0.01)
    failed = next(e for e in events if isinstance(e, Failed))
    assert failed.request_id == "r0" and "no KV reservation from its decode worker within 0.5 s" in failed.error
    assert pw.num_inflight == 0 and not pe.held
    pe.kv.check_all_free()


def test_a_worker_counts_the_requests_it_holds_not_its_control_commands(pair):
    """A worker's `inflight` (what status, drains and the nothing-left checks read) counts the
    requests its role holds and those still queued on its inbox. A peer to forget queued there is
    no request: counted, a worker read busy right after a peer left (a CI run's failure)."""
    import collections

    from pdserve.cluster.workers.worker_actor import WorkerActor
    from pdserve.cluster.workers.worker_commands import Add, ForgetPeer

    _, dw = pair
    worker = object.__new__(WorkerActor)  # its count alone: no actor, no engine thread
    worker.role, worker.inbox = dw, collections.deque([ForgetPeer("decode-9")])
    assert worker.inflight == 0
    params = SamplingParams(max_tokens=4)
    worker.inbox.append(Add("r1", valid(dw.engine, [5, 6, 7], params), "prefill-0"))
    assert worker.inflight == 1
    dw.add("r2", valid(dw.engine, [5, 6, 8], params), peer="prefill-0")  # waiting for its KV
    assert worker.inflight == 2


def test_a_peer_whose_host_does_not_answer_fails_what_waits_on_it_and_frees_its_blocks(tiny_models, monkeypatch):
    """transfer/probe.py on both roles: a prompt done whose decode worker's target does not come, and
    a posted receive whose prefill worker's order does not come, ask whether that peer's host
    answers; a refused connect (nothing listens there) fails each at once, `unreachable` on the
    prefill side, and frees its blocks; a peer that answers is waited for as before."""
    import socket
    import time

    import pdserve.decode.role as decode_role
    import pdserve.prefill.role as prefill_role
    from pdserve.engine.role import Emitted, Sent
    from pdserve.transfer.probe import answers as host_answers

    monkeypatch.setattr(prefill_role, "STALL_S", 0.2)
    monkeypatch.setattr(decode_role, "RECEIVE_STALL_S", 0.2)
    listening = socket.create_server(("127.0.0.1", 0))  # a host that answers
    with socket.socket() as s:  # ... and an address where nothing does (refused at once)
        s.bind(("127.0.0.1", 0))
        silent = f"127.0.0.1:{s.getsockname()[1]}"
    alive = f"127.0.0.1:{listening.getsockname()[1]}"
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    hub = LoopbackHub()
    for answers in (True, False):
        pe = LLMEngine(EngineConfig(model=tiny_models["llama"], max_model_len=128))
        de = LLMEngine(EngineConfig(model=tiny_models["llama"], max_model_len=128))
        pw = PrefillRole(pe, LoopbackConnector(f"prefill-{answers}", pe.runner.kv, hub))
        dw = DecodeRole(de, LoopbackConnector(f"decode-{answers}", de.runner.kv, hub))
        pw.addresses["decode-x"] = alive if answers else silent  # a target from it came before
        monkeypatch.setattr(dw.connector, "peer_address", lambda peer, a=answers: alive if a else silent)
        ids = list(range(5, 45))
        pw.add("p1", valid(pe, ids, sp), peer="decode-x")  # its decode worker never sends a target
        dw.add("d1", valid(de, ids, sp), peer="prefill-x")  # its prefill worker never sends the KV
        events, deadline = [], time.monotonic() + 10
        while time.monotonic() < deadline and len([e for e in events if isinstance(e, (Sent, Emitted))]) < 2:
            events += pw.step() + dw.step()
            time.sleep(0.05)
        ends = {e.request_id if isinstance(e, Sent) else e.output.request_id: e for e in events
                if isinstance(e, Sent) or (isinstance(e, Emitted) and e.output.finished)}
        if answers:  # still waiting for their peers
            assert not ends and pw.num_inflight == 1 and dw.num_inflight == 1, events
            continue
        sent, emitted = ends["p1"], ends["d1"]
        assert not sent.result.ok and sent.result.unreachable and "does not answer" in sent.result.error
        out = emitted.output.outputs[0]
        assert out.finish_reason == "error" and "does not answer" in out.stop_reason, out
        assert pw.num_inflight == 0 and dw.num_inflight == 0
        de.kv.check_all_free()
    # a probe now replaces a "no" from before the link's return; a connector's name is no address
    pw.prober._answers[alive] = (False, time.monotonic())
    assert pw.prober.verdict(alive) is False and pw.prober.check(alive) and pw.prober.verdict(alive) is True
    assert host_answers("decode-0") and not host_answers(silent)
    listening.close()
