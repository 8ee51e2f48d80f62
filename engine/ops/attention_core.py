"""The attention core the paged-decode (triton_attention.py) and paged-prefill (triton_prefill.py)
kernels share, so that a decode row gets the same bits whichever kernel a step sends it through:

    kv_tile      one tile of a sequence's keys and values through its block table (bf16/fp32,
                 int8/fp8 with a scale per row, int4 unpacked)
    attend       one key tile into the rows' online softmax: the scores q k^T (qk_dot), then softmax_tile
    softmax_tile a tile's scores into the online softmax, base 2: fp32 scores scaled by
                 softmax_scale x log2(e) after the dot (q is never rounded with the scale in it);
                 the MLA kernel's too (triton_mla.py: its scores have a latent and a rope part).
                 Its halves, tile_probs and tile_values, for a kernel that reads p between them
                 (the decode kernel's block scores)
    store_partial / _combine_kernel
                 key splits (flash-decoding): each split writes its unnormalized (acc, max, sum)
                 per live row; one combine kernel rescales them to the common max (per row for
                 decode launches, per tile for prefill ones). Partials are laid out
                 [program (tile or sequence) x kv head, split, row, D_PAD] for both kernels.
    split_count  the one planner of how many splits a launch cuts each program's keys into
    check_launch the one check of q, the caches, block tables and splits before a launch

A program's rows are query tokens x the GQA group of one kv head: the decode kernel's rows are
one token's group (ROWS = its padded group), the prefill kernel's BLOCK_M tokens x the group.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .kv_quant import INT4_GROUP, Int4KV, QuantKV
from .triton_int4 import int4_rows

MAX_SPLITS = 32
LOG2E = 1.4426950408889634
_COMPUTE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, offs_n, in_seq, valid, kvh, offs_d, mask_d,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
            PAGE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, SCALED: tl.constexpr, INT4: tl.constexpr,
            K_COLUMNS: tl.constexpr):
    """One tile of keys `offs_n` of a sequence (its block-table row at `table_ptr`), kv head `kvh`:
    K transposed [D_PAD, BLOCK_N] and V [BLOCK_N, D_PAD] in COMPUTE_DTYPE (zero where not `valid`)
    and, for a quantized cache, each token's K and V scale (else K and V again, unused). INT4 (the
    group size, 0 = off): packed rows and their group scales, dequantized here (triton_int4.py).
    K_COLUMNS: K is loaded as columns rather than transposed after the load; the interpreter's dot
    is numpy's matmul, whose bits for a row depend on how many rows the tile has when its right
    operand is a transposed view, and not when it is contiguous (set with IEEE: the fp32 path)."""
    blk = tl.load(table_ptr + offs_n // PAGE, mask=in_seq, other=0).to(tl.int64)
    tok = offs_n % PAGE
    kv_mask = valid[:, None] & mask_d[None, :]
    if INT4:
        k = int4_rows(k_ptr + blk[:, None] * stride_kb + tok[:, None] * stride_kt + kvh * stride_kh,
                      ks_ptr + blk[:, None] * stride_ksb + tok[:, None] * stride_kst + kvh * stride_ksh,
                      valid, offs_d.shape[0], INT4).to(COMPUTE_DTYPE)
        v = int4_rows(v_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt + kvh * stride_vh,
                      vs_ptr + blk[:, None] * stride_vsb + tok[:, None] * stride_vst + kvh * stride_vsh,
                      valid, offs_d.shape[0], INT4).to(COMPUTE_DTYPE)
        k = tl.trans(k)
    elif K_COLUMNS:
        k = tl.load(k_ptr + blk[None, :] * stride_kb + tok[None, :] * stride_kt + kvh * stride_kh
                    + offs_d[:, None], mask=tl.trans(kv_mask), other=0.0).to(COMPUTE_DTYPE)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
    else:
        k = tl.trans(tl.load(k_ptr + blk[:, None] * stride_kb + tok[:, None] * stride_kt + kvh * stride_kh
                             + offs_d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE))
        v = tl.load(v_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
    ks = k
    vs = v
    if SCALED:
        ks = tl.load(ks_ptr + blk * stride_ksb + tok * stride_kst + kvh * stride_ksh, mask=valid, other=0.0)
        vs = tl.load(vs_ptr + blk * stride_vsb + tok * stride_vst + kvh * stride_vsh, mask=valid, other=0.0)
    return k, v, ks, vs


@triton.jit
def qk_dot(q, k, IEEE: tl.constexpr):
    """q k^T of a tile (K transposed, as kv_tile gives it), unscaled, fp32."""
    if IEEE:
        return tl.dot(q, k, input_precision="ieee")
    return tl.dot(q, k)


@triton.jit
def attend(q, k, v, ks, vs, seen, acc, m_i, l_i, qk_scale, MASKED: tl.constexpr, IEEE: tl.constexpr,
           COMPUTE_DTYPE: tl.constexpr, SCALED: tl.constexpr):
    """One tile of keys (K transposed, as kv_tile gives it) into the rows' online softmax: the
    scores q k^T, then `softmax_tile`."""
    return softmax_tile(qk_dot(q, k, IEEE) * qk_scale, v, ks, vs, seen, acc, m_i, l_i, MASKED, IEEE, COMPUTE_DTYPE,
                        SCALED)


@triton.jit
def softmax_tile(s, v, ks, vs, seen, acc, m_i, l_i, MASKED: tl.constexpr, IEEE: tl.constexpr,
                 COMPUTE_DTYPE: tl.constexpr, SCALED: tl.constexpr):
    """A tile's scores s [rows, keys] (already scaled by softmax_scale x log2(e)) into the rows'
    online softmax (base 2): (acc, max, sum) updated with p v. A quantized cache's K scale `ks`
    multiplies a token's column of scores, its V scale `vs` its column of probabilities. MASKED:
    scores where not `seen` drop out (else every row sees every key of the tile). Every kernel's
    softmax: the GQA decode and prefill kernels through `attend`, the MLA kernel with its two-part
    scores (triton_mla.py). It is `tile_probs`, then `tile_values`."""
    p, alpha, m_new, l_i = tile_probs(s, ks, seen, m_i, l_i, MASKED, SCALED)
    return tile_values(p, v, vs, acc, alpha, IEEE, COMPUTE_DTYPE, SCALED), m_new, l_i


@triton.jit
def tile_probs(s, ks, seen, m_i, l_i, MASKED: tl.constexpr, SCALED: tl.constexpr):
    """The online softmax's first half: the tile's p = 2^(s - new max) [rows, keys], the factor
    alpha that rescales what came before, the new max and the new sum. A caller that needs p itself
    (the decode kernel's block scores) calls this and `tile_values` apart."""
    if SCALED:
        s = s * ks[None, :]
    if MASKED:
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: no NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def tile_values(p, v, vs, acc, alpha, IEEE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, SCALED: tl.constexpr):
    """The online softmax's second half: acc rescaled by alpha, plus p v."""
    if SCALED:
        p = p * vs[None, :]
    if IEEE:
        pv = tl.dot(p.to(COMPUTE_DTYPE), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(COMPUTE_DTYPE), v)
    return acc * alpha[:, None] + pv


@triton.jit
def finish(acc, l_i):
    """The normalized output of a program's rows (rows that saw no key stay zero)."""
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def store_partial(part_acc_ptr, part_ml_ptr, program, split, SPLITS, rows, live, offs_d, acc, m_i, l_i,
                  ROWS: tl.constexpr, D_PAD: tl.constexpr):
    """A split's unnormalized (acc, max, sum) for the live rows of `program` (tile or sequence x kv head)."""
    at = (program * SPLITS + split) * ROWS + rows
    tl.store(part_acc_ptr + at[:, None] * D_PAD + offs_d[None, :], acc, mask=live[:, None])
    tl.store(part_ml_ptr + at * 2, m_i, mask=live)
    tl.store(part_ml_ptr + at * 2 + 1, l_i, mask=live)


@triton.jit
def tile_rows(tiles_ptr, seqs_ptr, tile, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """A prefill tile's rows: (sequence, first token, their query rows in q, query heads within the group,
    live?, their absolute positions, the first query's position, the context after this step)."""
    seq = tl.load(tiles_ptr + tile * 2)
    m0 = tl.load(tiles_ptr + tile * 2 + 1)
    q0 = tl.load(seqs_ptr + seq * 3)  # the sequence's first query row in q
    q_len = tl.load(seqs_ptr + seq * 3 + 1)
    ctx = tl.load(seqs_ptr + seq * 3 + 2)  # its context after this step (cached + new)
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = m0 + rows // GROUP_PAD
    g = rows % GROUP_PAD
    return seq, m0, q0 + tok, g, (tok < q_len) & (g < GROUP), ctx - q_len + tok, ctx - q_len + m0, ctx


@triton.jit
def combine_rows(tiles_ptr, seqs_ptr, tile, r, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILED: tl.constexpr):
    """Rows `r` of an attention program as the output holds them: (query row in q, head within
    the group, live?). TILED: a prefill tile (through the plan); else a decode program, whose
    sequence is its query row and whose rows are the heads of its group."""
    if TILED:
        seq = tl.load(tiles_ptr + tile * 2)
        tok = tl.load(tiles_ptr + tile * 2 + 1) + r // GROUP_PAD
        g = r % GROUP_PAD
        return tl.load(seqs_ptr + seq * 3) + tok, g, (tok < tl.load(seqs_ptr + seq * 3 + 1)) & (g < GROUP)
    else:
        return tile + r * 0, r, r < GROUP


@triton.jit(do_not_specialize=["SPLITS"])
def _combine_kernel(
    part_acc_ptr, part_ml_ptr, o_ptr, tiles_ptr, seqs_ptr, stride_ot, stride_oh, SPLITS,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, S_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, TILED: tl.constexpr,
    PER_ROW: tl.constexpr,
):
    # the splits of each row rescaled to their common max and summed, in one of two schedules:
    # PER_ROW, one program per row with its splits as one [S_PAD, D_PAD] tile (decode: few rows,
    # up to 32 splits); else one program per attention program, its ROWS rows a tile, walking the
    # splits with a running max (prefill tiles: many rows, few splits)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_d = tl.arange(0, D_PAD)
    base = (tile * NUM_KV_HEADS + kvh) * SPLITS
    if PER_ROW:
        r = tl.program_id(2)
        qrow, g, live = combine_rows(tiles_ptr, seqs_ptr, tile, r, GROUP, GROUP_PAD, TILED)
        offs_s = tl.arange(0, S_PAD)
        live_s = (offs_s * 0 + live.to(tl.int32)) > 0  # through a tensor: the interpreter rejects scalar masks
        mask_s = (offs_s < SPLITS) & live_s
        at = (base + offs_s) * ROWS + r
        m = tl.load(part_ml_ptr + at * 2, mask=mask_s, other=float("-inf"))
        lsum = tl.load(part_ml_ptr + at * 2 + 1, mask=mask_s, other=0.0)
        acc = tl.load(part_acc_ptr + at[:, None] * D_PAD + offs_d[None, :], mask=mask_s[:, None], other=0.0)
        m_all = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp2(m - m_all), 0.0)  # empty splits weigh nothing
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
        live_d = (offs_d * 0 + live.to(tl.int32)) > 0
        tl.store(o_ptr + qrow * stride_ot + (kvh * GROUP + g) * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
                 mask=(offs_d < HEAD_DIM) & live_d)
    else:
        rows = tl.arange(0, ROWS)
        qrow, g, live = combine_rows(tiles_ptr, seqs_ptr, tile, rows, GROUP, GROUP_PAD, TILED)
        m_all = tl.full([ROWS], float("-inf"), tl.float32)
        l_all = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_PAD], tl.float32)
        for sp in range(0, SPLITS):
            at = (base + sp) * ROWS + rows
            m = tl.load(part_ml_ptr + at * 2, mask=live, other=float("-inf"))
            lsum = tl.load(part_ml_ptr + at * 2 + 1, mask=live, other=0.0)
            a = tl.load(part_acc_ptr + at[:, None] * D_PAD + offs_d[None, :], mask=live[:, None], other=0.0)
            m_new = tl.maximum(m_all, m)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty so far: weigh nothing, no NaN
            w_old = tl.exp2(m_all - m_use)
            w_new = tl.exp2(m - m_use)
            acc = acc * w_old[:, None] + a * w_new[:, None]
            l_all = l_all * w_old + lsum * w_new
            m_all = m_new
        tl.store(o_ptr + qrow[:, None] * stride_ot + (kvh * GROUP + g)[:, None] * stride_oh + offs_d[None, :],
                 finish(acc, l_all).to(o_ptr.dtype.element_ty), mask=live[:, None] & (offs_d < HEAD_DIM)[None, :])


