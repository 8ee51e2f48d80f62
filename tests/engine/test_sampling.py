import pytest
import torch

from pdserve.engine.core.request import Request
from pdserve.engine.sample.sampler import Sampler
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
    ({"priority": "1"}, "priority must be an integer"),
    ({"priority": 1.0}, "priority must be an integer"),
    ({"priority": True}, "priority must be an integer"),
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
    # a seeded request samples the same sequence whatever shares its batch, and keeps no state in
    # the sampler: another sampler (another worker) continues it from its output index
    flat = torch.zeros(1, 1000)

    def run(sampler, req, others: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            batch = reqs([SamplingParams()] * others, [f"o{i}" for i in range(others)]) + [req]
            out.append(sampler(flat.repeat(len(batch), 1), batch)[-1])
            req.append_token(out[-1])
        return out

    seq_alone = run(s, Request("x", [1], SamplingParams(seed=7)), 0, 6)
    moved = Request("x", [1], SamplingParams(seed=7))
    seq_batched = run(s, moved, 2, 3) + run(Sampler(torch.device("cpu")), moved, 1, 3)
    assert seq_alone == seq_batched and len(set(seq_alone)) > 1
    assert run(s, Request("x", [1], SamplingParams(seed=8)), 0, 6) != seq_alone


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
        assert llm.engine.stats().cache.prefix_hits >= 2 * 48  # two copies x the prompt's full blocks
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


def test_seeded_noise_is_a_pure_function_with_exponential_marginals():
    """sampling_noise: the same (seed, index) gives the same draws in any batch and call;
    neighbouring seeds and indices give unrelated ones; the draws are Exp(1) (mean, and the
    share below the median ln 2) and sampling with them follows p."""
    import collections
    import math

    from pdserve.engine.sample.sampling_noise import exponentials, seeded_exponentials, stream_keys

    a = seeded_exponentials(-5, 3, 4, 5000, "cpu")
    assert torch.equal(a[1:3], seeded_exponentials(-5, 4, 2, 5000, "cpu"))
    assert torch.equal(a[0], exponentials([stream_keys(9, 0), stream_keys(-5, 3)], 5000, "cpu")[1])
    b = seeded_exponentials(-4, 3, 4, 5000, "cpu")
    assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.02
    assert abs(a.mean().item() - 1) < 0.02 and abs((a < math.log(2)).float().mean().item() - 0.5) < 0.01
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    draws = (p / seeded_exponentials(1234, 0, n, 4, "cpu")).argmax(-1).tolist()  # one seed, n indices
    counts = collections.Counter(draws)
    chi2 = sum((counts[i] - n * p[i].item()) ** 2 / (n * p[i].item()) for i in range(4))
    assert chi2 < 16.3, counts  # 3 degrees of freedom, p = 0.001


def test_seeded_noise_is_never_zero_so_a_masked_token_is_never_drawn():
    """Every 32-bit hash maps to a uniform strictly inside (0, 1), so E > 0 everywhere: with
    E = 0 a token the grammar masked (p = 0) became 0 / 0 = NaN and won the argmax (a
    json_object request at seed 0 sampled ' clone' after '{' and ended 'invalid')."""
    from pdserve.engine.sample.sampling_noise import uniform

    h = torch.tensor([0, 1, 511, 512, (1 << 31), (1 << 32) - 512, (1 << 32) - 1], dtype=torch.int64)
    u = uniform(h)
    assert (u > 0).all() and (u < 1).all() and (-torch.log(u) > 0).all(), u
    assert torch.equal(u[:3], u[:1].expand(3)) and u[3] > u[2]  # the top 23 bits, in order
    p = torch.tensor([[0.0, 1.0]])
    noise = -torch.log(uniform(torch.tensor([[(1 << 32) - 1, 0]], dtype=torch.int64)))
    assert (p / noise).argmax(-1).item() == 1


def _reference_draw(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """The exponential race computed from the parameters themselves, row by row (no slots)."""
    from pdserve.engine.sample.sampling_noise import seeded_exponentials

    out = []
    for x, p, i in zip(logits, params, indices):
        if p.greedy:
            out.append(int(x.argmax()))
            continue
        x = x / torch.tensor(p.temperature, dtype=torch.float32)
        order = x.argsort(descending=True)
        keep = torch.zeros_like(x, dtype=torch.bool)
        k = p.top_k if 0 < p.top_k < len(x) else len(x)
        pr = x[order][:k].softmax(-1)
        n = max(1, int(((pr.cumsum(-1) - pr) < torch.tensor(p.top_p, dtype=torch.float32)).sum()))
        keep[order[:n]] = True
        probs = x.masked_fill(~keep, float("-inf")).softmax(-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < torch.tensor(p.min_p, dtype=torch.float32) * probs.max(), 0.0)
            probs = probs / probs.sum()
        assert p.seed is not None
        out.append(int((probs / seeded_exponentials(p.seed, i, 1, len(x), "cpu")[0]).argmax()))
    return out


def test_a_batchs_draws_equal_each_rows_own_reference_whatever_shares_it():
    """The batched race (temperature, top-k, top-p, min-p, seeds, greedy rows beside sampled ones)
    draws what each row's parameters give alone, step after step, in any row order."""
    torch.manual_seed(0)
    s = Sampler(torch.device("cpu"))
    params = [SamplingParams(temperature=0.7, top_k=20, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_p=0.8, seed=2), SamplingParams(min_p=0.1, seed=3),
              SamplingParams(temperature=0.9, top_k=5, top_p=0.5, min_p=0.05, seed=-4)]
    batch = reqs(params, [f"r{i}" for i in range(len(params))])
    for step in range(5):
        logits = torch.randn(len(batch), 300)
        got = s(logits.clone(), batch)
        assert got == _reference_draw(logits, params, [r.num_output_tokens for r in batch]), step
        for r, t in zip(batch, got):
            r.append_token(t)
        batch = batch[1:] + batch[:1]  # each request in another row next step
        params = params[1:] + params[:1]


def test_a_steps_row_parameters_come_from_each_requests_row_as_contiguous_vectors():
    """RowParams: one [5, rows] array whose rows are the parameters, contiguous (a strided
    [rows, 1] operand makes the [rows, vocab] kernels non-vectorized on the GPU); a greedy row's
    temperature is 1, top_k <= 0 keeps the whole vocabulary, and a request's row is computed once."""
    from pdserve.engine.sample.sampler import RowParams

    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_k=-1)]
    reqs = [Request(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
    rows = RowParams.of([r.sampling_row for r in reqs], "cpu")
    for t in (rows.temperature, rows.top_p, rows.min_p, rows.top_k):
        assert t.is_contiguous() and t.dtype == torch.float32 and t.shape == (3,)
    assert torch.allclose(rows.temperature, torch.tensor([0.7, 1.0, 1.3]))
    assert torch.allclose(rows.top_p, torch.tensor([0.9, 1.0, 1.0]))
    assert torch.allclose(rows.min_p, torch.tensor([0.1, 0.0, 0.0]))
    assert rows.top_k.tolist() == [5.0, float("inf"), float("inf")]
    assert rows.greedy.tolist() == [False, True, False]
    assert reqs[0].sampling_row is reqs[0].sampling_row  # cached on the request
