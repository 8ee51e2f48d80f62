import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams


def reqs(params, ids):
    return [Request(i, [1], p) for p, i in zip(params, ids)]


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n must be an integer in \\[1, 16\\]"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": 1 << 63}, "seed must be an integer in"),  # a torch.Generator overflowed: the step raised
])
def test_invalid_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_greedy_top_k_top_p_and_seed():
    s = Sampler(torch.device("cpu"))
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    assert s(logits, reqs([SamplingParams(temperature=0)] * 2, ["a", "b"])) == [0, 0]
    # top_k=2 never draws beyond the two most likely tokens
    draws = {t for i in range(200)
             for t in s(logits[:1], reqs([SamplingParams(top_k=2, seed=i)], [f"k{i}"]))}
    assert draws == {0, 1}
    # top_p=0.7: 0.5 + 0.3 reaches it, so tokens 2 and 3 never appear
    draws = {t for i in range(200)
             for t in s(logits[:1], reqs([SamplingParams(top_p=0.7, seed=i)], [f"p{i}"]))}
    assert draws == {0, 1}
    # a seeded request samples the same sequence whatever shares its batch
    flat = torch.zeros(1, 1000)
    seq_alone = [s(flat, reqs([SamplingParams(seed=7)], ["x"]))[0] for _ in range(5)]
    s.forget("x")
    seq_batched = [s(flat.repeat(3, 1), reqs([SamplingParams(), SamplingParams(seed=7), SamplingParams()],
                                              ["y", "x", "z"]))[1] for _ in range(5)]
    assert seq_alone == seq_batched and len(set(seq_alone)) > 1


def test_sampling_follows_distribution():
    s = Sampler(torch.device("cpu"))
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    torch.manual_seed(0)
    toks = torch.tensor(s(logits, reqs([SamplingParams()] * 4000, [str(i) for i in range(4000)])))
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_n_completions_share_the_prompt_blocks():
    """n > 1: n sequences of one prompt (seeded copies take seed, seed + 1, ...), the copies
    admitted after the first has prefilled, so they hit its blocks in the prefix cache."""
    from pdserve import LLM

    prompt = "Once upon a time, in a land far away, there lived a curious fox who " * 3
    with LLM(max_model_len=256) as llm:
        out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8))[0]
        assert [c.index for c in out.outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in out.outputs}) > 1
        singles = [llm.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8))[0]
                   for i in range(3)]
        assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in singles]
        assert llm.engine.stats()["prefix_cache_hits"] >= 2 * 48  # two copies x the prompt's full blocks
        with pytest.raises(ValueError, match="an engine request is one sequence"):
            llm.engine.make_request(prompt, SamplingParams(n=2))
        llm.engine.kv.check_all_free()


def test_extreme_values_found_by_the_fuzz():
    """Values the schema fuzz sent that raised inside a step (failing every request batched with
    them): a top_k beyond int64, a top_p below float32's smallest (0 on the device: every token
    dropped, NaN, token 0 every time)."""
    s = Sampler(torch.device("cpu"))
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1]]))
    assert s(logits.clone(), reqs([SamplingParams(top_k=1 << 70, top_p=0.5, seed=1)], "a")) == [1]
    assert s(logits.clone(), reqs([SamplingParams(top_p=1e-300, seed=2)], "b")) == [1]  # the top token stays
