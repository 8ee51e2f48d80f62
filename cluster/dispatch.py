"""Dispatch: one request's way through the cluster, from `submit()` to its last output.
Runs on the cluster's event loop thread.

    request()   block hashes; up to 3 attempts (a worker lost before the client saw a
                token, or a handoff that failed: try elsewhere; a non-streamed request's
                outputs are held until its last, so it is retried after its first token
                too); a request that fails for good ends with an error output
                (finish_reason "error", the cause as stop_reason)
    attempt     placement (placement.py: pools + registry + routing.py; an empty pool is
                NoWorker, the router's 503) and one of:
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
                first output's spans -> the request's timeline and phases
Outputs stay deltas all the way to the sink; `engine.outputs.Accumulator` rebuilds the
cumulative view at the edge that needs one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid

from ray.exceptions import RayActorError, RayError

from pdserve.engine.core.hashing import hash_block_tokens
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.role import HandoffResult
from pdserve.engine.sampling_params import SamplingParams

from .api import FinishedRequest, NoWorker, RequestObserver
from .placement import Placer
from .pools import Pools, WorkerRecord

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A worker died (`dead`) or its handoff failed before the client saw a token: retry
    elsewhere."""

    def __init__(self, message: str, dead: bool = False):
        super().__init__(message)
        self.dead = dead


class _Progress:
    """What the client has seen of an attempt, and the prompt tokens it queued on workers
    (their `queued_tokens`, what placement predicts TTFT from) until its first token."""

    def __init__(self, t0: float, priority: int = 0, hold: bool = False):
        self.t0, self.last, self.first_at = t0, None, None
        self.priority = priority
        # a client that reads the whole reply at once (JSON): the outputs wait here until the
        # last one, so a worker lost after the first token is still retried (nothing was shown)
        self.held: list[RequestOutput] | None = [] if hold else None
        self.shown = False  # the sink has had a token: the request can no longer be retried
        self.tokens = 0
        self.placement: dict | None = None
        self.predicted: tuple[str, float | None] | None = None  # (worker, TTFT) placement expected
        self.queue_s = self.prefill_s = None  # from the workers' spans at the first token (FinishedRequest)
        self._charged: list[tuple[WorkerRecord, int]] = []

    def charge(self, w: WorkerRecord, tokens: int) -> None:
        w.queued_tokens += tokens
        w.queued_by_priority[self.priority] += tokens
        self._charged.append((w, tokens))

    def settle(self) -> None:
        for w, n in self._charged:
            w.queued_tokens -= n
            w.queued_by_priority[self.priority] -= n
            if not w.queued_by_priority[self.priority]:
                del w.queued_by_priority[self.priority]
        self._charged = []


