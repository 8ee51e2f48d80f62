"""The engine thread of a worker actor (`EngineLoop`, WorkerActor's base): it owns the engine and
its role. The actor's async methods post commands to it (`_post`; worker_commands.py names them)
and await the futures or queues it resolves through the actor's event loop (`_deliver`,
outlets.py). Between steps it applies the commands in order (a request added or aborted, a peer
forgotten, a role switch, a retune), steps the role, forwards the role's events (outputs, sent
handoffs, failures, reservations to the prefill worker, peer fetches) and heartbeats to the
registry with the worker's stats and the prefix-cache events.

It reads what the actor sets up: engine, role, role_name, connector, fetches, peers,
membership, outlets, inbox, wake, stopped, heartbeat_s, handoff (HandoffConfig), aloop, and the actor's
`info()`, `_stats()` and `_die()`; it writes `dead` when the thread ends on an error and
`switch_waiting` while a role switch waits for the old role's last request.
"""

from __future__ import annotations

import logging
import time

from ray.exceptions import RayActorError

from pdserve.decode.role import DecodeRole
from pdserve.engine.base.tp import TPError
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.role import Emitted, Failed, Fetching, Reserved, Sent
from pdserve.prefill.role import PrefillRole

from ..records import BlockEvent
from .worker_commands import Abort, Aborted, Add, ForgetPeer, SwitchRole

ROLE_CLASSES = {"prefill": PrefillRole, "decode": DecodeRole}

log = logging.getLogger(__name__)


