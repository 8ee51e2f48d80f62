"""Structured output's dead ends (engine/sample/structured.py), on the engine itself: a grammar that
no token of the vocabulary can begin is refused before anything is queued; one that comes to a
dead end later ends only its own request (finish_reason "invalid", the reason as stop_reason),
frees its blocks, and the engine serves the next request. Found by the schema fuzz: the sampler
raised and took the engine thread with it."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

UNSPELLABLE = "\U000736c5\U000bc223"  # UTF-8 bytes that this byte-level vocabulary has no token for


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], max_model_len=64)


def test_a_grammar_that_cannot_begin_is_refused(llm):
    with pytest.raises(ValueError, match="'choice' cannot be produced: no token"):
        llm.generate(["hi"], SamplingParams(structured_outputs={"choice": [UNSPELLABLE]}))
    with pytest.raises(ValueError, match="'regex' cannot be produced"):
        llm.generate(["hi"], SamplingParams(structured_outputs={"regex": UNSPELLABLE + "[0-9]"}))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("spec, min_tokens, kept", [
    ({"choice": ["0" + UNSPELLABLE]}, 0, "0"),  # a character the tokenizer cannot spell, after "0"
    ({"choice": ["0"]}, 3, "0"),                # complete: only EOS is left, and min_tokens bans it
    ({"regex": ""}, 1, ""),                     # the same at the first token
])
def test_a_dead_end_ends_only_its_request(llm, spec, min_tokens, kept):
    free = llm.engine.kv.num_free_blocks
    plain = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    outs = llm.generate(["hi", "hello there"], [SamplingParams(structured_outputs=spec, min_tokens=min_tokens,
                                                              max_tokens=8), plain])
    dead, other = outs[0].outputs[0], outs[1].outputs[0]
    assert dead.finish_reason == "invalid" and dead.text == kept
    assert dead.stop_reason.startswith(f"structured_outputs: after {len(kept)} output token(s) the grammar allows")
    assert other.finish_reason == "length" and len(other.token_ids) == 6  # its batch-mate is untouched
    assert llm.generate(["hello there"], plain)[0].outputs[0].token_ids == other.token_ids  # the engine goes on
    assert llm.engine.kv.num_free_blocks == free and not llm.engine.runner.sampler.grammars.matchers
