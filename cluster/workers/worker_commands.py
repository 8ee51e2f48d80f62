"""The commands a worker actor's async methods post to its engine thread (worker_actor.py),
named in one place: the engine thread takes them off `inbox` in order, between steps.

    Add         a request, with its decode (prefill role) or prefill (decode role) peer, and
                the peer to fetch its prefix from (a FetchPlan), if any
    Abort       stop a request wherever it is; its caller gets Aborted
    ForgetPeer  a peer worker is gone: drop its KV pairs (or, receive only, its sender lost
                their pair: the next handoff from it runs on a new gen)
    SwitchRole  become the other role on the same engine once the old role holds nothing
                (the cluster drains it first; what was still on its way there finishes
                before the switch, up to the command's deadline)

Anything else posted is a callable the engine thread runs between steps (retune).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.engine.validation import ValidRequest


class Aborted(RuntimeError):
    """A request the dispatcher aborted (a client gone, a failed attempt): its prefill() fails
    with it; its generate() stream just ends."""


@dataclass
class Add:
    request_id: str
    request: ValidRequest  # validated at the edge (engine/validation.py)
    peer: str | None
    fetch: object = None  # a transfer.fetch.FetchPlan: its prefix fetched from that peer first


@dataclass
class Abort:
    request_id: str


@dataclass
class ForgetPeer:
    peer: str
    sends: bool = True  # False: only the pairs receiving from it


SWITCH_WAIT_S = 60.0  # how long a switch waits for what reached a drained worker late


@dataclass
class SwitchRole:
    role: str
    spec: EngineConfig  # the new pool's: its slo_tpot_s and max_num_batched_tokens
    done: object  # a future on the actor's loop: the new info, or the error
    deadline: float = float("inf")  # time.monotonic() past which a worker still busy refuses


class AbortLog:
    """The wire ids aborted on a worker (never reused: each attempt has its own), the newest
    `kept`. An async actor runs one caller's calls in any order, so an abort may come before its
    request: the request then never starts there, instead of generating for a client that left."""

    def __init__(self, kept: int = 65536):  # ~5 MB: far more than can be in flight at once
        self.kept, self.ids = kept, collections.OrderedDict()

    def add(self, request_id: str) -> None:
        self.ids[request_id] = None
        while len(self.ids) > self.kept:
            self.ids.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids
