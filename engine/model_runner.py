"""Turns a scheduled batch into tensors, runs the model, samples.

The flat batch: every scheduled request contributes `num_new_tokens` consecutive
tokens (a prefill chunk or one decode token). Single-token sequences are ordered
first so attention can send them through the paged-decode kernel in one launch.
Only sequences whose chunk reaches the end of their known tokens produce logits.

On CUDA, all-decode steps replay CUDA graphs captured at start for padded batch
sizes (1, 2, 4, 8, 16, 32, ...): a decode step of an 8B model launches ~800 kernels,
and launching them from Python costs more than running them. Padding rows store
nothing (slot -1) and attend to one token of block 0; their logits are dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from .attention import AttentionMetadata
from .config import EngineConfig
from .kv_cache import allocate_kv_cache, kv_layout, layer_views, num_kv_blocks
from .loader import load_model
from .sampler import Sampler
from .scheduler import ScheduledRequest


class ModelRunner:
    def __init__(self, config: EngineConfig, load_format: str = "auto"):
        self.config = config
        self.device = config.torch_device
        self.block_size = config.block_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # SDPA's cuDNN backend builds an execution plan for every new sequence length
            # (measured on H200, torch 2.11: 74 ms on an unseen length vs 1 ms for flash;
            # bench/results/prefill_shapes.md); served prompts rarely repeat a length
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.model = load_model(config, load_format)
        self.num_blocks = num_kv_blocks(config, self._activation_bytes())
        self.kv = allocate_kv_cache(config, self.num_blocks)  # see kv_cache.py for the layout
        self.kv_views = layer_views(self.kv)
        self.layout = kv_layout(config)
        self.sampler = Sampler(self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.split_mixed = False  # see execute()
        if self.device.type == "cuda" and config.use_triton and not config.enforce_eager:
            self.capture_graphs()

    def _activation_bytes(self) -> int:
        """A bound on forward-pass scratch memory, kept out of the KV budget on GPU."""
        mc, c = self.config.model_config, self.config
        elem = torch.empty((), dtype=c.torch_dtype).element_size()
        t = c.max_num_batched_tokens
        per_token = (2 * mc.intermediate_size * 2 + mc.hidden_size * 6
                     + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim * 2)
        logits = c.max_num_seqs * mc.vocab_size * 4 * 3
        return int(1.2 * (t * per_token * elem + logits)) + (256 << 20)

    # ---- one step ----------------------------------------------------------------------
    def order(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        return sorted(scheduled, key=lambda s: s.num_new_tokens != 1)

    def prepare(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens, query_lens, sample_rows = [], [], []
        max_blocks = max(len(s.block_ids) for s in batch)
        tables = np.zeros((len(batch), max_blocks), dtype=np.int32)
        num_decodes = 0
        for i, s in enumerate(batch):
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            input_ids += req.all_token_ids[start : start + n]
            pos = range(start, start + n)
            positions += pos
            slots += [s.block_ids[p // bs] * bs + p % bs for p in pos]
            seq_lens.append(start + n)
            query_lens.append(n)
            tables[i, : len(s.block_ids)] = s.block_ids
            if n == 1 and num_decodes == i:
                num_decodes += 1
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
        dev = self.device
        nb = dev.type == "cuda"
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=nb),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=nb),
            seq_lens=seq_lens,
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=nb),
            query_lens=query_lens,
            num_decodes=num_decodes,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=nb)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=nb)
        rows = torch.tensor(sample_rows, dtype=torch.int64).to(dev, non_blocking=nb)
        return ids, pos_t, meta, rows

    # ---- CUDA graphs for decode ---------------------------------------------------------
    def graph_sizes(self) -> list[int]:
        top = self.config.max_num_seqs
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

    def _replay(self, batch: list[ScheduledRequest]) -> torch.Tensor | None:
        """Logits of an all-decode batch through a captured graph (None: run eagerly)."""
        n = len(batch)
        if not self.graphs or n > max(self.graphs) or any(s.num_new_tokens != 1 for s in batch):
            return None
        b = min(k for k in self.graphs if k >= n)
        cols, tables = decode_inputs(batch, b, self.block_size, self.g_tables.shape[1])
        self.g_ids[:b].copy_(torch.from_numpy(cols[0]), non_blocking=True)
        self.g_pos[:b].copy_(torch.from_numpy(cols[1]), non_blocking=True)
        self.g_slots[:b].copy_(torch.from_numpy(cols[2]), non_blocking=True)
        self.g_lens[:b].copy_(torch.from_numpy(cols[3].astype(np.int32)), non_blocking=True)
        self.g_tables[:b].copy_(torch.from_numpy(tables), non_blocking=True)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        """Runs the batch; returns the sampled token of each request that samples. With
        `split_mixed` and CUDA graphs, a batch of decodes and prefill chunks runs as two
        passes: the decodes through their graph, then the chunks eagerly."""
        if self.split_mixed and self.graphs:
            decodes = [s for s in scheduled if s.num_new_tokens == 1 and s.request.is_decoding]
            if decodes and len(decodes) < len(scheduled) and len(decodes) <= max(self.graphs):
                rest = [s for s in scheduled if not (s.num_new_tokens == 1 and s.request.is_decoding)]
                return {**self._execute(decodes), **self._execute(rest)}
        return self._execute(scheduled)

    def _execute(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        batch = self.order(scheduled)
        logits = self._replay(batch)
        samplers = [s for s in batch if s.samples]
        if logits is None:
            ids, positions, meta, rows = self.prepare(batch)
            hidden = self.model(ids, positions, self.kv_views, meta)
            if not samplers:
                return {}
            logits = self.model.compute_logits(hidden[rows])
        req_ids = [s.request.request_id for s in samplers]
        tokens = self.sampler(logits, [s.request.sampling_params for s in samplers], req_ids,
                              [s.request.banned_token_ids() for s in samplers])
        return dict(zip(req_ids, tokens))


def decode_inputs(batch: list[ScheduledRequest], padded: int, block_size: int,
                  max_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The host side of a graph replay: ([4, padded] int64 rows of token ids, positions,
    KV slots and context lengths; [padded, max_blocks] int32 block tables). Padding rows
    store nothing (slot -1) and attend to one token of block 0. Built in numpy: a per-row
    torch tensor costs tens of microseconds on the host, per step, while the GPU waits."""
    n = len(batch)
    cols = np.zeros((4, padded), dtype=np.int64)
    cols[2, n:] = -1
    tables = np.zeros((padded, max_blocks), dtype=np.int32)
    for i, s in enumerate(batch):
        p = s.request.num_computed_tokens
        cols[0, i] = s.request.all_token_ids[p]
        cols[1, i] = p
        cols[2, i] = s.block_ids[p // block_size] * block_size + p % block_size
        tables[i, : len(s.block_ids)] = s.block_ids
    cols[3] = cols[1] + 1
    return cols, tables
