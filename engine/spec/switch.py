"""Speculation's off-switch: whether a step's drafts are expected to pay for themselves.

Per step, two rules (the Drafter asks before the schedule, decode.Drafter.decide):
  - a hard cap: no drafts while the running decodes exceed `disable_by_batch_size`
    (vLLM's `speculative_disable_by_batch_size`; default config.DISABLE_BY_BATCH_SIZE);
  - on CUDA, a cost model. A verifying request takes 1 + d rows of the decode graph
    (exec/model_runner.py), so a step with drafts costs t(B + sum d) against plain decoding's
    t(B). It carries its drafts only if the tokens they are expected to yield per second
    beat plain decoding's:

        sum over requests of (1 - a^(d+1)) / (1 - a)  /  t(B + sum d)   >   B / t(B)

    with a the per-token acceptance seen lately (accepted / (accepted + misses): a
    geometric fit, decayed by DECAY per verifying step; prior PRIOR_ACCEPTED of
    PRIOR_DRAFTS). The decision is taken before proposing (with full drafts) and again with
    the drafts proposed. Probes: after PROBE_EVERY steps one way, one step goes the other
    way, so the acceptance estimate follows the text and the step-time fit sees both sizes;
    a probe while speculation is off drafts for 1 in PROBE_SHARE of the decodes (rotating).

t(rows, kv) is the engine's one step-time model (step_model.StepModel.decode_seconds): the
decode-graph time the runner measures at start for each captured size (every row attending to
512 tokens) until steps are fitted, then the fit over every step the engine ran. Drafts beyond
the largest decode graph never pay. Why it is built so, with the measurements:
docs/design/spec_switch.md.
"""

from __future__ import annotations

from ..core.step_model import StepModel

PRIOR_ACCEPTED, PRIOR_DRAFTS = 1, 2  # the acceptance estimate before any verification: 1/2
PROBE_EVERY = 16
PROBE_SHARE = 8
DECAY = 0.99


class SpecSwitch:
    def __init__(self, model: StepModel | None = None):
        self.model = model  # the engine's step-time model (None, or no graphs: always speculate)
        self.recent = [0.0, 0.0]  # accepted drafts, misses: decayed by DECAY per verifying step
        self.since_plain = 0  # decode steps since the last one without drafts
        self.since_spec = 0  # and since the last one with drafts
        self._probe = False

    @property
    def active(self) -> bool:
        return self.model is not None and bool(self.model.graphs)

    def seconds(self, rows: int, context: float) -> float | None:
        """An all-decode step of `rows` rows, each reading `context` tokens (None: beyond the
        largest graph)."""
        return self.model.decode_seconds(rows, int(rows * context))

    def acceptance(self) -> float:
        acc = self.recent[0] + PRIOR_ACCEPTED
        return acc / (acc + self.recent[1] + PRIOR_DRAFTS - PRIOR_ACCEPTED)

    def verified(self, accepted: list[int], drafted: list[int]) -> None:
        """One step's verifications: accepted and drafted tokens per request."""
        self.recent = [x * DECAY for x in self.recent]
        self.recent[0] += sum(accepted)
        self.recent[1] += sum(a < d for a, d in zip(accepted, drafted))

    def gain(self, drafts: list[int], context: float) -> bool:
        """Whether a step with these draft counts (one per decoding request, whose mean context
        is `context` tokens) is expected to yield more tokens per second than plain decoding.
        True without a model (CPU)."""
        if not self.active:
            return True
        b = len(drafts)
        spec, plain = self.seconds(b + sum(drafts), context), self.seconds(b, context)
        if spec is None or plain is None:  # beyond the largest graph: never worth it
            return False
        a = min(self.acceptance(), 0.999)
        return sum((1 - a ** (d + 1)) / (1 - a) for d in drafts) / spec > b / plain

    def plan(self, b: int, k: int, context: float) -> bool:
        """Before proposing (proposals cost host time too): whether this step of b decodes
        speculates, judged with full drafts of k. Probes: after PROBE_EVERY steps one way,
        one step the other way, so both sizes keep being measured for the fit and the
        acceptance estimate follows the text."""
        self._probe = False
        if not self.active:
            return True
        ok = self.gain([k] * b, context)
        if ok and self.since_plain >= PROBE_EVERY:
            return False
        if not ok and self.since_spec >= PROBE_EVERY and self.seconds(b * (k + 1), context) is not None:
            self._probe = True
            return True
        return ok

    def probe_width(self, b: int) -> int | None:
        """How many of the b decodes draft in this step: a probe while off drafts for a few
        (ceil(b / PROBE_SHARE)); None: every request that may."""
        return -(-b // PROBE_SHARE) if self._probe else None

    def pays(self, drafts: list[int], context: float) -> bool:
        """After proposing: the planned step with the drafts it got (a probe runs anyway)."""
        return self._probe or self.gain(drafts, context)

    def stepped(self, drafted: bool) -> None:
        """An all-decode step ran, with drafts or not (the probes' counters; the step-time
        model times it)."""
        self.since_plain, self.since_spec = (self.since_plain + 1, 0) if drafted else (0, self.since_spec + 1)
