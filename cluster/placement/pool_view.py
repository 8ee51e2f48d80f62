"""What placement reads of the pools (`PoolView`): the worker records, each pool's members and
the snapshots (`routing.Candidate`) placement decides on. `Pools` is one (the live cluster's, its
records kept up to date by its monitor); the capacity simulator (pdserve.sim) is another, its
records kept by simulated engines, so that `placement.Placer` decides the same way in both.

A view has: `workers` (worker id -> `records.WorkerRecord`), `mode`, `serving` (the
`ServingConfig`: the SLO placement serves, the handoff settings), `specs` (each pool's engine
spec: its scheduling policy, and its batch size for a worker's free seats; values the cluster set
are read there, never sent back up in a worker's stats) and `start_s` (a worker's start: a 503's Retry-After).
"""

from __future__ import annotations

from ..records import WorkerRecord
from .routing import Candidate


class PoolView:
    workers: dict[str, WorkerRecord]
    start_s: float = 10.0

    def worker(self, worker_id: str) -> WorkerRecord:
        return self.workers[worker_id]

    def members(self, role: str) -> list[WorkerRecord]:
        """The pool's workers that stay in it (not draining to leave), a switching one included."""
        return [w for w in self.workers.values() if (w.switching_to or w.role) == role and not w.draining]

    def ahead_of(self, w: WorkerRecord, priority: int | None) -> int:
        """The prompt tokens queued on w that a request of `priority` waits behind: all of them,
        or under scheduling_policy "priority" those of its priority or a more urgent one."""
        spec = self.specs.get(w.role)
        if priority is None or spec is None or spec.scheduling_policy != "priority":
            return w.queued_tokens
        return sum(n for p, n in w.queued_by_priority.items() if p <= priority)

    def candidates(self, role: str, priority: int | None = None) -> list[Candidate]:
        """`priority`: the request's, so that the queue it is predicted to wait in is what runs ahead of it.
        Workers silent to the monitor's probe are left out while another worker of the pool answers
        (all silent: a slow host, not a dead pool; they stay). A pool left with no worker but one
        draining to leave it (a shrink, then its staying member died) places on that one: no 503
        while a worker that can serve is alive (the monitor's refill takes it back, `_reclaim`)."""
        out = []
        live = [w for w in self.workers.values() if w.role == role and not w.draining and w.switching_to is None] \
            or [w for w in self.workers.values() if w.role == role and w.drain is not None]
        answering = [w for w in live if w.silent_since is None]
        for w in answering or live:
            st, total, spec = w.stats, w.blocks_total or 1, self.specs.get(w.role)
            seats = spec.max_num_seqs - st.num_running - 4 if spec is not None else 1 << 30
            out.append(Candidate(w.worker_id, w.load, total - st.kv_blocks_used, total, self.ahead_of(w, priority),
                                 st.prefill_tok_s, st.prefill_chunk, st.step_s, 0,
                                 seats, st.tpot_over))
        return out
