"""A worker host's Ray for as long as its head's: `pdserve join HEAD:PORT`, the on-premises
config's worker start command.

`ray down` with Ray's local provider stops the head's Ray only (it cannot power a host off). A
worker host's raylet then waits Ray's minute for the gone GCS, since it cannot tell a stopped head
from a partition, and the agents it started outlive it. `join` runs `ray start --block` against
the head, from the address of this host's interface that reaches it (or the one given), with Ray's
workers at pdserve's niceness (local_ray.SYSTEM_CONFIG). Every TRACK_S it notes the processes below
that command (health/reaper), and it watches the head's GCS (local_ray.GcsWatch). Once every
connect has been refused for RAY_LOST_S (the head's host answers, its Ray is stopped), on SIGTERM
or Ctrl-C, or when the node's own Ray ends, it stops the node: SIGTERM to `ray start --block`,
which stops the processes it started, then STOP_S for it to end, then every noted process still
running. A head that does not answer at all (a link down) is left to Ray: a partition can heal.
It stops only what it started (no `ray stop`: another Ray on the host is not its own).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

from .local_ray import SYSTEM_CONFIG, GcsWatch
from .reaper import TRACK_S, below, note, reap

STOP_S = 15.0  # for `ray start --block` to end once sent SIGTERM (Ray drains the node first)


def route_address(host: str, port: int) -> str:
    """The address of this host's interface that reaches `host`: the kernel's route to it (a UDP
    socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" -> (host, port); ValueError naming what is wrong."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"the head's address {address!r}: expected HOST:PORT (the head's `ray start --port`)")
    return host, int(port)


def join(address: str, node_ip: str | None = None, ray_args: tuple[str, ...] = (), log=None) -> int:
    """Runs this host's Ray as a node of the cluster whose GCS is at `address` until the head's
    Ray is gone, a signal stops it, or the node's Ray ends; returns 0 for the first two, else the
    exit code of `ray start --block`. `ray_args`: more `ray start` flags (resources, GPUs)."""
    log = log or (lambda line: print(f"pdserve join: {line}", file=sys.stderr, flush=True))
    host, port = parse_address(address)
    node_ip = node_ip or route_address(host, port)
    env = {"RAY_worker_niceness": str(SYSTEM_CONFIG["worker_niceness"]), **os.environ}
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--address={address}",
           f"--node-ip-address={node_ip}", *ray_args]
    node = subprocess.Popen(cmd, env=env)
    log(f"this host's Ray joins {address} from {node_ip} (pid {node.pid})")
    done, why = threading.Event(), []

    def stop(reason: str) -> None:
        why.append(reason)
        done.set()

    saved = {sig: signal.signal(sig, lambda s, _f: stop(signal.Signals(s).name)) for sig in (signal.SIGTERM,
                                                                                           signal.SIGINT)}
    watch = GcsWatch(stop, address=f"{host}:{port}")
    noted = note([node.pid])
    try:
        while node.poll() is None and not done.wait(TRACK_S):
            noted = below(noted)  # the node's tree now (an agent its raylet left behind stays noted)
    finally:
        watch.stop()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if node.poll() is None:
            log(f"{why[0] if why else 'stopped'}: stopping this host's Ray")
            node.terminate()
            try:
                node.wait(STOP_S)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
        left = reap(noted | below(noted))
        log(f"this host's Ray stopped ({left} of its processes were still running)")
    return 0 if why else node.returncode
