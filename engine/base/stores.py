"""TCPStores that listen on one address only.

c10d's TCPStore server binds every interface of the host, and what it holds is trusted by
whoever reads it (a KV pair follows the orders in its receiver's store; tensor-parallel ranks
build their groups through rank 0's). A store here listens on the socket we bind to `host`
(loopback for a one-machine cluster, the node's private address otherwise) and hands c10d
its file descriptor (`master_listen_fd`).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


class BoundStore:
    """A master TCPStore listening on `host` only; `store` is the c10d object, `port` its port."""

    def __init__(self, host: str, timeout_s: float, world_size: int | None = None):
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(512)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.store = dist.TCPStore(host, self.port, world_size=world_size, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s), master_listen_fd=self._sock.fileno())

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
