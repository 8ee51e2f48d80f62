"""Turns a scheduled batch into tensors, runs the model, samples.

The flat batch: every scheduled request contributes `num_new_tokens` consecutive
tokens (a prefill chunk, one decode token, or one plus its drafts). Single-token
sequences are ordered first so attention sends them through the paged-decode kernel in
one launch, the rest through the paged-prefill kernel. Only sequences whose chunk
reaches the end of their known tokens produce logits.

    execute(step):       _prepare (order -> host_inputs: StepInputs, with the step's path)
                         -> forward (decode graph | pieces | eager) -> sample / verify
                         (and score the prompt tokens of requests that ask: prompt_logprobs)
                         -> StepResult (step_result.py)
    launch(step, rows):  the same _prepare and forward, sampled on the device (core/overlap.py)

Which path a step takes is one decision (graphs.StepGraphs.route): an all-decode step
(speculative verification rows included) replays a decode graph; any other step up to
512 tokens (`cuda_graph_max_tokens`) replays the piecewise graphs of its token bucket with attention between;
larger steps, and every step without graphs, run eagerly. On CPU,
`use_graph_layouts()` runs both graph layouts without capturing (tests).

Tensor parallel (engine/base/tp.py): rank 0's runner builds a step's host inputs (`StepInputs`:
numpy arrays, cheap to pickle), sends them to the shards and runs `forward` on them; each
shard's runner receives them and runs the same `forward` (shard.py). Only rank 0 samples.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import numpy as np
import torch

from ..base.host_to_device import to_device
from ..base.kv_layout import kv_layout
from ..base.kv_window import add_scores, rotate_keys
from ..base.tp import TPGroup
from ..core.request import PENDING, Request
from ..core.scheduler import ScheduledRequest, SchedulerOutput, StepShape
from ..models.attention import AttentionMetadata, AttentionPlanner
from ..sample.sampler import Sampler
from ..sampling_params import SamplingParams
from ..stats import StartupTimes
from ..tiers.offload import HostCache, host_slots
from . import step_inputs
from .graphs import StepGraphs, piece_tokens
from .kv_cache import activation_bytes, allocate_kv_cache, check_decode_room, layer_views, num_kv_blocks
from .loader import load_model
from .runner_settings import RunnerSettings
from .step_inputs import FlatBatch, StepInputs, StepPath
from .step_result import StepResult


class ModelRunner:
    def __init__(self, settings: RunnerSettings, load_format: str = "auto", tp: TPGroup | None = None,
                 grammars=None, startup: StartupTimes | None = None):
        """Loads the weights, allocates the KV cache, captures the graphs and warms the kernels (CUDA).
        `settings`: what it reads (`RunnerSettings.of(config)`, runner_settings.py). `tp`: this
        rank's group (connected). `grammars`: the engine's structured.Grammars (rank 0).
        `startup`: the times of what ran before it (the TP ranks), which it completes."""
        self.settings = settings
        self.tp = tp or TPGroup()
        self.device = settings.torch_device
        self.block_size = settings.block_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # SDPA's cuDNN backend builds an execution plan for every new sequence length
            # (measured on H200, torch 2.11: 74 ms on an unseen length vs 1 ms for flash;
            # bench/results/prefill_shapes.md); served prompts rarely repeat a length
            torch.backends.cuda.enable_cudnn_sdp(False)
        t0 = time.perf_counter()
        self.model = load_model(settings, load_format, self.tp)
        window = settings.window
        self.planner = AttentionPlanner.of_model(self.model, settings.attention_tuning, settings.use_triton,
                                                 scoring=window is not None and window.scores)
        self.step_scores: torch.Tensor | None = None  # the last forward's attention mass per block (scoring)
        self.startup = dataclasses.replace(startup or StartupTimes(), load_s=time.perf_counter() - t0)
        # every rank holds the same block ids: the count the fullest GPU allows
        graphs = (self.device.type == "cuda" and settings.use_triton and not settings.enforce_eager
                  and self.model.attention(0).capturable)
        scratch = activation_bytes(settings, piece_tokens(settings) if graphs else 0)
        self.layout = kv_layout(settings)  # one rank's blocks: what the wire check and the tiers see
        self.num_blocks = self.tp.min_int(num_kv_blocks(settings.cache, self.layout, self.device, scratch))
        check_decode_room(settings.cache, settings.max_num_seqs, self.num_blocks)  # each rank refuses alike
        self.kv = allocate_kv_cache(self.layout, self.num_blocks, self.device)  # see kv_cache.py for the layout
        self.kv_views = layer_views(self.kv, settings.kv_cache_dtype)
        self.host = None  # the host tier's buffer on this rank (tiers/offload.py)
        if settings.kv_offloading_size:
            self.host = HostCache(self.kv, self.num_host_slots)
        self.sampler = Sampler(self.device, grammars)
        self.last_tokens: torch.Tensor | None = None  # the last launch's sampled ids, on the device
        self.graphs: StepGraphs | None = None  # None: every step eager
        t0 = time.perf_counter()
        if graphs:
            self.graphs = StepGraphs(self.model, self.kv_views, settings, self.num_blocks, self.planner)
            self.startup.graphs_s = time.perf_counter() - t0
        if self.device.type == "cuda" and settings.use_triton:
            t0 = time.perf_counter()
            self.warm_up()
            self.startup.warm_up_s = time.perf_counter() - t0

    def close(self) -> None:
        """After the last step, a tensor-parallel rank's graphs and groups: the graphs are
        destroyed first (on 2x H200 the NCCL abort waited forever while graphs that captured
        its kernels lived), then the groups torn down (and kept: tp.GRAVEYARD)."""
        if self.tp.size > 1:
            self.graphs = None
            if self.device.type == "cuda":
                gc.collect()  # the graphs go before the communicators: an abort waited on live ones
                torch.cuda.synchronize(self.device)
            self.tp.close()

    def use_graph_layouts(self) -> None:
        """Runs every step in the graphs' layouts without capturing (the GPU path on CPU)."""
        self.graphs = StepGraphs(self.model, self.kv_views, self.settings, self.num_blocks, self.planner,
                                 capture=False)

    @property
    def queues_steps(self) -> bool:
        """`launch` queues its step on the device and returns (CUDA); False: it runs it (CPU)."""
        return self.device.type == "cuda"

    @property
    def graph_seconds(self) -> dict[int, float]:
        """Rows -> seconds per decode-graph replay (timed at start when speculation is configured;
        core/step_model.py)."""
        return self.graphs.decode_seconds if self.graphs else {}

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Before serving, runs what a served step can launch that the graphs' capture did not,
        so that no step waits on a Triton compile (a second or more per variant on the serving
        host; a fresh H100 host's first colocated requests waited seconds): every attention
        kernel variant (PagedAttention.warm_up; every layer shares them), then eager steps,
        decodes beside a chunk and a chunk alone, of a token count with and without a factor of
        16 (Triton specializes the fused kernels' int arguments on that). Every rank runs the
        same steps, so their all-reduces pair up. Dummy requests over block 0; nothing is
        written (slots -1) or sampled. On CUDA also the same-node handoff's block copy (ops/block_copy.py:
        whole blocks, and a head slice as tensor-parallel routes take), block 0 onto itself: its first
        compile otherwise lands on a worker's first handoff."""
        self.model.attention(0).warm_up(*self.kv_views[0], self.settings.torch_dtype, self.planner.scoring)
        if self.device.type == "cuda":
            from ..ops.block_copy import copy_blocks

            block0 = torch.zeros(1, dtype=torch.int64, device=self.device)
            for heads in (None, (0, 1)) if self.kv.shape[4] > 1 else (None,):
                copy_blocks(self.kv, block0, self.kv, block0, heads, heads)
        first = (self.graphs.max_piece_tokens if self.graphs else 0) + 16  # the smallest eager step
        for t in (first, first + 1):
            for q_lens, seq_lens in (([1, 1, t - 2], [24, 40, t + 62]), ([t], [t + 64])):
                if t <= self.settings.max_num_batched_tokens and max(seq_lens) <= self.settings.max_model_len:
                    self.forward(self._dummy_inputs(q_lens, seq_lens))

    @torch.inference_mode()
    def calibration(self, repeats: int = 2) -> list[tuple[StepShape, float]]:
        """Rank 0, after warm_up: timed dummy steps of the shapes serving meets (decode batches
        replaying their graphs, decodes beside prefill chunks, chunks alone) for the step-time
        model to fit before the first request (core/step_model.py): (the step's shape, seconds).
        Every rank runs them (the shards receive them as steps). Nothing is written or sampled."""
        bt, seqs = self.settings.max_num_batched_tokens, self.settings.max_num_seqs
        ctx = min(512, self.settings.max_model_len // 2)
        decodes = sorted({d for d in (1, 8, 32, 64) if d <= seqs})
        chunks = sorted({c for c in (128, 256, 1024, 2048, bt) if 64 <= c <= min(bt, self.settings.max_model_len)})
        mixed = [(d, c) for d in (0, *decodes[:2]) for c in chunks if d + c <= bt]
        shapes = [([1] * d, [ctx] * d) for d in decodes] + [([1] * d + [c], [ctx] * d + [c]) for d, c in mixed]
        out, t_start = [], time.perf_counter()
        for q_lens, seq_lens in shapes * max(repeats, -(-8 // max(len(mixed), 1))):  # >= 8 with prefill: fitted
            inp = self._dummy_inputs(q_lens, seq_lens)
            batch = self._dummy_batch(q_lens, seq_lens)
            self.tp.send(inp)
            self._sync()
            t0 = time.perf_counter()
            self.forward(inp)
            self._sync()
            out.append((StepShape.of(batch), time.perf_counter() - t0))
        self.startup.calibrate_s = time.perf_counter() - t_start
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _dummy_batch(self, query_lens: list[int], seq_lens: list[int]) -> list[ScheduledRequest]:
        batch = []
        for i, (q, ctx) in enumerate(zip(query_lens, seq_lens)):
            req = Request(f"warm-up-{i}", [0] * ctx, SamplingParams(max_tokens=1))
            req.num_computed_tokens = ctx - q
            batch.append(ScheduledRequest(req, q, [0] * -(-ctx // self.block_size)))
        return batch

    def _dummy_inputs(self, query_lens: list[int], seq_lens: list[int]) -> StepInputs:
        """A step's inputs for requests of these query and context lengths, every block 0,
        storing nothing."""
        inp = self.host_inputs(self.order(self._dummy_batch(query_lens, seq_lens)))
        inp.store_nothing()
        return inp

    # ---- one step ----------------------------------------------------------------------
    def order(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        return sorted(scheduled, key=lambda s: s.num_new_tokens != 1)

    def host_inputs(self, batch: list[ScheduledRequest]) -> StepInputs:
        """Rank 0: the step's path and its inputs as numpy arrays (step_inputs.py)."""
        path = self.graphs.route(batch) if self.graphs else StepPath.EAGER
        padded = self.graphs.padded(path, sum(s.num_new_tokens for s in batch)) if path != StepPath.EAGER else 0
        return step_inputs.build(batch, path, padded, self.block_size,
                                 self.graphs.table_width if path == StepPath.DECODE else 0)

    @property
    def num_host_slots(self) -> int:
        return host_slots(self.settings.kv_offloading_size, self.layout.block_bytes)

    @torch.inference_mode()
    def forward(self, inp: StepInputs) -> torch.Tensor | None:
        """Every rank: runs the step; the logits of its sampling rows (None if none)."""
        if inp.tier_ops is not None:
            self.host.apply(self.kv, inp.tier_ops)
        if inp.kv_shifts:
            rotate_keys(self.kv_views, self.model.rotary, inp.kv_shifts)
        patch = self._patcher(inp.pending)
        if inp.path == StepPath.DECODE:
            logits = self.graphs.run_decode(inp, patch)
            self.step_scores = self.graphs.scores
            if len(inp.sample_rows) == inp.num_rows:
                return logits
            return logits[to_device(inp.sample_rows, logits.device)] if len(inp.sample_rows) else None
        meta = AttentionMetadata.build(inp.slots, inp.tables, inp.seq_lens, inp.query_lens, self.device, self.planner)
        self.step_scores = meta.scores
        if inp.path == StepPath.PIECES:
            hidden = self.graphs.run_pieces(inp, meta, patch)
        else:
            ids, positions = (to_device(a, self.device) for a in (inp.ids, inp.positions))
            if patch is not None:
                patch(ids)
            hidden = self.model(ids, positions, self.kv_views, meta)
        rows = np.concatenate([inp.sample_rows, inp.prompt_rows]) if len(inp.prompt_rows) else inp.sample_rows
        if not len(rows):
            return None
        return self.model.compute_logits(hidden[to_device(rows, self.device)])

    def _patcher(self, pending: tuple[np.ndarray, np.ndarray] | None):
        """What writes the pending input tokens into a step's device ids: row dst gets the
        previous launch's sampled token src (None: no row is pending)."""
        if pending is None or not len(pending[0]):
            return None
        dst, src = (to_device(a, self.device) for a in pending)
        if self.tp.size > 1:  # the shards sample nothing: rank 0's ids reach them on the device, in order
            picked = self.last_tokens[src].to(torch.int64) if self.tp.rank == 0 else \
                torch.empty(len(pending[0]), dtype=torch.int64, device=self.device)
            tokens, src = self.tp.broadcast(picked), torch.arange(len(pending[0]), device=self.device)
        else:
            tokens = self.last_tokens

        def patch(ids: torch.Tensor) -> None:
            ids[dst] = tokens[src].to(ids.dtype)
        return patch

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput, pending_rows: dict[str, int]) -> tuple[torch.Tensor | None, list]:
        """The overlapped step (core/overlap.py): runs `step` without waiting for it. Returns the
        sampled token ids on the device and the requests they belong to, in order. A row whose
        input is PENDING reads it from the previous launch's tokens (`pending_rows`: request id
        -> its row there). Requests here need nothing from the host between steps (overlap.plain)."""
        batch, inp = self._prepare(step)
        ids = inp.ids
        dst, src, row = [], [], 0
        for s in batch:  # only a request's newest token can be pending: its one decode row
            row += s.num_new_tokens
            if ids[row - 1] == PENDING:
                dst.append(row - 1)
                src.append(pending_rows[s.request.request_id])
        if int((ids == PENDING).sum()) != len(dst):
            raise RuntimeError("a pending token outside a decode row")
        inp.pending = (np.array(dst, np.int64), np.array(src, np.int64))
        self.tp.send(inp)  # the shards run the same forward (tensor parallel; no-op alone)
        logits = self.forward(inp)
        reqs = [s.request for s in batch if s.samples]
        self.last_tokens = self.sampler.sample_on_device(logits, reqs) if reqs else None
        return self.last_tokens, reqs

    def _prepare(self, step: SchedulerOutput) -> tuple[list[ScheduledRequest], StepInputs]:
        """The preparation execute and launch share: the batch in kernel order, its host inputs
        with the host tier's copies and the key rotations the step carries, the sampler's
        per-step records cleared."""
        self.sampler.logprobs, self.sampler.prompt_logprobs = {}, {}
        batch = self.order(step.scheduled)
        inp = self.host_inputs(batch)
        inp.tier_ops, inp.kv_shifts = step.tier_ops, step.kv_shifts
        return batch, inp

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        """Runs the step (after the host tier's copies it carries) and samples; its StepResult."""
        stale = next((s.request.request_id for s in step.scheduled if s.request.all_token_ids[-1] == PENDING), None)
        if stale is not None:  # its id is still on the device: a step of the engine's is in flight
            raise RuntimeError(f"request {stale}'s newest token is not known yet (an overlapped step is in flight): "
                               "call LLMEngine.resolve() before running a step the engine did not schedule itself")
        batch, inp = self._prepare(step)
        self.tp.send(inp)  # the shards run the same forward (tensor parallel; no-op alone)
        logits = self.forward(inp)
        if self.step_scores is not None:
            add_scores(batch, self.step_scores)
        samplers = [s for s in batch if s.samples]
        if isinstance(inp, FlatBatch) and len(inp.prompt_rows):
            n = len(inp.sample_rows)
            self.sampler.score_prompts(logits[n:], [s for s in batch if s.prompt_positions])
            logits = logits[:n] if n else None
        if logits is None:
            tokens = {}
        elif any(s.draft_token_ids for s in samplers):
            tokens = self._verify(logits, samplers)
        else:
            reqs = [s.request for s in samplers]
            tokens = dict(zip([r.request_id for r in reqs], self.sampler(logits, reqs)))
        dead = {s.request.request_id: self.sampler.grammars.dead_ends(s.request.request_id) for s in samplers
                if s.request.sampling_params.structured_outputs and s.request.request_id in tokens}
        return StepResult(tokens, self.sampler.logprobs, self.sampler.prompt_logprobs,
                          {rid: why for rid, why in dead.items() if why is not None})

    def _verify(self, logits: torch.Tensor, samplers: list[ScheduledRequest]) -> dict:
        """A batch with draft tokens: plain rows sample as usual; each request with drafts gets
        the list of tokens its verification produced."""
        out, plain, row = {}, [], 0
        argmax = logits.argmax(dim=-1).tolist()  # one sync for every greedy verification
        for s in samplers:
            n = 1 + len(s.draft_token_ids)
            if s.draft_token_ids:
                out[s.request.request_id] = self.sampler.verify(logits[row:row + n], s.draft_token_ids, s.request,
                                                                argmax[row:row + n])
            else:
                plain.append((s, row))
            row += n
        if plain:
            rows = to_device([r for _, r in plain], logits.device, torch.int64)
            reqs = [s.request for s, _ in plain]
            out.update(zip([r.request_id for r in reqs], self.sampler(logits[rows], reqs)))
        return out

