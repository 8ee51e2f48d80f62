"""A decode step's mixture-of-experts layer in three launches: router, gate/up, down with the combine.

    moe_decode_triton(x, router_w, w_gate_up, w_down, routing, weights_dtype, arrivals, held=None)
                -> [T, hidden]

At a few tokens (T <= DECODE_TOKENS) the grouped path (ops/triton_moe.py: the router's GEMM,
routing, the alignment's blocks, gate/up, down, combine: six launches) is bound by launches, not
bytes: a batch-1 step spent 25 of its 40 us a layer outside the two GEMMs. Here every assignment
(token x slot) is its own GEMV, so nothing needs aligning:

    router      grid (T, E / BLOCK_E): each program computes BLOCK_E of a token's logits (fp32,
                rounded to x's dtype as the router's GEMM writes them) into `logits`; the last
                of a token's programs to arrive (a counter per token, `arrivals`, zero between
                calls: the last program resets it) routes the token (_route_row: the same top-k
                and weights as route_triton) and writes its ids and weights
    gate/up     grid (I / BLOCK_N, T x k): SiLU(x @ gate^T) x (x @ up^T) of one assignment's
                expert, BLOCK_N intermediate columns, stored in x's dtype as the grouped path's
    down        grid (hidden / BLOCK_N, T): a token's k assignments through their experts' down,
                each rounded to x's dtype, scaled by its weight and summed in fp32 in slot order
                (the grouped path's combine, fused)

Expert parallel (`held` = (first, count)): the router routes over every expert; an assignment to
another rank's expert computes nothing and adds nothing. Sizes depend on T only, no host sync:
decode graphs capture the three launches. Written for the GPU and for the CPU interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_moe_route import Routing, _route_row

DECODE_TOKENS = 4  # up to this many tokens a step runs this path (bench/moe_gpu.py --decode-sweep)


@triton.jit
def _moe_router_kernel(x_ptr, wr_ptr, bias_ptr, logits_ptr, arrivals_ptr, w_ptr, ids_ptr, H, E, stride_xt, scale,
                       ROUND: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
                       E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr,
                       ROUTING: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = k0 + offs_k < H
        xk = tl.load(x_ptr + t * stride_xt + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(wr_ptr + offs_e.to(tl.int64)[:, None] * H + (k0 + offs_k)[None, :],
                    mask=mask_e[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += w * xk[None, :]
    logit = tl.sum(acc, 1)
    if ROUND:  # as the router's GEMM in x's dtype writes its logits
        logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + t * E + offs_e, logit, mask=mask_e)
    tl.debug_barrier()  # every thread's logits stored before the arrival (acq_rel: released with it)
    if tl.atomic_add(arrivals_ptr + t, 1) == CHUNKS - 1:  # the token's last program routes it
        tl.store(arrivals_ptr + t, 0)
        offs = tl.arange(0, E_PAD)
        live = offs < E
        logits = tl.load(logits_ptr + t * E + offs, mask=live, other=float("-inf"), cache_modifier=".cg")
        top_ids, top_p = _route_row(logits, bias_ptr, offs, live, E, scale, TOP_K, K_PAD, RENORM, ROUTING, N_GROUP,
                                    G_PAD, TOPK_GROUP)
        ks = tl.arange(0, K_PAD)
        tl.store(w_ptr + t * TOP_K + ks, top_p.to(w_ptr.dtype.element_ty), mask=ks < TOP_K)
        tl.store(ids_ptr + t * TOP_K + ks, top_ids, mask=ks < TOP_K)


@triton.jit
def _moe_gemv_gate_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, H, inter, FIRST, COUNT, stride_xt, stride_we, stride_wn,
                             TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # w [E, 2 x inter, H]: gate rows [0, inter), up rows [inter, 2 x inter); h [T x k, inter]
    a = tl.program_id(1)
    e = tl.load(ids_ptr + a) - FIRST
    if (e >= 0) & (e < COUNT):
        t = (a // TOP_K).to(tl.int64)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            mask_k = k0 + offs_k < H
            xk = tl.load(x_ptr + t * stride_xt + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            wmask = mask_n[:, None] & mask_k[None, :]
            g = tl.load(w_e + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :], mask=wmask, other=0.0)
            u = tl.load(w_e + (inter + offs_n)[:, None] * stride_wn + (k0 + offs_k)[None, :], mask=wmask, other=0.0)
            acc_g += g.to(tl.float32) * xk[None, :]
            acc_u += u.to(tl.float32) * xk[None, :]
        g = tl.sum(acc_g, 1)
        h = g / (1.0 + tl.exp(-g)) * tl.sum(acc_u, 1)  # SiLU(gate) x up
        tl.store(h_ptr + a.to(tl.int64) * inter + offs_n, h.to(h_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _moe_gemv_down_kernel(h_ptr, w_ptr, ids_ptr, tw_ptr, out_ptr, H, inter, FIRST, COUNT, stride_we, stride_wn,
                          stride_ot, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # w [E, H, inter]; a token's k rows of h -> out [T, H], combined in slot order
    t = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    out = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        a = t * TOP_K + j
        e = tl.load(ids_ptr + a) - FIRST
        here = (e >= 0) & (e < COUNT)
        w_e = w_ptr + tl.where(here, e, 0).to(tl.int64) * stride_we
        width = tl.where(here, inter, 0)  # another rank's expert: nothing read, nothing added
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            mask_k = k0 + offs_k < width
            hk = tl.load(h_ptr + a * inter + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            w = tl.load(w_e + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc += w.to(tl.float32) * hk[None, :]
        y = tl.sum(acc, 1).to(out_ptr.dtype.element_ty).to(tl.float32)  # as the grouped path stores its rows
        out += y * tl.load(tw_ptr + a).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


@dataclass(frozen=True)
class DecodeTiles:
    """The decode path's tiles: router experts per program, GEMV output columns per program for
    gate/up and for down, reduction depth, warps."""

    block_e: int = 8
    gate_up_n: int = 16
    down_n: int = 16
    block_k: int = 256
    warps: int = 4


def moe_decode_triton(x: torch.Tensor, router_w: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      routing: Routing, weights_dtype: torch.dtype, arrivals: torch.Tensor,
                      held: tuple[int, int] | None = None, correction_bias: torch.Tensor | None = None,
                      tiles: DecodeTiles = DecodeTiles()) -> torch.Tensor:
    """x [T, hidden] through a sparse layer from its router weight [E, hidden] (the logits rounded to
    router_w's dtype unless it is float32, as F.linear(x, router_w) writes them); `arrivals` [>= T]
    int32, zero, and zero again on return (the caller keeps one per layer); `held` as
    ops/triton_moe.moe_triton. Equal to moe_triton on F.linear(x, router_w)'s logits up to the
    GEMMs' summation order."""
    T, H = x.shape
    E = router_w.shape[0]
    count, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    first, count = held if held is not None else (0, count)
    if router_w.shape != (E, H) or w_down.shape != (count, H, inter) or arrivals.numel() < T:
        raise ValueError(f"decode MoE shapes do not fit x {tuple(x.shape)}: router {tuple(router_w.shape)}, "
                         f"w_down {tuple(w_down.shape)}, arrivals {arrivals.numel()}")
    k = routing.top_k
    dev = x.device
    logits = torch.empty(T, E, dtype=torch.float32, device=dev)
    weights = torch.empty(T, k, dtype=weights_dtype, device=dev)
    ids = torch.empty(T, k, dtype=torch.int32, device=dev)
    chunks = triton.cdiv(E, tiles.block_e)
    _moe_router_kernel[(T, chunks)](
        x, router_w, logits if correction_bias is None else correction_bias, logits, arrivals, weights, ids, H, E,
        x.stride(0), routing.scale, ROUND=router_w.dtype != torch.float32, BLOCK_E=tiles.block_e,
        BLOCK_K=tiles.block_k, CHUNKS=chunks, E_PAD=triton.next_power_of_2(E), **routing.consts(),
        num_warps=tiles.warps)
    h = torch.empty(T * k, inter, dtype=x.dtype, device=dev)
    _moe_gemv_gate_up_kernel[(triton.cdiv(inter, tiles.gate_up_n), T * k)](
        x, w_gate_up, ids, h, H, inter, first, count, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        TOP_K=k, BLOCK_N=tiles.gate_up_n, BLOCK_K=tiles.block_k, num_warps=tiles.warps)
    out = torch.empty_like(x)
    _moe_gemv_down_kernel[(triton.cdiv(H, tiles.down_n), T)](
        h, w_down, ids, weights, out, H, inter, first, count, w_down.stride(0), w_down.stride(1), out.stride(0),
        TOP_K=k, BLOCK_N=tiles.down_n, BLOCK_K=tiles.block_k, num_warps=tiles.warps)
    return out
