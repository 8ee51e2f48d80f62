"""The ranks 1..N-1 of a tensor-parallel worker as Ray actors, and how rank 0 reaches them.

A worker of TP=N is N actors in one STRICT_PACK placement group (one bundle per GPU,
pools.py): the `WorkerActor` on bundle 0 (rank 0: scheduler, block tables, sampling,
the registry's view of the worker) and one `ShardActor` per other bundle. Each shard
runs the model shard in lockstep with rank 0 (engine/exec/shard.py) and holds a transfer
connector over its own slice of the KV cache, so a handoff goes rank to rank
(transfer/tp.py) with nothing gathered on rank 0.

    ShardActor.run()            the shard's whole life (a Ray call that lasts; the actor
                                is threaded, so the connector calls below run beside it)
    ShardActor.submit(seq, ..)  handoff ops (start / abort / forget), applied in `seq`
                                order by the shard's ops thread, which also polls them
    ShardActor.wait_finished()  a long poll: the handoffs that finished since last asked
    RayRankLink                 rank 0's RankLink over one shard: ops are fire-and-forget,
                                `finished()` checks an outstanding long poll (never blocks)
    RayShards                   the Shards launcher rank 0's engine uses; `dead()` is a
                                zero-timeout wait on the shards' `run` calls

Faults: a shard that dies ends its `run` call (RayActorError): rank 0's watchdog sees it
in `dead()` and ends the worker, which the pools' monitor purges and replaces (and the
dispatcher retries its requests). Rank 0 dying takes its shards with it (Ray ends actors
whose owner died) and the placement group is removed by the pools.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.config import EngineConfig
from pdserve.engine.exec.shard import Shards, run_shard, shard_config
from pdserve.transfer.base import Channel, TransferState
from pdserve.transfer.c10d import C10dConnector
from pdserve.transfer.tp import Part, RankLink, rank_name

from ..spec.serving_config import HandoffConfig
from .gpus import see_node_gpus

log = logging.getLogger(__name__)


class ShardActor:
    def __init__(self, worker_id: str, rank: int, config: EngineConfig, load_format: str, address: str,
                 handoff: HandoffConfig):
        see_node_gpus()  # before CUDA starts: its own GPU is cuda:0, its node's others visible
        self.name = rank_name(worker_id, rank)
        self.rank, self.config, self.load_format, self.tp_address = rank, config, load_format, address
        self.handoff = handoff
        self.connector: C10dConnector | None = None
        self.ready = threading.Event()
        self.stopped = False
        self.cv = threading.Condition()
        self.ops: dict[int, tuple[str, object]] = {}
        self.next_seq = 0
        self.done: list[tuple[str, TransferState, str | None]] = []

    # ---- the shard's life --------------------------------------------------------------------
    def run(self) -> None:
        try:
            run_shard(self.config, self.load_format, self.rank, self.tp_address, on_ready=self._on_ready)
        finally:
            self.stopped = True
            with self.cv:
                self.cv.notify_all()
            if self.connector is not None:
                self.connector.close()

    def _on_ready(self, runner) -> None:
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        mc = self.config.model_config
        self.connector = C10dConnector(self.name, runner.kv, host=host, default_timeout_s=self.handoff.timeout_s,
                                       tp=self.config.tensor_parallel_size, kv_heads_total=mc.kv_cache_spec.num_heads,
                                       kv_cache_dtype=self.config.kv_cache_dtype, same_node=self.handoff.same_node)
        threading.Thread(target=self._ops_loop, name=f"ops-{self.name}", daemon=True).start()
        self.ready.set()

    def address(self, timeout_s: float = 900.0) -> str:
        """The connector's address, once the weights and KV cache are in place."""
        if not self.ready.wait(timeout_s):
            raise TimeoutError(f"shard {self.name} was not ready within {timeout_s:.0f} s")
        return self.connector.address

    # ---- handoff ops -------------------------------------------------------------------------
    def new_channels(self, peers: list[str]) -> list[Channel]:
        return [self.connector.new_channel(p) for p in peers]

    def submit(self, seq: int, op: str, arg) -> None:
        with self.cv:
            self.ops[seq] = (op, arg)
            self.cv.notify_all()

    def wait_finished(self, timeout_s: float = 1.0) -> list[tuple[str, TransferState, str | None]]:
        with self.cv:
            self.cv.wait_for(lambda: self.done or self.stopped, timeout_s)
            out, self.done = self.done, []
        return out

    def _ops_loop(self) -> None:
        conn = self.connector
        while not self.stopped:
            with self.cv:
                todo = []
                while self.next_seq in self.ops:
                    todo.append(self.ops.pop(self.next_seq))
                    self.next_seq += 1
            failed = []
            for op, arg in todo:
                try:
                    if op == "start":
                        arg.start(conn)
                    elif op == "abort":
                        conn.abort(arg)
                    elif op == "forget":  # (peer, sends)
                        conn.forget_peer(*arg)
                except Exception as e:  # noqa: BLE001 - reported as the route's failure
                    if op == "start":
                        failed.append((arg.request_id, TransferState.FAILED, f"{self.name}: {e}"))
            finished = failed + [(h.request_id, h.state, h.error) for h in conn.poll()]
            with self.cv:
                self.done += finished
                if self.done:
                    self.cv.notify_all()
                if not conn.num_pending and self.next_seq not in self.ops:
                    self.cv.wait(0.05)
            if conn.num_pending:
                time.sleep(0.0005)


