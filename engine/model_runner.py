"""Turns a scheduled batch into tensors, runs the model, samples.

The flat batch: every scheduled request contributes `num_new_tokens` consecutive
tokens (a prefill chunk or one decode token). Single-token sequences are ordered
first so attention can send them through the paged-decode kernel in one launch.
Only sequences whose chunk reaches the end of their known tokens produce logits.

On CUDA, all-decode steps replay CUDA graphs captured at start for padded batch
sizes (1, 2, 4, 8, 16, 32, ...): a decode step of an 8B model launches ~800 kernels,
and launching them from Python costs more than running them. Padding rows store
nothing (slot -1) and attend to one token of block 0; their logits are dropped.
A speculative step is an all-decode step too ("flat decode"): a request verifying
[last, d1..dk] is k+1 rows, row j at position p+j attending to its first p+j+1 tokens
through the same block table, so verification replays the same graphs and the same
paged-decode kernel as plain decoding (the KV of all k+1 tokens is stored before any
row attends). `flat_decode` sends such steps through this layout eagerly where there
are no graphs (CPU tests of the GPU path).

Tensor parallel (engine/tp.py): rank 0's runner builds a step's host inputs (`StepInputs`:
numpy arrays, cheap to pickle), sends them to the shards and runs `forward` on them; each
shard's runner receives them and runs the same `forward` (shard.py). Only rank 0 samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionMetadata
from .config import EngineConfig
from .kv_cache import activation_bytes, allocate_kv_cache, kv_layout, layer_views, num_kv_blocks
from .loader import load_model
from .offload import HostCache, TierOps, host_slots
from .sampler import Sampler
from .scheduler import ScheduledRequest
from .tp import TPGroup


@dataclass
class StepInputs:
    """A step's host-side inputs, the same on every rank. `graph`: an all-decode batch padded
    to a captured size (cols = decode_inputs' rows); else the eager flat batch."""

    graph: bool
    num_rows: int  # real rows (graph) / sequences (eager)
    tables: np.ndarray  # int32 [rows, max_blocks]
    cols: np.ndarray | None = None  # graph: int64 [4, padded] ids, positions, slots, context lengths
    ids: np.ndarray | None = None  # eager: int64 [T] each
    positions: np.ndarray | None = None
    slots: np.ndarray | None = None
    seq_lens: list | None = None
    query_lens: list | None = None
    num_decodes: int = 0
    sample_rows: np.ndarray | None = None  # int64 rows of the flat batch whose logits are needed
    tier_ops: TierOps | None = None  # host-tier copies to apply first (offload.py)


class ModelRunner:
    def __init__(self, config: EngineConfig, load_format: str = "auto", tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or TPGroup()
        self.device = config.torch_device
        self.block_size = config.block_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # SDPA's cuDNN backend builds an execution plan for every new sequence length
            # (measured on H200, torch 2.11: 74 ms on an unseen length vs 1 ms for flash;
            # bench/results/prefill_shapes.md); served prompts rarely repeat a length
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.model = load_model(config, load_format, self.tp)
        # every rank holds the same block ids: the count the fullest GPU allows
        self.num_blocks = self.tp.min_int(num_kv_blocks(config, activation_bytes(config)))
        self.kv = allocate_kv_cache(config, self.num_blocks)  # see kv_cache.py for the layout
        self.kv_views = layer_views(self.kv, config.kv_cache_dtype)
        self.layout = kv_layout(config)
        self.host = None  # the host tier's buffer on this rank (offload.py)
        if config.kv_offloading_size:
            self.host = HostCache(self.kv, self.num_host_slots)
        self.sampler = Sampler(self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.split_mixed = False  # see execute()
        self.graph_seconds: dict[int, float] = {}  # rows -> seconds per replay (with speculation)
        self.flat_decode = False  # all-decode steps in the graph layout without graphs (CPU tests)
        if self.device.type == "cuda" and config.use_triton and not config.enforce_eager:
            self.capture_graphs()

    # ---- one step ----------------------------------------------------------------------
    def order(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        return sorted(scheduled, key=lambda s: s.num_new_tokens != 1)

    def host_inputs(self, batch: list[ScheduledRequest]) -> StepInputs:
        """Rank 0: the step's inputs as numpy arrays (graph replay or the eager batch)."""
        n = len(batch)
        rows = sum(s.num_new_tokens for s in batch)
        if (self.graphs or self.flat_decode) and all(s.decode_rows for s in batch) \
                and rows <= max(self.graphs, default=rows):
            b = min((k for k in self.graphs if k >= rows), default=rows)
            width = self.g_tables.shape[1] if self.graphs else max(len(s.block_ids) for s in batch)
            cols, tables, sample_rows = decode_inputs(batch, b, self.block_size, width)
            return StepInputs(True, rows, tables, cols=cols, sample_rows=sample_rows)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens, query_lens, sample_rows = [], [], []
        tables = np.zeros((n, max(len(s.block_ids) for s in batch)), dtype=np.int32)
        num_decodes = 0
        for i, s in enumerate(batch):
            req, start, k = s.request, s.request.num_computed_tokens, s.num_new_tokens
            input_ids += req.all_token_ids[start : start + k - len(s.draft_token_ids)] + s.draft_token_ids
            pos = range(start, start + k)
            positions += pos
            slots += [s.block_ids[p // bs] * bs + p % bs for p in pos]
            seq_lens.append(start + k)
            query_lens.append(k)
            tables[i, : len(s.block_ids)] = s.block_ids
            if k == 1 and num_decodes == i:
                num_decodes += 1
            if s.samples:  # a step with drafts needs the logits at each of its k + 1 tokens
                sample_rows += range(len(input_ids) - 1 - len(s.draft_token_ids), len(input_ids))
        i64 = np.int64
        return StepInputs(False, n, tables, ids=np.array(input_ids, i64), positions=np.array(positions, i64),
                          slots=np.array(slots, i64), seq_lens=seq_lens, query_lens=query_lens,
                          num_decodes=num_decodes, sample_rows=np.array(sample_rows, i64))

    def prepare(self, inp: StepInputs):
        """The eager batch's device tensors and attention metadata."""
        dev = self.device
        nb = dev.type == "cuda"

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=nb)

        meta = AttentionMetadata(
            slot_mapping=put(inp.slots), block_tables=put(inp.tables), seq_lens=inp.seq_lens,
            seq_lens_t=torch.tensor(inp.seq_lens, dtype=torch.int32).to(dev, non_blocking=nb),
            query_lens=inp.query_lens, num_decodes=inp.num_decodes)
        return put(inp.ids), put(inp.positions), meta, put(inp.sample_rows)

    # ---- CUDA graphs for decode ---------------------------------------------------------
    def graph_sizes(self) -> list[int]:
        top = self.config.max_num_seqs
        spec = self.config.spec
        if spec is not None:  # verification rows: k + 1 per request while speculation is on
            rows = min(top, spec.disable_by_batch_size) * (1 + spec.num_speculative_tokens)
            top = max(top, min(rows, self.config.max_num_batched_tokens))
        sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16))
        return sorted(set(sizes + [top]))

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        sizes = self.graph_sizes()
        max_bs = sizes[-1]
        max_blocks = -(-self.config.max_model_len // self.block_size)
        dev = self.device
        self.g_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.g_pos = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.g_slots = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.g_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev)
        self.g_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(sizes):  # largest first: smaller graphs reuse its memory pool
            meta = AttentionMetadata(self.g_slots[:b], self.g_tables[:b], [1] * b, self.g_lens[:b], [1] * b, b)

            def run(b=b, meta=meta):
                h = self.model(self.g_ids[:b], self.g_pos[:b], self.kv_views, meta)
                return self.model.compute_logits(h)

            run()  # compiles the Triton kernels and warms up cuBLAS outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
        if self.config.spec is not None:
            self.graph_seconds = self.time_graphs()

    def time_graphs(self, reps: int = 5, context: int = 512) -> dict[int, float]:
        """Seconds one replay of each captured graph takes (the speculation cost model,
        spec_cost.py), every row attending to `context` tokens (capped by max_model_len): the
        weights', activations' and a typical row's KV cost by row count. With 1-token rows
        the table missed the KV reads, so until the step-time fit had seen both sizes it
        priced a speculative step too low: batch 32-64 with 0-30% acceptance speculated its
        first steps at a loss (bench/results/spec/). Nothing is written (slots -1)."""
        ctx = min(context, self.config.max_model_len)
        blocks = -(-ctx // self.block_size)
        self.g_tables[:, :blocks] = torch.arange(blocks, device=self.device, dtype=torch.int32) % self.num_blocks
        self.g_lens.fill_(ctx)
        out = {}
        for b, (graph, _) in sorted(self.graphs.items()):
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                graph.replay()
            torch.cuda.synchronize()
            out[b] = (time.perf_counter() - t0) / reps
        self.g_tables.zero_()
        self.g_lens.fill_(1)
        return out

    def _replay(self, inp: StepInputs) -> torch.Tensor:
        """Logits of an all-decode batch through its captured graph."""
        b = inp.cols.shape[1]
        self.g_ids[:b].copy_(torch.from_numpy(inp.cols[0]), non_blocking=True)
        self.g_pos[:b].copy_(torch.from_numpy(inp.cols[1]), non_blocking=True)
        self.g_slots[:b].copy_(torch.from_numpy(inp.cols[2]), non_blocking=True)
        self.g_lens[:b].copy_(torch.from_numpy(inp.cols[3].astype(np.int32)), non_blocking=True)
        self.g_tables[:b].copy_(torch.from_numpy(inp.tables), non_blocking=True)
        graph, out = self.graphs[b]
        graph.replay()
        return out[: inp.num_rows]

    def _flat_eager(self, inp: StepInputs) -> torch.Tensor:
        """The graph layout run eagerly (no graphs: `flat_decode` on CPU)."""
        dev, b = self.device, inp.num_rows
        ids, pos, slots, lens = (torch.from_numpy(c[:b]).to(dev) for c in inp.cols)
        meta = AttentionMetadata(slots, torch.from_numpy(inp.tables[:b]).to(dev), lens.tolist(),
                                 lens.to(torch.int32), [1] * b, b)
        return self.model.compute_logits(self.model(ids, pos, self.kv_views, meta))

    @property
    def num_host_slots(self) -> int:
        return host_slots(self.config.kv_offloading_size, self.layout.block_bytes)

    @torch.inference_mode()
    def forward(self, inp: StepInputs) -> torch.Tensor | None:
        """Every rank: runs the step; the logits of its sampling rows (None if none)."""
        if inp.tier_ops is not None:
            self.host.apply(self.kv, inp.tier_ops)
        if inp.graph:
            logits = self._replay(inp) if self.graphs else self._flat_eager(inp)
            if len(inp.sample_rows) == inp.num_rows:
                return logits
            return logits[torch.from_numpy(inp.sample_rows).to(logits.device)] if len(inp.sample_rows) else None
        ids, positions, meta, rows = self.prepare(inp)
        hidden = self.model(ids, positions, self.kv_views, meta)
        if not len(inp.sample_rows):
            return None
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], tier_ops: TierOps | None = None) -> dict[str, int]:
        """Runs the batch (after the host tier's copies); returns the sampled token of each
        request that samples. With `split_mixed` and CUDA graphs, a batch of decodes and
        prefill chunks runs as two passes: the decodes through their graph, then the
        chunks eagerly."""
        self.sampler.logprobs = {}  # the step's log-probs: both passes add theirs
        if self.split_mixed and self.graphs:
            decodes = [s for s in scheduled if s.decode_rows and s.request.is_decoding]
            if decodes and len(decodes) < len(scheduled) \
                    and sum(s.num_new_tokens for s in decodes) <= max(self.graphs):
                rest = [s for s in scheduled if not (s.decode_rows and s.request.is_decoding)]
                return {**self._execute(decodes, tier_ops), **self._execute(rest)}
        return self._execute(scheduled, tier_ops)

    def _execute(self, scheduled: list[ScheduledRequest], tier_ops: TierOps | None = None) -> dict[str, int]:
        batch = self.order(scheduled)
        inp = self.host_inputs(batch)
        inp.tier_ops = tier_ops
        self.tp.send(inp)  # the shards run the same forward (tensor parallel; no-op alone)
        logits = self.forward(inp)
        samplers = [s for s in batch if s.samples]
        if logits is None:
            return {}
        if any(s.draft_token_ids for s in samplers):
            return self._verify(logits, samplers)
        reqs = [s.request for s in samplers]
        return dict(zip([r.request_id for r in reqs], self.sampler(logits, reqs)))

    def _verify(self, logits: torch.Tensor, samplers: list[ScheduledRequest]) -> dict:
        """A batch with draft tokens: plain rows sample as usual; each request with drafts gets
        the list of tokens its verification produced."""
        out, plain, row = {}, [], 0
        argmax = logits.argmax(dim=-1).tolist()  # one sync for every greedy verification
        for s in samplers:
            n = 1 + len(s.draft_token_ids)
            if s.draft_token_ids:
                out[s.request.request_id] = self.sampler.verify(logits[row:row + n], s.draft_token_ids,
                                                                s.request.sampling_params, s.request.request_id,
                                                                argmax[row:row + n])
            else:
                plain.append((s, row))
            row += n
        if plain:
            rows = torch.tensor([r for _, r in plain], device=logits.device)
            reqs = [s.request for s, _ in plain]
            out.update(zip([r.request_id for r in reqs], self.sampler(logits[rows], reqs)))
        return out


def decode_inputs(batch: list[ScheduledRequest], padded: int, block_size: int,
                  max_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host side of a graph replay: ([4, padded] int64 rows of token ids, positions,
    KV slots and context lengths; [padded, max_blocks] int32 block tables; the rows whose
    logits are sampled). A request with drafts takes a row per query token, each with the
    request's table and its own context length. Padding rows store nothing (slot -1) and
    attend to one token of block 0. Built in numpy: a per-row torch tensor costs tens of
    microseconds on the host, per step, while the GPU waits."""
    cols = np.zeros((4, padded), dtype=np.int64)
    tables = np.zeros((padded, max_blocks), dtype=np.int32)
    sample_rows, i = [], 0
    for s in batch:
        p = s.request.num_computed_tokens
        ids = [s.request.all_token_ids[p]] + s.draft_token_ids
        n = len(ids)
        pos = np.arange(p, p + n)
        blocks = np.asarray(s.block_ids, dtype=np.int64)
        cols[0, i:i + n] = ids
        cols[1, i:i + n] = pos
        cols[2, i:i + n] = blocks[pos // block_size] * block_size + pos % block_size
        tables[i:i + n, : len(s.block_ids)] = s.block_ids
        if s.samples:
            sample_rows += range(i, i + n)
        i += n
    cols[2, i:] = -1
    cols[3] = cols[1] + 1
    return cols, tables, np.array(sample_rows, dtype=np.int64)
