"""`pdserve join`'s parts that need no second host: the head's GCS watched at an address given,
the node address picked by the route to the head, and a bad address refused in one line (the
whole of it runs on a bed of hosts: tests/cluster/test_ray_up.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from pdserve.cluster.health.local_ray import GcsWatch
from pdserve.cluster.health.worker_host import parse_address, route_address


def test_a_head_that_listens_is_kept_and_one_that_refuses_is_lost_past_its_bound():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    lost: list[tuple[float, str]] = []
    fired = threading.Event()
    watch = GcsWatch(lambda why: (lost.append((time.monotonic(), why)), fired.set()), lost_s=0.6, every_s=0.1,
                     address=f"127.0.0.1:{port}")
    try:
        assert not fired.wait(1.0), lost  # it answers: the head is there
        listener.close()  # the head's host answers, nothing listens: refused
        closed = time.monotonic()
        assert fired.wait(5.0), "a refusing GCS was never taken for lost"
    finally:
        watch.stop()
    (at, why), = lost
    # 0.6 s from its last answer, which came at most a look (0.1 s) before the close
    assert at - closed >= 0.6 - 0.1 - 0.02 and f"127.0.0.1:{port}" in why and "refused connections for 0.6 s" in why


def test_the_node_address_is_that_of_the_interface_that_reaches_the_head():
    assert route_address("127.0.0.1", 6379) == "127.0.0.1"


@pytest.mark.parametrize("bad", ["10.0.0.1", ":6379", "10.0.0.1:port", "no-such-head.invalid:6379"])
def test_an_address_without_host_and_port_is_one_line(bad):
    if ":" in bad and bad.rpartition(":")[0] and bad.rpartition(":")[2].isdigit():
        words = "no route to the head"  # well formed: its name does not resolve
    else:
        words = "expected HOST:PORT"
        with pytest.raises(ValueError, match=words):
            parse_address(bad)
    out = subprocess.run([sys.executable, "-m", "pdserve", "join", bad], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr
