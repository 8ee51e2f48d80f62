"""Triton paged prefill attention: the prefill chunks of a flat batch, each on top of the
context its sequence already has in the paged cache, in one launch per layer.

One program = BLOCK_M query tokens of one sequence x one KV head; the GROUP query heads
that share the KV head are rows of the same tile (rows = BLOCK_M x GROUP_PAD), so each K/V
element a tile needs is read once for all of them: GQA without repeating K/V. The program
walks the sequence's block table up to its last query's position (causal; a sliding window
starts it later), with an online softmax in base 2. A quantized cache (kv_quant.QuantKV)
multiplies each token's K scale into its column of scores and its V scale into its row of
probabilities, as the decode kernel does.

Before it, a chunk over cached context went through the torch reference: it gathered the
sequence's whole context out of the cache, repeated K/V heads for GQA, built a mask and ran
SDPA, per sequence and layer (11.5 ms of SDPA plus ~10 ms of copies, masks and elementwise
kernels in one 16-decode + 256-token step on an H200: issue "one attention path").

`PrefillPlan` is built once per step (the tiles: which sequence and first token each
program takes, and each sequence's first query row and lengths) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_attention import _COMPUTE, _check_cache, _scale_args


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, tiles_ptr, seqs_ptr, ks_ptr, vs_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, SCALED: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 2)
    m0 = tl.load(tiles_ptr + tile * 2 + 1)
    q0 = tl.load(seqs_ptr + seq * 3)  # the sequence's first query row in q
    q_len = tl.load(seqs_ptr + seq * 3 + 1)
    ctx = tl.load(seqs_ptr + seq * 3 + 2)  # its context after this step (cached + new)
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = m0 + rows // GROUP_PAD
    g = rows % GROUP_PAD
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    live = (tok < q_len) & (g < GROUP)
    heads = kvh * GROUP + g
    q_pos = ctx - q_len + tok  # absolute positions of the rows' tokens
    q = tl.load(q_ptr + (q0 + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=live[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    q = (q * qk_scale).to(COMPUTE_DTYPE)  # qk_scale folds in log2(e): softmax in base 2

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, D_PAD], tl.float32)
    end = tl.minimum(ctx - q_len + m0 + BLOCK_M, ctx)  # past the tile's last query: nothing it sees
    lo = 0
    if window > 0:
        lo = tl.maximum(ctx - q_len + m0 - window + 1, 0)
    for n0 in range((lo // BLOCK_N) * BLOCK_N, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_seq = offs_n < end
        blk = tl.load(bt_ptr + seq * stride_bt + offs_n // PAGE, mask=in_seq, other=0).to(tl.int64)
        slot = offs_n % PAGE
        kv_mask = in_seq[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_kt + kvh * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vt + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SCALED:
            ks = tl.load(ks_ptr + blk * stride_ksb + slot * stride_kst + kvh * stride_ksh, mask=in_seq, other=0.0)
            vs = tl.load(vs_ptr + blk * stride_vsb + slot * stride_vst + kvh * stride_vsh, mask=in_seq, other=0.0)
            s = s * ks[None, :]
        seen = in_seq[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if window > 0:
            seen = seen & (q_pos[:, None] - offs_n[None, :] < window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SCALED:
            p = p * vs[None, :]
        if IEEE:
            pv = tl.dot(p.to(COMPUTE_DTYPE), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(COMPUTE_DTYPE), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q0 + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=live[:, None] & mask_d[None, :])


@dataclass
class PrefillPlan:
    """A step's prefill sequences as the kernel reads them, built once and used by every layer:
    `tiles` [num_tiles, 2] (sequence, first token), `seqs` [num_seqs, 3] (first query row,
    query length, context length), int32 on the device."""

    tiles: torch.Tensor
    seqs: torch.Tensor
    block_m: int

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], group: int, device) -> PrefillPlan:
        block_m = max(1, 64 // triton.next_power_of_2(group))
        tiles, seqs, row = [], [], 0
        for i, (q_len, ctx) in enumerate(zip(query_lens, seq_lens)):
            if q_len > ctx:
                raise ValueError(f"sequence {i}: {q_len} query tokens over a context of {ctx}")
            seqs += [row, q_len, ctx]
            tiles += [x for m in range(0, q_len, block_m) for x in (i, m)]
            row += q_len
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
        return cls(as_t(tiles).view(-1, 2), as_t(seqs).view(-1, 3), block_m)


def paged_prefill_triton(q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor, plan: PrefillPlan,
                         scale: float, sliding_window: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim]: the sequences' new tokens, back to back, each the
    last `query_len` positions of its context (the new K/V already stored) -> same shape."""
    k_cache, v_cache, ks, vs, *sstrides, scaled = _scale_args(k_cache, v_cache)
    _check_cache(k_cache, v_cache)
    T, H, D = q.shape
    _, page, KVH, Dc = k_cache.shape
    if Dc != D or H % KVH:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)} "
                         "(GQA needs num_heads % num_kv_heads == 0)")
    if q.stride(-1) != 1 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("q needs a contiguous last dimension and block_tables contiguous int32 rows")
    if block_tables.shape[0] != plan.seqs.shape[0]:
        raise ValueError(f"{block_tables.shape[0]} block tables for {plan.seqs.shape[0]} sequences")
    out = torch.empty_like(q) if out is None else out
    if T == 0 or plan.tiles.shape[0] == 0:
        return out
    group = H // KVH
    cdt = q.dtype if q.dtype in _COMPUTE and q.is_cuda else torch.float32  # the interpreter: fp32
    _paged_prefill_kernel[(plan.tiles.shape[0], KVH)](
        q, k_cache, v_cache, out, block_tables, plan.tiles, plan.seqs, ks, vs,
        scale * 1.4426950408889634, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), *sstrides,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=D, D_PAD=max(16, triton.next_power_of_2(D)),
        PAGE=page, BLOCK_M=plan.block_m, BLOCK_N=max(16, min(64, page * 4)) if page <= 64 else page,
        IEEE=cdt == torch.float32, COMPUTE_DTYPE=_COMPUTE[cdt], SCALED=scaled, num_warps=4,
    )
    return out
