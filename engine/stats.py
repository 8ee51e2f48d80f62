"""An engine's counters at one moment, as types: what `LLMEngine.stats()` returns and a worker
sends the cluster inside its `WorkerStats` (cluster/records.py).

Each record's fields carry their metric name (`metric(...)` metadata) and `as_dict()` turns a
record into the flat row metrics and `/admin/status` print, under those names (vLLM's and
pdserve's); `EngineStats.as_dict()` is the one place the whole row is made. Code reads the
fields (`stats.cache.prefix_hits`, `stats.host.blocks_used`), never the row.

    EngineStats
      placement    PlacementStats  what placement reads (the simulator reports the same record)
      cache        CacheStats      the GPU pool: usage, prefix hits, evictions, its configuration
      host / disk / peer           each KV tier the engine runs (engine/tiers/tier.py), else None
      persist      WriteStats      the persisted host tier's writes, when it persists one
      spec         SpecStats       speculative decoding, when configured
      step_cost    StepCost        the step model's fit of this engine's own steps, once it has one

    StartupTimes   what each part of the engine's start took (a worker's registration carries it)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from .core.decode_capacity import DecodeCapacity


def metric(name: str, default: Any = dataclasses.MISSING) -> Any:
    """A field printed under `name` in the flat row."""
    return field(default=default, metadata={"metric": name})


class _Row:
    """A record whose `metric(...)` fields make its part of the flat row."""

    def as_dict(self) -> dict:
        return {f.metadata["metric"]: getattr(self, f.name) for f in dataclasses.fields(self)
                if "metric" in f.metadata}


@dataclass(frozen=True)
class PlacementStats(_Row):
    """What placement reads of an engine (cluster/placement/routing.py), from its step model and scheduler."""
    num_running: int = metric("num_running")
    num_waiting: int = metric("num_waiting")
    kv_blocks_total: int = metric("kv_blocks_total")
    kv_blocks_used: int = metric("kv_blocks_used")
    step_s: float = metric("step_s")
    slo_tpot_s: float | None = metric("slo_tpot_s")
    tpot_margin: float = metric("tpot_margin")
    tpot_over: bool = metric("tpot_over")
    prefill_tok_s: float | None = metric("prefill_tok_s")
    prefill_chunk: int = metric("prefill_chunk")


PLACEMENT_FIELDS = frozenset(f.name for f in dataclasses.fields(PlacementStats))


@dataclass(frozen=True)
class CacheConfigInfo(_Row):
    """The GPU pool's configuration (vLLM's `cache_config_info`)."""
    block_size: int = metric("block_size")
    cache_dtype: str = metric("cache_dtype")
    num_gpu_blocks: int = metric("num_gpu_blocks")
    num_cpu_blocks: int = metric("num_cpu_blocks")
    enable_prefix_caching: bool = metric("enable_prefix_caching")
    max_model_len: int = metric("max_model_len")


@dataclass(frozen=True)
class CacheStats(_Row):
    """The GPU block pool: its use, its prefix cache's lookups, and what the host tier's copies
    brought back (`host_hit_tokens`, `load_back_seconds`: None without a host tier)."""
    usage: float = metric("kv_cache_usage")
    prefix_queries: int = metric("prefix_cache_queries")
    prefix_hits: int = metric("prefix_cache_hits")
    evicted_blocks: int = metric("kv_evicted_blocks")
    config: CacheConfigInfo | None = None
    host_hit_tokens: int | None = metric("prefix_cache_host_hits", None)
    load_back_seconds: float | None = metric("kv_load_back_seconds", None)

    def as_dict(self) -> dict:
        row = {k: v for k, v in super().as_dict().items() if v is not None}
        return {**row, "cache_config": self.config.as_dict()} if self.config is not None else row


@dataclass(frozen=True)
class WriteStats(_Row):
    """A tier's writes to its directory (engine/tiers/write_health.py), printed under `prefix`
    ("kv_disk", "kv_persist"); `cause`: the last failure while unwritable, else None."""
    prefix: str
    errors: int
    skipped: int
    cause: str | None = None

    def as_dict(self) -> dict:
        p = self.prefix
        return {f"{p}_write_errors": self.errors, f"{p}_writes_skipped": self.skipped,
                f"{p}_unwritable": int(self.cause is not None),
                **({f"{p}_write_error": self.cause} if self.cause else {})}


@dataclass(frozen=True)
class HostTierStats(_Row):
    """The host tier's slots (engine/tiers/offload.py)."""
    blocks_total: int = metric("kv_host_blocks_total")
    blocks_used: int = metric("kv_host_blocks_used")
    offloaded_blocks: int = metric("kv_offloaded_blocks")
    loaded_blocks: int = metric("kv_host_loaded_blocks")


@dataclass(frozen=True)
class DiskTierStats(_Row):
    """The disk tier's block files (engine/tiers/disk_tier.py) and its writes."""
    hit_tokens: int = metric("prefix_cache_disk_hits")
    skipped_tokens: int = metric("kv_disk_skipped_tokens")
    blocks: int = metric("kv_disk_blocks")
    blocks_total: int = metric("kv_disk_blocks_total")
    written_bytes: int = metric("kv_disk_written_bytes")
    read_bytes: int = metric("kv_disk_read_bytes")
    refused_blocks: int = metric("kv_disk_refused_blocks")
    read_gbps: float | None = metric("kv_disk_read_gbps")
    prefetch_seconds: float = metric("kv_disk_prefetch_seconds")  # mean of a prefetch
    waiting: int = metric("kv_disk_waiting")
    writes: WriteStats | None = None

    def as_dict(self) -> dict:
        return {**super().as_dict(), **(self.writes.as_dict() if self.writes else {})}


