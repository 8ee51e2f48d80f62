"""Continuous batching with chunked prefill and preemption by recompute.

Every step has a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). There is no separate prefill or decode phase: each scheduled
request simply advances `num_computed_tokens` towards `num_tokens`, by one token
when decoding and by a chunk when prefilling. Order of a step:
  1. running requests, oldest first; if the pool is out of blocks, the newest
     running request is preempted (blocks freed, recomputed later) until it fits;
  2. waiting requests, FIFO, after a prefix-cache lookup, while budget and blocks last.
With scheduling_policy "priority" both queues are kept in (priority, arrival) order instead:
the victim is the last of that order, and a waiting request that finds no blocks preempts
running ones that come after it.
The scheduler holds integer block ids only, so it runs on CPU and in tests as is.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus

if TYPE_CHECKING:
    from ..base.kv_window import KVShift, KVWindow
    from ..settings import SchedulerSettings
    from ..tiers.offload import TierOps


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # draft tokens included
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)  # verified this step (spec/decode.py)
    num_accepted: int = 0  # of the drafts, set after the step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens (logits needed)."""
        n = self.num_new_tokens - len(self.draft_token_ids)
        return self.request.num_computed_tokens + n == self.request.num_tokens

    @property
    def prompt_positions(self) -> range:
        """The positions of this chunk whose logits score the next prompt token (position p
        gives prompt token p + 1's log-prob; prompt_logprobs), those not scored before."""
        req = self.request
        if not req.scoring_prompt:
            return range(0)
        start = req.num_computed_tokens
        end = min(start + self.num_new_tokens - len(self.draft_token_ids), req.num_prompt_tokens - 1)
        return range(max(start, len(req.prompt_logprobs) - 1), end)

    @property
    def decode_rows(self) -> bool:
        """One known token plus any drafts: each a row of the paged-decode kernel (the
        decode graphs' layout, exec/step_inputs.decode_inputs)."""
        return self.num_new_tokens - len(self.draft_token_ids) == 1


