"""Paged attention for one layer, over a flat batch of mixed prefill chunks and decodes.

On CUDA a step of decodes only (and speculative verification rows, one per query token)
runs the Triton paged-decode kernel; any other step runs one Triton paged-prefill launch
over every sequence, decodes included as chunks of one token, each chunk on top of the
context its sequence has cached (ops/triton_prefill.py); a single fresh prompt alone runs
torch's causal flash kernel. Which of these a step takes is its AttentionPlan, decided once per
step by the runner from the step's shape and the config's AttentionTuning. On CPU everything
goes through the torch reference (ops/attention_ref.py), which stays the oracle the kernels are
tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..base.host_to_device import to_device
from ..ops.attention_ref import paged_attention_ref, store_kv_ref
from ..settings import AttentionTuning


@dataclass
class AttentionPlan:
    """How every layer runs one step's attention, built with the step's metadata before the first
    layer runs (AttentionPlanner.plan): `decode_only`: every row through the paged-decode kernel;
    else the first `apart` rows (decodes) through the paged-decode kernel and the rest through one
    paged-prefill launch over `tiles` (ops/triton_prefill.PrefillPlan, shared by every layer);
    `fresh`: one fresh prompt alone, which a layer without a sliding window runs through torch's
    causal flash kernel (one launch, faster there than the paged kernel; `tiles` then only where a
    layer has a window). Without kernels (CPU, the torch backend) every row goes through the
    torch reference."""

    kernels: bool
    decode_only: bool = False
    apart: int = 0
    fresh: bool = False
    tiles: object = None  # triton_prefill.PrefillPlan of the rows after `apart`, where a layer launches it


@dataclass(frozen=True)
class AttentionPlanner:
    """What decides each step's AttentionPlan, fixed for an engine and its model (`of_model`):
    whether the Triton kernels run, the query heads per key head (the paged-prefill tiles'
    group), whether a layer has a sliding window (it takes the paged kernel for a fresh prompt
    too), whether any layer launches the paged-prefill kernel (MLA's layers do not) and the
    config's AttentionTuning. `scoring` (heavy-hitter eviction, base/kv_window.py): every step also
    sums each block's attention mass; a step of decodes only runs the paged-decode kernel, which
    sums it from its own softmax, and any other step the torch reference, which does too. The
    default plans the torch reference for every row."""

    kernels: bool = False
    group: int = 1
    windowed: bool = False
    prefill_tiles: bool = True
    tuning: AttentionTuning = AttentionTuning()
    scoring: bool = False
    kv_heads: int = 1  # a layer's (the score buffer's middle dimension)

    @classmethod
    def of_model(cls, model, tuning: AttentionTuning, kernels: bool, scoring: bool = False) -> AttentionPlanner:
        paged = [a for a in (model.attention(i) for i in range(model.num_layers)) if isinstance(a, PagedAttention)]
        group = paged[0].num_heads // paged[0].num_kv_heads if paged else 1
        return cls(kernels, group, any(a.sliding_window is not None for a in paged), bool(paged), tuning, scoring,
                   paged[0].num_kv_heads if paged else 1)

    def plan(self, num_decodes: int, num_seqs: int, query_lens: list[int] | None, seq_lens: list[int] | None,
             device) -> AttentionPlan:
        if not self.kernels:
            return AttentionPlan(False)
        if num_decodes == num_seqs:
            return AttentionPlan(True, decode_only=True)
        if self.scoring:
            return AttentionPlan(False)
        nd, tuning = num_decodes, self.tuning
        apart = tuning.decodes_apart
        if apart is None:
            apart = len(query_lens) > nd and sum(query_lens[nd:]) >= tuning.apart_from_tokens
        apart = nd if apart else 0
        fresh = num_seqs - apart == 1 and query_lens[-1] == seq_lens[-1]
        tiles = None
        if self.prefill_tiles and (self.windowed or not fresh):
            from ..ops.triton_prefill import MIXED, PREFILL, PrefillPlan

            launch = None if tuning.prefill_tiles is None else MIXED if tuning.prefill_tiles == "mixed" else PREFILL
            tiles = PrefillPlan.build(query_lens[apart:], seq_lens[apart:], self.group, device, launch)
        return AttentionPlan(True, apart=apart, fresh=fresh, tiles=tiles)


REFERENCE = AttentionPlanner()


@dataclass
class AttentionMetadata:
    """What a layer's attention reads about the step's sequences, with the step's plan, built
    once per step by `build` before the first layer (eager and piecewise steps, decode graphs and
    their capture, TP shards alike)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens_t: torch.Tensor  # context length after this step, [num_seqs] int32 on the device
    num_decodes: int  # leading sequences with one query token (all of them in a decode graph)
    seq_lens: list[int] | None  # host copies (None: a decode graph's device buffers)
    query_lens: list[int] | None  # new tokens per sequence (None: one each)
    plan: AttentionPlan  # how every layer runs this step
    # the planner's scoring: [num_seqs, kv heads, max_blocks] float32, each layer adds the attention mass per
    # block (the decode kernel per kv head, the reference into the first; their sum is the block's)
    scores: torch.Tensor | None = None

    @classmethod
    def build(cls, slots, tables, seq_lens, query_lens: list[int] | None, device=None,
              planner: AttentionPlanner = REFERENCE) -> AttentionMetadata:
        """Host arrays (numpy, lists) are copied to `device`; device tensors are used as they
        are (a graph's static buffers: `seq_lens` a tensor, every row a decode, query_lens None).
        `planner`: the engine's (ModelRunner.planner); the default runs the torch reference."""
        def put(a, dtype=None):
            if isinstance(a, torch.Tensor):
                return a
            t = torch.as_tensor(np.asarray(a, dtype=dtype))
            return t if device is None else to_device(t, device)

        lens_list = None if isinstance(seq_lens, torch.Tensor) else [int(x) for x in seq_lens]
        num_seqs = tables.shape[0]
        if query_lens is None:
            nd = num_seqs
        else:
            nd = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        queries = None if query_lens is None else list(query_lens)
        plan = planner.plan(nd, num_seqs, queries, lens_list, device)
        at = tables.device if isinstance(tables, torch.Tensor) else device  # a graph's buffers: their device
        scores = None
        if planner.scoring:
            scores = torch.zeros(tables.shape[0], planner.kv_heads, tables.shape[1], dtype=torch.float32, device=at)
        return cls(put(slots, np.int64), put(tables, np.int32), put(seq_lens, np.int32), nd, lens_list, queries, plan,
                   scores)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


class PagedAttention:
    capturable = True  # its steps run inside CUDA graphs (no host sync)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None, use_triton: bool):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.out_dim = head_dim  # the output's last dim, like q's
        self.scale = scale
        self.sliding_window = sliding_window
        self.use_triton = use_triton
        if use_triton:
            from ..ops.kv_store import store_kv_triton
            from ..ops.triton_attention import paged_decode_triton
            from ..ops.triton_prefill import paged_prefill_triton

            self._store, self._decode, self._prefill = store_kv_triton, paged_decode_triton, paged_prefill_triton
        else:
            self._store, self._decode, self._prefill = store_kv_ref, None, None

    def warm_up(self, k_cache, v_cache, dtype: torch.dtype, scoring: bool = False) -> None:
        """Compiles, before serving, every kernel variant a step can launch: paged prefill in
        mixed and in prefill tiles, each with and without key splits (and their combine), and
        paged decode with and without, each for block tables whose width has a factor of 16, one
        whose width has not (Triton specializes an int argument on that) and tables that start
        off a 16-byte boundary (and a pointer on its alignment: a step whose decodes run apart
        hands the prefill kernel `block_tables[nd:]`, unaligned when nd x width is not a multiple
        of 4; its first such step on a fresh hybrid decode worker waited for that compile).
        Triton compiles a variant on first use, a second or more each, which a first request would
        otherwise wait for (docs/design/graphs.md; ops/compile_watch.py counts what is left).
        `scoring`: the decode kernel's block-score variant too (heavy-hitter eviction). Reads block 0
        only and writes nothing to the cache."""
        if self._prefill is None:
            return
        from ..ops.triton_prefill import MIXED, PREFILL, PrefillPlan

        page = k_cache.shape[1]
        device = (k_cache if isinstance(k_cache, torch.Tensor) else k_cache.values).device  # or a QuantKV
        group = self.num_heads // self.num_kv_heads
        for width, skip in ((64, 0), (65, 0), (65, 1)):  # blocks per table (contexts long enough for key
            tables = torch.zeros(1 + skip, width, dtype=torch.int32, device=device)[skip:]  # splits), alignment
            for launch in (MIXED, PREFILL):
                for splits in (1, 2):
                    q = torch.zeros(16, self.num_heads, self.head_dim, dtype=dtype, device=device)
                    plan = PrefillPlan.build([16], [width * page], group, device, launch)
                    self._prefill(q, k_cache, v_cache, tables, plan, self.scale, self.sliding_window, splits=splits)
            for splits in (1, 2):
                q = torch.zeros(1, self.num_heads, self.head_dim, dtype=dtype, device=device)
                lens = torch.full((1,), width * page, dtype=torch.int32, device=device)
                for scores in ((None, torch.zeros(1, self.num_kv_heads, width, device=device)) if scoring else (None,)):
                    self._decode(q, k_cache, v_cache, tables, lens, self.scale, self.sliding_window, splits=splits,
                                 scores=scores)

    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
        """Writes the step's new keys and values to their slots (-1: skip)."""
        self._store(k, v, k_cache, v_cache, slot_mapping)

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (None: already stored, as the piecewise graphs do); caches
        [num_blocks, block_size, KVH, D]; out: where to write (like q)."""
        if k is not None:
            self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = meta.plan
        if plan.decode_only:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t,
                                self.scale, self.sliding_window, out=out, scores=meta.scores)
        out = torch.empty_like(q) if out is None else out
        seq_lens = meta.seq_lens if meta.seq_lens is not None else meta.seq_lens_t.tolist()  # CPU layouts
        query_lens = meta.query_lens if meta.query_lens is not None else [1] * meta.num_seqs
        nd = plan.apart
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_t[:nd],
                         self.scale, self.sliding_window, out=out[:nd])
        if plan.kernels and self._prefill is not None and not (plan.fresh and self.sliding_window is None):
            self._prefill(q[nd:], k_cache, v_cache, meta.block_tables[nd:], plan.tiles, self.scale,
                          self.sliding_window, out=out[nd:])
            return out
        out[nd:] = paged_attention_ref(q[nd:], k_cache, v_cache, meta.block_tables[nd:], seq_lens[nd:],
                                       query_lens[nd:], self.scale, self.sliding_window,
                                       None if meta.scores is None else meta.scores[nd:])
        return out
