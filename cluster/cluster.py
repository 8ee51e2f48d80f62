"""`Cluster`: the public API of a pdserve cluster on Ray.

    c = Cluster(ClusterSpec.of(model, prefill=1, decode=1, mode=..., **engine_args))
    c = Cluster.start(model=None, prefill=1, decode=1, address=None, **engine_args)   # the same
    c.generate(prompts, params)      vLLM-shaped outputs, like LLM.generate
    c.stream(prompt, params)         iterator of cumulative RequestOutputs
    c.submit(prompt, c.validate(ids, params), sink) -> future; sink gets delta outputs (the router)
    c.scale(prefill=2, decode=3)     grow now; shrink after draining
    c.status()                       per worker: role, blocks, running, prefix hits
    c.shutdown()

It owns an event loop thread on which its parts run: `Pools` (pools.py: workers,
scaling, health, autoscaling), `Dispatcher` (dispatch.py: one request's way through
the workers) and the registry actor (registry.py). What it is comes from one `ClusterSpec`
(cluster_spec.py: the pools' ServingConfig and each pool's engine spec, parsed once). Front
ends use it through `ServingCluster` (api.py) only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import ray

from pdserve.engine.outputs import Accumulator, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.engine.validation import ValidRequest, check_request

from .aio import within
from .api import ClusterSnapshot, RequestObserver
from .dispatch.dispatch import Dispatcher
from .health.links import LinkCheck
from .health.local_ray import shutdown_own_ray, start_or_join_ray
from .pools.pools import Pools
from .records import RegisteredWorker
from .registry.registry import REGISTRY_NAME, named_actor
from .registry.registry_link import RegistryLink
from .spec.cluster_spec import ClusterSpec
from .spec.serving_config import ROLES
from .workers.gpus import runtime_env as gpus_runtime_env
from .workers.output_pipe import OutputPipe


class _AutoscaleLatency(RequestObserver):
    """Feeds the pools' latency windows (the autoscaler's TTFT and ITL p90)."""

    def __init__(self, pools: Pools):
        self.pools = pools

    def on_latency(self, kind: str, seconds: float) -> None:
        window = {"ttft": self.pools.ttft, "itl": self.pools.itl}.get(kind)
        if window is not None:
            window.add(seconds)


class Cluster:
    def __init__(self, spec: ClusterSpec, *, worker_cls=None, progress=None):
        """A cluster as `spec` describes it (cluster_spec.py; `Cluster.start` builds the spec from
        arguments). Starts (or joins, `spec.address`) Ray, the registry and the pools' first
        workers; raises, having stopped what it started, when a worker cannot start. `worker_cls`:
        a WorkerActor subclass (fault-injection tests). `progress(message)`: told each stage of the
        start (the CLI prints them)."""
        say = progress or (lambda message: None)
        self.spec = spec
        self.mode, self.serving, self.specs = spec.mode, spec.serving, spec.engines
        decode = spec.engines.decode
        self.model_path, self.max_model_len, self.block_size = decode.model, decode.max_model_len, decode.block_size
        self.vocab_size = decode.model_config.vocab_size
        self.tokenizer = load_tokenizer(decode.tokenizer or self.model_path)
        say(f"model {self.model_path}: config and tokenizer read (max_model_len {self.max_model_len})")
        self._owns_ray = not ray.is_initialized()
        self.namespace = namespace = spec.namespace
        if self._owns_ray:
            # no address: a Ray of our own ("local"), never one that happens to run on this machine
            say(f"joining the Ray cluster at {spec.address}" if spec.address else "starting a local Ray cluster")
            start_or_join_ray(spec.address, namespace)
        # a Ray of our own is this machine only: the workers' KV stores listen on loopback
        bind_host = "127.0.0.1" if self._owns_ray and spec.address is None else None
        try:
            named_actor(REGISTRY_NAME, namespace)
        except ValueError:
            pass
        else:
            if self._owns_ray:
                shutdown_own_ray()
            raise RuntimeError(f"another pdserve cluster serves namespace {namespace!r} on this Ray cluster: "
                               "pick another namespace (--namespace), or stop that one")
        self.registry = RegistryLink(namespace)
        self.registry.create()
        self._aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aloop.run_forever, name="pdserve-cluster", daemon=True)
        self._thread.start()
        options = {role: dict(spec.actor_options) if spec.actor_options else self._role_options(role)
                   for role in ROLES}
        self.pools = Pools(spec, options, self.registry, bind_host)
        self.pools.worker_cls = worker_cls or self.pools.worker_cls
        self.pipe = OutputPipe()  # workers' outputs straight to this process (output_pipe.py)
        self.pools.output_pipe = self._run(self.pipe.start(bind_host or ray.util.get_node_ip_address()), 30)
        self.pools.progress = say
        self.dispatcher = Dispatcher(self.pools, self.registry, self.block_size, spec.placement, pipe=self.pipe)
        self.dispatcher.observers.append(_AutoscaleLatency(self.pools))
        self.pools.pass_checks.append(LinkCheck(self.dispatcher.placer, self.pools.workers))
        if self.pools.ratio is not None:
            self.dispatcher.observers.append(self.pools.ratio)
        self._closed = False
        self._monitor = None
        try:
            sizes = {"prefill": None if self.mode == "colocated" else self.serving.prefill.replicas,
                     "decode": self.serving.decode.replicas}
            say("starting " + " + ".join(f"{n} {role}" for role, n in sizes.items() if n) +
                " worker(s); each loads the model")
            self.scale(**sizes)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = self._submit(self.pools.monitor())

    @classmethod
    def start(cls, model: str | None = None, prefill: int | None = None, decode: int | None = None, *,
              worker_cls=None, progress=None, **spec_args) -> Cluster:
        """`Cluster(ClusterSpec.of(model, prefill, decode, **spec_args))`: ClusterSpec.of names the
        arguments (mode, serving_config, address, namespace, the local-prefill rules, each pool's
        TP and the engine arguments) and checks them all before Ray or any worker starts."""
        return cls(ClusterSpec.of(model, prefill, decode, **spec_args), worker_cls=worker_cls, progress=progress)

    def _role_options(self, role: str) -> dict:
        """Ray options for one pool's actors: a GPU each when the cluster has GPUs, and the
        pool's custom resource (pdserve_prefill / pdserve_decode) when some node offers it,
        so that only that pool's node type can host it and the autoscaler grows that type."""
        pool = self.serving.pool(role)
        have = ray.cluster_resources()
        gpus = pool.num_gpus if pool.num_gpus is not None else (1 if have.get("GPU", 0) else 0)
        opts = {"num_cpus": pool.num_cpus if pool.num_cpus is not None else (1 if gpus else 0)}
        if gpus:  # Ray accounts the GPUs; the actor makes the node's others visible (gpus.py)
            opts["num_gpus"], opts["runtime_env"] = gpus, gpus_runtime_env()
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

    # ---- requests --------------------------------------------------------------------------------
    def validate(self, ids: list[int], params: SamplingParams) -> ValidRequest:
        """The one validation (engine/validation.py) against this cluster's model: what `submit`
        takes and the workers get. Raises InvalidRequest (a ValueError) naming the field."""
        return check_request(ids, params, self.max_model_len, self.vocab_size,
                             bounded=self.specs.decode.kv_window_tokens is None)

    def _prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, ValidRequest]:
        if params.n != 1:
            raise ValueError(f"n={params.n}: submit one sequence per request (SamplingParams.samples(); the HTTP "
                             "server does this for n > 1)")
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        return text, self.validate(ids, params)

    def submit(self, prompt: str | None, request: ValidRequest, sink, stream: bool = True):
        """Starts one request (`validate`'s) on the cluster's loop; `sink(out)` gets its delta
        outputs (from that loop's thread; with stream=False all at the end, so that a worker lost
        after the first token is retried). Returns a concurrent future; cancelling it aborts the
        request on every worker and frees its blocks."""
        return self._submit(self.dispatcher.request(request, sink, stream))

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 timeout: float | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(prompts)
        prepared = [self._prepare(p, sp) for p, sp in zip(prompts, params)]

        async def one(text, request):
            acc, final = Accumulator(text, request.prompt_token_ids), []
            await self.dispatcher.request(request, lambda out: final.append(acc.add(out)), stream=False)
            return final[-1]

        async def all_():
            return await asyncio.gather(*(one(t, r) for t, r in prepared))

        return self._run(all_(), timeout)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               timeout: float = 600) -> Iterator[RequestOutput]:
        params = sampling_params or SamplingParams()
        text, request = self._prepare(prompt, params)
        acc, q = Accumulator(text, request.prompt_token_ids), queue.Queue()
        fut = self.submit(text, request, q.put)
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
            yield acc.add(out)
            if out.finished:
                return

    def add_observer(self, observer: RequestObserver) -> None:
        self.dispatcher.observers.append(observer)

    def timeline(self, n: int = 1000) -> list[dict]:
        """The last `n` requests' timelines: spans (wall-clock seconds) and phases."""
        return list(self.dispatcher.timeline)[-n:]

    # ---- pools -----------------------------------------------------------------------------------
    def scale(self, prefill: int | None = None, decode: int | None = None, switch_roles: bool = False,
              timeout: float = 600) -> dict:
        """Sets the pool sizes. Growth returns once the new workers serve; shrinking drains
        the removed workers (no new requests; in-flight ones finish) before they stop.
        switch_roles=True reaches the sizes by moving workers between the pools instead
        (drain, switch role, re-register), keeping the total: e.g. 1P3D -> 2P2D on 4 GPUs."""
        if self.mode == "colocated" and (prefill is not None or switch_roles):
            raise ValueError("colocated mode has no prefill pool: scale decode (the colocated engines)")
        for role, n in (("prefill", prefill), ("decode", decode)):
            if n is not None and n < 1:
                raise ValueError(f"each pool needs at least one worker, got {role}={n}")
            pool = self.serving.pool(role)
            if n is not None and self.serving.autoscale.enabled and not (pool.min <= n <= pool.max):
                raise ValueError(f"{role}={n} is outside the autoscaler's bounds [{pool.min}, {pool.max}]")
        return self._run(self.pools.scale({"prefill": prefill, "decode": decode}, switch_roles), timeout)

    def set_slo(self, ttft_s: float | None = None, tpot_s: float | None = None) -> dict:
        """Changes the SLO live: hybrid placement reads it per request; the decode workers'
        step budget (hybrid and colocated modes) follows the TPOT target from their next step."""
        slo = dataclasses.replace(self.serving.slo, **{k: v for k, v in (("ttft_s", ttft_s), ("tpot_s", tpot_s))
                                                       if v is not None})
        slo.validate()
        self.serving.slo = slo  # its one home: placement and new workers read it there
        if self.mode in ("hybrid", "colocated"):  # new workers read serving.slo (Pools.engine_args)
            self._run(self.pools.retune("decode", slo.tpot_s), 60)
        return dataclasses.asdict(slo)

    def slo(self) -> dict:
        return dataclasses.asdict(self.serving.slo)

    def pool_sizes(self) -> dict:
        return self.pools.pool_sizes()

    @property
    def workers(self) -> dict:
        """worker id -> WorkerRecord (pools.py)."""
        return self.pools.workers

    @property
    def counters(self) -> dict:
        """requests, retries, failed, routing decisions by reason, how outputs came (the output pipe
        or Ray's stream), autoscale events, role switches."""
        return {**self.dispatcher.counters, "autoscale": self.pools.autoscale_events,
                "switches": self.pools.switch_events}

    def snapshot(self) -> ClusterSnapshot:
        """What the monitor last saw (no call into the workers): for metrics scrapes."""
        rows = [{"worker_id": w.worker_id, "role": w.role, **w.stats.as_dict(), "load": w.load}
                for w in list(self.pools.workers.values())]
        return ClusterSnapshot(rows, self.pool_sizes(), dict(self.dispatcher.counters["routing"]),
                               self.serving.autoscale.enabled, list(self.pools.autoscale_events[-20:]),
                               dict(self.pools.ratio.last) if self.pools.ratio is not None else None)

    def status(self) -> list[dict]:
        async def collect():
            rows = []
            for w in list(self.pools.workers.values()):
                try:
                    st = (await within(w.actor.stats.remote(), 10)).as_dict()
                except (ray.exceptions.RayError, asyncio.TimeoutError):
                    st = {"error": "unreachable"}
                rows.append({"worker_id": w.worker_id, "role": w.role, "node": w.info.node if w.info else None,
                             "draining": w.draining,
                             "switching_to": w.switching_to, "load": w.load,
                             "output_pipe": self.pipe.connected(w.worker_id), **st})
            return rows

        return self._run(collect(), 60)

    def registry_workers(self) -> list[RegisteredWorker]:
        """The registry's view of the workers; [] while it is away."""
        return self._run(self.registry.list_workers(), 30) or []

    def health(self) -> dict:
        """What /health reports: the pools, the workers silent to the monitor's probe (seconds), the
        (prefill, decode) pairs out of placement because a link between them is down (seconds left),
        and the block registry ("restarting" while it is away: placement then runs without prefix hints)."""
        return {"pools": self.pool_sizes(), "unresponsive": self.pools.unresponsive(),
                "kv_links_down": self.dispatcher.placer.links_down(),
                "registry": self.registry.state(), "monitor": self.pools.monitor_state()}

    def closing(self) -> None:
        """The process is going down (a signal that its workers got too): the monitor stops
        purging and replacing the workers that end; shutdown() follows."""
        self.pools.closed = True

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.pools.closed = True

        async def stop_all():
            await asyncio.gather(*(self.pools.remove(w, graceful=True) for w in list(self.pools.workers.values())),
                                 return_exceptions=True)

        try:
            if self._monitor is not None:
                self._monitor.cancel()
            self._run(stop_all(), 60)
        finally:
            for w in list(self.pools.leaving.values()):  # removals still under way (a drain, a switch)
                self.pools.kill(w)
            self.registry.kill()
            self._aloop.call_soon_threadsafe(self.pipe.close)
            self._aloop.call_soon_threadsafe(self._aloop.stop)
            if self._owns_ray:
                shutdown_own_ray()
            else:  # the Ray stays: the namespace is free for the next cluster once the registry's name is
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    try:
                        named_actor(REGISTRY_NAME, self.namespace)
                    except ValueError:
                        break
                    time.sleep(0.05)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
