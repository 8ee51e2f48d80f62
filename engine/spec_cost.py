"""Speculation's off-switch: whether a step's drafts are expected to pay for themselves.

Per step, two rules (engine/spec_decode.py's Drafter asks before each step):
  - a hard cap: no drafts while the running decodes exceed `disable_by_batch_size`
    (vLLM's `speculative_disable_by_batch_size`; default DISABLE_BY_BATCH_SIZE, the largest
    batch measured, bench/results/spec/);
  - on CUDA, a cost model. A verifying request takes 1 + d rows of the decode graph
    (model_runner.py), so a step with drafts costs t(B + sum d) against plain decoding's
    t(B). It carries its drafts only if the tokens they are expected to yield per second
    beat plain decoding's:

        sum over requests of (1 - a^(d+1)) / (1 - a)  /  t(B + sum d)   >   B / t(B)

    with a the per-token acceptance seen lately (accepted / (accepted + misses): a
    geometric fit, decayed by DECAY per verifying step; prior PRIOR_ACCEPTED of
    PRIOR_DRAFTS). At small batch a step reads all the weights whatever its rows, so any
    acceptance pays; at large batch the matmuls turn compute-bound and only high
    acceptance does. The decision is taken before proposing (with full drafts: an ngram
    lookup over 64 long requests is milliseconds of host time) and again with the drafts
    proposed. Probes: after PROBE_EVERY steps one way, one step goes the other way, so the
    acceptance estimate follows the text and the fit below sees both sizes. A probe while
    speculation is off drafts for 1 in PROBE_SHARE of the decodes only (rotating): probing
    the whole batch cost batch 64 at 0% acceptance 8% of its tokens (H100, Llama-3-8B
    shape: 8 of 127 steps at ~2x a plain step's time; bench/results/spec/).

t(rows) = base(rows) + h + r x rows. `base`: the runner times each captured graph at start,
every row attending to 512 tokens (model_runner.time_graphs; with 1-token rows the table
missed the KV reads: H100, Llama-3-8B shape, 512-token contexts, 160 rows cost 1.39x 32
rows, not that table's 1.17x). h and r: a least-squares fit of the measured wall time of
the last FIT_WINDOW all-decode steps beyond base: the host's work per step, and the KV
that contexts longer or shorter than 512 read. One fit for every size keeps
plain and speculative sizes comparable: a per-size table learns only the sizes a workload
visits, and then compares a measured plain step with an unmeasured speculative one.
"""

from __future__ import annotations

import collections

import numpy as np

DISABLE_BY_BATCH_SIZE = 64
PRIOR_ACCEPTED, PRIOR_DRAFTS = 1, 2  # the acceptance estimate before any verification: 1/2
PROBE_EVERY = 16
PROBE_SHARE = 8
DECAY = 0.99
FIT_WINDOW = 256


class SpecCost:
    def __init__(self, base: dict[int, float] | None = None):
        self.base = dict(base or {})  # graph rows -> seconds per replay (empty: no cost model)
        self.h = 0.0  # seconds per step beyond base
        self.r = 0.0  # seconds per row beyond base
        self._obs: collections.deque = collections.deque(maxlen=FIT_WINDOW)  # (rows, seconds beyond base)
        self.recent = [0.0, 0.0]  # accepted drafts, misses: decayed by DECAY per verifying step
        self.since_plain = 0  # decode steps since the last one without drafts
        self.since_spec = 0  # and since the last one with drafts
        self._probe = False

    def _size(self, rows: int) -> int | None:
        fits = [k for k in self.base if k >= rows]
        return min(fits) if fits else None

    def seconds(self, rows: int) -> float | None:
        """A decode-graph step of `rows` rows (None: beyond the largest graph, eager)."""
        k = self._size(rows)
        return None if k is None else self.base[k] + self.h + self.r * rows

    def acceptance(self) -> float:
        acc = self.recent[0] + PRIOR_ACCEPTED
        return acc / (acc + self.recent[1] + PRIOR_DRAFTS - PRIOR_ACCEPTED)

    def verified(self, accepted: list[int], drafted: list[int]) -> None:
        """One step's verifications: accepted and drafted tokens per request."""
        self.recent = [x * DECAY for x in self.recent]
        self.recent[0] += sum(accepted)
        self.recent[1] += sum(a < d for a, d in zip(accepted, drafted))

    def gain(self, drafts: list[int]) -> bool:
        """Whether a step with these draft counts (one per decoding request) is expected to
        yield more tokens per second than plain decoding. True without a table (CPU)."""
        if not self.base:
            return True
        b = len(drafts)
        spec, plain = self.seconds(b + sum(drafts)), self.seconds(b)
        if spec is None or plain is None:  # beyond the largest graph: never worth it
            return False
        a = min(self.acceptance(), 0.999)
        return sum((1 - a ** (d + 1)) / (1 - a) for d in drafts) / spec > b / plain

    def plan(self, b: int, k: int) -> bool:
        """Before proposing (proposals cost host time too): whether this step of b decodes
        speculates, judged with full drafts of k. Probes: after PROBE_EVERY steps one way,
        one step the other way, so both sizes keep being measured for the fit and the
        acceptance estimate follows the text."""
        self._probe = False
        if not self.base:
            return True
        ok = self.gain([k] * b)
        if ok and self.since_plain >= PROBE_EVERY:
            return False
        if not ok and self.since_spec >= PROBE_EVERY and self.seconds(b * (k + 1)) is not None:
            self._probe = True
            return True
        return ok

    def probe_width(self, b: int) -> int | None:
        """How many of the b decodes draft in this step: a probe while off drafts for a few
        (ceil(b / PROBE_SHARE)); None: every request that may."""
        return -(-b // PROBE_SHARE) if self._probe else None

    def pays(self, drafts: list[int]) -> bool:
        """After proposing: the planned step with the drafts it got (a probe runs anyway)."""
        return self._probe or self.gain(drafts)

    def observe(self, rows: int, seconds: float, drafted: bool) -> None:
        """An all-decode step of `rows` rows (with drafts or not) took `seconds` (wall):
        refits h and r."""
        self.since_plain, self.since_spec = (self.since_plain + 1, 0) if drafted else (0, self.since_spec + 1)
        k = self._size(rows)
        if k is None:
            return
        self._obs.append((rows, seconds - self.base[k]))
        if len(self._obs) % 8 == 0 or len(self._obs) < 8:
            x, y = np.array(self._obs).T
            if np.ptp(x) > 0:  # rows vary: both terms
                r, h = np.polyfit(x, y, 1)
                self.r = max(float(r), 0.0)
            self.h = float(np.mean(y - self.r * x))
