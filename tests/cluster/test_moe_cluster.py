"""A mixture-of-experts model (Qwen3-MoE: experts sharded by their intermediate dimension under
tensor parallelism) in a real Ray cluster: prompts handed off from a TP=1 prefill worker to a
TP=2 decode worker, and prompts prefilled on that decode worker itself, give Hugging Face's
greedy tokens and the colocated engine's seeded sampled tokens."""

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
LOCAL_BELOW = 24  # prompts of at most this many tokens are prefilled on the decode worker
SHORT = [[(31 * i + 17 * j) % 40000 + 100 for i in range(20)] for j in range(1, 4)]
LONG = [[(29 * i + 7 * j) % 40000 + 100 for i in range(56)] for j in range(1, 4)]
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=77, max_tokens=10, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory, request) -> str:
    tok = os.environ.get("PDSERVE_TEST_TOKENIZER") or request.getfixturevalue("default_model_dir")
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    save_hf("qwen3_moe", CONFIG, path, tok, seed=5)
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
