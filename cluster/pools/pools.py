"""The prefill and decode pools: worker records, sizes, scaling and each worker's lifecycle (start,
placement group, persistence slot, drain, role switch, removal); their health and autoscaling
are `PoolMonitor`'s (pool_monitor.py). Runs on the cluster's event loop thread.

    scale(want)   set pool targets; growth is awaited, the surplus drains (no new
                  requests, in-flight ones finish) and then stops
    monitor()     (pool_monitor.py) every second: the registry's probe (registry_link.RegistryLink.check), each
                  worker's stats (a worker gone, or silent for `unresponsive_s`: purge it from
                  the registry, tell its peers to drop their process groups with it, and
                  refill the pool); then one autoscaling decision when it is on
    candidates()  snapshots of the live, non-draining workers of a pool for placement

A worker's record (`records.WorkerRecord`) is the cluster's view of one `WorkerActor`:
its id, role, the actor handle, what it reported at start (`WorkerInfo`), the requests this
cluster has in flight on it (`load`), whether it drains, and its last stats (`WorkerStats`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
import uuid

import ray
from ray.exceptions import RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.config import EngineConfig

from ..aio import within
from ..placement.pool_view import PoolView
from ..records import WorkerRecord, WorkerRefused
from ..spec.cluster_spec import ClusterSpec
from ..spec.serving_config import ROLES
from ..workers.output_pipe import PipeAddress
from ..workers.shard_actor import RankPlacement
from ..workers.worker_actor import WorkerActor
from .autoscale import LatencyWindow, PoolState
from .pool_monitor import PoolMonitor
from .ratio import RatioPlanner

log = logging.getLogger(__name__)


class Pools(PoolMonitor, PoolView):
    def __init__(self, spec: ClusterSpec, actor_options: dict, registry, bind_host: str | None = None):
        """The pools `spec` describes (its serving config, each pool's engine spec and the mode,
        read there: `serving`, `specs`). `actor_options`: Ray options per role. `bind_host`: where
        the workers' KV stores listen (None: each node's address)."""
        serving = spec.serving
        self.cluster_spec, self.serving, self.specs, self.mode = spec, serving, spec.engines, spec.mode
        self.bind_host = bind_host
        self.worker_cls = WorkerActor  # the actor class (fault-injection tests use a subclass)
        self.output_pipe: PipeAddress | None = None  # the router's OutputPipe address, given to workers
        self.progress = lambda message: None  # told each worker that starts (the CLI prints it)
        self.actor_options = actor_options
        self.namespace, self.registry, self.start_timeout = spec.namespace, registry, spec.start_timeout
        self.workers: dict[str, WorkerRecord] = {}
        self.leaving: dict[str, WorkerRecord] = {}  # out of placement, not yet killed (remove() runs)
        self.targets = {"prefill": 0, "decode": 0}
        self._ids = itertools.count()
        self._persist_slots: set[str] = set()  # kv_persist_dir subfolders of live workers
        window = serving.autoscale.window_s
        self.ttft, self.itl = LatencyWindow(window), LatencyWindow(window)  # fed by the dispatcher
        self.autoscale_events: list[dict] = []
        self.switch_events: list[dict] = []
        self._pool_state = {role: PoolState() for role in ROLES}
        self.ratio = RatioPlanner(window, serving.autoscale.cooldown_s) if serving.autoscale.policy == "ratio" else None
        self._scaling = asyncio.Lock()
        self._refill: asyncio.Future | None = None  # the monitor's refill to the targets, while it runs
        self.closed = False
        self.monitor_error: str | None = None  # the last monitor pass's failure, if it failed
        self.start_s = 10.0  # EWMA of a worker's start (actor to serving): a 503's Retry-After
        self.unresponsive_s = 30.0  # a live worker silent this long is purged (pool_monitor.py)
        self.pass_checks: list = []  # async callables each monitor pass runs beside its probes

    # ---- views (PoolView's: worker, members, ahead_of, candidates) ------------------------------
    def pool_sizes(self) -> dict:
        return {r: len(self.members(r)) for r in ROLES}

    # ---- sizes --------------------------------------------------------------------------------
    async def scale(self, want: dict, switch_roles: bool = False) -> dict:
        """Sets the pools' targets. switch_roles: reach them by moving workers between the
        pools (drain, switch, re-register; no worker starts or stops), which needs the same
        total."""
        async with self._scaling:
            moves = self._plan_switches(want) if switch_roles else []
            for role, n in want.items():
                if n is not None:
                    self.targets[role] = n
            for w, role in moves:
                w.switching_to = role
            drains = await self._reconcile()
        # outside the lock: a long drain blocks no other scaling
        await asyncio.gather(*drains, *(self._switch(w, role) for w, role in moves))
        return self.pool_sizes()

    def _plan_switches(self, want: dict) -> list[tuple[WorkerRecord, str]]:
        if self.mode == "colocated":
            raise ValueError("colocated engines have no role to switch")
        sizes = self.pool_sizes()
        new = {r: sizes[r] if want.get(r) is None else want[r] for r in ROLES}
        if sum(new.values()) != sum(sizes.values()):
            raise ValueError(f"switching roles keeps the number of workers ({sum(sizes.values())}): "
                             f"asked for prefill={new['prefill']} decode={new['decode']}")
        moves = []
        for donor in ROLES:
            to = ROLES[1 - ROLES.index(donor)]
            extra = sizes[donor] - new[donor]
            # a worker started for the target pool first (back to its first role), then the least loaded
            idle_first = sorted((w for w in self.members(donor) if w.switching_to is None),
                                key=lambda w: (w.first_role != to, w.load, w.worker_id))
            moves += [(w, to) for w in idle_first[:max(0, extra)]]
        return moves

    async def retune(self, role: str, slo_tpot_s: float | None) -> None:
        """The pool's workers take a new TPOT target (their step budget follows it)."""
        await asyncio.gather(*(w.actor.retune.remote(slo_tpot_s) for w in list(self.workers.values())
                               if w.role == role), return_exceptions=True)

    def spec(self, role: str, **changes) -> EngineConfig:
        """A new `role` worker's engine spec (with `changes`). Decode workers that prefill too
        (hybrid: what placement lends them; colocated: every prompt) take the serving SLO's TPOT
        target as it is now: it lives in `serving.slo` alone (POST /admin/slo changes it there)."""
        if role == "decode" and self.mode in ("hybrid", "colocated"):
            changes["slo_tpot_s"] = self.serving.slo.tpot_s
        return self.specs.worker(role, **changes)

    async def _switch(self, w: WorkerRecord, role: str) -> None:
        """Drains `w` (placement already skips it), then switches its role; on failure it
        goes back to its old pool."""
        try:
            await self._wait_drained(w)
            info = await w.actor.switch_role.remote(role, self.spec(role))
            w.info = dataclasses.replace(info, persist_slot=w.info.persist_slot if w.info else None)  # its tier stays
            self.switch_events.append({"time": time.time(), "worker": w.worker_id, "from": w.role, "to": role})
            log.warning("worker %s switched %s -> %s", w.worker_id, w.role, role)
            w.role = role
        except BaseException:
            self.targets[role] -= 1  # it stays where it was
            self.targets[w.role] += 1
            raise
        finally:
            w.switching_to = None

    async def _reconcile(self) -> list:
        """Starts workers up to the targets (awaited) and marks the surplus draining; returns
        the drain tasks."""
        adds, drains = [], []
        for role in ROLES:
            live = self.members(role) + self._reclaim(role, self.targets[role] - len(self.members(role)))
            for _ in range(self.targets[role] - len(live)):
                adds.append(self._add_worker(role))
            stay = sorted(live, key=lambda w: (w.switching_to is None, w.worker_id), reverse=True)
            for w in stay[: max(0, len(live) - self.targets[role])]:
                w.draining = True
                w.drain = asyncio.ensure_future(self._drain_and_remove(w))
                drains.append(w.drain)
        if adds:
            await asyncio.gather(*adds)
        return drains

    async def _add_worker(self, role: str) -> WorkerRecord:
        label = "colocated" if self.mode == "colocated" else role  # its persistence slot's kind
        wid = f"w{next(self._ids)}-{uuid.uuid4().hex[:4]}"  # the worker, whatever role it has now or later
        opts, tp = dict(self.actor_options[role]), self.tp(role)
        spec, slot = self.spec(role), None
        if spec.kv_persist_dir:  # one file per worker slot, found again after a restart or by a
            # replacement: the lowest slot no live worker of this kind holds
            slot = next(f"{label}-{i}" for i in itertools.count() if f"{label}-{i}" not in self._persist_slots)
            self._persist_slots.add(slot)  # taken now: workers start concurrently
            spec = self.spec(role, kv_persist_dir=os.path.join(spec.kv_persist_dir, slot))
        pg = ranks = None
        if tp > 1:
            pg = await self._placement_group(wid, role, tp)
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
            ranks = RankPlacement(pg, opts.get("num_gpus", 0), opts.get("num_cpus", 0), opts.get("runtime_env"))
        t0 = time.monotonic()
        cls = ray.remote(self.worker_cls).options(name=wid, namespace=self.namespace, max_concurrency=1000, **opts)
        actor = cls.remote(wid, role, spec, self.namespace, ranks=ranks, bind_host=self.bind_host,
                           handoff=self.serving.handoff, output_pipe=self.output_pipe,
                           cluster_id=self.registry.cluster_id)
        try:
            info = await within(actor.start.remote(), self.start_timeout)
        except (asyncio.TimeoutError, RayError) as e:
            ray.kill(actor)
            if slot is not None:
                self._persist_slots.discard(slot)
            if pg is not None:
                remove_placement_group(pg)
            if isinstance(getattr(e, "cause", None), WorkerRefused):  # the engine's own words, one line
                raise WorkerRefused(f"{role} worker: {e.cause}") from None
            if isinstance(e, RayError):
                raise
            raise RuntimeError(f"{role} worker did not start within {self.start_timeout:.0f} s: no node offers "
                               f"{self.actor_options[role]} (is the autoscaler at its node type's max?)") from None
        if slot is not None:
            info = dataclasses.replace(info, persist_slot=slot)
        w = WorkerRecord(wid, role, actor, info, placement_group=pg)
        self.workers[wid] = w
        self.start_s = 0.7 * self.start_s + 0.3 * (time.monotonic() - t0)
        log.info("worker %s started", wid)
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in info.startup.parts()) if info.startup else ""
        self.progress(f"{role} worker {wid} ready ({time.monotonic() - t0:.1f} s{': ' + parts if parts else ''})")
        tier = info.kv_persist_status
        if tier and ("refused" in tier or not tier.startswith("restored")):  # in the server's own log too
            log.warning("worker %s: persisted KV tier: %s", wid, tier)
        return w

    def tp(self, role: str) -> int:
        return self.specs.tp(role)

    def _bundles(self, role: str, tp: int) -> list[dict]:
        """One bundle per rank, each what one rank's actor asks for; the pool's custom
        resource on bundle 0 only (rank 0 is the worker the pool's node type hosts)."""
        opts = self.actor_options[role]
        base = {k: opts[o] for k, o in (("GPU", "num_gpus"), ("CPU", "num_cpus")) if opts.get(o)}
        bundles = [{**base, **(opts.get("resources") or {})}] + [dict(base) for _ in range(tp - 1)]
        return [b or {"CPU": 0.01} for b in bundles]  # a bundle must hold something

    async def _placement_group(self, wid: str, role: str, tp: int):
        """The worker's N ranks packed on one node (their all-reduces stay on NVLink)."""
        pg = placement_group(self._bundles(role, tp), strategy="STRICT_PACK", name=f"pdserve-{wid}")
        try:
            await within(pg.ready(), self.start_timeout)
        except asyncio.TimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(f"{role} worker of tensor_parallel_size {tp}: no node offers {self._bundles(role, tp)} "
                               f"on one node within {self.start_timeout:.0f} s") from None
        return pg

    def _reclaim(self, role: str, short: int) -> list[WorkerRecord]:
        """Up to `short` workers draining to leave `role`'s pool (a shrink) that still answer go
        back into it, their drains called off: a member died during the shrink, and a worker
        that serves now beats a replacement that starts in a minute."""
        back = [w for w in self.workers.values() if w.role == role and w.drain is not None and w.silent_since is None]
        for w in back[:max(0, short)]:
            log.warning("worker %s stops draining: the %s pool needs it again", w.worker_id, role)
            w.drain.cancel()
            w.drain, w.draining = None, False
        return back[:max(0, short)]

    async def _drain_and_remove(self, w: WorkerRecord) -> None:
        """A shrink's drain: once `w` holds nothing it is removed. `_reclaim` may call it off
        while it waits (the task ends; the worker stays)."""
        try:
            await self._wait_drained(w)
        except asyncio.CancelledError:
            if w.draining:  # not a reclaim: the cluster is going down
                raise
            return
        w.drain = None
        await self.remove(w, graceful=True)

    def kill(self, w: WorkerRecord) -> None:
        """Kills the worker's actor now (no stop), and its shard actors with its placement group."""
        if self.leaving.pop(w.worker_id, None) is None:
            return  # killed already
        try:
            ray.kill(w.actor)
        except Exception:  # noqa: BLE001
            pass
        if w.placement_group is not None:
            try:
                remove_placement_group(w.placement_group)
            except Exception:  # noqa: BLE001 - removed already
                pass

    @staticmethod
    async def _wait_drained(w: WorkerRecord, timeout: float = 300) -> None:
        """Until the worker holds no request (or is gone, or `timeout` passed)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                st = await within(w.actor.stats.remote(), 10)
            except (RayError, asyncio.TimeoutError):
                return  # gone already
            if w.load == 0 and st.inflight == 0 and st.held_for_handoff == 0:
                return
            await asyncio.sleep(0.2)

    async def remove(self, w: WorkerRecord, graceful: bool) -> None:
        """Out of placement at once; then (graceful) its stop, its kill, its placement group and
        its registration go. Until the kill it stays in `leaving`, which shutdown kills outright:
        a removal cut short by the cluster going down leaves no actor behind."""
        self.workers.pop(w.worker_id, None)
        self.leaving[w.worker_id] = w
        if graceful:
            try:
                await within(w.actor.stop.remote(), 15)
            except (RayError, asyncio.TimeoutError):
                pass
        for other in self.workers.values():  # peers drop their pair groups with it
            other.actor.forget_peer.remote(w.worker_id)
        self.kill(w)
        await self.registry.unregister(w.worker_id)
        # stopped: a replacement takes its tier over
        self._persist_slots.discard(w.info.persist_slot if w.info else None)
