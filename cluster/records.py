"""What crosses Ray between a worker and the cluster, as types: `WorkerInfo` (what a worker says
of itself when it starts or switches role), `WorkerStats` (its counters at each monitor pass and
heartbeat) and `WorkerRecord` (the cluster's view of one worker, holding both).

Placement, autoscaling, the ratio planner and the pools read the typed fields; nothing in
cluster/ looks a worker's info or stats up by a string key. The counters only metrics and
`/admin/status` print (prefix-cache hits, tiers, links, iteration tokens, ...) travel typed too:
the engine's `EngineStats` (engine/stats.py) and the worker's `WorkerCounters`, and
`WorkerStats.as_dict()` gives the flat row they print, the engine's metric names plus the
worker's own.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pdserve.engine.core.decode_capacity import DecodeCapacity
from pdserve.engine.stats import PLACEMENT_FIELDS, EngineStats, PlacementStats, StartupTimes

if TYPE_CHECKING:
    from pdserve.engine.validation import ValidRequest
    from pdserve.transfer.fetch import FetchPlan
    from pdserve.transfer.records import PairLink, WireLayout


class BlockChange(enum.Enum):
    """What happened to a cached block of a worker: on its GPU, or in its host tier."""
    STORED = "stored"
    REMOVED = "removed"
    HOST_STORED = "host_stored"
    HOST_REMOVED = "host_removed"


class BlockEvent(NamedTuple):
    """One change to a worker's prefix caches, as its heartbeat carries it to the registry."""
    change: BlockChange
    block_hash: str  # hex

    @classmethod
    def of(cls, kind: str, block_hash: bytes) -> BlockEvent:
        """From the KV pool's and the host tier's own events: (kind, hash bytes)."""
        return cls(BlockChange(kind), block_hash.hex())


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's registration: its pool, where its KV pairs meet it (`address`), the epoch of
    its blocks (a new one after a restart), its tensor-parallel size, its node, its KV blocks
    and their wire layout (transfer/records.WireLayout), its persisted tier's state, what its
    start took (seconds by part) and, when it persists its host tier, the slot it holds."""
    role: str
    address: str
    epoch: str
    tp: int = 1
    node: str = ""
    node_id: str | None = None
    capacity_blocks: int = 0
    layout: WireLayout | None = None
    kv_persist_status: str | None = None
    startup: StartupTimes | None = None
    persist_slot: str | None = None

    def same_node(self, other: WorkerInfo) -> bool:
        return self.node_id is not None and self.node_id == other.node_id

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class WorkerCounters:
    """What a worker counts beside its engine: its requests whose outputs wait on it
    (`open_outputs`), those waiting on KV from a peer (`waiting_for_kv`) or on KV or a grammar
    (`num_deferred`), the GPU blocks its requests hold, each KV pair's link, and kernel variants
    compiled since it started serving (None before)."""
    role: str
    worker_id: str
    open_outputs: int = 0
    waiting_for_kv: int = 0
    num_deferred: int = 0
    request_blocks: int = 0
    kv_links: tuple[PairLink, ...] = ()
    kernel_compiles_serving: int | None = None
    kernel_compiles_recent: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        row = {"role": self.role, "worker_id": self.worker_id, "open_outputs": self.open_outputs,
               "waiting_for_kv": self.waiting_for_kv, "num_deferred": self.num_deferred,
               "request_blocks": self.request_blocks, "kv_links": {k.key: k.as_dict() for k in self.kv_links}}
        if self.kernel_compiles_serving is not None:
            row.update(kernel_compiles_serving=self.kernel_compiles_serving,
                       kernel_compiles_recent=list(self.kernel_compiles_recent))
        return row


@dataclass
class WorkerStats:
    """A worker's counters at one moment. A worker that has not reported yet has `kv_blocks_total`
    None (its info's capacity stands in); `prefill_tok_s` is None until a prefill rate is measured.
    `decode_capacity`: the step model's table of decode batch at the TPOT target by context, and
    the decode step of that batch (the ratio planner's time a token takes).
    Placement reads the fields above `engine`; metrics and status print `as_dict()`, the row
    made of those fields, the engine's counters (`engine`) and the worker's own (`worker`)."""
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int | None = None
    kv_blocks_used: int = 0
    step_s: float = 0.0
    prefill_tok_s: float | None = None
    prefill_chunk: int = 0
    tpot_over: bool = False
    decode_capacity: DecodeCapacity = field(default_factory=DecodeCapacity)
    inflight: int = 0
    held_for_handoff: int = 0
    kv_peer_fetch_gbps: float | None = None
    engine: EngineStats | None = None  # None: the defaults of a worker not heard from yet
    worker: WorkerCounters | None = None

    @classmethod
    def of(cls, engine: EngineStats, worker: WorkerCounters, inflight: int, held_for_handoff: int) -> WorkerStats:
        """From a worker's engine's counters and its own."""
        st = cls(decode_capacity=engine.decode_capacity, inflight=inflight, held_for_handoff=held_for_handoff,
                 engine=engine, worker=worker)
        st.placed(engine.placement)
        if engine.peer is not None:
            st.kv_peer_fetch_gbps = engine.peer.fetch_gbps
        return st

    def placed(self, placement: PlacementStats) -> None:
        """Takes what placement reads from an engine's (or the simulator's) placement stats."""
        for f in _PLACEMENT:
            v = getattr(placement, f)
            if v is not None:
                setattr(self, f, v)

    def blocks_total(self, info: WorkerInfo | None) -> int:
        return self.kv_blocks_total if self.kv_blocks_total is not None else (info.capacity_blocks if info else 0)

    def as_dict(self) -> dict:
        """The flat row metrics and status print (the engine's names); {} before the first report."""
        if self.engine is None:
            return {}
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("engine", "worker")}
        mine["decode_capacity"] = dict(self.decode_capacity.points)  # context -> sequences
        return {**self.engine.as_dict(), **(self.worker.as_dict() if self.worker else {}), **mine}


_PLACEMENT = tuple(f.name for f in dataclasses.fields(WorkerStats) if f.name in PLACEMENT_FIELDS)


@dataclass(frozen=True)
class DecodeCall:
    """One attempt as the dispatcher hands it to its decode worker (`WorkerActor.generate` and
    `generate_piped`): the attempt's wire id and request, and where the prompt's KV comes from.
    With `prefill_id` (a prefill worker of tensor-parallel size `prefill_tp`) the KV and the first
    token come from that worker; without, the decode worker prefills the prompt itself, copying
    the cached prefix blocks `fetch` names from a peer first (None: nothing to fetch)."""
    request_id: str
    request: ValidRequest
    prefill_id: str | None = None
    prefill_tp: int = 1
    fetch: FetchPlan | None = None

    def __post_init__(self):
        if self.prefill_id is not None and self.fetch is not None:
            raise ValueError(f"{self.request_id}: a prompt prefilled on {self.prefill_id} fetches nothing here")


@dataclass(frozen=True)
class RegisteredWorker:
    """The block registry's row for one member: its registration, its last heartbeat's stats and
    when that came (the registry's monotonic clock), and how many blocks it holds on its GPU and
    in its host tier."""
    worker_id: str
    info: WorkerInfo
    stats: WorkerStats
    last_heartbeat: float
    num_cached_blocks: int
    num_host_blocks: int

    @property
    def role(self) -> str:
        return self.info.role

    def as_dict(self) -> dict:
        """The JSON status row: the registration's fields flattened, stats nested."""
        return {**self.info.as_dict(), "worker_id": self.worker_id, "last_heartbeat": self.last_heartbeat,
                "stats": self.stats.as_dict(), "num_cached_blocks": self.num_cached_blocks,
                "num_host_blocks": self.num_host_blocks}


@dataclass
class WorkerRecord:
    """The cluster's view of one WorkerActor: its id, pool, actor handle, what it reported at
    start (`info`), the requests this cluster has in flight on it (`load`), the prompt tokens
    placed on it without a first token yet (`queued_tokens`, and by priority), whether it drains
    or is switching pools, its last stats, since when it has not answered the monitor's probe, a
    tensor-parallel worker's placement group and the pool it was started for (switching back goes
    to such workers first)."""
    worker_id: str
    role: str  # the pool: "prefill" or "decode" (colocated engines are the decode pool)
    actor: object
    info: WorkerInfo | None = None
    load: int = 0
    queued_tokens: int = 0
    queued_by_priority: collections.Counter = field(default_factory=collections.Counter)
    draining: bool = False
    drain: object = None  # the shrink's drain task while it drains to leave (a death's mark has none)
    switching_to: str | None = None  # draining to change role: counted in that pool, placed in none
    stats: WorkerStats = field(default_factory=WorkerStats)
    placement_group: object = None
    first_role: str = ""
    silent_since: float | None = None  # monotonic time of its first unanswered probe in a row; None: answering

    def __post_init__(self) -> None:
        self.first_role = self.first_role or self.role

    @property
    def tp(self) -> int:
        return self.info.tp if self.info is not None else 1

    @property
    def blocks_total(self) -> int:
        return self.stats.blocks_total(self.info)


class WorkerRefused(ValueError):
    """A worker's engine refused its spec at start (its KV room, its GPU share), in one line."""
