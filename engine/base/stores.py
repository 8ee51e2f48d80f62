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
    """A master TCPStore listening on `host` only; `store` is the c10d object, `port` its port.

    The listening socket's descriptor (`fd`) is the store's once it is made: c10d closes it when
    the store goes, and nothing here closes it again. (Python's socket object also closed it when
    it was collected: a second close of a number that another socket of the process may hold by
    then, which broke that socket: a store of the same process failing with EEXIST, or its peers
    timing out on connect.)"""

    def __init__(self, host: str, timeout_s: float, world_size: int | None = None):
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            sock.listen(512)
            self.host, self.port, self.fd = host, sock.getsockname()[1], sock.fileno()
            self.store = dist.TCPStore(host, self.port, world_size=world_size, is_master=True,
                                       wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                                       master_listen_fd=self.fd)
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns the descriptor now

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def interface_of(host: str) -> str | None:
    """The name of this host's network interface that holds IPv4 address `host` (None: none
    does, or `host` is a name). NCCL and gloo pick an interface of their own otherwise (NCCL the
    first that is up and not loopback, gloo the one GLOO_SOCKET_IFNAME names or the hostname's);
    on a host with several, that can be one the peer cannot reach."""
    import fcntl
    import struct

    try:
        want = socket.inet_aton(host)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:  # no IPv4 address on it
                continue
            if got == want:
                return name
    return None


def gloo_group(store, rank: int, size: int, host: str, timeout: timedelta) -> dist.ProcessGroupGloo:
    """A gloo group whose ranks listen and announce at `host` (this node's address, which its
    peers reach), whatever GLOO_SOCKET_IFNAME says: a worker joined to a cluster of several hosts
    announced 127.0.0.1 when the serving process's loopback setting reached it."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def nccl_interface(host: str) -> str | None:
    """Points NCCL's sockets (its bootstrap, and its transport between hosts without
    InfiniBand) at the interface that holds `host`, unless NCCL_SOCKET_IFNAME is set already;
    returns what NCCL_SOCKET_IFNAME says after. Called before the first NCCL group of the
    process (NCCL reads it once)."""
    import os

    name = interface_of(host)
    if name is not None and "NCCL_SOCKET_IFNAME" not in os.environ:
        os.environ["NCCL_SOCKET_IFNAME"] = "=" + name  # '=': this interface exactly, not a prefix
    return os.environ.get("NCCL_SOCKET_IFNAME")
