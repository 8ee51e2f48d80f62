"""The KV links that are down, checked each monitor pass (`LinkCheck`): a (prefill, decode) pair
that Placer.link_down took out of placement is probed from the prefill worker's host
(WorkerActor.reaches, a TCP connect to the decode worker's KV address: transfer/probe.py).

    answers        the pair is back now (Placer.link_up)
    refuses        it stays out (Placer.link_down: LINK_DOWN_S from now)
    no verdict     the prefill worker did not answer within PROBE_S + 1: left to LINK_DOWN_S
    a worker left  the pair is forgotten

Why: a verdict taken in a partition's last second held the healed pair out for LINK_DOWN_S more
(10 s); the probe takes it back within a pass of the link's return.
"""

from __future__ import annotations

import asyncio

from ray.exceptions import RayError

from pdserve.transfer.probe import PROBE_S

from ..aio import within
from ..placement.placement import Placer
from ..records import WorkerRecord


class LinkCheck:
    def __init__(self, placer: Placer, workers: dict[str, WorkerRecord]):
        """`workers`: the pools' live workers by id (Pools.workers, read at each check)."""
        self.placer, self.workers = placer, workers

    async def __call__(self) -> None:
        await asyncio.gather(*(self._check(p, d) for p, d in self.placer.down_pairs()))

    async def _check(self, pid: str, did: str) -> None:
        p, d = self.workers.get(pid), self.workers.get(did)
        if p is None or d is None or d.info is None:
            self.placer.link_up(pid, did)
            return
        try:
            up = await within(p.actor.reaches.remote(d.info.address), PROBE_S + 1)
        except (RayError, asyncio.TimeoutError):
            return
        (self.placer.link_up if up else self.placer.link_down)(pid, did)
