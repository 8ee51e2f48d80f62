"""`DecodeCapacity`: how many sequences an engine decodes within its TPOT target, by context
length. The step model makes it (`StepModel.capacity_table`); a worker's stats carry it to the
cluster, whose ratio planner reads it at its workload's mean context."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeCapacity:
    """Sequences an engine decodes within its TPOT target by context: `decode_capacity()` at a few
    contexts (`points`: (context, sequences), rising), and the seconds a decode-only step of that
    many sequences takes (`steps`: (context, seconds); of max_num_seqs sequences where the engine
    has no target, and `points` is empty): the time a token takes at the batch a plan counts on.
    A worker's stats carry it; the ratio planner reads it at its workload's mean context (`at`,
    `step_at`). Empty before the step model is fitted."""
    points: tuple[tuple[int, int], ...] = ()
    steps: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, table: dict[int, int], steps: dict[int, float] | None = None) -> DecodeCapacity:
        return cls(tuple(sorted((int(c), int(n)) for c, n in table.items())),
                   tuple(sorted((int(c), float(t)) for c, t in (steps or {}).items())))

    def at(self, ctx: float) -> float | None:
        """Sequences at `ctx`, linear between the points, clamped at the ends; None when empty."""
        return _between(self.points, ctx)

    def step_at(self, ctx: float) -> float | None:
        """A decode-only step's seconds at `ctx` (as `at`); None when not known."""
        return _between(self.steps, ctx)


def _between(pts, ctx: float) -> float | None:
    if not pts:
        return None
    if ctx <= pts[0][0]:
        return float(pts[0][1])
    for (c0, v0), (c1, v1) in zip(pts, pts[1:]):
        if ctx <= c1:
            return v0 + (v1 - v0) * (ctx - c0) / (c1 - c0)
    return float(pts[-1][1])
