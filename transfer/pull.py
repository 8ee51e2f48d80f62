"""The same-node transport of a pair (pair.py): the receiver pulls the sender's blocks out of the
sender's KV slab, mapped into the receiver's process once when the pair connects
(shared.py: CUDA IPC on a GPU, a shared memory file on CPU), so the sender's GPU spends no SMs
and no NCCL kernels on the move, and the two need no process group.

    connect   the sender offers its slab (shared.export) and its store's address; the receiver
              maps it (shared.open_peer) and answers the pair's link: "pull", or "c10d" with the
              reason it could not map it (then the pair builds its process group, wire.py)
    send      the sender waits for the step that wrote its blocks, writes order/<k> with its
              block ids, and waits for ack/<k>; its blocks stay held until then (DONE)
    receive   the receiver copies the blocks on its side stream (ops/block_copy: one kernel reading
              the peer's memory, on its GPU or another of the node), waits for the copy, checks that the sender is still
              alive (its store answers), then acks; a sender that died during the copy fails
              the handoff (what was copied is never used: the blocks stay reserved, not cached)
              and the pair, whose next gen connects afresh

The control path stays one round trip (the order, the ack), as over NCCL. Both travel over the
pair's doorbell (`Bell`: a Unix socket of the pair, in the abstract namespace, gone with either
process): a message wakes the side that waits for it at once and costs no store round trip (three
of them per message through the store: set, then check, get and delete). Without a doorbell
(another network namespace) they go through the receiver's store and each side polls.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
import uuid

import torch
import torch.distributed as dist

from pdserve.engine.base.cuda_ipc import gpu_uuid
from pdserve.engine.base.step_channel import process_start
from pdserve.engine.ops.block_copy import copy_blocks

from .base import Handoff, block_bytes, block_index
from .records import TransferError
from .shared import export, open_peer
from .wire import _nullctx, td, wait_stream


class PeerLost(TransferError):
    pass


def offer(conn) -> str:
    """The sender's half of the link choice: its slab's description, its store's address and its
    process (pid and start time, for a liveness check that costs no round trip)."""
    pid = os.getpid()
    return json.dumps({"share": export(conn.kv) if conn.same_node else None, "address": conn.address,
                       "pid": pid, "started": process_start(pid)})


def accept(conn, offer_json: str) -> tuple[dict, PullLink | None]:
    """The receiver's half: ({"link": "pull" | "c10d", "why": ...}, the link when it is "pull")."""
    o = json.loads(offer_json)
    if not conn.same_node:
        return {"link": "c10d", "why": "the same-node transport is off"}, None
    peer = open_peer(o["share"], conn.kv)
    if isinstance(peer, str):
        return {"link": "c10d", "why": peer}, None
    link = PullLink(conn, peer, o["address"])
    link.other_gpu = o["share"].get("kind") == "cuda" and o["share"]["uuid"] != gpu_uuid(conn.kv.device)
    # its process visible here (one PID namespace: the same pid with the same start time), whatever
    # GPU it holds: then each pull's liveness check reads /proc instead of a round trip to its store
    # (that round trip cost 5-28 ms p50 of a served handoff across two H200s, against a 1.6 ms copy)
    if o.get("started") is not None and process_start(o["pid"]) == o["started"]:
        link.peer_process = (o["pid"], o["started"])
    where = "from another GPU of this node" if link.other_gpu else None
    return {"link": "pull", "why": "the peer's KV is mapped here" + (f", {where}" if where else ""),
            "bell": link.listen()}, link


