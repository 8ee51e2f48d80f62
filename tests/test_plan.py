"""`pdserve plan`: its block count is the engine's, its max-concurrency prediction is what
the engine runs without preempting (within 5%), paged vs contiguous on mixed lengths."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import ALLOW_LONG
from pdserve.plan import GPUS, plan, render, workload_lengths


def run_without_preempting(llm: LLM, k: int, prompt_len: int, output_len: int) -> bool:
    rng = random.Random(k)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(k)]
    before = llm.engine.stats().num_preemptions
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return llm.engine.stats().num_preemptions == before


@pytest.mark.parametrize("prompt_len,output_len,budget_blocks", [(40, 40, 100), (70, 30, 160), (16, 17, 64)])
def test_max_concurrency_is_what_the_engine_runs_without_preempting(tiny_models, prompt_len, output_len,
                                                                    budget_blocks):
    model = tiny_models["llama"]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block x KV heads x head dim x float32
    budget = budget_blocks * block_bytes + 1000  # not a whole number of blocks
    p = plan(model, [(prompt_len, output_len)], kv_cache_memory_bytes=budget, dtype="float32", max_model_len=256,
             max_num_seqs=512)
    with LLM(model, kv_cache_memory_bytes=budget, max_model_len=256, max_num_seqs=512,
             enable_prefix_caching=False) as llm:
        assert llm.engine.kv.num_blocks == p["kv_blocks"] == budget_blocks
        k = p["max_concurrency_paged"]
        assert run_without_preempting(llm, k, prompt_len, output_len)
        more = k + max(1, round(0.05 * k))  # 5% more: the engine preempts
        assert not run_without_preempting(llm, more, prompt_len, output_len)
    assert p["kv_bytes_per_token_rank"] == block_bytes // 16


def test_gpu_budget_weights_and_mixed_lengths(tiny_models):
    model = tiny_models["llama"]
    with LLM(model, dtype="bfloat16", max_model_len=256) as llm:
        weights = sum(t.numel() * t.element_size() for t in [*llm.engine.runner.model.parameters(),
                                                              *llm.engine.runner.model.buffers()])
    mixed = [(20, 10), (200, 40), (60, 60), (100, 5)]
    p = plan(model, mixed, gpu="h100", max_model_len=256)
    assert p["weight_bytes_rank"] == weights
    blocks_each = [2, 15, 8, 7]  # ceil((prompt + output - 1) / 16)
    assert p["max_concurrency_paged"] == int(p["kv_blocks"] // (sum(blocks_each) / 4))
    assert p["max_concurrency_contiguous"] == p["kv_blocks"] // 16
    assert p["paged_over_contiguous"] == pytest.approx(16 / 8, rel=0.01)
    assert p["prefill_per_decode_worker"] > 0 and p["kv_budget_bytes_rank"] < GPUS["h100"].memory_bytes * 0.9
    tp2 = plan(model, mixed, gpu="h100", max_model_len=256, tensor_parallel_size=2)
    assert tp2["kv_bytes_per_token_rank"] * 2 == tp2["kv_bytes_per_token"] == p["kv_bytes_per_token"]
    with pytest.raises(ValueError, match="no request of the workload fits max_model_len 256"):
        plan(model, [(300, 10)], gpu="h100", max_model_len=256)
    with pytest.raises(ValueError, match="--prompt-len and --output-len"):
        workload_lengths(None, 10, None, None)


@pytest.mark.slow
def test_plan_cli_on_the_trace(tiny_models):
    out = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--model", tiny_models["llama"] + "/config.json",
                          "--gpu", "h200", "--trace", "--trace-requests", "200", "--max-model-len", "65536"],
                         capture_output=True, text=True, timeout=120,  # past the tiny model's 512 positions:
                         env={**os.environ, ALLOW_LONG: "1"})  # planned as the engine would serve it
    assert out.returncode == 0, out.stderr
    for line in ("KV per token", "request(s), mean prompt", "paged / contiguous", "prefill : decode workers"):
        assert line in out.stdout
    bad = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--model", tiny_models["llama"], "--gpu", "h100"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "give a workload" in bad.stderr


def test_a_mixture_of_experts_model_is_sized_by_what_a_token_activates(tmp_path, default_model_dir):
    """Weights: every expert's bytes (the engine's loaded model); prefill: the parameters a token
    runs (top_k of 8 experts in each sparse layer); a decode step at batch 1 reads top_k experts."""
    from helpers import save_hf

    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              mlp_only_layers=[1], max_position_embeddings=256)
    save_hf("qwen3_moe", kw, str(tmp_path), default_model_dir)
    with LLM(str(tmp_path), dtype="bfloat16", max_model_len=256) as llm:
        weights = sum(t.numel() * t.element_size() for t in [*llm.engine.runner.model.parameters(),
                                                              *llm.engine.runner.model.buffers()])
    p = plan(str(tmp_path), [(100, 20)], gpu="h200", max_model_len=256, max_num_seqs=1)
    assert p["weight_bytes_rank"] == weights
    expert = 3 * 64 * 32 * 2  # gate, up and down of one expert, bf16
    params = (weights - 6 * expert) / 2  # one sparse layer: 6 of its 8 experts idle for a token
    assert p["prefill_tok_s"] == pytest.approx(0.8 * GPUS["h200"].matmul_flops / (2 * params))
    kv_tok = p["kv_bytes_per_token_rank"]
    floor = (weights - 6 * expert + (100 + 10) * kv_tok) / GPUS["h200"].copy_bytes_s
    assert p["decode_step_ms"] == pytest.approx(1.25 * floor * 1e3)
    moe = p["moe"]
    assert (moe["experts"], moe["top_k"], moe["sparse_layers"]) == (8, 2, 1)
    assert moe["params_activated"] == params and moe["experts_touched_at_batch"] == pytest.approx(2.0)
    assert moe["decode_weight_bytes_at_batch"] == pytest.approx(weights - 6 * expert)
    text = render(p)  # what `pdserve plan --model DIR` prints for it
    assert "8 per sparse layer (1 layers), 2 per token" in text and "~2.0 of 8 experts per layer at batch 1" in text
    dense = plan(default_model_dir, [(100, 20)], gpu="h200", max_model_len=256)
    assert dense["moe"] is None and not any(r["expert_parallel"] for r in dense["layouts"])  # a dense model


def test_layouts_name_the_smallest_tensor_parallel_size_that_holds_a_full_decode_batch(tmp_path):
    """Qwen3-30B-A3B's shape (a config alone; weights counted on the meta device) on an H100 at
    4096 in / 256 out: one GPU keeps ~7 GB of KV beside 61 GB of weights and holds 35 requests, not
    a batch of 128; at TP=2 the worker holds 211 and is the smallest that fits. A size that does not
    divide the heads is named and why; a worker whose weights leave no room says so."""
    import json

    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
           "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 151936,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = plan(str(tmp_path), [(4096, 256)], gpu="h100", max_num_seqs=128)
    rows = {r["tensor_parallel_size"]: r for r in p["layouts"] if not r["expert_parallel"]}
    assert rows[1]["weight_bytes_rank"] == p["weight_bytes_rank"] and rows[1]["sequences_held"] == \
        p["max_concurrency_paged"] < 128 and not rows[1]["fits"]
    assert rows[2]["fits"] and rows[2]["best"] and rows[2]["sequences_held"] >= 128 and rows[2]["decode_batch"] == 128
    assert not rows[4]["best"] and rows[4]["weight_bytes_rank"] < rows[2]["weight_bytes_rank"] < \
        rows[1]["weight_bytes_rank"]
    ep = {r["tensor_parallel_size"]: r for r in p["layouts"] if r["expert_parallel"]}
    assert sorted(ep) == [2, 4, 8] and ep[2]["weight_bytes_rank"] == rows[2]["weight_bytes_rank"]  # the same bytes
    assert "EP=2:" in render(p)
    text = render(p)
    assert "TP=1: weights 61.11 GB per rank" in text and "decode batch 35 of 128, step ~" in text
    assert "does not hold a full batch" in text
    assert "TP=2:" in text and "fits (the smallest that does)" in text
    small = plan(str(tmp_path), [(4096, 256)], gpu_memory_gib=40, max_num_seqs=128)["layouts"]
    assert small[0]["kv_tokens"] == 0 and not small[0]["fits"]  # 61 GB of weights on 40 GiB
    assert "no KV room after the weights" in render(plan(str(tmp_path), [(4096, 256)], gpu_memory_gib=40))
    cfg["num_attention_heads"] = 12  # 12 heads: TP=8 cannot split them
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rows = {r["tensor_parallel_size"]: r for r in plan(str(tmp_path), [(4096, 256)], gpu="h200")["layouts"]
            if not r["expert_parallel"]}
    assert "must divide" in rows[8]["why_not"]
