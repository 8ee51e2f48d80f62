"""The reaper of a Ray that pdserve starts for itself: what is left of it when the process that
started it dies without stopping it (SIGKILL, an OOM kill, a crash).

Ray's node processes (GCS, raylet, monitors) share the fate of the process that started them
(the kernel kills them with it), but what the raylet started does not: its agents and idle
workers outlived a SIGKILLed `pdserve serve` (169 MiB, still running 30 s later). `Reaper.start`
runs this module as a small process of its own session, handed the node processes' pids and a
pipe. Every `TRACK_S` it notes the processes below them (pid and start time, so a reused pid is
never hit). When the pipe closes without the word that Ray was stopped, its starter is gone: it
sends SIGTERM to every noted process still running, gives them `GRACE_S`, then SIGKILL, and
exits. After `Reaper.stop` (Ray stopped by its starter) it exits doing nothing. It imports
nothing but the standard library.

    python -m pdserve.cluster.health.reaper PID [PID ...]   # stdin: the pipe; "stop\\n" then EOF: nothing to do
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

TRACK_S = 1.0  # how often the processes below the node's are noted
GRACE_S = 2.0  # between SIGTERM and SIGKILL
STOP_WORD = b"stop\n"


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) of a process, or None where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def process_tree() -> tuple[dict[int, list[int]], dict[int, int]]:
    """This machine's processes from /proc: pid -> its children, and pid -> its start time
    (both empty where there is no /proc)."""
    kids: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            kids.setdefault(st[0], []).append(int(entry))
            starts[int(entry)] = st[1]
    return kids, starts


def running(pid: int) -> bool:
    """Whether a process runs (a zombie does not)."""
    st = _stat(pid)
    return st is not None and st[2] != "Z"


def below(roots: dict[int, int]) -> dict[int, int]:
    """pid -> start time of the `roots` (pid -> start time) still running and of every process
    below them, now."""
    kids, starts = process_tree()
    out, todo = {}, [p for p, s in roots.items() if starts.get(p) == s]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = starts[pid]
            todo += kids.get(pid, [])
    return out


def note(pids) -> dict[int, int]:
    """pid -> start time of those of `pids` that run now (the start time tells a reused pid)."""
    return {pid: st[1] for pid in pids if (st := _stat(pid)) is not None}


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start and st[2] != "Z"


def reap(noted: dict[int, int]) -> int:
    """SIGTERM, GRACE_S, SIGKILL to the noted processes still running; how many there were."""
    live = {p: s for p, s in noted.items() if p != os.getpid() and _alive(p, s)}
    for pid in live:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in live.items()):
        time.sleep(0.05)
    for pid, start in live.items():
        if _alive(pid, start):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return len(live)


def main(argv: list[str]) -> int:
    noted = note(map(int, argv))
    fd, said = sys.stdin.fileno(), b""
    while True:
        noted = below(noted)  # the tree now, below what was noted (a process gone, its pid reused: dropped)
        ready, _, _ = select.select([fd], [], [], TRACK_S)
        if ready:
            chunk = os.read(fd, 64)
            said += chunk
            if not chunk:  # the pipe closed: stopped in order, or the starter died
                break
    if said.startswith(STOP_WORD):
        return 0
    reap(noted | below(noted))  # and what the noted ones started since the last look
    return 0


class Reaper:
    """The reaper process of one Ray start (see the module's docstring)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls, pids: list[int]) -> Reaper | None:
        """Runs the reaper over the node processes `pids` (None where it cannot start: nothing is
        reaped then, as before it existed)."""
        if not pids or not os.path.isdir("/proc"):
            return None
        try:
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.cluster.health.reaper", *map(str, pids)],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True, close_fds=True)
        except OSError:
            return None
        return cls(proc)

    def stop(self) -> None:
        """Ray was stopped by its starter: the reaper ends without touching anything."""
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(STOP_WORD)
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
