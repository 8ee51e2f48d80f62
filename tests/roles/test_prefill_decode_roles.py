"""Prefill and decode as roles of one engine, joined by the loopback transfer backend
in one process: the disaggregated path gives the colocated engine's greedy tokens."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.decode.worker import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.prefill.worker import PrefillWorker
from pdserve.transfer.loopback import LoopbackConnector, LoopbackHub

from helpers import PROMPTS

SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    hub = LoopbackHub()
    pe = LLMEngine(EngineConfig(max_model_len=512))
    de = LLMEngine(EngineConfig(max_model_len=512, num_gpu_blocks_override=16))  # small: forces preemption
    return (PrefillWorker(pe, LoopbackConnector("prefill-0", pe.runner.kv, hub)),
            DecodeWorker(de, LoopbackConnector("decode-0", de.runner.kv, hub)))


def run_disagg(pw: PrefillWorker, dw: DecodeWorker, prompts, params):
    finals, sent = {}, {}
    for i, p in enumerate(prompts):
        pw.add(p, params, f"r{i}")
    while pw.engine.has_unfinished_requests():
        for done in pw.step():
            if done.finished:
                finals[done.request_id] = done.output
                continue
            while (res := dw.reserve(done.prompt_token_ids, params, done.request_id, done.first_token)) is None:
                for out in dw.step():  # decode frees blocks as requests finish
                    if out.finished:
                        finals[out.request_id] = out
            fill, skip = res
            ch = dw.new_channel("prefill-0")
            dw.recv(done.request_id, "prefill-0", fill, ch)
            h = pw.send(done.request_id, "decode-0", "", skip, ch)
            sent[done.request_id] = (h.nbytes, skip)
            for h in pw.poll():
                assert h.state.name == "DONE", h.error
            for out in dw.poll():
                if out.finished:
                    finals[out.request_id] = out
    while dw.engine.has_unfinished_requests():
        for out in dw.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[f"r{i}"] for i in range(len(prompts))], sent


def test_disaggregated_equals_colocated(pair):
    pw, dw = pair
    ref = LLM(max_model_len=512).generate(PROMPTS[:8], SP)
    outs, _ = run_disagg(pw, dw, PROMPTS[:8], SP)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert [o.outputs[0].text for o in outs] == [r.outputs[0].text for r in ref]
    assert dw.engine.stats()["num_preemptions"] > 0  # the small decode pool recomputed on itself
    for w in pair:
        w.engine.kv.check_all_free()
        assert w.is_idle()


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
