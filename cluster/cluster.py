"""`Cluster`: prefill and decode pools of Ray actors, the block registry, and the
per-request orchestration the router builds on.

    c = Cluster.start(model=None, prefill=1, decode=1, address=None, **engine_args)
    c.generate(prompts, params)      vLLM-shaped outputs, like LLM.generate
    c.stream(prompt, params)         iterator of incremental RequestOutputs
    c.scale(prefill=2, decode=3)     grow now; shrink after draining
    c.status()                       per worker: role, blocks, running, prefix hits
    c.shutdown()

Pools are described by a `ServingConfig` (cluster/autoscale.py; a YAML file or
dataclass): sizes and min/max per pool, the Ray resources each pool's actors request
(`pdserve_prefill` / `pdserve_decode` when the cluster's nodes offer them, so Ray's
autoscaler brings up the right node type), and the autoscaling policy's targets.

One request: tokenize, chain-hash its full blocks -> prefill worker (registry's
longest cached prefix, else consistent hash with bounded load) runs the prompt and
samples token #1 -> decode worker (most free KV, least load) reserves blocks and
posts its receive -> prefill sends the KV -> decode streams tokens. If a worker
dies before any token was streamed, the request is retried elsewhere; after that
it ends with finish_reason "error". A monitor pings every worker each second,
purges dead ones from the registry and refills the pools to their targets.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayError

from pdserve.engine.config import EngineConfig
from pdserve.engine.hashing import hash_block_tokens
from pdserve.engine.loader import resolve_model_path
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer

from .autoscale import LatencyWindow, PoolSignals, PoolState, ServingConfig, decide
from .registry import REGISTRY_NAME, BlockRegistry
from .routing import Candidate, pick_decode, pick_prefill
from .worker_actor import WorkerActor, handoff_failed

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


@dataclass
class Worker:
    worker_id: str
    role: str
    actor: object
    info: dict = field(default_factory=dict)
    load: int = 0
    draining: bool = False
    stats: dict = field(default_factory=dict)


class WorkerLost(RuntimeError):
    pass


# the prefill pool's default chunk budget (the decode / colocated engines keep the
# engine's 2048, which bounds how long a prefill chunk stalls the running decodes)
PREFILL_CHUNK_TOKENS = 8192


def prefill_pool_args(engine_args: dict, overrides: dict | None = None) -> dict:
    """The prefill pool's engine arguments: the cluster's, then its own overrides; the
    chunk budget defaults to PREFILL_CHUNK_TOKENS, so most prompts run as one chunk
    (fewer chunks that re-read their prefix's KV; on the trace's lengths, one H200:
    2048 -> 8192 cut prefill time 17.1 -> 11.6 s, bench/results/prefill_shapes.md)."""
    out = {**engine_args, **(overrides or {})}
    if out.get("max_num_batched_tokens") is None:
        out["max_num_batched_tokens"] = PREFILL_CHUNK_TOKENS
    return out


class Cluster:
    def __init__(self, model: str | None, prefill: int | None, decode: int | None, address: str | None,
                 namespace: str, actor_options: dict | None, engine_args: dict, local_prefill_tokens: int = 0,
                 local_cached_fraction: float = 2.0, serving_config: ServingConfig | str | None = None,
                 start_timeout: float = 900.0, mode: str = "disaggregated",
                 prefill_engine_args: dict | None = None):
        if mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {mode!r}")
        if mode == "colocated" and prefill:
            raise ValueError("colocated mode has no prefill pool: size it with decode=N (N colocated engines)")
        self.mode = mode
        if isinstance(serving_config, str):
            serving_config = ServingConfig.from_yaml(serving_config)
        self.serving = serving_config or ServingConfig()
        for role, n in (("prefill", prefill), ("decode", decode)):
            if n is not None:  # explicit sizes win over the config's replicas; bounds widen to fit
                pool = self.serving.pool(role)
                pool.replicas = n
                if not self.serving.autoscale.enabled:
                    pool.min, pool.max = min(pool.min, n), max(pool.max, n)
        self.serving.validate()
        self.start_timeout = start_timeout
        self.model_path = resolve_model_path(model)
        # validate names and values here, not in an actor; keeps the limits the router checks
        self.engine_config = EngineConfig.from_kwargs(**{**engine_args, "model": self.model_path})
        self.engine_config.resolve(self.model_path)
        self.max_model_len = self.engine_config.max_model_len
        # conditional disaggregation: prompts up to this many tokens, or with at least this
        # fraction of their blocks cached on a decode worker, are prefilled on that decode
        # worker (defaults: off; values above 1 turn the cached rule off)
        self.local_prefill_tokens = local_prefill_tokens
        self.local_cached_fraction = local_cached_fraction
        self.handoff_observers: list = []  # callbacks(result dict), e.g. each router's metrics
        # callbacks(phase, seconds) for the phases of a request before its first token:
        # prefill (queue + compute on the prefill worker), decode_reserve, kv_to_first_token
        # (handoff + admission on the decode worker), local_first_token (colocated / local)
        self.phase_observers: list = []
        self.engine_args = {**engine_args, "model": self.model_path}
        # the prefill pool's own engine settings (e.g. a larger chunk budget: a prefill
        # worker runs no decodes whose inter-token latency a long chunk would hurt)
        prefill_args = prefill_pool_args(self.engine_args, prefill_engine_args)
        self.role_engine_args = {"decode": self.engine_args, "prefill": prefill_args}
        EngineConfig.from_kwargs(**prefill_args).resolve(self.model_path)
        self.block_size = engine_args.get("block_size", 16)
        self.tokenizer = load_tokenizer(self.model_path)
        self.namespace = namespace
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            env = {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "RAY_AUTH_MODE", "PDSERVE_CACHE",
                                              "PDSERVE_TORCH_THREADS") if k in os.environ}
            ray.init(address=address, namespace=namespace, include_dashboard=False,
                     runtime_env={"env_vars": env}, log_to_driver=False)
        self.actor_options = {role: dict(actor_options) if actor_options else self._role_options(role)
                              for role in ROLES}
        self.registry = BlockRegistry.options(name=REGISTRY_NAME, namespace=namespace,
                                              get_if_exists=True).remote()
        self.workers: dict[str, Worker] = {}
        self.targets = {"prefill": 0, "decode": 0}
        self._ids = itertools.count()
        self.counters = {"requests": 0, "retries": 0, "failed": 0, "routing": {}, "autoscale": []}
        window = self.serving.autoscale.window_s
        self.ttft, self.itl = LatencyWindow(window), LatencyWindow(window)
        self._pool_state = {role: PoolState() for role in ROLES}
        self._aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aloop.run_forever, name="pdserve-cluster", daemon=True)
        self._thread.start()
        self._closed = False
        self._scaling = asyncio.Lock()
        self._monitor = None
        try:
            self.scale(prefill=None if mode == "colocated" else self.serving.prefill.replicas,
                       decode=self.serving.decode.replicas)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = self._submit(self._monitor_loop())

    @classmethod
    def start(cls, model: str | None = None, prefill: int | None = None, decode: int | None = None,
              address: str | None = None, namespace: str = "pdserve", actor_options: dict | None = None,
              local_prefill_tokens: int = 0, local_cached_fraction: float = 2.0,
              serving_config: ServingConfig | str | None = None, start_timeout: float = 900.0,
              mode: str = "disaggregated", prefill_engine_args: dict | None = None, **engine_args) -> Cluster:
        """`prefill` / `decode` default to the serving config's replicas (1 each without one).
        mode="colocated" is the baseline: `decode` engines that each prefill (chunked) and
        decode their own requests, placed by cached prefix then consistent hash; no handoff."""
        return cls(model, prefill, decode, address, namespace, actor_options, engine_args,
                   local_prefill_tokens, local_cached_fraction, serving_config, start_timeout, mode,
                   prefill_engine_args)

    def _role_options(self, role: str) -> dict:
        """Ray options for one pool's actors: a GPU each when the cluster has GPUs, and the
        pool's custom resource (pdserve_prefill / pdserve_decode) when some node offers it,
        so that only that pool's node type can host it and the autoscaler grows that type."""
        pool = self.serving.pool(role)
        have = ray.cluster_resources()
        gpus = pool.num_gpus if pool.num_gpus is not None else (1 if have.get("GPU", 0) else 0)
        opts = {"num_cpus": pool.num_cpus if pool.num_cpus is not None else (1 if gpus else 0)}
        if gpus:
            opts["num_gpus"] = gpus
        resources = pool.resources
        if resources is None:
            resources = {f"pdserve_{role}": 1} if have.get(f"pdserve_{role}", 0) else {}
        if resources:
            opts["resources"] = dict(resources)
        return opts

    # ---- sync facade over the cluster's event loop ---------------------------------------------
    def _submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._aloop)

    def _run(self, coro, timeout: float | None = None):
        return self._submit(coro).result(timeout)

    # ---- pools -----------------------------------------------------------------------------------
    def scale(self, prefill: int | None = None, decode: int | None = None, timeout: float = 600) -> dict:
        """Sets the pool sizes. Growth returns once the new workers serve; shrinking drains
        the removed workers (no new requests; in-flight ones finish) before they stop."""
        if self.mode == "colocated" and prefill is not None:
            raise ValueError("colocated mode has no prefill pool: scale decode (the colocated engines)")
        for role, n in (("prefill", prefill), ("decode", decode)):
            if n is not None and n < 1:
                raise ValueError(f"each pool needs at least one worker, got {role}={n}")
            pool = self.serving.pool(role)
            if n is not None and self.serving.autoscale.enabled and not (pool.min <= n <= pool.max):
                raise ValueError(f"{role}={n} is outside the autoscaler's bounds [{pool.min}, {pool.max}]")
        return self._run(self._scale({"prefill": prefill, "decode": decode}), timeout)

    async def _scale(self, want: dict) -> dict:
        async with self._scaling:
            for role, n in want.items():
                if n is not None:
                    self.targets[role] = n
            drains = await self._reconcile()
        await asyncio.gather(*drains)  # outside the lock: a long drain blocks no other scaling
        return self.pool_sizes()

    def pool_sizes(self) -> dict:
        return {r: sum(1 for w in self.workers.values() if w.role == r and not w.draining) for r in ROLES}

    async def _reconcile(self) -> list:
        """Starts workers up to the targets (awaited) and marks the surplus draining; returns
        the drain tasks."""
        adds, drains = [], []
        for role in ROLES:
            live = [w for w in self.workers.values() if w.role == role and not w.draining]
            for _ in range(self.targets[role] - len(live)):
                adds.append(self._add_worker(role))
            for w in sorted(live, key=lambda w: w.worker_id, reverse=True)[: max(0, len(live) - self.targets[role])]:
                w.draining = True
                drains.append(asyncio.ensure_future(self._drain_and_remove(w)))
        if adds:
            await asyncio.gather(*adds)
        return drains

    async def _add_worker(self, role: str) -> Worker:
        label = "colocated" if self.mode == "colocated" else role
        wid = f"{label}-{next(self._ids)}-{uuid.uuid4().hex[:4]}"
        cls = ray.remote(WorkerActor).options(name=wid, namespace=self.namespace, max_concurrency=1000,
                                              **self.actor_options[role])
        actor = cls.remote(wid, role, self.role_engine_args[role], self.namespace)
        try:
            info = await asyncio.wait_for(actor.start.remote(), self.start_timeout)
        except asyncio.TimeoutError:
            ray.kill(actor)
            raise RuntimeError(f"{role} worker did not start within {self.start_timeout:.0f} s: no node offers "
                               f"{self.actor_options[role]} (is the autoscaler at its node type's max?)") from None
        w = Worker(wid, role, actor, info)
        self.workers[wid] = w
        log.info("worker %s started", wid)
        return w

    async def _drain_and_remove(self, w: Worker, timeout: float = 300) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                st = await asyncio.wait_for(w.actor.stats.remote(), 10)
            except (RayError, asyncio.TimeoutError):
                break  # gone already
            if w.load == 0 and st["inflight"] == 0:
                break
            await asyncio.sleep(0.2)
        await self._remove(w, graceful=True)

    async def _remove(self, w: Worker, graceful: bool) -> None:
        self.workers.pop(w.worker_id, None)
        if graceful:
            try:
                await asyncio.wait_for(w.actor.stop.remote(), 15)
            except (RayError, asyncio.TimeoutError):
                pass
        for other in self.workers.values():  # peers drop their pair groups with it
            other.actor.forget_peer.remote(w.worker_id)
        try:
            ray.kill(w.actor)
        except Exception:  # noqa: BLE001
            pass
        await self.registry.unregister.remote(w.worker_id)

    async def _monitor_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(1.0)
            for w in list(self.workers.values()):
                try:
                    w.stats = await asyncio.wait_for(w.actor.stats.remote(), 5)
                except (RayError, asyncio.TimeoutError):
                    if w.worker_id in self.workers and not self._closed:
                        log.warning("worker %s is dead: purging and replacing it", w.worker_id)
                        await self._remove(w, graceful=False)
            if not self._closed and not self._scaling.locked():
                async with self._scaling:
                    try:
                        await self._reconcile()  # drains it starts run on their own
                    except RayError as e:
                        log.warning("refilling pools failed: %s", e)
            if self.serving.autoscale.enabled and not self._closed and not self._scaling.locked():
                self._autoscale_step(time.monotonic())

    def pool_signals(self, now: float | None = None) -> dict[str, PoolSignals]:
        """The autoscaler's inputs, from the stats the monitor gathered and the latency windows."""
        now = time.monotonic() if now is None else now
        out = {}
        for role in ROLES:
            live = [w for w in self.workers.values() if w.role == role and not w.draining]
            n = max(1, len(live))
            if role == "prefill":
                waiting = sum(w.stats.get("num_waiting", 0) for w in live)
                out[role] = PoolSignals(len(live), queue=waiting / n, latency=self.ttft.quantile(0.9, now))
            else:
                used = sum(w.stats.get("kv_blocks_used", 0) for w in live)
                total = sum(w.stats.get("kv_blocks_total", w.info.get("capacity_blocks", 0)) for w in live)
                out[role] = PoolSignals(len(live), usage=used / total if total else 0.0,
                                        latency=self.itl.quantile(0.9, now))
        return out

    def _autoscale_step(self, now: float) -> None:
        cfg, want = self.serving.autoscale, {}
        for role, sig in self.pool_signals(now).items():
            if sig.size != self.targets[role] or (role == "prefill" and self.mode == "colocated"):
                continue  # a change is still being applied
            size, why = decide(role, sig, cfg, self.serving.pool(role), self._pool_state[role], now)
            if size != sig.size:
                want[role] = size
                self._pool_state[role].last_change = now
                self._pool_state[role].calm_since = None
                event = {"time": time.time(), "role": role, "from": sig.size, "to": size, "reason": why}
                self.counters["autoscale"].append(event)
                log.warning("autoscale %s: %d -> %d (%s)", role, sig.size, size, why)
        if want:
            task = asyncio.ensure_future(self._scale(want))
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or
                                   log.warning("autoscale failed: %s", t.exception()))

    # ---- placement ---------------------------------------------------------------------------
    def _candidates(self, role: str) -> list[Candidate]:
        out = []
        for w in self.workers.values():
            if w.role == role and not w.draining:
                st = w.stats
                total = st.get("kv_blocks_total", w.info.get("capacity_blocks", 1))
                used = st.get("kv_blocks_used", 0)
                out.append(Candidate(w.worker_id, w.load, total - used, total))
        return out

    async def _pick_prefill(self, hashes: list[str], prompt_ids: list[int], role: str = "prefill") -> Worker:
        """The worker to run this prompt's prefill: of the prefill pool, or (colocated mode)
        of the decode pool."""
        cached = await self.registry.longest_prefix.remote(hashes, role) if hashes else (None, 0)
        key = hashes[0] if hashes else str(prompt_ids[: self.block_size])
        wid, reason = pick_prefill(self._candidates(role), key, tuple(cached))
        self._count(reason)
        return self.workers[wid]

    # ---- one request ---------------------------------------------------------------------------
    def _prepare(self, prompt: str | list[int], params: SamplingParams | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if not prompt:
            raise ValueError("prompt is empty (no tokens)")
        return None, list(prompt)

    async def _request(self, prompt: str | None, ids: list[int], params: SamplingParams, sink) -> None:
        rid = uuid.uuid4().hex[:16]
        hashes = [h.hex() for h in hash_block_tokens(ids, self.block_size)]
        self.counters["requests"] += 1
        sink = self._observed(sink)
        last_error = None
        for attempt in range(3):  # WorkerLost means no token reached the client yet: retry elsewhere
            try:
                await self._attempt(f"{rid}-{attempt}", prompt, ids, hashes, params, sink)
                return
            except WorkerLost as e:
                last_error = e
                self.counters["retries"] += 1
        self.counters["failed"] += 1
        sink(self._error_output(rid, prompt, ids, str(last_error)))

    def _observed(self, sink):
        """Wraps a request's sink to record TTFT and inter-token latency for the autoscaler."""
        t0 = time.monotonic()
        last = None

        def observe(out: RequestOutput) -> None:
            nonlocal last
            if out.outputs and out.outputs[0].token_ids:
                now = time.monotonic()
                if last is None:
                    self.ttft.add(now - t0, now)
                else:
                    self.itl.add(now - last, now)
                last = now
            sink(out)

        return observe

    @staticmethod
    def _error_output(rid: str, prompt: str | None, ids: list[int], reason: str) -> RequestOutput:
        """The final output of a request that failed: finish_reason "error", the cause as stop_reason."""
        return RequestOutput(rid, prompt, ids, [CompletionOutput(0, "", [], finish_reason="error",
                                                                 stop_reason=reason)], True)

    def _phase(self, name: str, seconds: float) -> None:
        for observe in self.phase_observers:
            observe(name, seconds)

    def _count(self, reason: str) -> None:
        self.counters["routing"][reason] = self.counters["routing"].get(reason, 0) + 1

    async def _local_decode(self, hashes: list[str], ids: list[int]) -> tuple[Worker | None, str]:
        """Conditional disaggregation: the decode worker to prefill on, if any."""
        if len(ids) <= self.local_prefill_tokens:
            return self.workers[pick_decode(self._candidates("decode"))], "local_short"
        if hashes and self.local_cached_fraction <= 1.0 and \
                self.local_cached_fraction * len(ids) <= len(hashes) * self.block_size:
            holder, depth = await self.registry.longest_prefix.remote(hashes, "decode")
            if holder in self.workers and not self.workers[holder].draining and \
                    depth * self.block_size >= self.local_cached_fraction * len(ids):
                return self.workers[holder], "local_cached"
        return None, ""

    async def _relay(self, d: Worker, rid: str, prompt, ids: list[int], sink, p: Worker, progress: dict) -> None:
        """Passes the decode worker's stream to `sink`; progress["streamed"] tells the caller
        whether the client has seen a token (then a failure cannot be retried elsewhere).
        The worker sends deltas only (`slim_output`); the cumulative fields are rebuilt here."""
        text, token_ids = "", []
        async for ref in d.actor.stream.options(num_returns="streaming").remote(rid):
            out: RequestOutput = await ref
            c = out.outputs[0] if out.outputs else None
            if c is None:  # aborted
                return
            text += out.delta_text
            token_ids += out.delta_token_ids
            c.text, c.token_ids, out.prompt_token_ids = text, list(token_ids), ids
            if c.finish_reason == "error" and not c.token_ids:
                raise WorkerLost(f"request {rid} failed on {p.worker_id} -> {d.worker_id}: {c.stop_reason}")
            out.prompt = prompt
            if not progress["streamed"]:
                progress["first_at"] = time.monotonic()
            progress["streamed"] = True
            sink(self._tag(out, p, d))
            if out.finished:
                return

    async def _attempt_local(self, rid, prompt, ids, params, sink, d: Worker) -> bool:
        d.load += 1
        progress = {"streamed": False}
        t0 = time.monotonic()
        try:
            await d.actor.local.remote(rid, ids, params)
            await self._relay(d, rid, prompt, ids, sink, d, progress)
            if "first_at" in progress:
                self._phase("local_first_token", progress["first_at"] - t0)
            return True
        except RayActorError as e:
            if progress["streamed"]:
                sink(self._error_output(rid, prompt, ids, f"decode worker {d.worker_id} died"))
                return True
            raise WorkerLost(f"decode worker {d.worker_id} died: {e}") from e
        except RayError as e:
            if isinstance(e.cause, ValueError):
                raise e.cause from None
            raise
        except asyncio.CancelledError:
            d.actor.abort.remote(rid)
            raise
        finally:
            d.load -= 1

    async def _attempt(self, rid, prompt, ids, hashes, params, sink) -> bool:
        if self.mode == "colocated":
            w = await self._pick_prefill(hashes, ids, role="decode")
            return await self._attempt_local(rid, prompt, ids, params, sink, w)
        local, reason = await self._local_decode(hashes, ids)
        if local is not None:
            self._count(reason)
            return await self._attempt_local(rid, prompt, ids, params, sink, local)
        p = await self._pick_prefill(hashes, ids)
        p.load += 1
        d = None
        progress = {"streamed": False, "prefill_released": False}
        t0 = time.monotonic()
        try:
            try:
                pre = await p.actor.prefill.remote(rid, ids, params)
                self._phase("prefill", time.monotonic() - t0)
            except RayActorError as e:
                raise WorkerLost(f"prefill worker {p.worker_id} died: {e}") from e
            except RayError as e:
                if isinstance(e.cause, ValueError):
                    raise e.cause from None
                raise
            if pre.finished:
                pre.output.prompt = prompt
                pre.output.request_id = rid
                sink(self._tag(pre.output, p, None))
                return True
            d = self.workers[pick_decode(self._candidates("decode"))]
            d.load += 1
            t1 = time.monotonic()
            try:
                skip, channel = await d.actor.reserve.remote(p.worker_id, rid, ids, params, pre.first_token)
                t2 = time.monotonic()
                self._phase("decode_reserve", t2 - t1)
            except RayActorError as e:
                p.actor.abort.remote(rid)
                raise WorkerLost(f"decode worker {d.worker_id} died: {e}") from e
            self.registry.begin_handoff.remote(rid, p.worker_id, d.worker_id, 60.0)
            relay = asyncio.ensure_future(self._relay(d, rid, prompt, ids, sink, p, progress))
            send = asyncio.ensure_future(
                self._sent(p, p.actor.send.remote(rid, d.worker_id, d.info["address"], skip, channel), rid, progress))
            try:
                await relay
            except RayActorError as e:
                p.actor.abort.remote(rid)
                if progress["streamed"]:
                    sink(self._error_output(rid, prompt, ids, f"decode worker {d.worker_id} died mid-generation"))
                    return True
                raise WorkerLost(f"decode worker {d.worker_id} died: {e}") from e
            if "first_at" in progress:
                self._phase("kv_to_first_token", progress["first_at"] - t2)
            await send
            return True
        except asyncio.CancelledError:  # the client went away: free the blocks everywhere
            p.actor.abort.remote(rid)
            if d is not None:
                d.actor.abort.remote(rid)
            raise
        finally:
            if not progress["prefill_released"]:
                progress["prefill_released"] = True
                p.load -= 1
            if d is not None:
                d.load -= 1
                self.registry.end_handoff.remote(rid)

    async def _sent(self, p: Worker, send, rid: str, progress: dict) -> None:
        """Waits for the prefill side of a handoff; from then on the request no longer loads
        the prefill worker (its routing load, and what a drain of it waits for)."""
        try:
            res = await asyncio.wait_for(send, 120)
            if handoff_failed(res):
                log.warning("handoff %s reported %s", rid, res)
            else:
                for observe in self.handoff_observers:
                    observe(res)
        except (RayError, asyncio.TimeoutError):
            pass
        finally:
            if not progress["prefill_released"]:
                progress["prefill_released"] = True
                p.load -= 1

    @staticmethod
    def _tag(out: RequestOutput, p: Worker, d: Worker | None) -> RequestOutput:
        out.prefill_worker = p.worker_id  # -> x-pdserve-prefill / x-pdserve-decode headers
        out.decode_worker = d.worker_id if d is not None else p.worker_id
        return out

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 timeout: float | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(prompts)
        prepared = [self._prepare(p, sp) for p, sp in zip(prompts, params)]

        async def one(text, ids, sp):
            final = []
            await self._request(text, ids, sp, final.append)
            return final[-1]

        async def all_():
            return await asyncio.gather(*(one(t, i, sp) for (t, i), sp in zip(prepared, params)))

        return self._run(all_(), timeout)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               timeout: float = 600) -> Iterator[RequestOutput]:
        text, ids = self._prepare(prompt, sampling_params)
        q: queue.Queue = queue.Queue()
        fut = self._submit(self._request(text, ids, sampling_params or SamplingParams(), q.put))
        deadline = time.monotonic() + timeout
        while True:
            try:
                out = q.get(timeout=0.1)
            except queue.Empty:
                if fut.done():
                    fut.result()  # raises the request's error, if any
                    return
                if time.monotonic() > deadline:
                    fut.cancel()
                    raise TimeoutError("stream timed out") from None
                continue
            yield out
            if out.finished:
                return

    def submit(self, prompt: str | None, ids: list[int], params: SamplingParams, sink):
        """Starts one request on the cluster's loop; `sink(out)` gets every output (from
        that loop's thread). Returns a concurrent future; cancelling it aborts the request
        on every worker and frees its blocks."""
        return self._submit(self._request(prompt, ids, params, sink))

    def status(self) -> list[dict]:
        async def collect():
            rows = []
            for w in list(self.workers.values()):
                try:
                    st = await asyncio.wait_for(w.actor.stats.remote(), 10)
                except (RayError, asyncio.TimeoutError):
                    st = {"error": "unreachable"}
                rows.append({"worker_id": w.worker_id, "role": w.role, "draining": w.draining,
                             "load": w.load, **st})
            return rows

        return self._run(collect(), 60)

    def registry_workers(self) -> list[dict]:
        return ray.get(self.registry.list_workers.remote())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop_all():
            await asyncio.gather(*(self._remove(w, graceful=True) for w in list(self.workers.values())),
                                 return_exceptions=True)

        try:
            if self._monitor is not None:
                self._monitor.cancel()
            self._run(stop_all(), 60)
        finally:
            try:
                ray.kill(self.registry)
            except Exception:  # noqa: BLE001
                pass
            self._aloop.call_soon_threadsafe(self._aloop.stop)
            if self._owns_ray:
                ray.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
