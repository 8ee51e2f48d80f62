"""Speculative decoding: draft tokens proposed cheaply, verified by the target in one step.

    propose   before the schedule, each decoding request gets up to k draft tokens
              (`Request.spec_tokens`): ngram prompt lookup (the most recent earlier
              occurrence of its last n tokens, n from prompt_lookup_max down to
              prompt_lookup_min, and what followed it)
    schedule  the request's step carries [last token, d1..dk]: k+1 query tokens through
              paged attention on top of its cached context, KV slots for all of them
    verify    the target's logits at the k+1 positions: greedy keeps the drafts up to the
              first that is not the argmax, then the argmax there (or a bonus token after
              all k); sampled requests use rejection sampling (a draft d drawn with
              probability q(d) is kept with probability min(1, p(d) / q(d)), else the
              token comes from max(0, p - q) renormalized), which keeps the target's
              distribution exactly; ngram drafts are deterministic (q one-hot)
    rollback  the request's computed tokens advance by 1 + accepted drafts; the blocks the
              rejected drafts' KV slots took beyond that are freed, and only accepted full
              blocks get prefix-cache hashes (the rejected tokens never join the request)

Off-switch: a batch-size cap and, on CUDA, the engine's step-time model (switch.py).
"""

from __future__ import annotations

import time

from ..base.speculative import SpeculativeConfig
from ..sample.logits_process import one_token_steps
from ..stats import SpecStats
from .switch import SpecSwitch


def ngram_propose(tokens: list[int], k: int, nmax: int, nmin: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens
    (the longest n in [nmin, nmax] that occurs); [] if none does."""
    size = len(tokens)
    for n in range(min(nmax, size - 1), nmin - 1, -1):
        tail = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):  # most recent first, never the tail itself
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def decoding(running: list) -> tuple[list, float]:
    """The decoding requests of a batch and their mean context, in tokens."""
    decodes = [r for r in running if r.is_decoding]
    return decodes, sum(r.num_tokens for r in decodes) / max(1, len(decodes))


def load_draft(config: SpeculativeConfig | None, target=None):
    """The draft model's proposer (its weights and KV cache) where `config` names one, else None.
    `target`: the engine's EngineConfig (resolved). Built before the target's runner: the target's
    KV budget then counts the draft's memory (GPU)."""
    if config is None or config.method != "draft_model":
        return None
    from .draft import DraftModelProposer

    return DraftModelProposer(config.model, target, config.draft_kv_cache_memory_bytes)


class Drafter:
    """The engine's side of speculation: proposes drafts before a step, counts what the
    verification kept after it. A no-op without a config."""

    def __init__(self, config: SpeculativeConfig | None, max_model_len: int = 1 << 30, draft=None,
                 switch: SpecSwitch | None = None):
        """`draft`: a draft model's proposer (load_draft), None for ngram lookup. `switch`: the
        off-switch over the engine's step-time model (SpecSwitch(step_model)); None: one without
        a model (always speculates up to the batch cap)."""
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        # (request, room) -> draft tokens, instead of ngram lookup (benchmarks: a draft whose
        # acceptance is controlled)
        self.proposer = None
        self.num_drafts = 0  # requests that carried drafts into a step
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.steps_off = 0  # steps the batch size or the step-time model turned speculation off
        self.draft_seconds = 0.0  # in propose(): ngram lookup or the draft model's steps
        self.switch = switch or SpecSwitch()
        self._probe_from = 0  # the next probe's first request (probes rotate over the batch)
        self._drafting = False  # decide()'s answer for the coming step

    def decide(self, running: list) -> bool:
        """Before a step, before its schedule: whether it carries drafts (the batch cap and the
        off-switch's plan, switch.py, before any proposal's host time). A step without
        drafts is a plain step: the engine may overlap it (core/overlap.py) as it would without
        speculation. propose() follows the decision."""
        self._drafting = False
        if self.config is None:
            return False
        cfg = self.config
        decodes, context = decoding(running)
        if len(decodes) > cfg.disable_by_batch_size or \
                (decodes and not self.switch.plan(len(decodes), cfg.num_speculative_tokens, context)):
            self.steps_off += 1
            for r in decodes:  # drafts from an earlier step that did not run them go too
                r.spec_tokens = []
            return False
        self._drafting = bool(decodes)
        return self._drafting

    def propose(self, running: list) -> None:
        """The drafts of a step decide() said carries them (its newest tokens known by now)."""
        if self.config is None or not self._drafting:
            return
        t0 = time.perf_counter()
        self._propose(running)
        self.draft_seconds += time.perf_counter() - t0

    def _propose(self, running: list) -> None:
        cfg = self.config
        decodes, context = decoding(running)
        if not decodes:  # the step decide() saw in flight finished them all
            return
        rooms = [0 if one_token_steps(r) else  # bias, bans, penalties, log-probs: sample/logits_process.py
                 min(cfg.num_speculative_tokens, r.max_tokens - r.num_output_tokens - 1,
                     self.max_model_len - r.num_tokens - 1) for r in decodes]
        width = self.switch.probe_width(len(decodes))
        if width is not None:  # a probe while off: a rotating few draft (the estimate needs a sample)
            first, self._probe_from = self._probe_from % len(decodes), self._probe_from + width
            rooms = [room if (i - first) % len(decodes) < width else 0 for i, room in enumerate(rooms)]
        if self.draft is not None:
            drafts = self.draft.propose(decodes, rooms)
            for r in decodes:
                r.spec_tokens = drafts.get(r.request_id, [])
        else:
            for r, room in zip(decodes, rooms):
                if room <= 0:
                    r.spec_tokens = []
                elif self.proposer is not None:
                    r.spec_tokens = list(self.proposer(r, room))[:room]
                else:
                    r.spec_tokens = ngram_propose(r.all_token_ids, room, cfg.prompt_lookup_max,
                                                  cfg.prompt_lookup_min)
        if any(r.spec_tokens for r in decodes) and \
                not self.switch.pays([len(r.spec_tokens) for r in decodes], context):
            self.steps_off += 1
            for r in decodes:
                r.spec_tokens = []

    def forget(self, request_id: str) -> None:
        """The request ended: the draft model's copy of it goes."""
        if self.draft is not None:
            self.draft.forget(request_id)

    def observe(self, shape) -> None:
        """A step ran (shape: scheduler.StepShape): the off-switch's probe counters."""
        if shape.all_decode:
            self.switch.stepped(shape.draft_rows > 0)

    def settle(self, scheduled: list, tokens: dict) -> None:
        """Records each verified request's accepted drafts (the scheduler rolls back the rest)."""
        verified = [s for s in scheduled if s.draft_token_ids]
        for s in verified:
            s.num_accepted = max(0, len(tokens.get(s.request.request_id, [])) - 1)
            self.num_drafts += 1
            self.num_draft_tokens += len(s.draft_token_ids)
            self.num_accepted_tokens += s.num_accepted
        if verified:
            self.switch.verified([s.num_accepted for s in verified], [len(s.draft_token_ids) for s in verified])

    def stats(self) -> SpecStats | None:
        if self.config is None:
            return None
        return SpecStats(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                         num_accepted_tokens=self.num_accepted_tokens, steps_off=self.steps_off,
                         draft_seconds=self.draft_seconds)
