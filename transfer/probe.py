"""Whether a peer's host answers: a TCP connect to its KV store, which a live host's kernel accepts
whatever its load. A pair whose messages stall, or a prompt whose decode worker's reservation does
not come, asks; no answer means the link between the two hosts is down (a partition, a pulled
cable), and what waits on it fails now instead of at its deadline (30 s by default).

    STALL_S   a send on the wire, or a done prompt waiting for its target, this long is checked
    PROBE_S   the connect's limit: a lost SYN is resent at 1 s, so a lossy link still answers
    SCAN_S    how often a role looks for what waits on a silent peer
"""

from __future__ import annotations

import socket
import threading
import time

STALL_S = 2.0
PROBE_S = 3.0
SCAN_S = 0.5  # how often a role looks for what waits on a silent peer (off its every step)


def answers(address: str, timeout_s: float = PROBE_S) -> bool:
    """Whether something accepts a TCP connection at host:port within `timeout_s`. An address that
    is not host:port (a same-host connector's name) has no network to lose: it answers."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return True
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


class Prober:
    """Probes off the caller's thread (an engine loop must not wait PROBE_S): `verdict(address)` is
    the answer of a probe at most `fresh_s` old, else None while a new one runs (an old "no" must
    not fail what waits once the link is back)."""

    def __init__(self, timeout_s: float = PROBE_S, fresh_s: float = STALL_S):
        self.timeout_s, self.fresh_s = timeout_s, fresh_s
        self._answers: dict[str, tuple[bool, float]] = {}
        self._running: set[str] = set()
        self._lock = threading.Lock()

    def verdict(self, address: str) -> bool | None:
        with self._lock:
            got = self._answers.get(address)
            if got is not None and time.monotonic() - got[1] < self.fresh_s:
                return got[0]
            if address not in self._running:
                self._running.add(address)
                threading.Thread(target=self._probe, args=(address,), name="kv-probe", daemon=True).start()
        return None

    def check(self, address: str) -> bool:
        """A probe now, on the caller's thread; its answer is the verdict from here on (a "no" from
        before the link's return is not kept once it answers)."""
        ok = answers(address, self.timeout_s)
        with self._lock:
            self._answers[address] = (ok, time.monotonic())
        return ok

    def _probe(self, address: str) -> None:
        ok = answers(address, self.timeout_s)
        with self._lock:
            self._answers[address] = (ok, time.monotonic())
            self._running.discard(address)
