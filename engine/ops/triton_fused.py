"""Fused Triton kernels for the elementwise parts of a decoder layer.

A Llama layer in plain torch launches ~40 kernels, ~30 of them elementwise (RMSNorm's
cast / square / mean / rsqrt / scale, the residual add, rope's gathers, halves and
products, SiLU and the gate product). In a batch-1 decode step each costs a few
microseconds of launch and tail, ~1,300 per step for 32 layers. These three kernels
make it ~10 per layer:

    add_rmsnorm(x, residual, weight, eps)  residual += x (model dtype), then RMSNorm
    rope_(q, k, positions, cos, sin)       rotary embedding in place (rotate-half form), q's and
                                           k's heads in one launch when they are neighbours
    silu_mul(gate_up)                      SiLU(gate) * up over the fused projection
    head_rmsnorm_rope_(q, k, wq, wk, eps, positions, cos, sin)
                                           Qwen3's RMSNorm over each q and each k head, then rope,
                                           in place on the views of qkv, in one launch
    mla_rope_latent_(q, kv, ...)           DeepSeek's MLA: q's rope part rotated in place and
                                           kv_a_proj's row made the cached latent row (its latent
                                           RMS-normalized, its rope key rotated), in one launch

Each reproduces the torch path's rounding (fp32 statistics, a round to the model dtype
wherever torch rounds), so greedy outputs stay those of the reference. Like the
attention kernels they run on CPU tensors under TRITON_INTERPRET=1 for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                        N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # the residual stream, in the model dtype
        tl.store(r_out_ptr + row * stride_ro + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    xn = (xf * tl.rsqrt(var + eps)).to(dt)  # torch.rsqrt, as the torch path
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * xn.to(tl.float32)).to(dt), mask=m)


@triton.jit
def _rotate_half(x1, x2, c, s, dt):
    # torch's x * cos + rotate_half(x) * sin over the halves (fp32 in), each product and the sum
    # rounded to dt as torch rounds them -> the two halves in dt
    o1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _norm_rope_heads(ptr, w_ptr, c, s, stride_h, H, eps, HP: tl.constexpr, HALF: tl.constexpr,
                     HALF_PAD: tl.constexpr):
    # H head rows at ptr: each RMS-normalized (fp32 statistics, rounded to dt, times the weight,
    # rounded), then rotated by (c, s) [1, HALF_PAD] as _rope_kernel rotates: the two kernels' roundings
    rows = tl.arange(0, HP)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    m = (rows < H) & (cols < HALF)
    p1 = ptr + rows * stride_h + cols
    x1 = tl.load(p1, mask=m, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1))[:, None] / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    n1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    n2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    o1, o2 = _rotate_half(n1, n2, c, s, dt)
    tl.store(p1, o1, mask=m)
    tl.store(p1 + HALF, o2, mask=m)


@triton.jit
def _head_rmsnorm_rope_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh,
                              stride_kt, stride_kh, stride_c, H, KVH, eps, HP: tl.constexpr, KVHP: tl.constexpr,
                              HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    # one program = one token: its q heads, then its k heads, each normalized and rotated in registers
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    cols = tl.arange(0, HALF_PAD)[None, :]
    dt = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_c + cols, mask=cols < HALF, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_c + cols, mask=cols < HALF, other=0.0).to(dt).to(tl.float32)
    _norm_rope_heads(q_ptr + t * stride_qt, wq_ptr, c, s, stride_qh, H, eps, HP, HALF, HALF_PAD)
    _norm_rope_heads(k_ptr + t * stride_kt, wk_ptr, c, s, stride_kh, KVH, eps, KVHP, HALF, HALF_PAD)


def head_rmsnorm_rope_(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                       positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [T, H, D] and k [T, KVH, D] (views with unit last stride) in place: each head row replaced
    by its RMSNorm with wq / wk [D] as torch's RMSNorm rounds it, then rotated as rope_ rotates it,
    in one launch (Qwen3's attention inputs: as two launches, a norm's and rope's, they took ~4 us
    of kernel time a layer at one token on an H200, bench/results/moe/moe_gpu.md)."""
    T, H, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or q.stride(2) != 1 or k.stride(2) != 1 or wq.shape != (D,) \
            or wk.shape != (D,) or q.dtype != k.dtype:
        raise ValueError(f"head_rmsnorm_rope_ wants q [T, H, D], k [T, KVH, D] of one dtype with unit last stride "
                         f"and weights [D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, {tuple(wq.shape)}, "
                         f"{tuple(wk.shape)}")
    if positions.shape != (T,) or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D or D % 2 \
            or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError(f"head_rmsnorm_rope_: positions {tuple(positions.shape)} and tables {tuple(cos.shape)} "
                         f"do not fit q {tuple(q.shape)} (contiguous tables [max_positions, D], D even)")
    if T:
        kvh = k.shape[1]
        _head_rmsnorm_rope_kernel[(T,)](q, k, wq, wk, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                                        k.stride(1), cos.stride(0), H, kvh, eps, HP=triton.next_power_of_2(H),
                                        KVHP=triton.next_power_of_2(kvh), HALF=D // 2,
                                        HALF_PAD=triton.next_power_of_2(D // 2))


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); residual None: (RMSNorm(x), x)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rmsnorm wants x [tokens, hidden] with unit last stride and weight [hidden]; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    T, N = x.shape
    out = torch.empty_like(x)
    if residual is None:
        r_in = r_out = x
    else:
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        r_in, r_out = residual, torch.empty_like(x)
    if T:
        _add_rmsnorm_kernel[(T,)](x, r_in, weight, out, r_out, x.stride(0), r_in.stride(0), out.stride(0),
                                  r_out.stride(0), N, eps, HAS_RES=residual is not None,
                                  BLOCK=triton.next_power_of_2(N), num_warps=8 if N >= 2048 else 4)
    return out, r_out


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, H,
                 HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t)
    heads = tl.arange(0, H_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    m = (heads < H) & (cols < HALF)
    # the tables are fp32 [max_positions, head_dim], both halves equal; torch casts them first
    c = tl.load(cos_ptr + pos * stride_c + cols, mask=cols < HALF, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_c + cols, mask=cols < HALF, other=0.0).to(dt).to(tl.float32)
    p1 = x_ptr + t * stride_t + heads * stride_h + cols
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=m, other=0.0).to(tl.float32)
    o1, o2 = _rotate_half(x1, x2, c, s, dt)
    tl.store(p1, o1, mask=m)
    tl.store(p1 + HALF, o2, mask=m)


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D] in place (views of the qkv output are fine:
    only the last dimension must be contiguous); cos/sin [max_positions, D] fp32."""
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3 or x.stride(-1) != 1 or x.shape[0] != positions.shape[0] or x.shape[2] != cos.shape[1]:
            raise ValueError(f"rope_: {name} {tuple(x.shape)} does not fit positions {tuple(positions.shape)} "
                             f"and tables {tuple(cos.shape)}")
    if cos.shape != sin.shape or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("rope_: cos and sin must be contiguous and of one shape")
    T, _, D = q.shape
    if D % 2:
        raise ValueError(f"rope_: head_dim must be even, got {D}")
    if T:
        for x, H in _rope_launches(q, k):
            _rope_kernel[(T,)](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), H,
                               HALF=D // 2, H_PAD=triton.next_power_of_2(H),
                               HALF_PAD=triton.next_power_of_2(D // 2))
    return q, k


def _rope_launches(q: torch.Tensor, k: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """One launch over q's and k's heads together when k's heads follow q's in memory with
    q's strides (q and k views of one qkv projection, as the model makes them), else one each."""
    # one token: view() gives q and k different row strides, which the kernel never uses
    rows_alike = q.shape[0] == 1 or q.stride(0) == k.stride(0)
    follows = (q.dtype == k.dtype and rows_alike and q.stride(1) == k.stride(1) == q.shape[2]
               and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size())
    return [(q, q.shape[1] + k.shape[1])] if follows else [(q, q.shape[1]), (k, k.shape[1])]


