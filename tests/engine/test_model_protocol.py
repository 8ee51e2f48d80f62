"""Every registered architecture (engine/architectures.ARCHITECTURES) builds, from a config.json
of its kind written by Hugging Face's own config class, a model that implements the engine's model
protocol (engine/models/protocol.CausalLM) with every layer's attention backend reachable through
it; the rows agree with what the configs declare. A new family fails here until it does."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.architectures import ARCHITECTURES
from pdserve.engine.config import ModelConfig
from pdserve.engine.models.protocol import CausalLM

from helpers import HF_CLASSES

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
EXTRA = {  # what each kind needs beyond SMALL to be small
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=24,
                        n_group=2, topk_group=1),
}


def config_dir(row, tmp_path) -> str:
    import transformers

    (kind,) = row.model_types
    cfg = getattr(transformers, HF_CLASSES[kind][0])(**SMALL, **EXTRA.get(kind, {})).to_dict()
    cfg["architectures"] = [row.name]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_each_registered_architecture_builds_a_model_of_the_protocol(name, tmp_path):
    row = ARCHITECTURES[name]
    mc = ModelConfig.from_dir(config_dir(row, tmp_path))
    assert mc.architecture == name and mc.family == row.module
    with torch.device("meta"):
        model = row.model_class()(mc, 128, False)
    assert isinstance(model, CausalLM), f"{row.module}.{row.cls} lacks part of engine/models/protocol.CausalLM"
    assert model.num_layers == mc.num_layers == 2
    for i in range(model.num_layers):  # what the runner and the graphs call on each layer's attention
        attn = model.attention(i)
        assert callable(attn) and callable(attn.store) and callable(attn.warm_up) and isinstance(attn.capturable, bool)
    assert isinstance(model.float32_params(), set)
    assert (mc.mla is not None) == ("yarn" in row.rope_types) == (row.module == "deepseek")
    assert (mc.moe is not None) == (row.moe.__name__ != "_none")
    assert mc.qk_norm == row.qk_norm


def test_a_config_names_its_architecture_by_model_type_or_is_refused_with_the_list(tmp_path):
    cfg = {"model_type": "qwen2", "num_attention_heads": 4, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(str(tmp_path)).architecture == "Qwen2ForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"supported: \['DeepseekV2ForCausalLM'"):
        ModelConfig.from_dir(str(tmp_path))
