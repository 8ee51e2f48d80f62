"""What each supported Hugging Face architecture means for the engine: the model family that
builds it (a file under engine/models/), its biases, its attention windows per layer, its
mixture-of-experts layers, and the KV cache it declares (KVCacheSpec). ModelConfig.from_dir
reads a config.json through these rules; everything downstream of ModelConfig (the runner, the
KV layout, the handoff, the tiers, tensor parallelism, `pdserve plan`) reads the declarations,
never an architecture's name."""

from __future__ import annotations

from dataclasses import dataclass

# architecture -> the family (engine/models/<family>.py builds it; exec/loader.MODEL_FAMILIES)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
}

# a config.json without `architectures`: its model_type
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer caches per token: `num_heads` rows of `head_dim` values for K and for V.
    `sharded`: tensor parallelism splits the heads across ranks (GQA); False: every rank holds
    the same rows (a latent shared by all heads)."""

    num_heads: int
    head_dim: int
    sharded: bool = True


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

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}")


def biases(arch: str, cfg: dict) -> tuple[bool, bool, bool]:
    """(q/k/v, o, mlp) biases as Hugging Face builds them: Qwen2 biases q/k/v only; Llama's and
    Qwen3's `attention_bias` cover q/k/v and o, Llama's `mlp_bias` gate/up/down; Mistral and
    Mixtral have none."""
    if arch == "Qwen2ForCausalLM":
        return True, False, False
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return False, False, False
    attn = bool(cfg.get("attention_bias", False))
    return attn, attn, bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM"


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