@dataclass(frozen=True)
class StepShape:
    """What a step carries, counted once: the step-time model (step_model.py) learns from it,
    and every question about a step's cost (the TPOT chunk, the prefill rate, speculation's
    off-switch) asks that model, so a verifying request is priced one way: 1 + d rows that
    each read the request's context."""

    decodes: int = 0  # decoding requests
    draft_rows: int = 0  # their verification rows beyond one each
    prefill_tokens: int = 0
    kv_tokens: int = 0  # context the decode rows read, summed over rows
    attn: float = 0.0  # prefill tokens x their mean context

    @property
    def rows(self) -> int:
        return self.decodes + self.draft_rows

    @property
    def all_decode(self) -> bool:
        return self.decodes > 0 and not self.prefill_tokens

    @classmethod
    def of(cls, scheduled: list[ScheduledRequest]) -> StepShape:
        decodes = drafts = prefill = kv = 0
        attn = 0.0
        for s in scheduled:
            r = s.request
            if s.decode_rows:  # one known token (+ drafts): rows of the decode layout (exec/graphs.py)
                decodes += 1
                drafts += len(s.draft_token_ids)
                kv += r.num_tokens * (1 + len(s.draft_token_ids))
            else:
                prefill += s.num_new_tokens
                attn += s.num_new_tokens * (r.num_computed_tokens + s.num_new_tokens // 2)
        return cls(decodes, drafts, prefill, kv, attn)


@dataclass
class SchedulerOutput:
    """One step, built once by the scheduler and read by everything that runs or prices it:
    the rows (`scheduled`: decode rows, their drafts, prefill chunks, each request carrying its
    sampling state), the host tier's copies to apply before the forward, its `shape` for the
    step-time model; the runner takes it whole (ModelRunner.execute)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    tier_ops: TierOps | None = None  # host-tier copies queued up to this step (tiers/offload.py)
    kv_shifts: list[KVShift] = field(default_factory=list)  # keys to rotate first (kv_window.py)

    @functools.cached_property
    def shape(self) -> StepShape:
        return StepShape.of(self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", window: KVWindow | None = None):
        self.kv = kv
        self.window = window  # sink + window eviction before each step (kv_window.py)
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @classmethod
    def of(cls, kv: KVCacheManager, settings: SchedulerSettings, window: KVWindow | None = None) -> Scheduler:
        """The engine's scheduler: its batch settings (the group alone, resolved) over `kv`."""
        return cls(kv, settings.max_num_seqs, settings.max_num_batched_tokens, settings.enable_chunked_prefill,
                   settings.scheduling_policy, window)

    # ---- queue management ------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._enqueue(self.waiting, request)

    def add_running(self, request: Request) -> None:
        """Admits a request whose first `num_computed_tokens` are already in its blocks
        (decode role: the KV arrived from a prefill worker)."""
        request.status = RequestStatus.RUNNING
        self._enqueue(self.running, request)

    def key(self, request: Request) -> tuple:
        """A request's place in every queue: arrival (fcfs), or priority then arrival."""
        if self.policy == "priority":
            return request.sampling_params.priority, request.arrival_time
        return (request.arrival_time,)

    def _enqueue(self, queue, request: Request, front: bool = False) -> None:
        """fcfs: at the back (`front`: a preempted request, at the front); priority: in key order,
        so `running[-1]` is always the preemption victim and `waiting[0]` the next admitted."""
        if self.policy != "priority":
            queue.appendleft(request) if front else queue.append(request)
            return
        k = self.key(request)
        i = next((i for i, r in enumerate(queue) if self.key(r) > k), len(queue))
        queue.insert(i, request)

    def finish(self, request: Request, status: RequestStatus, free: bool = True) -> None:
        """Removes a request wherever it is and (unless told not to) frees its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        if free:
            self.kv.free(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- the step --------------------------------------------------------------------------
    def schedule(self, prefill_cap: int | None = None) -> SchedulerOutput:
        """`prefill_cap`: at most this many prefill tokens in the step (decodes are not
        counted); None: only the step budget. The engine sets it from a TPOT target
        (step_model.py). A step that runs takes the host tier's queued copies with it (an
        empty one leaves them queued)."""
        out = self._schedule(prefill_cap)
        if out.scheduled and self.kv.host is not None:
            out.tier_ops = self.kv.host.take()
        return out

    def _schedule(self, prefill_cap: int | None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill_left = budget if prefill_cap is None else prefill_cap
        scheduled_running: list[Request] = []

        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_tokens >= req.max_tokens:  # its last token is still on the device (overlap.py)
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not req.is_decoding:
                num_new = min(num_new, prefill_left)
                if num_new <= 0:  # a chunk for a later step; the decodes behind it still run
                    i += 1
                    continue
                prefill_left -= num_new
            used = self._with_drafts(req, budget, out) if req.spec_tokens and req.is_decoding else 0
            if used:
                scheduled_running.append(req)
                budget -= used
                i += 1
                continue
            if self.window is not None:
                out.kv_shifts.extend(self.window.trim(self.kv, req))
            while True:
                blocks = self.kv.allocate_slots(req, num_new)
                if blocks is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if blocks is None:  # req itself was preempted; everything after it too
                break
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv.block_ids(req.request_id)))
            scheduled_running.append(req)
            budget -= num_new
            i += 1

        # 2. waiting requests, FIFO (preempted ones were put at the front)
        if out.preempted:
            return out  # the pool is full: admitting new work would thrash
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - req.num_computed_tokens - num_hit_tokens
            if num_new > min(budget, prefill_left):
                if not self.enable_chunked_prefill or prefill_left <= 0:
                    break
                num_new = min(budget, prefill_left)
            blocks = self.kv.allocate_slots(req, num_new, hits)
            while blocks is None and self._make_room_for(req, out):
                blocks = self.kv.allocate_slots(req, num_new, hits)
                budget = self.max_num_batched_tokens - out.num_tokens
            if blocks is None:
                break  # wait for blocks to free up; the queue's order keeps fairness
            self.waiting.popleft()
            self.kv.record_lookup(req.num_tokens, num_hit_tokens)
            req.num_computed_tokens += num_hit_tokens
            if req.status != RequestStatus.PREEMPTED:
                req.num_cached_tokens = num_hit_tokens
            req.scheduled_at = req.scheduled_at or time.time()
            req.status = RequestStatus.RUNNING
            self._enqueue(self.running, req)
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv.block_ids(req.request_id)))
            budget -= num_new
            prefill_left -= num_new
        return out

    def _with_drafts(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedules a decode with its draft tokens (verified in this step, spec/decode.py)
        when they fit the budget and the pool without preempting; else drops the drafts
        (0: schedule it plainly)."""
        n = 1 + len(req.spec_tokens)
        blocks = self.kv.allocate_slots(req, n) if n <= budget else None
        if blocks is None:
            req.spec_tokens = []
            return 0
        out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id), list(req.spec_tokens)))
        return n

    def _make_room_for(self, req: Request, out: SchedulerOutput) -> bool:
        """priority: a waiting request that finds no blocks preempts the last running request
        when that one comes after it (a larger priority value, or the same and a later arrival),
        dropping it from this step. Whether a victim was found."""
        if self.policy != "priority" or not self.running or self.key(self.running[-1]) <= self.key(req):
            return False
        victim = self.running[-1]
        out.scheduled = [s for s in out.scheduled if s.request is not victim]
        self._preempt(victim)
        out.preempted.append(victim)
        return True

    def _preempt(self, req: Request) -> None:
        req.spec_tokens = []
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = req.kv_shift = 0
        req.kv_scores = req.kv_scores[:0]
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(self.waiting, req, front=True)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advances progress and publishes newly full blocks to the prefix cache. A step with
        drafts keeps the KV of its accepted ones only: the rejected drafts' blocks are freed."""
        for s in out.scheduled:
            if s.request.finished:  # ended by the step before it (overlap.py): its row was wasted
                continue
            s.request.num_computed_tokens += s.num_new_tokens - len(s.draft_token_ids) + s.num_accepted
            if s.draft_token_ids:
                s.request.spec_tokens = []
                self.kv.rollback(s.request, s.request.num_computed_tokens + 1)
            self.kv.cache_blocks(s.request, s.request.num_computed_tokens)
