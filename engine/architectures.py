"""What each supported Hugging Face architecture means for the engine: the model family that
builds it (a file under engine/models/), its biases, its attention windows per layer, its
mixture-of-experts layers, its latent attention (MLAConfig), and the KV cache it declares
(KVCacheSpec). ModelConfig.from_dir
reads a config.json through these rules; everything downstream of ModelConfig (the runner, the
KV layout, the handoff, the tiers, tensor parallelism, `pdserve plan`) reads the declarations,
never an architecture's name."""

from __future__ import annotations

import math
from dataclasses import dataclass

# architecture -> the family (engine/models/<family>.py builds it; exec/loader.MODEL_FAMILIES)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
}

# a config.json without `architectures`: its model_type
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer caches per token: `num_heads` rows of `head_dim` values for each of its
    `parts`: 2, K and V (GQA); 1, one latent row that is both the keys' and the values' source
    (MLA: kv_lora_rank + qk_rope_head_dim values). `sharded`: tensor parallelism splits the heads
    across ranks (GQA); False: every rank holds the same rows (a latent shared by all heads)."""

    num_heads: int
    head_dim: int
    sharded: bool = True
    parts: int = 2


@dataclass(frozen=True)
class MoEConfig:
    """A model's mixture-of-experts layers: `layers[i]` says whether layer i's MLP is a sparse
    block of `num_experts` experts (each a SiLU-gated MLP of `intermediate_size`) of which each
    token takes `top_k` by softmax over the router's logits, renormalized when `norm_topk_prob`;
    the other layers run a dense MLP of the model's intermediate_size. `weights_in_model_dtype`:
    the top-k weights are rounded to the model's dtype before they scale the experts' outputs
    (Qwen3-MoE) rather than kept in float32 (Mixtral)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[bool, ...]
    weights_in_model_dtype: bool
    # DeepSeek's routing (ops/moe_ref.route_grouped): "softmax" (the above), "softmax_group" (V2's
    # group_limited_greedy: the top `topk_group` of `n_group` groups by their best expert's
    # probability), "sigmoid_group" (V3's noaux_tc: sigmoid scores plus a per-expert correction bias
    # choose, groups ranked by their two best); the weights are then scaled by routed_scaling_factor
    routing: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # the shared experts beside the routed ones, as one dense MLP

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide the {self.num_experts} experts and topk_group "
                             f"{self.topk_group} be in [1, n_group]")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): each token caches one latent row of
    `kv_lora_rank` values (normalized) and `qk_rope_head_dim` rope-rotated key values, shared by
    all heads; each head's key is its `qk_nope_head_dim` up-projection of the latent plus that
    rope part, its value the `v_head_dim` up-projection (kv_b_proj). Queries go through a
    `q_lora_rank` bottleneck when it is set. `softmax_scale` includes YaRN's mscale."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    softmax_scale: float
    rope_interleave: bool = True  # rope rotates pairs (x0, x1), ... (V2; V3 unless its config says not)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def biases(arch: str, cfg: dict) -> tuple[bool, bool, bool]:
    """(q/k/v, o, mlp) biases as Hugging Face builds them: Qwen2 biases q/k/v only; Llama's and
    Qwen3's `attention_bias` cover q/k/v and o, Llama's `mlp_bias` gate/up/down; Mistral and
    Mixtral have none. DeepSeek's `attention_bias` covers q_a, kv_a and o; V2's `mlp_bias` its MLPs."""
    if arch == "Qwen2ForCausalLM":
        return True, False, False
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return False, False, False
    attn = bool(cfg.get("attention_bias", False))
    return attn, attn, bool(cfg.get("mlp_bias", False)) and arch in ("LlamaForCausalLM", "DeepseekV2ForCausalLM")


def layer_windows(arch: str, cfg: dict) -> tuple[int | None, ...]:
    """Each layer's attention window, as Hugging Face applies it. Qwen2 and Qwen3: a window only
    with `use_sliding_window`, and only on the layers `layer_types` marks "sliding_attention" (by
    default those from `max_window_layers` on). Mistral and Mixtral: the window on every layer
    (their models ignore `layer_types`); Qwen3-MoE likewise, with `use_sliding_window`. Llama: none."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * n
    if arch == "Qwen3MoeForCausalLM":
        return (window if cfg.get("use_sliding_window") else None,) * n
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not cfg.get("use_sliding_window") or window is None:
        return (None,) * n
    types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28) else
                                       "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    return tuple(window if t == "sliding_attention" else None for t in types)


def moe_config(arch: str, cfg: dict) -> MoEConfig | None:
    """The sparse layers as Hugging Face places them. Qwen3-MoE: layer i is sparse unless it is in
    `mlp_only_layers`, when experts exist and (i + 1) is a multiple of `decoder_sparse_step`.
    Mixtral: every layer, top-k always renormalized."""
    n = cfg["num_hidden_layers"]
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return _deepseek_moe(arch, cfg)
    if arch == "MixtralForCausalLM":
        return MoEConfig(experts, cfg.get("num_experts_per_tok", 2), cfg["intermediate_size"], True, (True,) * n,
                         weights_in_model_dtype=False)
    if arch != "Qwen3MoeForCausalLM" or not experts:
        return None
    only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1)
    layers = tuple(i not in only and (i + 1) % step == 0 for i in range(n))
    return MoEConfig(experts, cfg.get("num_experts_per_tok", 8), cfg["moe_intermediate_size"],
                     bool(cfg.get("norm_topk_prob", False)), layers, weights_in_model_dtype=True)


def _deepseek_moe(arch: str, cfg: dict) -> MoEConfig | None:
    """DeepSeek's MoE: layer i is sparse from `first_k_dense_replace` on, every `moe_layer_freq`-th
    (DeepSeek's own rule; Hugging Face's models assume a frequency of 1), with
    `n_shared_experts` x moe_intermediate_size of shared experts. V2 routes by softmax, greedy or
    group-limited (`topk_method`), never renormalized; V3 by sigmoid with its correction bias,
    group-limited, renormalized when `norm_topk_prob`."""
    n, experts = cfg["num_hidden_layers"], cfg.get("n_routed_experts")
    if not experts:
        return None
    first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    layers = tuple(i >= first and i % freq == 0 for i in range(n))
    inter = cfg["moe_intermediate_size"]
    common = dict(n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                  routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                  shared_intermediate_size=inter * (cfg.get("n_shared_experts") or 0))
    if arch == "DeepseekV2ForCausalLM":
        method = cfg.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        routing = "softmax" if method == "greedy" else "softmax_group"
        return MoEConfig(experts, cfg.get("num_experts_per_tok", 6), inter, False, layers, False, routing, **common)
    return MoEConfig(experts, cfg.get("num_experts_per_tok", 8), inter, bool(cfg.get("norm_topk_prob", True)), layers,
                     False, "sigmoid_group", **common)


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_config(arch: str, cfg: dict) -> MLAConfig | None:
    """DeepSeek-V2/V3's latent attention; None for the GQA families. The softmax scale is
    qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN rope scaling."""
    if arch not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return None
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    scale = (nope + rope) ** -0.5
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    interleave = arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True))
    return MLAConfig(cfg["kv_lora_rank"], nope, rope, cfg["v_head_dim"], cfg.get("q_lora_rank"), scale, interleave)
