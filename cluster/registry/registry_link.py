"""The cluster's side of the block registry (registry.py): `RegistryLink`, a guarded handle
that placement asks through, and the probe that keeps the registry alive (restarted by Ray,
killed when frozen, created again when gone)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..aio import within
from ..records import RegisteredWorker
from .registry import REGISTRY_NAME, BlockRegistry, PrefixRun, named_actor

log = logging.getLogger(__name__)


STABLE_S = 30.0  # up this long, a registry's earlier kills are forgotten (RegistryLink.kills)


class RegistryLink:
    """The cluster's handle on the registry, for a registry that may die.

    Lifecycle: `create()` starts the named actor with unlimited restarts. `runs`
    answers from it within `call_timeout_s`, else with no runs (that placement goes by
    consistent hash with bounded load): a late answer is a busy registry, not a lost one, and
    only the probe judges liveness (`slow_calls` counts them). A call that fails (the actor
    died) marks the registry down, and while it is down placement gets no runs at once without
    asking. The pools' monitor calls `check()` every second. The registry answers the probe's
    ping on a thread of its own (registry.CONCURRENCY_GROUPS), so the ping measures whether
    the process runs, not how long its queue is. It
    keeps one ping in flight and never abandons it for a new one: a registry that answers it,
    however late (a busy host), is up again. One whose name is gone (killed for good) is
    created anew under the same name (the workers look it up again). A ping still unanswered is
    judged by Ray's own state of the actor (the GCS actor table): ALIVE with the ping unanswered
    for `frozen_s` (counted from the later of the ping and the actor's ALIVE) is frozen, and is
    killed so that Ray restarts it; one Ray is still starting (RESTARTING, PENDING_CREATION) is
    not frozen, however slow its start on a busy machine, and is killed only after `start_s`.
    Each kill doubles the next allowance (up to 16x); the count starts again only once the
    registry has been up for `STABLE_S`, so a registry that answers once after each restart and
    then goes silent again is not killed at the first allowance every time. `state()` is what
    /health reports. (A fresh 2 s ping each second, abandoned on timeout, could take a live registry on a
    loaded host for frozen: an answer later than 2 s never counted, and each kill cost a restart.)"""

    def __init__(self, namespace: str, call_timeout_s: float = 1.0, frozen_s: float = 10.0,
                 start_s: float = 120.0):
        self.namespace, self.call_timeout_s, self.frozen_s, self.start_s = namespace, call_timeout_s, frozen_s, start_s
        self.actor_class = BlockRegistry  # the actor `create()` starts (a subclass declares CONCURRENCY_GROUPS too)
        self.cluster_id = uuid.uuid4().hex[:12]  # every incarnation of the registry serves this cluster
        self.actor = None
        self.down_since: float | None = None  # monotonic time of the first failure of this outage
        self.reason: str | None = None
        self.outages = 0  # outages seen since the cluster started
        self.recreated = 0  # times the registry was created anew (its name was gone)
        self.restarts = 0  # times another process answered the probe (Ray restarted the actor, or it was recreated)
        self.waiting_since: float | None = None  # when the wait in the actor's present state began
        self.alive: bool | None = None  # the actor's Ray state at the last probe: ALIVE, or being started
        self.kills = 0  # kills since the registry was last up for STABLE_S: each doubles the next allowance
        self.up_since: float | None = None  # when the registry last came up (monotonic)
        self.slow_calls = 0  # calls answered after their timeout (placed without runs)
        self.closed = False
        self._ping = None  # the probe's ping in flight, and when it was sent (monotonic)
        self._ping_sent = 0.0
        self.pid: int | None = None  # the process that last answered the probe
        self.node: str | None = None  # the address of the node it is bound to (create())
        self.killed_pid: int | None = None  # the process the probe last killed: its answers are not a restart's

    def create(self):
        """Starts the registry on the router's node: placement asks it on every request, and a
        worker host lost takes no registry with it. (On three hosts Ray's default placement, and
        also a soft affinity to this node, put it on a worker host; the router's node going
        away takes the router with it, so the hard affinity costs nothing.)"""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.node = ray.util.get_node_ip_address()
        self.actor = self.actor_class.options(name=REGISTRY_NAME, namespace=self.namespace, max_restarts=-1,
                                              scheduling_strategy=here).remote(cluster_id=self.cluster_id)
        return self.actor

    @property
    def up(self) -> bool:
        return self.down_since is None

    def state(self) -> dict:
        out = {"status": "ok" if self.up else "restarting", "node": self.node, "outages": self.outages,
               "recreated": self.recreated, "restarts": self.restarts, "slow_calls": self.slow_calls}
        if not self.up:
            out.update(down_s=round(time.monotonic() - self.down_since, 1), reason=self.reason)
        return out

    def _down(self, why: str) -> None:
        if self.up:
            self.down_since, self.outages = time.monotonic(), self.outages + 1
            self.waiting_since, self.alive = self.down_since, None
            if self.up_since is None or self.down_since - self.up_since >= STABLE_S:
                self.kills = 0
            log.warning("block registry unavailable (%s): placing without prefix hints until it is back", why)
        self.reason = why

    def _up(self) -> None:
        if not self.up:
            log.warning("block registry back after %.1f s", time.monotonic() - self.down_since)
            self.up_since = time.monotonic()
        elif self.up_since is None:
            self.up_since = time.monotonic()
        self.down_since, self.reason = None, None

    async def _call(self, ref, timeout: float):
        try:
            return await within(ref, timeout)
        except asyncio.TimeoutError:
            self.slow_calls += 1
            log.debug("block registry: no answer within %g s (busy); placed without its runs", timeout)
        except RayError as e:
            self._down(type(e).__name__)
        return None

    async def runs(self, hashes: list[str]) -> dict[str, PrefixRun] | None:
        """The registry's runs of these hashes per worker (BlockRegistry.runs). None where it gave
        no answer: away, or busy past `call_timeout_s` (placement then goes without prefix hints,
        and its timeline entry says so)."""
        if not hashes:
            return {}
        if not self.up:
            return None
        return await self._call(self.actor.runs.remote(hashes), self.call_timeout_s)

    async def unregister(self, worker_id: str) -> None:
        if self.up:
            await self._call(self.actor.unregister.remote(worker_id), 5.0)

    async def list_workers(self) -> list[RegisteredWorker] | None:
        return await self._call(self.actor.list_workers.remote(), 10.0)

    async def check(self) -> None:
        """The monitor's probe (every second): up, being started, frozen (kill: Ray restarts it)
        or gone (create it again). Nothing it meets raises: the monitor's pass goes on."""
        if self.closed:
            return
        try:
            await self._check()
        except Exception as e:  # noqa: BLE001 - e.g. the GCS slow to answer on a busy host
            self._down(f"probe failed: {type(e).__name__}")
            log.warning("block registry probe failed (%s: %s); the next one runs in 1 s", type(e).__name__, e)

    async def _check(self) -> None:
        if self._ping is None:
            self._ping, self._ping_sent = self.actor.ping.remote(), time.monotonic()
        answer = asyncio.wrap_future(self._ping.future())  # a new waiter on the same ping
        answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late error is no news
        done, _ = await asyncio.wait({answer}, timeout=2.0)
        if done:
            err, self._ping = answer.exception(), None
            if err is None and answer.result() == self.killed_pid:
                return  # the killed process, not dead yet (a ray.kill takes its time): the restart's wait goes on
            if err is None:
                if self.pid is not None and answer.result() != self.pid:
                    self.restarts += 1
                self.pid = answer.result()
                self._up()
                return
            self._down(type(err).__name__)
        else:  # still in flight: kept, never replaced by a new one
            self._down(f"no answer for {time.monotonic() - self._ping_sent:.0f} s")
        state, actor_pid = await asyncio.to_thread(self._actor_state)
        if state is None:  # dead for good (its restarts spent, or killed without restart)
            if self.closed:  # the cluster shut down while the probe waited: nothing is created again
                return
            log.warning("block registry gone: creating it again")
            self._ping = None
            self.create()
            self.recreated += 1
            self.waiting_since, self.alive = time.monotonic(), False  # the new actor's start is its own time
            return
        if (state == "ALIVE") != self.alive:  # a state's clock starts when the actor enters it
            self.alive, self.waiting_since = state == "ALIVE", time.monotonic()
        since = max(self.waiting_since, self._ping_sent) if self.alive and self._ping is not None else \
            self.waiting_since
        waited = time.monotonic() - since
        allowed = (self.frozen_s if self.alive else self.start_s) * 2 ** min(self.kills, 4)
        if waited > allowed:
            log.warning("block registry %s for %.0f s: killing it so that Ray restarts it",
                        "silent" if self.alive else f"stuck in {state}", waited)
            ray.kill(self.actor, no_restart=False)
            self.kills += 1
            # the process Ray holds as the actor now: the probe may never have heard from it (frozen
            # before its first answer), and once SIGCONT'd it may answer a ping before Ray ends it
            self.killed_pid = actor_pid or self.pid
            self._ping = None
            self.waiting_since, self.alive = time.monotonic(), None  # the restart's start is its own time

    def _actor_state(self) -> tuple[str | None, int | None]:
        """Ray's state of the registry actor (ALIVE, RESTARTING, PENDING_CREATION, ...), or None
        when its name is gone, and the process Ray holds for it (None where unknown). The GCS
        actor table is read through `ray._private.state` (the public state API needs the
        dashboard, which pdserve's Ray runs without); should that fail, the actor counts as
        ALIVE, so a silent one is still killed after `frozen_s`."""
        try:
            named_actor(REGISTRY_NAME, self.namespace)
        except ValueError:
            return None, None
        try:
            from ray._private import state as ray_state
            row = ray_state.actors(self.actor._actor_id.hex())
            return (None if row["State"] == "DEAD" else row["State"]), (row.get("Pid") or None)
        except Exception as e:  # noqa: BLE001
            log.debug("the registry's Ray state is unreadable (%s): taken as ALIVE", e)
            return "ALIVE", None

    def kill(self) -> None:
        self.closed = True
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001
            pass
