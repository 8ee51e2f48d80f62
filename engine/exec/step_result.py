"""What one executed step gives back to the engine (ModelRunner.execute), typed: nothing of it
is read from the runner or the sampler afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepResult:
    """tokens: each sampling request's token, or the list its verified drafts gave; logprobs: the
    sampled token's log-prob entry of each request that asked (sample/logits_process.py);
    prompt_logprobs: the (entry, rank) pairs of the prompt positions this step scored, per
    request; dead_ends: the requests whose grammar allowed nothing that could be sampled, and why."""

    tokens: dict[str, int | list[int]] = field(default_factory=dict)
    logprobs: dict[str, dict] = field(default_factory=dict)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    dead_ends: dict[str, str] = field(default_factory=dict)
