"""A decode step's mixture-of-experts layer in four launches: the router with routing, gate/up, down, combine.

    moe_decode_triton(x, router_w, w_gate_up, w_down, routing, weights_dtype, arrivals, held=None)
                -> [T, hidden]

At a few tokens (T <= DECODE_TOKENS) the grouped path (ops/triton_moe.py: the router's GEMM,
routing, the alignment's blocks, gate/up, down, combine: six launches) is bound by launches, not
bytes. Here one launch computes the router's logits and routes, and every assignment (token x
slot) is its own block of the experts' GEMMs (or its own row of programs of their GEMVs:
`run_experts_gemv`, FP8 experts' default), so nothing needs sorting:

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

from .triton_moe import Alignment, Fp8Experts, MoETiles, _moe_combine_kernel, run_experts
from .triton_moe_route import Routing, _route_row

DECODE_TOKENS = 4  # up to this many tokens a step runs this path (bench/moe_gpu.py --decode-sweep)
FP8_DECODE_TILES = MoETiles(16, 32, 128, 4, 4)  # FP8 experts' tiled GEMMs here (an H200 sweep: 1-14% over bf16's)


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


@triton.jit
def _gemv_part(acc, w_ptr, s_ptr, offs_n, mask_n, x, k0, K, stride_wn, stride_sn, FP8: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + rows offs_n of W [., K] times x over columns [k0, k0 + BLOCK_K), in float32; FP8:
    each BK-wide group's partial sums scaled by its block's scale."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32)
    if FP8:
        g = k0 // BK + tl.arange(0, BLOCK_K // BK)
        s = tl.load(s_ptr + (offs_n // BN)[:, None] * stride_sn + g[None, :],
                    mask=mask_n[:, None] & (g * BK < K)[None, :], other=0.0)
        part = tl.sum(tl.reshape(w * x[None, :], (BLOCK_N, BLOCK_K // BK, BK)), 2)
        return acc + tl.sum(part * s, 1)
    return acc + tl.sum(w * x[None, :], 1)


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, experts_ptr, rows_ptr, M, H, inter,
                         stride_xt, stride_we, stride_wn, stride_ht, stride_se, stride_sn,
                         TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # one assignment a (program_id 1) and BLOCK_N of its expert's intermediate rows: h[a] = SiLU(gate) x up
    a = tl.program_id(1)
    if tl.load(rows_ptr + a * BLOCK_M) < M:  # run here (expert parallel: another rank's expert is not)
        e = tl.load(experts_ptr + a).to(tl.int64)
        t = (a // TOP_K).to(tl.int64)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < inter
        acc_g = tl.zeros([BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_N], tl.float32)
        w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < H, other=0.0).to(tl.float32)
            acc_g = _gemv_part(acc_g, w_e, s_e, offs_n, mask_n, x, k0, H, stride_wn, stride_sn, FP8, BN, BK,
                               BLOCK_N, BLOCK_K)
            acc_u = _gemv_part(acc_u, w_e, s_e, inter + offs_n, mask_n, x, k0, H, stride_wn, stride_sn, FP8, BN, BK,
                               BLOCK_N, BLOCK_K)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + a.to(tl.int64) * stride_ht + offs_n, h.to(h_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _gemv_down_kernel(h_ptr, w_ptr, s_ptr, y_ptr, experts_ptr, rows_ptr, M, H, inter,
                      stride_ht, stride_we, stride_wn, stride_yt, stride_se, stride_sn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # y[a, rows] = W_down[e, rows] @ h[a]
    a = tl.program_id(1)
    if tl.load(rows_ptr + a * BLOCK_M) < M:
        e = tl.load(experts_ptr + a).to(tl.int64)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(h_ptr + a.to(tl.int64) * stride_ht + offs_k, mask=offs_k < inter, other=0.0).to(tl.float32)
            acc = _gemv_part(acc, w_ptr + e * stride_we, s_ptr + e * stride_se, offs_n, mask_n, h, k0, inter,
                             stride_wn, stride_sn, FP8, BN, BK, BLOCK_N, BLOCK_K)
        tl.store(y_ptr + a.to(tl.int64) * stride_yt + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


@dataclass(frozen=True)
class GemvTiles:
    """The experts' GEMVs: weight elements a program loads at once (`tile`), up to `max_k` of a
    row, and warps."""

    tile: int = 8192
    max_k: int = 2048
    warps: int = 4

    def shape(self, k: int, group: int) -> tuple[int, int]:
        """(rows, columns) per load for rows of length k (columns a multiple of the scale group)."""
        block_k = max(group, min(triton.next_power_of_2(k), self.max_k))
        return max(1, self.tile // block_k), block_k


def run_experts_gemv(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                     al: Alignment, tiles: GemvTiles, skip: bool, fp8: Fp8Experts | None) -> torch.Tensor:
    """gate/up and down as GEMVs, one assignment per program row of the grid (the decode path's
    alignment: block a holds assignment a, or nothing), then the grouped path's combine: at a few
    tokens each expert's rows are streamed by many programs at once, where the tiled GEMMs ran
    16-row dots for one live row over sequential K steps (bench/moe_gpu.py --fp8-decode-sweep)."""
    T, H = x.shape
    k = weights.shape[1]
    m, inter = T * k, w_gate_up.shape[1] // 2
    if fp8 is not None:
        fp8.check(w_gate_up, w_down)
    (bn, bk), gs, ds = fp8.block if fp8 else (1, 1), fp8.gate_up if fp8 else w_gate_up, fp8.down if fp8 else w_down
    h = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    rows_n, block_k = tiles.shape(H, bk)
    rows_n = max(1, rows_n // 2)  # gate's rows and up's: twice the elements per load
    _gemv_gate_up_kernel[(triton.cdiv(inter, rows_n), m)](
        x, w_gate_up, gs, h, al.experts, al.rows, m, H, inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        h.stride(0), gs.stride(0), gs.stride(1), TOP_K=k, BLOCK_M=al.block_m, BLOCK_N=rows_n, BLOCK_K=block_k,
        FP8=fp8 is not None, BN=bn, BK=bk, num_warps=tiles.warps)
    y = (torch.zeros if skip else torch.empty)(m, H, dtype=x.dtype, device=x.device)
    rows_n, block_k = tiles.shape(inter, bk)
    _gemv_down_kernel[(triton.cdiv(H, rows_n), m)](
        h, w_down, ds, y, al.experts, al.rows, m, H, inter, h.stride(0), w_down.stride(0), w_down.stride(1),
        y.stride(0), ds.stride(0), ds.stride(1), BLOCK_M=al.block_m, BLOCK_N=rows_n, BLOCK_K=block_k,
        FP8=fp8 is not None, BN=bn, BK=bk, num_warps=tiles.warps)
    out = torch.empty_like(x)
    _moe_combine_kernel[(T, triton.cdiv(H, 1024))](y, weights.contiguous(), out, H, y.stride(0), out.stride(0),
                                                   TOP_K=k, BLOCK_H=1024)
    return out


FP8_GEMV = GemvTiles(8192, 1024, 2)  # FP8 experts' GEMVs on an H200 (--fp8-decode-sweep: best at 1 and 4 tokens)


@dataclass(frozen=True)
class DecodeTiles:
    """The router's tiles (experts per program, reduction depth, warps) and the experts': the
    grouped path's tiled GEMMs (`experts`: ops/triton_moe.MoETiles; None: `experts_tiles` picks
    them by the step's tokens), or GEMVs (`gemv`; None: FP8 experts run FP8_GEMV, bf16 ones the
    tiled GEMMs: on an H200 the GEMVs took an FP8 layer at one token from 32 to 25 us, a bf16 one
    from 34 to 32 but at four tokens from 80 to 84, bench/results/moe/moe_fp8_decode_sweep.json)."""

    block_e: int = 4
    block_k: int = 2048
    warps: int = 8
    experts: MoETiles | None = None
    gemv: GemvTiles | None = None

    def experts_gemv(self, fp8: bool) -> GemvTiles | None:
        """The GEMVs' tiles, or None: the tiled GEMMs run."""
        if self.gemv is not None:
            return self.gemv
        return FP8_GEMV if fp8 and self.experts is None else None

    def experts_tiles(self, tokens: int, top_k: int, fp8: bool = False) -> MoETiles:
        """The GEMMs' tiles: `experts` if set, else by the step's tokens (bench/moe_gpu.py
        --decode-sweep on an H200: wider column tiles from 3 tokens, MoETiles.for_rows below);
        `fp8`: FP8 experts' (--fp8-decode-sweep)."""
        if self.experts is not None:
            return self.experts
        if fp8:
            return FP8_DECODE_TILES
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
    experts_tiles = tiles.experts_tiles(T, k, fp8 is not None)
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
    al = Alignment(rows, experts, used, bm)
    gemv = tiles.experts_gemv(fp8 is not None)
    if gemv is not None:
        return run_experts_gemv(x, w_gate_up, w_down, weights, al, gemv, held is not None, fp8)
    return run_experts(x, w_gate_up, w_down, weights, al, experts_tiles, skip=held is not None, fp8=fp8)
