"""The interface every role of the engine offers to the loop that drives it (the Ray
worker actor, or a test): requests in, events out, one non-blocking step at a time.

    add(request_id, prompt_token_ids, params, peer, fetch)   queue a request (validated first);
                  `fetch` (a transfer.fetch.FetchPlan): its prefix is fetched from a peer first
    step()        one engine step plus the handoffs' progress -> list of events
    abort(rid)    stop the request wherever it is; its blocks are freed
    num_inflight  requests this role still holds (a drain waits for 0)
    has_work()    an engine step to run now (else the driver sleeps: ~5 ms while requests
                  are in flight, polling their handoffs; longer when idle)

Events (what the driver forwards; nothing else leaves a role):
    Emitted(output)             a delta output for the request's stream
    Reserved(rid, peer, target) decode: blocks are reserved and the receive posted; the
                                prefill worker `peer` must learn the target
    Sent(rid, result)           prefill: the request's handoff is over (a HandoffResult);
                                its blocks are released
    Failed(rid, error)          the request could not go on here (error names why)
    Fetching(fid, peer, hashes, target)  a peer fetch's receive is posted: the holder `peer`
                                must learn the target (transfer/fetch.py)

Roles: pdserve.prefill.role.PrefillRole, pdserve.decode.role.DecodeRole.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from .outputs import RequestOutput
from .validation import ValidRequest


@dataclass
class Emitted:
    output: RequestOutput


@dataclass
class Reserved:
    request_id: str
    peer: str
    target: HandoffTarget


@dataclass
class Fetching:
    """A peer fetch's receive is posted (transfer/fetch.py): the holder `peer` must learn the
    target and the run of block hashes (hex) to send under the fetch's id."""
    request_id: str
    peer: str
    hashes: list[str]
    target: HandoffTarget


class TransferState(enum.IntEnum):
    """Where a KV handoff is (transfer/base.Handoff): waiting for its turn, moving, DONE or FAILED."""
    WAITING = 0
    TRANSFERRING = 1
    DONE = 2
    FAILED = 3

    @property
    def finished(self) -> bool:
        return self >= TransferState.DONE


@dataclass(frozen=True)
class Channel:
    """Where a handoff goes: the generation of its pair's process group (a new one after
    any failure), assigned by the receiver when it reserves blocks."""

    gen: int


@dataclass(frozen=True)
class RankTarget:
    """One rank of a tensor-parallel receiver: its name, its transfer address and, per sender
    rank (by name), the channel generation it assigned that sender; `gens` None: the target's
    own channel (a single-GPU receiver)."""

    name: str
    address: str
    gens: dict[str, int] | None = None


@dataclass(frozen=True)
class HandoffTarget:
    """Where a sender's handoff goes: the receiver's name and transfer address, the
    channel it assigned, and how many leading blocks it already holds (prefix hits,
    never sent). The receiver makes it when it reserves blocks."""

    peer: str
    address: str
    channel: Channel
    num_skip: int
    # a tensor-parallel receiver: each of its ranks, in rank order (rank 0's is peer/address/
    # channel above); empty for a single-GPU receiver
    ranks: tuple[RankTarget, ...] = ()

    @property
    def tp(self) -> int:
        return max(1, len(self.ranks))


@dataclass(frozen=True)
class HandoffResult:
    """A prefill worker's report of one finished send, what its caller (the dispatcher) and the
    metrics read: its state (DONE or FAILED), the error, bytes moved, seconds from the start
    of the send to its end, the prefill side's spans (wall-clock times by name), the link
    that moved it (transfer: cuda-ipc, shared-memory, nccl, gloo), and whether it failed with
    its pair (`pair_lost`: the receiver must close its side before a retry on the same pair), and
    whether the receiver's host stopped answering (`unreachable`: the link between them is down),
    and how many of the prompt's tokens its prefix cache held (`cached_tokens`: not computed)."""
    state: TransferState
    error: str | None = None
    nbytes: int = 0
    seconds: float | None = None
    spans: dict[str, float] = field(default_factory=dict)
    link: str | None = None
    pair_lost: bool = False
    unreachable: bool = False
    cached_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.state is TransferState.DONE


@dataclass
class Sent:
    request_id: str
    result: HandoffResult


@dataclass
class Failed:
    request_id: str
    error: str


Event = Emitted | Reserved | Sent | Failed | Fetching


class Role(ABC):
    @abstractmethod
    def add(self, request_id: str, request: ValidRequest, peer: str | None = None, fetch=None) -> None:
        """Queues a request, validated at the edge (the engine checks its own KV capacity).
        `peer`: the worker on the other side of its handoff (prefill: the decode worker to
        send to; decode: the prefill worker to receive from); None for a request that stays
        on this worker. `fetch`: a transfer.fetch.FetchPlan for a request prefilled here,
        whose prefix a peer caches. Raises ValueError on bad input."""

    @abstractmethod
    def step(self) -> list[Event]:
        """One engine step (if there is work) and the handoffs' progress; never blocks."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stops the request here and frees its blocks; unknown ids are ignored."""

    @property
    @abstractmethod
    def num_inflight(self) -> int:
        """Requests still held here: queued, running, waiting for KV or for a handoff."""

    @abstractmethod
    def has_work(self) -> bool:
        """True when step() has an engine step to run now."""
