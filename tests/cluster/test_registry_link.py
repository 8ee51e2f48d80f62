"""The cluster's probe of the block registry (`RegistryLink.check`) against a real Ray actor:
a registry that Ray is still restarting is left to start, however slowly; one that is alive
and silent is frozen and killed, so that Ray restarts it."""
import asyncio
import os
import signal
import tempfile
import time
import uuid

import pytest
import ray

from pdserve.cluster.registry.registry import CONCURRENCY_GROUPS, BlockRegistry
from pdserve.cluster.registry.registry_link import RegistryLink

pytestmark = pytest.mark.usefixtures("shared_ray")


START_S = 4.0


def _slow_marker(namespace: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{namespace}.slow")


@ray.remote(num_cpus=0, concurrency_groups=CONCURRENCY_GROUPS)
class SlowStartRegistry(BlockRegistry.__ray_actor_class__):
    """The block registry, whose process takes START_S to start while its namespace's marker file
    exists (as a restart does on a loaded machine: a fresh Python process importing torch and Ray)."""

    def __init__(self, **kw):
        if os.path.exists(_slow_marker(ray.get_runtime_context().namespace)):
            time.sleep(START_S)
        super().__init__(**kw)


def _probe_until(link: RegistryLink, cond, timeout: float) -> None:
    async def run():
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"not within {timeout} s: {link.state()}, kills {link.kills}"
            await link.check()
            await asyncio.sleep(0.2)
    asyncio.run(run())


@pytest.fixture
def link():
    """A RegistryLink (frozen_s 0.5 s) on a SlowStartRegistry of its own namespace, answering."""
    link = RegistryLink(f"registry-link-{uuid.uuid4().hex[:8]}", frozen_s=0.5, start_s=60.0)
    link.actor_class = SlowStartRegistry
    link.create()
    assert ray.get(link.actor.ping.remote(), timeout=60)
    yield link
    link.kill()
    if os.path.exists(_slow_marker(link.namespace)):
        os.remove(_slow_marker(link.namespace))


def test_a_registry_slow_to_restart_is_not_taken_for_frozen(link):
    """SIGKILL the registry, whose restart takes 4 s, against a 0.5 s `frozen_s`: the probe sees
    Ray restarting it, kills nothing, and the restarted registry (a new process) answers."""
    pid = ray.get(link.actor.ping.remote(), timeout=30)
    open(_slow_marker(link.namespace), "w").close()
    os.kill(pid, signal.SIGKILL)
    _probe_until(link, lambda: not link.up, 30)
    _probe_until(link, lambda: link.up, 60)
    assert link.kills == 0
    assert ray.get(link.actor.ping.remote(), timeout=30) != pid


def test_a_registry_alive_and_silent_is_killed_and_restarted(link):
    """SIGSTOP the registry: Ray still reports it ALIVE, it answers nothing, and after `frozen_s`
    the probe kills it; Ray restarts it and the new process answers."""
    pid = ray.get(link.actor.ping.remote(), timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        _probe_until(link, lambda: link.kills >= 1, 30)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    # up means the restarted process answered: the killed one, SIGCONT'd while Ray ends it, may
    # still answer a ping first (CI saw the link 'back' on it, then Ray's 'actor is restarting')
    # the link never heard from the frozen process (the fixture pinged it, not the probe): the
    # process it killed is the one Ray held for the actor, so that process's late answers are no restart
    assert link.killed_pid == pid
    _probe_until(link, lambda: link.up, 60)
    assert link.kills == 1 and link.pid != pid
    assert ray.get(link.actor.ping.remote(), timeout=30) == link.pid


BUSY_S = 1.5


@ray.remote(num_cpus=0, concurrency_groups=CONCURRENCY_GROUPS)
class BusyRegistry(BlockRegistry.__ray_actor_class__):
    """The block registry, each of whose `runs` calls takes BUSY_S (a backlog on a loaded host)."""

    def runs(self, hashes):
        time.sleep(BUSY_S)
        return super().runs(hashes)


def test_a_registry_busy_with_a_backlog_answers_the_probe_and_is_not_killed():
    """Six `runs` calls queued on the registry (9 s of work) against a 0.5 s `frozen_s`: the probe's
    ping is answered on the registry's own probe thread, so nothing is killed, the registry stays
    up, the router's late calls place without runs (`slow_calls`), and the queue is served by the
    same process. (Before, the ping waited behind the queue: the registry was killed as frozen,
    and each restart, busiest of all, was killed again.)"""
    link = RegistryLink(f"registry-link-{uuid.uuid4().hex[:8]}", call_timeout_s=0.2, frozen_s=0.5, start_s=60.0)
    link.actor_class = BusyRegistry
    link.create()
    try:
        pid = ray.get(link.actor.ping.remote(), timeout=60)
        queued = [link.actor.runs.remote(["a"]) for _ in range(5)]

        async def run():
            assert await link.runs(["a"]) is None  # late: placed without runs, not taken for a lost registry
            deadline = time.monotonic() + 4 * BUSY_S
            while time.monotonic() < deadline:
                await link.check()
                assert link.up, link.state()
                await asyncio.sleep(0.2)
        asyncio.run(run())
        assert link.kills == 0 and link.outages == 0 and link.slow_calls == 1
        assert ray.get(queued, timeout=60) == [{}] * 5
        assert ray.get(link.actor.ping.remote(), timeout=30) == pid
    finally:
        link.kill()


def test_a_lookup_that_ray_gave_up_on_is_asked_once_more(link, monkeypatch):
    """Ray's GetTimeoutError on a named actor's lookup (its 60 s passed: once on a busy 2-core host, the
    GCS answering every other call) is one lost request: the lookup is asked again and finds the
    registry; a second timeout in a row is raised."""
    from ray.exceptions import GetTimeoutError

    from pdserve.cluster.registry.registry import REGISTRY_NAME, named_actor

    real, lost = ray.get_actor, []

    def lose(n):
        def get_actor(name, namespace=None):
            if len(lost) < n:
                lost.append(name)
                raise GetTimeoutError("There was timeout in getting the actor handle")
            return real(name, namespace=namespace)
        return get_actor

    monkeypatch.setattr(ray, "get_actor", lose(1))
    pid = ray.get(named_actor(REGISTRY_NAME, link.namespace).ping.remote(), timeout=30)
    assert lost == [REGISTRY_NAME] and pid == ray.get(link.actor.ping.remote(), timeout=30)
    lost.clear()
    monkeypatch.setattr(ray, "get_actor", lose(2))
    with pytest.raises(GetTimeoutError):
        named_actor(REGISTRY_NAME, link.namespace)
    with pytest.raises(ValueError):  # no actor of that name: not a timeout, not asked again
        named_actor("no-such-actor", link.namespace)
