"""`ServingCluster`: what a front end (the HTTP router, a benchmark, a test) may use
of a cluster, and nothing else; `RequestObserver`: what the cluster reports as requests
run. `Cluster` (cluster.py) implements the first; a front end never reads the cluster's
other attributes."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.engine.role import HandoffResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.validation import ValidRequest


class NoWorker(RuntimeError):
    """A pool has no worker to place a request on (all dead or draining, a replacement
    starting): the router answers 503 with Retry-After (`retry_after_s`, the pools' measured
    worker start time)."""

    def __init__(self, role: str, retry_after_s: float = 5.0, why: str | None = None):
        super().__init__(why or f"no healthy {role} worker: a replacement is starting, retry shortly")
        self.role, self.retry_after_s = role, retry_after_s


class RequestObserver:
    """What the dispatcher reports as requests run (the router's metrics, the autoscaler's
    latency windows). Override what you need."""

    def on_latency(self, kind: str, seconds: float) -> None:
        """kind: "ttft" (to the first token), "itl" (between tokens), "e2e" (to the end)."""

    def on_phase(self, name: str, seconds: float) -> None:
        """Phases before the first token: prefill (queue + compute on the prefill worker),
        decode_reserve (the prefill's KV waiting for the decode reservation: 0 when the
        reservation was first), kv_to_first_token (send start -> first token here),
        local_prefill (queue + chunked prefill on a decode worker: hybrid placement) and
        local_to_first_token, local_first_token (a request served by one worker, no spans)."""

    def on_handoff(self, result: HandoffResult) -> None:
        """A finished send (its state, error, bytes, seconds and spans)."""

    def on_arrive(self, prompt_tokens: int, max_tokens: int | None = None) -> None:
        """A request came in at the edge (once, whatever its retries; before its placement), with
        its max_tokens (resolved: the rest of max_model_len where the client set none)."""

    def on_finish(self, done: FinishedRequest) -> None:
        """A request ended."""


@dataclass
class FinishedRequest:
    """A request that ended, as the edge saw it (vLLM's request-level metrics). Times in
    seconds; None where the request never got that far (or no worker reported when a step
    first took it)."""

    reason: str  # stop, length, abort, error, invalid
    num_prompt_tokens: int
    num_output_tokens: int
    queue_s: float | None  # arrival here -> a worker's step first took it
    prefill_s: float | None  # that step -> the first token here
    decode_s: float | None  # the first token -> the last
    priority: int = 0  # SamplingParams.priority
    ttft_s: float | None = None  # arrival here -> the first token here
    num_preemptions: int = 0  # times a worker preempted it (the last attempt's)
    max_tokens: int | None = None  # the most it could decode (its max_tokens, resolved)
    num_cached_tokens: int = 0  # of its prompt, the tokens a prefix cache held (not computed)

    @property
    def inference_s(self) -> float | None:
        return None if self.prefill_s is None else self.prefill_s + (self.decode_s or 0.0)


@dataclass
class ClusterSnapshot:
    """What the cluster's monitor last saw, without calling into the workers."""

    workers: list[dict]  # per worker: worker_id, role, and its last reported stats
    pool_sizes: dict  # role -> workers not draining
    routing: dict  # placement decisions by reason
    autoscale_enabled: bool
    autoscale_events: list[dict]  # the latest autoscaling decisions
    autoscale_plan: dict | None = None  # policy "ratio": its last look (the split, the load it measured)


class ServingCluster(Protocol):
    # model facts
    model_path: str
    tokenizer: Any  # a Hugging Face tokenizer (encode, apply_chat_template)
    max_model_len: int
    vocab_size: int
    mode: str  # "disaggregated" | "hybrid" | "colocated"

    def validate(self, ids: list[int], params: SamplingParams) -> ValidRequest:
        """The request's one validation: raises InvalidRequest (a ValueError with .param)."""

    def submit(self, prompt: str | None, request: ValidRequest, sink, stream: bool = True) -> Future:
        """Runs a request `validate` passed; sink(out) gets its delta outputs (stream=False: all at its end, and a
        token-less one at its first token; a worker lost in between is retried). Cancel the
        future to abort it."""

    def scale(self, prefill: int | None = None, decode: int | None = None, switch_roles: bool = False) -> dict:
        """Sets pool sizes (raises ValueError when refused); returns the sizes. switch_roles:
        by moving workers between the pools (same total)."""

    def set_slo(self, ttft_s: float | None = None, tpot_s: float | None = None) -> dict:
        """Changes the SLO placement serves (raises ValueError on a bad value); returns it."""

    def slo(self) -> dict:
        """The SLO placement serves now: {"ttft_s", "tpot_s", ...}."""

    def pool_sizes(self) -> dict: ...

    def health(self) -> dict:
        """{"pools": sizes, "unresponsive": {worker id: seconds silent}, "kv_links_down": {"prefill
        id->decode id": seconds out of placement left}, "registry": {"status": "ok" |
        "restarting", ...}, "monitor": {"status": ...}}: what is missing, without calling into the workers."""

    def status(self) -> list[dict]:
        """Per worker, asked now (blocking; run it off the event loop)."""

    def snapshot(self) -> ClusterSnapshot: ...

    def add_observer(self, observer: RequestObserver) -> None:
        """Latencies, phases, handoffs and finished requests, as requests run."""

    def timeline(self, n: int = 1000) -> list[dict]:
        """The latest requests' timelines (spans and phases before the first token)."""
