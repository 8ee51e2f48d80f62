"""Quantized KV with scales: `kv_cache_dtype` "int8" and "fp8" (e4m3), and "int4".

Each (token, KV head) row of K and of V is stored as head_dim 1-byte values and its own
float32 scale (dynamic: amax / 127 for int8, amax / 448 for fp8), the scale in the 16
bytes right after the row inside the same block-major KV tensor (4 of them; 12 pad the row
to a multiple of 16 bytes):

    kv  uint8 [num_blocks, layers, 2, block_size, kv_heads, head_dim + 16]
        row = head_dim values (int8 / fp8 bits) | float32 scale | 12 bytes of padding

A scale per token and head is written once, as a decode step appends its token; inside the
slab it travels with the blocks everywhere a block goes (the handoff, tensor-parallel head
slices, the host tier, the persisted file). The kernels (ops/triton_attention.py on GPU,
ops/attention_ref.py on CPU and for prefill chunks) read a layer's `QuantKV` views: `values`
[num_blocks, block_size, kv_heads, head_dim] in the value dtype and `scales` [num_blocks,
block_size, kv_heads] float32, both strided views of the same bytes.

"int4" (`Int4KV`): each row is head_dim / 2 bytes of packed 4-bit codes (element 2i in the
low nibble, 2i+1 in the high one) and then, per group of INT4_GROUP = 32 elements, a float16
scale and a float16 minimum: code = round((x - min) / scale), scale = (max - min) / 15,
x ~ code x scale + min:

    row = head_dim / 2 bytes | (scale, min) float16 per 32 values      (head_dim 64: 32 + 8 bytes)

The row is 5/8 of head_dim bytes: 3.2x bf16's blocks per byte (int8 / fp8: 1.78x at head_dim
128). Why these layouts, with the measurements: docs/design/kv_quant.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SCALE_BYTES = 16  # after an int8 / fp8 row's values: its float32 scale, then padding to 16 bytes
# value dtype, the largest magnitude it holds
SCALED = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0),
          "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}


class QuantKV(NamedTuple):
    values: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim], int8 or float8_e4m3fn
    scales: torch.Tensor  # [num_blocks, block_size, kv_heads] float32

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def qmax(self) -> float:
        return 127.0 if self.values.dtype == torch.int8 else 448.0


INT4_GROUP = 32  # elements per float16 scale of an int4 row


class Int4KV(NamedTuple):
    values: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim // 2] uint8, two codes a byte
    scales: torch.Tensor  # [num_blocks, block_size, kv_heads, 2 * head_dim // INT4_GROUP] float16: (scale, min)s

    @property
    def shape(self) -> torch.Size:
        """The logical [num_blocks, block_size, kv_heads, head_dim]."""
        return torch.Size((*self.values.shape[:-1], 2 * self.values.shape[-1]))


def is_scaled(kv_cache_dtype: str) -> bool:
    """Values with scales in a uint8 slab: int8, fp8 and int4."""
    return kv_cache_dtype in SCALED or kv_cache_dtype == "int4"


def row_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    """A quantized (token, head) row's bytes in the slab: its values, then its scale(s)."""
    if kv_cache_dtype == "int4":
        return head_dim // 2 + 4 * (head_dim // INT4_GROUP)
    return head_dim + SCALE_BYTES


def head_dim_of(kv_cache_dtype: str, row: int) -> int:
    """row_bytes' inverse."""
    return row * 8 // 5 if kv_cache_dtype == "int4" else row - SCALE_BYTES


def check_head_dim(kv_cache_dtype: str, head_dim: int, kernels: bool = True) -> None:
    """int4 packs each row in groups of INT4_GROUP with a (scale, min) each, and its kernels take
    a row as whole power-of-two tiles (ops/triton_int4.py); `kernels` False (a row only the torch
    path reads): any whole number of groups."""
    if kv_cache_dtype == "int4" and not kernels and head_dim % INT4_GROUP:
        raise ValueError(f"kv_cache_dtype='int4' packs each row in groups of {INT4_GROUP} values with a scale and a "
                         f"minimum each: this model's rows of {head_dim} values are not whole groups")
    if kv_cache_dtype == "int4" and kernels and (head_dim < INT4_GROUP or head_dim & (head_dim - 1)):
        raise ValueError(f"kv_cache_dtype='int4' packs each row in groups of {INT4_GROUP} values with a scale and a "
                         f"minimum each and needs a power-of-two head_dim >= {INT4_GROUP}: this model's head_dim "
                         f"{head_dim} is not one")


def views(raw: torch.Tensor, kv_cache_dtype: str) -> QuantKV | Int4KV:
    """A layer's K (or V) cache [num_blocks, block_size, kv_heads, row_bytes] uint8 as
    (values, scales) views."""
    d = head_dim_of(kv_cache_dtype, raw.shape[-1])
    if kv_cache_dtype == "int4":
        return Int4KV(raw[..., : d // 2], raw[..., d // 2 :].view(torch.float16))
    return QuantKV(raw[..., :d].view(SCALED[kv_cache_dtype][0]), raw[..., d:d + 4].view(torch.float32).squeeze(-1))


def quantize(x: torch.Tensor, value_dtype: torch.dtype, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values [..., head_dim] in value_dtype, scales [...] float32)."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(1e-8) / qmax
    q = xf / scale[..., None]
    if value_dtype == torch.int8:
        q = q.round().clamp_(-qmax, qmax)
    return q.to(value_dtype), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scales[..., None]).to(dtype)


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (packed uint8 [..., head_dim / 2], float16 [..., 2 * head_dim / 32]:
    each group's scale, then its minimum)."""
    g = x.float().unflatten(-1, (-1, INT4_GROUP))
    lo = g.amin(-1).half()
    scale = ((g.amax(-1) - lo.float()) / 15.0).half()
    q = ((g - lo.float()[..., None]) / scale.float().clamp_min(2.0**-24)[..., None]).round().clamp_(0, 15)
    q = q.to(torch.uint8).flatten(-2)
    return q[..., 0::2] | (q[..., 1::2] << 4), torch.stack((scale, lo), -1).flatten(-2)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_int4's inverse, in `dtype`."""
    q = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).float().unflatten(-1, (-1, INT4_GROUP))
    sm = scales.float().unflatten(-1, (-1, 2))
    return (q * sm[..., 0:1] + sm[..., 1:2]).flatten(-2).to(dtype)


def dequantize_cache(cache: QuantKV | Int4KV, index, dtype: torch.dtype) -> torch.Tensor:
    """The rows `cache.values[index]` dequantized, [..., head_dim] in `dtype`."""
    if isinstance(cache, Int4KV):
        return dequantize_int4(cache.values[index], cache.scales[index], dtype)
    return dequantize(cache.values[index], cache.scales[index], dtype)


def store(k: torch.Tensor, v: torch.Tensor | None, k_cache: QuantKV | Int4KV, v_cache: QuantKV | Int4KV | None,
          slot_mapping: torch.Tensor) -> None:
    """The torch path of the KV store: quantizes k, v [tokens, kv_heads, head_dim] into their slots
    (a latent cache: k alone, v and v_cache None)."""
    bs = k_cache.values.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blk, off = slots // bs, slots % bs
    for x, cache in ((k[keep], k_cache), *(((v[keep], v_cache),) if v_cache is not None else ())):
        q, s = quantize_int4(x) if isinstance(cache, Int4KV) else quantize(x, cache.values.dtype, cache.qmax)
        cache.values[blk, off] = q
        cache.scales[blk, off] = s
