"""CUDA graphs: a step's kernel launches leave Python.

A step's kernels are launched from graphs rather than one by one from Python (why:
docs/design/graphs.md). Two kinds of graph, captured at start (CUDA, Triton, not
`enforce_eager`), sharing one memory pool:

- decode graphs: a whole all-decode step, one graph per padded row count (1, 2, 4, 8, 16,
  32, ...). Rows are decodes and speculative verification rows (a request verifying
  [last, d1..dk] is k+1 rows, row j attending to its first p+j+1 tokens). Padding rows store
  nothing (slot -1) and attend to one token of block 0; their logits are dropped.
- piecewise graphs: any other step of up to `cuda_graph_max_tokens` (512), padded to a token
  bucket. The model's work between two attentions (`model.piece`: norms, projections, rope,
  the KV store, MLP, TP all-reduces) is one graph per layer boundary and bucket; each layer's
  attention runs eagerly between them on the real rows, because its grid depends on the
  step's mix of decodes and chunks: one paged-prefill launch per layer over every sequence
  (two when its keys are split). Padding rows compute garbage that no real row reads
  (every op outside attention is row-wise).

`route` is the one decision every step goes through (a StepPath): DECODE (a decode graph),
PIECES or EAGER. On CPU, `StepGraphs(capture=False)` runs both layouts without capturing, so
the tests exercise the padding and the static buffers the graphs read.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..base.host_to_device import pinned
from ..models.attention import AttentionMetadata, AttentionPlanner
from .runner_settings import RunnerSettings
from .step_inputs import DecodeRows, FlatBatch, StepPath


def piece_buckets(top: int) -> list[int]:
    """Token counts the piecewise graphs are captured for, up to `top`: multiples of 16 up to
    128, then 8 sizes per doubling (a step pads by at most 1/8; 1,040 tokens run as 1,152)."""
    sizes, t = [], 16
    while t < top:
        sizes.append(t)
        t += max(16, (1 << (t.bit_length() - 1)) // 8)
    return sizes + [top]


class StepGraphs:
    """The captured graphs of one model runner and the static buffers they read."""

    def __init__(self, model, kv_views: list, settings: RunnerSettings, num_blocks: int, planner: AttentionPlanner,
                 capture: bool = True):
        self.model, self.kv_views, self.settings, self.num_blocks = model, kv_views, settings, num_blocks
        self.planner = planner  # the runner's: each step's attention plan (models/attention.py)
        self.capture = capture
        self.block_size = settings.block_size
        self.decode_sizes = decode_sizes(settings)
        self.piece_sizes = piece_buckets(piece_tokens(settings))
        self.max_piece_tokens = self.piece_sizes[-1]
        self.decode: dict[int, tuple] = {}  # rows -> (graph, logits, attention mass per block or None)
        self.scores: torch.Tensor | None = None  # the last decode step's attention mass per block (scoring)
        self.pieces: dict[int, list] = {}  # tokens -> [graph per piece]
        self.decode_seconds: dict[int, float] = {}  # rows -> seconds per replay (core/step_model.py's `graph` feature)
        self._buffers(next(model.parameters()).device)
        if capture:
            self._capture()

    # ---- the one decision ------------------------------------------------------------------
    def route(self, batch) -> StepPath:
        """DECODE (every scheduled request is decode rows, within the largest decode graph),
        PIECES (within the largest token bucket) or EAGER."""
        rows = sum(s.num_new_tokens for s in batch)
        if all(s.decode_rows and not s.prompt_positions for s in batch) and rows <= self.decode_sizes[-1]:
            return StepPath.DECODE
        return StepPath.PIECES if rows <= self.max_piece_tokens else StepPath.EAGER

    def padded(self, path: StepPath, rows: int) -> int:
        sizes = self.decode_sizes if path == StepPath.DECODE else self.piece_sizes
        return next(b for b in sizes if b >= rows)

    @property
    def table_width(self) -> int:
        return self.tables.shape[1]

    # ---- buffers and capture ---------------------------------------------------------------
    def _buffers(self, dev) -> None:
        m, c = self.model, self.settings.model_config
        attn = m.attention(0)  # the layer's paged attention: q's and its output's shapes
        t = max(self.decode_sizes[-1], self.max_piece_tokens)
        rows = self.decode_sizes[-1]
        dtype = next(m.parameters()).dtype
        self.ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(rows, -(-self.settings.max_model_len // self.block_size), dtype=torch.int32,
                                  device=dev)
        self.lens = torch.ones(rows, dtype=torch.int32, device=dev)
        p = self.max_piece_tokens
        self.piece_slots = torch.full((p,), -1, dtype=torch.int64, device=dev)
        self.q = torch.zeros(p, attn.num_heads, attn.head_dim, dtype=dtype, device=dev)
        self.o = torch.zeros(p, attn.num_heads, attn.out_dim, dtype=dtype, device=dev)
        self.res = torch.zeros(p, c.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros_like(self.res)

    def _decode_step(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of b decode rows over the static buffers, and their attention mass per block
        where the planner scores (heavy-hitter eviction: zeroed and filled inside the graph)."""
        meta = AttentionMetadata.build(self.slots[:b], self.tables[:b], self.lens[:b], None, planner=self.planner)
        return self.model.compute_logits(self.model(self.ids[:b], self.pos[:b], self.kv_views, meta)), meta.scores

    def _piece(self, t: int, i: int) -> None:
        """Piece i over the first t rows of the static buffers: its q and residual written back
        to them, its keys and values stored in layer i's cache (padding rows: slot -1)."""
        x = self.ids[:t] if i == 0 else self.o[:t]
        out = self.model.piece(i, self.pos[:t], x, self.res[:t] if i else None)
        if i == self.model.num_layers:
            self.hidden[:t].copy_(out)
            return
        q, k, v, residual = out
        self.q[:t].copy_(q)
        self.res[:t].copy_(residual)
        self.model.attention(i).store(k, v, *self.kv_views[i], self.piece_slots[:t])

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.decode_sizes):  # largest first: smaller graphs reuse its memory
            self._decode_step(b)  # compiles the Triton kernels and warms up cuBLAS outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out, scores = self._decode_step(b)
            self.decode[b] = (graph, out, scores)
        n = self.model.num_layers + 1
        for t in reversed(self.piece_sizes):
            for i in range(n):
                self._piece(t, i)
            torch.cuda.synchronize()
            graphs = []
            for i in range(n):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(t, i)
                graphs.append(graph)
            self.pieces[t] = graphs
        torch.cuda.synchronize()
        if self.settings.spec is not None:
            self.decode_seconds = self.time_decode()

    def time_decode(self, reps: int = 5, context: int = 512) -> dict[int, float]:
        """Seconds one replay of each decode graph takes (the step-time model's `graph` feature,
        which speculation's off-switch reads: spec/switch.py), every row attending to `context`
        tokens (capped by max_model_len): the weights', activations' and a typical row's KV
        cost by row count. With 1-token rows the table missed the KV reads, so until the
        step-time fit had seen both sizes it priced a speculative step too low: batch 32-64
        with 0-30% acceptance speculated its first steps at a loss (bench/results/spec/).
        Nothing is written (slots -1)."""
        ctx = min(context, self.settings.max_model_len)
        blocks = -(-ctx // self.block_size)
        self.tables[:, :blocks] = torch.arange(blocks, device=self.tables.device, dtype=torch.int32) % self.num_blocks
        self.lens.fill_(ctx)
        out = {}
        for b, (graph, *_) in sorted(self.decode.items()):
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                graph.replay()
            torch.cuda.synchronize()
            out[b] = (time.perf_counter() - t0) / reps
        self.tables.zero_()
        self.lens.fill_(1)
        return out

    # ---- replay ------------------------------------------------------------------------------
    def run_decode(self, inp: DecodeRows, patch=None) -> torch.Tensor:
        """Logits of an all-decode step's rows (`inp.cols`: ids, positions, slots, context lengths)."""
        b = inp.cols.shape[1]
        dev = self.ids.device
        for buf, col in zip((self.ids, self.pos, self.slots), inp.cols[:3]):
            buf[:b].copy_(pinned(col, dev), non_blocking=True)
        self.lens[:b].copy_(pinned(inp.cols[3].astype(np.int32), dev), non_blocking=True)
        self.tables[:b, : inp.tables.shape[1]].copy_(pinned(inp.tables, dev), non_blocking=True)
        if patch is not None:
            patch(self.ids)
        if self.capture:
            graph, out, scores = self.decode[b]
            graph.replay()
        else:
            out, scores = self._decode_step(b)
        self.scores = None if scores is None else scores[: inp.num_rows]
        return out[: inp.num_rows]

    def run_pieces(self, inp: FlatBatch, meta: AttentionMetadata, patch=None) -> torch.Tensor:
        """Hidden states of a flat step's real rows: the pieces of its bucket, attention between."""
        n, t = len(inp.ids), inp.padded
        dev = self.ids.device
        self.ids[:n].copy_(pinned(inp.ids, dev), non_blocking=True)
        if patch is not None:
            patch(self.ids)
        self.pos[:n].copy_(pinned(inp.positions, dev), non_blocking=True)
        slots = np.full(t, -1, dtype=np.int64)
        slots[:n] = inp.slots
        self.piece_slots[:t].copy_(pinned(slots, dev), non_blocking=True)
        graphs = self.pieces.get(t)
        layers = self.model.num_layers
        for i in range(layers + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(t, i)
            if i < layers:
                k_cache, v_cache = self.kv_views[i]
                self.model.attention(i)(self.q[:n], None, None, k_cache, v_cache, meta, out=self.o[:n])
        return self.hidden[:n]


def piece_tokens(settings: RunnerSettings) -> int:
    """The largest token bucket (cuda_graph_max_tokens, at most the step budget)."""
    return max(16, min(settings.max_num_batched_tokens, settings.cuda_graph_max_tokens))


def decode_sizes(settings: RunnerSettings) -> list[int]:
    """Row counts the decode graphs are captured for: max_num_seqs, or while speculation is on
    the verification rows (k + 1 per request) up to the step budget."""
    top = settings.max_num_seqs
    spec = settings.spec
    if spec is not None:
        rows = min(top, spec.disable_by_batch_size) * (1 + spec.num_speculative_tokens)
        top = max(top, min(rows, settings.max_num_batched_tokens))
    sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16))
    return sorted(set(sizes + [top]))
