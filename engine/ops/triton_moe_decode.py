"""A decode step's mixture-of-experts layer in four launches: the router with routing, gate/up, down, combine.

    moe_decode_triton(x, router_w, w_gate_up, w_down, routing, weights_dtype, arrivals, held=None)
                -> [T, hidden]

At a few tokens (T <= DECODE_TOKENS) the grouped path (ops/triton_moe.py: the router's GEMM,
routing, the alignment's blocks, gate/up, down, combine: six launches) is bound by launches, not
bytes. Here one launch computes the router's logits and routes, and every assignment (token x
slot) is its own block of the experts' GEMMs, so nothing needs sorting:

    router      grid (T, E / BLOCK_E): each program computes BLOCK_E of a token's logits (fp32,
                rounded to x's dtype as the router's GEMM writes them) into `logits`; the last
                of a token's programs to arrive (a counter per token, `arrivals`, zero between
                calls: the last program resets it) routes the token (_route_row: the same top-k
                and weights as route_triton) and writes the alignment of its k assignments:
                block a holds assignment a alone (row 0; the rows after it empty), its expert
    experts     ops/triton_moe.run_experts over that alignment: gate/up, down, combine, the
                grouped path's kernels and numerics

Expert parallel (`held` = (first, count)): the router routes over every expert; an assignment to
another rank's expert gets an empty block (nothing read, its row zero). Sizes depend on T only,
no host sync: decode graphs capture the four launches. Written for the GPU and for the CPU
interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_moe import Alignment, Fp8Experts, MoETiles, run_experts
from .triton_moe_route import Routing, _route_row

DECODE_TOKENS = 4  # up to this many tokens a step runs this path (bench/moe_gpu.py --decode-sweep)


@triton.jit
def _moe_router_kernel(x_ptr, wr_ptr, bias_ptr, logits_ptr, arrivals_ptr, w_ptr, experts_ptr, rows_ptr, H, E,
                       stride_xt, scale, FIRST, COUNT, M, BLOCK_M: tl.constexpr, ROUND: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
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
                                    G_PAD, TOPK_GROUP, E_PAD <= 128)
        ks = tl.arange(0, K_PAD)
        live_k = ks < TOP_K
        a = t * TOP_K + ks  # the token's assignments, block a each: its expert, row 0 a (M: not here), rows 1.. M
        local = top_ids - FIRST
        here = (local >= 0) & (local < COUNT)
        tl.store(w_ptr + a, top_p.to(w_ptr.dtype.element_ty), mask=live_k)
        tl.store(experts_ptr + a, tl.where(here, local, 0), mask=live_k)
        r = tl.arange(0, BLOCK_M)
        first_row = tl.where(here, a, M).to(tl.int32)
        tl.store(rows_ptr + a[:, None] * BLOCK_M + r[None, :], tl.where(r[None, :] == 0, first_row[:, None], M),
                 mask=live_k[:, None])


@dataclass(frozen=True)
class DecodeTiles:
    """The router's tiles (experts per program, reduction depth, warps) and the experts' GEMMs'
    (ops/triton_moe.MoETiles; None: `experts_tiles` picks them by the step's tokens)."""

    block_e: int = 4
    block_k: int = 2048
    warps: int = 8
    experts: MoETiles | None = None

    def experts_tiles(self, tokens: int, top_k: int) -> MoETiles:
        """The GEMMs' tiles: `experts` if set, else by the step's tokens (bench/moe_gpu.py
        --decode-sweep on an H200: wider column tiles from 3 tokens, MoETiles.for_rows below)."""
        if self.experts is not None:
            return self.experts
        return MoETiles(16, 64, 128, 4, 2) if tokens >= 3 else MoETiles.for_rows(tokens * top_k)


_USED: dict = {}  # (rows, device) -> a constant [1] tensor: every block of the decode layout may run


def moe_decode_triton(x: torch.Tensor, router_w: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      routing: Routing, weights_dtype: torch.dtype, arrivals: torch.Tensor,
                      held: tuple[int, int] | None = None, correction_bias: torch.Tensor | None = None,
                      tiles: DecodeTiles = DecodeTiles(), fp8: Fp8Experts | None = None) -> torch.Tensor:
    """x [T, hidden] through a sparse layer from its router weight [E, hidden] (the logits rounded to
    router_w's dtype unless it is float32, as F.linear(x, router_w) writes them); `arrivals` [>= T]
    int32, zero, and zero again on return (the caller keeps one per layer); `held` as
    ops/triton_moe.moe_triton. The same experts' kernels as moe_triton on F.linear(x, router_w)'s
    logits: equal to it wherever the two routers' logits round alike. `fp8`: e4m3 experts and their
    block scales (ops/triton_moe.Fp8Experts)."""
    T, H = x.shape
    E = router_w.shape[0]
    count, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    first, count = held if held is not None else (0, count)
    if router_w.shape != (E, H) or w_down.shape != (count, H, inter) or arrivals.numel() < T:
        raise ValueError(f"decode MoE shapes do not fit x {tuple(x.shape)}: router {tuple(router_w.shape)}, "
                         f"w_down {tuple(w_down.shape)}, arrivals {arrivals.numel()}")
    k = routing.top_k
    m = T * k
    experts_tiles = tiles.experts_tiles(T, k)
    bm = experts_tiles.block_m
    dev = x.device
    logits = torch.empty(T, E, dtype=torch.float32, device=dev)
    weights = torch.empty(T, k, dtype=weights_dtype, device=dev)
    experts = torch.empty(m, dtype=torch.int32, device=dev)
    rows = torch.empty(m * bm, dtype=torch.int32, device=dev)
    used = _USED.get((m * bm, dev))
    if used is None:
        used = _USED[(m * bm, dev)] = torch.full((1,), m * bm, dtype=torch.int32, device=dev)
    chunks = triton.cdiv(E, tiles.block_e)
    _moe_router_kernel[(T, chunks)](
        x, router_w, logits if correction_bias is None else correction_bias, logits, arrivals, weights, experts, rows,
        H, E, x.stride(0), routing.scale, first, count, m, BLOCK_M=bm, ROUND=router_w.dtype != torch.float32,
        BLOCK_E=tiles.block_e, BLOCK_K=min(tiles.block_k, triton.next_power_of_2(H)), CHUNKS=chunks,
        E_PAD=triton.next_power_of_2(E), **routing.consts(), num_warps=tiles.warps)
    return run_experts(x, w_gate_up, w_down, weights, Alignment(rows, experts, used, bm), experts_tiles,
                       skip=held is not None, fp8=fp8)
