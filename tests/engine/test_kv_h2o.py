"""Heavy-hitter eviction (`kv_evict="h2o"`, engine/base/kv_window.py; docs/design/h2o.md): with the
budget above the sequence the tokens equal the unbounded cache's; each block's score is the
attention mass Hugging Face's own eager attention puts on its tokens (every layer, head and
query); past the budget the least attended blocks go, the kept keys rotated to their cache
positions (layer 0's K and V equal a fresh run over the kept tokens); bad settings are refused
by name."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_with_the_budget_above_the_sequence_tokens_equal_the_unbounded_cache(tiny_models, kind):
    prompts = [list(range(300, 360)), list(range(1000, 1037))]
    with LLM(tiny_models[kind], max_model_len=256) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    with LLM(tiny_models[kind], max_model_len=256, kv_window_tokens=128, kv_sink_tokens=4, kv_evict="h2o",
             max_num_batched_tokens=32) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
        llm.engine.kv.check_all_free()


@pytest.mark.parametrize("kind,layouts", [("llama", False), ("mistral", False), ("llama", True)])
def test_block_scores_are_the_attention_mass_of_hugging_faces_eager_attention(tiny_models, kind, layouts):
    """A 40-token prompt prefilled in chunks of 16, then 12 decodes: per block, the probability
    every query (every layer and head) put on its tokens, against HF's attention weights over
    the same tokens (a sliding window too: mistral; the CUDA graphs' step layouts too, whose
    decode steps fill the graph's own score buffer)."""
    from transformers import AutoModelForCausalLM

    eng = LLMEngine(EngineConfig(model=tiny_models[kind], max_model_len=256, max_num_batched_tokens=16,
                                 kv_window_tokens=128, kv_evict="h2o", dtype="float32"))
    if layouts:
        eng.runner.use_graph_layouts()
    req = eng.add_request(list(range(500, 540)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "s")
    while eng.has_unfinished_requests():
        eng.step()
    n = req.num_computed_tokens  # every token whose query ran (the last sampled one never did)
    assert n == 40 + 11 and req.kv_shift == 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[kind], dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        att = hf(torch.tensor([req.all_token_ids[:n]]), output_attentions=True).attentions
    mass = sum(a[0].sum(dim=(0, 1)) for a in att)  # per key: over layers, heads and queries
    want = torch.nn.functional.pad(mass, (0, -n % 16)).view(-1, 16).sum(dim=1)
    got = torch.tensor(req.kv_scores[: len(want)], dtype=torch.float32)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got, want)
    assert abs(sum(req.kv_scores) - n * 2 * 4) < 1e-3  # each query row of each layer and head sums to 1


def test_the_least_attended_blocks_go_and_the_kept_keys_sit_at_their_cache_positions(tiny_models):
    """A 200-token prompt past a 64-token budget (32 recent + 32 heavy) with one sink block: at
    every eviction the blocks dropped are the least scored among those between the sinks and the
    recent half; afterwards layer 0's K and V over the kept blocks equal a fresh engine's over
    the kept tokens at positions 0, 1, ... (keys rotated by the tokens dropped before them)."""
    kw = dict(model=tiny_models["llama"], max_model_len=256, max_num_batched_tokens=16)
    eng = LLMEngine(EngineConfig(kv_sink_tokens=4, kv_window_tokens=64, kv_evict="h2o", **kw))
    req = eng.add_request(list(range(300, 500)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "w")
    origin: dict[int, int] = {}  # block id -> the sequence index of its first token
    blocks, evictions, middle_dropped = [], 0, False
    while req.num_output_tokens < 16:
        scores, before, shift = list(req.kv_scores), list(blocks), req.kv_shift
        eng.step()
        blocks = eng.kv.block_ids("w")
        if req.kv_shift > shift:  # this step's schedule dropped (req.kv_shift - shift) // 16 blocks
            evictions += 1
            gone = [j for j, b in enumerate(before) if b not in blocks]
            assert len(gone) == (req.kv_shift - shift) // 16 and gone
            scores += [0.0] * (len(before) - len(scores))
            passed_over = [j for j in range(1, gone[-1]) if j not in gone]  # candidates kept: never less attended
            assert max(scores[j] for j in gone) <= min([scores[j] for j in passed_over] or [float("inf")]), scores
            middle_dropped |= gone != list(range(1, 1 + len(gone)))
        for j, b in enumerate(blocks):
            if b not in before:  # new since the last step: cache index j*16 holds sequence index j*16 + shift
                origin[b] = j * 16 + (req.kv_shift if j else 0)
    assert evictions >= 2 and middle_dropped  # not simply the window's oldest-first
    cached = req.num_computed_tokens - req.kv_shift
    assert len(blocks) == -(-cached // 16) <= (1 + 4 + 1 + 1) + 64 // 16  # sinks, budget, chunk, partial, a step
    tokens = req.all_token_ids
    kept = [t for b in blocks for t in tokens[origin[b]: origin[b] + 16]][:cached]
    ref = LLMEngine(EngineConfig(**kw))
    r = ref.add_request(kept, SamplingParams(temperature=0, max_tokens=2), "f")
    while r.num_computed_tokens < len(kept):
        ref.step()
    for which in (0, 1):  # K (rotated), V (moved with its block)
        a = eng.runner.kv_views[0][which][torch.tensor(blocks)].flatten(0, 1)[:cached]
        b = ref.runner.kv_views[0][which][torch.tensor(ref.kv.block_ids("f"))].flatten(0, 1)[:cached]
        assert torch.allclose(a, b, atol=1e-5), (which, (a - b).abs().max())
    eng.abort_request("w")
    eng.kv.check_all_free()


def test_bad_eviction_settings_are_refused_by_name(tiny_models):
    m = tiny_models["llama"]
    for kw, match in ((dict(kv_window_tokens=64, kv_evict="lru"), "kv_evict must be window or h2o"),
                      (dict(kv_evict="h2o"), "kv_evict 'h2o' chooses what a budget keeps: set kv_window_tokens"),
                      (dict(kv_window_tokens=16, kv_evict="h2o"), "kv_window_tokens must be >= 2 blocks"),
                      (dict(kv_window_tokens=64, kv_evict="h2o", kv_cache_dtype="int8"), "needs kv_cache_dtype")):
        with pytest.raises(ValueError, match=match):
            LLM(m, **kw)
