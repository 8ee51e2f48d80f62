"""Quantized KV with scales: `kv_cache_dtype` "int8" and "fp8" (e4m3).

Each (token, KV head) row of K and of V is stored as head_dim 1-byte values and its own
float32 scale (dynamic: amax / 127 for int8, amax / 448 for fp8), the scale in the 4
bytes right after the row inside the same block-major KV tensor:

    kv  uint8 [num_blocks, layers, 2, block_size, kv_heads, head_dim + 4]
        row = head_dim values (int8 / fp8 bits) | float32 scale

Why a scale per token and head, not per block: a decode step appends one token at a
time, so a block's scale fixed by its first tokens would clip later outliers (or the
block would be requantized on every step); a per-token scale costs 4 bytes per 128
(3%: 1.94x bf16's blocks instead of 2x) and is written once. Why inside the slab: the
scales then travel with the blocks everywhere a block goes (the handoff, tensor-parallel
head slices, the host tier, the persisted file) with no second tensor to keep in step.

The kernels (ops/triton_attention.py on GPU, ops/attention_ref.py on CPU and for prefill
chunks) read a layer's `QuantKV` views: `values` [num_blocks, block_size, kv_heads,
head_dim] in the value dtype and `scales` [num_blocks, block_size, kv_heads] float32,
both strided views of the same bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SCALE_BYTES = 4
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


def is_scaled(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in SCALED


def views(raw: torch.Tensor, kv_cache_dtype: str) -> QuantKV:
    """A layer's K (or V) cache [num_blocks, block_size, kv_heads, head_dim + 4] uint8 as
    (values, scales) views."""
    d = raw.shape[-1] - SCALE_BYTES
    return QuantKV(raw[..., :d].view(SCALED[kv_cache_dtype][0]), raw[..., d:].view(torch.float32).squeeze(-1))


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


def store(k: torch.Tensor, v: torch.Tensor, k_cache: QuantKV, v_cache: QuantKV, slot_mapping: torch.Tensor) -> None:
    """The torch path of the KV store: quantizes k, v [tokens, kv_heads, head_dim] into their slots."""
    bs = k_cache.values.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blk, off = slots // bs, slots % bs
    for x, cache in ((k[keep], k_cache), (v[keep], v_cache)):
        q, s = quantize(x, cache.values.dtype, cache.qmax)
        cache.values[blk, off] = q
        cache.scales[blk, off] = s
