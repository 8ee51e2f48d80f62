"""The HTTP server: uvicorn (h11) with a deadline for each request's headers.

uvicorn closes idle keep-alive connections, but a connection that sends part of its
headers and then nothing stays open for ever (seen: one client can hold sockets and file
descriptors without end, a slowloris). Here every connection must finish a request's headers
within `header_timeout_s` of its first byte (of opening, for the first request), else it gets
a 408 and is closed.
"""

from __future__ import annotations

import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .schemas import error_body

HEADER_TIMEOUT_S = 10.0

_BODY = json.dumps(error_body("request headers not received in time", "timeout", None, 408)).encode()
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class HeaderDeadlineH11(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # a new request begins on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # its headers are complete
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
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
           **kwargs) -> uvicorn.Config:
    """uvicorn's config for `app` with the header deadline (tests serve through this too)."""
    protocol = type("HeaderDeadline", (HeaderDeadlineH11,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, **kwargs)
