"""Rank 0 -> shards on one host: a step's inputs through a shared memory ring.

A tensor-parallel engine's shards run each step on the inputs rank 0 built (tp.py). Over the
gloo group a step cost two broadcasts (the length, then the pickled bytes), a TCP round trip
each, before a shard could start the step its peers' first all-reduce waits for. Here rank 0
writes the pickled bytes into a slot of a ring in shared memory and the shards, which poll
it, read them microseconds later.

    layout     SLOTS slots of SLOT_BYTES, each [seq u64 | length u64 | crc32 u64 | bytes],
               then one u64 per shard: the last seq it has read
    send       rank 0: waits until every shard has read the slot's previous message (SLOTS
               back), writes the bytes, their length and crc32, then the seq. A message
               longer than a slot (a long prefill's inputs) is marked BIG and goes over gloo.
    recv       a shard: polls the slot's seq (yielding its thread, then sleeping as the wait
               grows), reads the bytes, checks the crc (bytes seen before the seq had landed
               read again), marks the seq read
    liveness   a waiting side checks every 50 ms that the other processes still run (pid and
               start time, /proc): a dead peer raises TPError, as a failed collective does

Lifecycle: rank 0 creates the file under /dev/shm, every rank maps it, and once all have
(the group's MIN agrees) it is unlinked: the mapping lives as long as the processes, and
nothing is left behind by one that dies. A rank that cannot map it (another host, no
/dev/shm, its peers' processes not visible) makes the whole group stay on gloo.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import uuid
import zlib

SLOTS = 4
SLOT_BYTES = 1 << 20
HEAD = 24  # seq, length, crc32
BIG = (1 << 64) - 1  # length: the message is too long for a slot and goes over gloo
CHECK_S = 0.05  # how often a waiting side looks at its peers' processes
_U64 = struct.Struct("<Q")
_LEN_CRC = struct.Struct("<QQ")  # after the seq


class PeerGone(RuntimeError):
    """A process of the group is no longer running."""


def process_start(pid: int) -> str | None:
    """When process `pid` of this host started (clock ticks since boot), None if there is none
    running (an exited process not yet reaped is a zombie: none): a pid and its start time name
    one process for good."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in "ZX" else fields[19]


def this_process() -> str:
    """'pid start' of this process, for `StepChannel.open`'s peers."""
    return f"{os.getpid()} {process_start(os.getpid())}"


class StepChannel:
    """One rank's end of the ring: rank 0 sends, shards receive. `size` ranks in all."""

    def __init__(self, path: str, rank: int, size: int, create: bool = False):
        self.rank, self.size, self.path = rank, size, path
        self.nbytes = SLOTS * (HEAD + SLOT_BYTES) + 8 * (size - 1)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, self.nbytes)
            self.mm = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self.seq = 0  # the last message sent (rank 0) or read (a shard)
        self.peers: list[tuple[int, str]] = []  # (pid, start) of the processes a wait watches

    def watch(self, peers: list[str]) -> None:
        """The processes ('pid start', `this_process()`) whose end ends a wait: rank 0 watches
        the shards, a shard rank 0. Raises PeerGone if one is not visible from here."""
        self.peers = [(int(p.split(" ", 1)[0]), p.split(" ", 1)[1]) for p in peers]
        if any(process_start(pid) != start for pid, start in self.peers):
            raise PeerGone("a rank's process is not visible from this one (another host or pid namespace)")

    @staticmethod
    def new_path() -> str:
        return f"/dev/shm/pdserve-tp-{uuid.uuid4().hex}"

    @staticmethod
    def unlink(path: str) -> None:
        """Rank 0, once every rank has mapped the file or given up."""
        try:
            os.unlink(path)
        except OSError:
            pass

    def close(self) -> None:
        mm, self.mm = getattr(self, "mm", None), None
        if mm is not None:
            mm.close()

    # ---- rank 0 -----------------------------------------------------------------------------
    def send(self, data: bytes) -> bool:
        """Writes one message; False when it is too long for a slot (the caller sends it over
        gloo; the shards know from the slot). Raises PeerGone if a shard died."""
        s = self.seq + 1
        base = (s % SLOTS) * (HEAD + SLOT_BYTES)
        self._wait(lambda: self._oldest_read() >= s - SLOTS)
        fits = len(data) <= SLOT_BYTES
        if fits:
            self.mm[base + HEAD:base + HEAD + len(data)] = data
        _LEN_CRC.pack_into(self.mm, base + 8, len(data) if fits else BIG, zlib.crc32(data) if fits else 0)
        _U64.pack_into(self.mm, base, s)  # the seq last: a reader takes the slot once it sees it
        self.seq = s
        return fits

    def _oldest_read(self) -> int:
        acks = SLOTS * (HEAD + SLOT_BYTES)
        return min(_U64.unpack_from(self.mm, acks + 8 * i)[0] for i in range(self.size - 1))

    # ---- a shard ----------------------------------------------------------------------------
    def recv(self) -> bytes | None:
        """The next message's bytes; None: it is BIG (read it over gloo). Raises PeerGone if
        rank 0 died while this rank waited."""
        s = self.seq + 1
        base = (s % SLOTS) * (HEAD + SLOT_BYTES)
        self._wait(lambda: _U64.unpack_from(self.mm, base)[0] == s)
        deadline = time.monotonic() + 1.0
        while True:
            n, crc = _LEN_CRC.unpack_from(self.mm, base + 8)
            data = None if n == BIG else bytes(self.mm[base + HEAD:base + HEAD + n])
            if data is None or zlib.crc32(data) == crc:
                break
            if time.monotonic() > deadline:  # pragma: no cover - a torn write that never completes
                raise PeerGone(f"step message {s} never became whole")
        _U64.pack_into(self.mm, SLOTS * (HEAD + SLOT_BYTES) + 8 * (self.rank - 1), s)
        self.seq = s
        return data

    # ---- both -------------------------------------------------------------------------------
    def _wait(self, ready) -> None:
        """Until `ready()`: yielding the thread for the first 20 ms, then sleeping 0.2 ms, then
        2 ms after a second idle (an engine between requests); the peers checked every 50 ms."""
        if ready():
            return
        t0 = time.monotonic()
        check_at = t0 + CHECK_S
        while not ready():
            now = time.monotonic()
            idle = now - t0
            time.sleep(0 if idle < 0.02 else 0.0002 if idle < 1.0 else 0.002)
            if now > check_at:
                check_at = now + CHECK_S
                for pid, start in self.peers:
                    if process_start(pid) != start:
                        raise PeerGone(f"tensor-parallel process {pid} is gone")
