"""int4 KV in Triton (engine/ops/kv_quant.py, "int4"): the store packs each (token, head) row into
head_dim / 2 bytes of 4-bit codes with a float16 (scale, minimum) per group of 32 values; the
attention kernels' tile loader (attention_core.kv_tile) unpacks a tile of rows with `int4_rows`.
head_dim is a power of two (kv_quant.check_head_dim): rows and groups are whole tiles, no padding.

Why unpack in the tile loader: the kernels read K and V once per step; unpacking there costs a
shift, a mask and a multiply per element in registers and reads 9/16 of int8's bytes
(bench/results/kv_int4/). The reference path is kv_quant.quantize_int4 / dequantize_int4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import INT4_GROUP, Int4KV


@triton.jit
def int4_rows(row_ptrs, scale_ptrs, valid, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):
    """Rows of packed codes at `row_ptrs` [N, 1] with their float16 (scale, min) pairs at
    `scale_ptrs` [N, 1]: [N, HEAD_DIM] float32 (0 where not `valid`). Each row is read as one
    contiguous run of bytes and one of scales (a gather per element ran at 46 GB/s on an H100)."""
    N: tl.constexpr = valid.shape[0]
    NG: tl.constexpr = HEAD_DIM // GROUP
    b = tl.load(row_ptrs + tl.arange(0, HEAD_DIM // 2)[None, :], mask=valid[:, None], other=0).to(tl.int32)
    codes = tl.reshape(tl.join((b & 15).to(tl.float32), (b >> 4).to(tl.float32)), [N, NG, GROUP])
    sm = tl.load(scale_ptrs + tl.arange(0, 2 * NG)[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    scale, lo = tl.split(tl.reshape(sm, [N, NG, 2]))
    return tl.reshape(codes * scale[:, :, None] + lo[:, :, None], [N, HEAD_DIM])


@triton.jit
def _store_kv_int4_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    H_PAD: tl.constexpr, GROUP: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    NG: tl.constexpr = HEAD_DIM // GROUP
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    offs_p = tl.arange(0, HEAD_DIM // 2)[None, :]
    offs_s = tl.arange(0, 2 * NG)[None, :]
    live = (offs_h * 0 + slot) >= 0  # a tensor: the interpreter rejects scalar masks
    mask_h = ((offs_h < NUM_KV_HEADS) & live)[:, None]
    for which in tl.static_range(2):
        if which == 0:
            x = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d, mask=mask_h, other=0.0)
            vals = kc_ptr + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_p
            scales = ks_ptr + blk * stride_ksb + off * stride_kst + offs_h[:, None] * stride_ksh + offs_s
        else:
            x = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d, mask=mask_h, other=0.0)
            vals = vc_ptr + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_p
            scales = vs_ptr + blk * stride_vsb + off * stride_vst + offs_h[:, None] * stride_vsh + offs_s
        xg = tl.reshape(x.to(tl.float32), [H_PAD, NG, GROUP])
        lo = tl.min(xg, axis=2).to(tl.float16)  # each group's min and (max - min) / 15, in float16
        scale = ((tl.max(xg, axis=2) - lo.to(tl.float32)) / 15.0).to(tl.float16)
        tl.store(scales, tl.reshape(tl.join(scale, lo), [H_PAD, 2 * NG]), mask=mask_h)
        q = (xg - lo.to(tl.float32)[:, :, None]) / tl.maximum(scale.to(tl.float32), 5.960464477539063e-08)[:, :, None]
        q = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), 15.0).to(tl.int32)
        even, odd = tl.split(tl.reshape(q, [H_PAD, HEAD_DIM // 2, 2]))
        tl.store(vals, (even | (odd << 4)).to(tl.uint8), mask=mask_h)


def store_kv_int4(k: torch.Tensor, v: torch.Tensor, k_cache: Int4KV, v_cache: Int4KV,
                  slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] -> packed rows and scales; slot -1 is skipped
    (the launcher in triton_attention.store_kv_triton checked the shapes)."""
    T, H, D = k.shape
    kc, vc, ks, vs = k_cache.values, v_cache.values, k_cache.scales, v_cache.scales
    _store_kv_int4_kernel[(T,)](
        k, v, kc, vc, ks, vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        NUM_KV_HEADS=H, HEAD_DIM=D, PAGE=kc.shape[1], H_PAD=triton.next_power_of_2(H), GROUP=INT4_GROUP,
    )
