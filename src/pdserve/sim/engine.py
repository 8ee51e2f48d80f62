"""One worker's engine in simulated time (`SimEngine`) and the GPU its steps run on (`SimGpu`).

A SimEngine is the live engine's scheduling without its model: the same `Scheduler` and
`KVCacheManager` (block ids, prefix cache, chunked prefill, preemption), the same `StepModel`
asking for the TPOT-bounded chunk of each step, and the step's seconds predicted by that model
from a profile (profile.py) instead of measured. A step's sampled token is a placeholder id; a
request ends at its max_tokens. A prefill worker's finished prompts keep their blocks until their
handoff is over (`release`), as the live prefill role's do.

A SimGpu runs one step at a time: the engines on it (two sharing one GPU, as the one-GPU serving
runs do) queue for it in turn; with a profile's measured sharing (sharing.py) they step side by
side instead, each step slowed by what the other runs.

Lifecycle: the simulator (cluster.py) adds requests (`add`, `admit_prefilled`); the engine asks
its GPU for a step whenever it has work; at a step's end it calls the simulator back with each
request that sampled a token (`on_token(engine, request, now)`) and each that finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.cluster.records import WorkerRecord, WorkerStats
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.core.step_model import placement_stats

from .profile import Profile
from .sharing import Sharing

TOKEN = 0  # the id every simulated sample is


class SimGpu:
    """One GPU. Without `sharing`: the steps of the engines on it one at a time, in the order they
    asked. With it (a profile's measured sharing.Sharing, for engines sharing the GPU): every
    engine's step runs as soon as it asks, each stretched by its factor for the time another
    engine's step runs beside it (the step's seconds alone are its work; it progresses at 1 /
    factor of that while it shares)."""

    def __init__(self, sim, name: str, sharing: Sharing | None = None):
        self.sim, self.name, self.sharing = sim, name, sharing
        self.queue: deque[SimEngine] = deque()
        self.running: SimEngine | None = None
        self.busy_s = 0.0
        self.steps: dict[SimEngine, _SharedStep] = {}  # with sharing: the steps running now
        self._at = 0.0  # when the running steps' work was last brought up to date

    def want(self, engine: SimEngine) -> None:
        if self.sharing is not None:
            if engine not in self.steps:
                self._start(engine)
        elif engine is not self.running and engine not in self.queue:
            self.queue.append(engine)
            self._next()

    def _next(self) -> None:
        while self.running is None and self.queue:
            engine = self.queue.popleft()
            seconds = engine.start_step()
            if seconds is None:
                continue  # nothing it can schedule now (no free blocks): it asks again when some free
            self.running = engine
            self.busy_s += seconds
            self.sim.at(self.sim.now + seconds, self._done, engine, seconds)

    def _done(self, engine: SimEngine, seconds: float) -> None:
        self.running = None
        engine.end_step(seconds)
        if engine.has_work:
            self.queue.append(engine)
        self._next()

    # ---- side by side (sharing) ----------------------------------------------------------------
    def _start(self, engine: SimEngine) -> None:
        seconds = engine.start_step()
        if seconds is None:
            return  # it asks again when blocks free
        self._progress()
        self.steps[engine] = _SharedStep(seconds, engine.step_kind, self.sim.now)
        self.busy_s += seconds
        self._plan()

    def _stretch(self, engine: SimEngine) -> float:
        own = self.steps[engine].kind
        return max((self.sharing.factor(own, st.kind) for e, st in self.steps.items() if e is not engine),
                   default=1.0)

    def _progress(self) -> None:
        """Every running step's work left, brought to now at the rate it ran since the last change."""
        dt = self.sim.now - self._at
        if dt > 0:
            for e, st in self.steps.items():
                st.left -= dt / self._stretch(e)
        self._at = self.sim.now

    def _plan(self) -> None:
        """Each running step's end at its rate now (an end planned before a change is void)."""
        for e, st in self.steps.items():
            st.version += 1
            self.sim.at(self.sim.now + max(st.left, 0.0) * self._stretch(e), self._ended, e, st.version)

    def _ended(self, engine: SimEngine, version: int) -> None:
        st = self.steps.get(engine)
        if st is None or st.version != version:
            return
        self._progress()
        del self.steps[engine]
        engine.end_step(self.sim.now - st.started)
        self._plan()
        if engine.has_work and engine not in self.steps:
            self._start(engine)


@dataclass
class _SharedStep:
    left: float  # its seconds alone not yet run
    kind: str  # "decode" or "prefill" (sharing.KINDS)
    started: float
    version: int = 0


