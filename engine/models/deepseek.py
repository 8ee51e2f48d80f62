"""DeepSeek-V2 and -V3 (Hugging Face's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM): multi-head
latent attention and DeepSeek's mixture of experts.

Attention (engine/architectures.MLAConfig): the query goes through a q_lora_rank bottleneck when
the config has one (q_a_proj, q_a_layernorm, q_b_proj; else q_proj) and splits per head into a
no-rope part and a rope part; kv_a_proj_with_mqa makes each token's latent (kv_lora_rank values,
RMS-normalized by kv_a_layernorm) and one rope key part shared by all heads. The latent and the
rotated rope part are what the token caches: one row per layer (exec/kv_cache.py, parts 1), read
by models/mla_attention.py through kv_b_proj (each head's key and value up-projections). Rope
rotates interleaved pairs (x0, x1), (x2, x3), ... (V2 always; V3 with `rope_interleave`, else
the halves as Llama does), under YaRN scaling as the configs set it (its mscale on cos and sin,
and mscale_all_dim squared on the softmax scale).

MLP: dense for the first `first_k_dense_replace` layers (and off the `moe_layer_freq` grid), else
DeepSeek's MoE (`DeepseekMoE`): routed experts (models/moe.py's fused weights and kernels) chosen
by the router in float32 (ops/moe_ref.route_grouped: V2's softmax, greedy or group-limited;
V3's sigmoid with its correction bias, group-limited, renormalized), their weights scaled by
routed_scaling_factor, plus the shared experts (one dense MLP). Numerics follow Hugging Face's
code, so float32 greedy outputs match it.

With a tensor-parallel group of N each rank builds its shard: its H/N heads (their rows of the
query projection and of kv_b_proj, their columns of o_proj, one all-reduce after it), the whole
latent path (kv_a_proj, its norm: every rank computes and caches the same latent rows, so the
cache is not split: KVCacheSpec(sharded=False)), I/N of every MLP and expert (one all-reduce
each, the routed experts' and the shared experts' separately), its ceil(V/N) rows of the LM head.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..base.tp import TPGroup
from ..config import ModelConfig
from ..ops.moe_ref import fused_moe_ref, local_ids, route_grouped
from .layers import MLP, DecoderLayer, DecoderStack, Linear, RMSNorm, RowParallelLinear, fused_ops
from .mla_attention import MLAPagedAttention
from .moe import SparseMoE

_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def yarn_inv_freq(dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Rope's inverse frequencies and the factor on cos and sin: plain, or YaRN's blend of
    interpolated (long wavelengths) and extrapolated (short) frequencies, a linear ramp between
    the dimensions that turn beta_slow and beta_fast times over the original context."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling is None:
        return inv, 1.0
    factor, old = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor") or (mscale(m) / mscale(m_all) if m and m_all else mscale(1))

    def turn_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turn_dim(scaling.get("beta_fast") or 32), turn_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp
    return inv / factor * (1 - extrapolated) + inv * extrapolated, float(attention_factor)


class DeepseekRotary(nn.Module):
    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict | None, interleave: bool):
        super().__init__()
        with torch.device("cpu"):  # host tables even on meta (see models/llama.RotaryEmbedding)
            inv, factor = yarn_inv_freq(dim, theta, scaling)
            freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)  # [positions, dim / 2]
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)
        self.interleave = interleave

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, dim] -> rotated, its pairs' first elements, then their second ones."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        xf = x.float()
        x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if self.interleave else xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: DeepseekRotary, use_triton: bool, tp: TPGroup, fused: bool = False):
        super().__init__()
        m, h = cfg.mla, cfg.num_heads // tp.size
        self.mla, self.num_heads, self.rotary, self.fused = m, h, rotary, fused
        if m.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, m.q_lora_rank, cfg.attention_bias, fused)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(m.q_lora_rank, h * m.qk_head_dim, False, fused)
        else:
            self.q_proj = Linear(cfg.hidden_size, h * m.qk_head_dim, False, fused)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, m.latent_dim, cfg.attention_bias, fused)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = RowParallelLinear(h * m.v_head_dim, cfg.hidden_size, cfg.o_bias, tp, fused)
        self.attn = MLAPagedAttention(h, m, self.kv_b_proj, use_triton)

    def project(self, positions: torch.Tensor, x: torch.Tensor):
        """x [T, hidden] -> q [T, H, nope + rope] (rope part rotated), the latent rows
        [T, 1, kv_lora_rank + rope] to cache, and None (no separate values)."""
        m = self.mla
        if self.fused:  # the norms and both ropes in Triton: two launches (one without q_lora)
            ops = fused_ops()
            if m.q_lora_rank:
                qa = self.q_a_layernorm
                q = self.q_b_proj(ops.add_rmsnorm(self.q_a_proj(x), None, qa.weight, qa.eps)[0])
            else:
                q = self.q_proj(x)
            q, latent = q.view(-1, self.num_heads, m.qk_head_dim), self.kv_a_proj_with_mqa(x)
            kvn = self.kv_a_layernorm
            ops.mla_rope_latent_(q, latent, positions, self.rotary.cos, self.rotary.sin, kvn.weight, kvn.eps,
                                 self.rotary.interleave)
            return q, latent[:, None, :], None
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m.q_lora_rank else self.q_proj(x)
        q = q.view(-1, self.num_heads, m.qk_head_dim)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        q = torch.cat((q_nope, self.rotary(positions, q_rope)), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c), self.rotary(positions, k_rope[:, None, :])[:, 0]), dim=-1)
        return q, latent[:, None, :], None


class DeepseekMoE(SparseMoE):
    """Routed experts (SparseMoE's fused weights) chosen by DeepSeek's router in float32, plus
    the shared experts."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, use_triton: bool, fused: bool = False):
        super().__init__(cfg.hidden_size, cfg.moe, tp, use_triton)
        self.use_triton = use_triton
        if cfg.moe.routing == "sigmoid_group":
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.moe.num_experts))
        shared = cfg.moe.shared_intermediate_size
        self.shared_experts = MLP(cfg, fused, tp, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        bias, moe = getattr(self.gate, "e_score_correction_bias", None), self.moe
        if self.use_triton:  # routing and ranking in one launch, then the fused experts
            from ..ops.triton_moe import fused_moe_triton
            from ..ops.triton_moe_route import route_triton

            renorm = moe.routing == "sigmoid_group" and moe.norm_topk_prob
            weights, ids, ranked = route_triton(logits, moe.top_k, renorm, torch.float32, moe, bias)
            if self.held is not None:  # expert parallel: the ranks' own experts (models/moe.py)
                ids, ranked = local_ids(ids, self.held), None
            out = fused_moe_triton(x, self.w_gate_up, self.w_down, weights, ids, ranked=ranked,
                                   skip=self.held is not None, fp8=self.fp8())
        else:
            weights, ids = route_grouped(logits, moe, bias)
            out = fused_moe_ref(x, self.w_gate_up, self.w_down, weights, local_ids(ids, self.held))
        out = self.tp.all_reduce(out)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekForCausalLM(DecoderStack):
    def __init__(self, cfg: ModelConfig, max_positions: int, use_triton: bool, fused: bool = False,
                 tp: TPGroup | None = None):
        """`fused`: the elementwise parts through Triton (ops/triton_fused.py: the norms with the
        residual, both ropes with the latent's norm, SiLU x up) and the router in one launch."""
        super().__init__(cfg, fused, tp)
        m, tp = cfg.mla, self.tp
        self.rotary = DeepseekRotary(m.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                     m.rope_interleave)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, MLAttention(cfg, self.rotary, use_triton, tp, fused),
                         DeepseekMoE(cfg, tp, use_triton, fused) if cfg.moe is not None and cfg.moe.layers[i]
                         else MLP(cfg, fused, tp), fused)
            for i in range(cfg.num_layers))
        self.add_head()

    def float32_params(self) -> set[str]:
        """Parameters kept in float32 whatever the model's dtype: the routers (Hugging Face keeps
        DeepSeek's gate and its correction bias in float32)."""
        return {n for n, _ in self.named_parameters() if ".mlp.gate." in n}

    # ---- weights -----------------------------------------------------------------------
    def shard_targets(self, hf_name: str) -> list[tuple[str, slice | None, int, slice | None]]:
        """Where a Hugging Face tensor goes on this rank (the loader's form, as LlamaForCausalLM's):
        the experts' per-expert tensors into the fused ones, the dense MLPs' gate and up into
        gate_up_proj; the heads' and the MLPs' rank slices; multi-token-prediction layers past
        num_hidden_layers are not served."""
        name = hf_name.removeprefix("model.")
        r = self.tp.rank
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.cfg.num_layers:
            return []
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return []
        expert = _EXPERT.match(name)
        if expert:
            prefix, e, part = expert.groups()
            return self.get_submodule(prefix).expert_targets(prefix, int(e), part)
        for part in ("gate_proj", "up_proj"):
            if name.endswith(f".{part}.weight"):
                mlp = self.get_submodule(name.rsplit(".", 2)[0])
                ff = mlp.gate_up_proj.weight.shape[0] // 2
                rows = slice(0, ff) if part == "gate_proj" else slice(ff, 2 * ff)
                return [(name.replace(part, "gate_up_proj"), rows, 0, slice(r * ff, (r + 1) * ff))]
        if name.endswith(".down_proj.weight"):
            ff = self.get_submodule(name.removesuffix(".weight")).weight.shape[1]
            return [(name, None, 1, slice(r * ff, (r + 1) * ff))]
        m, h = self.cfg.mla, self.cfg.num_heads // self.tp.size
        for part, width in (("q_proj", m.qk_head_dim), ("q_b_proj", m.qk_head_dim),
                            ("kv_b_proj", m.qk_nope_head_dim + m.v_head_dim)):
            if name.endswith(f".self_attn.{part}.weight"):
                return [(name, None, 0, slice(r * h * width, (r + 1) * h * width))]
        if name.endswith(".self_attn.o_proj.weight"):
            return [(name, None, 1, slice(r * h * m.v_head_dim, (r + 1) * h * m.v_head_dim))]
        lo, hi = self.vocab_rows
        if name == "lm_head.weight":
            return [(name, slice(0, hi - lo), 0, slice(lo, hi))]
        if name == "embed_tokens.weight" and self.cfg.tie_word_embeddings and self.tp.size > 1:
            return [(name, None, 0, None), ("lm_head.weight", slice(0, hi - lo), 0, slice(lo, hi))]
        return [(name, None, 0, None)]
