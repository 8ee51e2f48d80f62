"""int4 KV in Triton (engine/ops/kv_quant.py, "int4"): the store kernel (kv_store.py) packs each
(token, head) row with `int4_encode` into head_dim / 2 bytes of 4-bit codes with a float16
(scale, minimum) per group of 32 values; the attention kernels' tile loader (attention_core.kv_tile)
unpacks a tile of rows with `int4_rows`. head_dim is a power of two (kv_quant.check_head_dim):
rows and groups are whole tiles, no padding.

Why unpack in the tile loader: the kernels read K and V once per step; unpacking there costs a
shift, a mask and a multiply per element in registers and reads 9/16 of int8's bytes
(bench/results/kv_int4/). The reference path is kv_quant.quantize_int4 / dequantize_int4.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def int4_encode(x, row_ptrs, scale_ptrs, mask, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):
    """Rows x [H_PAD, HEAD_DIM] packed at `row_ptrs` [H_PAD, 1] (two codes a byte, low nibble
    first) with each group's float16 (scale, min) at `scale_ptrs` [H_PAD, 1]; rows where not
    `mask` [H_PAD, 1] are not written. The store kernel's int4 code (kv_store.py)."""
    NG: tl.constexpr = HEAD_DIM // GROUP
    xg = tl.reshape(x.to(tl.float32), [H_PAD, NG, GROUP])
    lo = tl.min(xg, axis=2).to(tl.float16)  # each group's min and (max - min) / 15, in float16
    scale = ((tl.max(xg, axis=2) - lo.to(tl.float32)) / 15.0).to(tl.float16)
    tl.store(scale_ptrs + tl.arange(0, 2 * NG)[None, :], tl.reshape(tl.join(scale, lo), [H_PAD, 2 * NG]), mask=mask)
    q = (xg - lo.to(tl.float32)[:, :, None]) / tl.maximum(scale.to(tl.float32), 5.960464477539063e-08)[:, :, None]
    q = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), 15.0).to(tl.int32)
    even, odd = tl.split(tl.reshape(q, [H_PAD, HEAD_DIM // 2, 2]))
    tl.store(row_ptrs + tl.arange(0, HEAD_DIM // 2)[None, :], (even | (odd << 4)).to(tl.uint8), mask=mask)
