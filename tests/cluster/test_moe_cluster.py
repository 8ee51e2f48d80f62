"""Mixture-of-experts models in a real Ray cluster (Qwen3-MoE: experts sharded by their
intermediate dimension under tensor parallelism; DeepSeek-V3: the same, with latent attention,
whose rows every rank holds whole): prompts handed off from a TP=1 prefill worker to a TP=2
decode worker, and prompts prefilled on that decode worker itself, give Hugging Face's greedy
tokens and the colocated engine's seeded sampled tokens."""

from __future__ import annotations

import os

import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster

from helpers import hf_greedy, save_hf

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              norm_topk_prob=True, max_position_embeddings=512, initializer_range=0.15, bos_token_id=1,
              eos_token_id=2, pad_token_id=2)
DEEPSEEK = dict(CONFIG, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=4,
                topk_group=2, routed_scaling_factor=2.5)
MODELS = {"qwen3_moe": CONFIG, "deepseek_v3": DEEPSEEK}
LOCAL_BELOW = 24  # prompts of at most this many tokens are prefilled on the decode worker
SHORT = [[(31 * i + 17 * j) % 40000 + 100 for i in range(20)] for j in range(1, 4)]
LONG = [[(29 * i + 7 * j) % 40000 + 100 for i in range(56)] for j in range(1, 4)]
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=77, max_tokens=10, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(tmp_path_factory, request) -> str:
    tok = os.environ.get("PDSERVE_TEST_TOKENIZER") or request.getfixturevalue("default_model_dir")
    path = str(tmp_path_factory.mktemp(request.param))
    save_hf(request.param, MODELS[request.param], path, tok, seed=5)
    return path


def test_moe_handoff_to_a_tp2_decode_worker_and_local_prefill_equal_colocated(model, shared_ray):
    with LLM(model, max_model_len=256) as llm:
        seeded = [o.outputs[0].token_ids for o in llm.generate(SHORT + LONG, SEEDED)]
    greedy = hf_greedy(model, SHORT + LONG, 8)
    c = Cluster.start(model, prefill=1, decode=1, prefill_tp=1, decode_tp=2, max_model_len=256,
                      local_prefill_tokens=LOCAL_BELOW)
    try:
        for params, want in ((GREEDY, greedy), (SEEDED, seeded)):
            outs = c.generate(SHORT + LONG, params)
            assert [o.outputs[0].token_ids for o in outs] == want, params
            local = [o.prefill_worker == o.decode_worker for o in outs]
            assert local == [True] * len(SHORT) + [False] * len(LONG)  # placement: local, then handed off
        rows = {r["worker_id"]: r for r in c.status()}
        assert sorted(r["tensor_parallel_size"] for r in rows.values()) == [1, 2]
        for row in rows.values():
            assert row["request_blocks"] == 0 and row["inflight"] == 0, row
    finally:
        c.shutdown()


def handed_off_tokens_equal_hf(model: str, **cluster_kw) -> None:
    """LONG through a prefill and a decode worker of `cluster_kw`'s layouts: HF's greedy tokens,
    every request handed off, no block or request left on a worker."""
    greedy = hf_greedy(model, LONG, 8)
    c = Cluster.start(model, prefill=1, decode=1, max_model_len=256, **cluster_kw)
    try:
        outs = c.generate(LONG, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == greedy
        assert all(o.prefill_worker != o.decode_worker for o in outs)
        for row in c.status():
            assert row["request_blocks"] == 0 and row["inflight"] == 0, row
    finally:
        c.shutdown()


def test_a_tp1_prefill_worker_hands_off_to_an_expert_parallel_tp2_decode_worker(model, shared_ray):
    """The decode worker's two ranks each hold half the experts whole (enable_expert_parallel); the
    prefill worker (TP=1) holds them all. The KV does not depend on how the experts are laid out:
    the handoff gives Hugging Face's greedy tokens."""
    handed_off_tokens_equal_hf(model, prefill_tp=1, decode_tp=2, enable_expert_parallel=True)


def test_a_tp2_prefill_worker_hands_latent_rows_to_a_tp1_decode_worker(model, shared_ray):
    """Latent rows are the same on every rank of a TP prefill worker: a TP=1 decode worker gets them
    (from one of its ranks) and answers with Hugging Face's greedy tokens."""
    if "deepseek" not in model:
        pytest.skip("the latent cache (GQA heads are split across ranks: test_tensor_parallel_cluster.py)")
    handed_off_tokens_equal_hf(model, prefill_tp=2, decode_tp=1)