@triton.jit
def _rotate_pairs(base, rows, m, cols, c, s, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    # in place: x1 (the pairs' first elements: even columns, or the first half) and x2 rotated in
    # float32, written as Hugging Face's DeepSeek rope leaves them, x1's results then x2's
    dt = base.dtype.element_ty
    if INTERLEAVE:
        x1 = tl.load(base + rows + 2 * cols, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + rows + 2 * cols + 1, mask=m, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + rows + cols, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + rows + cols + HALF, mask=m, other=0.0).to(tl.float32)
    tl.debug_barrier()  # every thread's loads before any store: a pair's results land on others' inputs
    tl.store(base + rows + cols, (x1 * c - x2 * s).to(dt), mask=m)
    tl.store(base + rows + cols + HALF, (x2 * c + x1 * s).to(dt), mask=m)


@triton.jit
def _mla_rope_latent_kernel(q_ptr, kv_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kv,
                            stride_c, H, NOPE, RANK, eps, HALF: tl.constexpr, H_PAD: tl.constexpr,
                            HALF_PAD: tl.constexpr, RANK_PAD: tl.constexpr, INTERLEAVE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    cols = tl.arange(0, HALF_PAD)[None, :]
    c = tl.load(cos_ptr + pos * stride_c + cols, mask=cols < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * stride_c + cols, mask=cols < HALF, other=0.0)
    heads = tl.arange(0, H_PAD)[:, None]
    _rotate_pairs(q_ptr + t * stride_qt + NOPE, heads * stride_qh, (heads < H) & (cols < HALF), cols, c, s, HALF,
                  INTERLEAVE)
    row = kv_ptr + t * stride_kv
    _rotate_pairs(row + RANK, heads * 0, (heads == 0) & (cols < HALF), cols, c, s, HALF, INTERLEAVE)
    offs = tl.arange(0, RANK_PAD)
    m = offs < RANK
    dt = kv_ptr.dtype.element_ty
    x = tl.load(row + offs, mask=m, other=0.0).to(tl.float32)
    xn = (x * tl.rsqrt(tl.sum(x * x, axis=0) / RANK + eps)).to(dt)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(row + offs, (w.to(tl.float32) * xn.to(tl.float32)).to(dt), mask=m)


def mla_rope_latent_(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, interleave: bool) -> None:
    """In place, one launch per step: q [T, H, nope + rope] (unit last stride) gets its rope part
    rotated; kv [T, rank + rope] (kv_a_proj's output, contiguous rows) becomes the row a token
    caches: RMSNorm(latent) x norm_weight [rank], then the rotated rope key. cos/sin
    [max_positions, rope / 2] float32 (models/deepseek.DeepseekRotary's, its scale folded in).
    The rounding is the torch path's: rope in float32, one round to the model dtype."""
    T, H, D = q.shape
    half = cos.shape[1]
    rank = norm_weight.shape[0]
    if kv.dim() != 2 or kv.shape != (T, rank + 2 * half) or kv.stride(1) != 1 or q.stride(2) != 1 \
            or D < 2 * half or positions.shape != (T,) or sin.shape != cos.shape or not cos.is_contiguous() \
            or not sin.is_contiguous():
        raise ValueError(f"mla_rope_latent_: q {tuple(q.shape)}, kv {tuple(kv.shape)}, norm {rank}, tables "
                         f"{tuple(cos.shape)} and positions {tuple(positions.shape)} do not fit together")
    if T:
        _mla_rope_latent_kernel[(T,)](q, kv, norm_weight, positions, cos, sin, q.stride(0), q.stride(1), kv.stride(0),
                                      cos.stride(0), H, D - 2 * half, rank, eps, HALF=half,
                                      H_PAD=triton.next_power_of_2(H), HALF_PAD=triton.next_power_of_2(half),
                                      RANK_PAD=triton.next_power_of_2(rank), INTERLEAVE=interleave)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    dt = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + N + cols, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # torch rounds SiLU's output, then the product
    tl.store(out_ptr + t * stride_o + cols, (s * u).to(dt), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2N] (gate first) -> SiLU(gate) * up, [T, N]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul wants [tokens, 2 * N] with unit last stride, got {tuple(gate_up.shape)}")
    T, N = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((T, N), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(1024, triton.next_power_of_2(N))
        _silu_mul_kernel[(T, triton.cdiv(N, block))](gate_up, out, gate_up.stride(0), out.stride(0), N, BLOCK=block)
    return out
