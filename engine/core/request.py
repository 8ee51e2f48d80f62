"""The one `Request` that flows through router, scheduler, workers and transfer.

Progress is `num_computed_tokens` against `num_tokens` (prompt + generated). The
scheduler moves a request WAITING -> RUNNING -> FINISHED_*; preemption puts it back
in WAITING (status PREEMPTED) with its blocks freed, to be recomputed. Blocks are
integer ids owned by the KV-cache manager; a request never holds tensors.
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from ..sampling_params import SamplingParams

# A sampled token still on the device (the overlapped step, overlap.py): the last output token
# of a request between the step that samples it and the next, never seen outside the engine.
PENDING = -1


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_KV = 1  # decode role: blocks reserved, KV in flight from a prefill worker
    RUNNING = 2
    PREEMPTED = 3
    # everything at or after FINISHED_STOPPED is finished
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    FINISHED_INVALID = 8  # the request's own parameters cannot go on (not retried elsewhere)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
            RequestStatus.FINISHED_INVALID: "invalid",
        }.get(self)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    # effective cap on new tokens (sampling_params.max_tokens, or what max_model_len leaves)
    max_tokens: int = 16
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # tokens evicted between the sinks and the window (kv_window.py): a computed token's cache
    # position is its sequence index minus this (after the sinks)
    kv_shift: int = 0
    # heavy-hitter eviction (kv_window.py, kv_evict "h2o"): per block of the request's list, the attention
    # mass its tokens received so far (every layer, head and query; float64), added after each step
    kv_scores: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False)
    # prompt tokens found in the prefix cache when last admitted
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # per output token, {sampled id: log-prob, then the top N ids: log-probs} (sampling_params.logprobs)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # per prompt token (sampling_params.prompt_logprobs): None for the first, then {its id: log-prob,
    # the top N ids: log-probs} given the tokens before it; filled as its chunks run
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # each prompt token's rank (1: the likeliest)
    # draft tokens proposed for this step (speculative decoding, spec/decode.py)
    spec_tokens: list[int] = field(default_factory=list)
    # detokenizer state (owned by the engine's output processor)
    output_text: str = ""
    first_token_time: float | None = None
    finished_time: float | None = None
    scheduled_at: float | None = None  # when a step first took it (wall clock: metrics' queue time)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs, self.prompt_ranks = [None], [None]

    @functools.cached_property
    def sampling_row(self) -> tuple[float, ...]:
        """Its parameters as the sampler uploads them (SamplingParams.row), computed once."""
        return self.sampling_params.row()

    @property
    def scoring_prompt(self) -> bool:
        """Whether some prompt token's log-prob is still to be computed (prompt_logprobs)."""
        return 0 < len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def is_decoding(self) -> bool:
        """One token left to compute and some output already: a decode (else a prefill, or
        a preempted request's recompute)."""
        return self.num_tokens - self.num_computed_tokens == 1 and self.num_output_tokens > 0

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the next sample may not be: before `min_tokens` outputs, the EOS ids (unless
        ignore_eos) and the stop token ids, masked out of the logits as vLLM does, so the
        output cannot contain them (not merely go on past them)."""
        sp = self.sampling_params
        if self.num_output_tokens >= sp.min_tokens:
            return ()
        return (() if sp.ignore_eos else tuple(self.eos_token_ids)) + tuple(sp.stop_token_ids)

    def check_stop_token(self) -> bool:
        """Sets a finished status if the last token or the length ends the request."""
        sp = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in sp.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def apply_stop_strings(self, delta: str) -> str:
        """Finishes the request if a stop string appears; returns the delta cut before it."""
        stops = self.sampling_params.stop_strs
        if not stops or not delta:
            return delta
        text = self.output_text + delta
        search_from = max(0, len(self.output_text) - max(len(s) for s in stops) + 1)
        best = None
        for stop in stops:
            i = text.find(stop, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return delta
        i, stop = best
        end = i + len(stop) if self.sampling_params.include_stop_str_in_output else i
        self.status = RequestStatus.FINISHED_STOPPED
        self.stop_reason = stop
        return text[len(self.output_text):end] if end > len(self.output_text) else ""
