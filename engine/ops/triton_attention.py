"""Triton kernels for the paged KV cache: KV store and paged decode attention.

Written for both the GPU machines' Triton (3.6) and the CPU interpreter
(TRITON_INTERPRET=1, Triton 3.9) that CI uses. The launchers check shapes, dtypes
and strides before launching; the kernels index the cache through its strides, so
they work on the strided per-layer views of the block-major KV tensor.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .kv_quant import INT4_GROUP, Int4KV, QuantKV
from .triton_int4 import int4_rows, store_kv_int4


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, H_PAD)[:, None]
    offs_d = tl.arange(0, D_PAD)[None, :]
    # the slot test is broadcast through a tensor: the interpreter rejects scalar masks
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM) & ((offs_h * 0 + slot) >= 0)
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    kc = kc_ptr + blk * stride_kcb + off * stride_kct + offs_h * stride_kch + offs_d
    vc = vc_ptr + blk * stride_vcb + off * stride_vct + offs_h * stride_vch + offs_d
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_quant_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    QMAX: tl.constexpr, INT8: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    # quantized KV (engine/ops/kv_quant.py): each (token, head) row gets scale = amax / QMAX
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)[None, :]
    live = (offs_h * 0 + slot) >= 0
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d < HEAD_DIM) & live[:, None]
    mask_h = (offs_h < NUM_KV_HEADS) & live
    for which in tl.static_range(2):
        if which == 0:
            x = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d, mask=mask, other=0.0)
            vals = kc_ptr + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d
            scales = ks_ptr + blk * stride_ksb + off * stride_kst + offs_h * stride_ksh
        else:
            x = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d, mask=mask, other=0.0)
            vals = vc_ptr + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d
            scales = vs_ptr + blk * stride_vsb + off * stride_vst + offs_h * stride_vsh
        x = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-8) / QMAX
        q = x / scale[:, None]
        if INT8:
            q = tl.minimum(tl.maximum(tl.floor(q + 0.5), -QMAX), QMAX)
        tl.store(vals, q.to(vals.dtype.element_ty), mask=mask)
        tl.store(scales, scale, mask=mask_h)


@triton.jit
def kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, offs_n, in_seq, valid, kvh, offs_d, mask_d,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
            PAGE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, SCALED: tl.constexpr, INT4: tl.constexpr):
    """One tile of keys `offs_n` of a sequence (its block-table row at `table_ptr`), kv head `kvh`:
    K and V [BLOCK_N, D_PAD] in COMPUTE_DTYPE (zero where not `valid`) and, for a quantized cache,
    each token's K and V scale (else K and V again, unused). INT4 (the group size, 0 = off): packed
    rows and their group scales, dequantized here (triton_int4.py). Shared by the decode and
    prefill kernels."""
    blk = tl.load(table_ptr + offs_n // PAGE, mask=in_seq, other=0).to(tl.int64)
    tok = offs_n % PAGE
    kv_mask = valid[:, None] & mask_d[None, :]
    if INT4:
        k = int4_rows(k_ptr + blk[:, None] * stride_kb + tok[:, None] * stride_kt + kvh * stride_kh,
                      ks_ptr + blk[:, None] * stride_ksb + tok[:, None] * stride_kst + kvh * stride_ksh,
                      valid, offs_d.shape[0], INT4).to(COMPUTE_DTYPE)
        v = int4_rows(v_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt + kvh * stride_vh,
                      vs_ptr + blk[:, None] * stride_vsb + tok[:, None] * stride_vst + kvh * stride_vsh,
                      valid, offs_d.shape[0], INT4).to(COMPUTE_DTYPE)
    else:
        k = tl.load(k_ptr + blk[:, None] * stride_kb + tok[:, None] * stride_kt + kvh * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
    ks = k
    vs = v
    if SCALED:
        ks = tl.load(ks_ptr + blk * stride_ksb + tok * stride_kst + kvh * stride_ksh, mask=valid, other=0.0)
        vs = tl.load(vs_ptr + blk * stride_vsb + tok * stride_vst + kvh * stride_vsh, mask=valid, other=0.0)
    return k, v, ks, vs


# One program = one sequence x one kv head x one split of the context; the GROUP query
# heads sharing that kv head are the rows of the tile, so each K/V element is read once
# per step. SPLIT (SPLITS > 1: too few sequences to fill the GPU) writes the split's
# unnormalized partial (acc, max, sum) for _combine_splits_kernel. SPLITS is a runtime
# value, never specialized: eager mixed batches vary it from step to step, and a new
# constant would compile a new kernel in the middle of serving. SCALED: a quantized cache
# (engine/ops/kv_quant.py) with a float32 scale per (token, head) row.
@triton.jit(do_not_specialize=["SPLITS"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_lens_ptr, part_acc_ptr, part_ml_ptr, ks_ptr, vs_ptr,
    qk_scale, window,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    SPLITS, SPLIT: tl.constexpr, NUM_HEADS: tl.constexpr, SCALED: tl.constexpr, INT4: tl.constexpr,
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
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    q = (q * qk_scale).to(COMPUTE_DTYPE)  # qk_scale folds in log2(e): softmax in base 2

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
                               PAGE, COMPUTE_DTYPE, SCALED, INT4)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SCALED:  # a token's K scale multiplies its column of scores, its V scale its row of p
            s = s * ks[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pw = p
        if SCALED:
            pw = p * vs[None, :]
        if IEEE:
            pv = tl.dot(pw.to(COMPUTE_DTYPE), v, input_precision="ieee")
        else:
            pv = tl.dot(pw.to(COMPUTE_DTYPE), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if not SPLIT:
        acc = acc / l_i[:, None]
        tl.store(o_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 acc.to(o_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        # partials laid out [seq, head, split, D_PAD] and [seq, head, split, 2] (max, sum)
        row = (seq * NUM_HEADS + heads) * SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=mask_g[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=mask_g)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=mask_g)


@triton.jit(do_not_specialize=["SPLITS"])
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, o_ptr, stride_ob, stride_oh, SPLITS,
    NUM_HEADS: tl.constexpr, S_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    # one program = one sequence x one query head: rescale each split to the common max
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_s = offs_s < SPLITS
    row = (seq * NUM_HEADS + head) * SPLITS + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=mask_s, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + row * 2 + 1, mask=mask_s, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_all), 0.0)  # empty splits weigh nothing
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def num_splits(num_seqs: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """How many pieces to cut each sequence's context into so that a decode launch on `sms`
    SMs has about two programs per SM: 1 when the batch alone fills the GPU. Depends on shapes
    only (the padded batch and the block table's width), so a CUDA graph captures a fixed grid."""
    programs = num_seqs * num_kv_heads
    if programs >= sms:
        return 1
    # at least 256 tokens per split: below that the combine costs more than it saves
    return max(1, min(-(-2 * sms // programs), max_context // 256, MAX_SPLITS))


MAX_SPLITS = 32


class CacheArgs(NamedTuple):
    """A layer's caches as the kernels take them: K and V values, K and V scales (the values
    again when there are none), the scales' 6 strides, per-row scales?, the int4 group (0: not
    int4), and the logical [num_blocks, block_size, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor
    ks: torch.Tensor
    vs: torch.Tensor
    sstrides: tuple
    scaled: bool
    int4: int
    shape: torch.Size


def cache_args(k_cache, v_cache) -> CacheArgs:
    if isinstance(k_cache, (QuantKV, Int4KV)):
        ks, vs = k_cache.scales, v_cache.scales
        int4 = INT4_GROUP if isinstance(k_cache, Int4KV) else 0
        return CacheArgs(k_cache.values, v_cache.values, ks, vs, (*ks.stride()[:3], *vs.stride()[:3]), not int4,
                         int4, k_cache.shape)
    return CacheArgs(k_cache, v_cache, k_cache, v_cache, (0,) * 6, False, 0, k_cache.shape)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must be [num_blocks, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must be contiguous (stride 1)")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k/v cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] -> their slots; slot -1 is skipped. A
    quantized cache (kv_quant.QuantKV, Int4KV) gets each row's values and its scale(s)."""
    c = cache_args(k_cache, v_cache)
    _check_cache(c.k, c.v)
    T, H, D = k.shape
    if v.shape != k.shape or c.shape[2:] != (H, D):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match cache {tuple(c.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have a contiguous last dimension")
    if slot_mapping.shape != (T,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{T}], "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if T == 0:
        return
    if c.int4:
        store_kv_int4(k, v, k_cache, v_cache, slot_mapping)
        return
    k_cache, v_cache = c.k, c.v
    if c.scaled:
        _store_kv_quant_kernel[(T,)](
            k, v, k_cache, v_cache, c.ks, c.vs, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *c.sstrides,
            QMAX=127.0 if k_cache.dtype == torch.int8 else 448.0, INT8=k_cache.dtype == torch.int8,
            NUM_KV_HEADS=H, HEAD_DIM=D, PAGE=k_cache.shape[1],
            H_PAD=triton.next_power_of_2(H), D_PAD=triton.next_power_of_2(D),
        )
        return
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=H, HEAD_DIM=D, PAGE=k_cache.shape[1],
        H_PAD=triton.next_power_of_2(H), D_PAD=triton.next_power_of_2(D),
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_COMPUTE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        sliding_window: int | None = None, out: torch.Tensor | None = None,
                        splits: int | None = None) -> torch.Tensor:
    """One query token per sequence. q [num_seqs, num_heads, head_dim] -> same shape.

    splits: pieces each context is cut into (flash-decoding), combined by a second launch;
    None picks by shape (num_splits), 1 on CPU. A quantized cache's scales are applied to
    the scores (K) and the probabilities (V); an int4 cache's rows are unpacked in the tile loader."""
    c = cache_args(k_cache, v_cache)
    k_cache, v_cache = c.k, c.v
    _check_cache(k_cache, v_cache)
    B, H, D = q.shape
    _, page, KVH, Dc = c.shape
    if Dc != D or H % KVH:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)} "
                         "(GQA needs num_heads % num_kv_heads == 0)")
    if q.stride(-1) != 1:
        raise ValueError("q must have a contiguous last dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{B}, max_blocks], "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    group = H // KVH
    # compute in the model dtype (bf16/fp16 tensor cores); fp8 caches are upcast. The
    # CPU interpreter's tl.dot mishandles bf16 operands (Triton 3.9), so CPU runs in fp32.
    cdt = q.dtype if q.dtype in _COMPUTE and q.is_cuda else torch.float32
    block_n = max(16, min(64, page * 4)) if page <= 64 else page
    log2e = 1.4426950408889634
    if splits is None:
        splits = (num_splits(B, KVH, block_tables.shape[1] * page, _sm_count(q.device))
                  if q.is_cuda else 1)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    d_pad = max(16, triton.next_power_of_2(D))
    if splits > 1:
        part_acc = torch.empty(B, H, splits, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B, H, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_decode_kernel[(B, KVH, splits)](
        q, k_cache, v_cache, out, block_tables, seq_lens, part_acc, part_ml, c.ks, c.vs,
        scale * log2e, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), *c.sstrides,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D,
        D_PAD=d_pad, PAGE=page, BLOCK_N=block_n,
        IEEE=cdt == torch.float32, COMPUTE_DTYPE=_COMPUTE[cdt], SPLITS=splits, SPLIT=splits > 1, NUM_HEADS=H,
        SCALED=c.scaled, INT4=c.int4, num_warps=4,
    )
    if splits > 1:
        _combine_splits_kernel[(B, H)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), splits,
            NUM_HEADS=H, S_PAD=MAX_SPLITS, HEAD_DIM=D, D_PAD=d_pad,
        )
    return out
