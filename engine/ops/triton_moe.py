"""The fused mixture-of-experts in Triton: every expert of a layer in two grouped-GEMM launches.

    fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids) -> [T, hidden]
    moe_triton(x, logits, w_gate_up, w_down, top_k, renormalize, weights_dtype)
                the same from the router's logits, routed in one launch (route_triton)

Shapes and meaning as ops/moe_ref.fused_moe_ref, the oracle it is tested against. The steps:

    align       the T x k (token, expert) assignments grouped by expert, each expert's run padded
                to a multiple of BLOCK_M rows (`align`: three small kernels, no host sync, fixed
                sizes for a given T, so a CUDA graph captures it)
    gate/up     one launch: a program takes BLOCK_M rows of one expert and BLOCK_N of its
                intermediate columns, gathers the rows' tokens from x, accumulates x @ gate^T and
                x @ up^T over the hidden dim in fp32, and writes SiLU(gate) x up per assignment
    down        one launch: the same rows times the expert's down projection, per assignment
    combine     one launch: each token's k rows scaled by their top-k weights and summed in fp32,
                in slot order

FP8 experts (`Fp8Experts`: the weights e4m3 with a float32 scale per block, engine/fp8.py's format):
    W8A16   each weight tile is converted to x's dtype in the kernel and its dot scaled by the
            tile's block scale (tiles no larger than a block, so one scale per tile and K step):
            half of bf16's bytes for a decode step to read; at a prefill's sizes the experts run
            at half of bf16's speed (bench/results/fp8/fp8_moe_engine.md)
    W8A8    past `Fp8Experts.a8_rows` assignments (default None: never, until measured on Hopper by
            bench/moe_fp8_prefill_gpu.py): x is quantized per (token, 128 columns) to e4m3 (DeepSeek-V3's
            activation format), gate/up writes h so from its float32 tile (a column tile is a group);
            each K step is one FP8 tensor-core dot scaled by the rows' and the block's scales

Programs whose block lies past the padded rows return at once: the grid is sized for the worst
case (every assignment on its own expert), so it depends on T only. Written for the GPU's Triton
and for the CPU interpreter (TRITON_INTERPRET=1) that tests it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .moe_ref import local_ids
from .triton_fp8 import _round_e4m3, quantize_groups
from .triton_moe_route import route_triton

A8_ROWS = 1024  # where W8A8 would start (MoETiles.for_rows' big tiles): Fp8Experts' a8_rows, off until measured


@dataclass(frozen=True)
class Alignment:
    """Assignments sorted by expert: `rows` [capacity] the assignment (token x k + slot) at each
    padded row (padding: T x k), `experts` [capacity / BLOCK_M] each block's expert, `used` [1]
    how many padded rows hold a run, `block_m` the block size."""

    rows: torch.Tensor
    experts: torch.Tensor
    used: torch.Tensor
    block_m: int


@triton.jit
def _moe_rank_kernel(ids_ptr, counts_ptr, rank_ptr, M, BLOCK: tl.constexpr):
    # each assignment's place among its expert's (the order within an expert is the atomics', and
    # no row's result depends on it: each GEMM row is computed on its own)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    e = tl.load(ids_ptr + offs, mask=mask, other=0)
    rank = tl.atomic_add(counts_ptr + e, tl.full([BLOCK], 1, tl.int32), mask=mask)
    tl.store(rank_ptr + offs, rank, mask=mask)


@triton.jit
def _moe_blocks_kernel(counts_ptr, starts_ptr, experts_ptr, used_ptr, rows_ptr, ids_ptr, rank_ptr, M, CAPACITY,
                   E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                   PLACE: tl.constexpr):
    # one program: each expert's first padded row, each block's expert, every row empty (M), and
    # with PLACE (a small step) each assignment in its row too, saving _moe_place_kernel's launch
    offs_e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + offs_e, ends - padded, mask=offs_e < E)
    tl.store(used_ptr + offs_e * 0, ends, mask=offs_e == E - 1)
    ends = tl.where(offs_e < E, ends, CAPACITY + BLOCK_M)  # padding experts end past every block
    for b0 in range(0, CAPACITY // BLOCK_M, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        first = b * BLOCK_M
        e = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(experts_ptr + b, tl.minimum(e, E - 1), mask=b < CAPACITY // BLOCK_M)
    for r0 in range(0, CAPACITY, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(rows_ptr + r, tl.full([CHUNK], 0, tl.int32) + M, mask=r < CAPACITY)
    if PLACE:
        tl.debug_barrier()  # the starts and the empty rows, written by every thread, before any row is placed
        for a0 in range(0, M, CHUNK):
            a = a0 + tl.arange(0, CHUNK)
            mask = a < M
            e = tl.load(ids_ptr + a, mask=mask, other=0)
            at = tl.load(starts_ptr + e, mask=mask, other=0) + tl.load(rank_ptr + a, mask=mask, other=0)
            tl.store(rows_ptr + at, a.to(tl.int32), mask=mask)


@triton.jit
def _moe_place_kernel(ids_ptr, rank_ptr, starts_ptr, rows_ptr, M, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    e = tl.load(ids_ptr + offs, mask=mask, other=0)
    at = tl.load(starts_ptr + e, mask=mask, other=0) + tl.load(rank_ptr + offs, mask=mask, other=0)
    tl.store(rows_ptr + at, offs.to(tl.int32), mask=mask)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int, ranked: tuple | None = None,
          skip: bool = False) -> Alignment:
    """The assignments of `topk_ids` [T, k] grouped by expert, each group padded to block_m rows:
    ranks by atomics (`ranked`: the (counts, ranks) route_triton already made), the blocks, the
    rows; a few launches, no host sync. `skip`: ids equal to num_experts (another rank's experts,
    expert parallel) are placed past `used`, in blocks no kernel runs."""
    if skip:
        num_experts += 1  # the "not here" id as one more expert, its run emptied below
    ids = topk_ids.flatten().to(torch.int32)
    m = ids.numel()
    capacity = (-(-m // block_m) + min(m, num_experts)) * block_m
    dev = ids.device
    block = 256
    if ranked is None:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
        rank = torch.empty(m, dtype=torch.int32, device=dev)
        _moe_rank_kernel[(triton.cdiv(m, block),)](ids, counts, rank, m, BLOCK=block)
    else:
        counts, rank = ranked
    if skip:  # its assignments keep their ranks; with no rows counted they land past `used`
        counts[num_experts - 1] = 0
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    rows = torch.empty(capacity, dtype=torch.int32, device=dev)
    experts = torch.empty(capacity // block_m, dtype=torch.int32, device=dev)
    place = m <= 1024  # a decode step's few assignments: placed by the one program, one launch fewer
    _moe_blocks_kernel[(1,)](counts, starts, experts, used, rows, ids, rank, m, capacity, E=num_experts,
                         E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=128, PLACE=place)
    if not place:
        _moe_place_kernel[(triton.cdiv(m, block),)](ids, rank, starts, rows, m, BLOCK=block)
    return Alignment(rows, experts, used, block_m)


@triton.jit
def _block_rows(rows_ptr, experts_ptr, used_ptr, block, M, BLOCK_M: tl.constexpr):
    """A block's (assignment per row, live?, expert, whether it runs: below `used`, its first row
    live; a block's run starts at its first row, in the decode path's layout too)."""
    offs = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + offs)
    runs = (block * BLOCK_M < tl.load(used_ptr)) & (tl.load(rows_ptr + block * BLOCK_M) < M)
    return rows, rows < M, tl.load(experts_ptr + block).to(tl.int64), runs


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b, exact fp32 products under IEEE (the fp32 path), tensor cores otherwise."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _dot_scaled(a, w, acc, s, IEEE: tl.constexpr):
    """acc + (a @ w) x s for an FP8 weight tile w (converted to a's dtype, exactly) under one scale."""
    if IEEE:
        return acc + tl.dot(a, w.to(a.dtype), input_precision="ieee") * s
    return acc + tl.dot(a, w.to(a.dtype)) * s


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, experts_ptr, used_ptr, s_ptr, xs_ptr, hs_ptr, M, H, inter,
                    stride_xt, stride_we, stride_wn, stride_ot, stride_se, stride_sn, stride_xst, stride_xsg, stride_hs,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, A8: tl.constexpr):
    # w [E, 2 x inter, H]: gate rows [0, inter), up rows [inter, 2 x inter); out [M, inter]
    # A8 (W8A8): x is e4m3 with a scale per (token, K step) in xs; out is h in e4m3 with a scale per
    # (assignment, column tile) in hs: BLOCK_N = BLOCK_K = BK, down's K steps
    nb = tl.program_id(0)  # a block's column tiles run back to back: its rows and expert stay in L2
    block = tl.program_id(1)
    rows, live, e, any_rows = _block_rows(rows_ptr, experts_ptr, used_ptr, block, M, BLOCK_M)
    if any_rows:
        tok = tl.where(live, rows // TOP_K, 0).to(tl.int64)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_e = w_ptr + e * stride_we
        for k0 in range(0, H, BLOCK_K):
            mask_k = k0 + offs_k < H
            a = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + offs_k)[None, :],
                        mask=live[:, None] & mask_k[None, :], other=0.0)
            wmask = mask_k[:, None] & mask_n[None, :]
            g = tl.load(w_e + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None], mask=wmask, other=0.0)
            u = tl.load(w_e + (inter + offs_n)[None, :] * stride_wn + (k0 + offs_k)[:, None], mask=wmask, other=0.0)
            if FP8:  # the tile's block scales: gate's and up's rows, this K step
                s_k = s_ptr + e * stride_se + k0 // BK
                s_g = tl.load(s_k + (nb * BLOCK_N // BN) * stride_sn)
                s_u = tl.load(s_k + ((inter + nb * BLOCK_N) // BN) * stride_sn)
                if A8:  # an FP8 dot, scaled by the rows' and the block's scales
                    s_a = tl.load(xs_ptr + tok * stride_xst + (k0 // BK) * stride_xsg)[:, None]
                    acc_g += tl.dot(a, g) * (s_a * s_g)
                    acc_u += tl.dot(a, u) * (s_a * s_u)
                else:
                    acc_g = _dot_scaled(a, g, acc_g, s_g, IEEE)
                    acc_u = _dot_scaled(a, u, acc_u, s_u, IEEE)
            else:
                acc_g = _dot(a, g, acc_g, IEEE)
                acc_u = _dot(a, u, acc_u, IEEE)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) x up
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
        if A8:  # each row's BLOCK_N values to e4m3, amax to 448 (as quantize_groups)
            s_h = tl.maximum(tl.max(tl.abs(h), 1), 1e-12) / 448.0
            h = _round_e4m3(tl.minimum(tl.maximum(h / s_h[:, None], -448.0), 448.0))
            tl.store(hs_ptr + rows.to(tl.int64) * stride_hs + nb, s_h, mask=live)
        tl.store(out, h.to(out_ptr.dtype.element_ty), mask=live[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, out_ptr, rows_ptr, experts_ptr, used_ptr, s_ptr, hs_ptr, M, H, inter,
                 stride_ht, stride_we, stride_wn, stride_ot, stride_se, stride_sn, stride_hs,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                 FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, A8: tl.constexpr):
    # w [E, H, inter]; h [M, inter] -> out [M, H], per assignment; A8: h e4m3, its scales in hs
    nb = tl.program_id(0)  # a block's column tiles run back to back: its rows and expert stay in L2
    block = tl.program_id(1)
    rows, live, e, any_rows = _block_rows(rows_ptr, experts_ptr, used_ptr, block, M, BLOCK_M)
    if any_rows:
        r = tl.where(live, rows, 0).to(tl.int64)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_e = w_ptr + e * stride_we
        for k0 in range(0, inter, BLOCK_K):
            mask_k = k0 + offs_k < inter
            a = tl.load(h_ptr + r[:, None] * stride_ht + (k0 + offs_k)[None, :],
                        mask=live[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_e + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if FP8:
                s = tl.load(s_ptr + e * stride_se + (nb * BLOCK_N // BN) * stride_sn + k0 // BK)
                if A8:
                    acc += tl.dot(a, w) * (tl.load(hs_ptr + r * stride_hs + k0 // BK)[:, None] * s)
                else:
                    acc = _dot_scaled(a, w, acc, s, IEEE)
            else:
                acc = _dot(a, w, acc, IEEE)
        tl.store(out_ptr + r[:, None] * stride_ot + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & mask_n[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, out_ptr, H, stride_yt, stride_ot, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # a token's k rows of down outputs, each scaled by its top-k weight, summed in fp32 in slot order
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_yt + offs, mask=mask, other=0.0).to(tl.float32) * w
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Fp8Experts:
    """FP8 experts' block scales (the weights themselves e4m3): expert e's weight block (n // bn,
    k // bk) is scaled by `gate_up[e, n // bn, k // bk]` ([E, 2I / bn, H / bk] float32; I a
    multiple of bn, so gate's and up's rows start on a block) and `down[e, ...]` ([E, H / bn, I / bk])."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int]
    a8_rows: int | None = None  # W8A8 past this many assignments a step; None: W8A16 always

    def check(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        (bn, bk), (E, two_i, H), inter = self.block, w_gate_up.shape, w_down.shape[2]
        want = ((E, two_i // bn, triton.cdiv(H, bk)), (E, triton.cdiv(H, bn), triton.cdiv(inter, bk)))
        if w_gate_up.dtype != torch.float8_e4m3fn or w_down.dtype != torch.float8_e4m3fn or inter % bn or \
                (tuple(self.gate_up.shape), tuple(self.down.shape)) != want or bn & (bn - 1) or bk & (bk - 1):
            raise ValueError(f"FP8 experts: weights {w_gate_up.dtype} {tuple(w_gate_up.shape)}, "
                             f"{tuple(w_down.shape)} with scales {tuple(self.gate_up.shape)}, "
                             f"{tuple(self.down.shape)} do not fit blocks {self.block} (want e4m3 weights, "
                             f"scales {want[0]} and {want[1]}, I a multiple of {bn}, blocks powers of two)")

    def quantizes(self, m: int) -> bool:
        """Whether a step of `m` assignments runs W8A8: more than `a8_rows`, and a block at least as
        tall as it is wide (gate/up's column tiles are then down's K steps)."""
        bn, bk = self.block
        return self.a8_rows is not None and m > self.a8_rows and 16 <= bk <= bn

    def tiles(self, tiles: MoETiles, a8: bool = False) -> MoETiles:
        """`tiles` no larger than a block: one scale per weight tile and K step; W8A8's (`a8`): K
        steps and column tiles of the block's width, one activation scale per row and K step."""
        bn, bk = self.block
        if a8:
            return dataclasses.replace(tiles, block_n=bk, block_k=bk)
        return dataclasses.replace(tiles, block_n=min(tiles.block_n, bn), block_k=min(tiles.block_k, bk))


@dataclass(frozen=True)
class MoETiles:
    """A launch's tile settings: rows per block (assignments of one expert), output columns and
    reduction depth per program, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int

    @classmethod
    def for_rows(cls, m: int) -> MoETiles:
        """By the assignments a step has (T x k): small blocks when few tokens share an expert."""
        if m <= 64:  # bench/moe_gpu.py --sweep on an H200 (bench/results/moe/moe_sweep.json)
            return cls(16, 32, 128, 2, 4)
        if m <= 1024:
            return cls(16, 64, 128, 4, 2)
        return cls(128, 128, 64, 8, 3)


def fused_moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, tiles: MoETiles | None = None,
                     ranked: tuple | None = None, skip: bool = False, fp8: Fp8Experts | None = None) -> torch.Tensor:
    """`skip`: ids equal to the number of experts here (moe_ref.local_ids: another rank's experts)
    contribute nothing: their rows are never computed and read as zeros by the combine. `fp8`:
    the weights are e4m3 with these block scales."""
    T, H = x.shape
    E, two_i, Hw = w_gate_up.shape
    inter = two_i // 2
    if Hw != H or w_down.shape != (E, H, inter) or two_i % 2:
        raise ValueError(f"experts do not fit x {tuple(x.shape)}: w_gate_up {tuple(w_gate_up.shape)} "
                         f"(want [E, 2 x I, {H}]), w_down {tuple(w_down.shape)} (want [E, {H}, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [{T}, k]")
    if x.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError("x and the experts' weights need a contiguous last dimension")
    if T == 0:
        return torch.zeros_like(x)
    tiles = tiles or MoETiles.for_rows(topk_ids.numel())
    return run_experts(x, w_gate_up, w_down, topk_weights, align(topk_ids, E, tiles.block_m, ranked, skip), tiles, skip,
                       fp8)


def run_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                al: Alignment, tiles: MoETiles, skip: bool = False, fp8: Fp8Experts | None = None) -> torch.Tensor:
    """gate/up, down and the combine over assignments already aligned (by `align`, or by the decode
    path's router: ops/triton_moe_decode.py); `skip`: some assignments are not run (their rows
    read as zeros); `fp8`: e4m3 weights and their block scales. Shapes checked by the caller."""
    T, H = x.shape
    k = topk_weights.shape[1]
    m = T * k
    a8 = fp8 is not None and fp8.quantizes(m)
    if fp8 is not None:
        fp8.check(w_gate_up, w_down)
        tiles = fp8.tiles(tiles, a8)
    (bn, bk), gs, ds = fp8.block if fp8 else (1, 1), fp8.gate_up if fp8 else w_gate_up, fp8.down if fp8 else w_down
    inter = w_gate_up.shape[1] // 2
    blocks = al.experts.shape[0]
    ieee = x.dtype == torch.float32
    if a8:  # x per (token, 128) to e4m3; h written in e4m3 by gate/up, a scale per (assignment, column tile)
        xa, xs = quantize_groups(x, bk)
        h = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=x.device)
        hs = torch.empty(m, inter // bk, dtype=torch.float32, device=x.device)
    else:
        xa, xs, hs = x, x, x  # (the scale pointers unused)
        h = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(triton.cdiv(inter, tiles.block_n), blocks)](
        xa, w_gate_up, h, al.rows, al.experts, al.used, gs, xs, hs, m, H, inter,
        xa.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), gs.stride(0), gs.stride(1),
        xs.stride(0), xs.stride(1), hs.stride(0), TOP_K=k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, IEEE=ieee, FP8=fp8 is not None, BN=bn, BK=bk, A8=a8, num_warps=tiles.warps,
        num_stages=tiles.stages)
    y = (torch.zeros if skip else torch.empty)(m, H, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(triton.cdiv(H, tiles.block_n), blocks)](
        h, w_down, y, al.rows, al.experts, al.used, ds, hs, m, H, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0), ds.stride(0), ds.stride(1), hs.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, IEEE=ieee,
        FP8=fp8 is not None, BN=bn, BK=bk, A8=a8, num_warps=tiles.warps, num_stages=tiles.stages)
    out = torch.empty_like(x)
    _moe_combine_kernel[(T, triton.cdiv(H, 1024))](y, topk_weights.contiguous(), out, H, y.stride(0), out.stride(0),
                                               TOP_K=k, BLOCK_H=1024)
    return out


def moe_triton(x: torch.Tensor, logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
               renormalize: bool, weights_dtype: torch.dtype, held: tuple[int, int] | None = None,
               fp8: Fp8Experts | None = None) -> torch.Tensor:
    """A sparse layer's experts from its router logits [T, E]: routing and ranking in one launch,
    then the fused experts (ops/moe_ref.moe_ref is the same in torch). `held`: this rank's experts
    (expert parallel): the ranking is redone over them, the others' assignments skipped; `fp8` as
    fused_moe_triton."""
    weights, ids, ranked = route_triton(logits, top_k, renormalize, weights_dtype)
    if held is not None:
        return fused_moe_triton(x, w_gate_up, w_down, weights, local_ids(ids, held), skip=True, fp8=fp8)
    return fused_moe_triton(x, w_gate_up, w_down, weights, ids, ranked=ranked, fp8=fp8)
