"""The ratio autoscale policy in simulated time: a disaggregated (or hybrid) cluster whose workers
move between the pools as the live one's do (`disagg:P:D:adaptive`, `hybrid:P:D:adaptive`).

What decides is the live policy itself, `cluster/pools/ratio.RatioPlanner` on the simulated
clock: it reads the requests that arrive (their prompt lengths) and those that finish (their
prompt and output lengths, decode time, TTFT and TPOT), as the dispatcher tells it, and the
workers' stats (a prefill worker's rate, a decode worker's KV room), and each look it may ask
for a new split. A move then goes as
`Pools._plan_switches` and `Pools._switch` make it go live:

    pick       the least loaded workers of the pool that gives them up
    drain      out of placement at once (`switching_to`); its requests in flight finish, a
               prefill worker's handoffs land, a decode worker's reservations are served
    switch     SWITCH_S later it serves in the other pool: its role, its step budget (the
               prefill pool's chunk or the decode engines'), whether it keeps finished prompts'
               blocks for their handoff; its KV cache and prefix cache stay

The planner sees the pools as they are, a worker switching counted in the pool it goes to;
while one drains it may only go on the same way (as live).

Its clock is the simulated one, as a live cluster's planner runs on the wall clock of the replay
it serves (a trace stretched to a rate is served in that time, drains and all). Run on the
trace's recorded clock instead (window, looks and cooldown shrunk by the replay's speed-up) it
moved 7 times in 3000 requests at 80 req/s on 8 GPUs, chasing the bursts of short windows, for
the same attainment (0.84) as one move on the live clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.api import FinishedRequest
from pdserve.cluster.pools.ratio import RatioPlanner
from pdserve.cluster.spec.serving_config import ROLES

SWITCH_S = 1.0  # a drained worker's role switch and its registration again (the live actor's call)


@dataclass
class Move:
    """One worker moved: when it was asked, when it serves in its new pool, and why."""

    worker_id: str
    to: str
    asked: float
    why: str
    serving: float | None = None


class Mover:
    """The ratio policy of one simulated cluster: `arrived` for each request that comes in,
    `finished` for each that ends, `look` on the cluster's stats tick."""

    def __init__(self, sim, window_s: float = 30.0, cooldown_s: float = 30.0):
        """`window_s`, `cooldown_s`: the policy's (AutoscaleConfig's defaults)."""
        self.sim = sim
        self.planner = RatioPlanner(window_s, cooldown_s, clock=lambda: sim.now)
        self.moves: list[Move] = []
        self.draining: dict[str, Move] = {}
        total = len(sim.engines)
        for role in ROLES:  # the policy keeps the total: each pool between 1 and the rest
            pool = sim.pools.serving.pool(role)
            pool.min, pool.max = 1, total - 1

    def arrived(self, prompt_tokens: int, max_tokens: int) -> None:
        """A request came in at the edge (as the dispatcher reports it, before its placement)."""
        self.planner.on_arrive(prompt_tokens, max_tokens)

    def finished(self, f) -> None:
        """A request ended (the edge's view: FinishedRequest, as the dispatcher reports it)."""
        r = f.record
        if r.ttft is None or r.e2e is None:
            return
        cached = f.first.num_cached_tokens if f.first is not None else 0
        self.planner.on_finish(FinishedRequest("length", r.prompt_tokens, r.output_tokens, None, None,
                                               r.e2e - r.ttft, ttft_s=r.ttft, max_tokens=r.max_tokens,
                                               num_cached_tokens=cached))

    def start(self) -> None:
        """Its first look; each schedules the next, a monitor pass (one second) apart."""
        self.sim.at(0.0, self.look)

    def look(self) -> None:
        """The monitor's pass: drained workers switch, then the planner may ask for a split."""
        sim = self.sim
        sim.at(sim.now + 1.0, self.look)
        for wid, move in list(self.draining.items()):
            if move.serving is None and self._drained(sim.engines[wid]):
                move.serving = sim.now + SWITCH_S
                sim.at(move.serving, self._switch, wid, move)
        got = self.planner.plan(list(sim.pools.workers.values()), sim.pools.serving, sim.pools.specs.decode, sim.now)
        if got is None:
            return
        want, why = got
        sizes = {r: len(sim.pools.members(r)) for r in ROLES}
        for donor in ROLES:
            to = ROLES[1 - ROLES.index(donor)]
            extra = sizes[donor] - want[donor]
            idle_first = sorted((w for w in sim.pools.members(donor) if w.switching_to is None),
                                key=lambda w: (w.load, w.worker_id))
            for w in idle_first[:max(0, extra)]:
                w.switching_to = to
                move = Move(w.worker_id, to, sim.now, why)
                self.moves.append(move)
                self.draining[w.worker_id] = move

    def _drained(self, e) -> bool:
        return (e.record.load == 0 and not e.has_work and not e.held
                and not self.sim.backlog.get(e.worker_id))

    def _switch(self, wid: str, move: Move) -> None:
        e = self.sim.engines[wid]
        e.switch_role(move.to, self.sim.layout, self.sim.engine_tpot)
        self.draining.pop(wid, None)
        if e.has_work:
            e.gpu.want(e)

    def events(self) -> list[dict]:
        """The moves, for a run's report: time asked, time serving, worker, pool, why."""
        return [{"asked": round(m.asked, 2), "serving": None if m.serving is None else round(m.serving, 2),
                 "worker": m.worker_id, "to": m.to, "why": m.why} for m in self.moves]
