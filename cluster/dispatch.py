"""Dispatch: one request's way through the cluster, from `submit()` to its last output.
Runs on the cluster's event loop thread.

    request()   block hashes; up to 3 attempts (a worker lost before the client saw a
                token: try elsewhere); a request that fails for good ends with an error
                output (finish_reason "error", the cause as stop_reason)
    attempt     placement (pools + registry, routing.py) and one of:
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

from pdserve.engine.hashing import hash_block_tokens
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

from .api import RequestObserver
from .pools import Pools, WorkerRecord
from .routing import pick_decode, pick_prefill, place_prompt

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

    def __init__(self, t0: float):
        self.t0, self.last, self.first_at = t0, None, None
        self.tokens = 0
        self.placement: dict | None = None
        self._charged: list[tuple[WorkerRecord, int]] = []

    @property
    def streamed(self) -> bool:
        return self.first_at is not None

    def charge(self, w: WorkerRecord, tokens: int) -> None:
        w.queued_tokens += tokens
        self._charged.append((w, tokens))

    def settle(self) -> None:
        for w, n in self._charged:
            w.queued_tokens -= n
        self._charged = []


class Dispatcher:
    def __init__(self, pools: Pools, registry, block_size: int, local_prefill_tokens: int = 0,
                 local_cached_fraction: float = 2.0, timeline_len: int = 4096):
        self.pools, self.registry, self.block_size = pools, registry, block_size
        self.slo = pools.serving.slo
        self.handoff_s = 0.02  # EWMA of the kv_to_first_token phase: hybrid placement's handoff cost
        # conditional disaggregation: prompts up to this many tokens, or with at least this
        # fraction of their blocks cached on a decode worker, prefill on that decode worker
        # (defaults: off; values above 1 turn the cached rule off)
        self.local_prefill_tokens = local_prefill_tokens
        self.local_cached_fraction = local_cached_fraction
        self.observers: list[RequestObserver] = []
        self.counters = {"requests": 0, "retries": 0, "failed": 0, "routing": {}}
        self.timeline: collections.deque = collections.deque(maxlen=timeline_len)
        self._early_spans: dict[str, dict] = {}

    # ---- one request ---------------------------------------------------------------------------
    async def request(self, ids: list[int], params: SamplingParams, sink) -> None:
        """Runs one request; `sink(out)` gets its delta outputs, the last one finished."""
        rid = uuid.uuid4().hex[:16]
        hashes = [h.hex() for h in hash_block_tokens(ids, self.block_size)]
        self.counters["requests"] += 1
        last_error = None
        for attempt in range(3):
            progress = _Progress(time.monotonic())
            try:
                await self._attempt(f"{rid}-{attempt}", rid, ids, hashes, params, sink, progress)
                return
            except _Ended:
                return
            except WorkerLost as e:
                last_error = e
                self.counters["retries"] += 1
            finally:
                progress.settle()
        self.counters["failed"] += 1
        self._finish(RequestOutput.error(rid, str(last_error)), ids, _Progress(time.monotonic()), sink, None, None)

    async def _attempt(self, wire_id: str, rid: str, ids, hashes, params, sink, progress: _Progress):
        if self.pools.mode == "colocated":
            w = await self._pick_prefill(hashes, ids, "decode")
            progress.charge(w, len(ids))
            return await self._single(wire_id, rid, ids, params, sink, progress, w)
        local, reason = await self._local_decode(hashes, ids)
        if local is not None:
            self._count(reason)
            progress.charge(local, len(ids))
            return await self._single(wire_id, rid, ids, params, sink, progress, local)
        if self.pools.mode == "hybrid":
            p, d, local = await self._place_hybrid(hashes, ids, progress)
            if local:
                return await self._single(wire_id, rid, ids, params, sink, progress, d)
        else:
            p = await self._pick_prefill(hashes, ids, "prefill")
            d = self.pools.worker(pick_decode(self.pools.candidates("decode")))
            progress.charge(p, len(ids))
        if params.max_tokens == 1:
            return await self._prefill_only(wire_id, rid, ids, params, sink, progress, p)
        return await self._disaggregated(wire_id, rid, ids, params, sink, progress, p, d)

    async def _place_hybrid(self, hashes: list[str], ids: list[int], progress: _Progress):
        """Hybrid mode: the prefill worker p, the decode worker d, and whether d prefills the
        prompt itself (routing.place_prompt, from live queues, rates and cached prefixes)."""
        if hashes:
            (ph, pd), (dh, dd) = await asyncio.gather(self.registry.longest_prefix.remote(hashes, "prefill"),
                                                      self.registry.longest_prefix.remote(hashes, "decode"))
        else:
            ph, pd, dh, dd = None, 0, None, 0
        prefills = self.pools.candidates("prefill")
        key = hashes[0] if hashes else str(ids[: self.block_size])
        pid, why = pick_prefill(prefills, key, (ph, pd))
        p = next(c for c in prefills if c.worker_id == pid)
        p.cached_tokens = pd * self.block_size if pid == ph else 0
        decodes = self.pools.candidates("decode")
        for c in decodes:
            c.cached_tokens = dd * self.block_size if c.worker_id == dh else 0
        pl = place_prompt(len(ids), p, decodes, self.slo.ttft_s, self.slo.spill_at, self.handoff_s)
        self._count(pl.reason)
        progress.placement = {**pl.explain(), "prefill": pid}
        d = self.pools.worker(pl.decode)
        if pl.local:
            progress.charge(d, len(ids) - next(c.cached_tokens for c in decodes if c.worker_id == pl.decode))
            return None, d, True
        self._count(why)
        progress.charge(self.pools.worker(pid), len(ids) - p.cached_tokens)
        return self.pools.worker(pid), d, False

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
                if prefill.exception() is not None:
                    raise self._lost(prefill.exception(), p, progress, sink, rid, ids, d)
                if isinstance(prefill.result(), RequestOutput):  # nothing to hand off (an error on the
                    d.actor.abort.remote(wire_id)  # prefill worker): the decode worker's reservation goes
                    self._finish(prefill.result(), ids, progress, sink, p, None, rid)
                    return
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
            raise WorkerLost(f"prefill worker {p.worker_id} died: {e}", dead=True) from e
        except RayError as e:
            if isinstance(e.cause, ValueError):
                raise e.cause from None
            raise WorkerLost(f"prefill on {p.worker_id} failed: {e}") from e
        if isinstance(res, dict):
            self._late_spans(rid, res.get("spans") or {})
            if res.get("state") == "DONE":
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
            err = WorkerLost(f"{w.role} worker {w.worker_id} died: {err}", dead=True)
        if getattr(err, "dead", False):
            w.draining = True  # no more placements on it; the monitor purges and replaces it
        if progress.streamed:
            self._finish(RequestOutput.error(rid, f"{w.worker_id} failed mid-generation: {err}"), ids, progress,
                         sink, None, d)
            return _Ended()
        return err if isinstance(err, WorkerLost) else WorkerLost(f"{w.worker_id} failed: {err}")

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
                if c is not None and c.finish_reason == "error" and not progress.streamed:
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
            raise WorkerLost(f"{d.worker_id}: {e}") from e

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
                self._record(out, progress, now)
            elif progress.last is not None:
                self._observe("itl", now - progress.last)
            progress.last = now
            progress.tokens += n
        if out.finished:
            c = out.outputs[0] if out.outputs else None
            self._observe("e2e", now - progress.t0)
            for o in self.observers:
                o.on_finish((c.finish_reason if c else None) or "abort", len(ids), progress.tokens)
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
        phases = timeline_phases(spans)
        for name, sec in phases.items():
            for o in self.observers:
                o.on_phase(name, sec)
        if "kv_to_first_token" in phases:
            self.handoff_s = 0.9 * self.handoff_s + 0.1 * phases["kv_to_first_token"]
        entry = {"request_id": out.request_id, "prefill_worker": out.prefill_worker,
                 "decode_worker": out.decode_worker, "spans": spans, "phases": phases}
        if progress.placement is not None:
            entry["placement"] = progress.placement
        self.timeline.append(entry)

    # ---- placement ------------------------------------------------------------------------------
    async def _pick_prefill(self, hashes: list[str], ids: list[int], role: str) -> WorkerRecord:
        """The worker to run this prompt's prefill: of the prefill pool, or (colocated mode)
        of the decode pool: longest cached prefix, else consistent hash, bounded load."""
        cached = await self.registry.longest_prefix.remote(hashes, role) if hashes else (None, 0)
        key = hashes[0] if hashes else str(ids[: self.block_size])
        wid, reason = pick_prefill(self.pools.candidates(role), key, tuple(cached))
        self._count(reason)
        return self.pools.worker(wid)

    async def _local_decode(self, hashes: list[str], ids: list[int]) -> tuple[WorkerRecord | None, str]:
        """Conditional disaggregation: the decode worker to prefill on, if any."""
        if len(ids) <= self.local_prefill_tokens:
            return self.pools.worker(pick_decode(self.pools.candidates("decode"))), "local_short"
        if hashes and self.local_cached_fraction <= 1.0 and \
                self.local_cached_fraction * len(ids) <= len(hashes) * self.block_size:
            holder, depth = await self.registry.longest_prefix.remote(hashes, "decode")
            w = self.pools.workers.get(holder)
            if w is not None and not w.draining and depth * self.block_size >= self.local_cached_fraction * len(ids):
                return w, "local_cached"
        return None, ""

    def _count(self, reason: str) -> None:
        self.counters["routing"][reason] = self.counters["routing"].get(reason, 0) + 1


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
