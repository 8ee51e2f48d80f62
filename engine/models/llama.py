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

`fused=True` runs the elementwise parts through Triton kernels (engine/ops/triton_fused.py):
the residual travels beside the hidden states, and each RMSNorm adds it first.

With a tensor-parallel group of N (engine/exec/tp.py) each rank builds its shard: its q and KV
heads, its ff/N of gate/up, o and down reading only those, an all-reduce after each of
o and down (their biases added once, after it), its ceil(V/N) rows of the LM head.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..exec.attention import AttentionMetadata, PagedAttention
from ..exec.tp import TPGroup, kv_head_range, vocab_range
from .moe import SparseMoE

# a checkpoint's per-expert tensors: Qwen3-MoE's (mlp.experts.E.{gate,up,down}_proj) and Mixtral's
# (block_sparse_moe.experts.E.{w1,w3,w2}); Mixtral's router is block_sparse_moe.gate
_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _fused_ops():
    from ..ops import triton_fused  # imports Triton only when a model is built fused

    return triton_fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rtype = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rtype == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        # computed on the host even under `torch.device("meta")` (the loader moves them): math on
        # meta goes through torch._refs, whose first use imports torch._dynamo (1.7 s of every start)
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q [T, H, D], k [T, KVH, D]
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the input dim is split across the ranks;
    the bias is whole on every rank and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, use_triton: bool, fused: bool = False,
                 layer: int = 0, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup()
        self.fused = fused
        self.rope_ = _fused_ops().rope_ if fused else None
        self.num_heads = cfg.num_heads // tp.size
        lo, hi = kv_head_range(cfg.num_kv_heads, tp.size, tp.rank)
        self.num_kv_heads, self.head_dim = hi - lo, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
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
        if self.qk_norm and self.fused:  # in place, one launch: q and k stay neighbours in qkv for rope
            _fused_ops().head_rmsnorm_(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        elif self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused:  # q and k are neighbours in qkv's rows: one launch rotates both
            self.rope_(q, k, positions, self.rotary.cos, self.rotary.sin)
        else:
            q, k = self.rotary(positions, q, k)
        # v stays a view of qkv: the KV store reads it by its strides (a copy was one more launch a layer)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False, tp: TPGroup | None = None,
                 intermediate_size: int | None = None):
        """`intermediate_size`: the config's by default (DeepSeek's shared experts are an MLP of their own)."""
        super().__init__()
        tp = tp or TPGroup()
        self.fused = fused
        self.silu_mul = _fused_ops().silu_mul if fused else None
        ff = (intermediate_size or cfg.intermediate_size) // tp.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * ff, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(ff, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x):
        if self.fused:
            return self.down_proj(self.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, use_triton: bool, fused: bool = False,
                 layer: int = 0, tp: TPGroup | None = None):
        super().__init__()
        self.fused = fused
        self.add_rmsnorm = _fused_ops().add_rmsnorm if fused else None
        self.self_attn = Attention(cfg, rotary, use_triton, fused, layer, tp)
        sparse = cfg.moe is not None and cfg.moe.layers[layer]
        self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, tp, use_triton) if sparse else MLP(cfg, fused, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def begin(self, positions, h, residual):
        """The layer up to its attention: -> (q, k, v, residual). Unfused, the residual is the
        layer's input h; fused, the residual travels beside h (the RMSNorm adds it first)."""
        ln1 = self.input_layernorm
        if self.fused:
            x, residual = self.add_rmsnorm(h, residual, ln1.weight, ln1.eps)
        else:
            x, residual = ln1(h), h
        return (*self.self_attn.project(positions, x), residual)

    def finish(self, o, residual):
        """The layer after its attention output o [T, H, D]: -> (h, residual); unfused, the
        residual is None and h the layer's output; fused, the layer's output is h + residual."""
        h = self.self_attn.o_proj(o.reshape(-1, self.self_attn.q_size))
        ln2 = self.post_attention_layernorm
        if not self.fused:
            h = residual + h
            return h + self.mlp(ln2(h)), None
        x, residual = self.add_rmsnorm(h, residual, ln2.weight, ln2.eps)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, use_triton: bool, fused: bool = False,
                 tp: TPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TPGroup()
        self.fused = fused
        # `_weight`: no random init (the loader fills it; on meta, `normal_` imports torch._dynamo)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, use_triton, fused, i, tp)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # vocab-parallel: ceil(V/N) rows here (the last rank's tail rows are zero, cut after the gather)
        self.vocab_rows = vocab_range(cfg.vocab_size, tp.size, tp.rank)
        self.lm_head = nn.Linear(cfg.hidden_size, -(-cfg.vocab_size // tp.size), bias=False)
        if cfg.tie_word_embeddings and tp.size == 1:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]: the pieces with each layer's
        attention between them (the piecewise CUDA graphs replay the same pieces, exec/graphs.py)."""
        out = self.piece(0, positions, input_ids)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches), 1):
            q, k, v, residual = out
            out = self.piece(i, positions, layer.self_attn.attn(q, k, v, k_cache, v_cache, meta), residual)
        return out

    def piece(self, i: int, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The model's work between two attentions. Piece 0 embeds the token ids x and runs
        layer 0 up to its attention; piece i (1..L-1) finishes layer i-1 from its attention
        output x [T, H, D] and runs layer i up to its own; piece L finishes the last layer and
        applies the final norm. -> (q, k, v, residual), or the hidden states [T, hidden] (L)."""
        if i == 0:
            h = self.embed_tokens(x)
        else:
            h, residual = self.layers[i - 1].finish(x, residual)
        if i < len(self.layers):
            return self.layers[i].begin(positions, h, residual)
        if self.fused:
            return _fused_ops().add_rmsnorm(h, residual, self.norm.weight, self.norm.eps)[0]
        return self.norm(h)

    def attention(self, i: int) -> nn.Module:
        return self.layers[i].self_attn.attn

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def float32_params(self) -> set[str]:
        return set()  # every parameter in the model's dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last(logits)[:, : self.cfg.vocab_size]
        return logits.float()

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

    def expected_elements(self, name: str, p: torch.Tensor) -> int:
        """How many of parameter `name`'s elements a checkpoint fills (the LM head's padding
        rows on the last rank stay zero)."""
        if name == "lm_head.weight":
            lo, hi = self.vocab_rows
            return (hi - lo) * p.shape[1]
        return p.numel()
