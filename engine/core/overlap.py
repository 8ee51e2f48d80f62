"""The overlapped step: the host's work for step n+1 runs while the GPU runs step n.

    step n+1:  schedule -> launch (inputs; pending ids patched on the device; sample on the device)
               -> resolve step n (wait for its ids, append them, detokenize, stop checks)
               -> advance step n+1 (progress, prefix-cache blocks, PENDING placeholders)

Step n's sampled ids stay on the device and feed step n+1 there (model_runner.launch); the
host sees them through a pinned copy only after step n+1 is queued, so scheduling, input
building and step n's outputs leave the GPU busy (docs/design/overlap.md).
Until its id arrives, a request's newest token is `request.PENDING`: it counts for lengths,
block slots and seeded sampling's token index, and no one reads its value.

A request that finishes in step n (EOS, a stop string) was already scheduled into step n+1:
that row runs and is dropped (its blocks are free by then and nothing reads what it wrote).
A request whose length limit ends it at its pending token is not scheduled again.

Steps whose requests need the host between steps run in turn (resolve, then a synchronous
step): log-probs, prompt log-probs, grammars, logit bias, penalties and allowed tokens read
or change what the host holds per token; speculation verifies drafts on the host. A tensor
parallel engine overlaps too: its shards receive the step's host inputs from rank 0 and the
pending ids, which only rank 0 sampled, in a broadcast on the device before the step runs.
`plain` says which requests may overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import PENDING, Request
from .scheduler import SchedulerOutput


def plain(req: Request) -> bool:
    """Whether a request's steps may overlap: nothing of its sampling reads host state that
    the previous step's token changes."""
    p = req.sampling_params
    return (p.logprobs is None and p.prompt_logprobs is None and p.structured_outputs is None
            and not p.adjusts_logits)


@dataclass
class PendingStep:
    """A launched step: its schedule, the requests it samples for (in row order) and their ids
    on the way to the host."""

    sched: SchedulerOutput
    reqs: list[Request]
    host: torch.Tensor | None  # the sampled ids (pinned, filled by the copy `event` waits for)
    event: torch.cuda.Event | None = None

    @classmethod
    def start(cls, sched: SchedulerOutput, tokens: torch.Tensor | None, reqs: list[Request]) -> PendingStep:
        if tokens is None or not tokens.is_cuda:
            return cls(sched, reqs, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(sched, reqs, host, event)

    @property
    def rows(self) -> dict[str, int]:
        """Request id -> its row in the sampled ids (what the next launch patches from)."""
        return {r.request_id: i for i, r in enumerate(self.reqs)}

    def tokens(self) -> dict[str, int]:
        """Waits for the ids; takes the PENDING placeholders back off the requests."""
        if self.event is not None:
            self.event.synchronize()
        ids = self.host.tolist() if self.host is not None else []
        for r in self.reqs:
            if r.output_token_ids and r.output_token_ids[-1] == PENDING:
                r.output_token_ids.pop()
                r.all_token_ids.pop()
        return {r.request_id: t for r, t in zip(self.reqs, ids)}

    def placeholders(self) -> None:
        """After the step's progress: each live request it samples for holds PENDING as its
        newest token until tokens() is called."""
        for r in self.reqs:
            if not r.finished:
                r.append_token(PENDING)
