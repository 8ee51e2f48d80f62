"""`WorkerActor`: a Ray actor that hosts one engine in one role (prefill or decode),
role-agnostic. This module is the actor's side: its start and stop, its health (`ping`, `stats`,
a dead rank or engine thread), and its intake (requests, targets, fetches, aborts, role switches
and retunes posted to the engine thread). The engine thread's side, which feeds the role those
commands, steps it, forwards its events and heartbeats, is `EngineLoop` (engine_loop.py).

Threads: the engine is owned by one thread (the engine loop); the actor's async methods
only post commands to it (small dataclasses on `inbox`) and await futures or queues
that the loop resolves through the actor's event loop, so an engine step never blocks
a Ray call and no lock is needed around the engine (worker_commands.py names the commands).
A request with a grammar is posted once its grammar has compiled on the actor's compile
thread, so a new grammar never holds up a step.

A disaggregated request touches two actors, each once, at the same time (the cluster
calls both; nothing goes back through the cluster before the first token). `request` is the
cluster's ValidRequest (validated once, at the edge):

    prefill actor  prefill(rid, request, decode_id)   -> the handoff's result when done
    decode actor   generate(rid, request, prefill_id) -> stream of delta outputs
                   (or generate_piped: the same outputs over the output pipe, output_pipe.py)
                   its role reserves blocks (Reserved) -> prefill actor.target(rid, target),
                   actor to actor; the prefill role sends the KV + first token when ready
A request served by one worker: generate(rid, request) on a decode (or colocated) actor, or
prefill(rid, request, None) when max_tokens == 1.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import sys
import threading
import time
import uuid

import ray

from pdserve.engine.base.tp import TPError
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.ops.compile_watch import CompileWatch
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.validation import ValidRequest
from pdserve.transfer.base import HandoffTarget
from pdserve.transfer.c10d import C10dConnector
from pdserve.transfer.fetch import FetchPlan, PeerFetches
from pdserve.transfer.tp import TPConnector

from ..records import DecodeCall, WorkerCounters, WorkerInfo, WorkerRefused, WorkerStats
from ..registry.registry import Membership
from ..spec.serving_config import HandoffConfig
from .engine_loop import ROLE_CLASSES, EngineLoop
from .gpus import see_node_gpus
from .outlets import Outlets
from .output_pipe import PipeAddress, PipeSender
from .peer_calls import PeerCalls
from .shard_actor import RankPlacement, RayShards
from .worker_commands import SWITCH_WAIT_S, Abort, Aborted, AbortLog, Add, ForgetPeer, SwitchRole

log = logging.getLogger(__name__)


class WorkerActor(EngineLoop):
    def __init__(self, worker_id: str, role: str, spec: EngineConfig, namespace: str,
                 heartbeat_s: float = 1.0, handoff: HandoffConfig | None = None, ranks: RankPlacement | None = None,
                 bind_host: str | None = None, output_pipe: PipeAddress | None = None, cluster_id: str = ""):
        """`spec`: its engine's, resolved where the cluster started (EngineSpecs; not parsed again).
        `bind_host`: where its KV store listens and peers reach it (default: the node's address).
        `handoff`: its KV handoffs' timeout and links. `output_pipe`: the router's OutputPipe address
        if any. `cluster_id`: the cluster that started it (its registry refuses another's workers). A
        worker of tensor_parallel_size N > 1 is rank 0 of N: it starts ranks 1..N-1 as shard actors
        where `ranks` says (bundles 1..N-1 of its placement group; shard_actor.py)."""
        see_node_gpus()  # before CUDA starts: its GPU is cuda:0, its node's others visible after it
        import torch
        if role not in ROLE_CLASSES:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        torch.set_num_threads(int(os.environ.get("PDSERVE_TORCH_THREADS", "1")))
        # the engine thread's GIL turns: Python's 5 ms made a handoff's receive take 20-40 ms on 2x H200;
        # 0.5 ms cut kv_to_first_token p50 at 7 req/s from 1.5 s to 0.13 s (bench/results/serving.md);
        # 0.1 ms took a served handoff's host steps from 2.4 to 1.6 ms p50 (bench/results/ipc/served_2gpu.md)
        sys.setswitchinterval(float(os.environ.get("PDSERVE_SWITCH_INTERVAL", "0.0001")))
        self.worker_id, self.role_name, self.namespace = worker_id, role, namespace
        self.epoch, self.heartbeat_s, config, launch = uuid.uuid4().hex[:8], heartbeat_s, spec, None
        handoff = handoff or HandoffConfig()
        if config.tensor_parallel_size > 1:
            launch = RayShards.launcher(worker_id, ranks or RankPlacement(), handoff, namespace)
        self.refused: ValueError | None = None
        try:
            self.engine, self.tp = LLMEngine(config, launch_shards=launch), config.tensor_parallel_size
        except ValueError as e:  # a spec this worker cannot serve (its KV room, its GPU share): start() says so
            self.refused = e
            return
        self.engine.stream_deltas = True
        self.engine.kv.pool.record_events = True
        if self.engine.kv.host is not None:  # the host tier's blocks (a persisted tier's too) are announced
            self.engine.kv.host.record_events = True
            self.engine.kv.host.events = [("host_stored", h) for h, _ in self.engine.kv.host.entries()]
        host = bind_host or (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1")
        kv_heads = config.model_config.kv_cache_spec.num_heads
        local = C10dConnector(worker_id, self.engine.runner.kv, host=host, default_timeout_s=handoff.timeout_s,
                              tp=self.tp, kv_heads_total=kv_heads, kv_cache_dtype=config.kv_cache_dtype,
                              same_node=handoff.same_node)
        # rank to rank handoffs with workers of any TP (transfer/tp.py); one route at TP 1 <-> 1
        self.connector = TPConnector(local, self.engine.shards.links() if self.engine.shards else [], kv_heads)
        self.handoff = handoff
        self.fetches = PeerFetches(self.engine, self.connector)  # prefixes fetched from peers, served to them
        self.role = self._make_role(role)
        self.membership = Membership(worker_id, namespace, cluster_id)
        self.inbox: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.stopped = False
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.outlets = Outlets(PipeSender(output_pipe, worker_id) if output_pipe else None)
        self.done = self.outlets.done  # prefill()'s futures
        self.peers = PeerCalls(worker_id, namespace)  # targets to prefill workers, fetches from holders
        self.thread: threading.Thread | None = None
        self.compiling = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")  # _admitted()
        self.compiling_now: set[str] = set()  # requests whose grammar compiles now
        self.aborted = AbortLog()  # an abort that comes before its request keeps it from starting
        self.dead: str | None = None  # why the engine thread ended, if it did: ping() and stats() raise it
        self.switch_waiting: SwitchRole | None = None  # a role switch waiting for the old role to empty
        self.kernels: CompileWatch | None = None  # kernel variants compiled once serving (armed by start())

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> WorkerInfo:
        """Joins the cluster and starts the engine thread; raises WorkerRefused (a ValueError) where
        the engine refused the spec, its words in one line."""
        if self.refused is not None:
            raise WorkerRefused(str(self.refused))
        self.aloop = self.outlets.aloop = asyncio.get_running_loop()
        self.kernels = CompileWatch.arm(self.worker_id)  # the engine is warm: a compile from here on is a stall
        info = self.info()
        await self.membership.join(info)
        self.thread = threading.Thread(target=self._loop, name=f"engine-{self.worker_id}", daemon=True)
        self.thread.start()
        if self.engine.shards is not None:
            threading.Thread(target=self._watch_shards, name=f"shards-{self.worker_id}", daemon=True).start()
        return info

    def _watch_shards(self) -> None:
        """A TP worker is whole or gone: a dead rank ends this actor (on NCCL the engine thread may be
        stuck in a collective with it); the monitor replaces it, the dispatcher retries its requests."""
        while not self.stopped:
            dead = self.engine.shards.dead() if self.engine.shards is not None else []
            if dead and not self.stopped:
                self._die(TPError(f"rank(s) {dead} of tensor-parallel worker {self.worker_id} died"))
            time.sleep(0.5)

    def _die(self, err: Exception) -> None:
        log.error("%s: %s: ending the worker", self.worker_id, err)
        os._exit(1)

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.role_name, self.connector.address, self.epoch, self.tp, ray.util.get_node_ip_address(),
                          ray.get_runtime_context().get_node_id(), self.engine.kv.num_blocks, self.connector.layout,
                          self.engine.persist_status, dataclasses.replace(self.engine.runner.startup))

    async def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        if self.thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 10)
        self.compiling.shutdown(wait=False, cancel_futures=True)
        self.connector.close()
        if self.outlets.pipe is not None:
            self.outlets.pipe.close()
        self.engine.close()  # a TP worker's shards stop

    async def ping(self) -> str:
        self._check_alive()
        return self.worker_id

    async def stats(self) -> WorkerStats:
        self._check_alive()
        return self._stats()

    def _check_alive(self) -> None:
        """Its engine thread dead, the worker fails every call: the pools purge and replace it."""
        if self.dead is not None:
            raise RuntimeError(f"{self.worker_id} cannot serve: {self.dead}")

    def _stats(self) -> WorkerStats:
        waiting_for_kv = len(getattr(self.role, "receiving", ())) + len(getattr(self.role, "backlog", ()))
        mine = WorkerCounters(
            self.role_name, self.worker_id, open_outputs=len(self.outlets.requests()),  # calls waiting on outputs
            waiting_for_kv=waiting_for_kv, num_deferred=waiting_for_kv + len(self.compiling_now),  # KV or a grammar
            request_blocks=self.engine.kv.num_blocks - self.engine.kv.num_free_blocks,
            kv_links=tuple(self.connector.local.links()),  # each KV pair's link and why (transfer/pull.py)
            kernel_compiles_serving=self.kernels.count if self.kernels is not None else None,
            kernel_compiles_recent=tuple(self.kernels.recent()) if self.kernels is not None else ())
        return WorkerStats.of(self.engine.stats(), mine, inflight=self.inflight, held_for_handoff=len(self.engine.held))

    @property
    def inflight(self) -> int:
        """Requests here: the role's, and those still on `inbox` (a peer to forget or a role
        switch queued there is no request: counted, it showed an idle worker busy)."""
        return self.role.num_inflight + sum(isinstance(c, Add) for c in list(self.inbox))

    # ---- requests ---------------------------------------------------------------------------
    async def prefill(self, request_id: str, request: ValidRequest, decode_id: str | None,
                      fetch: FetchPlan | None = None):
        """Prefill role. With a decode peer: the handoff's result dict once the KV is sent
        (or the final output if the request ended here otherwise); without: the output.
        `fetch`: the prompt's prefix is fetched from that peer first (transfer/fetch.py)."""
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self.done[request_id] = fut
        if not await self._admitted(request_id, request.params):
            self.done.pop(request_id, None)
            raise Aborted(f"request {request_id} aborted")
        self._post(Add(request_id, request, decode_id, fetch))
        return await fut

    async def target(self, request_id: str, target: HandoffTarget) -> None:
        """Prefill role: the decode worker's reservation for a request. Applied here, not on
        the engine thread, which may be inside a long prefill step the send need not wait for."""
        self.role.target(request_id, target)
        self.wake.set()

    async def generate(self, call: DecodeCall):
        """Decode role: a stream of delta outputs of `call` (records.DecodeCall: its KV from a
        prefill worker, or its prompt prefilled here)."""
        self._check_alive()
        q = self.outlets.open_stream(call.request_id)
        try:
            if not await self._decode(call):
                return  # aborted before it started: the stream just ends, as after an abort
            async for out in self.outlets.stream(q):
                yield out
        finally:
            self.outlets.streams.pop(call.request_id, None)

    async def generate_piped(self, call: DecodeCall) -> bool:
        """generate() with its outputs over the output pipe: True once the last is on it, False
        if the request was aborted here; raises the request's error (ConnectionError: no pipe)."""
        self._check_alive()
        fut = self.outlets.open_piped(call.request_id)
        started = await self._decode(call)
        return await self.outlets.piped_end(call.request_id, fut if started else None)

    async def _decode(self, call: DecodeCall) -> bool:
        """Posts the request to the engine thread; False if it was aborted before it could start."""
        if call.prefill_id is not None:
            self.connector.peer_tp[call.prefill_id] = call.prefill_tp
        if not await self._admitted(call.request_id, call.request.params):
            return False
        self._post(Add(call.request_id, call.request, call.prefill_id, call.fetch))
        return True

    async def _admitted(self, request_id: str, params: SamplingParams) -> bool:
        """Compiles the request's grammar off the engine thread (which then finds it cached); False
        if the request was aborted here first (its abort came before it, or while it compiled)."""
        if params.structured_outputs and request_id not in self.aborted:
            self.compiling_now.add(request_id)
            try:
                await asyncio.get_running_loop().run_in_executor(self.compiling, self.engine.grammars.warm,
                                                                 params.structured_outputs)
            finally:
                self.compiling_now.discard(request_id)
        return request_id not in self.aborted

    async def serve_fetch(self, fetch_id: str, hashes: list[str], target: HandoffTarget) -> bool:
        """A peer fetch from this worker (transfer/fetch.py): sends the GPU blocks of `hashes` to
        `target`, on the engine thread between steps; False if it no longer caches them all."""
        self._check_alive()
        done = asyncio.get_running_loop().create_future()
        self._post(lambda: self.aloop.call_soon_threadsafe(done.set_result, self.fetches.serve(fetch_id, hashes,
                                                                                               target)))
        return await done

    async def abort(self, request_id: str) -> None:
        """Stops the request at any stage here; one whose call has not come yet never starts."""
        self.aborted.add(request_id)
        self._post(Abort(request_id))

    async def switch_role(self, role: str, spec: EngineConfig) -> WorkerInfo:
        """Becomes a `role` worker on the same engine (weights, KV pool and prefix cache
        stay: cached blocks are as valid for the other role), and registers again under it.
        It takes the step budget and TPOT target of `spec` (the new pool's). The cluster
        drains the worker first; what still reaches it finishes under the old role first, and a
        worker still busy after `SWITCH_WAIT_S` refuses (it keeps its role)."""
        done = asyncio.get_running_loop().create_future()
        self._post(SwitchRole(role, spec, done, time.monotonic() + SWITCH_WAIT_S))
        info = await done
        await self.membership.join(info)
        return info

    async def retune(self, slo_tpot_s: float | None) -> None:
        """A new TPOT target for this engine's step budget, set by the engine thread between steps."""
        self._post(lambda: self.engine.retune(slo_tpot_s, self.engine.scheduler.max_num_batched_tokens))

    async def forget_peer(self, worker_id: str) -> None:
        self.peers.forget(worker_id)
        self._post(ForgetPeer(worker_id))

    async def renew_receives(self, worker_id: str) -> None:
        """The sender `worker_id` lost its pair with this worker (HandoffResult.pair_lost): the
        receiving side is closed, so the next handoff from it runs on a new gen. Posted ahead of
        any request the caller sends after this call returns (the inbox keeps the order)."""
        self._post(ForgetPeer(worker_id, sends=False))

    async def reaches(self, address: str) -> bool:
        """Whether a peer's KV address answers from this worker's host (transfer/probe.py): the
        cluster asks while the link between them is out of placement, and takes it back once it
        does. The answer is also the role's verdict from here on."""
        return await asyncio.to_thread(self.role.prober.check, address)
