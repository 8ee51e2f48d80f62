"""Linear layers over FP8 block-scaled weights in Triton, the scales applied inside the kernels
(the weights stay float8_e4m3fn in memory: half of bf16's bytes for a decode step to read, and
Hopper's FP8 tensor cores for a prefill's GEMMs).

A weight W [N, K] is held as `wq` (e4m3) and `ws` [ceil(N/bn), ceil(K/bk)] float32, one scale per
(bn, bk) block (engine/fp8.py: W = wq * ws block by block; [128, 128] in every release).

    fp8_linear(x, wq, ws, block)  -> x @ W^T in x's dtype, for x [M, K]
      M <= FEW_ROWS  a GEMV (`_w8a16_kernel`): x stays in its dtype; each program streams BLOCK_N
                     rows of wq and scales each 128-wide group's partial sums by its block's scale
      larger M       W8A8: x is quantized per (row, 128-wide group) to e4m3 with a float32 scale
                     (`quantize_groups`, DeepSeek-V3's activation format), then cuBLAS's block-scaled
                     FP8 GEMM (torch._scaled_mm, 1x128 and 128x128 scales) where torch and the GPU
                     have it, else `_w8a8_kernel`: each K step of 128 one FP8 tensor-core dot, scaled
                     by the row's and the block's scales into a float32 accumulator. On an H200 at
                     Qwen3-32B's prefill GEMMs cuBLAS's runs at 1.6-1.9x bf16, the Triton kernel at
                     ~1.0x: a K step's dot must finish before it is scaled, so the tensor cores
                     wait (bench/results/fp8/)
    reference      `fp8_linear_ref`: the same arithmetic in torch (the tests' and CPU's check)

Written for the GPU and for the CPU interpreter; sizes depend on shapes only (graphs capture them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # the largest finite e4m3fn value
FEW_ROWS = 4  # up to this many rows the GEMV runs (no activation quantization)


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32: the cast
    that follows is exact. (Triton's interpreter casts 126.5 to 64, not 128: it drops the exponent's
    carry when the mantissa rounds up; this one rounding serves the GPU and the interpreter alike.)"""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3); subnormals 2^-9
    magic = 12582912.0  # 1.5 * 2^23: adding and taking it away rounds |v/ulp| < 2^22 to an integer, ties to even
    return ((v / ulp + magic) - magic) * ulp


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg, GROUP: tl.constexpr,
                  GROUPS: tl.constexpr):
    """GROUPS groups of GROUP columns of one row: each to e4m3 with scale amax / 448."""
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 448.0
    q = _round_e4m3(tl.minimum(tl.maximum(x / s[:, None], -448.0), 448.0))
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, s, mask=g * GROUP < K)


def quantize_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 values [M, K], float32 scales [M, ceil(K/group)]): x ~ q * s per group. The
    scales are stored column by column (stride (1, M)), the layout cuBLAS's block-scaled GEMM reads."""
    M, K = x.shape
    groups = triton.cdiv(K, group)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(groups, M, dtype=torch.float32, device=x.device).t()
    per = min(8, triton.next_power_of_2(groups))
    _quant_kernel[(M, triton.cdiv(groups, per))](x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                                 GROUP=group, GROUPS=per)
    return q, s


