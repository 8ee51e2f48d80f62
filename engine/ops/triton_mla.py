"""The MLA decode kernel: one query token per sequence in the absorbed form (ops/mla_ref.py),
over the paged latent cache, every head of a head block reading each cached row once.

    mla_decode_triton(q_lat, q_rope, cache, block_tables, seq_lens, scale) -> o_lat [B, H, rank]

q_lat [B, H, rank]: each head's no-rope query mapped into latent space (q_nope W_UK); q_rope
[B, H, rope]; cache [num_blocks, block_size, 1, rank + rope] (bf16/fp16/fp32, or int8/fp8 rows
with one float32 scale each: kv_quant.QuantKV). A program takes BLOCK_H heads of one sequence
and a split of its context; per tile of BLOCK_N cached rows it loads the latent part c
[BLOCK_N, rank] and the rope part once, scores every head (q_lat c^T + q_rope pe^T), and adds
p c to the heads' latent outputs: c is the keys' and the values' source at once. The online
softmax is attention_core's (`softmax_tile`), so are the splits (flash-decoding): its partials,
combine and planner (`split_count` at MLA_SPLITS; shapes only, so a decode CUDA graph captures a
fixed grid). W_UV maps o_lat out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_core import (
    LOG2E,
    Partials,
    combine,
    compute_dtype,
    finish,
    sm_count,
    softmax_tile,
    split_count,
    store_partial,
)
from .kv_quant import QuantKV

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit(do_not_specialize=["SPLITS"])
def _mla_decode_kernel(
    ql_ptr, qr_ptr, c_ptr, s_ptr, tables_ptr, lens_ptr, o_ptr, part_acc_ptr, part_ml_ptr,
    stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_cb, stride_ct, stride_sb, stride_st,
    stride_tb, stride_ot, stride_oh, qk_scale, SPLITS,
    HEADS: tl.constexpr, H_ALL: tl.constexpr, BLOCK_H: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, SCALED: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    live = heads < HEADS
    offs_r = tl.arange(0, RANK)
    offs_p = tl.arange(0, ROPE)
    q_lat = tl.load(ql_ptr + seq * stride_qlt + heads[:, None] * stride_qlh + offs_r[None, :],
                    mask=live[:, None], other=0.0).to(COMPUTE_DTYPE)
    q_rope = tl.load(qr_ptr + seq * stride_qrt + heads[:, None] * stride_qrh + offs_p[None, :],
                     mask=live[:, None], other=0.0).to(COMPUTE_DTYPE)
    ctx = tl.load(lens_ptr + seq)
    per = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, ctx)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        blk = tl.load(tables_ptr + seq * stride_tb + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
        row = blk * stride_cb + (offs_n % PAGE) * stride_ct
        c = tl.load(c_ptr + row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0).to(COMPUTE_DTYPE)
        pe = tl.load(c_ptr + row[:, None] + RANK + offs_p[None, :], mask=valid[:, None], other=0.0).to(COMPUTE_DTYPE)
        if IEEE:  # fp32: not through TF32
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee") + tl.dot(q_rope, tl.trans(pe),
                                                                             input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_rope, tl.trans(pe))
        if SCALED:  # a row's one scale multiplies its scores and, through p, its values
            sc = tl.load(s_ptr + blk * stride_sb + (offs_n % PAGE) * stride_st, mask=valid, other=0.0)
        else:
            sc = valid  # not read
        acc, m_i, l_i = softmax_tile(s * qk_scale, c, sc, sc, valid[None, :], acc, m_i, l_i, True, IEEE,
                                     COMPUTE_DTYPE, SCALED)
    if SPLIT:
        store_partial(part_acc_ptr, part_ml_ptr, seq, split, SPLITS, heads, live, offs_r, acc, m_i, l_i, H_ALL, RANK)
    else:
        tl.store(o_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
                 finish(acc, l_i).to(o_ptr.dtype.element_ty), mask=live[:, None])


MLA_SPLITS = dict(per_sm=1, whole_wave=True)
"""split_count's aim for the MLA kernel: one wave of one program (sequence x head block) per SM,
at least a tile of keys each; a program's latent tiles fill an SM's shared memory, and a second,
partly filled wave costs more than the combine saves: 64 sequences on 132 SMs ran 1.45x their HBM
floor with 2 splits and 1.65x with 5 (bench/results/mla/mla_gpu.md)."""


def mla_decode_triton(q_lat: torch.Tensor, q_rope: torch.Tensor, cache, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                      splits: int | None = None, block_h: int = 16, block_n: int = 128, warps: int = 8,
                      stages: int = 2) -> torch.Tensor:
    """o_lat [B, H, rank] (in q_lat's dtype, or into `out`). `splits`: None plans by shape; the
    tile settings (block_h heads, block_n rows, warps, pipeline stages) as bench/mla_gpu.py
    measured them."""
    scaled = isinstance(cache, QuantKV)
    values = cache.values if scaled else cache
    scales = cache.scales if scaled else values
    b, heads, rank = q_lat.shape
    rope = values.shape[-1] - rank
    if q_rope.shape != (b, heads, rope) or values.dim() != 4 or values.shape[2] != 1:
        raise ValueError(f"q_lat {tuple(q_lat.shape)} / q_rope {tuple(q_rope.shape)} do not fit the latent cache "
                         f"{tuple(values.shape)} (rows of rank + rope values, one per token)")
    if rank & (rank - 1) or rope & (rope - 1) or values.stride(-1) != 1:
        raise ValueError(f"the kernel tiles the latent ({rank}) and rope ({rope}) parts as powers of two, contiguous")
    if block_tables.dtype != torch.int32 or block_tables.shape[0] != b or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [{b}, max_blocks], contiguous rows")
    out = torch.empty_like(q_lat) if out is None else out
    block_h = max(16, min(block_h, triton.next_power_of_2(heads)))
    head_blocks = triton.cdiv(heads, block_h)
    page = values.shape[1]
    if splits is None:
        splits = split_count(b * head_blocks, block_tables.shape[1] * page, sm_count(q_lat.device),
                             min_keys=block_n, **MLA_SPLITS) if q_lat.is_cuda else 1
    h_all = head_blocks * block_h
    part = Partials.empty(b, splits, h_all, rank, q_lat.device) if splits > 1 else Partials(out, out)
    dtype = compute_dtype(q_lat)
    _mla_decode_kernel[(b, head_blocks, splits)](
        q_lat, q_rope, values, scales, block_tables, seq_lens, out, part.acc, part.ml,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), values.stride(0), values.stride(1),
        scales.stride(0), scales.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, splits, HEADS=heads, H_ALL=h_all, BLOCK_H=block_h, RANK=rank, ROPE=rope, PAGE=page,
        BLOCK_N=block_n, COMPUTE_DTYPE=_TL[dtype], SCALED=scaled, SPLIT=splits > 1, IEEE=dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        combine(part, out, b, 1, splits, heads, h_all, h_all)
    return out
