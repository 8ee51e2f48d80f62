"""Multi-head latent attention (MLA) over a paged latent cache, in plain torch: the CPU path and
the oracle for MLA kernels.

    latent cache  [num_blocks, block_size, 1, kv_lora_rank + rope]   a row: the token's normalized
                  latent c, then its rope-rotated shared key part (engine/exec/kv_cache.py, parts 1)
    q             [T, H, nope + rope]   each head's query: its no-rope part, then its rotated part
    w_kv_b        [H, nope + v, kv_lora_rank]   kv_b_proj's weight by head: W_UK rows, then W_UV rows

Two forms of the same attention (scores q . k = q_nope . (W_UK c) + q_rope . k_rope):

    expanded  each context token's per-head key (W_UK c, then the shared rope part) and value
              (W_UV c) are built from the latent, then attention runs as usual: Hugging Face's
              order of operations; its cost grows with context x heads x (nope + v) x rank
    absorbed  W_UK is folded into the query (q_lat = q_nope W_UK, per head: a kv_lora_rank
              query), the scores are one pass over the cached rows (q_lat . c + q_rope . k_rope),
              the output stays in latent space (sum of p c) until W_UV maps it out; it reads only
              the cached rows, which is what a decode step wants

Sequences are a flat batch as in ops/attention_ref.py: `query_lens` new tokens of each, whose
queries are the last of its `seq_lens` context, causal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .attention_ref import gather_kv


def _mask(seq_len: int, q_len: int, device) -> torch.Tensor:
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    return torch.arange(seq_len, device=device)[None, :] <= q_pos


def mla_expanded_ref(q: torch.Tensor, latent_cache, block_tables: torch.Tensor, seq_lens: list[int],
                     query_lens: list[int], w_kv_b: torch.Tensor, scale: float) -> torch.Tensor:
    """-> [T, H, v]: each sequence's context expanded to per-head keys and values."""
    heads, nope_v, rank = w_kv_b.shape
    nope = q.shape[-1] - (latent_cache.shape[-1] - rank)
    v_dim = nope_v - nope
    out = q.new_empty(q.shape[0], heads, v_dim)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        lat = gather_kv(latent_cache, block_tables[i], seq_len, q.dtype)[:, 0]  # [S, rank + rope]
        # token-major [S, H, dim], each row's last dim contiguous (what SDPA's kernels take); on
        # CUDA the values padded with zeros to the keys' width, which flash attention needs (the
        # padding columns of its output are zeros, cut below)
        kv = F.linear(lat[:, :rank], w_kv_b.flatten(0, 1)).view(seq_len, heads, nope_v)
        k = q.new_empty(seq_len, heads, q.shape[-1])
        k[..., :nope] = kv[..., :nope]
        k[..., nope:] = lat[:, None, rank:]
        v = kv[..., nope:]
        if q.is_cuda and k.shape[-1] != v_dim:
            v = torch.cat((v, v.new_zeros(seq_len, heads, k.shape[-1] - v_dim)), dim=-1)
        qi, k, v = (x.transpose(0, 1)[None] for x in (q[start:start + q_len], k, v))  # [1, H, len, dim]
        causal = dict(is_causal=True) if q_len == seq_len else dict(attn_mask=causal_lower_right(q_len, seq_len))
        o = F.scaled_dot_product_attention(qi, k, v, scale=scale, **causal)[..., :v_dim]
        out[start:start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


def mla_absorbed_ref(q: torch.Tensor, latent_cache, block_tables: torch.Tensor, seq_lens: list[int],
                     query_lens: list[int], w_kv_b: torch.Tensor, scale: float) -> torch.Tensor:
    """-> [T, H, v]: the queries mapped into latent space, one pass over the cached rows."""
    heads, nope_v, rank = w_kv_b.shape
    nope = q.shape[-1] - (latent_cache.shape[-1] - rank)
    w_uk, w_uv = w_kv_b[:, :nope], w_kv_b[:, nope:]
    q_lat = torch.einsum("thn,hnr->thr", q[..., :nope], w_uk)  # [T, H, rank]
    q_rope = q[..., nope:]
    o_lat = q.new_empty(q.shape[0], heads, rank)
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in float32 at least
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        lat = gather_kv(latent_cache, block_tables[i], seq_len, q.dtype)[:, 0]  # [S, rank + rope]
        c, k_rope = lat[:, :rank], lat[:, rank:]
        ql, qr = q_lat[start:start + q_len], q_rope[start:start + q_len]  # [q, H, .]
        scores = (torch.einsum("qhr,sr->hqs", ql, c) + torch.einsum("qhd,sd->hqs", qr, k_rope)).to(acc) * scale
        scores = scores.masked_fill(~_mask(seq_len, q_len, q.device), float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        o_lat[start:start + q_len] = torch.einsum("hqs,sr->qhr", p, c)
        start += q_len
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)