class SimEngine:
    def __init__(self, sim, worker_id: str, role: str, gpu: SimGpu, profile: Profile, num_blocks: int,
                 max_num_seqs: int, max_num_batched_tokens: int, slo_tpot_s: float | None):
        self.sim, self.gpu, self.profile = sim, gpu, profile
        self.kv = KVCacheManager(num_blocks, profile.block_size)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens)
        self.model = profile.step_model(max_num_batched_tokens, slo_tpot_s)
        self.holds = role == "prefill"  # its finished prompts keep their blocks for the handoff
        self.held: dict[str, Request] = {}
        self.record = WorkerRecord(worker_id, role, None)
        self.record.stats = WorkerStats(kv_blocks_total=num_blocks)
        self._step: SchedulerOutput | None = None
        self.steps = 0

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- requests in ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """A prompt to prefill here (and decode, unless this is a prefill worker)."""
        self.scheduler.add(req)
        self.gpu.want(self)

    def admit_prefilled(self, req: Request) -> None:
        """A request whose prompt's KV landed in its reserved blocks, its first token appended:
        it joins the running batch (engine.admit_prefilled), or ends if that token was its last."""
        req.num_computed_tokens = req.num_prompt_tokens
        if req.check_stop_token():
            self.finish(req)
            return
        self.scheduler.add_running(req)
        self.gpu.want(self)

    def release(self, request_id: str) -> None:
        """A prefill worker's prompt whose handoff is over: its blocks go back (the prefix cache keeps them)."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)
            if self.has_work:
                self.gpu.want(self)

    def finish(self, req: Request) -> None:
        status = req.status if req.status.finished else RequestStatus.FINISHED_LENGTH
        self.scheduler.finish(req, status, free=not self.holds)
        if self.holds:
            self.held[req.request_id] = req
        if self.has_work:
            self.gpu.want(self)

    # ---- steps ---------------------------------------------------------------------------------
    def start_step(self) -> float | None:
        """Schedules the next step (the TPOT-bounded chunk included) and predicts its seconds;
        None when nothing can be scheduled."""
        sched = self.scheduler.schedule(self.model.prefill_cap(self.scheduler.running, self.scheduler.waiting))
        if not sched:
            return None
        shape = sched.shape
        self._step = sched
        return max(self.model.predict(shape.rows, shape.prefill_tokens, shape.kv_tokens, shape.attn), 1e-5)

    @property
    def step_kind(self) -> str:
        """The running step's kind, as sharing.KINDS names it."""
        return "prefill" if self._step.shape.prefill_tokens else "decode"

    def end_step(self, seconds: float) -> None:
        sched, self._step = self._step, None
        sampled = [s.request for s in sched.scheduled if s.samples and not s.request.finished]
        self.model.observe(sched.shape, seconds)
        self.scheduler.update_after_step(sched)
        self.steps += 1
        now = self.sim.now
        for req in sampled:
            req.append_token(TOKEN)
            if req.first_token_time is None:
                req.first_token_time = now
            stopped = req.check_stop_token() or self.holds
            self.sim.on_token(self, req, now)
            if stopped:
                self.finish(req)
                n = req.num_output_tokens
                if n >= 2 and not self.holds:
                    self.model.observe_tpot((now - req.first_token_time) / (n - 1))

    def switch_role(self, role: str, layout, slo_tpot_s: float | None) -> None:
        """Serves in the other pool from now on (a drained worker the ratio policy moved: adaptive.py):
        its role, the new pool's step budget and TPOT target (the prefill pool's chunk and none; a
        disagg decode engine's 2048 and none; a hybrid one's chunk and `slo_tpot_s`, which sizes
        the prompts it prefills beside its decodes) and whether it keeps finished prompts' blocks
        for their handoff. Its KV and prefix cache stay."""
        from .cluster import COLOCATED_CHUNK

        self.record.role = role
        self.record.switching_to = None
        self.holds = role == "prefill"
        hybrid_decode = role == "decode" and layout.mode == "hybrid"
        budget = layout.prefill_chunk if self.holds or hybrid_decode else COLOCATED_CHUNK
        self.scheduler.max_num_batched_tokens = self.model.max_tokens = budget
        self.model.slo_tpot_s = slo_tpot_s if hybrid_decode else None

    def close(self) -> None:
        """Drops its scheduler and KV cache at the run's end: their blocks (a quarter million in a
        run at capacity) go by reference counting, not by a pass of the cyclic collector (the
        engine and the simulation refer to each other)."""
        self.scheduler = self.kv = self.held = None

    # ---- what placement reads ------------------------------------------------------------------
    def report(self) -> None:
        """Its stats as a live worker reports them (placement_stats, and its step model's decode
        capacity as the engine's stats carry it), into its record."""
        self.record.stats.placed(placement_stats(self.model, self.scheduler))
        self.record.stats.decode_capacity = self.model.capacity_table(self.profile.max_model_len,
                                                                      self.scheduler.max_num_seqs)
