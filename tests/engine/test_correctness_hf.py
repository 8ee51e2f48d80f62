"""Greedy token ids equal Hugging Face transformers' generate on the same weights,
for a batch of prompts of different lengths submitted together, in float32 on CPU;
also on a second, prefix-cached pass, with tiny prefill chunks, and under preemption."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

from helpers import PROMPTS, hf_greedy

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompt_ids(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(p) for p in PROMPTS]


def _shared_prefix_ids(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    system = ("You are a careful assistant. Answer in one sentence, cite no sources, and never "
              "repeat the question back to the user. ")
    return [tok.encode(system + q) for q in ("Why is the sky blue?", "What is rust?",
                                             "Name a prime number.", "Where is Peru?")]


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def _check_all_free(llm: LLM) -> None:
    llm.engine.kv.check_all_free()
    assert not llm.engine.has_unfinished_requests()


MODELS = ["smollm2", "llama", "qwen2", "mistral"]
TINY = MODELS[1:]  # chunking and preemption are the same code on every model: the default one adds 30 s


@pytest.fixture(scope="module")
def model_dirs(tiny_models, default_model_dir):
    return {"smollm2": default_model_dir, **tiny_models}


@pytest.fixture(scope="module")
def references(model_dirs):
    refs = {}
    for name, path in model_dirs.items():
        prompts = _prompt_ids(path)
        shared = _shared_prefix_ids(path)
        batched = name == "smollm2"  # a trained model: padding cannot tip a token (helpers.hf_greedy)
        refs[name] = (prompts, hf_greedy(path, prompts, NEW_TOKENS, batched), shared,
                      hf_greedy(path, shared, NEW_TOKENS, batched))
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_batch_matches_hf_and_prefix_cache(name, model_dirs, references):
    prompts, ref, shared, shared_ref = references[name]
    llm = LLM(model_dirs[name])
    assert _run(llm, prompts) == ref
    _check_all_free(llm)
    # shared-prefix prompts, twice: the second pass reads the cached prefix blocks
    assert _run(llm, shared) == shared_ref
    hits_before = llm.engine.stats().cache.prefix_hits
    assert _run(llm, shared) == shared_ref
    assert llm.engine.stats().cache.prefix_hits > hits_before
    _check_all_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_small_chunks_match_hf(name, model_dirs, references):
    prompts, ref, _, _ = references[name]
    llm = LLM(model_dirs[name], max_num_batched_tokens=7, max_num_seqs=4)
    assert _run(llm, prompts) == ref
    _check_all_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_preemption_matches_hf(name, model_dirs, references):
    prompts, ref, _, _ = references[name]
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    blocks = -(-longest // 16) + 2  # room for the longest request, not for the batch
    llm = LLM(model_dirs[name], num_gpu_blocks_override=blocks)
    assert _run(llm, prompts) == ref
    assert llm.engine.stats().num_preemptions > 0
    _check_all_free(llm)


@pytest.mark.slow
def test_triton_backend_matches_hf_under_interpreter(model_dirs, references):
    """The Triton store and paged-decode kernels inside the real engine (CPU: interpreter)."""
    pytest.importorskip("triton")
    prompts, ref, _, _ = references["llama"]
    llm = LLM(model_dirs["llama"], attention_backend="triton")
    assert _run(llm, prompts[:4]) == ref[:4]
    _check_all_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fused_ops_match_hf_under_interpreter(model_dirs, references, name):
    """Fused RMSNorm + residual, rope and SiLU * gate kernels in the real engine: greedy
    tokens equal Hugging Face's (qwen2: q/k/v biases; both GQA)."""
    pytest.importorskip("triton")
    prompts, ref, _, _ = references[name]
    llm = LLM(model_dirs[name], attention_backend="triton", fused_ops=True)
    assert llm.engine.runner.model.fused
    assert _run(llm, prompts[:4]) == ref[:4]
    _check_all_free(llm)


def test_fused_ops_need_triton(model_dirs):
    with pytest.raises(ValueError, match="fused_ops needs Triton"):
        LLM(model_dirs["llama"], attention_backend="torch", fused_ops=True)
