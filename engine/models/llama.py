"""The Llama-shaped GQA decoders: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2, SmolLM2,
Qwen3, and the mixture-of-experts Qwen3-MoE and Mixtral.

They differ only in what their configuration declares (engine/architectures.py): GQA ratio,
biases (q/k/v: Qwen2; q/k/v/o and the MLP's where a Llama or Qwen3 config says so), attention
windows per layer (Mistral, Mixtral: every layer; Qwen2, Qwen3: the layers `layer_types` marks
sliding), tied embeddings (SmolLM2, small Qwen2/Qwen3), an RMSNorm over each q and k head before
rope (Qwen3), and which layers' MLP is a sparse block of experts (models/moe.py). Projections
are fused (qkv, gate_up) so that a layer runs 4 matmuls; checkpoints are loaded by slicing the
Hugging Face tensors into the fused weights, per-expert tensors into the experts' fused ones.
Numerics follow HF's modeling code (fp32 RMSNorm statistics, rope tables built in fp32) so greedy
outputs match it.

The norms, rope tables, parallel linears, MLP, the pre-norm layer and the decoder stack are the
shared floor (models/layers.py); this file is the GQA attention and the checkpoint mapping.

With a tensor-parallel group of N (engine/base/tp.py) each rank builds its shard: its q and KV
heads, its ff/N of gate/up, o and down reading only those, an all-reduce after each of
o and down (their biases added once, after it), its ceil(V/N) rows of the LM head.
"""

from __future__ import annotations

import re

from torch import nn

from ..base.tp import TPGroup, kv_head_range
from ..config import ModelConfig
from .attention import PagedAttention
from .layers import MLP, DecoderLayer, DecoderStack, Linear, RMSNorm, RotaryEmbedding, RowParallelLinear, fused_ops
from .moe import SparseMoE

# a checkpoint's per-expert tensors: Qwen3-MoE's (mlp.experts.E.{gate,up,down}_proj) and Mixtral's
# (block_sparse_moe.experts.E.{w1,w3,w2}); Mixtral's router is block_sparse_moe.gate
_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, use_triton: bool, fused: bool = False,
                 layer: int = 0, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup()
        self.fused = fused
        self.rope_ = fused_ops().rope_ if fused else None
        self.num_heads = cfg.num_heads // tp.size
        lo, hi = kv_head_range(cfg.num_kv_heads, tp.size, tp.rank)
        self.num_kv_heads, self.head_dim = hi - lo, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, fused)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp, fused)
        self.rotary = rotary
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5, cfg.layer_windows[layer], use_triton)

    def project(self, positions, x):
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D], rope applied."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm and self.fused:  # in place, one launch: the norms, then rope
            fused_ops().head_rmsnorm_rope_(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, positions,
                                           self.rotary.cos, self.rotary.sin)
            return q, k, v
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused:  # q and k are neighbours in qkv's rows: one launch rotates both
            self.rope_(q, k, positions, self.rotary.cos, self.rotary.sin)
        else:
            q, k = self.rotary(positions, q, k)
        # v stays a view of qkv: the KV store reads it by its strides (a copy was one more launch a layer)
        return q, k, v


class LlamaForCausalLM(DecoderStack):
    def __init__(self, cfg: ModelConfig, max_positions: int, use_triton: bool, fused: bool = False,
                 tp: TPGroup | None = None):
        super().__init__(cfg, fused, tp)
        self.rotary = rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, Attention(cfg, rotary, use_triton, fused, i, self.tp), self._mlp(i, use_triton), fused)
            for i in range(cfg.num_layers))
        self.add_head()

    def _mlp(self, layer: int, use_triton: bool) -> nn.Module:
        """Layer `layer`'s MLP: a sparse block of experts where the config's MoE layers say so."""
        cfg = self.cfg
        if cfg.moe is not None and cfg.moe.layers[layer]:
            return SparseMoE(cfg.hidden_size, cfg.moe, self.tp, use_triton)
        return MLP(cfg, self.fused, self.tp)

    # ---- weights -----------------------------------------------------------------------
    def shard_targets(self, hf_name: str) -> list[tuple[str, slice | None, int, slice | None]]:
        """Where a Hugging Face tensor goes on this rank: [(our parameter, rows within it,
        dim of the source to slice, the slice of it this rank reads (None: all))]."""
        c, tp = self.cfg, self.tp
        name = hf_name.removeprefix("model.")
        if name.startswith("rotary_emb") or ".rotary_emb." in name:
            return []
        if name == "lm_head.weight" and c.tie_word_embeddings:
            return []
        expert = _EXPERT.match(name)
        if expert:
            layer, e, part = expert.groups()
            return self.get_submodule(f"{layer}.mlp").expert_targets(f"{layer}.mlp", int(e), _EXPERT_PART[part])
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        d, r = c.head_dim, tp.rank
        hq = c.num_heads // tp.size
        klo, khi = kv_head_range(c.num_kv_heads, tp.size, r)
        q, kv = hq * d, (khi - klo) * d
        kv_src = slice(klo * d, khi * d)
        for part, rows, src in (("q_proj", slice(0, q), slice(r * q, (r + 1) * q)),
                                ("k_proj", slice(q, q + kv), kv_src), ("v_proj", slice(q + kv, q + 2 * kv), kv_src)):
            if f".self_attn.{part}." in name:
                return [(name.replace(part, "qkv_proj"), rows, 0, src)]
        ff = c.intermediate_size // tp.size
        for part, rows in (("gate_proj", slice(0, ff)), ("up_proj", slice(ff, 2 * ff))):
            if f".mlp.{part}." in name:
                return [(name.replace(part, "gate_up_proj"), rows, 0, slice(r * ff, (r + 1) * ff))]
        for part, width in (("self_attn.o_proj.weight", q), ("mlp.down_proj.weight", ff)):
            if name.endswith(part):
                return [(name, None, 1, slice(r * width, (r + 1) * width))]
        lo, hi = self.vocab_rows
        if name == "lm_head.weight":
            return [(name, slice(0, hi - lo), 0, slice(lo, hi))]
        if name == "embed_tokens.weight" and c.tie_word_embeddings and tp.size > 1:
            return [(name, None, 0, None), ("lm_head.weight", slice(0, hi - lo), 0, slice(lo, hi))]
        return [(name, None, 0, None)]
