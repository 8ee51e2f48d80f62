"""What each supported Hugging Face architecture means for the engine, one row each
(`ARCHITECTURES`): the model_types a config.json without `architectures` names it by, the module
and class under engine/models/ that build it, and the functions that declare its parts from the
config.json: biases, attention windows per layer, mixture-of-experts layers (MoEConfig), latent
attention (MLAConfig), per-head q/k norms, the rope scalings it takes. ModelConfig.from_dir reads
a config.json through its row; everything downstream of ModelConfig (the runner, the KV layout,
the handoff, the tiers, tensor parallelism, `pdserve plan`) reads the declarations, never an
architecture's name. A Llama-like family is one file under engine/models/ plus one row."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass


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
    # a deployment's layout, not the checkpoint's: set when the engine resolves the model with
    # enable_expert_parallel (models/moe.py: experts whole, num_experts / N per rank)
    expert_parallel: bool = False

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


def _attention_biases(cfg: dict, mlp: bool) -> tuple[bool, bool, bool]:
    """Llama's, Qwen3's and DeepSeek's `attention_bias` (q/k/v and o; DeepSeek: q_a, kv_a and o);
    `mlp_bias` (gate/up/down) where the family's model reads it (Llama, DeepSeek-V2)."""
    attn = bool(cfg.get("attention_bias", False))
    return attn, attn, mlp and bool(cfg.get("mlp_bias", False))


def _no_windows(cfg: dict) -> tuple[int | None, ...]:
    return (None,) * cfg["num_hidden_layers"]


def _every_layer_window(cfg: dict) -> tuple[int | None, ...]:
    """Mistral and Mixtral: the window on every layer (their models ignore `layer_types`)."""
    return (cfg.get("sliding_window"),) * cfg["num_hidden_layers"]


