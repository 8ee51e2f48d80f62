"""Speculative decoding (ngram): proposals and verification exactly, greedy output identical
with and without it (preemption and prefix hits in the mix), the rollback's exact blocks,
rejection sampling that keeps the target distribution, the batch-size off-switch."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.base.speculative import SpeculativeConfig
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler import ScheduledRequest, StepShape
from pdserve.engine.sample.verify import verify_greedy, verify_sampled
from pdserve.engine.spec.decode import Drafter, ngram_propose

from helpers import PROMPTS

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64}
REPEATS = ["Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the "
           "lazy dog. the quick brown", "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"]


def test_ngram_proposals():
    toks = [5, 6, 7, 8, 9, 5, 6, 7]
    assert ngram_propose(toks, 3, 3, 1) == [8, 9, 5]  # "5 6 7" occurred at 0: what followed
    assert ngram_propose(toks, 10, 3, 1) == [8, 9, 5, 6, 7]
    assert ngram_propose([1, 2, 3, 9, 2, 3], 2, 3, 2) == [9, 2]  # n=3 misses, n=2 finds "2 3"
    assert ngram_propose([1, 2, 1, 3, 1], 2, 1, 1) == [3, 1]  # the most recent earlier "1"
    assert ngram_propose([1, 2, 3, 4], 2, 3, 1) == []


def test_greedy_verification_keeps_drafts_up_to_the_first_miss():
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([7, 3, 9, 2]):
        logits[row, tok] = 1.0
    assert verify_greedy(logits.argmax(-1).tolist(), [7, 3, 9]) == [7, 3, 9, 2]  # all kept + the bonus token
    assert verify_greedy(logits.argmax(-1).tolist(), [7, 4, 9]) == [7, 3]  # the miss is replaced by the target's token
    assert verify_greedy(logits.argmax(-1).tolist(), [1, 3, 9]) == [7]


def test_rejection_sampling_keeps_the_target_distribution():
    """One-hot drafts: whatever is drafted, the first token is distributed as p (unseeded
    noise), and a seeded request's step equals what it samples without drafts."""
    from pdserve.engine.sample.sampling_noise import seeded_exponentials

    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = p.repeat(2, 1)
    n = 20000
    for draft in (0, 3):
        counts = collections.Counter(verify_sampled(probs, [draft], torch.empty(2, 4).exponential_())[0]
                                     for _ in range(n))
        chi2 = sum((counts[i] - n * p[i].item()) ** 2 / (n * p[i].item()) for i in range(4))
        assert chi2 < 16.3, (draft, counts)  # 3 degrees of freedom, p = 0.001
    for seed in range(50):  # the draws at indices 5, 6 without drafts; a kept draft continues them
        plain = (probs / seeded_exponentials(seed, 5, 2, 4, "cpu")).argmax(-1).tolist()
        for draft in range(4):
            got = verify_sampled(probs, [draft], seeded_exponentials(seed, 5, 2, 4, "cpu"))
            assert got == (plain if draft == plain[0] else plain[:1]), (seed, draft)


def test_rollback_frees_exactly_the_rejected_tail():
    kv = KVCacheManager(10, 4)
    req = Request("r", list(range(7)), SamplingParams())
    assert [b.block_id for b in kv.allocate_slots(req, 7)] == [0, 1]
    req.num_computed_tokens = 7
    assert [b.block_id for b in kv.allocate_slots(req, 6)] == [0, 1, 2, 3]  # 1 + 5 drafts: up to 13 tokens
    kv.rollback(req, 9)  # 1 draft kept: 8 computed + room for the next token
    assert kv.block_ids("r") == [0, 1, 2] and kv.num_free_blocks == 7
    assert kv.pool.eviction_order()[-1] == 3  # freed to the tail
    kv.free(req)
    kv.check_all_free()


def greedy(llm: LLM, prompts, max_tokens=40):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


@pytest.mark.slow
def test_greedy_output_is_identical_with_preemption_and_prefix_hits():
    prompts = REPEATS + PROMPTS[:4] + [REPEATS[0] + " fox"]  # the last shares the first's prefix
    with LLM(max_model_len=512) as llm:
        want = greedy(llm, prompts)
    with LLM(max_model_len=512, speculative_config=NGRAM) as llm:
        assert greedy(llm, prompts[:-1]) + greedy(llm, prompts[-1:]) == want  # the last one hits the cache
        st = llm.engine.stats().as_dict()
        assert st["spec_decode_num_accepted_tokens"] > 10 and st["prefix_cache_hits"] > 0, st
        llm.engine.kv.check_all_free()
    with LLM(max_model_len=512, speculative_config=NGRAM, num_gpu_blocks_override=12, max_num_seqs=4) as llm:
        assert greedy(llm, prompts) == want
        st = llm.engine.stats().as_dict()
        assert st["num_preemptions"] > 0 and st["spec_decode_num_accepted_tokens"] > 0, st
        llm.engine.kv.check_all_free()


