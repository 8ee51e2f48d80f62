"""The decode role: reserve blocks, receive KV and the first token, decode in the
continuous batch. It also prefills requests itself when the cluster sends them with
no prefill peer (hybrid placement, the explicit local rules, colocated mode); with a TPOT
target the engine sizes those prompts' chunks to keep its decodes inside it
(engine/core/step_model.py).

One handed-off request's way through this role (queues named as in `step()`):

    add(rid, ids, params, peer=prefill_id)  validated; joins `backlog` (WAITING_FOR_KV)
    step(): backlog -> `receiving`   blocks reserved (its own prefix hits pinned, never
            sent), the receive posted on a new channel of the pair -> Reserved(rid, peer,
            target): the driver tells the prefill worker where to send. This runs while
            the prompt is still being prefilled elsewhere: it is off the critical path.
            A request that waits for blocks longer than the handoff timeout fails.
    step(): receiving -> running     the KV landed; the first token (sampled by prefill,
            carried in the handoff's meta) is appended and the request joins the batch
            -> Emitted(first output). A failed handoff frees the blocks -> Emitted(error).
    step(): receiving, silent        a receive posted RECEIVE_STALL_S ago whose sender's host does
            not answer (transfer/probe.py) fails, its blocks freed: the cluster's abort cannot
            reach a decode host cut off from it, and the receive would hold them for `wait_s`
    abort(rid)                       the receive ends; a receive already on the wire finishes
            first (`settling`), so that the pair and the handoffs queued on it live on, and
            its blocks are freed when it does
    step(): the engine step          -> Emitted(delta outputs); preemption recomputes here
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.role import Emitted, Event, Reserved, Role
from pdserve.engine.validation import ValidRequest
from pdserve.transfer.base import Abort, KVConnector, TransferState
from pdserve.transfer.fetch import FetchPlan, PeerFetches
from pdserve.transfer.probe import PROBE_S, SCAN_S, STALL_S, Prober

# the prefill side notices a lost link first (STALL_S after its prompt is done) and the cluster aborts the
# receive; this is the backstop for an abort that cannot come: later, so that it never races that retry
RECEIVE_STALL_S = 2 * (STALL_S + PROBE_S)


@dataclass
class _Incoming:
    request: Request
    peer: str  # the prefill worker sending its KV
    queued: float = field(default_factory=time.monotonic)
    spans: dict = field(default_factory=lambda: {"decode_queued": time.time()})
    reserved: float | None = None  # monotonic, when its receive was posted


class DecodeRole(Role):
    def __init__(self, engine: LLMEngine, connector: KVConnector, handoff_timeout_s: float = 30.0,
                 fetches: PeerFetches | None = None, wait_s: float | None = None):
        self.engine = engine
        self.connector = connector
        self.handoff_timeout_s = handoff_timeout_s
        self.wait_s = wait_s  # a posted receive waits this long for its sender (None: the timeout)
        # the worker's peer tier, shared by its roles (the engine's own where one joined it already)
        self.fetches = fetches or engine.tiers.get("peer") or PeerFetches(engine, connector)
        self.backlog: collections.deque[_Incoming] = collections.deque()  # waiting for free blocks
        self.receiving: dict[str, _Incoming] = {}  # reserved, KV on its way
        self.settling: dict[str, _Incoming] = {}  # aborted on the wire: blocks freed when it ends
        self.local: dict[str, dict] = {}  # prefilled here, no first token yet: their spans
        self.prober = Prober()
        self._scan_at = 0.0  # the next look for peers that stopped answering (_unreached)

    def add(self, request_id: str, request: ValidRequest, peer: str | None = None,
            fetch: FetchPlan | None = None) -> None:
        if request_id in self.receiving or any(i.request.request_id == request_id for i in self.backlog):
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.engine.admit(request, request_id)
        if peer is None:
            self.fetches.add(req, fetch)  # with a fetch plan, the engine's peer tier fetches its prefix first
            self.local[request_id] = {"local_queued": time.time()}
            return
        req.status = RequestStatus.WAITING_FOR_KV
        self.backlog.append(_Incoming(req, peer))

    def step(self) -> list[Event]:
        """Reservations and landed handoffs first; when there were any, their events go out
        before the next engine step (a first token should not wait for a decode step)."""
        events = self.fetches.events() + self._reserve() + self._landed() + self._unreached()
        if not events and self.engine.has_unfinished_requests():
            events = [Emitted(out) for out in self.engine.step()]
            for ev in events if self.local else ():  # a local prompt's first token: its spans
                spans = self.local.pop(ev.output.request_id, None)
                if spans is not None and ev.output.metrics is not None:
                    ev.output.metrics.spans = {**spans, "local_prefill_done": time.time(),
                                               **({"scheduled": ev.output.metrics.scheduled_at}
                                                  if ev.output.metrics.scheduled_at is not None else {})}
        return events

    def _reserve(self) -> list[Event]:
        events: list[Event] = []
        waiting = collections.deque()
        sched = self.engine.scheduler
        by_priority = sched.policy == "priority"  # in (priority, arrival) order, none passing a blocked one
        held = False
        for inc in sorted(self.backlog, key=lambda i: sched.key(i.request)) if by_priority else self.backlog:
            req = inc.request
            res = None if held else self.engine.kv.reserve_prompt(req)
            held = held or (by_priority and res is None)
            if res is None:
                if time.monotonic() - inc.queued > self.handoff_timeout_s:
                    events.append(Emitted(RequestOutput.error(
                        req.request_id, f"{self.connector.name} had no free KV blocks within "
                                        f"{self.handoff_timeout_s:g} s")))
                else:
                    waiting.append(inc)
                continue
            fill, skip = res
            req.num_cached_tokens = skip * self.engine.config.block_size
            # one receive, or one per route from a tensor-parallel peer's ranks (transfer/tp.py)
            _, target = self.connector.receive(inc.peer, req.request_id, fill, skip, self.handoff_timeout_s,
                                               self.wait_s)
            inc.spans["reserved"], inc.reserved = time.time(), time.monotonic()
            self.receiving[req.request_id] = inc
            events.append(Reserved(req.request_id, inc.peer, target))
        self.backlog = waiting
        return events

    def _landed(self) -> list[Event]:
        events: list[Event] = []
        for h in self.fetches.take(self.connector.poll()):
            inc = self.receiving.pop(h.request_id, None)
            if inc is None:
                gone = self.settling.pop(h.request_id, None)
                if gone is not None:
                    self.engine.kv.free(gone.request)
                continue
            req = inc.request
            if h.state != TransferState.DONE:
                self.engine.kv.free(req)
                req.status = RequestStatus.FINISHED_ERROR
                events.append(Emitted(RequestOutput.error(req.request_id, f"KV handoff failed: {h.error}")))
                continue
            meta = h.meta
            req.append_token(meta.first_token)
            if meta.first_logprobs is not None:
                req.output_logprobs.append(meta.first_logprobs)
            if meta.prompt_logprobs is not None:
                req.prompt_logprobs, req.prompt_ranks = meta.prompt_logprobs, meta.prompt_ranks
            self.engine.kv.cache_blocks(req, req.num_prompt_tokens)
            out = self.engine.admit_prefilled(req)
            out.metrics.spans = {**meta.spans, **inc.spans, **h.wall_spans("recv"),
                                 "kv_landed": time.time()}
            events.append(Emitted(out))
        return events

    def _unreached(self) -> list[Event]:
        """Receives posted RECEIVE_STALL_S ago whose sender's host does not answer: failed, blocks freed."""
        now = time.monotonic()
        if now < self._scan_at:  # a scan of what waits, at most every SCAN_S: it sits on the step loop
            return []
        self._scan_at = now + SCAN_S
        events = []
        for rid, inc in list(self.receiving.items()):
            if inc.reserved is None or now - inc.reserved < RECEIVE_STALL_S:
                continue
            address = self.connector.peer_address(inc.peer)
            if address is None or self.prober.verdict(address) is not False:
                continue
            del self.receiving[rid]
            self.connector.abort(rid)  # not on the wire: nothing to settle
            self.engine.kv.free(inc.request)
            inc.request.status = RequestStatus.FINISHED_ERROR
            events.append(Emitted(RequestOutput.error(
                rid, f"prefill worker {inc.peer}'s host does not answer at {address}: the link is down")))
        return events

    def abort(self, request_id: str) -> None:
        self.local.pop(request_id, None)
        self.backlog = collections.deque(i for i in self.backlog if i.request.request_id != request_id)
        inc = self.receiving.pop(request_id, None)
        if inc is not None:
            if self.connector.abort(request_id, settle=True) is Abort.SETTLING:
                self.settling[request_id] = inc  # the pair lives on; the blocks wait for its end
            else:
                self.engine.kv.free(inc.request)
        self.engine.abort_request(request_id)

    @property
    def num_inflight(self) -> int:
        """Requests here, and aborted handoffs still settling on the wire (their blocks are held:
        a role switch waits for them)."""
        return len(self.backlog) + len(self.receiving) + len(self.settling) + len(self.engine.requests)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()