def _qwen_windows(cfg: dict) -> tuple[int | None, ...]:
    """Qwen2 and Qwen3: a window only with `use_sliding_window`, and only on the layers
    `layer_types` marks "sliding_attention" (by default those from `max_window_layers` on)."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if not cfg.get("use_sliding_window") or window is None:
        return (None,) * n
    types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28) else
                                       "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _qwen3_moe_windows(cfg: dict) -> tuple[int | None, ...]:
    """Qwen3-MoE: the window on every layer with `use_sliding_window`."""
    return (cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,) * cfg["num_hidden_layers"]


def _mixtral_moe(cfg: dict) -> MoEConfig:
    """Mixtral: every layer sparse, top-k always renormalized."""
    return MoEConfig(cfg.get("num_local_experts", cfg.get("num_experts")), cfg.get("num_experts_per_tok", 2),
                     cfg["intermediate_size"], True, (True,) * cfg["num_hidden_layers"], weights_in_model_dtype=False)


def _qwen3_moe(cfg: dict) -> MoEConfig | None:
    """Qwen3-MoE: layer i is sparse unless it is in `mlp_only_layers`, when experts exist and
    (i + 1) is a multiple of `decoder_sparse_step`."""
    n, experts = cfg["num_hidden_layers"], cfg.get("num_local_experts", cfg.get("num_experts"))
    if not experts:
        return None
    only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1)
    layers = tuple(i not in only and (i + 1) % step == 0 for i in range(n))
    return MoEConfig(experts, cfg.get("num_experts_per_tok", 8), cfg["moe_intermediate_size"],
                     bool(cfg.get("norm_topk_prob", False)), layers, weights_in_model_dtype=True)


def _none(cfg: dict) -> None:
    return None


def _deepseek_moe(v2: bool, cfg: dict) -> MoEConfig | None:
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
    if v2:
        method = cfg.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        routing = "softmax" if method == "greedy" else "softmax_group"
        return MoEConfig(experts, cfg.get("num_experts_per_tok", 6), inter, False, layers, False, routing, **common)
    return MoEConfig(experts, cfg.get("num_experts_per_tok", 8), inter, bool(cfg.get("norm_topk_prob", True)), layers,
                     False, "sigmoid_group", **common)


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _deepseek_mla(v2: bool, cfg: dict) -> MLAConfig:
    """DeepSeek-V2/V3's latent attention. The softmax scale is qk_head_dim^-0.5, times
    mscale(factor, mscale_all_dim)^2 under YaRN rope scaling."""
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    scale = (nope + rope) ** -0.5
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    interleave = v2 or bool(cfg.get("rope_interleave", True))
    return MLAConfig(cfg["kv_lora_rank"], nope, rope, cfg["v_head_dim"], cfg.get("q_lora_rank"), scale, interleave)


@dataclass(frozen=True)
class Architecture:
    """One supported architecture: the `model_types` that name it in a config.json without
    `architectures`, the class that builds it (`cls` in engine.models.`module`), and what it
    declares from a config.json: (q/k/v, o, mlp) biases, each layer's attention window, its MoE
    and MLA parts (None: dense, GQA), per-head q/k RMSNorms before rope, and the rope scaling
    types it takes beyond default / llama3 / linear."""

    name: str
    model_types: tuple[str, ...]
    module: str
    cls: str
    biases: Callable[[dict], tuple[bool, bool, bool]]
    windows: Callable[[dict], tuple[int | None, ...]] = _no_windows
    moe: Callable[[dict], MoEConfig | None] = _none
    mla: Callable[[dict], MLAConfig | None] = _none
    qk_norm: bool = False
    rope_types: tuple[str, ...] = ()

    def model_class(self) -> type:
        """The class that builds this architecture (its module imported on first use)."""
        return getattr(importlib.import_module(f"pdserve.engine.models.{self.module}"), self.cls)


def _row(name: str, model_types: tuple[str, ...], module: str, cls: str, **parts) -> tuple[str, Architecture]:
    return name, Architecture(name, model_types, module, cls, **parts)


ARCHITECTURES: dict[str, Architecture] = dict((
    _row("LlamaForCausalLM", ("llama",), "llama", "LlamaForCausalLM", biases=lambda c: _attention_biases(c, True)),
    _row("MistralForCausalLM", ("mistral",), "llama", "LlamaForCausalLM", biases=lambda c: (False, False, False),
         windows=_every_layer_window),
    _row("Qwen2ForCausalLM", ("qwen2",), "llama", "LlamaForCausalLM", biases=lambda c: (True, False, False),
         windows=_qwen_windows),
    _row("Qwen3ForCausalLM", ("qwen3",), "llama", "LlamaForCausalLM", biases=lambda c: _attention_biases(c, False),
         windows=_qwen_windows, qk_norm=True),
    _row("Qwen3MoeForCausalLM", ("qwen3_moe",), "llama", "LlamaForCausalLM",
         biases=lambda c: _attention_biases(c, False), windows=_qwen3_moe_windows, moe=_qwen3_moe, qk_norm=True),
    _row("MixtralForCausalLM", ("mixtral",), "llama", "LlamaForCausalLM", biases=lambda c: (False, False, False),
         windows=_every_layer_window, moe=_mixtral_moe),
    _row("DeepseekV2ForCausalLM", ("deepseek_v2",), "deepseek", "DeepseekForCausalLM",
         biases=lambda c: _attention_biases(c, True), moe=lambda c: _deepseek_moe(True, c),
         mla=lambda c: _deepseek_mla(True, c), rope_types=("yarn",)),
    _row("DeepseekV3ForCausalLM", ("deepseek_v3",), "deepseek", "DeepseekForCausalLM",
         biases=lambda c: _attention_biases(c, False), moe=lambda c: _deepseek_moe(False, c),
         mla=lambda c: _deepseek_mla(False, c), rope_types=("yarn",)),
))


def architecture_of(cfg: dict, where: str) -> Architecture:
    """The row a config.json names: the first of its `architectures` pdserve supports, else its
    `model_type`'s; a clear error naming what it says and what is supported otherwise."""
    archs = cfg.get("architectures") or [a.name for a in ARCHITECTURES.values()
                                         if cfg.get("model_type") in a.model_types]
    row = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if row is None:
        raise ValueError(f"model at {where!r} has architectures {archs} (model_type {cfg.get('model_type')!r}); "
                         f"supported: {sorted(ARCHITECTURES)}")
    return row