class Partials(NamedTuple):
    """A split launch's scratch: acc [programs x splits x rows, D_PAD] and (max, sum) [..., 2], fp32."""

    acc: torch.Tensor
    ml: torch.Tensor

    @classmethod
    def empty(cls, programs: int, splits: int, rows: int, d_pad: int, device) -> Partials:
        n = programs * splits * rows
        return cls(torch.empty(n, d_pad, dtype=torch.float32, device=device),
                   torch.empty(n, 2, dtype=torch.float32, device=device))


def combine(part: Partials, out: torch.Tensor, programs: int, num_kv_heads: int, splits: int, group: int,
            group_pad: int, rows: int, tiles: torch.Tensor | None = None, seqs: torch.Tensor | None = None,
            warps: int = 4) -> None:
    """The second launch of a split attention over `programs` x `num_kv_heads` attention programs of
    `rows` rows each. `tiles`/`seqs`: a prefill plan's, one program per tile x kv head walking the
    splits; None: a decode launch (a program per sequence), one program per live row."""
    tiled = tiles is not None
    grid = (programs, num_kv_heads) if tiled else (programs, num_kv_heads, group)
    _combine_kernel[grid](
        part.acc, part.ml, out, tiles if tiled else out, seqs if tiled else out, out.stride(0), out.stride(1),
        splits, GROUP=group, GROUP_PAD=group_pad, ROWS=rows, HEAD_DIM=out.shape[-1], D_PAD=part.acc.shape[1],
        S_PAD=MAX_SPLITS, NUM_KV_HEADS=num_kv_heads, TILED=tiled, PER_ROW=not tiled,
        num_warps=warps,
    )


