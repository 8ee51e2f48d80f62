"""vLLM-shaped results: `RequestOutput.outputs[0].text / .token_ids`.

An engine produces cumulative outputs (vLLM's default) or, with `stream_deltas` (the
cluster's workers), delta outputs: each carries only the text and token ids added since
the previous one, so a long generation costs O(1) per token to move; `Accumulator`
rebuilds the cumulative view where one is needed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {sampled id: log-prob, top ids: ...}
    # "stop" | "length" | "abort" | "error" (a worker failed: retried elsewhere while nothing has
    # been streamed) | "invalid" (the request's own parameters cannot go on: never retried)
    finish_reason: str | None = None
    # the stop token id or stop string that ended it; for "error" / "invalid", why (an "invalid"
    # reason begins with the parameter's name: "structured_outputs: ...")
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    scheduled_at: float | None = None  # when a step first took it (time.time(), the worker's clock)
    # cluster: when the request passed each point before its first token (time.time(),
    # by the workers' clocks: prefill_queued, prefill_done, target_known, send_start,
    # decode_queued, reserved, kv_landed, ...), for the per-request timeline
    spans: dict | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # text added since the previous output of this request (streaming)
    delta_text: str = field(default="", repr=False)
    delta_token_ids: list[int] = field(default_factory=list, repr=False)
    # cluster: the workers that served it (the router's x-pdserve-* headers)
    prefill_worker: str | None = None
    decode_worker: str | None = None
    # sampling_params.prompt_logprobs: per prompt token, None for the first, then {its id: log-prob,
    # the top N: log-probs} (vLLM's); on the first output of a delta stream, and every cumulative one
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank, with prompt_logprobs

    @classmethod
    def error(cls, request_id: str, reason: str, prompt: str | None = None,
              prompt_token_ids: list[int] | None = None) -> RequestOutput:
        """The final output of a request that failed: finish_reason "error", the cause as stop_reason."""
        return cls(request_id, prompt, prompt_token_ids or [],
                   [CompletionOutput(0, "", [], finish_reason="error", stop_reason=reason)], True)


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """b, a later delta output of the same request, carrying a's deltas too."""
    b.delta_text = a.delta_text + b.delta_text
    b.delta_token_ids = a.delta_token_ids + b.delta_token_ids
    b.prompt_logprobs = a.prompt_logprobs or b.prompt_logprobs
    b.prompt_ranks = a.prompt_ranks or b.prompt_ranks
    if a.outputs and b.outputs:
        b.outputs[0].text = a.outputs[0].text + b.outputs[0].text
        b.outputs[0].token_ids = a.outputs[0].token_ids + b.outputs[0].token_ids
        if a.outputs[0].logprobs is not None:  # one entry per delta token, so both halves
            b.outputs[0].logprobs = a.outputs[0].logprobs + (b.outputs[0].logprobs or [])
    if b.metrics is not None and a.metrics is not None and a.metrics.spans and not b.metrics.spans:
        b.metrics.spans = a.metrics.spans
    return b


class Accumulator:
    """Turns a request's delta outputs (what workers stream: `delta_text`,
    `delta_token_ids`, no prompt ids) into cumulative vLLM-shaped outputs, once, at the
    edge that needs them (`Cluster.generate`, the router's non-streaming replies)."""

    def __init__(self, prompt: str | None, prompt_token_ids: list[int]):
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.text, self.token_ids, self.logprobs = "", [], None
        self.prompt_logprobs = self.prompt_ranks = None

    def add(self, out: RequestOutput) -> RequestOutput:
        self.prompt_logprobs = out.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs
        self.prompt_ranks = out.prompt_ranks = out.prompt_ranks or self.prompt_ranks
        self.text += out.delta_text
        self.token_ids += out.delta_token_ids
        out.prompt, out.prompt_token_ids = self.prompt, self.prompt_token_ids
        if out.outputs:
            c = out.outputs[0]
            if c.logprobs is not None:
                self.logprobs = (self.logprobs or []) + c.logprobs
            c.text, c.token_ids, c.logprobs = self.text, list(self.token_ids), self.logprobs
        return out
