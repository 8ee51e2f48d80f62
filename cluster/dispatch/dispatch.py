"""Dispatch: one request's way through the cluster, from `submit()` to its last output.
Runs on the cluster's event loop thread.

    request()   block hashes; up to 3 attempts (a worker lost before the client saw a
                token, or a handoff that failed: try elsewhere; a non-streamed request's
                outputs are held until its last, so it is retried after its first token
                too); a request that fails for good ends with an error output
                (finish_reason "error", the cause as stop_reason)
    attempt     an Attempt (attempt.py: its wire id, what the client has seen, its charges),
                placed (placement.py's Placement: pools + registry + routing.py; an empty pool
                is NoWorker, the router's 503) and run one of three ways:
      disaggregated  the prefill worker p and the decode worker d are asked AT ONCE:
                         p.prefill(rid, ids, params, d)       -> the handoff's result
                         d.generate(rid, ids, params, p)      -> the stream of outputs
                     d reserves blocks while p computes and tells p where to send (actor
                     to actor); p sends the KV with the first token as soon as both are
                     ready. Nothing returns through here before the first token.
      single         one worker does all: d.generate(rid, ids, params) (conditional
                     disaggregation, colocated mode), or p.prefill(.., None) when
                     max_tokens == 1 (nothing to decode)
    relay       the worker's delta outputs -> the sink, tagged with the workers; the
                first output's spans -> the request's timeline and phases. They come over
                the output pipe (output_pipe.py: d.generate_piped) when the worker's is
                connected, else through Ray's streaming generator (d.generate)
Outputs stay deltas all the way to the sink; `engine.outputs.Accumulator` rebuilds the
cumulative view at the edge that needs one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid

from ray.exceptions import RayActorError, RayError

from pdserve.engine.base.hashing import hash_block_tokens
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.role import HandoffResult
from pdserve.engine.validation import ValidRequest

from ..aio import within
from ..api import FinishedRequest, NoWorker, RequestObserver
from ..placement.placement import Placer
from ..pools.pools import Pools
from ..records import DecodeCall, WorkerRecord
from ..spec.cluster_spec import LocalRules
from ..workers.output_pipe import OutputPipe
from .attempt import Attempt

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A worker died (`dead`) or its handoff failed before the client saw a token: retry
    elsewhere."""

    def __init__(self, message: str, dead: bool = False):
        super().__init__(message)
        self.dead = dead