@pytest.mark.slow
def test_seeded_requests_sample_the_same_tokens_with_speculation():
    """Verification draws row j at the request's output index + j, as plain sampling would:
    seeded requests (temperature, top-p, min-p, n = 2) give the same tokens with ngram drafts,
    of which many are kept."""
    sp = SamplingParams(temperature=0.8, top_p=0.95, min_p=0.01, n=2, max_tokens=24, seed=77, ignore_eos=True)
    got = []
    for spec in (None, NGRAM):
        with LLM(max_model_len=256, speculative_config=spec) as llm:
            got.append([[c.token_ids for c in o.outputs] for o in llm.generate(REPEATS, sp)])
            if spec:
                assert llm.engine.stats().spec.num_accepted_tokens > 10, llm.engine.stats()
    assert got[0] == got[1]
    assert any(a != b for a, b in got[0])  # the two copies differ (seeds 77, 78)


@pytest.mark.slow
def test_sampled_output_keeps_the_target_distribution():
    """The default model sampled (temperature 1, top_k 3) on a counting prompt, where ngram
    drafts are often accepted: the tokens at output positions 1-4, over 150 seeded requests
    each way, come from the same distribution with and without speculation (chi-square
    homogeneity test; test_rejection_sampling_keeps_the_target_distribution tests the sampler
    itself on 20,000 draws)."""
    prompt = "Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=5, seed=i, ignore_eos=True) for i in range(150)]
    counts = []
    for spec in (None, NGRAM):
        with LLM(max_model_len=128, speculative_config=spec) as llm:
            outs = [o.outputs[0].token_ids for i in range(0, 150, 50)
                    for o in llm.generate([prompt] * 50, params[i:i + 50])]
            if spec:
                st = llm.engine.stats().as_dict()
                assert st["spec_decode_num_accepted_tokens"] > 105 and st["spec_decode_steps_off"] == 0, st
        counts.append(collections.Counter((pos, o[pos]) for o in outs for pos in (1, 2, 3, 4)))
    keys = [k for k in set(counts[0]) | set(counts[1]) if counts[0][k] + counts[1][k] >= 5]
    chi2 = sum((counts[0][k] - counts[1][k]) ** 2 / (counts[0][k] + counts[1][k]) for k in keys)
    dof = max(1, len(keys) - 4)
    assert chi2 < dof + 4 * math.sqrt(2 * dof), (chi2, dof, counts)


