"""The pools' health and autoscaling (`PoolMonitor`, Pools' base): every second, the registry's
probe, each worker's stats (one that is gone or says it cannot serve is purged and replaced; one
that is silent is out of placement, and purged once silent for `unresponsive_s`), the refill to the
targets (a task beside the passes: a start that waits for a node holds up nothing else), and
the autoscaler's step (autoscale.py's signals policy, or ratio.py's split), which switches a
worker between the pools when none can be added.

It reads what Pools sets up: serving, mode, registry, workers, targets, actor_options, ttft, itl,
ratio, closed, _scaling, _refill, _pool_state, autoscale_events, unresponsive_s, pass_checks (what
else runs beside the probes: the dispatcher's check of links that are down), and Pools'
`pool_sizes()`, `candidates()`, `tp()`, `scale()`, `remove()` and `_reconcile()`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError

from ..aio import within
from ..records import WorkerRefused
from ..spec.serving_config import ROLES
from .autoscale import PoolSignals, decide, pool_signals

log = logging.getLogger(__name__)

PROBE_S = 5.0  # how long the monitor waits for a worker's stats


class PoolMonitor:
    # ---- health and autoscaling ---------------------------------------------------------------
    async def monitor(self) -> None:
        """Every second: the registry's probe, each worker's stats (`_probe`), the refill, the
        autoscaler. One pass that raises is logged and the
        next runs: health, refills and the registry's return all hang on this loop."""
        while not self.closed:
            await asyncio.sleep(1.0)
            try:
                await self._monitor_pass()
                self.monitor_error = None
            except Exception as e:  # noqa: BLE001
                self.monitor_error = f"{type(e).__name__}: {e}"[:300]
                log.exception("pool monitor pass failed; the next one runs in 1 s")

    async def _refill_pools(self) -> None:
        """Starts workers up to the targets, beside the monitor's passes: a start can wait long for
        a node that offers its pool (a host that died, until it is back), and the probes, the
        registry's return and /health must not wait with it (they did: one refill held the
        monitor for up to the start timeout, 900 s)."""
        async with self._scaling:
            try:
                await self._reconcile()  # drains it starts run on their own
            except (RayError, WorkerRefused) as e:
                log.warning("refilling pools failed: %s", e)

    def monitor_state(self) -> dict:
        return {"status": "ok" if self.monitor_error is None else "error",
                **({"error": self.monitor_error} if self.monitor_error else {})}

    async def _monitor_pass(self) -> None:
        await self.registry.check()
        await asyncio.gather(*(self._probe(w) for w in list(self.workers.values())),
                             *(check() for check in self.pass_checks))
        if not self.closed and not self._scaling.locked() and (self._refill is None or self._refill.done()):
            self._refill = asyncio.ensure_future(self._refill_pools())
        if self.serving.autoscale.enabled and not self.closed and not self._scaling.locked():
            self._autoscale_step(time.monotonic())

    async def _probe(self, w) -> None:
        """One worker's stats. A worker that is gone (its actor died) or says it cannot serve (its
        engine thread died) is purged and replaced at once. One that is silent (no answer in
        PROBE_S, or a stray error) is out of placement while its pool has a worker that answers
        (`candidates()`), and is purged only once silent for `unresponsive_s`: a busy host's slow
        answer is not a death, and purging the only decode worker for it failed every request
        until its replacement started. It is back as soon as it answers."""
        asked = time.monotonic()
        try:
            w.stats = await within(w.actor.stats.remote(), PROBE_S)
            if w.silent_since is not None:
                log.warning("worker %s answers again after %.1f s", w.worker_id, time.monotonic() - w.silent_since)
            w.silent_since = None
            return
        except (RayError, asyncio.TimeoutError) as e:
            why = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
            gone = isinstance(e, RayActorError) and not isinstance(e, ActorUnavailableError)
            dead = gone or "cannot serve" in str(e)
        now = time.monotonic()
        if not dead:
            if w.silent_since is None:
                w.silent_since = asked
                log.warning("worker %s does not answer (%s): out of placement while another answers", w.worker_id, why)
            if now - w.silent_since < self.unresponsive_s:
                return
            why = f"silent for {now - w.silent_since:.0f} s: {why}"
        await asyncio.sleep(0.5)  # a signal that ended the worker ends this process too: closed by then
        if w.worker_id in self.workers and not self.closed:
            log.warning("worker %s cannot serve (%s): purging and replacing it", w.worker_id, why)
            await self.remove(w, graceful=False)

    def unresponsive(self) -> dict[str, float]:
        """Workers silent to the probe now, and for how many seconds (/health)."""
        now = time.monotonic()
        return {w.worker_id: round(now - w.silent_since, 1) for w in list(self.workers.values())
                if w.silent_since is not None}

    def _switch_instead(self, want: dict) -> dict | None:
        """The policy wants a pool to grow and no worker can be added: move one worker from
        the other pool if that one is not growing and stays within its bounds (the
        prefill:decode ratio is what was wrong). None: scale as asked."""
        sizes = self.pool_sizes()
        grow = [r for r in ROLES if want.get(r, sizes[r]) > sizes[r]]
        if not self.serving.autoscale.switch_roles or len(grow) != 1 or self.can_add(grow[0]):
            return None
        donor = ROLES[1 - ROLES.index(grow[0])]
        if sizes[donor] - 1 < self.serving.pool(donor).min or len(self.candidates(donor)) < 2:
            return None
        self.autoscale_events.append({"time": time.time(), "role": donor, "from": sizes[donor],
                                      "to": sizes[donor] - 1, "reason": f"switch to {grow[0]}: no worker can be added"})
        return {grow[0]: sizes[grow[0]] + 1, donor: sizes[donor] - 1}

    def can_add(self, role: str) -> bool:
        """Whether one more worker of `role` can start now: under autoscale.max_workers, and
        Ray has the resources its actor asks for free (a Ray autoscaler that could add a
        node is not asked: set switch_roles false to wait for it instead)."""
        cap = self.serving.autoscale.max_workers
        if cap is not None and len(self.workers) >= cap:
            return False
        opts, free, tp = self.actor_options[role], ray.available_resources(), self.tp(role)
        need = {"GPU": opts.get("num_gpus", 0) * tp, "CPU": opts.get("num_cpus", 0) * tp,
                **(opts.get("resources") or {})}
        return all(free.get(k, 0.0) >= v for k, v in need.items() if v)

    def pool_signals(self, now: float | None = None) -> dict[str, PoolSignals]:
        return pool_signals(self.workers.values(), self.ttft, self.itl, time.monotonic() if now is None else now)

    def _autoscale_step(self, now: float) -> None:
        cfg, want, switch = self.serving.autoscale, {}, False
        if self.ratio is not None:  # policy "ratio": the split of the workers there are (ratio.py)
            got = self.ratio.plan(list(self.workers.values()), self.serving, self.specs.decode, now)
            if got:
                want, switch = got[0], True
                self.autoscale_events.append({"time": time.time(), "role": "ratio", "from": self.pool_sizes(),
                                              "to": want, "reason": got[1]})
                log.warning("autoscale %s", got[1])
        for role, sig in (self.pool_signals(now) if self.ratio is None else {}).items():
            if sig.size != self.targets[role] or (role == "prefill" and self.mode == "colocated"):
                continue  # a change is still being applied
            size, why = decide(role, sig, cfg, self.serving.pool(role), self._pool_state[role], now)
            if size != sig.size:
                want[role] = size
                self._pool_state[role].last_change = now
                self._pool_state[role].calm_since = None
                self.autoscale_events.append({"time": time.time(), "role": role, "from": sig.size, "to": size,
                                              "reason": why})
                log.warning("autoscale %s: %d -> %d (%s)", role, sig.size, size, why)
        if self.ratio is None and (moved := self._switch_instead(want)):
            want, switch = moved, True
        if want:
            task = asyncio.ensure_future(self.scale(want, switch_roles=bool(switch)))
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or
                                   log.warning("autoscale failed: %s", t.exception()))
