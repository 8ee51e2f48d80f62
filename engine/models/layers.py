"""The floor every model family builds on (engine/models/<family>.py): RMSNorm, rope tables
(`RotaryEmbedding`: default, linear and llama3 scaling), the tensor-parallel row linear, the
SiLU-gated MLP, the pre-norm decoder layer around any attention and MLP (`DecoderLayer`), and the
decoder stack (`DecoderStack`: embeddings, layers, final norm, vocab-parallel LM head) with what
the engine's model protocol asks of it (models/protocol.py: forward, pieces, logits, each layer's
attention). `fused=True` runs the elementwise parts through Triton kernels
(engine/ops/triton_fused.py): the residual travels beside the hidden states, and each RMSNorm
adds it first. Numerics follow Hugging Face's modeling code (fp32 RMSNorm statistics, rope tables
built in fp32)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..base.tp import TPGroup, vocab_range
from ..config import ModelConfig
from .attention import AttentionMetadata


def fused_ops():
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


def gemv_op(fused: bool):
    """ops/triton_gemv where a model runs fused (its Triton kernels), else None."""
    if not fused:
        return None
    from ..ops import triton_gemv  # imports Triton only when a model is built fused

    return triton_gemv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv=None) -> torch.Tensor:
    """F.linear, through ops/triton_gemv (`gemv`: gemv_op's) for a CUDA step of up to its FEW_ROWS
    rows (a decode step of one sequence: a GEMV, where cuBLAS's tiles left up to half of the
    bandwidth unused; bench/gemv_gpu.py)."""
    if (gemv is not None and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= gemv.FEW_ROWS and x.stride(1) == 1
            and weight.stride(1) == 1):
        return gemv.gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def hold_fp8(module: nn.Module, block: tuple[int, int]) -> None:
    """From here on `module` (a Linear or RowParallelLinear, still empty) holds its weight as e4m3
    values with a float32 scale per `block` (`weight_scale`, engine/fp8.py's format) and its
    forward runs ops/triton_fp8.fp8_linear: the loader's choice for an FP8 checkpoint's layers
    where the model runs its Triton kernels (exec/loader.py). A module with a `hold_fp8` of its
    own (models/moe.SparseMoE: the fused experts) holds its weights its way."""
    if hasattr(module, "hold_fp8"):
        module.hold_fp8(block)
        return
    n, k = module.weight.shape
    dev = module.weight.device
    module.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev), requires_grad=False)
    module.weight_scale = nn.Parameter(torch.empty(-(-n // block[0]), -(-k // block[1]), device=dev),
                                       requires_grad=False)
    module.fp8_block = block


def fp8_linear(x: torch.Tensor, module: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] through a module that holds FP8 weights (hold_fp8)."""
    from ..ops.triton_fp8 import fp8_linear as run  # imports Triton only for a model that holds FP8

    x2 = x.reshape(-1, x.shape[-1])
    y = run(x2 if x2.stride(-1) == 1 else x2.contiguous(), module.weight, module.weight_scale, module.fp8_block)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """nn.Linear whose few-row steps run `linear`'s GEMV where the model runs fused, or whose
    weight is FP8 with block scales (hold_fp8)."""

    fp8_block: tuple[int, int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, fused: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.gemv = gemv_op(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_block is not None:
            return fp8_linear(x, self, self.bias)
        return linear(x, self.weight, self.bias, self.gemv)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the input dim is split across the ranks;
    the bias is whole on every rank and added once, after the sum. Its weight may be FP8 (hold_fp8)."""

    fp8_block: tuple[int, int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, fused: bool = False):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.gemv = gemv_op(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self, None) if self.fp8_block is not None else linear(x, self.weight, None, self.gemv)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False, tp: TPGroup | None = None,
                 intermediate_size: int | None = None):
        """`intermediate_size`: the config's by default (DeepSeek's shared experts are an MLP of their own)."""
        super().__init__()
        tp = tp or TPGroup()
        self.fused = fused
        self.silu_mul = fused_ops().silu_mul if fused else None
        ff = (intermediate_size or cfg.intermediate_size) // tp.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * ff, cfg.mlp_bias, fused)
        self.down_proj = RowParallelLinear(ff, cfg.hidden_size, cfg.mlp_bias, tp, fused)

    def forward(self, x):
        if self.fused:
            return self.down_proj(self.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: input RMSNorm, `self_attn` (its `project(positions, x)` gives the
    attention's inputs, its `o_proj` takes the attention's output), post-attention RMSNorm, `mlp`."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.add_rmsnorm = fused_ops().add_rmsnorm if fused else None
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def begin(self, positions, h, residual):
        """The layer up to its attention: -> (*the attention's inputs, residual). Unfused, the
        residual is the layer's input h; fused, the residual travels beside h (the RMSNorm adds it first)."""
        ln1 = self.input_layernorm
        if self.fused:
            x, residual = self.add_rmsnorm(h, residual, ln1.weight, ln1.eps)
        else:
            x, residual = ln1(h), h
        return (*self.self_attn.project(positions, x), residual)

    def finish(self, o, residual):
        """The layer after its attention output o [T, H, D]: -> (h, residual); unfused, the
        residual is None and h the layer's output; fused, the layer's output is h + residual."""
        h = self.self_attn.o_proj(o.reshape(o.shape[0], -1))
        ln2 = self.post_attention_layernorm
        if not self.fused:
            h = residual + h
            return h + self.mlp(ln2(h)), None
        x, residual = self.add_rmsnorm(h, residual, ln2.weight, ln2.eps)
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """Embeddings, `layers` (DecoderLayers; a family builds them after this __init__, then calls
    `add_head`), the final norm and the LM head (vocab-parallel: ceil(V/N) rows on each of N ranks,
    the last rank's tail rows zero and cut after the gather)."""

    def __init__(self, cfg: ModelConfig, fused: bool = False, tp: TPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.fused = fused
        # `_weight`: no random init (the loader fills it; on meta, `normal_` imports torch._dynamo)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))

    def add_head(self) -> None:
        cfg, tp = self.cfg, self.tp
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.vocab_rows = vocab_range(cfg.vocab_size, tp.size, tp.rank)
        self.lm_head = Linear(cfg.hidden_size, -(-cfg.vocab_size // tp.size), False, self.fused)
        if cfg.tie_word_embeddings and tp.size == 1:
            self.lm_head.weight = self.embed_tokens.weight

    def attention(self, i: int) -> nn.Module:
        return self.layers[i].self_attn.attn

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def float32_params(self) -> set[str]:
        return set()  # every parameter in the model's dtype unless a family says otherwise

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]: the pieces with each layer's
        attention between them (the piecewise CUDA graphs replay the same pieces, exec/graphs.py)."""
        out = self.piece(0, positions, input_ids)
        for i, (k_cache, v_cache) in enumerate(kv_caches[: len(self.layers)]):
            *inputs, residual = out
            out = self.piece(i + 1, positions, self.attention(i)(*inputs, k_cache, v_cache, meta), residual)
        return out

    def piece(self, i: int, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The model's work between two attentions. Piece 0 embeds the token ids x and runs
        layer 0 up to its attention; piece i (1..L-1) finishes layer i-1 from its attention
        output x [T, H, D] and runs layer i up to its own; piece L finishes the last layer and
        applies the final norm. -> (*attention inputs, residual), or the hidden states [T, hidden] (L)."""
        if i == 0:
            h = self.embed_tokens(x)
        else:
            h, residual = self.layers[i - 1].finish(x, residual)
        if i < len(self.layers):
            return self.layers[i].begin(positions, h, residual)
        if self.fused:
            return fused_ops().add_rmsnorm(h, residual, self.norm.weight, self.norm.eps)[0]
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last(logits)[:, : self.cfg.vocab_size]
        return logits.float()

    def expected_elements(self, name: str, p: torch.Tensor) -> int:
        """How many of parameter `name`'s elements a checkpoint fills (the LM head's padding
        rows on the last rank stay zero)."""
        if name == "lm_head.weight":
            lo, hi = self.vocab_rows
            return (hi - lo) * p.shape[1]
        return p.numel()
