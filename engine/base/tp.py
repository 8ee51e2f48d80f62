"""Tensor parallelism: one engine over N processes (one per GPU), in lockstep.

Rank 0 owns everything that decides (scheduler, block tables, sampling); ranks 1..N-1
(shards, `shard.py`) hold a slice of the weights and of the KV cache and run the same
forward pass on the inputs rank 0 sends them, one step at a time:

    rank 0   schedule -> host inputs -> send (step ring) -> forward (all-reduces) -> sample
    rank k               recv (step ring)              -> forward (all-reduces)

Sharding (Megatron): q heads split evenly; KV heads split evenly, or each rank keeps the
one KV head its q heads read when num_kv_heads < N (replicated N / num_kv_heads times);
qkv and gate/up column-parallel, o and down row-parallel with one all-reduce each; the
embedding replicated (a lookup reads T rows: no traffic); the LM head vocab-parallel
(ceil(V / N) rows per rank, all-gathered logits: it saves (N-1)/N of a 1-2 GB matrix
per rank on 70B-class models, room for KV).

The group is built at run time, like the transfer groups: rank 0 serves a TCPStore,
the shards join it; two process groups over it: `ctrl` (gloo, CPU: agreements, and the step
inputs too long for the ring) and `dev` (NCCL on CUDA, gloo on CPU: all-reduce and
all-gather). The step inputs, pickled, travel through a shared memory ring on the host
(step_channel.py: microseconds, where two gloo broadcasts cost a TCP round trip each); a
group whose ranks cannot all map it sends them over `ctrl`. A shard
that dies closes its sockets: rank 0's next collective raises (`TPError`), and the
worker hosting it ends (the cluster replaces it). The ctrl group waits without limit
(an idle engine sends nothing); the dev group's collectives time out after `timeout_s`.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .stores import BoundStore, gloo_group, nccl_interface

log = logging.getLogger(__name__)

# A closed tensor-parallel engine's aborted NCCL groups, kept for the life of the process and
# never destroyed: on 2x H200 a later garbage collection of one (its destructor) hung the next
# engine's start.
GRAVEYARD: list = []


class TPError(RuntimeError):
    """A collective of the tensor-parallel group failed: a rank died or hung."""


def check_tp(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """Raises ValueError naming the numbers when a model cannot be split `size` ways."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} and the model's {num_kv_heads} KV heads: one must "
                         "divide the other")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's intermediate size "
                         f"{intermediate_size}")


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """The global KV heads [lo, hi) rank `rank` of `size` holds."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    h = rank * num_kv_heads // size
    return h, h + 1


def vocab_range(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    """The LM-head rows [lo, hi) of rank `rank`; each rank's shard has ceil(V / N) rows."""
    per = -(-vocab_size // size)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group; size 1 is the ordinary engine."""

    rank: int = 0
    size: int = 1
    ctrl: object = None  # ProcessGroupGloo: step inputs from rank 0
    dev: object = None  # ProcessGroupNCCL / Gloo: the model's collectives
    store: object = None  # rank 0's TCPStore (kept alive)
    bound: BoundStore | None = None  # rank 0: the store's listening socket (bound to one address)
    host: str = "127.0.0.1"  # the node's address: rank 0's store, every rank's gloo device
    oneshot: object = None  # CUDA: the one-shot all-reduce over IPC buffers (ipc_allreduce.py), if it runs
    oneshot_why: str | None = None  # why not, when it does not
    channel: object = None  # the step ring (step_channel.py), when every rank maps it
    channel_why: str | None = None  # why not, when it does not

    @property
    def address(self) -> str | None:
        return None if self.store is None else f"{self.host}:{self.store.port}"

    @classmethod
    def serve(cls, size: int, host: str = "127.0.0.1") -> TPGroup:
        """Rank 0's store, before the shards start (they need its address)."""
        bound = BoundStore(host, 600, world_size=size)  # the shards run on this node: loopback by default
        return cls(0, size, store=bound.store, bound=bound, host=host)

    def connect(self, device: torch.device, address: str | None = None, timeout_s: float = 600.0,
                custom_all_reduce: bool = True) -> TPGroup:
        """Builds both process groups (every rank calls it; blocks until all have), and on CUDA the
        one-shot all-reduce unless `custom_all_reduce` is off."""
        if self.size == 1:
            return self
        if self.store is None:
            self.host, port = address.rsplit(":", 1)
            self.store = dist.TCPStore(self.host, int(port), is_master=False, timeout=td(timeout_s))
        host = self.host
        self.ctrl = gloo_group(dist.PrefixStore("tp/ctrl", self.store), self.rank, self.size, host,
                               td(365 * 86400))
        self._open_channel()
        dev_store = dist.PrefixStore("tp/dev", self.store)
        if device.type == "cuda":
            nccl_interface(host)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td(timeout_s)
            self.dev = dist.ProcessGroupNCCL(dev_store, self.rank, self.size, opts)
            if custom_all_reduce:
                self._build_oneshot(device)
            else:
                self.oneshot_why = "off (disable_custom_all_reduce)"
        else:
            self.dev = gloo_group(dev_store, self.rank, self.size, host, td(timeout_s))
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        """Tears this rank's groups down after the last step. Every rank calls it at about the
        same time (rank 0 right after it sends stop, a shard when it reads stop): on CUDA the
        communicators' teardown may wait for the peers' (NCCL), so rank 0 tearing down only
        after its shards exited waited forever, and left to the group's destructor it did too.
        Bounded: a teardown that does not finish within `timeout_s` (a peer that died) is left
        to the process's exit, logged."""
        groups, self.dev, self.ctrl, self.oneshot = (self.dev, self.ctrl), None, None, None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if any(pg is not None and not isinstance(pg, dist.ProcessGroupGloo) for pg in groups):
            GRAVEYARD.append(groups)  # NCCL: never destroyed (see GRAVEYARD)

        def teardown() -> None:
            for pg in groups:
                stop = getattr(pg, "abort", None) or getattr(pg, "_abort", None)  # torch < 2.7: _abort
                if stop is not None:
                    try:
                        stop()
                    except Exception:  # noqa: BLE001 - a peer already gone: nothing left to tear down
                        pass

        t = threading.Thread(target=teardown, name=f"tp-close-{self.rank}", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            log.warning("tensor-parallel rank %d of %d: its groups did not tear down within %g s", self.rank,
                        self.size, timeout_s)

    def _open_channel(self) -> None:
        """The step ring, used once every rank has mapped it (then its file is unlinked)."""
        from .step_channel import PeerGone, StepChannel, this_process

        self.store.set(f"tp/proc/{self.rank}", this_process())
        path, ch = "", None
        if self.rank == 0:
            try:
                path = StepChannel.new_path()
                ch = StepChannel(path, 0, self.size, create=True)
            except OSError as e:
                path, self.channel_why = "", f"rank 0 cannot create {StepChannel.new_path()}: {e}"
            self.store.set("tp/chan", path)
        path = self.store.get("tp/chan").decode()
        if path:
            peers = [self.store.get(f"tp/proc/{r}").decode() for r in (range(1, self.size) if self.rank == 0 else [0])]
            try:
                ch = ch or StepChannel(path, self.rank, self.size)
                ch.watch(peers)
            except (OSError, PeerGone) as e:
                if ch is not None:
                    ch.close()
                ch, self.channel_why = None, f"rank {self.rank} cannot map the step ring: {e}"
        if self.min_int(int(ch is not None)):
            self.channel = ch
        elif ch is not None:
            ch.close()
            self.channel_why = self.channel_why or "another rank cannot map the step ring"
        if self.rank == 0 and path:  # every rank has mapped it or given up: the mappings keep it
            StepChannel.unlink(path)
        if self.channel is None:
            log.warning("tensor-parallel rank %d of %d: step inputs over gloo: %s", self.rank, self.size,
                        self.channel_why)

    def _build_oneshot(self, device: torch.device) -> None:
        """The one-shot all-reduce, trusted once its first result equals NCCL's on every rank
        (float32: both sum in float32; 2 ranks add in the same order); else NCCL, logged why."""
        from .ipc_allreduce import IPCAllReduce

        got = IPCAllReduce.build(self.store, self.min_int, self.rank, self.size, device)
        if not isinstance(got, str):
            g = torch.Generator(device=device).manual_seed(1234 + self.rank)
            x = torch.randn(3, 4096, generator=g, device=device)
            want = x.clone()
            self._wait(self.dev.allreduce([want]))
            try:
                ok = torch.allclose(got(x), want, rtol=1e-5, atol=1e-5) and not got.error()
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run here: NCCL it is
                log.warning("the one-shot all-reduce failed its first call: %s", e)
                ok = False
            got = got if self.min_int(int(ok)) else "its first result differs from NCCL's"
        if isinstance(got, str):
            self.oneshot_why = got
            log.warning("tensor-parallel rank %d of %d: all-reduces over NCCL only: %s", self.rank, self.size, got)
        else:
            self.oneshot = got

    # ---- the model's collectives ---------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x <- the sum over the ranks, in place: the one-shot kernel for a small x on CUDA (decode
        steps), NCCL / gloo otherwise."""
        if self.size > 1:
            if self.oneshot is not None and self.oneshot.fits(x):
                return self.oneshot(x)
            self._wait(self.dev.allreduce([x]))
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x <- rank 0's x, in place (an overlapped step's pending token ids: model_runner._patcher)."""
        if self.size > 1:
            self._wait(self.dev.broadcast([x], _root0()))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., N * n], rank-major along the last dim."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._wait(self.dev._allgather_base(out, x))
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV block count all ranks can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait(self.ctrl.allreduce([t], opts))
        return int(t.item())

    # ---- rank 0 -> shards -----------------------------------------------------------------------
    def send(self, obj) -> None:
        """Rank 0: one message to every shard (a step's inputs, or None: stop)."""
        if self.size == 1:
            return
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if self.channel is not None and self._ring(self.channel.send, data):
            return
        self._wait(self.ctrl.broadcast([torch.tensor([len(data)], dtype=torch.int64)], _root0()))
        self._wait(self.ctrl.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)], _root0()))

    def recv(self):
        """A shard: the next message from rank 0."""
        if self.channel is not None and (data := self._ring(self.channel.recv)) is not None:
            return pickle.loads(data)
        n = torch.zeros(1, dtype=torch.int64)
        self._wait(self.ctrl.broadcast([n], _root0()))
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        self._wait(self.ctrl.broadcast([buf], _root0()))
        return pickle.loads(buf.numpy().tobytes())

    def _ring(self, call, *args):
        from .step_channel import PeerGone

        try:
            return call(*args)
        except PeerGone as e:
            raise TPError(f"tensor-parallel rank {self.rank} of {self.size}: {e}") from e

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - gloo / NCCL raise their own types
            raise TPError(f"tensor-parallel rank {self.rank} of {self.size}: a collective failed "
                          f"(a rank died or hung): {e}") from e


def _root0() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts
