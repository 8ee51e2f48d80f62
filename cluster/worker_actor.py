"""A Ray actor that hosts one engine in the prefill or the decode role.

The engine is owned by one thread (the engine loop); the actor's async methods only
queue commands for it and await futures or queues that the loop resolves through
the actor's event loop, so an engine step never blocks a Ray call and no lock is
needed around the engine. The loop also heartbeats to the registry with the
worker's stats and the prefix-cache events (block hashes stored / evicted).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import threading
import time
import uuid

import ray

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.transfer.base import TransferState
from pdserve.transfer.c10d import C10dConnector

from .registry import REGISTRY_NAME


class WorkerActor:
    def __init__(self, worker_id: str, role: str, engine_kwargs: dict, namespace: str,
                 heartbeat_s: float = 1.0, handoff_timeout_s: float = 30.0):
        import torch

        from pdserve.decode.worker import DecodeWorker
        from pdserve.prefill.worker import PrefillWorker

        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        torch.set_num_threads(int(os.environ.get("PDSERVE_TORCH_THREADS", "1")))
        self.worker_id, self.role_name = worker_id, role
        self.epoch = uuid.uuid4().hex[:8]
        self.heartbeat_s, self.handoff_timeout_s = heartbeat_s, handoff_timeout_s
        self.engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
        self.engine.kv.pool.record_events = True
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.connector = C10dConnector(worker_id, self.engine.runner.kv, host=host,
                                       default_timeout_s=handoff_timeout_s)
        role_cls = PrefillWorker if role == "prefill" else DecodeWorker
        self.role = role_cls(self.engine, self.connector)
        self.registry = ray.get_actor(REGISTRY_NAME, namespace=namespace)
        self.inbox: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.stopped = False
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.futures: dict[tuple[str, str], asyncio.Future] = {}
        self.streams: dict[str, asyncio.Queue] = {}
        self.backlog: list[tuple] = []  # decode reservations waiting for blocks
        self._beat = None  # the last heartbeat's reply: False means the registry dropped us
        self.thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> dict:
        self.aloop = asyncio.get_running_loop()
        info = self.info()
        await self.registry.register.remote(self.worker_id, info)
        self.thread = threading.Thread(target=self._loop, name=f"engine-{self.worker_id}", daemon=True)
        self.thread.start()
        return info

    def info(self) -> dict:
        return {"role": self.role_name, "address": self.connector.address, "epoch": self.epoch,
                "node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "capacity_blocks": self.engine.kv.num_blocks,
                "layout": self.connector.layout}

    async def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        if self.thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 10)
        self.connector.close()

    async def ping(self) -> str:
        return self.worker_id

    async def stats(self) -> dict:
        return self._stats()

    def _stats(self) -> dict:
        s = self.engine.stats()
        s.update(role=self.role_name, worker_id=self.worker_id, inflight=self.inflight,
                 held_for_handoff=len(self.engine.held), waiting_for_kv=len(getattr(self.role, "pending", {})),
                 request_blocks=self._request_blocks())
        return s

    @property
    def inflight(self) -> int:
        n = len(self.engine.requests) + len(self.engine.held) + len(self.backlog)
        return n + len(getattr(self.role, "pending", {}))

    def _request_blocks(self) -> int:
        """Blocks referenced by requests (prefix-cache blocks at ref 0 not counted)."""
        return self.engine.kv.num_blocks - self.engine.kv.num_free_blocks

    # ---- prefill role -------------------------------------------------------------------------
    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        fut = self._future("prefill", request_id)
        self._post(("add", request_id, prompt_token_ids, params))
        return await fut

    async def send(self, request_id: str, decode_id: str, decode_address: str, num_skip: int, channel) -> dict:
        """Starts the handoff here, not on the engine thread: that one may be inside a
        prefill step of hundreds of ms, which the transfer need not wait for (the KV was
        written by an earlier step, whose CUDA event the transfer stream waits on)."""
        fut = self._future("send", request_id)
        try:
            self.role.send(request_id, decode_id, decode_address, num_skip, channel, self.handoff_timeout_s)
        except Exception:
            self.futures.pop(("send", request_id), None)
            raise
        self.wake.set()  # the engine loop polls the handoff and resolves `fut`
        return await fut

    # ---- decode role ---------------------------------------------------------------------------
    async def reserve(self, prefill_id: str, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, first_token: int):
        self.streams[request_id] = asyncio.Queue()
        fut = self._future("reserve", request_id)
        self._post(("reserve", prefill_id, request_id, prompt_token_ids, params, first_token, time.monotonic()))
        return await fut

    async def local(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Decode role: prefill here too (short or mostly cached prompts); stream() gives the tokens."""
        self.streams[request_id] = asyncio.Queue()
        fut = self._future("local", request_id)
        self._post(("local", request_id, prompt_token_ids, params))
        return await fut

    async def stream(self, request_id: str):
        q = self.streams.get(request_id)
        if q is None:
            raise ValueError(f"no request {request_id!r} on {self.worker_id}")
        try:
            while True:
                out: RequestOutput = await q.get()
                while not out.finished and not q.empty():  # the consumer fell behind: one item
                    out = merge_outputs(out, q.get_nowait())
                yield slim_output(out)
                if out.finished:
                    return
        finally:
            self.streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    async def forget_peer(self, worker_id: str) -> None:
        self._post(("forget", worker_id))

    # ---- plumbing between the actor's event loop and the engine thread ------------------------
    def _future(self, kind: str, request_id: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.futures[(kind, request_id)] = fut
        return fut

    def _post(self, cmd: tuple) -> None:
        self.inbox.append(cmd)
        self.wake.set()

    def _resolve(self, kind: str, request_id: str, value=None, error: Exception | None = None) -> None:
        def done():
            fut = self.futures.pop((kind, request_id), None)
            if fut is not None and not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)
        self.aloop.call_soon_threadsafe(done)

    def _emit(self, out: RequestOutput) -> None:
        def put():
            q = self.streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
        self.aloop.call_soon_threadsafe(put)

    # ---- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        last_beat = 0.0
        while not self.stopped:
            self.wake.clear()
            while self.inbox:
                self._handle(self.inbox.popleft())
            busy = self._work()
            now = time.monotonic()
            if now - last_beat >= self.heartbeat_s:
                last_beat = now
                self._heartbeat()
            if not busy and not self.inbox:
                self.wake.wait(0.005 if (self.connector._handoffs or self.backlog) else 0.2)

    def _heartbeat(self) -> None:
        pool = self.engine.kv.pool
        events = [(k, h.hex()) for k, h in pool.drain_events()]
        try:
            if self._beat is not None and ray.wait([self._beat], timeout=0)[0] and ray.get(self._beat) is False:
                # the registry purged us (no heartbeat within its stale_s, e.g. a long stall):
                # join again and announce every cached block, not just the news
                self.registry.register.remote(self.worker_id, self.info())
                events = [("stored", h.hex()) for h in pool.cached]
            self._beat = self.registry.heartbeat.remote(self.worker_id, self._stats(), events)
        except Exception:  # noqa: BLE001 - the registry restarting must not stop the engine
            self._beat = None

    def _handle(self, cmd: tuple) -> None:
        kind, rid = cmd[0], cmd[1]
        try:
            if kind == "forget":
                self.connector.forget_peer(rid)
            elif kind == "add":
                self.role.add(cmd[2], cmd[3], rid)
            elif kind == "local":
                self.engine.add_request(cmd[2], cmd[3], rid)
                self._resolve("local", rid, None)
            elif kind == "reserve":
                self.backlog.append(cmd)
                self._try_reserve()
            elif kind == "abort":
                self.role.abort(rid)
                self.backlog = [c for c in self.backlog if c[2] != rid]
                for k in ("prefill", "send", "reserve", "local"):
                    self._resolve(k, rid, error=RuntimeError(f"request {rid} aborted"))
                self._emit(RequestOutput(rid, None, [], [], True))
        except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
            self._resolve({"add": "prefill"}.get(kind, kind), rid, error=e)

    def _try_reserve(self) -> None:
        still = []
        for cmd in self.backlog:
            _, prefill_id, rid, prompt, params, first, t0 = cmd
            try:
                res = self.role.reserve(prompt, params, rid, first)
            except Exception as e:  # noqa: BLE001
                self._resolve("reserve", rid, error=e)
                continue
            if res is None:
                if time.monotonic() - t0 > self.handoff_timeout_s:
                    self._resolve("reserve", rid, error=RuntimeError(
                        f"{self.worker_id} had no free KV blocks for {rid} within {self.handoff_timeout_s} s"))
                else:
                    still.append(cmd)
                continue
            fill, skip = res
            channel = self.role.new_channel(prefill_id)
            self.role.recv(rid, prefill_id, fill, channel, self.handoff_timeout_s)
            self._resolve("reserve", rid, (skip, channel))
        self.backlog = still

    def _work(self) -> bool:
        busy = False
        if self.backlog:
            self._try_reserve()
        if self.role_name == "prefill":
            if self.engine.has_unfinished_requests():
                busy = True
                for p in self.role.step():
                    self._resolve("prefill", p.request_id, p)
            for h in self.role.poll():
                self._resolve("send", h.request_id, {"state": h.state.name, "error": h.error, "bytes": h.nbytes,
                                                     "seconds": h.seconds})
        else:
            for out in self.role.poll():  # first tokens of arrived handoffs: out before the step
                self._emit(out)
            if self.engine.has_unfinished_requests():
                busy = True
                for out in self.role.step():
                    self._emit(out)
        return busy


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """b, a later output of the same request, carrying a's deltas too."""
    b.delta_text = a.delta_text + b.delta_text
    b.delta_token_ids = a.delta_token_ids + b.delta_token_ids
    return b


def slim_output(out: RequestOutput) -> RequestOutput:
    """What a streamed output carries across Ray: its deltas, not the prompt's token ids
    and the cumulative text and ids, which the cluster rebuilds (`Cluster._relay`); a
    4K-token prompt would otherwise be pickled twice per generated token."""
    if not out.outputs:
        return out
    c = out.outputs[0]
    return dataclasses.replace(out, prompt_token_ids=[], outputs=[dataclasses.replace(c, text="", token_ids=[])])


def handoff_failed(result: dict) -> bool:
    return result.get("state") != TransferState.DONE.name
