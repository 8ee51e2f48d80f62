"""The HTTP server: uvicorn (h11) with a deadline for each request's headers and a bound on a
client that stops reading.

uvicorn closes idle keep-alive connections, but a connection that sends part of its
headers and then nothing stays open for ever (seen: one client can hold sockets and file
descriptors without end, a slowloris). Here every connection must finish a request's headers
within `header_timeout_s` of its first byte (of opening, for the first request), else it gets
a 408 and is closed.

A client that opens streams and reads none held their queue slots and KV while the workers
generated into its full socket (seen: one such process held all 256 slots). A connection whose
writes stay paused (its socket buffer and the transport's both full) for `write_stall_s` is
aborted: the app sees the client gone, which cancels its request on every worker and gives its
slot and blocks back. Each connection's kernel send buffer is SEND_BUFFER_BYTES, so what a
non-reader pins is bounded and "full" comes after a few hundred streamed tokens, not megabytes.
"""

from __future__ import annotations

import json
import logging
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .schemas import error_body

HEADER_TIMEOUT_S = 10.0
WRITE_STALL_S = 30.0  # a response that cannot be written for this long: its client is not reading
SEND_BUFFER_BYTES = 64 << 10  # SO_SNDBUF of each connection (the kernel doubles it): a stream needs far less
log = logging.getLogger(__name__)

_BODY = json.dumps(error_body("request headers not received in time", "timeout", None, 408)).encode()
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class HeaderDeadlineH11(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    write_stall_s = WRITE_STALL_S
    on_stall = None  # called once for each connection aborted for not reading

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(transport)
        self._header_timer = self._stall_timer = None
        self._arm()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.write_stall_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_stall()

    def _cancel_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        if self.flow.write_paused and not self.transport.is_closing():
            log.warning("client %s read nothing for %g s (its socket full): connection aborted, its request "
                        "cancelled", ":".join(map(str, self.client or ("?",))), self.write_stall_s)
            if self.on_stall is not None:
                self.on_stall()
            self.transport.abort()  # connection_lost: the app sees a disconnect and cancels the request

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # a new request begins on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # its headers are complete
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._cancel_stall()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._overdue)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _overdue(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server that calls `on_listening(port)` once its socket is bound: a line announcing
    the server comes only when a client can connect, and with --port 0 it names the port the OS chose."""

    def __init__(self, config: uvicorn.Config, on_listening=None):
        super().__init__(config)
        self.on_listening = on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_listening is not None:
            self.on_listening(self.servers[0].sockets[0].getsockname()[1])


def config(app, host: str, port: int, log_level: str = "info", header_timeout_s: float = HEADER_TIMEOUT_S,
           write_stall_s: float = WRITE_STALL_S, **kwargs) -> uvicorn.Config:
    """uvicorn's config for `app` with the header deadline and the write-stall bound (tests serve
    through this too); an app with `state.metrics` counts the connections aborted for not reading."""
    metrics = getattr(getattr(app, "state", None), "metrics", None)
    protocol = type("HeaderDeadline", (HeaderDeadlineH11,), {
        "header_timeout_s": header_timeout_s, "write_stall_s": write_stall_s,
        "on_stall": staticmethod(metrics.stalled) if metrics is not None else None})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, **kwargs)
