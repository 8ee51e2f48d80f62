"""Plain-torch paged attention and KV store: the CPU path and the reference the
Triton kernels are tested against.

Cache views, one layer: k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
(strided views into the block-major KV tensor, see engine/exec/kv_cache.py); a quantized
cache's are kv_quant.QuantKV (values + per-token, per-head scales) or kv_quant.Int4KV (packed
nibbles + per-group scales), dequantized on read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kv_quant


def store_kv_ref(k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
    """Writes k, v [num_tokens, num_kv_heads, head_dim] to their slots (-1 = skip); a latent
    cache has no v (None)."""
    if isinstance(k_cache, (kv_quant.QuantKV, kv_quant.Int4KV)):
        kv_quant.store(k, v, k_cache, v_cache, slot_mapping)
        return
    bs = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blk, off = slots // bs, slots % bs
    k_cache[blk, off] = k[keep].to(k_cache.dtype)
    if v_cache is not None:
        v_cache[blk, off] = v[keep].to(v_cache.dtype)


def gather_kv(cache, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One sequence's keys or values, [seq_len, num_kv_heads, head_dim] (in `dtype`)."""
    bs = cache.shape[1]
    nb = -(-seq_len // bs)
    if isinstance(cache, (kv_quant.QuantKV, kv_quant.Int4KV)):
        return kv_quant.dequantize_cache(cache, block_ids[:nb], dtype or torch.float32).flatten(0, 1)[:seq_len]
    out = cache[block_ids[:nb]].flatten(0, 1)[:seq_len]
    return out if dtype is None else out.to(dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: list[int],  # context length of each sequence after this step
    query_lens: list[int],  # new tokens of each sequence (its queries are the last ones)
    scale: float,
    sliding_window: int | None = None,
    scores: torch.Tensor | None = None,  # [num_seqs, kv heads, max_blocks] float32: each block's mass added to head 0's
) -> torch.Tensor:
    out = torch.empty_like(q)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        qi = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        k = gather_kv(k_cache, block_tables[i], seq_len, q.dtype).transpose(0, 1).unsqueeze(0)
        v = gather_kv(v_cache, block_tables[i], seq_len, q.dtype).transpose(0, 1).unsqueeze(0)
        gqa = q.shape[1] != k.shape[1]
        if scores is not None:
            o = _attention_scored(qi, k, v, scale, sliding_window, scores[i, 0], k_cache.shape[1])
        elif q_len == seq_len and sliding_window is None:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            mask = _visible(q_len, seq_len, sliding_window, q.device)
            if gqa:  # an explicit mask with enable_gqa falls back to the math kernel on CUDA
                # ([H, q, k] scores in memory: seconds for an 8K prompt's later chunks);
                # repeated K/V heads keep it on the memory-efficient kernel
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.squeeze(0).transpose(0, 1)
        start += q_len
    return out


def _visible(q_len: int, seq_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """[q_len, seq_len]: which keys each of a sequence's last q_len queries sees (causal, windowed)."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


def _attention_scored(q, k, v, scale: float, sliding_window: int | None, scores: torch.Tensor,
                      page: int) -> torch.Tensor:
    """One sequence's attention from its explicit softmax (q [1, H, q, D], k/v [1, KVH, seq, D]),
    whose probabilities, summed over heads and query rows per block of `page` keys, are added to
    `scores` (the row's [max_blocks]): one pass, the same probabilities give both."""
    q_len, seq_len = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1).float(), v.repeat_interleave(rep, dim=1).float()
    s = (q.float() @ k.transpose(-1, -2)) * scale  # [1, H, q, seq]
    p = s.masked_fill(~_visible(q_len, seq_len, sliding_window, q.device), float("-inf")).softmax(dim=-1)
    mass = p.sum(dim=(0, 1, 2))
    nb = -(-seq_len // page)
    scores[:nb] += F.pad(mass, (0, nb * page - seq_len)).view(nb, page).sum(dim=1)
    return (p @ v).to(q.dtype)
