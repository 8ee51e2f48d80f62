"""`pdserve serve --model DIR` for each new family (Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V2/V3): one
prefill and one decode worker in a real Ray cluster, the KV (DeepSeek's: latent rows) handed off
between them, answering through the `openai` client with Hugging Face's greedy tokens; DeepSeek-V3
in hybrid mode too, where the placement may prefill on the decode worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import RayHead, free_port, hf_greedy, save_hf, serving_port, stop_server

openai = pytest.importorskip("openai")

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, bos_token_id=1,
            eos_token_id=2, pad_token_id=2)
FAMILIES = {"qwen3": dict(head_dim=32), "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                           moe_intermediate_size=32, norm_topk_prob=True),
            "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}
MLA = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
           kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1,
           num_key_value_heads=4)  # HF's MLA repeats nothing: as many KV heads as heads
FAMILIES |= {"deepseek_v2": dict(MLA, q_lora_rank=None),
             "deepseek_v3": dict(MLA, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5)}
MODES = [(kind, "disagg") for kind in sorted(FAMILIES)] + [("deepseek_v3", "hybrid")]


ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo"}


@pytest.fixture(scope="module")
def ray_address():
    """One Ray on loopback that each server joins (`--address`, as on a cluster `ray up` made): a Ray
    of its own cost each of the six servers a start and a stop."""
    port = free_port()
    head = RayHead(port, "--node-ip-address=127.0.0.1", "--num-cpus=4", env=ENV)
    yield f"127.0.0.1:{port}"
    head.stop()


@pytest.mark.slow
@pytest.mark.parametrize("kind,mode", MODES)
def test_a_served_model_of_each_family_answers_through_the_handoff(tmp_path, default_model_dir, ray_address, kind,
                                                                    mode):
    save_hf(kind, {**BASE, **FAMILIES[kind]}, str(tmp_path), default_model_dir)
    prompt = [(29 * i + 7) % 40000 + 100 for i in range(40)]
    want = hf_greedy(str(tmp_path), [prompt], 6)[0]
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model", str(tmp_path), "--mode", mode,
                             "--prefill", "1", "--decode", "1", "--max-model-len", "256", "--port", "0",
                             "--address", ray_address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)  # its own group: stopping it stops only what it started
    try:
        port = serving_port(proc)  # printed once bound: the client connects at once
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True,
                                                  "kv_transfer_params": {}})
        assert r.choices[0].model_extra["token_ids"] == want
        facts = r.model_extra["kv_transfer_params"]
        if mode == "disagg":
            assert facts["kv_handoff"] and facts["prefill_worker"] != facts["decode_worker"], facts
    finally:
        stop_server(proc)
