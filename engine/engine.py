"""LLMEngine: requests in, outputs out, one step at a time.

    step():  schedule -> run -> postprocess
             (overlapped: schedule -> launch -> resolve the previous step -> advance; core/overlap.py)

add_request() validates (make_request; admit() for a request validated at the edge) and queues; step()
schedules a batch under the token budget, runs it, appends sampled tokens, detokenizes, applies stop
conditions and frees finished requests' blocks. Prefill and decode workers are roles of this engine
(pdserve.prefill / pdserve.decode): the same step, other request settings, a KV handoff around it."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time

from .assembly import assemble, calibrate
from .config import EngineConfig
from .core.iteration_stats import TokenHistogram, step_tokens
from .core.overlap import PendingStep, plain
from .core.request import Request, RequestStatus
from .core.scheduler import SchedulerOutput
from .core.step_model import placement_stats
from .exec.loader import resolve_model_path
from .exec.step_result import StepResult
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .stats import CacheConfigInfo, CacheStats, EngineStats, StepCost
from .tokenizer import IncrementalDetokenizer
from .validation import ValidRequest, check_capacity, check_request

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, load_format: str | None = None, launch_shards=None):
        """An engine serving `config`, resolved here against its model and device; its parts built
        in one pass (assembly.assemble: `launch_shards` starts a tensor-parallel engine's ranks)."""
        load_format = load_format or config.load_format
        config.resolve(resolve_model_path(config.model))
        self.config = config
        self.model_config = config.model_config
        self.load_format = load_format
        parts = assemble(config, load_format, launch_shards)
        self.tokenizer, self.tp, self.shards, self.grammars = parts.tokenizer, parts.tp, parts.shards, parts.grammars
        self.runner, self.kv, self.scheduler = parts.runner, parts.kv, parts.scheduler
        self.step_model, self.drafter = parts.step_model, parts.drafter
        self.tier_file, self.tiers = parts.tier_file, parts.tiers
        self.iteration_tokens = TokenHistogram()  # tokens per step (metrics)
        self.requests: dict[str, Request] = {}
        # prefill role: requests that finish normally keep their blocks until release()
        self.hold_blocks_on_finish, self.held = False, {}  # a prefill worker's prompts kept for their handoff
        # outputs carry only what is new since the previous one (outputs.py; the cluster's
        # workers stream these: no per-token copy of the whole text and token list)
        self.stream_deltas = False
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.pending: PendingStep | None = None  # the launched step not yet resolved (core/overlap.py)
        self._in_turn: set[str] = set()  # live requests that are not overlap.plain
        eos = {*self.model_config.eos_token_ids, self.tokenizer.eos_token_id} - {None}
        self.eos_token_ids = tuple(sorted(eos))

    # ---- requests ----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Validates a prompt and its sampling parameters (check_request; its caller is the edge)."""
        if (text := prompt if isinstance(prompt, str) else None) == "":
            raise ValueError("prompt is empty")
        token_ids = self.tokenize(prompt) if text is not None else list(prompt)
        valid = check_request(token_ids, params or SamplingParams(), self.config.max_model_len,
                              self.model_config.vocab_size, bounded=self.config.kv_window_tokens is None)
        return self.admit(valid, request_id, text)

    def admit(self, valid: ValidRequest, request_id: str | None = None, text: str | None = None) -> Request:
        """A request validated at the edge (check_request) as one of this engine's: checks only what
        it alone knows (its grammars, KV capacity, request ids); raises ValueError. Queues nothing."""
        params = valid.params
        if params.structured_outputs:
            self.grammars.check(params.structured_outputs)  # a bad grammar: refused now
        if params.n != 1:
            raise ValueError(f"n={params.n}: an engine request is one sequence; LLM.generate and the HTTP server "
                             "run n of them (SamplingParams.samples())")
        if self.config.kv_window_tokens is None:
            check_capacity(valid, self.kv.num_blocks * self.config.block_size)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        return Request(rid, valid.prompt_token_ids, params, text, self.eos_token_ids, max_tokens=valid.max_tokens)

    def add_request(self, prompt: str | list[int] | Request, params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        req = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._track(req)
        self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                             req.sampling_params.skip_special_tokens)
        if not self.tiers.hold(req):  # else its prefix comes up from a tier first (disk reads)
            self.scheduler.add(req)
        return req

    def _track(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if not plain(req):
            self._in_turn.add(req.request_id)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request wherever it is and frees its blocks. False if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.tiers.forget(request_id)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def release(self, request_id: str) -> bool:
        """Frees the blocks of a finished request held for a handoff (prefill role)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def admit_prefilled(self, req: Request) -> RequestOutput:
        """Decode role: `req` has its prompt's KV in its blocks and its first token
        appended; it joins the running batch and decodes from there."""
        self._track(req)
        det = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling_params.skip_special_tokens)
        self._detok[req.request_id] = det
        req.num_computed_tokens = req.num_prompt_tokens
        req.first_token_time = req.first_token_time or time.monotonic()
        delta = det.push(req.output_token_ids[-1])
        stopped = req.check_stop_token()
        delta = req.apply_stop_strings(delta)
        req.output_text += delta
        if stopped or req.status.finished:
            self._finish(req, req.status)
        else:
            self.scheduler.add_running(req)
        return self._output(req, delta, [req.output_token_ids[-1]])

    def close(self) -> None:
        """Persists the host tier (kv_persist_dir, or to its disk tier), stops a TP engine's shards;
        a second call is a no-op."""
        first, self._closed = not self.__dict__.get("_closed"), True
        try:
            if first and self.tier_file is not None:
                self.tier_file.close()
            if first:
                self.tiers.close()
        except OSError as e:
            log.warning("could not persist the host tier: %s", e)
        shards, self.shards = self.shards, None
        if shards is not None:
            with contextlib.suppress(Exception):  # a rank already gone: kill the rest
                self.tp.send(None)
            self.runner.close()  # with the shards' own teardown, which reading stop starts
            shards.close()

    def has_unfinished_requests(self) -> bool:  # a request whose last token is in flight is still running
        return self.scheduler.num_unfinished > 0 or bool(self.tiers.waiting)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        drafting = self.drafter.decide(self.scheduler.running)  # a step with drafts verifies on the host
        overlap = self.overlaps and not drafting
        done = [] if overlap else self.resolve()  # a step that cannot overlap waits for the one in flight
        sched = self._schedule()
        return done + ((self._launch(sched) if overlap else self._postprocess(sched, self._execute(sched)))
                       if sched else self.resolve())

    @property
    def overlaps(self) -> bool:
        """Whether the next step may run while the one in flight finishes (core/overlap.py): every
        live request plain, no drafts in it (step()), not a prefill worker (its KV handoff starts at
        the end of the step that wrote the KV, not one step later). Tensor parallel too: the shards
        take the previous step's ids from rank 0 on the device (model_runner._patcher)."""
        return self.config.async_scheduling and not self._in_turn and not self.hold_blocks_on_finish

    def _launch(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Overlapped (core/overlap.py): queues `sched`, then finishes the step before it (timed: its time on CUDA)."""
        timed = (self.pending.sched.shape if self.pending else None) if self.runner.queues_steps else sched.shape
        with self.step_model.timed(timed):
            rows = self.pending.rows if self.pending is not None else {}
            launched = PendingStep.start(sched, *self.runner.launch(sched, rows))
            outputs = self.resolve()
        self.iteration_tokens.observe(step_tokens(sched.scheduled))
        self.drafter.observe(sched.shape)
        self.scheduler.update_after_step(sched)
        launched.placeholders()
        self.pending = launched
        self.persist_if_due()
        return outputs

    def resolve(self) -> list[RequestOutput]:
        """The outputs of the step in flight once its ids reach the host ([] when none); a caller
        that drives the scheduler and runner itself resolves first (the runner refuses PENDING)."""
        step, self.pending = self.pending, None
        if step is None:
            return []
        tokens = step.tokens()
        return self._postprocess(step.sched, StepResult({k: v for k, v in tokens.items() if k in self.requests}))

    def _schedule(self) -> SchedulerOutput:
        """Drafts (speculative decoding), then the scheduler's batch under the step budget."""
        self.drafter.propose(self.scheduler.running)
        if self.tiers.waiting and not self.scheduler.num_unfinished:  # nothing else to run: wait, no spinning
            self.tiers.wait()
        for req in self.tiers.ready():  # their blocks are host hits now
            self.scheduler.add(req)
        return self.scheduler.schedule(self.step_model.prefill_cap(self.scheduler.running, self.scheduler.waiting))

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        """The host tier's copies and the forward pass; then the drafts' verdicts, progress
        (rolling back rejected drafts) and, on its interval, the host tier to disk."""
        with self.step_model.timed(sched.shape):
            result = self.runner.execute(sched)
        self.iteration_tokens.observe(step_tokens(sched.scheduled, result.tokens))
        self.drafter.settle(sched.scheduled, result.tokens)
        self.drafter.observe(sched.shape)
        self.scheduler.update_after_step(sched)
        self.persist_if_due()
        return result

    def persist_if_due(self) -> bool:
        """The persisted host tier on its interval (persist.HostTierFile.due); True if it wrote."""
        return self.tier_file is not None and self.tier_file.due()

    def persist_host_tier(self) -> str | None:
        """Writes the persisted host tier now (persist.HostTierFile.write): its index's path, or
        None where the directory took no writes."""
        return self.tier_file.write()

    @property
    def persist_status(self) -> str | None:
        """What restoring the host tier said (None without kv_persist_dir)."""
        return self.tier_file.status if self.tier_file is not None else None

    def retune(self, slo_tpot_s: float | None, max_num_batched_tokens: int | None = None) -> None:
        """Changes the TPOT target and the step budget at run time (a worker switching role).
        The budget never grows past the configured one (activation memory is sized for it);
        what the step model learned is kept."""
        self.step_model.slo_tpot_s = slo_tpot_s
        budget = min(max_num_batched_tokens or self.config.max_num_batched_tokens, self.config.max_num_batched_tokens)
        self.scheduler.max_num_batched_tokens = self.step_model.max_tokens = budget

    def _postprocess(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for s in sched.scheduled:
            req = s.request
            for entry, rank in result.prompt_logprobs.get(req.request_id, ()):
                req.prompt_logprobs.append(entry)
                req.prompt_ranks.append(rank)
            got = result.tokens.get(req.request_id)
            if got is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            if req.first_token_time is None:
                req.first_token_time = now
            text, ids = "", []
            dead = result.dead_ends.get(req.request_id)
            if dead is not None:  # nothing the grammar allows could be sampled: the request ends here
                req.stop_reason = dead
                self._finish(req, RequestStatus.FINISHED_INVALID)
                outputs.append(self._output(req, "", []))
                continue
            lp = result.logprobs.get(req.request_id)
            if lp is not None:  # one token per step for these (no drafts: sample/logits_process.py)
                req.output_logprobs.append(lp)
            for token in got if isinstance(got, list) else [got]:  # a list: verified drafts
                req.append_token(token)
                ids.append(token)
                delta = self._detok[req.request_id].push(token)
                stopped = req.check_stop_token()
                delta = req.apply_stop_strings(delta)
                if delta:
                    req.output_text += delta
                    text += delta
                if req.status.finished or stopped:
                    self._finish(req, req.status)
                    break
            outputs.append(self._output(req, text, ids))
        return outputs

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.drafter.forget(req.request_id)
        done = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        hold = self.hold_blocks_on_finish and done
        self.scheduler.finish(req, status, free=not hold)
        if hold:
            self.held[req.request_id] = req
        self.requests.pop(req.request_id, None)
        self._in_turn.discard(req.request_id)
        self._detok.pop(req.request_id, None)
        self.runner.sampler.forget(req.request_id)
        req.finished_time = time.monotonic()
        n = req.num_output_tokens
        if done and n >= 2 and req.first_token_time is not None:  # its TPOT here: the step model's margin follows
            self.step_model.observe_tpot((req.finished_time - req.first_token_time) / (n - 1))

    def _output(self, req: Request, delta: str, delta_ids: list[int]) -> RequestOutput:
        fin = req.status.finished
        text, ids, prompt_ids = (delta, delta_ids, []) if self.stream_deltas else \
            (req.output_text, list(req.output_token_ids), req.prompt_token_ids)
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = req.output_logprobs[len(req.output_logprobs) - len(ids):] if self.stream_deltas \
                else list(req.output_logprobs)
        comp = CompletionOutput(0, text, ids, finish_reason=req.status.finish_reason if fin else None,
                                stop_reason=req.stop_reason, logprobs=logprobs)
        metrics = RequestMetrics(req.arrival_time, req.first_token_time,
                                 req.finished_time, req.num_cached_tokens,
                                 req.num_preemptions, req.scheduled_at)
        first = len(ids) == req.num_output_tokens  # the output that brings the first token(s)
        scored = bool(req.prompt_logprobs) and (first or not self.stream_deltas)
        return RequestOutput(req.request_id, req.prompt, prompt_ids, [comp], fin,
                             req.num_cached_tokens, metrics, delta, delta_ids,
                             prompt_logprobs=list(req.prompt_logprobs) if scored else None,
                             prompt_ranks=list(req.prompt_ranks) if scored else None)

    # ---- counters for metrics ----------------------------------------------------------------
    def calibrate(self) -> None:
        """The step model fitted from the runner's timed calibration steps (assembly.calibrate: at
        start on CUDA; on CPU on demand)."""
        calibrate(self.step_model, self.runner)

    def stats(self) -> EngineStats:
        """Its counters now (engine/stats.py; `.as_dict()` is the row metrics print)."""
        kv, c, sched = self.kv, self.config, self.scheduler
        host = kv.host is not None
        cache = CacheStats(usage=kv.usage, prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
                           evicted_blocks=kv.pool.num_evicted,
                           config=CacheConfigInfo(block_size=c.block_size, cache_dtype=c.kv_cache_dtype,
                                                  num_gpu_blocks=kv.num_blocks,
                                                  num_cpu_blocks=kv.host.num_slots if host else 0,
                                                  enable_prefix_caching=c.enable_prefix_caching,
                                                  max_model_len=c.max_model_len),
                           host_hit_tokens=kv.host_hit_tokens if host else None,  # the host tier's hits in tokens
                           load_back_seconds=self.runner.host.load_seconds if host else None)
        return EngineStats.with_tiers(
            self.tiers.stats(), placement=placement_stats(self.step_model, sched), cache=cache,
            num_preemptions=sched.num_preemptions, num_decoding=sum(r.is_decoding for r in sched.running),
            decode_capacity=self.step_model.capacity_table(c.max_model_len, sched.max_num_seqs),
            tensor_parallel_size=self.tp.size, iteration_tokens=self.iteration_tokens.snapshot(),
            persist=self.tier_file.stats() if self.tier_file is not None else None,
            persist_status=self.persist_status, spec=self.drafter.stats(),
            step_cost=StepCost.of(self.step_model.coefficients(), len(self.step_model.decode_steps),
                                  len(self.step_model.mixed_steps)))
