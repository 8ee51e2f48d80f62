"""A bed of hosts for a test (scripts/hosts.sh): hosts h1..hN, each with its own network, mount,
PID, IPC and UTS namespaces and its own address on a bridge of the bed's own; this process reaches
them at their addresses. `down()` (also when a test fails: use it as a context manager or a
fixture) ends every process the hosts ran and removes what the bed made.

Files a host must read go outside /tmp (each host has its own): `shared_dir()` is one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hosts.sh"


def namespaces_refused() -> str | None:
    """Why this kernel (or this user) cannot make the bed's namespaces; None if it can."""
    if os.geteuid() != 0:
        return "the bed of hosts needs root (network, mount and PID namespaces)"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "the bed of hosts needs iproute2's ip and util-linux's nsenter"
    probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the kernel refuses namespaces here: {probe.stderr.strip()[:200]}"
    return None


class HostBed:
    def __init__(self, n: int, name: str | None = None, ssh_key: str | None = None):
        """`ssh_key`: a public key that root on each host lets in, through an sshd on the host's
        address (port 22), with root's own home and Python environment there (hosts.sh --ssh)."""
        why = namespaces_refused()
        if why:
            pytest.skip(why)
        # a name of this process's: two pytest workers each have a bed of their own
        self.name = name or f"t{os.getpid() % 10_000_000}"
        subprocess.run(["bash", str(SCRIPT), "down", "--name", self.name], check=True)  # a bed left by a crash
        # the interpreter's environment, wherever it lies (a checkout under /tmp: each host has its own)
        ssh = ["--ssh", ssh_key] if ssh_key else []
        out = subprocess.run(["bash", str(SCRIPT), "up", str(n), "--name", self.name, "--keep", sys.prefix, *ssh],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"hosts.sh up {n}: {out.stderr.strip()}")
        self.addr = dict(tuple(line.split()) for line in out.stdout.strip().splitlines())  # h1 -> 10.231.k.2
        self.hosts = list(self.addr)
        self.procs: list[subprocess.Popen] = []
        self._shared = None

    def shared_dir(self) -> str:
        """A directory every host sees at the same path (a shared file system's stand-in)."""
        if self._shared is None:
            self._shared = tempfile.mkdtemp(prefix=f"pdserve-bed-{self.name}-", dir="/var/tmp")
        return self._shared

    def argv(self, host: str, *cmd: str) -> list[str]:
        return ["bash", str(SCRIPT), "run", "--name", self.name, host, "--", *cmd]

    def popen(self, host: str, *cmd: str, env: dict | None = None, **kw) -> subprocess.Popen:
        """`cmd` started on `host` (its processes end with the bed)."""
        p = subprocess.Popen(self.argv(host, *cmd), env=env, **kw)
        self.procs.append(p)
        return p

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        """`sig` to what `popen` started (nsenter's child: nsenter forks into the host's PID
        namespace and does not pass signals on)."""
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except FileNotFoundError:
            return
        for c in children:
            try:
                os.kill(c, sig)
            except ProcessLookupError:
                pass

    def link(self, host: str, up: bool) -> None:
        """Takes `host`'s link to the bridge down (its cable pulled) or up again."""
        out = self.run(host, "ip", "link", "set", "eth0", "up" if up else "down")
        assert out.returncode == 0, out.stderr

    def crash(self, host: str) -> None:
        """`host` loses its power (hosts.sh crash): its link goes down, every process of it is
        killed, Ray's session files and its shared memory are gone."""
        out = subprocess.run(["bash", str(SCRIPT), "crash", "--name", self.name, host], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr

    def boot(self, host: str) -> None:
        """`host` is back (hosts.sh boot): its link up, nothing running on it yet."""
        out = subprocess.run(["bash", str(SCRIPT), "boot", "--name", self.name, host], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr

    def partition(self, a: str, b: str, cut: bool = True) -> None:
        """Cuts (or restores) the path between hosts `a` and `b` only: each drops what it would
        send to the other (a blackhole route); both still reach every other host."""
        for src, dst in ((a, b), (b, a)):
            out = self.run(src, "ip", "route", "add" if cut else "del", "blackhole", f"{self.addr[dst]}/32")
            assert out.returncode == 0, out.stderr

    def impair(self, host: str, delay_ms: float, loss: float) -> None:
        """`host`'s link delays each frame `delay_ms` each way and drops `loss` of them (hosts.sh
        impair: netem's delay and loss, relayed in user space)."""
        out = subprocess.run(["bash", str(SCRIPT), "impair", "--name", self.name, host, str(delay_ms), str(loss)],
                             capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
        assert out.returncode == 0, out.stderr

    def mend(self, host: str) -> None:
        """`host`'s link whole again (hosts.sh mend)."""
        out = subprocess.run(["bash", str(SCRIPT), "mend", "--name", self.name, host], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr

    def run(self, host: str, *cmd: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, *cmd), env=env, capture_output=True, text=True, timeout=timeout)

    def python(self, host: str, code: str, env: dict | None = None, timeout: float = 120) -> str:
        out = self.run(host, sys.executable, "-c", code, env=env, timeout=timeout)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    def down(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "down", "--name", self.name], check=False)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self._shared is not None:
            shutil.rmtree(self._shared, ignore_errors=True)

    def __enter__(self) -> HostBed:
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def wait_for(pred, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(every_s)
