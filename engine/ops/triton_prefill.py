"""Triton paged prefill attention: the prefill chunks of a flat batch, each on top of the
context its sequence already has in the paged cache, in one launch per layer.

One program = BLOCK_M query tokens of one sequence x one KV head; the GROUP query heads
that share the KV head are rows of the same tile (rows = BLOCK_M x GROUP_PAD), so each K/V
element a tile needs is read once for all of them: GQA without repeating K/V. The program
walks the sequence's block table up to its last query's position (causal; a sliding window
starts it later). The tile loader, the online softmax, the key splits' partials and their
combine are the attention core's (attention_core.py), shared with the decode kernel, so a
decode row that a mixed step puts in a tile here gets the bits the decode kernel gives it.

`PrefillPlan` is built once per step (the tiles: which sequence and first token each
program takes, and each sequence's first query row and lengths) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_core import (
    _COMPUTE,
    LOG2E,
    Partials,
    attend,
    cache_args,
    check_launch,
    combine,
    compute_dtype,
    finish,
    kv_tile,
    sm_count,
    split_count,
    store_partial,
    tile_rows,
)


@triton.jit(do_not_specialize=["SPLITS"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, tiles_ptr, seqs_ptr, ks_ptr, vs_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, window, SPLITS,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, SCALED: tl.constexpr, INT4: tl.constexpr, SPLIT: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # q_pos: the rows' absolute positions; first: the tile's first query's. q is loaded unscaled (no
    # rounding of q x scale): the scale, with log2(e) folded in, goes on the fp32 scores
    seq, m0, qrow, g, live, q_pos, first, ctx = tile_rows(tiles_ptr, seqs_ptr, tile, GROUP, GROUP_PAD, BLOCK_M)
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + qrow[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=live[:, None] & mask_d[None, :], other=0.0).to(COMPUTE_DTYPE)
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, D_PAD], tl.float32)
    end = tl.minimum(first + BLOCK_M, ctx)  # past the tile's last query: nothing it sees
    lo = 0
    if window > 0:
        lo = tl.maximum(first - window + 1, 0)
    start = (lo // BLOCK_N) * BLOCK_N
    stop = end
    if SPLIT:  # this program's share of the tile's keys (flash-decoding's split, for chunks over long contexts)
        per_split = tl.cdiv(tl.cdiv(end - start, BLOCK_N), SPLITS) * BLOCK_N
        start = start + split * per_split
        stop = tl.minimum(start + per_split, end)
    # keys below `full` are seen by every row of the tile (causal, no window): the first phase walks them
    # without building a mask, the second walks the rest (the diagonal, the window) with one
    full = start
    if window == 0:
        full = tl.maximum(start, tl.minimum(stop, ((first + 1) // BLOCK_N) * BLOCK_N))
    for phase in tl.static_range(2):
        lo_n = start
        hi_n = full
        if phase == 1:
            lo_n = full
            hi_n = stop
        for n0 in range(lo_n, hi_n, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            in_seq = offs_n < end
            k, v, ks, vs = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr + seq * stride_bt, offs_n, in_seq, in_seq,
                                   kvh, offs_d, mask_d, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                   stride_vh, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                                   PAGE, COMPUTE_DTYPE, SCALED, INT4, IEEE)
            seen = in_seq[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if window > 0:
                seen = seen & (q_pos[:, None] - offs_n[None, :] < window)
            acc, m_i, l_i = attend(q, k, v, ks, vs, seen, acc, m_i, l_i, qk_scale, phase == 1,
                                   IEEE, COMPUTE_DTYPE, SCALED)
    if SPLIT:  # live rows only: a decode's tile has GROUP of its BLOCK_M x GROUP_PAD rows live
        store_partial(part_acc_ptr, part_ml_ptr, tile * NUM_KV_HEADS + kvh, split, SPLITS, rows, live, offs_d,
                      acc, m_i, l_i, BLOCK_M * GROUP_PAD, D_PAD)
    else:
        tl.store(o_ptr + qrow[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 finish(acc, l_i).to(o_ptr.dtype.element_ty), mask=live[:, None] & mask_d[None, :])


@dataclass(frozen=True)
class PrefillLaunch:
    """A launch's tile settings: query rows per program (BLOCK_M tokens x the GQA group, padded
    to a power of 2), keys per iteration, warps, pipeline stages, and the programs per SM that
    key splits aim for (attention_core.split_count)."""

    rows: int
    block_n: int
    warps: int
    stages: int
    per_sm: int

    @classmethod
    def for_step(cls, query_lens: list[int]) -> PrefillLaunch:
        """MIXED when a sequence brings fewer than 16 new tokens (a decode or verification row,
        which fills a few rows of its tile), else PREFILL."""
        return MIXED if min(query_lens, default=0) < 16 else PREFILL


# From a sweep of 48 settings on 8 shapes, one layer of Llama-3-8B's attention on an H100
# (`bench/prefill_attention_gpu.py --sweep`, bench/results/attention/prefill_sweep.md):
# - steps with decode rows: small tiles, many key splits; the best on both mixed steps
#   (16 decodes at 4K + a 64 or 256-token chunk at 8K).
# - prompts and chunks only: 128-row tiles read each key for twice the queries; within 9% of
#   the best on 5 of 6 shapes (1.08x geomean), against 1.24-1.96x for the mixed settings.
MIXED = PrefillLaunch(rows=64, block_n=64, warps=4, stages=2, per_sm=8)
PREFILL = PrefillLaunch(rows=128, block_n=128, warps=8, stages=2, per_sm=2)


@dataclass
class PrefillPlan:
    """A step's prefill sequences as the kernel reads them, built once and used by every layer:
    `tiles` [num_tiles, 2] (sequence, first token), `seqs` [num_seqs, 3] (first query row,
    query length, context length), int32 on the device; `launch`: the tile settings."""

    tiles: torch.Tensor
    seqs: torch.Tensor
    block_m: int
    launch: PrefillLaunch
    max_context: int = 0

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], group: int, device,
              launch: PrefillLaunch | None = None) -> PrefillPlan:
        """launch None: by the step's shape (PrefillLaunch.for_step)."""
        launch = launch or PrefillLaunch.for_step(query_lens)
        block_m = max(1, launch.rows // triton.next_power_of_2(group))
        tiles, seqs, row = [], [], 0
        for i, (q_len, ctx) in enumerate(zip(query_lens, seq_lens)):
            if q_len > ctx:
                raise ValueError(f"sequence {i}: {q_len} query tokens over a context of {ctx}")
            seqs += [row, q_len, ctx]
            tiles += [x for m in range(0, q_len, block_m) for x in (i, m)]
            row += q_len
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
        return cls(as_t(tiles).view(-1, 2), as_t(seqs).view(-1, 3), block_m, launch, max(seq_lens, default=0))


def paged_prefill_triton(q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor, plan: PrefillPlan,
                         scale: float, sliding_window: int | None = None, out: torch.Tensor | None = None,
                         splits: int | None = None) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim]: the sequences' new tokens, back to back, each the
    last `query_len` positions of its context (the new K/V already stored) -> same shape.
    The tile settings are the plan's (`plan.launch`). splits: pieces each tile's keys are cut
    into (combined by a second launch); None: by shape (split_count at the launch's per_sm), 1 on CPU."""
    c = cache_args(k_cache, v_cache)
    T, H, D = q.shape
    _, page, KVH, _ = c.shape
    tiles = plan.tiles.shape[0]
    if splits is None:
        splits = 1
        if q.is_cuda and tiles:
            splits = split_count(tiles * KVH, plan.max_context, sm_count(q.device), plan.launch.per_sm)
    check_launch(q, c, block_tables, plan.seqs.shape[0], splits)
    out = torch.empty_like(q) if out is None else out
    if T == 0 or tiles == 0:
        return out
    group = H // KVH
    group_pad = triton.next_power_of_2(group)
    cdt = compute_dtype(q)
    d_pad = max(16, triton.next_power_of_2(D))
    rows = plan.block_m * group_pad
    part = Partials.empty(tiles * KVH, splits, rows, d_pad, q.device) if splits > 1 else Partials(out, out)
    _paged_prefill_kernel[(tiles, KVH, splits)](
        q, c.k, c.v, out, block_tables, plan.tiles, plan.seqs, c.ks, c.vs, part.acc, part.ml,
        scale * LOG2E, sliding_window or 0, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *c.strides(), block_tables.stride(0), *c.sstrides,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=D, D_PAD=d_pad,
        PAGE=page, BLOCK_M=plan.block_m, BLOCK_N=plan.launch.block_n,
        IEEE=cdt == torch.float32, COMPUTE_DTYPE=_COMPUTE[cdt], SCALED=c.scaled, INT4=c.int4, SPLIT=splits > 1,
        NUM_KV_HEADS=KVH,
        num_warps=plan.launch.warps, num_stages=plan.launch.stages,
    )
    if splits > 1:
        combine(part, out, tiles, KVH, splits, group, group_pad, rows, plan.tiles, plan.seqs, plan.launch.warps)
    return out