class Bell:
    """The pair's doorbell: an abstract Unix socket between its two processes that carries the
    pair's control messages (order/<k>, ack/<k>) as JSON lines, so a message wakes the side that
    waits for it at once and costs no store round trip. Messages read wait in `inbox` by key."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""
        self.inbox: dict[str, str] = {}

    def post(self, key: str, value: str) -> bool:
        """Sends one message; False if the peer is gone (the caller falls back to the store)."""
        try:
            self.sock.sendall(json.dumps([key, value]).encode() + b"\n")
            return True
        except OSError:
            return False

    def take(self, timeout: float) -> None:
        """Files the messages that arrive within `timeout` into `inbox`. A peer that closed its
        end, or reset it (it ended with a message of ours unread), raises TransferError."""
        if not select.select([self.sock], [], [], max(timeout, 0))[0]:
            return
        try:
            data = self.sock.recv(1 << 16)
        except ConnectionError:
            data = b""
        if not data:
            raise TransferError("the peer left (it closed the pair's doorbell)")
        *lines, self.buf = (self.buf + data).split(b"\n")
        for line in lines:
            key, value = json.loads(line)
            self.inbox[key] = value

    def close(self) -> None:
        self.sock.close()


def take(ps: dist.PrefixStore, key: str, bell: Bell | None) -> str | None:
    """The message `key` if it is here: from the doorbell's inbox, else from the store (then
    deleted there); None if neither has it yet."""
    if bell is not None and key in bell.inbox:
        return bell.inbox.pop(key)
    if ps.check([key]):
        value = ps.get(key).decode()
        ps.delete_key(key)
        return value
    return None


def post(ps: dist.PrefixStore, key: str, value: str, bell: Bell | None) -> None:
    """Sends the message `key` over the doorbell when the pair has one, else through the store."""
    if bell is None or not bell.post(key, value):
        ps.set(key, value)


def wait_key(ps: dist.PrefixStore, key: str, h: Handoff, gone, bell: Bell | None = None) -> str:
    """Waits for `key` until the handoff's deadline or `gone()` (the pair died): woken by the
    doorbell when there is one, else polling (spin for the first 5 ms, then back off)."""
    spin_until = time.monotonic() + 0.005
    while (value := take(ps, key, bell)) is None:
        now = time.monotonic()
        if now > h.deadline:
            raise TimeoutError(f"handoff {h.request_id} timed out after {h.timeout_s:.1f} s waiting for {key}")
        if gone():
            raise TransferError(f"handoff {h.request_id}: the pair closed")
        if bell is not None:
            bell.take(min(0.05, h.deadline - now))
        else:
            time.sleep(0 if now < spin_until else 0.0002)
    return value


class PullLink:
    """One pair's same-node link. Receiver: the peer's slab mapped here, and a client of the
    peer's store to ask whether it is still alive. Sender: nothing but the protocol."""

    def __init__(self, conn, peer_kv: torch.Tensor | None = None, peer_address: str | None = None):
        self.conn, self.peer_kv, self.peer_address = conn, peer_kv, peer_address
        self.name = "cuda-ipc" if conn.device.type == "cuda" else "shared-memory"
        self._peer_store: dist.TCPStore | None = None
        self.peer_process: tuple[int, str] | None = None  # (pid, start time), when /proc shows it here
        self.other_gpu = False  # receiver: the peer's KV is on another GPU (read over NVLink / PCIe)
        self.bell: Bell | None = None  # the pair's doorbell once both ends hold it
        self._listener: socket.socket | None = None  # receiver: until the sender connects

    # ---- the doorbell ---------------------------------------------------------------------
    def listen(self) -> str | None:
        """Receiver: the doorbell's address (abstract Unix socket), None if there can be none."""
        name = f"\0pdserve-bell-{uuid.uuid4().hex}"
        try:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(name)
            self._listener.listen(1)
        except (OSError, AttributeError):
            self._listener = None
            return None
        return name[1:]

    def ring_at(self, name: str | None) -> None:
        """Sender: connects to the receiver's doorbell; without one, it polls."""
        if name is None:
            return
        try:
            bell = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bell.connect("\0" + name)
            self.bell = Bell(bell)
        except OSError:
            pass

    def wait_order(self, timeout: float) -> None:
        """Receiver, no order yet: until the sender rings or `timeout` (then the caller polls)."""
        if self.bell is None and self._listener is not None:
            self._listener.settimeout(timeout)
            try:
                self.bell = Bell(self._listener.accept()[0])
            except OSError:  # not connected yet (or never: a sender that cannot reach it polls)
                return
            self._listener.close()
            self._listener = None
        if self.bell is None:
            time.sleep(timeout)
            return
        self.bell.take(timeout)

    @property
    def liveness(self) -> str | None:
        """Receiver: how a pull learns its sender outlived the copy: "process" (its pid and start
        time, read here) or "store" (a round trip to its store); None on the sender's side."""
        if self.peer_kv is None and self.peer_address is None:
            return None
        return "process" if self.peer_process is not None else "store"

    def close(self) -> None:
        self.peer_kv = None  # the mapping goes with the last reference (a copy in flight keeps it)
        for sock in (self.bell, self._listener):
            if sock is not None:
                sock.close()

    # ---- sender -------------------------------------------------------------------------------
    def send(self, ps: dist.PrefixStore, h: Handoff, k: int, order: dict, gone) -> None:
        if h._ready is not None:
            h._ready.synchronize()  # the step that wrote the blocks is done: the peer may read them
        post(ps, f"order/{k}", json.dumps({**order, "src": h.block_ids}), self.bell)
        h.t_first_post = h.t_posted = time.monotonic()
        ack = wait_key(ps, f"ack/{k}", h, gone, self.bell)
        if ack not in ("ok", "gone"):  # "gone": the receiver gave the request up; nothing to hold
            raise TransferError(f"handoff {h.request_id}: the receiver could not pull: {ack}")
        h.nbytes = block_bytes(self.conn.kv, h.heads) * len(h.block_ids)
        if not h.complete():
            raise TransferError(f"handoff {h.request_id} finished after it was {h.state.name}")

    # ---- receiver -----------------------------------------------------------------------------
    def receive(self, ps: dist.PrefixStore, h: Handoff, k: int, order: dict, peer: str) -> None:
        conn = self.conn
        stream = conn.stream
        with torch.cuda.stream(stream) if stream is not None else _nullctx():
            if h._ready is not None:
                stream.wait_event(h._ready)  # the step in flight may still write these blocks
            dev = conn.kv.device
            copy_blocks(conn.kv, block_index(h.block_ids, dev), self.peer_kv, block_index(order["src"], dev),
                        h.heads, order.get("heads"))
        h.t_first_post = time.monotonic()
        if stream is not None:
            wait_stream(stream, h)
        h.t_posted = time.monotonic()
        self._check_alive(peer, h)
        h.nbytes = block_bytes(self.conn.kv, h.heads) * len(h.block_ids)
        done = h.complete()  # the blocks are usable here now; the ack only lets the sender free its own
        post(ps, f"ack/{k}", "ok", self.bell)
        if not done:
            raise TransferError(f"handoff {h.request_id} finished after it was {h.state.name}")

    def _check_alive(self, peer: str, h: Handoff) -> None:
        """The sender held the blocks until now only if its process still runs: the same pid with
        the same start time (its process visible here), else its store answers."""
        if self.peer_process is not None:
            pid, started = self.peer_process
            if process_start(pid) != started:
                raise PeerLost(f"prefill worker {peer} died during the pull of {h.request_id}; its KV is not used")
            return
        try:
            if self._peer_store is None:
                host, port = self.peer_address.rsplit(":", 1)
                self._peer_store = dist.TCPStore(host, int(port), is_master=False, timeout=td(2.0))
            self._peer_store.check(["alive"])
        except Exception as e:  # noqa: BLE001 - any failure to reach it: it is gone
            raise PeerLost(f"prefill worker {peer} died during the pull of {h.request_id}; its KV is not "
                           f"used ({type(e).__name__})") from None
