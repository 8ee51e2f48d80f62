"""Tensor parallelism on CPU (gloo, float32): N processes in lockstep give TP=1's greedy
tokens; each rank loads exactly its Megatron slices; a dead rank fails the step clearly."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve import SamplingParams
from pdserve.engine.base.tp import TPError, TPGroup, check_tp, kv_head_range, vocab_range
from pdserve.engine.config import EngineConfig
from pdserve.engine.exec.loader import load_model
from pdserve.engine.exec.runner_settings import RunnerSettings
from pdserve.engine.llm import LLM

from helpers import save_hf

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _prompts() -> list[list[int]]:
    shared = [11, 52, 903, 4000, 17, 88, 612, 9, 1200, 33, 71, 5, 6, 7, 8, 9, 10]  # > one 16-token block
    return [shared + [21, 22, 23], shared + [31], [7, 8, 9], list(range(100, 140)), [42]]


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory, default_model_dir) -> str:
    """A Llama with q/k/v/o and MLP biases and a vocabulary 4 does not divide (49155):
    row-parallel biases added once, the last rank's LM-head rows padded."""
    out = str(tmp_path_factory.mktemp("biased"))
    save_hf("llama", dict(vocab_size=49155, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.15, attention_bias=True, mlp_bias=True, bos_token_id=1,
                          eos_token_id=2, pad_token_id=2), out, default_model_dir, bias_std=0.1)
    return out


def _greedy(model_dir: str, tp: int, params: SamplingParams = GREEDY, **kw) -> list[list[int]]:
    with LLM(model_dir, tensor_parallel_size=tp, **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp", [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen2", 4)])
def test_tp_greedy_equals_tp1(tiny_models, kind, tp):
    """llama: 2 KV heads (TP=4 replicates each twice); qwen2: 1 KV head, q/k/v biases, tied
    embeddings (the LM head's shard is cut from the embedding)."""
    assert _greedy(tiny_models[kind], tp) == _greedy(tiny_models[kind], 1)


