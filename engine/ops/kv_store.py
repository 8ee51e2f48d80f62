"""The one KV-store kernel: each new token's K and V rows (or a latent row alone) into their
cache slots, in whichever of the cache's three codes the slab holds (kv_quant.py):

    values   bf16/fp16/fp32 rows as they are (cast to the cache's dtype)
    scaled   int8/fp8 rows with one float32 scale per (token, head) row: scale = amax / QMAX
    int4     two 4-bit codes a byte with a float16 (scale, min) per group of 32 values
             (triton_int4.int4_encode)

One program per token: it reads its slot (-1: skipped, nothing written), each of its rows
once, and writes the values and, for a quantized cache, the scales. A latent cache (MLA: one
row per token, no V) is written once (`v` None). The torch path is kv_quant.store and
attention_ref.store_kv_ref; the tile loader that reads these rows back is
attention_core.kv_tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_core import cache_args, check_cache
from .kv_quant import INT4_GROUP
from .triton_int4 import int4_encode

VALUES, SCALED, INT4 = 0, 1, 2  # the cache's code, as the kernel takes it


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    CODE: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr, SOURCES: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)[None, :]
    live = (offs_h * 0 + slot) >= 0  # the slot test through a tensor: the interpreter rejects scalar masks
    mask_h = (offs_h < NUM_KV_HEADS) & live
    mask = mask_h[:, None] & (offs_d < HEAD_DIM)
    for which in tl.static_range(SOURCES):  # K, then V (SOURCES 1: a latent row alone)
        if which == 0:
            x = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d, mask=mask, other=0.0)
            row = kc_ptr + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch
            scales = ks_ptr + blk * stride_ksb + off * stride_kst + offs_h * stride_ksh
        else:
            x = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d, mask=mask, other=0.0)
            row = vc_ptr + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch
            scales = vs_ptr + blk * stride_vsb + off * stride_vst + offs_h * stride_vsh
        if CODE == 0:
            tl.store(row + offs_d, x.to(row.dtype.element_ty), mask=mask)
        elif CODE == 1:
            x = x.to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-8) / QMAX
            q = x / scale[:, None]
            if INT8:
                q = tl.minimum(tl.maximum(tl.floor(q + 0.5), -QMAX), QMAX)
            tl.store(row + offs_d, q.to(row.dtype.element_ty), mask=mask)
            tl.store(scales, scale, mask=mask_h)
        else:
            int4_encode(x, row, scales[:, None], mask_h[:, None], H_PAD, HEAD_DIM, GROUP)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor | None, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] -> their slots; slot -1 is skipped. A quantized
    cache (kv_quant.QuantKV, Int4KV) gets each row's codes and its scale(s). `v` and `v_cache`
    None: a latent cache, one row per token written once."""
    latent = v is None
    if latent != (v_cache is None):
        raise ValueError("v and v_cache are given together (both None: a latent cache)")
    c = cache_args(k_cache, k_cache if latent else v_cache)
    check_cache(c.k, c.v)
    T, H, D = k.shape
    if (not latent and v.shape != k.shape) or c.shape[2:] != (H, D):
        raise ValueError(f"k {tuple(k.shape)} / v {None if latent else tuple(v.shape)} do not match cache "
                         f"{tuple(c.shape)}")
    v = k if latent else v
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have a contiguous last dimension")
    if slot_mapping.shape != (T,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{T}], "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if T == 0:
        return
    code = INT4 if c.int4 else SCALED if c.scaled else VALUES
    _store_kv_kernel[(T,)](
        k, v, c.k, c.v, c.ks, c.vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *c.strides(), *c.sstrides,
        CODE=code, QMAX=127.0 if c.k.dtype == torch.int8 else 448.0, INT8=c.k.dtype == torch.int8,
        SOURCES=1 if latent else 2, NUM_KV_HEADS=H, HEAD_DIM=D, PAGE=c.shape[1],
        H_PAD=triton.next_power_of_2(H), D_PAD=triton.next_power_of_2(D), GROUP=INT4_GROUP,
    )