class Dispatcher:
    def __init__(self, pools: Pools, registry, block_size: int, local: LocalRules | None = None,
                 timeline_len: int = 4096, pipe: OutputPipe | None = None):
        self.pools, self.registry, self.block_size, self.pipe = pools, registry, block_size, pipe
        self.observers: list[RequestObserver] = []
        self.counters = {"requests": 0, "retries": 0, "failed": 0, "routing": {}, "outputs": {"pipe": 0, "ray": 0}}
        self.placer = Placer(pools, registry, block_size, local, self.counters["routing"])
        self.timeline: collections.deque = collections.deque(maxlen=timeline_len)
        self._early_spans: dict[str, dict] = {}

    # ---- one request ---------------------------------------------------------------------------
    async def request(self, request: ValidRequest, sink, stream: bool = True) -> None:
        """Runs one request (validated at the edge); `sink(out)` gets its delta outputs, the last
        one finished. With stream=False the sink gets them all when the last one comes (and, at
        the first token, one output without tokens: the request runs), so a worker lost after the
        first token is retried like one lost before it."""
        rid = uuid.uuid4().hex[:16]
        hashes = [h.hex() for h in hash_block_tokens(request.prompt_token_ids, self.block_size)]
        self.counters["requests"] += 1
        for o in self.observers:
            o.on_arrive(len(request.prompt_token_ids), request.max_tokens)
        last_error = None
        for n in range(3):
            a = Attempt(rid, n, request, hashes, sink, stream)
            try:
                await self._attempt(a)
                return
            except _Ended:
                return
            except NoWorker:  # the router's 503 with Retry-After
                self.counters["failed"] += 1
                raise
            except WorkerLost as e:
                last_error = e
                self.counters["retries"] += 1
            finally:
                a.charges.settle()
        self.counters["failed"] += 1
        self._finish(Attempt(rid, 3, request, hashes, sink), RequestOutput.error(rid, str(last_error)), None, None)

    async def _attempt(self, a: Attempt):
        a.placement = placed = await self.placer.plan(a.hashes, a.request.prompt_token_ids, a.charges)
        if placed.local:
            return await self._single(a, placed.decode)
        if a.request.params.max_tokens == 1:
            return await self._prefill_only(a, placed.prefill)
        return await self._disaggregated(a, placed.prefill, placed.decode)

    async def _disaggregated(self, a: Attempt, p: WorkerRecord, d: WorkerRecord) -> None:
        p.load += 1
        d.load += 1
        call = p.actor.prefill.remote(a.wire_id, a.request, d.worker_id, a.fetch)
        prefill = asyncio.ensure_future(self._await_prefill(p, call, a.rid, d))
        prefill.add_done_callback(a.prefilled)
        relay = asyncio.ensure_future(self._relay(a, d, p))
        try:
            done, _ = await asyncio.wait({prefill, relay}, return_when=asyncio.FIRST_COMPLETED)
            if relay not in done:  # the prefill side ended first: failed, or the request ended there
                err = prefill.exception()
                result = prefill.result() if err is None else None
                if getattr(err, "dead", False):
                    # the prefill worker died: whether its KV landed is the decode worker's to say.
                    # If it did, the request goes on there; if not, the receive fails (the monitor
                    # makes the peers forget the dead worker) and the relay's WorkerLost retries
                    p.draining = True
                elif err is not None:
                    raise self._lost(a, err, p, d)
                elif isinstance(result, RequestOutput):  # nothing to hand off (an error on the
                    d.actor.abort.remote(a.wire_id)  # prefill worker): the decode worker's reservation goes
                    self._finish(a, result, p, None)
                    return
                elif not result.ok and not a.shown:
                    # the decode worker's receive would wait out its deadline: retry now (aborted below)
                    if result.unreachable:  # the link between their hosts is down: not this pair again soon
                        self.placer.link_down(p.worker_id, d.worker_id)
                    if result.pair_lost:  # the retry may meet the same pair: its receiver moves to a new gen first
                        await self._renew(d, p)
                    raise WorkerLost(f"handoff from {p.worker_id} failed: {result.error}")
            try:
                await relay
            except (RayActorError, WorkerLost) as e:
                raise self._lost(a, e, d, d) from None
            try:  # the client has its last output; the request is over once its prefill side is
                await within(asyncio.shield(prefill), 60)
            except (RayError, WorkerLost, asyncio.TimeoutError):
                pass
        except BaseException:  # failed, or the client went away: free the blocks everywhere
            p.actor.abort.remote(a.wire_id)
            d.actor.abort.remote(a.wire_id)
            raise
        finally:
            d.load -= 1
            relay.cancel()
            # the request loads the prefill worker (routing, drains) until its send is over
            prefill.add_done_callback(lambda t: (t.cancelled() or t.exception(), self._release(p)))

    @staticmethod
    async def _renew(d: WorkerRecord, p: WorkerRecord) -> None:
        """The sender p lost its pair with d: d closes its receiving side before any retry is sent
        to it, so the next handoff from p runs on a new gen. (The sender also marks the gen dead in
        d's store, but that write is lost when it cannot reach the store: under load, three tries
        in a row then met the same retired gen.) A d that does not answer is the retry's to find."""
        try:
            await within(d.actor.renew_receives.remote(p.worker_id), 10)
        except (RayError, asyncio.TimeoutError) as e:
            log.warning("%s did not renew its receives from %s: %s", d.worker_id, p.worker_id, e)

    @staticmethod
    def _release(w: WorkerRecord) -> None:
        w.load -= 1

    async def _await_prefill(self, p: WorkerRecord, ref, rid: str | None = None,
                             d: WorkerRecord | None = None) -> HandoffResult | RequestOutput:
        """The prefill side of a handoff to `d`: its result (observed; placement learns the
        link's cost from it), or the output of a request that ended there; a dead worker or bad
        input raises."""
        try:
            res = await ref
        except RayActorError as e:
            log.warning("prefill worker %s died: %s", p.worker_id, e)
            raise WorkerLost(f"prefill worker {p.worker_id} died", dead=True) from e
        except RayError as e:
            if isinstance(e.cause, ValueError):
                raise e.cause from None
            raise WorkerLost(f"prefill on {p.worker_id} failed: {public_cause(e)}") from e
        if isinstance(res, HandoffResult):
            self._late_spans(rid, res.spans)
            if res.ok:
                for o in self.observers:
                    o.on_handoff(res)
                if d is not None:
                    self.placer.observe_transfer(p.worker_id, d.worker_id, res.nbytes, res.seconds)
            else:
                log.warning("handoff from %s reported %s", p.worker_id, res)
        return res

    def _lost(self, a: Attempt, err: BaseException, w: WorkerRecord, d: WorkerRecord | None) -> BaseException:
        """The exception that ends a failed attempt: WorkerLost (retried elsewhere) while
        the client has seen nothing; once it has, the request ends with an error output."""
        if isinstance(err, ValueError):
            return err
        if isinstance(err, RayActorError):
            log.warning("%s worker %s died: %s", w.role, w.worker_id, err)
            err = WorkerLost(f"{w.role} worker {w.worker_id} died", dead=True)
        if getattr(err, "dead", False):
            w.draining = True  # no more placements on it; the monitor purges and replaces it
        if a.shown:
            self._finish(a, RequestOutput.error(a.rid, f"{w.worker_id} failed mid-generation: {public_cause(err)}"),
                         None, d)
            return _Ended()
        return err if isinstance(err, WorkerLost) else WorkerLost(f"{w.worker_id} failed: {public_cause(err)}")

    async def _single(self, a: Attempt, w: WorkerRecord) -> None:
        w.load += 1
        try:
            await self._relay(a, w, None)
        except (RayActorError, WorkerLost) as e:
            raise self._lost(a, e, w, w) from None
        except asyncio.CancelledError:
            w.actor.abort.remote(a.wire_id)
            raise
        finally:
            w.load -= 1

    async def _prefill_only(self, a: Attempt, p: WorkerRecord) -> None:
        p.load += 1
        try:
            out = await self._await_prefill(p, p.actor.prefill.remote(a.wire_id, a.request, None, a.fetch))
            self._finish(a, out, p, None)
        except asyncio.CancelledError:
            p.actor.abort.remote(a.wire_id)
            raise
        finally:
            p.load -= 1

    async def _relay(self, a: Attempt, d: WorkerRecord, p: WorkerRecord | None) -> None:
        """Passes the worker's outputs to the attempt's sink until the last output."""
        call = DecodeCall(a.wire_id, a.request, p.worker_id, p.tp) if p is not None else \
            DecodeCall(a.wire_id, a.request, fetch=a.fetch)
        how = "pipe" if self.pipe is not None and self.pipe.connected(d.worker_id) else "ray"
        self.counters["outputs"][how] += 1
        if how == "pipe":
            outputs = self.pipe.outputs(a.wire_id, d.worker_id, lambda: d.actor.generate_piped.remote(call))
        else:
            outputs = _outputs(d.actor.generate.options(num_returns="streaming").remote(call))
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    c = out.outputs[0] if out.outputs else None
                    if c is not None and c.finish_reason == "error" and not a.shown:
                        raise WorkerLost(f"request {a.rid} failed on {d.worker_id}: {c.stop_reason}")
                    self._finish(a, out, p, d)
                    if out.finished:
                        return
            raise WorkerLost(f"{d.worker_id}: the stream of {a.rid} ended before its last output")  # aborted
        except ConnectionError as e:  # the pipe closed under the request: the worker may live on
            d.actor.abort.remote(a.wire_id)
            raise WorkerLost(f"{d.worker_id}: {e}") from None
        except RayError as e:
            if isinstance(e, RayActorError):
                raise
            if isinstance(e.cause, ValueError):
                raise e.cause from None
            log.warning("%s: %s", d.worker_id, e)
            raise WorkerLost(f"{d.worker_id}: {public_cause(e)}") from e

    # ---- outputs, latencies, the timeline ------------------------------------------------------
    def _finish(self, a: Attempt, out: RequestOutput, p: WorkerRecord | None, d: WorkerRecord | None) -> None:
        """Tags one delta output of `a` with its workers, observes its latencies (and the
        timeline on the first token), and hands it to the attempt's sink."""
        now = time.monotonic()
        out.request_id = a.rid
        out.prefill_worker = p.worker_id if p is not None else (d.worker_id if d is not None else None)
        out.decode_worker = d.worker_id if d is not None else out.prefill_worker
        n = len(out.delta_token_ids)
        a.cached = max(a.cached, out.num_cached_tokens or 0)
        if n:
            if a.first_at is None:
                a.first_at = now
                a.charges.settle()
                self._observe("ttft", now - a.t0)
                self.placer.observe_first_token(a.placement and a.placement.predicted, now - a.t0)
                self._record(a, out, now)
                for _ in range(n - 1):  # tokens that came with the first: no time between them
                    self._observe("itl", 0.0)
            elif a.last is not None:
                for _ in range(n):  # per token, as vLLM counts: the chunk's wait shared by its tokens
                    self._observe("itl", (now - a.last) / n)
            a.last = now
            a.tokens += n
        if out.finished:
            c = out.outputs[0] if out.outputs else None
            self._observe("e2e", now - a.t0)
            done = FinishedRequest((c.finish_reason if c else None) or "abort", len(a.request.prompt_token_ids),
                                   a.tokens,
                                   a.queue_s, a.prefill_s,
                                   now - a.first_at if a.first_at is not None else None,
                                   a.request.params.priority,
                                   a.first_at - a.t0 if a.first_at is not None else None,
                                   out.metrics.num_preemptions if out.metrics is not None else 0,
                                   a.request.max_tokens, a.cached)
            for o in self.observers:
                o.on_finish(done)
        if a.held is not None and not out.finished:
            if n and not a.held:
                a.sink(RequestOutput(out.request_id, None, [], [], False, prefill_worker=out.prefill_worker,
                                     decode_worker=out.decode_worker))
            a.held.append(out)
            return
        for o in a.held or ():
            a.sink(o)
        a.shown = a.shown or bool(n) or bool(a.held)
        a.held = [] if a.held is not None else None
        a.sink(out)

    def _observe(self, kind: str, seconds: float) -> None:
        for o in self.observers:
            o.on_latency(kind, seconds)

    def _late_spans(self, rid: str | None, spans: dict) -> None:
        """The sender's spans of a handoff (they arrive with its result, often after the first
        token): into the request's timeline entry, or kept until it is made."""
        for t in reversed(self.timeline):
            if t["request_id"] == rid:
                t["spans"] = {**spans, **t["spans"]}
                return
        self._early_spans[rid] = spans
        while len(self._early_spans) > 4096:
            self._early_spans.pop(next(iter(self._early_spans)))

    def _record(self, a: Attempt, out: RequestOutput, now: float) -> None:
        """The request's timeline (wall clock, the workers' spans + the edge's) and phases."""
        wall = time.time()
        spans = {**self._early_spans.pop(out.request_id, {}),
                 **((out.metrics.spans if out.metrics is not None else None) or {})}
        spans["arrival"] = wall - (now - a.t0)
        spans["first_token_at_edge"] = wall
        if spans.get("scheduled") is not None:  # the worker's step first took it
            a.queue_s = max(0.0, spans["scheduled"] - spans["arrival"])
            a.prefill_s = max(0.0, wall - spans["scheduled"])
        phases = timeline_phases(spans)
        for name, sec in phases.items():
            for o in self.observers:
                o.on_phase(name, sec)
        if "kv_to_first_token" in phases:
            self.placer.observe_handoff(phases["kv_to_first_token"])
        entry = {"request_id": out.request_id, "prefill_worker": out.prefill_worker,
                 "decode_worker": out.decode_worker, "spans": spans, "phases": phases}
        if a.placement is not None and a.placement.explain is not None:
            entry["placement"] = a.placement.explain
        self.timeline.append(entry)

