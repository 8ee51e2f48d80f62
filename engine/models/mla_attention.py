"""Paged multi-head latent attention for one layer: PagedAttention's interface (models/attention.py)
over a latent cache, so the runner, the piecewise graphs and the decode graphs drive it alike.

    store(latent, None, cache, None, slots)   each new token's latent row into its slot
    __call__(q, latent, None, cache, None, meta, out)   q [T, H, nope + rope] -> out [T, H, v]

The layer's kv_b_proj holds W_UK and W_UV (ops/mla_ref.py). Which form a sequence runs in is
decided per step by its new tokens: decodes and chunks of at most `absorb_max_query` tokens in the
absorbed form, which reads only the cached rows (once per query token); longer chunks in the
expanded form, whose cost (the context's keys and values built once) is shared by all the chunk's
queries (the crossover: bench/mla_gpu.py --forms). With Triton the absorbed rows run through
ops/triton_mla.py, each token of a short chunk a row of its own over its causal prefix (the
query's absorption and W_UV as batched GEMMs around the kernel: a decode step has no host sync, so
the decode CUDA graphs capture it) and the store through the KV-store kernel; the expanded form
runs in torch (SDPA) between the piecewise graphs. On CPU both forms run in torch
(ops/mla_ref.py), the oracle.
"""

from __future__ import annotations

import torch
from torch import nn

from ..architectures import MLAConfig
from ..ops.attention_ref import store_kv_ref
from ..ops.mla_ref import mla_absorbed_ref, mla_expanded_ref
from .attention import AttentionMetadata

# a chunk of up to this many new tokens runs absorbed: on an H200 (V2-Lite, bench/results/mla/mla_gpu_forms.md)
# absorbed is faster up to 64 at every context measured (1K-16K) and slower at 128 on 16K
ABSORB_MAX_QUERY = 64


class MLAPagedAttention:
    def __init__(self, num_heads: int, mla: MLAConfig, kv_b_proj: nn.Linear, use_triton: bool):
        self.num_heads = num_heads
        self.head_dim = mla.qk_head_dim  # q's last dim (the piecewise graphs' q buffer)
        self.out_dim = mla.v_head_dim  # the output's (their o buffer)
        self.mla = mla
        self.kv_b_proj = kv_b_proj  # the module, not its weight: the loader replaces parameters
        self.scale = mla.softmax_scale
        self.use_triton = use_triton
        self.absorb_max_query = ABSORB_MAX_QUERY
        self.capturable = use_triton  # decode steps without a host sync: the decode graphs capture them
        self._store, self._decode = store_kv_ref, None
        if use_triton:
            from ..ops.kv_store import store_kv_triton
            from ..ops.triton_mla import mla_decode_triton

            self._store, self._decode = store_kv_triton, mla_decode_triton

    def w_kv_b(self) -> torch.Tensor:
        """kv_b_proj's weight by head: [H, nope + v, kv_lora_rank]."""
        return self.kv_b_proj.weight.view(self.num_heads, -1, self.mla.kv_lora_rank)

    def warm_up(self, k_cache, v_cache, dtype: torch.dtype, scoring: bool = False) -> None:
        """Compiles the decode kernel with and without key splits before serving, for block tables
        whose width has a factor of 16, one whose width has not, and tables off a 16-byte boundary
        (a prefill's rows take one sequence's row of the step's tables): the specializations
        PagedAttention.warm_up covers (no score variant: eviction by scores refuses MLA). Block 0
        read, nothing written."""
        if self._decode is None:
            return
        device = (k_cache if isinstance(k_cache, torch.Tensor) else k_cache.values).device
        m, h = self.mla, self.num_heads
        for width, skip in ((64, 0), (65, 0), (65, 1)):
            tables = torch.zeros(1 + skip, width, dtype=torch.int32, device=device)[skip:]
            lens = torch.full((1,), width * k_cache.shape[1], dtype=torch.int32, device=device)
            for splits in (1, 2):
                self._decode(torch.zeros(1, h, m.kv_lora_rank, dtype=dtype, device=device),
                             torch.zeros(1, h, m.qk_rope_head_dim, dtype=dtype, device=device), k_cache, tables,
                             lens, self.scale, splits=splits)

    def store(self, k: torch.Tensor, v: None, k_cache, v_cache: None, slot_mapping: torch.Tensor) -> None:
        """The latent rows into their slots, one row per token written once."""
        self._store(k, None, k_cache, None, slot_mapping)

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, v: None, k_cache, v_cache: None,
                 meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        if k is not None:
            self.store(k, None, k_cache, None, meta.slot_mapping)
        out = q.new_empty(q.shape[0], self.num_heads, self.out_dim) if out is None else out
        w = self.w_kv_b()
        nd = meta.num_decodes  # leading rows of one query token each
        if nd and self._decode is not None:
            self._absorbed_rows(q, k_cache, meta.block_tables[:nd], meta.seq_lens_t[:nd], w, out, slice(0, nd))
            if nd == meta.num_seqs:  # a decode step: nothing on the host (the decode graphs capture it)
                return out
        seq_lens = meta.seq_lens if meta.seq_lens is not None else meta.seq_lens_t.tolist()
        query_lens = meta.query_lens if meta.query_lens is not None else [1] * meta.num_seqs
        if nd and self._decode is None:
            out[:nd] = mla_absorbed_ref(q[:nd], k_cache, meta.block_tables[:nd], seq_lens[:nd], query_lens[:nd], w,
                                        self.scale)
        start = nd
        for i in range(nd, meta.num_seqs):  # the chunks, each in its form
            n, rows = query_lens[i], slice(start, start + query_lens[i])
            args = (k_cache, meta.block_tables[i:i + 1], seq_lens[i:i + 1], query_lens[i:i + 1], w, self.scale)
            if n > self.absorb_max_query:
                out[rows] = mla_expanded_ref(q[rows], *args)
            elif self._decode is None:
                out[rows] = mla_absorbed_ref(q[rows], *args)
            else:  # each token a row over its causal prefix
                lens = torch.arange(seq_lens[i] - n + 1, seq_lens[i] + 1, dtype=torch.int32, device=q.device)
                self._absorbed_rows(q, k_cache, meta.block_tables[i:i + 1].expand(n, -1), lens, w, out, rows)
            start += n
        return out

    def _absorbed_rows(self, q, k_cache, tables, lens, w, out, rows: slice) -> None:
        """out[rows] from q[rows], one query token per row over its `lens` keys: the kernel between
        two batched GEMMs on strided views (by head, no copies)."""
        nope = self.mla.qk_nope_head_dim
        q_lat = torch.bmm(q[rows, :, :nope].transpose(0, 1), w[:, :nope])  # [H, n, rank]
        o_lat = self._decode(q_lat.transpose(0, 1), q[rows, :, nope:], k_cache, tables, lens, self.scale)
        out[rows] = torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)
