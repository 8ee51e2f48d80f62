"""Turns a scheduled batch into tensors, runs the model, samples.

The flat batch: every scheduled request contributes `num_new_tokens` consecutive
tokens (a prefill chunk or one decode token). Single-token sequences are ordered
first so attention can send them through the paged-decode kernel in one launch.
Only sequences whose chunk reaches the end of their known tokens produce logits.
"""

from __future__ import annotations

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
        self.model = load_model(config, load_format)
        self.num_blocks = num_kv_blocks(config, self._activation_bytes())
        self.kv = allocate_kv_cache(config, self.num_blocks)  # see kv_cache.py for the layout
        self.kv_views = layer_views(self.kv)
        self.layout = kv_layout(config)
        self.sampler = Sampler(self.device)

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
        tables = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        num_decodes = 0
        for i, s in enumerate(batch):
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            input_ids += req.all_token_ids[start : start + n]
            pos = range(start, start + n)
            positions += pos
            slots += [s.block_ids[p // bs] * bs + p % bs for p in pos]
            seq_lens.append(start + n)
            query_lens.append(n)
            tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
            if n == 1 and num_decodes == i:
                num_decodes += 1
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
        dev = self.device
        nb = dev.type == "cuda"
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=nb),
            block_tables=tables.to(dev, non_blocking=nb),
            seq_lens=seq_lens,
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=nb),
            query_lens=query_lens,
            num_decodes=num_decodes,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=nb)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=nb)
        rows = torch.tensor(sample_rows, dtype=torch.int64).to(dev, non_blocking=nb)
        return ids, pos_t, meta, rows

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        """Runs the batch; returns the sampled token of each request that samples."""
        batch = self.order(scheduled)
        ids, positions, meta, rows = self.prepare(batch)
        hidden = self.model(ids, positions, self.kv_views, meta)
        samplers = [s for s in batch if s.samples]
        if not samplers:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        req_ids = [s.request.request_id for s in samplers]
        tokens = self.sampler(logits, [s.request.sampling_params for s in samplers], req_ids)
        return dict(zip(req_ids, tokens))
