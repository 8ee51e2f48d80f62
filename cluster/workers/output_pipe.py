"""The output pipe: a worker's delta outputs go straight to the router over one TCP connection
per worker, instead of through Ray's streaming generator (a hop of about 1.3 ms on an idle
machine and 5-20 ms on a loaded one: bench/results/ipc/README.md).

    router   OutputPipe.start(host) listens on the cluster's event loop; its `address` (host,
             port, secret) goes to every worker the pools start
    worker   PipeSender(address, worker_id): a thread that connects, sends its hello (worker
             id and the secret: nothing from a connection is unpickled before the secret
             matched), then writes what the engine thread gives it, all that is pending in
             one frame per wake-up; it reconnects after a failure
    request  dispatch calls the worker's `generate_piped` (a plain Ray call that returns once
             the request's last output is handed to the pipe, or raises the request's error)
             and reads `OutputPipe.outputs()`; a worker whose pipe is not connected is
             streamed through Ray (`generate`), so the pipe is never what stops a request

Frames: a 4-byte big-endian length, then the payload; the first is the hello (JSON), each
later one a pickled list of (wire id, RequestOutput). A connection that closes fails the
requests opened on it with ConnectionError (dispatch retries them or ends them with an error
output); their worker reconnects and new requests use the new connection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ..aio import within

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 30
HELLO_TIMEOUT_S = 5.0
CHECK_S = 0.5  # an idle sender looks this often whether the router closed its connection
LAST_OUTPUT_S = 10.0  # a call that returned has its last output on the wire: it arrives within this
DEATH_S = 3.0  # a closed pipe: how long its worker's call may take to say the worker died


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = struct.unpack(">I", await reader.readexactly(4))
    if n > MAX_FRAME:
        raise ValueError(f"an output frame of {n} bytes")
    return await reader.readexactly(n)


@dataclass(frozen=True)
class PipeAddress:
    """Where a worker connects to send its outputs, and the secret it proves itself with."""

    host: str
    port: int
    secret: str


class OutputPipe:
    """The router's end: one listening socket, a queue per open request, the connected workers."""

    def __init__(self):
        self.secret = secrets.token_hex(16)
        self.address: PipeAddress | None = None
        self.server: asyncio.Server | None = None
        self.links: dict[str, asyncio.StreamWriter] = {}  # worker id -> its current connection
        self.queues: dict[str, tuple[asyncio.StreamWriter, asyncio.Queue]] = {}  # wire id -> (its connection, q)

    async def start(self, host: str) -> PipeAddress:
        self.server = await asyncio.start_server(self._serve, host, 0)
        self.address = PipeAddress(host, self.server.sockets[0].getsockname()[1], self.secret)
        return self.address

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self.links.values()):
            w.close()

    def connected(self, worker_id: str) -> bool:
        return worker_id in self.links

    async def outputs(self, wire_id: str, worker_id: str, call: Callable[[], Awaitable]) -> AsyncIterator:
        """A piped request's outputs until its last. `call()` (made once its queue is open):
        the worker's generate_piped; its error is raised here, and its False (the request was
        aborted there) ends the outputs early. ConnectionError: the pipe is not connected or
        closed under the request."""
        link = self.links.get(worker_id)
        if link is None:
            raise ConnectionError(f"{worker_id}: no output pipe")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[wire_id] = (link, q)
        ended = asyncio.ensure_future(call())
        ended.add_done_callback(lambda f: f.cancelled() or f.exception())  # an error after we stopped reading
        try:
            while True:
                item = q.get_nowait() if not q.empty() else await self._next(q, ended)
                if item is None:
                    return
                if isinstance(item, ConnectionError):  # a worker that died says so through its call
                    await asyncio.wait({ended}, timeout=DEATH_S)
                    if ended.done() and not ended.cancelled() and ended.exception() is not None:
                        raise ended.exception()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.queues.pop(wire_id, None)

    @staticmethod
    async def _next(q: asyncio.Queue, ended: asyncio.Future):
        if not ended.done():
            getter = asyncio.ensure_future(q.get())
            try:
                await asyncio.wait({getter, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # cancelled (the client went away) or the call ended first: no get left pending
                got = getter.done()
                if not got:
                    getter.cancel()
            if got:
                return getter.result()
        if not ended.result():  # raises the worker's error; False: aborted there
            return None
        try:
            return await within(q.get(), LAST_OUTPUT_S)
        except asyncio.TimeoutError:
            return ConnectionError(f"the last output did not arrive within {LAST_OUTPUT_S:g} s")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        worker = None
        try:
            hello = json.loads(await within(read_frame(reader), HELLO_TIMEOUT_S))
            if not hmac.compare_digest(str(hello.get("secret", "")), self.secret):
                log.warning("output pipe: a connection from %s without the secret: closed",
                            writer.get_extra_info("peername"))
                return
            worker = str(hello["worker"])
            self.links[worker] = writer
            while True:
                for wire_id, out in pickle.loads(await read_frame(reader)):
                    entry = self.queues.get(wire_id)
                    if entry is not None:
                        entry[1].put_nowait(out)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError, ValueError, KeyError) as e:
            if worker is not None:  # a warning when it cuts requests off; a worker that stops closes it too
                open_here = any(conn is writer for conn, _ in self.queues.values())
                (log.warning if open_here else log.info)("output pipe of %s closed: %s", worker, type(e).__name__)
        finally:
            if worker is not None and self.links.get(worker) is writer:
                del self.links[worker]
            for conn, q in self.queues.values():
                if conn is writer:
                    q.put_nowait(ConnectionError(f"{worker}: its output pipe closed"))
            writer.close()


class PipeSender:
    """A worker's end: `send()` from any thread; a daemon thread connects and writes."""

    def __init__(self, address: PipeAddress, worker_id: str):
        self.host, self.port, self.secret = address.host, address.port, address.secret
        self.worker_id = worker_id
        self.pending: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.sock: socket.socket | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._run, name=f"pipe-{worker_id}", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.sock is not None

    def send(self, wire_id: str, output) -> None:
        self.pending.append((wire_id, output))
        self.wake.set()

    def close(self) -> None:
        self.closed = True
        self.wake.set()
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        backoff = 0.05
        while not self.closed:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=5)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(60)  # a router that stops reading fails the pipe, not the engine
                sock.sendall(frame(json.dumps({"worker": self.worker_id, "secret": self.secret}).encode()))
            except OSError as e:
                log.warning("%s: output pipe to %s:%s: %s", self.worker_id, self.host, self.port, e)
                time.sleep(backoff)
                backoff = min(2 * backoff, 2.0)
                continue
            self.sock, backoff = sock, 0.05
            try:
                self._pump(sock)
            except OSError as e:
                log.warning("%s: output pipe failed: %s", self.worker_id, e)
            finally:
                self.sock = None
                self.pending.clear()  # the router fails the requests of a closed connection
                sock.close()

    def _pump(self, sock: socket.socket) -> None:
        while not self.closed:
            if not self.wake.wait(CHECK_S) and select.select([sock], [], [], 0)[0] and not sock.recv(1):
                raise ConnectionResetError("the router closed the connection")  # it never writes
            self.wake.clear()
            batch = []
            while self.pending:
                batch.append(self.pending.popleft())
            if batch:
                sock.sendall(frame(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)))
