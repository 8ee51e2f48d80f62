"""The commands a worker actor's async methods post to its engine thread (worker_actor.py),
named in one place: the engine thread takes them off `inbox` in order, between steps.

    Add         a request, with its decode (prefill role) or prefill (decode role) peer, and
                the peer to fetch its prefix from (a FetchPlan), if any
    Abort       stop a request wherever it is; its caller gets Aborted
    ForgetPeer  a peer worker is gone: drop its KV pair
    SwitchRole  become the other role on the same engine (drained first)

Anything else posted is a callable the engine thread runs between steps (retune).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams


class Aborted(RuntimeError):
    """A request the dispatcher aborted (a client gone, a failed attempt): its prefill() fails
    with it; its generate() stream just ends."""


@dataclass
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    peer: str | None
    fetch: object = None  # a transfer.fetch.FetchPlan: its prefix fetched from that peer first


@dataclass
class Abort:
    request_id: str


@dataclass
class ForgetPeer:
    peer: str


@dataclass
class SwitchRole:
    role: str
    engine_kwargs: dict  # the new pool's slo_tpot_s and max_num_batched_tokens
    done: object  # a future on the actor's loop: the new info, or the error
