"""`ServingCluster`: what a front end (the HTTP router, a benchmark, a test) may use
of a cluster, and nothing else. `Cluster` (cluster.py) implements it; a front end never
reads the cluster's other attributes."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.engine.sampling_params import SamplingParams


@dataclass
class ClusterSnapshot:
    """What the cluster's monitor last saw, without calling into the workers."""

    workers: list[dict]  # per worker: worker_id, role, and its last reported stats
    pool_sizes: dict  # role -> workers not draining
    routing: dict  # placement decisions by reason
    autoscale_enabled: bool
    autoscale_events: list[dict]  # the latest autoscaling decisions


class ServingCluster(Protocol):
    # model facts
    model_path: str
    tokenizer: Any  # a Hugging Face tokenizer (encode, apply_chat_template)
    max_model_len: int
    vocab_size: int
    mode: str  # "disaggregated" | "colocated"

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        """Raises InvalidRequest (a ValueError with .param) or returns max_tokens."""

    def submit(self, prompt: str | None, ids: list[int], params: SamplingParams, sink) -> Future:
        """Runs a request; sink(out) gets its delta outputs. Cancel the future to abort it."""

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict:
        """Sets pool sizes (raises ValueError when refused); returns the sizes."""

    def pool_sizes(self) -> dict: ...

    def status(self) -> list[dict]:
        """Per worker, asked now (blocking; run it off the event loop)."""

    def snapshot(self) -> ClusterSnapshot: ...

    def add_observer(self, observer) -> None:
        """A dispatch.RequestObserver: latencies, phases, handoffs, finished requests."""

    def timeline(self, n: int = 1000) -> list[dict]:
        """The latest requests' timelines (spans and phases before the first token)."""
