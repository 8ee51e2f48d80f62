"""Paged attention for one layer, over a flat batch of mixed prefill chunks and decodes.

The model runner orders a batch so that its `num_decodes` single-token sequences
come first: those go through one Triton paged-decode launch on CUDA; the rest
(prefill chunks, possibly on top of cached prefixes) through the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops.attention_ref import paged_attention_ref, store_kv_ref


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: list[int]  # context length after this step, per sequence
    seq_lens_t: torch.Tensor  # the same, [num_seqs] int32 on device
    query_lens: list[int]  # new tokens per sequence
    num_decodes: int  # leading sequences with query_len == 1


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None, use_triton: bool):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.use_triton = use_triton
        if use_triton:
            from .ops.triton_attention import paged_decode_triton, store_kv_triton

            self._store, self._decode = store_kv_triton, paged_decode_triton
        else:
            self._store, self._decode = store_kv_ref, None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q [T, H, D], k/v [T, KVH, D]; caches [num_blocks, block_size, KVH, D]
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes if self._decode is not None else 0
        if nd == len(meta.seq_lens):
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t,
                                self.scale, self.sliding_window)
        out = torch.empty_like(q)
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_t[:nd],
                         self.scale, self.sliding_window, out=out[:nd])
        start = sum(meta.query_lens[:nd])
        out[start:] = paged_attention_ref(
            q[start:], k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
            meta.query_lens[nd:], self.scale, self.sliding_window)
        return out
