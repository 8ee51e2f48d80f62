"""The Ray that pdserve starts for itself (`pdserve serve` without `--address`, the tests'):
what its processes inherit, and that it listens on this machine only."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import ray
import ray._private.utils as ray_utils

from .reaper import Reaper, process_tree, running

LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch: "0" puts a new local Ray on 127.0.0.1


def ray_init_options(local: bool = True) -> dict:
    """`ray.init` options: the workers inherit the settings that the environment gives pdserve
    (auth mode, cache, threads; gloo's interface only in a Ray of its own, all on this machine:
    a worker on another host picks the interface of its own node's address, engine/base/stores.py)."""
    names = ("RAY_AUTH_MODE", "PDSERVE_CACHE", "PDSERVE_TORCH_THREADS", "PDSERVE_SWITCH_INTERVAL")
    env = {k: os.environ[k] for k in names + (("GLOO_SOCKET_IFNAME",) if local else ()) if k in os.environ}
    out = dict(include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    if local:  # a Ray this process starts: its settings are ours to give (a joined one has its own)
        out["_system_config"] = SYSTEM_CONFIG
    return out


# Ray starts its workers at nice 15, below everything else on the host: the serving workers are the
# host's main work, and at nice 15 a busy neighbour (two CPU-bound processes on 2 cores) left them a
# few percent of a core, so a restarted registry or a worker's start took minutes. `ray start` of a
# multi-host cluster gives the same setting as RAY_worker_niceness=0 (configs/*.yaml).
# No worker process started ahead for the driver (Ray's prestart: on 2 cores that idle `ray::IDLE`
# cost 1.5 s of CPU and served no actor; every actor here asks for its own) and no Ray metrics
# (pdserve's are the router's /metrics): a local cluster's start 26.9 -> 19.6 s of CPU, summed over
# its processes (`pdserve serve`, the default model, 2 workers).
SYSTEM_CONFIG = {"worker_niceness": 0, "prestart_worker_first_driver": False, "enable_metrics_collection": False}


# Ray's head processes that a Ray pdserve starts for itself does not use: the log monitor (it relays
# workers' output to the driver: log_to_driver is off), the autoscaler's monitor (one machine, nothing
# to scale) and the dashboard's API server (include_dashboard is off; pdserve reads the GCS directly)
UNUSED_HEAD_PROCESSES = ("start_log_monitor", "start_monitor", "start_api_server")


def _not_started(*_args, **_kwargs) -> None:
    return None


@contextlib.contextmanager
def ray_on_loopback():
    """A Ray started inside is this machine's only: its node IP is 127.0.0.1, so GCS, raylet,
    workers and agents listen on loopback, not on every interface. (`ray.init` turns a loopback
    `_node_ip_address` into the host's address; Ray's own single-machine switch, the one it uses
    on macOS and Windows, keeps it: its constant in this process, its variable in the processes
    Ray starts. Both are restored after: this process may join another Ray later.) Nor does it
    start the head processes that such a Ray does not use (UNUSED_HEAD_PROCESSES): a `pdserve
    serve` of the default model starts with ~1.4 s less CPU (13.2 -> 11.8 s over all its
    processes, 2 cores) and 0.9 s sooner."""
    from ray._private import ray_constants
    from ray._private.node import Node

    saved = os.environ.get(LOOPBACK_VAR), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_VAR], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    unused = {name: getattr(Node, name) for name in UNUSED_HEAD_PROCESSES if hasattr(Node, name)}
    for name in unused:
        setattr(Node, name, _not_started)
    try:
        yield
    finally:
        for name, method in unused.items():
            setattr(Node, name, method)
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]
        if saved[0] is None:
            os.environ.pop(LOOPBACK_VAR, None)
        else:
            os.environ[LOOPBACK_VAR] = saved[0]


class RayStartError(RuntimeError):
    """Ray could not be started or joined: one line, Ray's own words and what to try."""


STOP_GRACE_S = 1.0  # what Ray's node processes get, together, between SIGTERM and SIGKILL


def shutdown_own_ray() -> None:
    """`ray.shutdown()` of a Ray this process started, its node processes (GCS, raylet, monitors)
    and theirs (the raylet's agents and workers) stopped together: Ray's own stops the node
    processes one after another, each given a second to go on SIGTERM, and GCS, raylet and monitor
    took all of it (5 s of every Ctrl-C of `pdserve serve`). Here all are signalled at once, given
    STOP_GRACE_S together, then killed, so none is left behind (the raylet's agents outlive a
    raylet killed before it stopped them). Ray's bookkeeping of its shutdown is unchanged; should
    its internals change, its own shutdown runs instead."""
    global _reaper
    node = getattr(ray._private.worker, "_global_node", None)
    infos = getattr(node, "all_processes", None)
    if node is not None and isinstance(infos, dict) and hasattr(node, "kill_all_processes"):
        def kill_all_processes(*_args, **_kwargs) -> None:
            procs = [pi.process for group in infos.values() for pi in group if pi.process.poll() is None]
            tree, todo, below = process_tree()[0], [p.pid for p in procs], []
            while todo:  # every process below the node's: agents, workers, theirs
                kids = tree.get(todo.pop(), [])
                below += kids
                todo += kids
            for p in procs:
                p.terminate()
            for pid in below:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and (any(p.poll() is None for p in procs) or any(map(running, below))):
                time.sleep(0.02)
            for pid in filter(running, below):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            infos.clear()

        node.kill_all_processes = kill_all_processes  # this node's, for this one call: ray.shutdown() ends it
    ray.shutdown()
    if _reaper is not None:
        _reaper.stop()
        _reaper = None


