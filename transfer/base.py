"""The transfer interface: a polled state machine per handoff, and the KV gather/scatter.

A handoff moves the KV blocks of one request from a prefill worker (sender) to a
decode worker (receiver):

    WAITING       queued: pairing with the peer, or waiting for its turn on the pair
    TRANSFERRING  the message is posted on the pair's process group
    DONE          sender: the data left, its block references may be dropped;
                  receiver: the blocks are written and usable
    FAILED        timeout, abort, dead peer or layout mismatch; `error` says which

An abort before the wire ends a handoff at once. One on the wire is either cut (its pair
dies with its group, and every handoff queued on that pair with it) or, asked with
`settle=True`, left to finish its messages: it then ends FAILED "aborted", the pair lives
on, and the caller frees the blocks when poll() returns it (`Abort.SETTLING`).

Worker loops call `poll()` between engine steps; it never blocks. Both sides name
a handoff by (peer, request_id). The receiver reserves blocks and posts its receive
first, then hands the sender a `HandoffTarget`: itself, its address, the `Channel` (the
pair's group generation) and how many leading blocks it already holds. The sender's
sends go in the order they start, which the backend makes the receiver follow (NCCL
matches sends and receives in the order they are posted). The sender's small JSON
`meta` (the first sampled token, its spans) travels with the KV and is the receiver's
`meta` once DONE.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

# a handoff's state and where it goes: the roles' events carry them (engine/ does not import transfer/)
from pdserve.engine.role import Channel, HandoffTarget, RankTarget, TransferState  # noqa: F401

from .records import WireLayout


class Abort(enum.IntEnum):
    """What `abort()` did. NONE: no handoff of that id in flight. ENDED: failed now; nothing
    touches its blocks any more. SETTLING: on the wire (asked with settle=True): it ends
    FAILED "aborted" once its messages are done with the blocks, and poll() returns it then."""

    NONE = 0
    ENDED = 1
    SETTLING = 2


@dataclass
class HandoffMeta:
    """What rides with a request's KV from its prefill worker to its decode worker: the first
    sampled token, its log-probs and the prompt's where they were asked for, and the prefill
    side's spans. A connector carries it as JSON: `to_wire()` writes it (log-prob maps as
    [token, value] pairs, since JSON keys are strings), `from_wire()` reads it back."""
    first_token: int
    spans: dict[str, float] = field(default_factory=dict)
    first_logprobs: dict[int, float] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int] | None = None

    def to_wire(self) -> dict:
        out: dict = {"first_token": int(self.first_token), "spans": self.spans}
        if self.first_logprobs is not None:
            out["first_logprobs"] = [[int(t), v] for t, v in self.first_logprobs.items()]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [e and [[int(t), v] for t, v in e.items()] for e in self.prompt_logprobs]
            out["prompt_ranks"] = self.prompt_ranks
        return out

    @classmethod
    def from_wire(cls, wire: dict) -> HandoffMeta:
        prompt = wire.get("prompt_logprobs")
        return cls(int(wire["first_token"]), dict(wire.get("spans") or {}),
                   None if wire.get("first_logprobs") is None else {int(t): v for t, v in wire["first_logprobs"]},
                   None if prompt is None else [e and {int(t): v for t, v in e} for e in prompt],
                   None if wire.get("prompt_ranks") is None else list(wire["prompt_ranks"]))


@dataclass(eq=False)
class Handoff:
    request_id: str
    peer: str
    block_ids: list[int]
    channel: Channel
    is_sender: bool
    timeout_s: float
    state: TransferState = TransferState.WAITING
    error: str | None = None
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    nbytes: int = 0
    # sender: what rides with the KV (None: nothing, as for a peer fetch); receiver: what arrived
    # (set when DONE). The pair's order carries it as JSON (HandoffMeta.to_wire / from_wire)
    meta: HandoffMeta | None = None
    _event: threading.Event = field(default_factory=threading.Event, repr=False)
    _ready: object = field(default=None, repr=False)  # CUDA event: no step before it touches the blocks any more
    # when the pair's thread took it up and when all its messages were posted (monotonic)
    t_started: float | None = None
    t_first_post: float | None = None
    t_posted: float | None = None
    # tensor parallel: the KV heads [lo, hi) of this rank's blocks that this handoff moves
    # (the peer moves as many of its own); None: all of them
    heads: tuple[int, int] | None = None
    # the pair's link that moved it: cuda-ipc | shared-memory (pulled) | nccl | gloo; None: no blocks
    link: str | None = None
    # aborted while on the wire, with settle=True: it ends FAILED "aborted" when its messages are done
    cancelled: bool = False
    # how long it may wait for the wire (a receive: for its sender's order, which comes when the
    # prompt's prefill is done); None: timeout_s
    wait_s: float | None = None
    # it failed with its pair (the pair's group died, or the channel was of a gen the sender had
    # retired): no later handoff on that gen can succeed, so the receiver must close its side
    # (KVConnector.forget_peer(sender, sends=False)) before the next one from this sender
    pair_lost: bool = False
    # it failed because its peer stopped answering a TCP connect on its store: the link between the
    # two hosts is down (c10d.C10dConnector's watchdog), not one handoff; placement avoids the pair
    unreachable: bool = False

    @property
    def deadline(self) -> float:
        """`wait_s` (default `timeout_s`) from its start for its turn on the wire, then `timeout_s`
        from when the pair's thread took it up."""
        if self.t_started is not None:
            return self.t_started + self.timeout_s
        return self.created + (self.timeout_s if self.wait_s is None else self.wait_s)

    def complete(self) -> bool:
        """DONE: the blocks moved (the receiver's `meta` is set first); FAILED "aborted" instead
        when it was cancelled on the wire. False if it had ended."""
        if self.cancelled:
            return self._end(TransferState.FAILED, "aborted")
        return self._end(TransferState.DONE)

    def fail(self, error: str, pair_lost: bool = False, unreachable: bool = False) -> bool:
        """FAILED with `error` (`pair_lost`: with its pair; `unreachable`: its peer's host does not
        answer); False if it had ended. The first to end it wins (a connector's thread racing an
        abort or a timeout)."""
        if self.state.finished:
            return False
        self.pair_lost, self.unreachable = pair_lost, unreachable
        return self._end(TransferState.FAILED, error)

    def _end(self, state: TransferState, error: str | None = None) -> bool:
        if self.state.finished:
            return False
        self.error = error
        self.finished_at = time.monotonic()
        self.state = state
        self._event.set()
        return True

    def wait(self, timeout: float | None = None) -> TransferState:
        """Blocks until finished (tests and benchmarks; worker loops poll instead)."""
        self._event.wait(timeout)
        return self.state

    def wall_spans(self, prefix: str) -> dict:
        """When the pair's thread took it up, posted it and finished it, as wall-clock
        seconds (time.time(), comparable across the host's processes)."""
        shift = time.time() - time.monotonic()
        marks = {"taken": self.t_started, "first_post": self.t_first_post, "posted": self.t_posted,
                 "done": self.finished_at}
        return {f"{prefix}_{k}": v + shift for k, v in marks.items() if v is not None}

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.created


