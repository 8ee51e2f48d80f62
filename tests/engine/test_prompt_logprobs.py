"""Prompt log-probs (SamplingParams.prompt_logprobs, vLLM's): scored by the chunks that run
the prompt, equal to Hugging Face's log-softmax at every prompt position, in small chunks,
beside other requests, through a preemption, and never from a prefix-cache hit; the engine
refuses a max_model_len past the model's positions unless told."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import ALLOW_LONG


def hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_prompt_logprobs_equal_hf_in_chunks_beside_others_and_through_preemption(tiny_models):
    path = tiny_models["llama"]
    prompt = list(range(200, 250))  # 50 tokens: four chunks of 16 at most
    ref = hf_logprobs(path, prompt)
    top = ref.topk(3, dim=-1)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=3, n=2)
    other = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=16, num_gpu_blocks_override=9) as llm:
        llm.generate([prompt], other)  # caches the prompt's blocks: the scoring request must not use them
        outs = llm.generate([list(range(300, 340)), list(range(400, 430)), prompt], [other, other, sp])
        scored = outs[2]
        lps = scored.prompt_logprobs
        assert len(lps) == len(prompt) == len(scored.prompt_ranks) and lps[0] is None is scored.prompt_ranks[0]
        for i in range(1, len(prompt)):
            assert lps[i][prompt[i]] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
            want = {t: v for t, v in zip(top.indices[i - 1].tolist(), top.values[i - 1].tolist())}
            assert {t: lps[i][t] for t in want} == pytest.approx(want, abs=1e-4)
            assert set(lps[i]) == set(want) | {prompt[i]}
            assert scored.prompt_ranks[i] == 1 + int((ref[i - 1] > ref[i - 1, prompt[i]]).sum())
        assert scored.metrics.num_preemptions > 0  # nine blocks for three requests: the latest recomputed
        assert [c.token_ids for c in scored.outputs][0] == scored.outputs[1].token_ids  # greedy copies agree
        assert outs[0].prompt_logprobs is None
        llm.engine.kv.check_all_free()


def test_max_model_len_past_the_models_positions_is_refused_unless_allowed(tiny_models, monkeypatch):
    """vLLM refuses to start past max_position_embeddings (512 here) unless told."""
    with pytest.raises(ValueError, match=f"max_position_embeddings \\(512\\).*{ALLOW_LONG}=1"):
        LLM(tiny_models["llama"], max_model_len=1024)
    monkeypatch.setenv(ALLOW_LONG, "1")
    with LLM(tiny_models["llama"], max_model_len=1024) as llm:
        assert llm.engine.config.max_model_len == 1024
