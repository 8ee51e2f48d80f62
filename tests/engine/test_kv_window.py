"""Sink + window eviction (engine/base/kv_window.py): a request shorter than its window is
unchanged; evicted requests keep their sinks and window with each key rotated to its cache
position (layer 0's keys and values equal a fresh run over the kept tokens at those
positions); a session longer than max_model_len runs in bounded blocks; bad settings are
refused by name."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def _rows(cache: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    return cache[torch.tensor(blocks)].flatten(0, 1)[:n]


def test_a_request_within_its_window_is_unchanged(tiny_models):
    prompt = list(range(300, 360))
    with LLM(tiny_models["llama"], max_model_len=256) as plain:
        want = plain.generate([prompt], GREEDY)[0].outputs[0].token_ids
    with LLM(tiny_models["llama"], max_model_len=256, kv_window_tokens=128, kv_sink_tokens=4,
             max_num_batched_tokens=64) as llm:
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == want


def test_evicted_keys_are_rotated_to_their_cache_positions(tiny_models):
    """Layer 0's K and V depend only on a token and its position: after evictions (during the
    chunked prefill and the decode), the window's rows equal a fresh engine's over the kept
    tokens (the first block, then the window) at positions 0, 1, ..."""
    kw = dict(model=tiny_models["llama"], max_model_len=256, max_num_batched_tokens=32)
    eng = LLMEngine(EngineConfig(kv_sink_tokens=4, kv_window_tokens=32, **kw))
    req = eng.add_request(list(range(300, 420)), GREEDY, "w")
    while req.num_output_tokens < 20:
        eng.step()
    assert req.kv_shift > 0 and req.kv_shift % 16 == 0
    cached = req.num_computed_tokens - req.kv_shift
    blocks = eng.kv.block_ids("w")
    assert len(blocks) == -(-cached // 16) and 32 <= cached - 16 < 32 + 2 * 16  # sinks + window + < a chunk
    kept = req.all_token_ids[:16] + req.all_token_ids[16 + req.kv_shift: req.num_computed_tokens]
    ref = LLMEngine(EngineConfig(**kw))
    r = ref.add_request(kept, SamplingParams(temperature=0, max_tokens=2), "f")
    while r.num_computed_tokens < len(kept):
        ref.step()
    for which in (0, 1):  # K (rotated back), V (moved with its block)
        a = _rows(eng.runner.kv_views[0][which], blocks, cached)
        b = _rows(ref.runner.kv_views[0][which], ref.kv.block_ids("f"), cached)
        assert torch.allclose(a, b, atol=1e-5), (which, (a - b).abs().max())
    eng.abort_request("w")
    eng.kv.check_all_free()


def test_a_session_longer_than_max_model_len_runs_in_bounded_blocks(tiny_models):
    """A 300-token prompt and 400 new tokens on max_model_len 128: the request holds at most
    (sinks + window + chunk + a step) of blocks at any step and gives back every block."""
    eng = LLMEngine(EngineConfig(model=tiny_models["llama"], max_model_len=128, max_num_batched_tokens=16,
                                 kv_sink_tokens=4, kv_window_tokens=64))
    req = eng.add_request(list(range(500, 800)), SamplingParams(temperature=0.8, seed=3, max_tokens=400,
                                                               ignore_eos=True), "long")
    most = 0
    while eng.has_unfinished_requests():
        eng.step()
        most = max(most, len(eng.kv.block_ids("long")))
    assert req.num_output_tokens == 400 and req.kv_shift > 600
    assert most <= eng.scheduler.window.max_cache_tokens // 16 + 1
    eng.kv.check_all_free()


def test_bad_window_settings_are_refused_by_name(tiny_models):
    m = tiny_models["llama"]
    for kw, match in ((dict(kv_window_tokens=8), "kv_window_tokens must be an integer >= the block size"),
                      (dict(kv_window_tokens=True), "kv_window_tokens must be an integer"),
                      (dict(kv_sink_tokens=4), "set kv_window_tokens too"),
                      (dict(kv_sink_tokens=-1, kv_window_tokens=64), "kv_sink_tokens must be"),
                      (dict(kv_window_tokens=64, kv_cache_dtype="int8"), "needs kv_cache_dtype 'auto'"),
                      (dict(kv_window_tokens=64, kv_offloading_size=0.01), "kv_offloading_size"),
                      (dict(kv_window_tokens=200, max_model_len=256), "kv_window_tokens 200: .* past max_model_len")):
        with pytest.raises(ValueError, match=match):
            LLM(m, **kw)