class RayRankLink(RankLink):
    def __init__(self, actor, name: str, address: str):
        self.actor, self.name, self.address = actor, name, address
        self._seq = itertools.count()
        self._poll = None

    def new_channels(self, peers: list[str]) -> list[Channel]:
        return ray.get(self.actor.new_channels.remote(peers), timeout=30)

    def _submit(self, op: str, arg) -> None:
        self.actor.submit.remote(next(self._seq), op, arg)

    def start(self, parts: list[Part]) -> None:
        for part in parts:
            self._submit("start", part)

    def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def forget_peer(self, peer: str, sends: bool = True) -> None:
        self._submit("forget", (peer, sends))

    def finished(self) -> list[tuple[str, TransferState, str | None]]:
        if self._poll is None:
            self._poll = self.actor.wait_finished.remote()
        if not ray.wait([self._poll], timeout=0)[0]:
            return []
        ref, self._poll = self._poll, self.actor.wait_finished.remote()
        try:
            return ray.get(ref)
        except RayError:  # the shard is gone: the worker's watchdog ends the worker
            return []


@dataclass(frozen=True)
class RankPlacement:
    """Where a tensor-parallel worker's ranks 1..N-1 run: bundles 1..N-1 of its placement group
    (None: wherever Ray places them), each asking what rank 0's actor asks for."""

    placement_group: object = None
    num_gpus: float = 0
    num_cpus: float = 0
    runtime_env: dict | None = None


class RayShards(Shards):
    """Ranks 1..N-1 on bundles 1..N-1 of the worker's placement group."""

    def __init__(self, worker_id: str, ranks: RankPlacement, handoff: HandoffConfig, namespace: str,
                 config: EngineConfig, load_format: str, address: str):
        self.worker_id = worker_id
        self.actors, self.runs = [], []
        pg = ranks.placement_group
        for rank in range(1, config.tensor_parallel_size):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank) \
                if pg is not None else None
            actor = ray.remote(ShardActor).options(
                name=rank_name(worker_id, rank), namespace=namespace, max_concurrency=8, num_cpus=ranks.num_cpus,
                num_gpus=ranks.num_gpus, runtime_env=ranks.runtime_env, scheduling_strategy=strategy,
            ).remote(worker_id, rank, shard_config(config, rank, False), load_format, address, handoff)
            self.actors.append(actor)
            self.runs.append(actor.run.remote())

    @classmethod
    def launcher(cls, worker_id: str, ranks: RankPlacement, handoff: HandoffConfig, namespace: str):
        """The `launch_shards` an LLMEngine takes (rank r is the actor "<worker_id>#r" in `namespace`)."""
        return lambda config, load_format, address: cls(worker_id, ranks, handoff, namespace, config,
                                                        load_format, address)

    def links(self) -> list[RayRankLink]:
        addresses = ray.get([a.address.remote() for a in self.actors])
        return [RayRankLink(a, rank_name(self.worker_id, r + 1), addr)
                for r, (a, addr) in enumerate(zip(self.actors, addresses))]

    def dead(self) -> list[int]:
        ended = set(ray.wait(self.runs, num_returns=len(self.runs), timeout=0)[0])
        return [r + 1 for r, ref in enumerate(self.runs) if ref in ended]

    def close(self) -> None:
        ray.wait(self.runs, num_returns=len(self.runs), timeout=10)
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