def test_steps_with_speculation_off_overlap_like_plain_steps():
    """A step the off-switch runs without drafts is a plain step: it overlaps with the one
    before (core/overlap.py), as without speculation (it ran in turn: at batch 64 on an H200 the
    switched-off engine made 0.67x the tokens of one without speculation); the tokens are the
    same, and once drafts pay again the step in flight is resolved first."""
    prompts = REPEATS + PROMPTS[:2]
    params = [SamplingParams(max_tokens=8 + 6 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    with LLM(max_model_len=256) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(max_model_len=256, speculative_config={**NGRAM, "disable_by_batch_size": 2}) as llm:
        eng, overlapped = llm.engine, 0
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(eng.tokenize(p), sp, request_id=f"q{i}")
        got = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                got[out.request_id] = out.outputs[0].token_ids
            overlapped += eng.pending is not None
        st = eng.stats().as_dict()
        assert overlapped > 0 and st["spec_decode_steps_off"] > 0 and st["spec_decode_num_drafts"] > 0, st
        assert [got[f"q{i}"] for i in range(len(prompts))] == want
        eng.kv.check_all_free()


def test_large_batches_turn_speculation_off():
    with LLM(max_model_len=256, speculative_config={**NGRAM, "disable_by_batch_size": 2}) as llm:
        greedy(llm, REPEATS + PROMPTS[:2], max_tokens=8)
        st = llm.engine.stats().as_dict()
        assert st["spec_decode_steps_off"] > 0
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1, got 0"):
        LLM(max_model_len=64, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3})


@pytest.mark.slow
def test_draft_model_proposals(tiny_models):
    """The draft model keeps its own paged KV per request (spec/draft.py). Drafting with the
    target itself is accepted in full; an unrelated random draft rarely is; both give the
    target's greedy tokens, and every draft block is freed when requests end."""
    from pdserve.engine.exec.loader import resolve_model_path

    prompts = REPEATS + PROMPTS[:3]
    with LLM(max_model_len=256) as llm:
        want = greedy(llm, prompts, 24)
    for draft, least in ((resolve_model_path(None), 0.95), (tiny_models["llama"], 0.0)):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": 64}
        with LLM(max_model_len=256, speculative_config=spec) as llm:
            assert greedy(llm, prompts, 24) == want
            st = llm.engine.stats().as_dict()
            assert st["spec_decode_num_draft_tokens"] > 0 and st["spec_decode_acceptance_rate"] >= least, st
            assert not llm.engine.drafter.draft.shadows
            llm.engine.drafter.draft.kv.check_all_free()
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verification_in_the_decode_graph_layout(backend, tiny_models):
    """The GPU path on CPU: with the graph layouts every all-decode step, drafts included, runs
    in the decode graphs' layout (a row per query token through the paged-decode kernel; on
    CUDA the captured graphs replay it). The draft is the plain run's own continuation with every third
    token corrupted: the kept ones are accepted, output equals plain decoding's, nothing leaks."""
    if backend == "triton":
        pytest.importorskip("triton")
    prompts = PROMPTS[:3]
    kw = dict(model=tiny_models["llama"], max_model_len=128, attention_backend=backend)
    with LLM(**kw) as llm:
        want = greedy(llm, prompts, 16)
    with LLM(**kw, speculative_config=NGRAM) as llm:
        runner, flat = llm.engine.runner, []
        runner.use_graph_layouts()
        real = runner.graphs.run_decode
        runner.graphs.run_decode = lambda inp, *a: flat.append(inp.num_rows) or real(inp, *a)
        cont = {tuple(llm.engine.tokenizer.encode(p)): w for p, w in zip(prompts, want)}

        def oracle(req, room):
            c, m = cont[tuple(req.prompt_token_ids)], req.num_output_tokens
            return [t if (m + j) % 3 else 0 for j, t in enumerate(c[m:m + room])]

        llm.engine.drafter.proposer = oracle
        assert greedy(llm, prompts, 16) == want
        st = llm.engine.stats().as_dict()
        assert st["spec_decode_acceptance_rate"] > 0.3 and st["spec_decode_mean_accepted_length"] > 1.5, st
        assert max(flat) > len(prompts), flat  # steps with k + 1 rows per request
        llm.engine.kv.check_all_free()


def switch_on(graphs: dict[int, float]):
    """A spec off-switch over a fresh step-time model with this start-up decode-graph table."""
    from pdserve.engine.core.step_model import StepModel
    from pdserve.engine.spec.switch import SpecSwitch

    return SpecSwitch(StepModel(8192, graphs=graphs))


def decode_step(switch, b: int, drafts: int, context: int = 100) -> None:
    """An all-decode step of b requests carrying `drafts` draft rows ran and took what the
    model says (the engine times it into the step model; the switch counts it)."""
    rows = b + drafts
    switch.model.observe(StepShape(decodes=b, draft_rows=drafts, kv_tokens=rows * context),
                         switch.seconds(rows, context))
    switch.stepped(drafts > 0)


def test_the_step_model_turns_speculation_off_when_it_does_not_pay():
    """The off-switch (spec/switch.py) asks the engine's one step-time model, on start-up
    tables like the ones the runner measures on CUDA: flat (weight-bound) pays at any
    acceptance; steep (compute-bound) pays only at high acceptance; drafts beyond the largest
    graph never; a probe every PROBE_EVERY steps; the fit of measured steps replaces what the
    start-up table misses, and the chunk and the switch read the same fit."""
    from pdserve.engine.core.step_model import StepModel
    from pdserve.engine.spec.switch import PROBE_EVERY, SpecSwitch

    sizes = (1, 2, 4, 8, 16)
    assert SpecSwitch().pays([4, 4], 100) and SpecSwitch(StepModel(8192)).pays([4, 4], 100)  # no table (CPU)
    c = switch_on({b: 0.010 for b in sizes})
    assert c.pays([4, 4], 100) and c.acceptance() == 0.5
    c = switch_on({b: 0.001 * b for b in sizes})  # time grows with rows
    assert not c.pays([4, 4], 100)  # 10 rows cost 8x two; 1/2 acceptance yields < 2x tokens
    c.recent = [10_000, 10]  # ~all accepted: 5 tokens per request for 8x the time
    assert not c.pays([4, 4], 100)
    c = switch_on({b: 0.001 * (1 + b / 4) for b in sizes})
    c.recent = [10_000, 10]
    assert c.pays([4, 4], 100)  # 3.5x the time, ~5x the tokens
    assert not c.pays([4, 4, 4, 4], 100)  # 20 rows: beyond the largest graph
    for accepted, probes in ((0, True), (4, False)):  # nothing accepted: spec probes; all: plain probes
        c = switch_on({b: 0.001 * (1 + b / 4) for b in sizes})
        c.verified([accepted] * 10_000, [4] * 10_000)
        said = []
        for _ in range(3 * PROBE_EVERY + 3):
            said.append(c.plan(2, 4, 100) and c.pays([4, 4], 100))
            decode_step(c, 2, 8 if said[-1] else 0)
        assert said.count(probes) == 3 and said[PROBE_EVERY] == probes, said
    # flat at start-up, but measured: 2 rows take 20 ms, 10 rows 40 ms (host work, KV reads)
    c = switch_on({b: 0.010 for b in sizes})
    for _ in range(8):
        for rows, seconds in ((2, 0.020), (10, 0.040)):
            c.model.observe(StepShape(decodes=2, draft_rows=rows - 2, kv_tokens=rows * 100), seconds)
    assert c.seconds(2, 100) == pytest.approx(0.020, rel=1e-3) and c.seconds(10, 100) == pytest.approx(0.040, rel=1e-3)
    assert not c.pays([4, 4], 100)  # 1/2 acceptance: 1.94x tokens for 2x time
    assert c.model.coef is not None and not c.model.prefill_fitted  # a decode worker's fit: no chunk yet
    # the drafter counts all-decode steps only (its probes); the engine's model times every step
    d = Drafter(SpeculativeConfig.from_dict(NGRAM))
    d.switch = switch_on({b: 0.010 for b in sizes})
    two = [ScheduledRequest(Request(f"r{i}", [1, 2], SamplingParams()), 5, [], [7, 7, 7, 7]) for i in range(2)]
    d.observe(StepShape.of(two))
    d.observe(StepShape.of(two[:1] + [ScheduledRequest(Request("p", [1] * 9, SamplingParams()), 8, [])]))
    assert (d.switch.since_plain, d.switch.since_spec) == (1, 0)


def test_a_probe_while_off_drafts_for_a_rotating_few():
    """While the cost model keeps speculation off, a probe (one step in PROBE_EVERY) drafts for
    ceil(B / PROBE_SHARE) of the B decodes, the next ones each time: the acceptance estimate
    needs a sample, and a probe of the whole batch cost batch 64 8% of its tokens (H100)."""
    from pdserve.engine.spec.switch import PROBE_EVERY, PROBE_SHARE

    d = Drafter(SpeculativeConfig.from_dict(NGRAM))
    d.switch = switch_on({b: 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64, 128)})  # compute-bound: off
    d.switch.verified([0] * 1000, [4] * 1000)  # nothing accepted lately
    d.proposer = lambda req, room: [7] * room
    reqs = []
    for i in range(16):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100))
        r.num_computed_tokens = 3
        r.append_token(5)
        reqs.append(r)
    drafted = []
    for _ in range(2 * PROBE_EVERY + 2):
        d.decide(reqs)
        d.propose(reqs)
        drafted.append([r.request_id for r in reqs if r.spec_tokens])
        decode_step(d.switch, 16, 4 * len(drafted[-1]))
    probes = [ids for ids in drafted if ids]
    width = -(-16 // PROBE_SHARE)
    assert probes == [[f"r{i}" for i in range(width)], [f"r{i}" for i in range(width, 2 * width)]], drafted
    assert drafted.index(probes[0]) == PROBE_EVERY and d.steps_off == len(drafted) - 2


def test_a_step_decided_with_drafts_whose_decodes_then_finish():
    """decide() sees the decodes of a step still in flight; once it resolves they may all have
    finished: propose() then drafts for none (it divided by their count: a ZeroDivisionError
    on an H200 at batch 1)."""
    d = Drafter(SpeculativeConfig.from_dict(NGRAM))
    d.proposer = lambda req, room: [7] * room
    r = Request("r0", [1, 2, 3], SamplingParams(max_tokens=100))
    r.num_computed_tokens = 3
    r.append_token(5)
    assert d.decide([r])
    d.propose([])
    assert r.spec_tokens == []
