"""A linear layer over a few rows in Triton: y = x @ W^T (+ b) for x [M <= MAX_ROWS, K], W [N, K].

    gemv_triton(x, weight, bias=None, tiles=GemvTiles()) -> [M, N] in x's dtype

A decode step of one to four sequences reads each weight once and does two FLOPs per byte: the
GEMM is a GEMV, bound by how fast the weight streams from HBM. cuBLAS picks tiles made for
larger M there (qkv and o of a Qwen3-30B-A3B layer at batch 1: 7.7 and 8.9 us against 4.4
and 3.5 us of weight bytes on an H200). Here each program takes BLOCK_N whole rows of W (up to
BLOCK_K of K per load, all of K for the usual hidden sizes, so a program's loads are in flight
together), multiplies them with each of x's M rows in fp32 and writes [M, BLOCK_N]; the weight
is read once, streaming (evict first), x from cache. Sizes depend on the shapes only: decode
graphs capture it. Written for the GPU and for the CPU interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 4  # the most rows the kernel takes
FEW_ROWS = 1  # up to this many rows a linear layer runs here (models/layers.linear): bench/gemv_gpu.py
# on an H200 beat cuBLAS at one row on 6 of 7 decode shapes, at two on 3, at four on none


@triton.jit
def _row_dot(acc, w, x_ptr, row, k0, offs_k, mask_k, stride_xm):
    x = tl.load(x_ptr + row * stride_xm + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    return acc + tl.sum(w * x[None, :], 1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om, M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        acc0 = _row_dot(acc0, w, x_ptr, 0, k0, offs_k, mask_k, stride_xm)
        if M > 1:
            acc1 = _row_dot(acc1, w, x_ptr, 1, k0, offs_k, mask_k, stride_xm)
        if M > 2:
            acc2 = _row_dot(acc2, w, x_ptr, 2, k0, offs_k, mask_k, stride_xm)
        if M > 3:
            acc3 = _row_dot(acc3, w, x_ptr, 3, k0, offs_k, mask_k, stride_xm)
    b = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_n, (acc0 + b).to(dt), mask=mask_n)
    if M > 1:
        tl.store(out_ptr + stride_om + offs_n, (acc1 + b).to(dt), mask=mask_n)
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + offs_n, (acc2 + b).to(dt), mask=mask_n)
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + offs_n, (acc3 + b).to(dt), mask=mask_n)


@dataclass(frozen=True)
class GemvTiles:
    """Elements of W a program loads at once (`tile` = BLOCK_N x BLOCK_K), the most of K in one
    load (`max_k`), warps."""

    tile: int = 4096  # bench/gemv_gpu.py on an H200: the best at one row on 4 of its 7 shapes, within 7% on the rest
    max_k: int = 2048
    warps: int = 4

    def blocks(self, k: int) -> tuple[int, int]:
        block_k = min(triton.next_power_of_2(k), self.max_k)
        return max(1, self.tile // block_k), block_k


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tiles: GemvTiles = GemvTiles()) -> torch.Tensor:
    """F.linear(x, weight, bias) for 1 <= M <= MAX_ROWS rows, up to the summation order."""
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= MAX_ROWS or weight.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [1..{MAX_ROWS}, K] and weight [N, K] with contiguous rows, got "
                         f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n, block_k = tiles.blocks(K)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, weight if bias is None else bias, out, N, K, x.stride(0), weight.stride(0), out.stride(0),
        M=M, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=tiles.warps)
    return out