_reaper: Reaper | None = None  # the reaper of the Ray this process started (reaper.py), while it runs


def _node_pids() -> list[int]:
    """The pids of this process's own Ray node processes (GCS, raylet, monitors)."""
    infos = getattr(getattr(ray._private.worker, "_global_node", None), "all_processes", None)
    if not isinstance(infos, dict):
        return []
    return [pi.process.pid for group in infos.values() for pi in group if getattr(pi, "process", None) is not None]


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Raises RayStartError when nothing answers at the Ray address `host:port` (its GCS): ray.init
    retries an unreachable address for minutes, with the signals that would stop it held."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except ValueError:
        raise RayStartError(f"--address must be host:port (the Ray head's GCS), got {address!r}") from None
    except OSError as e:
        raise RayStartError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}; is its head "
                            "running there (`ray start --head`), and is that its address?") from None


def start_or_join_ray(address: str | None, namespace: str) -> None:
    """Joins the Ray at `address`, or starts one of our own on loopback (never one that happens
    to run on this machine). On the main thread, SIGINT and SIGTERM that come while ray.init runs
    are held until it returns and then go to the caller's handlers: interrupted halfway, it left
    Ray's agent processes running after the server exited. ray.init's own SIGTERM handler (it
    exits at once) is not installed; the caller's stays. A Ray of our own gets a reaper
    (reaper.py): killed before it stops that Ray, this process leaves nothing of it running;
    shutdown_own_ray() ends the reaper."""
    if address not in (None, "auto"):
        check_reachable(address)
    main = threading.current_thread() is threading.main_thread()
    caught: list[int] = []
    signals = {signal.SIGINT, signal.SIGTERM}

    def hold(n, _f):
        caught.append(n)

    saved = {sig: signal.signal(sig, hold) for sig in signals} if main else {}
    sets_handler = getattr(ray_utils, "set_sigterm_handler", None)
    if main and sets_handler is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    # blocked, not only caught: ray.init installs Ray's C++ crash handler over Python's, and a
    # SIGTERM it caught in the middle of the driver's connect aborted the process at exit (-6).
    # The threads ray.init starts inherit the mask: their signals come to this thread too
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals) if main else set()
    try:
        with ray_on_loopback() if address is None else contextlib.nullcontext():
            ray.init(address=address or "local", namespace=namespace, **ray_init_options(address is None))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - Ray's own words, on one line, with what to try
        words = " ".join(str(e).split())[:300] or type(e).__name__
        if address is None:
            raise RayStartError(f"the local Ray did not start ({type(e).__name__}: {words}); on a busy host try "
                                "again, or start one with `ray start --head` and pass --address") from None
        raise RayStartError(f"cannot join the Ray cluster at {address} ({type(e).__name__}: {words}); is it "
                            "running, and does its token match RAY_AUTH_TOKEN?") from None
    finally:
        if main and sets_handler is not None:
            ray_utils.set_sigterm_handler = sets_handler
        for sig in saved:  # Python's handler back over Ray's before a held signal is let through
            signal.signal(sig, hold)
        if main:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # runs `hold` for one that came
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if address is None:  # ours: what it starts is stopped even if this process is killed
        global _reaper
        _reaper = Reaper.start(_node_pids())
    if caught:
        signal.raise_signal(caught[0])  # now the caller's handler (pdserve serve's: stop)


RAY_LOST_S = 5.0  # the Ray's GCS refusing or not answering this long: the cluster is gone


class GcsWatch:
    """Watches a Ray cluster's GCS (`address` "host:port"; by default that of the Ray this process
    joined or started): a TCP connect to it every second. Once every connect for RAY_LOST_S has
    been refused (its host answers, no GCS listens: stopped or killed), `on_lost(why)` runs once
    (on the watch's thread). Without its GCS a Ray cluster is gone (pdserve's Ray keeps no GCS
    state to restart from), and Ray's own driver notices only after 60 s, spinning a core the while
    (its error listener polls the dead GCS in a loop: 100% of a core from `ray down` of a head until
    the router exited). A GCS that does not answer at all (a link down) is left to Ray's own 60 s:
    a partition can heal."""

    def __init__(self, on_lost, lost_s: float = RAY_LOST_S, every_s: float = 1.0, address: str | None = None):
        import socket

        host, _, port = (address or ray.get_runtime_context().gcs_address).rpartition(":")
        self.address, self._target = f"{host}:{port}", (host, int(port))
        self._on_lost, self._lost_s, self._every_s, self._socket = on_lost, lost_s, every_s, socket
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-gcs-watch", daemon=True)
        self._thread.start()

    def _refused(self) -> bool:
        try:
            with self._socket.create_connection(self._target, timeout=self._every_s):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:  # no answer: not known to be gone
            return False

    def _run(self) -> None:
        last_seen = time.monotonic()
        while not self._stop.wait(self._every_s):
            if not self._refused():
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen >= self._lost_s:
                self._on_lost(f"the Ray cluster's GCS at {self.address} has refused connections for "
                              f"{self._lost_s:g} s")
                return

    def stop(self) -> None:
        self._stop.set()