def quantize_groups_ref(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups in torch."""
    M, K = x.shape
    pad = -K % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(M, -1, group)
    s = (xf.abs().amax(-1).clamp_min(1e-12) / FP8_MAX)
    q = (xf / s[..., None]).to(torch.float8_e4m3fn).view(M, -1)[:, :K]
    return q, s


def dequantize_groups(q: torch.Tensor, s: torch.Tensor, group: int = 128) -> torch.Tensor:
    """quantize_groups' output back to float32: q [M, K] e4m3 times each group's scale s [M, groups]."""
    M, K = q.shape
    return (torch.nn.functional.pad(q.float(), (0, -K % group)).view(M, -1, group) * s[..., None]).view(M, -1)[:, :K]


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, stride_am, stride_asm, stride_ask, stride_bn, stride_bsn,
                 stride_cm, BN_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SCALED: tl.constexpr = True):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)  # GROUP_M row tiles share each column tile while it is in L2
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = offs_m % M  # out-of-range rows and columns read row 0 / column 0 and are not stored
    cols_n = offs_n % N
    a_ptrs = a_ptr + rows_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + rows_m * stride_asm
    bs_ptrs = bs_ptr + (cols_n // BN_ROWS) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if SCALED:  # each K step's dot is finished before it is scaled into acc
            acc += tl.dot(a, b) * tl.load(as_ptrs + kb * stride_ask)[:, None] * tl.load(bs_ptrs + kb)[None, :]
        else:  # the bench's ceiling: the same loads and dots accumulated in the tensor cores, no scales
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _w8a16_row(acc, w, x_ptr, row, k0, offs_k, mask_k, s, stride_xm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP: tl.constexpr):
    x = tl.load(x_ptr + row * stride_xm + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    part = tl.sum(tl.reshape(w * x[None, :], (BLOCK_N, BLOCK_K // GROUP, GROUP)), 2)
    return acc + tl.sum(part * s, 1)


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_om, M: tl.constexpr,
                  BN_ROWS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_K // GROUP)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + (offs_n // BN_ROWS)[:, None] * stride_sn
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        g = k0 // GROUP + offs_g
        s = tl.load(s_rows + g[None, :], mask=mask_n[:, None] & (g * GROUP < K)[None, :], other=0.0)
        acc0 = _w8a16_row(acc0, w, x_ptr, 0, k0, offs_k, mask_k, s, stride_xm, BLOCK_N, BLOCK_K, GROUP)
        if M > 1:
            acc1 = _w8a16_row(acc1, w, x_ptr, 1, k0, offs_k, mask_k, s, stride_xm, BLOCK_N, BLOCK_K, GROUP)
        if M > 2:
            acc2 = _w8a16_row(acc2, w, x_ptr, 2, k0, offs_k, mask_k, s, stride_xm, BLOCK_N, BLOCK_K, GROUP)
        if M > 3:
            acc3 = _w8a16_row(acc3, w, x_ptr, 3, k0, offs_k, mask_k, s, stride_xm, BLOCK_N, BLOCK_K, GROUP)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_n, acc0.to(dt), mask=mask_n)
    if M > 1:
        tl.store(out_ptr + stride_om + offs_n, acc1.to(dt), mask=mask_n)
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + offs_n, acc2.to(dt), mask=mask_n)
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + offs_n, acc3.to(dt), mask=mask_n)


@dataclass(frozen=True)
class Fp8Tiles:
    """How fp8_linear runs: cuBLAS's block-scaled GEMM where torch and the GPU offer it (`cublas`),
    else the W8A8 kernel's tiles (BLOCK_M x BLOCK_N, K steps of the scale block, GROUP_M row tiles per
    column tile, warps, pipeline stages; bench/fp8_gpu.py's best on an H200), and the GEMV's
    (`gemv_tile` weight elements a program loads at once, up to `gemv_max_k` of K, `gemv_warps`)."""

    block_m: int = 64
    block_n: int = 128
    group_m: int = 16
    warps: int = 4
    stages: int = 4
    cublas: bool = True
    gemv_tile: int = 8192
    gemv_max_k: int = 2048
    gemv_warps: int = 4


def _check(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, block: tuple[int, int]) -> None:
    (N, K), (bn, bk) = wq.shape, block
    if x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1 or wq.stride(1) != 1:
        raise ValueError(f"fp8_linear takes x [M, K] and wq [N, K] with contiguous rows, got x {tuple(x.shape)}, "
                         f"wq {tuple(wq.shape)}")
    if tuple(ws.shape) != (triton.cdiv(N, bn), triton.cdiv(K, bk)) or ws.dtype != torch.float32:
        raise ValueError(f"fp8_linear: scales {tuple(ws.shape)} {ws.dtype} do not match wq {tuple(wq.shape)} in "
                         f"blocks of {bn}x{bk} (float32 [{triton.cdiv(N, bn)}, {triton.cdiv(K, bk)}])")
    if bk & (bk - 1) or bk < 16:
        raise ValueError(f"fp8_linear: a scale block's columns must be a power of two >= 16, got {bk}")


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, block: tuple[int, int] = (128, 128),
               tiles: Fp8Tiles = Fp8Tiles()) -> torch.Tensor:
    """x [M, K] @ (wq * ws)^T -> [M, N] in x's dtype (module docstring: which kernel, which arithmetic)."""
    _check(x, wq, ws, block)
    (M, K), N, (bn, bk) = x.shape, wq.shape[0], block
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if M <= FEW_ROWS:
        block_k = max(bk, min(triton.next_power_of_2(K), tiles.gemv_max_k))
        block_n = max(1, tiles.gemv_tile // block_k)
        _w8a16_kernel[(triton.cdiv(N, block_n),)](
            x, wq, ws, out, N, K, x.stride(0), wq.stride(0), ws.stride(0), out.stride(0), M=M, BN_ROWS=bn, GROUP=bk,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=tiles.gemv_warps)
        return out
    xq, xs = quantize_groups(x, bk)
    if tiles.cublas and _cublas_blockwise(x, N, K, block):
        try:
            return torch._scaled_mm(xq, wq.t(), xs, ws.t(), out_dtype=x.dtype)
        except RuntimeError:  # a shape this cuBLAS refuses: the Triton kernel takes it
            pass
    grid = (triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n),)
    _w8a8_kernel[grid](xq, xs, wq, ws, out, M, N, K, xq.stride(0), xs.stride(0), xs.stride(1), wq.stride(0),
                       ws.stride(0), out.stride(0), BN_ROWS=bn, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                       BLOCK_K=bk, GROUP_M=tiles.group_m, num_warps=tiles.warps, num_stages=tiles.stages)
    return out


_CUBLAS: dict[tuple, bool] = {}  # (device index, dtype) -> whether cuBLAS's block-scaled GEMM ran there


def _cublas_blockwise(x: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> bool:
    """Whether torch._scaled_mm takes DeepSeek's scales here: 1 x 128 for x, 128 x 128 for the weight
    (cuBLAS 12.9+ on Hopper; torch >= 2.9). Probed once per GPU and output dtype on a small GEMM;
    a torch or GPU without it gets the Triton kernel."""
    if not x.is_cuda or block != (128, 128) or n % 128 or k % 128 or k < 512:
        return False  # K = 256 (N = 512) came back 287x off on an H200 (torch 2.11, cu130); 512+ agreed
    key = (x.device.index, x.dtype)
    if key not in _CUBLAS:
        try:
            q = torch.zeros(128, 128, dtype=torch.float8_e4m3fn, device=x.device)
            sa = torch.ones(1, 128, device=x.device).t()
            torch._scaled_mm(q, q.t(), sa, torch.ones(1, 1, device=x.device), out_dtype=x.dtype)
            _CUBLAS[key] = True
        except (RuntimeError, TypeError, ValueError):
            _CUBLAS[key] = False
    return _CUBLAS[key]


def fp8_linear_ref(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                   block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """fp8_linear's arithmetic in torch, float32: the GEMV's (x as it is) up to FEW_ROWS rows, W8A8's
    (x quantized per group, each group's dot scaled) above."""
    from pdserve.engine.fp8 import dequantize

    _check(x, wq, ws, block)
    w = dequantize(wq, ws, block, torch.float32)
    if x.shape[0] <= FEW_ROWS:
        return (x.float() @ w.t()).to(x.dtype)
    bk = block[1]
    return (dequantize_groups(*quantize_groups_ref(x, bk), bk) @ w.t()).to(x.dtype)
