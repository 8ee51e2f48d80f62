"""GPU, two or more: tensor parallelism on CUDA (the one-shot all-reduce, or NCCL's, inside the CUDA graphs).
Skipped without two CUDA GPUs. In float32 a TP=2 engine's greedy tokens equal TP=1's (the
all-reduce's summation order moves logits by ~1e-6: no near-tie of these prompts flips); in
bf16 the decode graphs are captured with the all-reduce inside and agree with TP=1 closely."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _tokens(path: str, prompts, tp: int, dtype: str, n: int = 24, custom: bool = True, **kw):
    from pdserve import LLM, SamplingParams

    with LLM(path, dtype=dtype, tensor_parallel_size=tp, gpu_memory_utilization=0.3, max_model_len=512,
             disable_custom_all_reduce=not custom, **kw) as llm:
        assert llm.engine.config.use_triton
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.decode, "TP graphs were not captured"
        if tp > 1:  # the decode steps' all-reduces take the one-shot kernel unless it is off
            assert (llm.engine.tp.oneshot is not None) == custom, llm.engine.tp.oneshot_why
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        llm.engine.kv.check_all_free()
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name,custom", [("llama", True), ("qwen2", True), ("llama", False)])
def test_tp2_greedy_tokens_equal_tp1_in_float32(name, custom, tiny_models):
    from transformers import AutoTokenizer

    from helpers import PROMPTS

    path = tiny_models[name]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    assert _tokens(path, prompts, 2, "float32", custom=custom) == _tokens(path, prompts, 1, "float32")


def test_tp2_bf16_graphs_agree_with_tp1(tiny_models):
    from transformers import AutoTokenizer

    from helpers import PROMPTS

    path = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    one, two = _tokens(path, prompts, 1, "bfloat16"), _tokens(path, prompts, 2, "bfloat16")
    first = sum(a[0] == b[0] for a, b in zip(one, two)) / len(one)
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(one, two))
    print(f"\nTP2 vs TP1 bf16: first tokens equal {first:.0%}, common prefix {prefix / sum(map(len, one)):.0%}")
    assert first >= 0.75 and prefix / sum(map(len, one)) >= 0.5


@pytest.mark.parametrize("ep", [False, True])
def test_moe_tp2_and_ep2_greedy_tokens_equal_tp1_in_float32(ep, tmp_path, tok_dir):
    """A Qwen3-MoE model on two GPUs, its experts split by intermediate rows (TP) or whole, half on
    each rank (EP: the fused kernel skips the other rank's assignments inside the decode graphs):
    TP=1's float32 greedy tokens."""
    from helpers import PROMPTS, save_hf

    save_hf("qwen3_moe", dict(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                              initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=2),
            str(tmp_path), tok_dir, seed=5)
    from transformers import AutoTokenizer

    prompts = [AutoTokenizer.from_pretrained(str(tmp_path)).encode(p) for p in PROMPTS]
    assert _tokens(str(tmp_path), prompts, 2, "float32", enable_expert_parallel=ep) == \
        _tokens(str(tmp_path), prompts, 1, "float32")
