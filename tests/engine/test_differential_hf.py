"""Engine fidelity against Hugging Face transformers' own forward pass (float32, CPU):
per-layer attention windows from `layer_types`, biases wherever a config puts them,
EOS / stop ids masked until `min_tokens`, and a randomized differential run over a few
dozen tiny Llama / Qwen2 / Mistral configs (GQA 1-4, head_dim != hidden / heads,
biases, windows, rope scalings, tied embeddings), prompts crossing block boundaries,
prefix-cache hits and prefill chunks down to a few tokens: greedy tokens == HF argmax."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams

from helpers import save_hf

NEW = 4


def save(kind: str, cfg_kwargs: dict, out_dir: str, tok_dir: str, seed: int = 0):
    base = dict(vocab_size=512, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    return save_hf(kind, {**base, **cfg_kwargs}, out_dir, tok_dir, seed, bias_std=0.2)


def hf_argmax(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by HF's full forward pass (no cache): argmax of the last logits."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def engine_tokens(path: str, prompts: list[list[int]], n: int = NEW, **engine_args) -> list[list[int]]:
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20, **engine_args)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    llm.engine.kv.check_all_free()
    return [o.outputs[0].token_ids for o in outs]


PROMPT = [(37 * i + 11) % 500 + 3 for i in range(40)]  # 40 tokens: 3 blocks, past every window below


def test_qwen2_windows_only_the_layers_marked_sliding(tmp_path, tok_dir):
    from pdserve.engine.config import ModelConfig

    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = save("qwen2", kw, str(tmp_path / "q"), tok_dir)
    assert ModelConfig.from_dir(str(tmp_path / "q")).layer_windows == (None, 8, 8)
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert engine_tokens(str(tmp_path / "q"), [PROMPT], 6) == [hf_argmax(model, PROMPT, 6)]
    # explicit layer_types win over max_window_layers
    model = save("qwen2", {**kw, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
                 str(tmp_path / "q2"), tok_dir)
    assert ModelConfig.from_dir(str(tmp_path / "q2")).layer_windows == (8, None, 8)
    assert engine_tokens(str(tmp_path / "q2"), [PROMPT], 6) == [hf_argmax(model, PROMPT, 6)]


def test_llama_attention_and_mlp_biases_load_and_match(tmp_path, tok_dir):
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              attention_bias=True, mlp_bias=True)
    model = save("llama", kw, str(tmp_path / "l"), tok_dir)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert engine_tokens(str(tmp_path / "l"), [PROMPT], 6) == [hf_argmax(model, PROMPT, 6)]


@pytest.mark.parametrize("with_stop_id", [False, True])
def test_min_tokens_masks_eos_and_stop_ids(tmp_path, tok_dir, with_stop_id):
    """A model whose every greedy step prefers EOS: before min_tokens it must not appear."""
    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = save("llama", kw, str(tmp_path / "m"), tok_dir)
    with torch.no_grad():  # a constant hidden state; EOS (2), then token 7, the most likely tokens
        model.model.embed_tokens.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.fill_(-0.01)
        model.lm_head.weight[2] = 0.05
        model.lm_head.weight[7] = 0.04
    model.save_pretrained(str(tmp_path / "m"), safe_serialization=True)
    llm = LLM(str(tmp_path / "m"), dtype="float32", max_model_len=64, kv_cache_memory_bytes=4 << 20)
    stop_ids = [7] if with_stop_id else []
    out = llm.generate([PROMPT[:5]], SamplingParams(temperature=0, max_tokens=6, min_tokens=3,
                                                    stop_token_ids=stop_ids))[0].outputs[0]
    banned = {2, 7} if with_stop_id else {2}
    assert len(out.token_ids) == 4 and not banned & set(out.token_ids[:3])
    assert out.token_ids[:3] == ([0, 0, 0] if with_stop_id else [7, 7, 7])  # the best allowed token
    assert out.token_ids[3] == 2 and out.finish_reason == "stop"  # allowed from then on: EOS wins
    sampled = llm.generate([PROMPT[:5]], SamplingParams(temperature=1.0, seed=3, max_tokens=3, min_tokens=3,
                                                        stop_token_ids=stop_ids))[0].outputs[0]
    assert len(sampled.token_ids) == 3 and not banned & set(sampled.token_ids)  # the sampling path too
    llm.engine.kv.check_all_free()


def random_config(rng: random.Random) -> tuple[str, dict, dict]:
    kind = rng.choice(["llama", "qwen2", "mistral"])
    heads = rng.choice([2, 4, 8])
    kv = heads // rng.choice([r for r in (1, 2, 4) if heads % r == 0])
    hidden = rng.choice([32, 64])
    head_dim = rng.choice([hidden // heads, 8, 16])  # often != hidden / heads
    layers = rng.choice([1, 2, 3])
    kw = dict(hidden_size=hidden, intermediate_size=rng.choice([48, 96]), num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
              tie_word_embeddings=rng.random() < 0.4, rope_theta=rng.choice([10000.0, 500000.0]))
    if kind == "llama":
        kw.update(attention_bias=rng.random() < 0.5, mlp_bias=rng.random() < 0.3)
        kw["rope_scaling"] = rng.choice([
            None, {"rope_type": "linear", "factor": 2.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 32}])
    elif kind == "qwen2":
        if rng.random() < 0.6:
            kw.update(use_sliding_window=True, sliding_window=rng.choice([8, 16, 24]),
                      max_window_layers=rng.randint(0, layers))
    elif rng.random() < 0.7:
        kw["sliding_window"] = rng.choice([8, 16, 24])
    else:
        kw["sliding_window"] = None
    engine = dict(max_num_batched_tokens=rng.choice([4, 7, 16, 64]), block_size=rng.choice([8, 16]))
    return kind, kw, engine


@pytest.mark.parametrize("seed", range(30))
def test_random_configs_match_hf_argmax(tmp_path, tok_dir, seed):
    rng = random.Random(seed)
    kind, kw, engine = random_config(rng)
    model = save(kind, kw, str(tmp_path / "m"), tok_dir, seed)
    shared = [rng.randrange(3, 512) for _ in range(rng.choice([17, 24, 33]))]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    prompts.append([rng.randrange(3, 512) for _ in range(rng.randint(2, 15))])
    want = [hf_argmax(model, p, NEW) for p in prompts]
    path = str(tmp_path / "m")
    # submitted together, then again in order: the second pass reads the shared prefix from the cache
    assert engine_tokens(path, prompts, **engine) == want, (kind, kw, engine)
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20, **engine)
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    got = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert got == want, (kind, kw, engine)
    assert llm.engine.stats().cache.prefix_hits > 0
    llm.engine.kv.check_all_free()