@dataclass(frozen=True)
class PeerTierStats(_Row):
    """The peer tier's fetches from other workers' GPUs (transfer/fetch.py); `fetch_gbps` is
    what placement predicts a fetch by (None until one is measured)."""
    hit_tokens: int = metric("prefix_cache_peer_hits")
    fetched_bytes: int = metric("kv_peer_fetched_bytes")
    served_bytes: int = metric("kv_peer_served_bytes")
    fetches: int = metric("kv_peer_fetches")
    failed: int = metric("kv_peer_fetches_failed")
    waiting: int = metric("kv_peer_waiting")
    fetch_seconds: float = metric("kv_peer_fetch_seconds")  # mean of a fetch
    fetch_gbps: float | None = metric("kv_peer_fetch_gbps")


@dataclass(frozen=True)
class SpecStats(_Row):
    """Speculative decoding's drafts and what was accepted of them (engine/spec/decode.py)."""
    num_drafts: int = metric("spec_decode_num_drafts")
    num_draft_tokens: int = metric("spec_decode_num_draft_tokens")
    num_accepted_tokens: int = metric("spec_decode_num_accepted_tokens")
    steps_off: int = metric("spec_decode_steps_off")
    draft_seconds: float = metric("spec_decode_draft_seconds")

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.num_accepted_tokens / max(1, self.num_drafts)

    def as_dict(self) -> dict:
        return {**super().as_dict(), "spec_decode_acceptance_rate": self.acceptance_rate,
                "spec_decode_mean_accepted_length": self.mean_accepted_length}


class TokenCounts(NamedTuple):
    """A cumulative histogram of tokens per step: [(le, count), ..., ("+Inf", count)] and the sum
    (Prometheus' shape; engine/core/iteration_stats.py)."""
    buckets: list[tuple[str, int]]
    sum: int


Tier = HostTierStats | DiskTierStats | PeerTierStats


@dataclass(frozen=True)
class StepCost:
    """The engine's step-cost model as fitted to its own steps (engine/core/step_model.py): seconds
    per unit of each feature, and the steps of each kind the fit holds now. A worker's are what the
    simulator's profile holds (pdserve.sim.profile `coefficients`), measured where the worker runs:
    beside its router, its clients and its host's other processes."""
    base: float
    mixed: float
    per_seq: float
    per_token: float
    per_kv_token: float
    per_attn: float
    graph: float
    decode_steps: int
    mixed_steps: int

    @classmethod
    def of(cls, coefficients: dict[str, float], decode_steps: int, mixed_steps: int) -> StepCost | None:
        """From `StepModel.coefficients()` (None before the first fit)."""
        if not coefficients:
            return None
        return cls(**coefficients, decode_steps=decode_steps, mixed_steps=mixed_steps)

    def coefficients(self) -> dict[str, float]:
        """The fit in a profile's terms (feature -> seconds per unit)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type == "float"}


@dataclass(frozen=True)
class EngineStats:
    """One engine's counters (see the module's table)."""
    placement: PlacementStats
    cache: CacheStats
    num_preemptions: int
    num_decoding: int
    decode_capacity: DecodeCapacity
    tensor_parallel_size: int
    iteration_tokens: TokenCounts
    host: HostTierStats | None = None
    disk: DiskTierStats | None = None
    peer: PeerTierStats | None = None
    persist: WriteStats | None = None
    persist_status: str | None = None
    spec: SpecStats | None = None
    step_cost: StepCost | None = None

    @classmethod
    def with_tiers(cls, tiers: list[Tier], **fields) -> EngineStats:
        """`tiers`: each tier's stats (its kind says which field it fills)."""
        kinds = {HostTierStats: "host", DiskTierStats: "disk", PeerTierStats: "peer"}
        return cls(**fields, **{kinds[type(t)]: t for t in tiers})

    def as_dict(self) -> dict:
        """The flat row metrics and `/admin/status` print, under the engine's metric names."""
        row = {**self.placement.as_dict(), **self.cache.as_dict(), "num_preemptions": self.num_preemptions,
               "num_decoding": self.num_decoding, "decode_capacity": dict(self.decode_capacity.points),
               "tensor_parallel_size": self.tensor_parallel_size,
               "iteration_tokens": {"buckets": self.iteration_tokens.buckets, "sum": self.iteration_tokens.sum}}
        if self.persist_status:
            row["kv_persist_status"] = self.persist_status
        if self.step_cost is not None:
            row["step_cost"] = dataclasses.asdict(self.step_cost)
        for part in (self.persist, self.host, self.disk, self.peer, self.spec):
            if part is not None:
                row.update(part.as_dict())
        return row


@dataclass
class StartupTimes:
    """What each part of an engine's start took, in seconds (None: that part did not run): the
    tensor-parallel ranks and their groups, the weights, the CUDA graphs, the kernels' warm-up and
    the step-cost calibration. A worker's registration carries it (cluster/records.WorkerInfo)."""
    tensor_parallel_s: float | None = None
    load_s: float | None = None
    graphs_s: float | None = None
    warm_up_s: float | None = None
    calibrate_s: float | None = None

    def parts(self) -> list[tuple[str, float]]:
        """(part, seconds) of the parts that ran, in the order they run: ("warm-up", 1.2), ..."""
        return [(f.name[:-2].replace("_", "-"), v) for f in dataclasses.fields(self)
                if (v := getattr(self, f.name)) is not None]