@pytest.mark.slow
def test_tp_with_biases_padded_vocab_preemption_and_prefix_hits(biased_llama):
    """6 blocks for 5 prompts of up to 70 tokens: requests are preempted and recomputed;
    the shared 16-token block is a prefix hit. The shards follow rank 0's block tables."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _greedy(biased_llama, 1, params)
    with LLM(biased_llama, tensor_parallel_size=4, num_gpu_blocks_override=6, max_num_seqs=4) as llm:
        outs = llm.generate(_prompts(), params)
        stats = llm.engine.stats().as_dict()
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert stats["tensor_parallel_size"] == 4
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


@pytest.mark.slow
def test_tp_steps_overlap_and_the_shards_take_rank_0s_ids_on_the_device(tiny_models):
    """Greedy plain requests at TP=2: each step is launched before the one in flight resolves
    (the shards read the pending ids from rank 0's broadcast), and the tokens are TP=1's; a
    request that needs the host between steps (log-probs) runs in turn beside them."""
    ref = _greedy(tiny_models["llama"], 1)
    with LLM(tiny_models["llama"], tensor_parallel_size=2) as llm:
        e = llm.engine
        for i, p in enumerate(_prompts()):
            e.add_request(p, GREEDY, request_id=str(i))
        overlapped, outs = 0, {}
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            overlapped += e.pending is not None
        logprobs = llm.generate(_prompts()[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                               logprobs=1))
    assert overlapped >= 5
    assert [outs[str(i)] for i in range(len(ref))] == ref
    assert [o.outputs[0].token_ids for o in logprobs] == ref[:2]


def test_each_rank_loads_its_slices(tiny_models):
    """Rank 1 of 4 on the llama (4 q heads, 2 KV heads, head_dim 16, ff 128): q head 1,
    KV head 0 (replicated on ranks 0 and 1), gate/up rows 32:64, o/down columns."""
    from safetensors import safe_open

    d = tiny_models["llama"]
    cfg = EngineConfig(model=d, tensor_parallel_size=4).resolve(d)
    model = load_model(RunnerSettings.of(cfg), tp=TPGroup(rank=1, size=4))
    with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}
    layer = model.layers[1]
    qkv = layer.self_attn.qkv_proj.weight
    p = "model.layers.1."
    assert qkv.shape == (16 * 3, 64)
    assert torch.equal(qkv[:16], hf[p + "self_attn.q_proj.weight"][16:32])
    assert torch.equal(qkv[16:32], hf[p + "self_attn.k_proj.weight"][0:16])
    assert torch.equal(qkv[32:], hf[p + "self_attn.v_proj.weight"][0:16])
    assert torch.equal(layer.self_attn.o_proj.weight, hf[p + "self_attn.o_proj.weight"][:, 16:32])
    gate_up = layer.mlp.gate_up_proj.weight
    assert torch.equal(gate_up[:32], hf[p + "mlp.gate_proj.weight"][32:64])
    assert torch.equal(gate_up[32:], hf[p + "mlp.up_proj.weight"][32:64])
    assert torch.equal(layer.mlp.down_proj.weight, hf[p + "mlp.down_proj.weight"][:, 32:64])
    lo, hi = vocab_range(49152, 4, 1)
    assert (lo, hi) == (12288, 24576)
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"][lo:hi])
    assert torch.equal(model.embed_tokens.weight, hf["model.embed_tokens.weight"])  # replicated


def test_head_ranges_and_refusals():
    assert [kv_head_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert vocab_range(49155, 4, 3) == (36867, 49155)  # 12288 rows + 1 padding row
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's 4 attention heads"):
        check_tp(4, 2, 128, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 and the model's 6 KV heads"):
        check_tp(8, 6, 128, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_tp_size_the_model_cannot_split_is_refused(tiny_models):
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(tiny_models["llama"], tensor_parallel_size=3)


@pytest.mark.slow
def test_a_dead_rank_fails_the_step_instead_of_hanging(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2)
    try:
        assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
        proc = llm.engine.shards.procs[0]
        proc.kill()
        proc.wait()
        assert llm.engine.shards.dead() == [1]
        with pytest.raises(TPError, match="tensor-parallel rank 0 of 2: "):
            llm.generate([[5, 6, 7]], GREEDY)
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # the aborted request freed its blocks
    finally:
        llm.close()


def save_tiny_moe(kind: str, path: str, tok_dir: str) -> None:
    """A tiny Qwen3-MoE (8 experts of 32) or Mixtral (4 experts) with HF's classes."""
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16) if kind == "qwen3_moe" \
        else dict(num_local_experts=4, num_experts_per_tok=2)
    save_hf(kind, dict(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=2, **moe), path, tok_dir)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_tp_shards_each_experts_intermediate_rows(tmp_path, default_model_dir, kind):
    """TP=2 on gloo: each rank holds half of every expert's gate/up rows and down columns and the
    whole router; one all-reduce after the combine gives TP=1's greedy tokens. Rank 1 loads
    exactly its rows of expert 3."""
    from safetensors import safe_open

    save_tiny_moe(kind, str(tmp_path), default_model_dir)
    assert _greedy(str(tmp_path), 2) == _greedy(str(tmp_path), 1)
    cfg = EngineConfig(model=str(tmp_path), tensor_parallel_size=2).resolve(str(tmp_path))
    model = load_model(RunnerSettings.of(cfg), tp=TPGroup(rank=1, size=2))
    names = ("mlp.experts.3.gate_proj", "mlp.experts.3.up_proj", "mlp.experts.3.down_proj") \
        if kind == "qwen3_moe" else ("block_sparse_moe.experts.3.w1", "block_sparse_moe.experts.3.w3",
                                     "block_sparse_moe.experts.3.w2")
    with safe_open(os.path.join(str(tmp_path), "model.safetensors"), framework="pt") as f:
        gate, up, down = (f.get_tensor(f"model.layers.0.{n}.weight") for n in names)
    half = gate.shape[0] // 2
    moe_layer = model.layers[0].mlp
    assert torch.equal(moe_layer.w_gate_up[3], torch.cat([gate[half:], up[half:]]))
    assert torch.equal(moe_layer.w_down[3], down[:, half:])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_expert_parallel_keeps_experts_whole_on_their_rank_and_tp1s_tokens(tmp_path, default_model_dir, kind):
    """enable_expert_parallel, TP=2 on gloo: rank r holds experts [r x E/2, (r + 1) x E/2) whole
    and skips the others' assignments; the all-reduce after the combine sums each token's experts
    across the ranks: TP=1's greedy tokens. Rank 1 loads expert 5 (qwen3_moe) / 3 (mixtral) whole
    as its own expert 1, and nothing of rank 0's."""
    from safetensors import safe_open

    save_tiny_moe(kind, str(tmp_path), default_model_dir)
    assert _greedy(str(tmp_path), 2, enable_expert_parallel=True) == _greedy(str(tmp_path), 1)
    cfg = EngineConfig(model=str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True).resolve(str(tmp_path))
    model = load_model(RunnerSettings.of(cfg), tp=TPGroup(rank=1, size=2))
    e = 5 if kind == "qwen3_moe" else 3
    names = tuple(f"mlp.experts.{e}.{p}_proj" for p in ("gate", "up", "down")) if kind == "qwen3_moe" else \
        tuple(f"block_sparse_moe.experts.{e}.w{i}" for i in (1, 3, 2))
    with safe_open(os.path.join(str(tmp_path), "model.safetensors"), framework="pt") as f:
        gate, up, down = (f.get_tensor(f"model.layers.0.{n}.weight") for n in names)
    layer = model.layers[0].mlp
    count = 4 if kind == "qwen3_moe" else 2
    assert layer.held == (count, count) and layer.w_gate_up.shape[0] == count
    assert torch.equal(layer.w_gate_up[1], torch.cat([gate, up])) and torch.equal(layer.w_down[1], down)


def test_expert_parallel_is_refused_where_it_cannot_split(tmp_path, default_model_dir, tiny_models):
    save_hf("qwen3_moe", dict(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                              num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
            str(tmp_path), default_model_dir)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide the model's 6 experts"):
        EngineConfig(model=str(tmp_path), tensor_parallel_size=4, enable_expert_parallel=True).resolve(str(tmp_path))
    one = EngineConfig(model=str(tmp_path), enable_expert_parallel=True).resolve(str(tmp_path)).model_config.moe
    assert not one.expert_parallel  # one rank holds every expert: nothing to split
    with pytest.raises(ValueError, match="has no experts"):
        EngineConfig(model=tiny_models["llama"], tensor_parallel_size=2,
                     enable_expert_parallel=True).resolve(tiny_models["llama"])
    moe = EngineConfig(model=str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True).resolve(
        str(tmp_path)).model_config.moe
    assert moe.expert_parallel and moe.num_experts == 6  # the router still sees every expert
