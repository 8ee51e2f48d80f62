"""The overlapped step (engine/core/overlap.py): with async_scheduling on, the engine queues step
n+1 before it reads step n's tokens, and its outputs are token for token those of the step
in turn: greedy and seeded sampling, EOS, stop strings, length limits, chunked prefill,
prefix hits, preemption, aborts, the graphs' layouts; requests that need the host between
steps (log-probs, penalties, grammars) switch the engine to steps in turn and back."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.request import PENDING
from pdserve.engine.engine import LLMEngine

from helpers import PROMPTS


def params(i: int, **kw) -> SamplingParams:
    """A mix: greedy and seeded, EOS or not, lengths from 3 to 25."""
    return SamplingParams(temperature=0 if i % 3 else 0.9, seed=i if i % 3 == 0 else None, max_tokens=3 + 2 * i,
                          ignore_eos=i % 2 == 0, **kw)


def with_stops(model: str, prompts: list, sps: list) -> list:
    """Requests 4 and 7 (greedy) get a stop string and a stop token that their own output
    reaches mid-way (a random model's text has no predictable word)."""
    with LLM(model=model, max_model_len=256) as llm:
        tok = llm.engine.tokenizer
        (a, b) = [o.outputs[0].token_ids for o in llm.generate([prompts[4], prompts[7]], [sps[4], sps[7]])]
    sps = list(sps)
    sps[4] = dataclasses.replace(sps[4], stop=[tok.decode(a[3:5]).strip()[:6]])
    sps[7] = dataclasses.replace(sps[7], stop_token_ids=[b[5]])
    return sps


def run(model: str, overlap: bool, prompts: list, sps: list, abort_at: dict | None = None, **kw):
    """Each request's (token ids, text, finish reason); the steps, how many ran overlapped."""
    eng = LLMEngine(EngineConfig(model=model, max_model_len=256, async_scheduling=overlap, **kw))
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        eng.add_request(p, sp, f"r{i}")
    out, steps, overlapped = {}, 0, 0
    while eng.has_unfinished_requests():
        for rid, at in (abort_at or {}).items():
            if steps == at:
                eng.abort_request(rid)
        for o in eng.step():
            c = o.outputs[0]
            assert PENDING not in c.token_ids
            if o.finished:
                out[o.request_id] = (c.token_ids, c.text, c.finish_reason)
        steps += 1
        overlapped += eng.pending is not None
    eng.kv.check_all_free()
    return out, steps, overlapped, eng


SHARED = "The history of the city begins with a small village by the river, and then "
PROMPTS12 = [SHARED * (i % 2) + PROMPTS[i % len(PROMPTS)] + " and" * i for i in range(12)]


@pytest.mark.parametrize("kw", [{}, {"num_gpu_blocks_override": 10}, {"max_num_batched_tokens": 32, "max_num_seqs": 6}],
                         ids=["plain", "preemption", "chunks"])
def test_overlapped_steps_give_the_same_tokens(kw, tiny_models):
    sps = with_stops(tiny_models["llama"], PROMPTS12, [params(i) for i in range(12)])
    prompts = PROMPTS12 + PROMPTS12[:4]  # the repeats: prefix-cache hits
    sps += sps[:4]
    want, *_ = run(tiny_models["llama"], False, prompts, sps, **kw)
    got, steps, overlapped, eng = run(tiny_models["llama"], True, prompts, sps, **kw)
    assert got == want
    assert overlapped >= steps - 2  # all but the last: one in flight at every step's end
    assert {r[2] for r in got.values()} == {"length", "stop"}
    if "num_gpu_blocks_override" in kw:
        assert eng.scheduler.num_preemptions > 0
    if "max_num_seqs" in kw:  # later requests find the earlier ones' blocks
        assert eng.kv.prefix_hits > 0


def test_aborts_while_a_step_is_in_flight(tiny_models):
    sps = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in range(6)]
    abort_at = {"r1": 3, "r4": 10, "r5": 0}
    want, *_ = run(tiny_models["llama"], False, PROMPTS[:6], sps, abort_at)
    got, *_ = run(tiny_models["llama"], True, PROMPTS[:6], sps, abort_at)
    assert got == want and set(got) == {"r0", "r2", "r3"}


def test_requests_that_need_the_host_between_steps_run_in_turn(tiny_models):
    """Log-probs, penalties, a grammar: while one is live the engine steps in turn (nothing in
    flight at a step's end); their outputs and the others' match the engine without overlap."""
    sps = [params(i) for i in range(6)]
    sps[1] = params(1, logprobs=2)
    sps[3] = params(3, repetition_penalty=1.3)
    sps[5] = params(5, structured_outputs={"regex": "[a-z ]{1,12}"})
    want, *_ = run(tiny_models["llama"], False, PROMPTS[:6], sps)
    got, steps, overlapped, eng = run(tiny_models["llama"], True, PROMPTS[:6], sps)
    assert got == want
    assert 0 < overlapped < steps - 2  # in turn while those ran, overlapped once they were done
    assert not eng._in_turn


@pytest.mark.slow
def test_graph_layouts_patch_pending_tokens_on_the_device(tiny_models):
    """The decode graphs' and the pieces' static buffers take the pending ids (patched on the
    device), as the eager path's ids do."""
    kw = dict(model=tiny_models["mistral"], max_model_len=256, max_num_batched_tokens=24, max_num_seqs=4)
    sp = [params(i) for i in range(6)]
    with LLM(**kw, async_scheduling=False) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], sp)]
    with LLM(**kw) as llm:
        llm.engine.runner.use_graph_layouts()
        patched = []
        patcher = llm.engine.runner._patcher
        llm.engine.runner._patcher = lambda pending: patched.append(pending is not None and len(pending[0])) \
            or patcher(pending)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], sp)]
        llm.engine.kv.check_all_free()
    assert got == want and sum(patched) > 20