def split_count(programs: int, max_context: int, sms: int, per_sm: int, full_at: int | None = None,
                min_keys: int = 256, whole_wave: bool = False) -> int:
    """Pieces to cut each program's keys into so that a launch on `sms` SMs has about `per_sm`
    programs per SM: 1 when the programs alone reach `full_at` per SM (default `per_sm`), and each
    piece at least `min_keys` keys (below 256 the GQA kernels' combine costs more than it saves).
    `whole_wave`: never more pieces than one wave holds (rounded down, not up: for kernels whose
    program fills an SM, where a second, partly filled wave costs more than the combine saves).
    Depends on shapes only, so a CUDA graph captures a fixed grid."""
    if programs >= (per_sm if full_at is None else full_at) * sms:
        return 1
    wave = per_sm * sms // programs if whole_wave else -(-per_sm * sms // programs)
    return max(1, min(wave, max_context // min_keys, MAX_SPLITS))


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the dots run in: the model's on CUDA (bf16/fp16 tensor cores; fp8 caches are
    upcast). The CPU interpreter's tl.dot mishandles bf16 operands (Triton 3.9): fp32 there."""
    return q.dtype if q.dtype in _COMPUTE and q.is_cuda else torch.float32


class CacheArgs(NamedTuple):
    """A layer's caches as the kernels take them: K and V values, K and V scales (the values
    again when there are none), the scales' 6 strides, per-row scales?, the int4 group (0: not
    int4), and the logical [num_blocks, block_size, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor
    ks: torch.Tensor
    vs: torch.Tensor
    sstrides: tuple
    scaled: bool
    int4: int
    shape: torch.Size

    def strides(self) -> tuple:
        """The values' strides (block, token, head) of K, then of V, as the kernels take them."""
        return (*self.k.stride()[:3], *self.v.stride()[:3])


def cache_args(k_cache, v_cache) -> CacheArgs:
    if isinstance(k_cache, (QuantKV, Int4KV)):
        ks, vs = k_cache.scales, v_cache.scales
        int4 = INT4_GROUP if isinstance(k_cache, Int4KV) else 0
        return CacheArgs(k_cache.values, v_cache.values, ks, vs, (*ks.stride()[:3], *vs.stride()[:3]), not int4,
                         int4, k_cache.shape)
    return CacheArgs(k_cache, v_cache, k_cache, v_cache, (0,) * 6, False, 0, k_cache.shape)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must be [num_blocks, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must be contiguous (stride 1)")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k/v cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")


def check_launch(q: torch.Tensor, c: CacheArgs, block_tables: torch.Tensor, num_seqs: int, splits: int) -> None:
    """What both attention launchers require: q [rows, heads, head_dim] fits the cache (GQA), q and
    the block tables' rows contiguous, int32 tables one per sequence, splits in [1, MAX_SPLITS]."""
    check_cache(c.k, c.v)
    D = q.shape[-1]
    kvh, dc = c.shape[2], c.shape[3]
    if q.dim() != 3 or dc != D or q.shape[1] % kvh:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(c.shape)} "
                         "(GQA needs num_heads % num_kv_heads == 0)")
    if q.stride(-1) != 1:
        raise ValueError("q must have a contiguous last dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_blocks], "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