def block_bytes(kv: torch.Tensor, heads: tuple[int, int] | None = None) -> int:
    """Bytes of one block of `kv`, or of its KV heads [lo, hi) only (a tensor-parallel route)."""
    whole = kv[0].numel() * kv.element_size()
    return whole if heads is None else whole // kv.shape[4] * (heads[1] - heads[0])


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    idx = torch.tensor(block_ids, dtype=torch.int64)
    if device.type == "cuda":  # pinned + async: no host sync on the copy (measured: -0.1 ms/chunk)
        return idx.pin_memory().to(device, non_blocking=True)
    return idx


def contiguous_run(block_ids: list[int]) -> bool:
    """Ascending consecutive ids: the blocks are one contiguous slice of the block-major
    KV tensor, so they can be sent from / received into place with no staging copy."""
    return block_ids[-1] - block_ids[0] == len(block_ids) - 1 and all(
        b - a == 1 for a, b in zip(block_ids, block_ids[1:]))


def gather_blocks(kv: torch.Tensor, block_ids: list[int] | torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """One contiguous staging buffer [n, layers, 2, block_size, kv_heads, head_dim] (`out`
    if given): block-major storage makes this a single index_select on the device.
    `block_ids`: a list, or an index tensor on kv's device (block_index)."""
    idx = block_ids if isinstance(block_ids, torch.Tensor) else block_index(block_ids, kv.device)
    return kv.index_select(0, idx) if out is None else torch.index_select(kv, 0, idx, out=out)


def scatter_blocks(kv: torch.Tensor, block_ids: list[int] | torch.Tensor, buf: torch.Tensor) -> None:
    idx = block_ids if isinstance(block_ids, torch.Tensor) else block_index(block_ids, kv.device)
    kv.index_copy_(0, idx, buf)


class StagingRing:
    """Two slots of up to `slot_blocks` blocks each, for the chunks of one handoff that are
    not a run of consecutive blocks."""

    def __init__(self, kv: torch.Tensor, slot_blocks: int, persistent: bool):
        self.kv, self.persistent = kv, persistent
        self.slots = [torch.empty((slot_blocks, *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
                      for _ in range(2)] if persistent else []

    def slot(self, i: int, num_blocks: int) -> torch.Tensor:
        if self.persistent:
            return self.slots[i][:num_blocks]
        return torch.empty((num_blocks, *self.kv.shape[1:]), dtype=self.kv.dtype, device=self.kv.device)


class StagingPool:
    """Staging rings shared by a connector's pairs: one per handoff in flight at a time,
    made on first need and kept (on CUDA; on CPU each handoff allocates its own)."""

    def __init__(self, kv: torch.Tensor, chunk_bytes: int):
        self.kv = kv
        self.slot_blocks = max(1, min(kv.shape[0], 2 * chunk_bytes // max(1, kv[0].numel() * kv.element_size())))
        self.keep = kv.device.type == "cuda"
        self.free: list[StagingRing] = []
        self.lock = threading.Lock()

    def acquire(self) -> StagingRing:
        with self.lock:
            if self.free:
                return self.free.pop()
        return StagingRing(self.kv, self.slot_blocks, self.keep)

    def release(self, ring: StagingRing) -> None:
        if self.keep:
            with self.lock:
                self.free.append(ring)


class KVConnector(ABC):
    """What a worker's roles use: a sender starts sends, a receiver posts receives (`receive`,
    which also names the target its sender needs), both poll them, abort one, forget a peer.
    Implementations: `PairConnector`s (one process's pairs with its peers) and
    `tp.TPConnector` (a tensor-parallel worker: routes over its ranks' pair connectors)."""

    name: str
    address: str  # where peers reach this connector (a TCPStore host:port for c10d)
    layout: WireLayout  # what peers must share, checked before the first handoff

    @abstractmethod
    def start_send(self, target: HandoffTarget, request_id: str, block_ids: list[int],
                   timeout_s: float | None = None, ready=None, meta: HandoffMeta | None = None,
                   heads: tuple[int, int] | None = None) -> Handoff:
        """Sends `block_ids` (the request's blocks after target.num_skip) and `meta` to the
        target. `ready`: a CUDA event recorded after the step that wrote the blocks
        (default: one recorded now on the caller's stream). `heads`: only that slice of
        the blocks' KV heads (tensor parallel, transfer/tp.py)."""

    @abstractmethod
    def receive(self, peer: str, request_id: str, block_ids: list[int], num_skip: int,
                timeout_s: float | None = None, wait_s: float | None = None) -> tuple[Handoff, HandoffTarget]:
        """Receiver: posts the receive of a handoff from `peer` into `block_ids`; returns it and
        the target the sender needs. `meta` arrives with it. It waits up to `wait_s` (default
        `timeout_s`) for the sender's order, then `timeout_s` for the blocks."""

    @abstractmethod
    def poll(self) -> list[Handoff]:
        """Handoffs that finished (DONE or FAILED) since the last poll; fails overdue ones."""

    @abstractmethod
    def abort(self, request_id: str, settle: bool = False) -> Abort:
        """Fails the request's handoff if it is in flight. One already on the wire is cut (its
        pair dies), or with `settle` finishes its messages first (Abort.SETTLING: free its
        blocks when poll() returns it)."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """Handoffs started and not yet returned by poll()."""

    @abstractmethod
    def forget_peer(self, peer: str, sends: bool = True) -> None:
        """Closes the pairs with `peer` (its process groups; with each of its ranks): the ones
        receiving from it, and with `sends` the ones sending to it too. The peer left the cluster,
        or (sends=False) it lost its pair with this receiver: the next channel for it is a new
        gen, so a retry does not meet the gen its sender retired."""

    @abstractmethod
    def close(self) -> None:
        """Fails what is in flight and releases the connector's resources."""

    def peer_address(self, peer: str) -> str | None:
        """Where `peer`'s own store listens, once a pair with it has connected (None before, or
        for a connector that does not know): what transfer/probe.py asks about a silent peer."""
        return None


class PairConnector(KVConnector):
    """One process's pairs with its peers, a receive at a time on a channel it assigns:
    `c10d.C10dConnector` (NCCL / gloo, or the same-node pull), `loopback.LoopbackConnector`
    (tests). A tensor-parallel worker's ranks each hold one (transfer/tp.py)."""

    @abstractmethod
    def start_recv(self, peer: str, request_id: str, block_ids: list[int], channel: Channel,
                   timeout_s: float | None = None, heads: tuple[int, int] | None = None,
                   wait_s: float | None = None) -> Handoff:
        """Receives into `block_ids` on `channel` (from new_channel); `meta` arrives with it."""

    @abstractmethod
    def new_channel(self, peer: str) -> Channel:
        """Receiver side: the channel of the next handoff from `peer`."""

    def receive(self, peer: str, request_id: str, block_ids: list[int], num_skip: int,
                timeout_s: float | None = None, wait_s: float | None = None) -> tuple[Handoff, HandoffTarget]:
        channel = self.new_channel(peer)
        h = self.start_recv(peer, request_id, block_ids, channel, timeout_s, wait_s=wait_s)
        return h, HandoffTarget(self.name, self.address, channel, num_skip)