class Dispatcher:
    def __init__(self, pools: Pools, registry, block_size: int, local_prefill_tokens: int = 0,
                 local_cached_fraction: float = 2.0, timeline_len: int = 4096):
        self.pools, self.registry, self.block_size = pools, registry, block_size
        self.observers: list[RequestObserver] = []
        self.counters = {"requests": 0, "retries": 0, "failed": 0, "routing": {}}
        self.placer = Placer(pools, registry, block_size, local_prefill_tokens, local_cached_fraction,
                             self.counters["routing"])
        self.timeline: collections.deque = collections.deque(maxlen=timeline_len)
        self._early_spans: dict[str, dict] = {}

    # ---- one request ---------------------------------------------------------------------------
    async def request(self, ids: list[int], params: SamplingParams, sink, stream: bool = True) -> None:
        """Runs one request; `sink(out)` gets its delta outputs, the last one finished. With
        stream=False the sink gets them all when the last one comes (and, at the first token, one
        output without tokens: the request runs), so a worker lost after the first token is
        retried like one lost before it."""
        rid = uuid.uuid4().hex[:16]
        hashes = [h.hex() for h in hash_block_tokens(ids, self.block_size)]
        self.counters["requests"] += 1
        last_error = None
        for attempt in range(3):
            progress = _Progress(time.monotonic(), params.priority, hold=not stream)
            try:
                await self._attempt(f"{rid}-{attempt}", rid, ids, hashes, params, sink, progress)
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
                progress.settle()
        self.counters["failed"] += 1
        self._finish(RequestOutput.error(rid, str(last_error)), ids, _Progress(time.monotonic(), params.priority),
                     sink, None, None)

    async def _attempt(self, wire_id: str, rid: str, ids, hashes, params, sink, progress: _Progress):
        p, d, local = await self.placer.plan(hashes, ids, progress)
        if local:
            return await self._single(wire_id, rid, ids, params, sink, progress, d)
        if params.max_tokens == 1:
            return await self._prefill_only(wire_id, rid, ids, params, sink, progress, p)
        return await self._disaggregated(wire_id, rid, ids, params, sink, progress, p, d)

    async def _disaggregated(self, wire_id, rid, ids, params, sink, progress, p: WorkerRecord,
                             d: WorkerRecord) -> None:
        p.load += 1
        d.load += 1
        prefill = asyncio.ensure_future(self._await_prefill(p, p.actor.prefill.remote(wire_id, ids, params,
                                                                                        d.worker_id), rid))
        relay = asyncio.ensure_future(self._relay(d, wire_id, rid, ids, params, sink, progress, p))
        try:
            done, _ = await asyncio.wait({prefill, relay}, return_when=asyncio.FIRST_COMPLETED)
            if relay not in done:  # the prefill side ended first: failed, or the request ended there
                err = prefill.exception()
                if getattr(err, "dead", False):
                    # the prefill worker died: whether its KV landed is the decode worker's to say.
                    # If it did, the request goes on there; if not, the receive fails (the monitor
                    # makes the peers forget the dead worker) and the relay's WorkerLost retries
                    p.draining = True
                elif err is not None:
                    raise self._lost(err, p, progress, sink, rid, ids, d)
                elif isinstance(prefill.result(), RequestOutput):  # nothing to hand off (an error on the
                    d.actor.abort.remote(wire_id)  # prefill worker): the decode worker's reservation goes
                    self._finish(prefill.result(), ids, progress, sink, p, None, rid)
                    return
                elif isinstance(prefill.result(), HandoffResult) and not prefill.result().ok and not progress.shown:
                    # the decode worker's receive would wait out its deadline: retry now (aborted below)
                    raise WorkerLost(f"handoff from {p.worker_id} failed: {prefill.result().error}")
            try:
                await relay
            except (RayActorError, WorkerLost) as e:
                raise self._lost(e, d, progress, sink, rid, ids, d) from None
            try:  # the client has its last output; the request is over once its prefill side is
                await asyncio.wait_for(asyncio.shield(prefill), 60)
            except (RayError, WorkerLost, asyncio.TimeoutError):
                pass
        except BaseException:  # failed, or the client went away: free the blocks everywhere
            p.actor.abort.remote(wire_id)
            d.actor.abort.remote(wire_id)
            raise
        finally:
            d.load -= 1
            relay.cancel()
            # the request loads the prefill worker (routing, drains) until its send is over
            prefill.add_done_callback(lambda t: (t.cancelled() or t.exception(), self._release(p)))

    @staticmethod
    def _release(w: WorkerRecord) -> None:
        w.load -= 1

    async def _await_prefill(self, p: WorkerRecord, ref, rid: str | None = None):
        """The prefill side of a handoff: its result (observed), or the output of a request
        that ended there; a dead worker or bad input raises."""
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
            else:
                log.warning("handoff from %s reported %s", p.worker_id, res)
        return res

    def _lost(self, err: BaseException, w: WorkerRecord, progress: _Progress, sink, rid, ids,
              d: WorkerRecord | None) -> BaseException:
        """The exception that ends a failed attempt: WorkerLost (retried elsewhere) while
        the client has seen nothing; once it has, the request ends with an error output."""
        if isinstance(err, ValueError):
            return err
        if isinstance(err, RayActorError):
            log.warning("%s worker %s died: %s", w.role, w.worker_id, err)
            err = WorkerLost(f"{w.role} worker {w.worker_id} died", dead=True)
        if getattr(err, "dead", False):
            w.draining = True  # no more placements on it; the monitor purges and replaces it
        if progress.shown:
            self._finish(RequestOutput.error(rid, f"{w.worker_id} failed mid-generation: {public_cause(err)}"), ids,
                         progress,
                         sink, None, d)
            return _Ended()
        return err if isinstance(err, WorkerLost) else WorkerLost(f"{w.worker_id} failed: {public_cause(err)}")

    async def _single(self, wire_id, rid, ids, params, sink, progress, w: WorkerRecord) -> None:
        w.load += 1
        try:
            await self._relay(w, wire_id, rid, ids, params, sink, progress, None)
        except (RayActorError, WorkerLost) as e:
            raise self._lost(e, w, progress, sink, rid, ids, w) from None
        except asyncio.CancelledError:
            w.actor.abort.remote(wire_id)
            raise
        finally:
            w.load -= 1

    async def _prefill_only(self, wire_id, rid, ids, params, sink, progress, p: WorkerRecord) -> None:
        p.load += 1
        try:
            out = await self._await_prefill(p, p.actor.prefill.remote(wire_id, ids, params, None))
            self._finish(out, ids, progress, sink, p, None, rid)
        except asyncio.CancelledError:
            p.actor.abort.remote(wire_id)
            raise
        finally:
            p.load -= 1

    async def _relay(self, d: WorkerRecord, wire_id, rid, ids, params, sink, progress: _Progress,
                     p: WorkerRecord | None) -> None:
        """Passes the worker's stream to `sink` until the last output."""
        try:
            async for ref in d.actor.generate.options(num_returns="streaming").remote(
                    wire_id, ids, params, *((p.worker_id, p.info.get("tp", 1)) if p is not None else ())):
                out: RequestOutput = await ref
                c = out.outputs[0] if out.outputs else None
                if c is not None and c.finish_reason == "error" and not progress.shown:
                    raise WorkerLost(f"request {rid} failed on {d.worker_id}: {c.stop_reason}")
                self._finish(out, ids, progress, sink, p, d, rid)
                if out.finished:
                    return
            raise WorkerLost(f"{d.worker_id}: the stream of {rid} ended before its last output")  # aborted
        except RayError as e:
            if isinstance(e, RayActorError):
                raise
            if isinstance(e.cause, ValueError):
                raise e.cause from None
            log.warning("%s: %s", d.worker_id, e)
            raise WorkerLost(f"{d.worker_id}: {public_cause(e)}") from e

    # ---- outputs, latencies, the timeline ------------------------------------------------------
    def _finish(self, out: RequestOutput, ids, progress: _Progress, sink, p, d, rid=None) -> None:
        """Tags one delta output, observes its latencies (and the timeline on the first
        token), and hands it to the sink."""
        now = time.monotonic()
        if rid is not None:
            out.request_id = rid
        out.prefill_worker = p.worker_id if p is not None else (d.worker_id if d is not None else None)
        out.decode_worker = d.worker_id if d is not None else out.prefill_worker
        n = len(out.delta_token_ids)
        if n:
            if progress.first_at is None:
                progress.first_at = now
                progress.settle()
                self._observe("ttft", now - progress.t0)
                self.placer.observe_first_token(progress.predicted, now - progress.t0)
                self._record(out, progress, now)
                for _ in range(n - 1):  # tokens that came with the first: no time between them
                    self._observe("itl", 0.0)
            elif progress.last is not None:
                for _ in range(n):  # per token, as vLLM counts: the chunk's wait shared by its tokens
                    self._observe("itl", (now - progress.last) / n)
            progress.last = now
            progress.tokens += n
        if out.finished:
            c = out.outputs[0] if out.outputs else None
            self._observe("e2e", now - progress.t0)
            done = FinishedRequest((c.finish_reason if c else None) or "abort", len(ids), progress.tokens,
                                   progress.queue_s, progress.prefill_s,
                                   now - progress.first_at if progress.first_at is not None else None,
                                   progress.priority,
                                   progress.first_at - progress.t0 if progress.first_at is not None else None,
                                   out.metrics.num_preemptions if out.metrics is not None else 0)
            for o in self.observers:
                o.on_finish(done)
        if progress.held is not None and not out.finished:
            if n and not progress.held:
                sink(RequestOutput(out.request_id, None, [], [], False, prefill_worker=out.prefill_worker,
                                   decode_worker=out.decode_worker))
            progress.held.append(out)
            return
        for o in progress.held or ():
            sink(o)
        progress.shown = progress.shown or bool(n) or bool(progress.held)
        progress.held = [] if progress.held is not None else None
        sink(out)

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

    def _record(self, out: RequestOutput, progress: _Progress, now: float) -> None:
        """The request's timeline (wall clock, the workers' spans + the edge's) and phases."""
        wall = time.time()
        spans = {**self._early_spans.pop(out.request_id, {}),
                 **((out.metrics.spans if out.metrics is not None else None) or {})}
        spans["arrival"] = wall - (now - progress.t0)
        spans["first_token_at_edge"] = wall
        if spans.get("scheduled") is not None:  # the worker's step first took it
            progress.queue_s = max(0.0, spans["scheduled"] - spans["arrival"])
            progress.prefill_s = max(0.0, wall - spans["scheduled"])
        phases = timeline_phases(spans)
        for name, sec in phases.items():
            for o in self.observers:
                o.on_phase(name, sec)
        if "kv_to_first_token" in phases:
            self.placer.observe_handoff(phases["kv_to_first_token"])
        entry = {"request_id": out.request_id, "prefill_worker": out.prefill_worker,
                 "decode_worker": out.decode_worker, "spans": spans, "phases": phases}
        if progress.placement is not None:
            entry["placement"] = progress.placement
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