class EngineLoop:
    def _make_role(self, role: str):
        self.engine.hold_blocks_on_finish = False  # the prefill role sets it
        if role == "decode":
            return DecodeRole(self.engine, self.connector, self.handoff.timeout_s, self.fetches, self.handoff.wait_s)
        return ROLE_CLASSES[role](self.engine, self.connector, self.handoff.timeout_s, self.fetches)

    # ---- the engine thread -> the actor's event loop ---------------------------------------------
    def _post(self, cmd) -> None:
        self.inbox.append(cmd)
        self.wake.set()

    def _deliver(self, request_id: str, result=None, output: RequestOutput | None = None,
                 error: Exception | None = None) -> None:
        self.outlets.deliver(request_id, result, output, error)

    # ---- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        """The engine thread. Whatever escapes the step's own guard (a bug in the heartbeat,
        a command) ends the thread: the worker then says so to every call (`dead`) and its
        requests fail at once, instead of /health staying 200 while every request waits."""
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - recorded and reported, never silent
            self.dead = f"engine thread died: {type(e).__name__}: {e}"
            log.exception("%s: %s", self.worker_id, self.dead)
            for rid in self.outlets.requests():
                self._deliver(rid, error=RuntimeError(f"{self.worker_id}: {self.dead}"))

    def _serve(self) -> None:
        last_beat = 0.0
        while not self.stopped:
            self.wake.clear()
            while self.inbox:
                self._handle(self.inbox.popleft())
            if self.switch_waiting is not None:  # a switch waits for the old role's last request
                self._switch(self.switch_waiting)
            try:
                events = self.role.step()
            except TPError as e:
                self._die(e)
            except Exception as e:  # noqa: BLE001 - a bug must not leave the thread dead and requests hanging
                events = self._fail_all(e)
            for ev in events:
                self._forward(ev)
            now = time.monotonic()
            if now - last_beat >= self.heartbeat_s:
                last_beat = now
                self._heartbeat()
                if not self.role.has_work():  # busy, the steps keep the interval; idle, this does
                    self.engine.persist_if_due()
            if not self.role.has_work() and not self.inbox:
                self.wake.wait(0.005 if self.role.num_inflight or self.fetches.busy or self.switch_waiting else 0.2)

    def _fail_all(self, err: Exception) -> list:
        """An unexpected error in a step: which request caused it is unknown, so every request
        here ends with the error (their blocks freed) and the engine goes on with new ones."""
        log.exception("%s: engine step failed; failing its %d request(s)", self.worker_id, len(self.engine.requests))
        # a rank actor's death (tensor parallelism) in words, not Ray's exception: the client reads it
        what = "a tensor-parallel rank died" if isinstance(err, RayActorError) else repr(err)
        for rid in set(self.engine.requests) | self.outlets.requests():
            self.role.abort(rid)
            self._deliver(rid, error=RuntimeError(f"{self.worker_id}: engine step failed: {what}"))
        return []

    def _handle(self, cmd) -> None:
        try:
            if isinstance(cmd, Add):
                self.role.add(cmd.request_id, cmd.request, cmd.peer, cmd.fetch)
            elif isinstance(cmd, Abort):
                self.role.abort(cmd.request_id)
                self._deliver(cmd.request_id, error=Aborted(f"request {cmd.request_id} aborted"))
            elif isinstance(cmd, ForgetPeer):
                self.connector.forget_peer(cmd.peer, cmd.sends)
            elif isinstance(cmd, SwitchRole):
                self._switch(cmd)
            else:  # a setting the engine thread changes between steps (retune)
                cmd()
        except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
            self._deliver(getattr(cmd, "request_id", ""), error=e)

    @property
    def busy(self) -> int:
        """What the role still holds: its requests, blocks held for a handoff, the scheduler's
        unfinished sequences, and peer fetches in or out. A role switch waits for 0."""
        return self.role.num_inflight + len(self.engine.held) + self.engine.scheduler.num_unfinished + \
            self.fetches.busy

    def _switch(self, cmd: SwitchRole) -> None:
        """On the engine thread, between steps, once the old role holds nothing (nothing is lost).
        The cluster stops placing on the worker and waits for its load to end, but a request, an
        abort or a peer fetch already on its way can still land after that: the switch then waits
        for them (`switch_waiting`, tried again after each step) until the command's deadline."""
        self.switch_waiting = None
        try:
            if cmd.role not in ROLE_CLASSES:
                raise ValueError(f"role must be prefill or decode, got {cmd.role!r}")
            if self.busy:
                if time.monotonic() < cmd.deadline:
                    self.switch_waiting = cmd
                    return
                raise RuntimeError(f"{self.worker_id} still holds {self.busy} request(s): drain it first")
            self.role = self._make_role(cmd.role)
            self.role_name = cmd.role
            self.engine.retune(cmd.spec.slo_tpot_s, cmd.spec.max_num_batched_tokens)
            info = self.info()
            self.aloop.call_soon_threadsafe(lambda: cmd.done.done() or cmd.done.set_result(info))
        except Exception as e:  # noqa: BLE001 - the caller learns why; the worker keeps its role
            self.aloop.call_soon_threadsafe(lambda err=e: cmd.done.done() or cmd.done.set_exception(err))

    def _forward(self, ev) -> None:
        if isinstance(ev, Emitted):
            self._deliver(ev.output.request_id, output=ev.output)
        elif isinstance(ev, Sent):
            self._deliver(ev.request_id, result=ev.result)
        elif isinstance(ev, Failed):
            self._deliver(ev.request_id, error=RuntimeError(ev.error))
        elif isinstance(ev, Fetching):
            self.peers.fetch(ev, lambda fid, why: self._post(lambda: self.fetches.refused(fid, why)))
        elif isinstance(ev, Reserved) and not self.peers.target(ev):  # the prefill worker is gone
            self.role.abort(ev.request_id)
            why = f"prefill worker {ev.peer} unreachable"
            self._deliver(ev.request_id, output=RequestOutput.error(ev.request_id, why))

    def _heartbeat(self) -> None:
        pool, host = self.engine.kv.pool, self.engine.kv.host
        news = [BlockEvent.of(k, h) for k, h in pool.drain_events() + (host.drain_events() if host else [])]
        self.membership.beat(self.info, self._stats(), news, lambda: [
            BlockEvent.of("stored", h) for h in pool.cached] + [BlockEvent.of("host_stored", h) for h, _ in
                                                                 (host.entries() if host else [])])
