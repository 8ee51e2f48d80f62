"""One try at serving a request, and what the dispatcher knows of it.

Lifecycle: `Dispatcher.request` makes an `Attempt` for each try (up to 3) with a wire id of
its own (`<rid>-<n>`, so a retry never meets the blocks of the try before it); placement
sets `placement` and charges the prompt's tokens to the workers it picked (`charges`); the
dispatcher runs it one of three ways and hands each output to `Dispatcher._finish(a, ...)`,
which tracks what the client has seen (`first_at`, `last`, `tokens`, `shown`) and holds a
non-streamed reply's outputs (`held`) until its last; `charges.settle()` runs at the first
token or when the try ends, whatever way."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.role import HandoffResult
from pdserve.engine.validation import ValidRequest

from ..placement.placement import Charges, Placement


class Attempt:
    def __init__(self, rid: str, n: int, request: ValidRequest, hashes: list[str],
                 sink: Callable[[RequestOutput], None], stream: bool = True):
        self.rid, self.wire_id = rid, f"{rid}-{n}"
        self.request, self.hashes, self.sink = request, hashes, sink  # request: what the workers get
        self.t0, self.last, self.first_at = time.monotonic(), None, None
        # a client that reads the whole reply at once (JSON): the outputs wait here until the
        # last one, so a worker lost after the first token is still retried (nothing was shown)
        self.held: list[RequestOutput] | None = None if stream else []
        self.shown = False  # the sink has had a token: the request can no longer be retried
        self.tokens = 0
        self.cached = 0  # the prompt's tokens a prefix cache held, as the outputs say (FinishedRequest)
        self.placement: Placement | None = None
        self.queue_s = self.prefill_s = None  # from the workers' spans at the first token (FinishedRequest)
        self.charges = Charges(self.request.params.priority)

    @property
    def fetch(self):
        """The placement's peer fetch (a transfer.fetch.FetchPlan) for the worker that prefills, or None."""
        return self.placement.fetch if self.placement is not None else None

    def prefilled(self, done) -> None:
        """The prefill side's call ended (`done`, its future): what its prefix cache held of the
        prompt counts (FinishedRequest; the decode worker's outputs say what its own cache held,
        nothing of the prefill's)."""
        if not done.cancelled() and done.exception() is None and isinstance(done.result(), HandoffResult):
            self.cached = max(self.cached, done.result().cached_tokens)
