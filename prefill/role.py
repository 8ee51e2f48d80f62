"""The prefill role: run prompts (chunked prefill, prefix caching), sample token #1,
send the KV with that token to the decode worker the request names, keep the blocks
in the prefix cache.

A prefill is the engine's ordinary request with max_tokens=1 whose blocks outlive it
until the handoff that reads them is over. One request's way through this role:

    add(rid, ids, params, peer=decode_id)   queued; the engine runs it (max_tokens=1)
    target(rid, HandoffTarget)   the decode worker reserved blocks (it runs concurrently
                                 with the prefill: the cluster asks both at once)
    step()   when the prompt is done AND its target is known (whichever comes last; the
             other side may call target() from another thread), the send starts, with the
             first token and the spans in the handoff's meta
    step()   the finished send -> Sent(rid, result); the request's references are dropped
             (full blocks stay cached at ref 0)
    abort(rid)   the request ends here; a send already on the wire finishes first (its pair,
                 and the sends queued behind it, live on) and poll() releases its blocks then

A prompt done whose target has not come after STALL_S, from a decode worker whose address a target
gave before, asks whether that host answers (transfer/probe.py); if not, the handoff fails at once
with `unreachable` (the cluster then keeps the pair out of placement) instead of after the timeout.

A request with no decode peer (max_tokens == 1: nothing to decode) ends here: step()
returns its output as Emitted.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.role import Emitted, Event, Failed, HandoffResult, Role, Sent, TransferState
from pdserve.engine.validation import ValidRequest
from pdserve.transfer.base import Abort, HandoffMeta, HandoffTarget, KVConnector
from pdserve.transfer.fetch import FetchPlan, PeerFetches
from pdserve.transfer.probe import SCAN_S, STALL_S, Prober


@dataclasses.dataclass
class _Pending:
    """A request between add() and the end of its handoff."""

    peer: str | None
    spans: dict  # wall-clock seconds (time.time(): comparable across the host's processes)
    target: HandoffTarget | None = None
    output: RequestOutput | None = None  # set when the prompt is done (first token sampled)
    ready: object = None  # CUDA event after the step that wrote its KV
    sending: bool = False


class PrefillRole(Role):
    def __init__(self, engine: LLMEngine, connector: KVConnector, handoff_timeout_s: float = 30.0,
                 fetches: PeerFetches | None = None):
        self.engine = engine
        self.connector = connector
        self.handoff_timeout_s = handoff_timeout_s
        # the worker's peer tier, shared by its roles (the engine's own where one joined it already)
        self.fetches = fetches or engine.tiers.get("peer") or PeerFetches(engine, connector)
        engine.hold_blocks_on_finish = True
        self.pending: dict[str, _Pending] = {}
        self._failed: list[Event] = []  # sends that could not start (appended from either thread)
        # targets that arrived before their request's add() (the decode side was faster):
        # request id -> (target, arrival), picked up by add(), dropped after the handoff timeout
        self.early: dict[str, tuple[HandoffTarget, float]] = {}
        # target() runs on the actor's thread, step() on the engine's: the later of the two
        # starts the send, decided under this lock
        self._lock = threading.Lock()
        self.addresses: dict[str, str] = {}  # decode worker -> its store's address (from its targets)
        self.prober = Prober()
        self._scan_at = 0.0  # the next look for peers that stopped answering (_unreached)

    def add(self, request_id: str, request: ValidRequest, peer: str | None = None,
            fetch: FetchPlan | None = None) -> None:
        if request_id in self.pending:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            req = self.engine.admit(request.first_token(), request_id)
            self.fetches.add(req, fetch)  # with a fetch plan, the engine's peer tier fetches its prefix first
        except ValueError:
            with self._lock:
                self.early.pop(request_id, None)
            raise
        p = _Pending(peer, {"prefill_queued": time.time()})
        with self._lock:
            self.pending[request_id] = p
            early = self.early.pop(request_id, None)
        if early is not None:
            p.target = early[0]
            p.spans["target_known"] = early[1]

    def target(self, request_id: str, target: HandoffTarget) -> None:
        """The decode worker's reservation: where to send and how many blocks to skip."""
        with self._lock:
            self.addresses[target.peer] = target.address
            p = self.pending.get(request_id)
            if p is None:  # not added yet (or aborted: then dropped after the timeout)
                self.early[request_id] = (target, time.time())
                return
            if p.target is not None:
                return  # a duplicate
            p.target = target
            p.spans["target_known"] = time.time()
            go = p.output is not None
        if go:
            self._send(request_id, p)

    def step(self) -> list[Event]:
        events, self._failed = self._failed + self.fetches.events(), []
        too_old = time.time() - self.handoff_timeout_s
        if self.early:
            with self._lock:
                for rid in [r for r, (_, t) in self.early.items() if t < too_old]:
                    del self.early[rid]
        events += self._unclaimed(too_old) + self._unreached()
        if self.engine.has_unfinished_requests():
            event = None
            for out in self.engine.step():
                if not out.finished:
                    continue
                p = self.pending.get(out.request_id)
                if p is None:
                    continue
                p.spans["prefill_done"] = time.time()
                if out.metrics is not None and out.metrics.scheduled_at is not None:
                    p.spans["scheduled"] = out.metrics.scheduled_at
                if p.peer is None or out.outputs[0].finish_reason not in ("stop", "length"):
                    self.pending.pop(out.request_id)
                    self.engine.release(out.request_id)
                    events.append(Emitted(out))
                    continue
                if self.engine.runner.device.type == "cuda":
                    if event is None:
                        event = torch.cuda.Event()
                        event.record()
                    p.ready = event
                with self._lock:
                    p.output = out
                    go = p.target is not None
                if go:
                    self._send(out.request_id, p)
        for h in self.fetches.take(self.connector.poll()):
            p = self.pending.pop(h.request_id, None)
            self.engine.release(h.request_id)  # full blocks stay in the prefix cache at ref 0
            if p is None:
                continue
            p.spans.update(h.wall_spans("send"))
            cached = p.output.num_cached_tokens if p.output is not None else 0
            events.append(Sent(h.request_id, HandoffResult(h.state, h.error, h.nbytes, h.seconds, p.spans,
                                                                   h.link, h.pair_lost, h.unreachable, cached)))
        return events

    def _unclaimed(self, too_old: float) -> list[Event]:
        """Prompts done before `too_old` whose decode worker never said where to send (it
        aborted or failed the request first): their blocks are released (cached at ref 0)
        and the handoff fails, instead of holding them for good."""
        with self._lock:
            stale = [rid for rid, p in self.pending.items()
                     if p.peer is not None and p.target is None and p.output is not None
                     and p.spans["prefill_done"] < too_old]
            for rid in stale:
                del self.pending[rid]
        for rid in stale:
            self.engine.release(rid)
        return [Failed(rid, f"no KV reservation from its decode worker within {self.handoff_timeout_s:g} s")
                for rid in stale]

    def _unreached(self) -> list[Event]:
        """Prompts done STALL_S ago still waiting for their target, whose decode worker's host does
        not answer: their handoff fails now, `unreachable` (blocks released, cached at ref 0)."""
        now = time.monotonic()
        if now < self._scan_at:  # a scan of what waits, at most every SCAN_S: it sits on the step loop
            return []
        self._scan_at = now + SCAN_S
        waited = time.time() - STALL_S
        with self._lock:
            waiting = [(rid, p) for rid, p in self.pending.items() if p.peer is not None and p.target is None
                       and p.output is not None and p.spans["prefill_done"] < waited and p.peer in self.addresses]
            down = {p.peer for _, p in waiting if self.prober.verdict(self.addresses[p.peer]) is False}
            gone = [(rid, p) for rid, p in waiting if p.peer in down]
            for rid, _ in gone:
                del self.pending[rid]
        events = []
        for rid, p in gone:
            self.engine.release(rid)
            why = f"decode worker {p.peer}'s host does not answer at {self.addresses[p.peer]}: the link is down"
            events.append(Sent(rid, HandoffResult(TransferState.FAILED, why, spans=p.spans, unreachable=True)))
        return events

    def _send(self, request_id: str, p: _Pending) -> None:
        with self._lock:
            if p.sending:
                return
            p.sending = True
        req = self.engine.held.get(request_id)
        if req is None:
            return  # aborted between the two
        c = p.output.outputs[0]
        p.spans["send_start"] = time.time()
        meta = HandoffMeta(c.token_ids[0], p.spans,
                           # the first token's log-probs travel with it (the decode worker emits it)
                           first_logprobs=dict(c.logprobs[0]) if c.logprobs else None,
                           # the prompt's: scored here, where the prompt ran; emitted there
                           prompt_logprobs=p.output.prompt_logprobs or None,
                           prompt_ranks=p.output.prompt_ranks if p.output.prompt_logprobs else None)
        blocks = self.engine.kv.prompt_blocks_after(req, p.target.num_skip)
        try:
            self.connector.start_send(p.target, request_id, blocks, self.handoff_timeout_s, p.ready,
                                      meta)
        except Exception as e:  # noqa: BLE001 - e.g. a duplicate id: reported like a failed handoff
            self.pending.pop(request_id, None)
            self.engine.release(request_id)
            self._failed.append(Failed(request_id, f"{type(e).__name__}: {e}"))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.pending.pop(request_id, None)
            self.early.pop(request_id, None)
        settling = self.connector.abort(request_id, settle=True) is Abort.SETTLING
        self.engine.abort_request(request_id)
        if not settling:  # else its send finishes first (the pair lives on); poll() releases it then
            self.engine.release(request_id)

    @property
    def num_inflight(self) -> int:
        return len(self.pending)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()
