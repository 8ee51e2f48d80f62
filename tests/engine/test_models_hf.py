"""Qwen3 (per-head q/k RMSNorm, explicit head_dim) and the mixture-of-experts Qwen3-MoE and
Mixtral against Hugging Face's own classes (float32, CPU): the configuration read through
engine/architectures.py, the per-expert checkpoint tensors loaded into fused experts, and greedy
tokens equal to HF's generate with prefix-cache hits and prompts in small prefill chunks."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import ModelConfig

from helpers import ID_PROMPTS, hf_greedy, save_hf

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
MODELS = {
    "qwen3": ("qwen3", dict(head_dim=32)),  # head_dim 32 > hidden / heads
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe_norm": ("qwen3_moe", dict(head_dim=16, num_experts=6, num_experts_per_tok=3,
                                         moe_intermediate_size=24, decoder_sparse_step=2, norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
}
PROMPTS = ID_PROMPTS


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory, tok_dir):
    kind, kw = MODELS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    save_hf(kind, {**BASE, **kw}, path, tok_dir, seed=3)
    return request.param, path


def test_the_configuration_declares_the_models_shape(model_dir):
    name, path = model_dir
    mc = ModelConfig.from_dir(path)
    assert mc.qk_norm == name.startswith("qwen3")
    assert mc.kv_cache_spec.num_heads == 2 and mc.kv_cache_spec.sharded
    if name == "qwen3":
        assert mc.moe is None and mc.head_dim == 32
    elif name == "qwen3_moe":
        assert mc.moe.layers == (True, False, True) and mc.moe.top_k == 2 and not mc.moe.norm_topk_prob
        assert mc.moe.intermediate_size == 32 and mc.moe.weights_in_model_dtype
    elif name == "qwen3_moe_norm":
        assert mc.moe.layers == (False, True, False) and mc.moe.norm_topk_prob  # every second layer
    else:
        assert mc.moe.layers == (True,) * 3 and mc.moe.norm_topk_prob and not mc.moe.weights_in_model_dtype


def test_greedy_tokens_equal_hf_generate_with_prefix_hits_and_chunks(model_dir):
    name, path = model_dir
    want = hf_greedy(path, PROMPTS, 8)
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=True,
              max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    again = llm.generate(PROMPTS[:2], params)  # their first blocks now come from the prefix cache
    assert [o.outputs[0].token_ids for o in again] == want[:2]
    assert sum(o.num_cached_tokens for o in again) >= 32
    llm.engine.kv.check_all_free()


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
FEATURES = {
    "preemption": dict(num_gpu_blocks_override=6, max_num_seqs=3),  # 3 prompts needing 3 + 3 + 2 blocks
    "host tier": dict(num_gpu_blocks_override=4, max_num_seqs=1, kv_offloading_size=0.001),
    "ngram speculation": dict(speculative_config=NGRAM),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_engine_features_keep_hf_tokens_on_moe_models(model_dir, feature):
    """Preemption (recomputed prompts), the host tier (blocks evicted to host memory and loaded back
    on a hit) and ngram speculation (drafts verified in one step) give HF's greedy tokens."""
    name, path = model_dir
    if name == "qwen3":
        pytest.skip("the dense model: covered with Llama's tests")
    want = hf_greedy(path, PROMPTS, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, dtype="float32", max_model_len=128, **FEATURES[feature]) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        stats = llm.engine.stats().as_dict()
    assert got == want and again == want
    if feature == "preemption":
        assert stats["num_preemptions"] > 0
    if feature == "host tier":
        assert stats["prefix_cache_host_hits"] > 0


def test_int8_kv_on_a_moe_model_keeps_the_first_token(model_dir):
    """int8 KV (a scale per token and head) on the MoE models: each prompt's first token, the one
    the prefill computes over the quantized cache, is HF's. Later tokens may drift: a tiny random
    model's logits are near-flat (the quality bound on a real model: tests/engine/test_engine.py)."""
    name, path = model_dir
    if name == "qwen3":
        pytest.skip("the dense model: covered with Llama's tests")
    want = hf_greedy(path, PROMPTS, 1)
    with LLM(path, dtype="float32", max_model_len=128, kv_cache_dtype="int8") as llm:
        assert llm.engine.runner.kv.dtype == torch.uint8
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))]
    assert got == want


def test_the_triton_kernels_keep_hf_tokens_on_moe_models(model_dir):
    """The model on its Triton kernels (the interpreter on CPU): paged attention, the fused
    elementwise ops (Qwen3's q/k norm and rope in place, in one launch) and the fused-MoE kernel in place of
    the experts' torch path."""
    name, path = model_dir
    want = hf_greedy(path, PROMPTS[:2], 6)
    with LLM(path, dtype="float32", max_model_len=128, attention_backend="triton", fused_ops=True) as llm:
        sparse = [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "SparseMoE"]
        assert all(m.experts.__name__ == "moe_triton" for m in sparse) and bool(sparse) == (name != "qwen3")
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6,
                                                                                        ignore_eos=True))]
    assert got == want


def test_structured_output_and_seeded_sampling_on_moe_models(model_dir):
    """A regex-constrained reply matches its pattern; seeded sampled tokens repeat exactly across
    two engines, one of them preempting (the seed fixes each draw)."""
    import re

    name, path = model_dir
    if name == "qwen3":
        pytest.skip("the dense model: covered with Llama's tests")
    with LLM(path, dtype="float32", max_model_len=128) as llm:
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.8, seed=3, max_tokens=12,
                                                        structured_outputs={"regex": "[0-9]{2}-[0-9]{3}"}))
        text = out[0].outputs[0].text
        assert re.fullmatch("[0-9]{2}-[0-9]{3}", text), text
        seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
        a = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded)]
    with LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks_override=6, max_num_seqs=3) as llm:
        b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded)]
        assert llm.engine.stats().num_preemptions > 0
    assert a == b
