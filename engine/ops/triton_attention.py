"""The paged decode attention kernel (the KV store is kv_store.py).

Written for both the GPU machines' Triton (3.6) and the CPU interpreter
(TRITON_INTERPRET=1, Triton 3.9) that CI uses. The launchers check shapes, dtypes
and strides before launching; the kernels index the cache through its strides, so
they work on the strided per-layer views of the block-major KV tensor.
"""

from __future__ import annotations

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
    qk_dot,
    sm_count,
    split_count,
    store_partial,
    tile_probs,
    tile_values,
)


# One program = one sequence x one kv head x one split of the context; the GROUP query
# heads sharing that kv head are the rows of the tile, so each K/V element is read once
# per step. The softmax, the tile loader, the partials and their combine are the attention
# core's (attention_core.py), shared with the paged-prefill kernel. SPLIT (SPLITS > 1: too
# few sequences to fill the GPU) writes the split's partial. SPLITS is a runtime value,
# never specialized: eager mixed batches vary it from step to step, and a new constant would
# compile a new kernel in the middle of serving. SCALED: a quantized cache
# (engine/ops/kv_quant.py) with a float32 scale per (token, head) row. SCORES (heavy-hitter
# eviction, base/kv_window.py): the softmax's own p of each tile, summed per cache block by one
# dot with a 0/1 block-membership matrix (BLOCKS_PAD columns), gives every row's log2 of its
# unnormalized mass per block, m + log2(sum p) with the running max m, into lm [sequence, kv head,
# table width, row] (a tile's blocks and rows are one contiguous run: one coalesced store). A
# program without splits then has its rows' final (max, sum): its epilogue reads its scratch back
# (still in L2) and adds 2^(lm - max) / sum, summed over its rows, to its kv head's row of
# scores; a split launch's `_block_mass_kernel` does that from the splits' partials after the launch.
@triton.jit(do_not_specialize=["SPLITS", "NB"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_lens_ptr, part_acc_ptr, part_ml_ptr, ks_ptr, vs_ptr, lm_ptr, scores_ptr,
    qk_scale, window, NB, stride_sr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    SPLITS, SPLIT: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SCALED: tl.constexpr, INT4: tl.constexpr,
    SCORES: tl.constexpr, BLOCKS_PAD: tl.constexpr, EPILOGUE_BLOCKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    # q unscaled: the scale (log2(e) folded in) goes on the fp32 scores, as in the prefill kernel
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(COMPUTE_DTYPE)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    start = lo_tile
    end = seq_len
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(seq_len - lo_tile, BLOCK_N), SPLITS) * BLOCK_N
        start = lo_tile + split * per_split
        end = tl.minimum(start + per_split, seq_len)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_seq = offs_n < seq_len
        valid = in_seq & (offs_n >= lo)
        k, v, ks, vs = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr + seq * stride_bt, offs_n, in_seq, valid, kvh,
                               offs_d, mask_d, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                               stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                               PAGE, COMPUTE_DTYPE, SCALED, INT4, IEEE)
        if SCORES:  # p itself, between the softmax's halves: each block's sum of it, into the scratch
            sc = qk_dot(q, k, IEEE) * qk_scale
            p, alpha, m_i, l_i = tile_probs(sc, ks, valid[None, :], m_i, l_i, True, SCALED)
            _store_block_mass(lm_ptr + (seq * NUM_KV_HEADS + kvh) * NB * GROUP_PAD, p, m_i, n0, NB, offs_g, mask_g,
                              IEEE, COMPUTE_DTYPE, PAGE, BLOCK_N, BLOCKS_PAD, GROUP_PAD)
            acc = tile_values(p, v, vs, acc, alpha, IEEE, COMPUTE_DTYPE, SCALED)
        else:
            acc, m_i, l_i = attend(q, k, v, ks, vs, valid[None, :], acc, m_i, l_i, qk_scale, True,
                                   IEEE, COMPUTE_DTYPE, SCALED)
    if SCORES and not SPLIT:  # the final (max, sum) are this program's: normalize here, the scratch still in L2
        row = seq * NUM_KV_HEADS + kvh
        _add_block_scores(lm_ptr + row * NB * GROUP_PAD, scores_ptr + row * stride_sr, lo_tile // PAGE,
                          tl.minimum((seq_len + PAGE - 1) // PAGE, NB), m_i, l_i, offs_g, mask_g, GROUP_PAD,
                          EPILOGUE_BLOCKS)
    if SPLIT:
        store_partial(part_acc_ptr, part_ml_ptr, seq * NUM_KV_HEADS + kvh, split, SPLITS, offs_g, mask_g, offs_d,
                      acc, m_i, l_i, GROUP_PAD, D_PAD)
    else:
        tl.store(o_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 finish(acc, l_i).to(o_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _store_block_mass(lm_ptr, p, m_i, n0, NB, offs_g, mask_g, IEEE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                      PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr):
    # a tile's p [rows, keys] summed per cache block (one dot with a 0/1 membership matrix), kept as
    # log2 of each row's unnormalized mass, m + log2(sum p), at the program's scratch [block, row]
    blk = tl.arange(0, BLOCKS_PAD)
    member = ((tl.arange(0, BLOCK_N) // PAGE)[:, None] == blk[None, :]).to(COMPUTE_DTYPE)
    if IEEE:
        mass = tl.dot(p, member, input_precision="ieee")
    else:  # p as p v takes it (bf16): the one operand both dots read
        mass = tl.dot(p.to(COMPUTE_DTYPE), member)
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    lm = tl.where(mass > 0, m_use[:, None] + tl.log2(tl.where(mass > 0, mass, 1.0)), float("-inf"))
    blk = n0 // PAGE + blk
    tl.store(lm_ptr + blk[None, :] * GROUP_PAD + offs_g[:, None], lm,
             mask=mask_g[:, None] & (blk < NB)[None, :] & (blk < n0 // PAGE + BLOCK_N // PAGE)[None, :])


@triton.jit
def _add_block_scores(lm_ptr, scores_ptr, first, last, m_i, l_i, offs_g, mask_g, GROUP_PAD: tl.constexpr,
                      BLOCKS: tl.constexpr):
    # a program's own normalization (no splits): blocks [first, last) of its scratch, each row's
    # 2^(lm - max) / sum summed over its rows, added to its kv head's row of scores
    tl.debug_barrier()  # every thread's scratch rows written before any thread reads them back
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    for b0 in range(first, last, BLOCKS):
        bb = b0 + tl.arange(0, BLOCKS)
        live = bb < last
        lm = tl.load(lm_ptr + bb[None, :] * GROUP_PAD + offs_g[:, None], mask=mask_g[:, None] & live[None, :],
                     other=float("-inf"))
        mass = tl.sum(tl.exp2(lm - m_use[:, None]) * inv[:, None], axis=0)
        tl.store(scores_ptr + bb, tl.load(scores_ptr + bb, mask=live, other=0.0) + mass, mask=live)


DECODE_SPLITS = dict(per_sm=2, full_at=1)  # split_count's aim for decode launches: 2 programs per SM


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        sliding_window: int | None = None, out: torch.Tensor | None = None,
                        splits: int | None = None, scores: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence. q [num_seqs, num_heads, head_dim] -> same shape.

    splits: pieces each context is cut into (flash-decoding), combined by a second launch;
    None picks by shape (split_count, DECODE_SPLITS), 1 on CPU. A quantized cache's scales are
    applied to the scores (K) and the probabilities (V); an int4 cache's rows are unpacked in
    the tile loader. `scores` [num_seqs, num_kv_heads, >= table width] float32, contiguous: each
    block's attention mass (its probabilities summed over the query heads of a kv head's group) is
    added to it, from the kernel's own softmax (unquantized caches); a split launch adds all of a
    sequence's to its first kv head's row. The sum over the kv heads is the caller's."""
    c = cache_args(k_cache, v_cache)
    B, H, D = q.shape
    _, page, KVH, _ = c.shape
    if splits is None:
        splits = 1
        if q.is_cuda and B:
            splits = split_count(B * KVH, block_tables.shape[1] * page, sm_count(q.device), **DECODE_SPLITS)
    check_launch(q, c, block_tables, B, splits)
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    group = H // KVH
    group_pad = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows
    cdt = compute_dtype(q)
    block_n = max(16, min(64, page * 4)) if page <= 64 else page
    if scores is not None:  # twice the keys a tile: the block sums cost per tile (+50% a step at 64, +20% so)
        block_n = max(16, min(128, page * 8)) if page <= 128 else page
    d_pad = max(16, triton.next_power_of_2(D))
    part = Partials.empty(B * KVH, splits, group_pad, d_pad, q.device) if splits > 1 else Partials(out, out)
    nb, lm, sc = block_tables.shape[1], out, out
    if scores is not None:
        if c.scaled or c.int4:
            raise ValueError("attention scores need an unquantized cache")
        if scores.dtype != torch.float32 or scores.shape[:2] != (B, KVH) or scores.shape[2] < nb or \
                not scores.is_contiguous():
            raise ValueError(f"scores must be contiguous float32 [{B}, {KVH}, >= {nb}], got {scores.dtype} "
                             f"{tuple(scores.shape)}")
        lm, sc = torch.empty(B, KVH, nb, group_pad, dtype=torch.float32, device=q.device), scores  # read where written
    _paged_decode_kernel[(B, KVH, splits)](
        q, c.k, c.v, out, block_tables, seq_lens, part.acc, part.ml, c.ks, c.vs, lm, sc,
        scale * LOG2E, sliding_window or 0, nb, sc.stride(1),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *c.strides(), block_tables.stride(0), *c.sstrides,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=D, D_PAD=d_pad, PAGE=page, BLOCK_N=block_n,
        IEEE=cdt == torch.float32, COMPUTE_DTYPE=_COMPUTE[cdt], SPLITS=splits, SPLIT=splits > 1, NUM_KV_HEADS=KVH,
        SCALED=c.scaled, INT4=c.int4, SCORES=scores is not None,
        BLOCKS_PAD=max(16, block_n // page), EPILOGUE_BLOCKS=MASS_BLOCKS, num_warps=4,
    )
    if splits > 1:
        combine(part, out, B, KVH, splits, group, group_pad, group_pad)
    if scores is not None and splits > 1:  # the splits' (max, sum) are combined first
        _block_mass_kernel[(B, triton.cdiv(nb, MASS_BLOCKS))](
            lm, part.ml, scores, seq_lens, scores.stride(0), sliding_window or 0, nb, splits,
            NUM_KV_HEADS=KVH, GROUP=group, GROUP_PAD=group_pad, PAGE=page, BLOCK_N=block_n, BLOCK_B=MASS_BLOCKS,
        )
    return out


MASS_BLOCKS = 64  # cache blocks a program of _block_mass_kernel (or the decode kernel's epilogue) sums at once


# A split launch's scores (without splits the decode program normalizes its own in its epilogue).
# One program = one sequence x MASS_BLOCKS of its cache blocks: per kv head, each row's final (max,
# sum) from its splits (the split combine's arithmetic, base 2), then each block's 2^(lm - max) / sum
# summed over the rows (the query heads) and the kv heads, added to the sequence's first kv head's
# scores (the caller sums the kv heads). Blocks the decode kernel
# wrote nothing to (before a sliding window's first tile, past the context) are not read.
@triton.jit(do_not_specialize=["SPLITS", "NB"])
def _block_mass_kernel(lm_ptr, ml_ptr, scores_ptr, seq_lens_ptr, stride_sb, window, NB, SPLITS,
                       NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    seq = tl.program_id(0)
    blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    live_b = (blk >= lo // BLOCK_N * BLOCK_N // PAGE) & (blk < (seq_len + PAGE - 1) // PAGE) & (blk < NB)
    g = tl.arange(0, GROUP_PAD)
    live_g = g < GROUP
    total = tl.zeros([BLOCK_B], tl.float32)
    for kvh in range(NUM_KV_HEADS):
        program = seq * NUM_KV_HEADS + kvh
        m_all = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_all = tl.zeros([GROUP_PAD], tl.float32)
        for sp in range(0, SPLITS):
            at = (program * SPLITS + sp) * GROUP_PAD + g
            m = tl.load(ml_ptr + at * 2, mask=live_g, other=float("-inf"))
            lsum = tl.load(ml_ptr + at * 2 + 1, mask=live_g, other=0.0)
            m_new = tl.maximum(m_all, m)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty split weighs nothing, no NaN
            l_all = l_all * tl.exp2(m_all - m_use) + lsum * tl.exp2(m - m_use)
            m_all = m_new
        lm = tl.load(lm_ptr + (program * NB + blk[None, :]) * GROUP_PAD + g[:, None],
                     mask=live_g[:, None] & live_b[None, :], other=float("-inf"))
        m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
        total += tl.sum(tl.exp2(lm - m_use[:, None]) / tl.where(l_all > 0, l_all, 1.0)[:, None], axis=0)
    at = scores_ptr + seq * stride_sb + blk
    tl.store(at, tl.load(at, mask=live_b, other=0.0) + total, mask=live_b)
