"""Per-request logit adjustments (sample/logits_process.py) and min-p, exactly on small tensors, then
their effect through the engine: penalties cut repetition, logit_bias forces a token."""

from __future__ import annotations

import collections

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.core.request import Request
from pdserve.engine.sample.logits_process import process
from pdserve.engine.sample.sampler import Sampler
from pdserve.engine.sampling_params import InvalidParam


def req(rid="r", prompt=(1, 2), out=(), **sp) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**sp), eos_token_ids=(0,))
    for t in out:
        r.append_token(t)
    return r


def test_adjustments_exactly():
    base = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0, -2.0]])
    x = base.clone()
    process(x, [req(out=(3, 3, 4), frequency_penalty=0.5, presence_penalty=0.25)])
    # token 3 twice in the output: 3 - 2 x 0.5 - 0.25; token 4 once: 1 - 0.5 - 0.25; the prompt (1, 2) untouched
    assert x.tolist() == [[2.0, -1.0, 0.5, 1.75, 0.25, -2.0]]
    x = base.clone()
    process(x, [req(prompt=(1, 2), out=(3,), repetition_penalty=2.0)])
    assert x.tolist() == [[2.0, -2.0, 0.25, 1.5, 1.0, -2.0]]  # seen: positive / 2, negative x 2
    x = base.clone()
    process(x, [req(logit_bias={"5": 100, 0: -100}, min_tokens=2)])
    assert x[0, 5] == 98.0 and x[0, 0] == float("-inf")  # EOS (0) banned before min_tokens too
    x = base.clone()
    process(x, [req(allowed_token_ids=[4, 1], logit_bias={1: 1.0})])
    assert x.tolist() == [[float("-inf"), 0.0, float("-inf"), float("-inf"), 1.0, float("-inf")]]
    x = base.repeat(2, 1)
    process(x, [req("a"), req("b", out=(3,), presence_penalty=1.0)])
    assert x[0].tolist() == base[0].tolist() and x[1, 3] == 2.0  # only the asking row changes


def test_min_p_and_the_sampler():
    s = Sampler(torch.device("cpu"))
    probs = s.probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), [SamplingParams(min_p=0.2)])
    assert probs[0, 3] == 0 and torch.allclose(probs[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    logits = torch.zeros(1, 8)
    assert s(logits, [req(temperature=0, logit_bias={6: 5})]) == [6]
    counts = collections.Counter(s(torch.zeros(1, 8), [req(f"r{i}", temperature=1.0, logit_bias={2: 100})])[0]
                                 for i in range(50))
    assert counts == {2: 50}


@pytest.mark.parametrize("bad, match", [
    ({"presence_penalty": 3}, "presence_penalty must be in"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p must be in"), ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {5: 101}}, "values in \\[-100, 100\\]"), ({"frequency_penalty": True}, "frequency_penalty"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"), ({"prompt_logprobs": 21}, "prompt_logprobs must be")])
def test_bad_values_are_refused(bad, match):
    """Each refusal names its parameter as data (InvalidParam.param), not only in its text: the
    router's 400 reads it (it matched message prefixes)."""
    with pytest.raises(InvalidParam, match=match) as e:
        SamplingParams(**bad)
    assert e.value.param == next(iter(bad))
    with pytest.raises(InvalidParam) as e:
        SamplingParams(structured_outputs={"regex": 3})
    assert e.value.param == "structured_outputs"


@pytest.mark.slow
def test_penalties_and_bias_through_the_engine():
    """The default model on a prompt that invites repetition: frequency and repetition penalties
    cut the most repeated token's count; a +100 bias makes every token the biased one."""
    prompt = "Say the word 'yes' many times: yes yes yes yes"
    with LLM(max_model_len=256) as llm:
        def top_count(**kw) -> int:
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **kw))
            return collections.Counter(out[0].outputs[0].token_ids).most_common(1)[0][1]

        plain = top_count()
        assert plain >= 8
        assert top_count(frequency_penalty=1.5) < plain / 2
        assert top_count(repetition_penalty=2.0) < plain
        tok = llm.engine.tokenizer.encode(" banana")[0]
        out = llm.generate([prompt], SamplingParams(temperature=0.8, max_tokens=6, seed=1, logit_bias={tok: 100}))
        assert out[0].outputs[0].token_ids == [tok] * 6
        llm.engine.kv.check_all_free()


@pytest.mark.slow
def test_structured_outputs_hold_their_grammar():
    """A JSON schema, any JSON, a regex and a choice: sampled output (temperature 0.8) parses
    and validates; a grammar that does not compile is refused before anything is queued."""
    import json
    import re

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    with LLM(max_model_len=256) as llm:
        def run(spec, n=3):  # n seeds in one batch
            outs = llm.chat([ask] * n, [SamplingParams(temperature=0.8, seed=s, max_tokens=80, structured_outputs=spec)
                                        for s in range(n)])
            return [o.outputs[0] for o in outs]

        for o in run({"json": schema}):
            doc = json.loads(o.text)
            assert o.finish_reason == "stop" and set(doc) == {"name", "age"} and isinstance(doc["age"], int)
        objects = run({"json_object": True}, 4)  # an object, as OpenAI's json_object means (no array)
        assert all(o.finish_reason in ("stop", "length") for o in objects), [o.stop_reason for o in objects]
        assert all(isinstance(json.loads(o.text), dict) for o in objects if o.finish_reason == "stop")
        assert any(o.finish_reason == "stop" for o in objects)
        assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", o.text) for o in run({"regex": "[0-9]{3}-[0-9]{4}"}))
        assert {o.text for o in run({"choice": ["red", "green", "blue"]}, 4)} <= {"red", "green", "blue"}
        with pytest.raises(ValueError, match="does not compile"):
            llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(("}))
        with pytest.raises(ValueError, match="structured_outputs must be one of"):
            SamplingParams(structured_outputs={"yaml": "x"})
        llm.engine.kv.check_all_free()
        assert not llm.engine.runner.sampler.grammars.matchers