def public_cause(e: BaseException) -> str:
    """What a client may read of an error: the worker's own exception, never Ray's text (actor
    ids, addresses, RPC details, tracebacks), which goes to the server's log instead."""
    if isinstance(e, RayActorError):
        return "the worker process ended"
    if isinstance(e, RayError):
        cause = getattr(e, "cause", None)
        if cause is None or isinstance(cause, RayError):
            return type(e).__name__
        e = cause
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


async def _outputs(stream):
    """The outputs of a worker's Ray stream (generate)."""
    async for ref in stream:
        yield await ref


class _Ended(Exception):
    """An attempt that already ended the request with an error output (not retried)."""


def timeline_phases(spans: dict) -> dict:
    """Seconds per phase before the first token, from a request's spans (missing ones skipped)."""
    s = spans
    out = {}
    if "prefill_queued" in s and "prefill_done" in s:
        out["prefill"] = s["prefill_done"] - s["prefill_queued"]
    if "send_start" in s:
        if "prefill_done" in s:
            out["decode_reserve"] = max(0.0, s["send_start"] - s["prefill_done"])
        out["kv_to_first_token"] = s["first_token_at_edge"] - s["send_start"]
    elif "local_queued" in s and "local_prefill_done" in s:  # prefilled on the decode worker
        out["local_prefill"] = s["local_prefill_done"] - s["local_queued"]
        out["local_to_first_token"] = s["first_token_at_edge"] - s["local_prefill_done"]
    elif "prefill_queued" not in s:
        out["local_first_token"] = s["first_token_at_edge"] - s["arrival"]
    return out
