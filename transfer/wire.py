"""How a pair's messages move over its 2-rank process group (NCCL on CUDA, gloo on CPU): the
`C10dLink` a Pair (pair.py) builds when its peer's KV cannot be mapped into this process
(pull.py is the link when it can).

A message's blocks go in chunks of up to 2 x 64 MiB: a run of consecutive block ids from / into
the KV tensor in place, other chunks gathered into (sender) or scattered from (receiver) a
two-slot staging ring, so that the gather / scatter of one chunk overlaps the transfer of the
next. Over gloo, blocks of at least INPLACE_BLOCK_BYTES go one message each, from and into the
KV tensor in place (no gather, no scatter, no staging buffer: between two hosts of a bed, 2,048
tokens of SmolLM2's float32 KV took 188 ms staged and take 61 ms in place, bench/results/cross_host/).
A failed link is aborted (NCCL kernels waiting on a dead peer return) and set aside in
the connector's graveyard, never destroyed from a pair's thread (NCCL may hang there).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from pdserve.engine.base.stores import gloo_group, nccl_interface

from .base import Handoff, block_bytes, block_index, contiguous_run, gather_blocks, scatter_blocks

INPLACE_BLOCK_BYTES = 64 << 10  # gloo: a block this big is its own message, sent in place


def message_tag(k: int, i: int) -> int:
    """The tag of the i-th message of a pair's k-th handoff (both sides compute it alike)."""
    return (((k & 0x7FF) << 20) | (i & 0xFFFFF)) & 0x7FFFFFFF


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def plan_chunks(num_blocks: int, block_bytes: int, chunk_bytes: int = 64 << 20):
    """[lo, hi) block ranges: one message up to 2 x chunk_bytes, else chunks of chunk_bytes,
    so that the gather/scatter of one chunk overlaps the transfer of the next and a staged
    chunk fits a slot of the connector's staging ring (2 x chunk_bytes each)."""
    if num_blocks == 0:
        return []
    if num_blocks * block_bytes <= 2 * chunk_bytes:
        return [(0, num_blocks)]
    step = max(1, chunk_bytes // block_bytes)
    return [(lo, min(num_blocks, lo + step)) for lo in range(0, num_blocks, step)]


def width(heads) -> int | None:
    return None if heads is None else heads[1] - heads[0]


def _sliced(heads, num_heads: int) -> tuple[int, int] | None:
    """A head range that is less than all of this rank's heads, else None."""
    if heads is None or (heads[0] == 0 and heads[1] == num_heads):
        return None
    return tuple(heads)


def _index(ids: list[int], index, lo: int, hi: int, conn) -> torch.Tensor:
    return index[lo:hi] if index is not None else block_index(ids, conn.kv.device)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False




class C10dLink:
    """A pair's process group and the moves of its messages over it."""

    def __init__(self, conn, is_sender: bool, pg):
        self.conn, self.is_sender, self.pg = conn, is_sender, pg
        self.name = "nccl" if conn.device.type == "cuda" else "gloo"

    @classmethod
    def connect(cls, conn, rank: int, ps: dist.PrefixStore, deadline: float) -> C10dLink:
        timeout = td(max(deadline - time.monotonic(), 1.0))
        if conn.device.type == "cuda":
            nccl_interface(conn.host)  # NCCL's sockets on the interface that holds the node's address
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return cls(conn, rank == 0, dist.ProcessGroupNCCL(ps, rank, 2, opts))
        return cls(conn, rank == 0, gloo_group(ps, rank, 2, conn.host, timeout))

    def close(self) -> None:
        if self.conn.device.type == "cuda":
            try:
                self.pg.abort()  # unblocks NCCL kernels waiting on a dead peer
            except Exception:  # noqa: BLE001
                pass
        self.conn.graveyard.append(self.pg)  # never destroyed here (see module doc)

    def move(self, h: Handoff, k: int, block_ids: list[int] | None, scratch: int = 0) -> None:
        """Posts the k-th message's chunks and waits for them. A run of consecutive block ids
        goes from / into the KV tensor in place; other chunks are staged through a ring of
        two slots (on CUDA, preallocated: allocating under a full KV cache can force the
        caching allocator to free and synchronize the device, which cost the receiver
        ~20 ms a handoff on 2x H200). Stream order makes the ring safe: a slot is refilled
        only after the op that used it two chunks earlier."""
        n = scratch or len(block_ids)
        if self.in_place(h.heads, n):
            self._move_blocks(h, k, block_ids, n)
        else:
            self._move_chunks(h, k, block_ids, n)
        if scratch:
            return
        if not h.complete():
            # aborted or overdue while in flight: the data moved, but the owner gave up
            raise RuntimeError(f"handoff {h.request_id} finished after it was {h.state.name}")

    def in_place(self, heads, n: int) -> bool:
        """Whether a message of n blocks goes block by block in place: over gloo, whole blocks
        (no head range: a tensor-parallel route names one on both sides) of at least
        INPLACE_BLOCK_BYTES. Both sides decide it alike: their layouts are the same."""
        conn = self.conn
        return (self.name == "gloo" and n > 0 and heads is None
                and block_bytes(conn.kv) >= INPLACE_BLOCK_BYTES and conn.kv.is_contiguous())

    def _move_blocks(self, h: Handoff, k: int, block_ids: list[int] | None, n: int) -> None:
        """gloo: one message a block, each posted at once from (sender) or into (receiver) the
        block's own bytes in the KV tensor, then all waited for. A drained message (no
        `block_ids`) lands in one scratch block."""
        kv = self.conn.kv
        scratch = torch.empty_like(kv[0]) if block_ids is None else None
        posted: list = []
        for i in range(n):
            buf = scratch if block_ids is None else kv[block_ids[i]]
            tag = message_tag(k, i)
            posted.append([self.pg.send([buf], 1, tag) if self.is_sender else self.pg.recv([buf], 0, tag), False])
            if i == 0:
                h.t_first_post = time.monotonic()
            h.nbytes += buf.numel() * buf.element_size()
        h.t_posted = time.monotonic()
        for op in posted:
            self._wait(op, h, None)

    def _move_chunks(self, h: Handoff, k: int, block_ids: list[int] | None, n: int) -> None:
        conn = self.conn
        stream = conn.stream
        ring = conn.staging.acquire() if n else None
        try:
            with torch.cuda.stream(stream) if stream is not None else _nullctx():
                if h._ready is not None:
                    stream.wait_event(h._ready)  # steps that wrote (sender) or may write (receiver) them
                posted: list = []
                # one index tensor for the whole message (one pinned copy; the chunks slice it):
                # the fewer calls this thread makes, the fewer times it waits for the GIL
                index = block_index(block_ids, conn.kv.device) if block_ids and not contiguous_run(block_ids) \
                    else None
                heads = _sliced(h.heads, conn.kv.shape[4])
                one_block = block_bytes(conn.kv, heads)
                for i, (lo, hi) in enumerate(plan_chunks(n, one_block, conn.min_chunk_bytes)):
                    ids = block_ids[lo:hi] if block_ids is not None else None
                    if heads is not None:  # a head slice (tensor parallel): always staged
                        buf, staged = self._head_slice(h, ring, i, ids, index, lo, hi, heads), False
                    elif ids is not None and contiguous_run(ids):  # each side decides alone
                        buf, staged = conn.kv[ids[0]: ids[-1] + 1], False
                    else:
                        if i >= 2 and posted[i - 2][1]:  # the slot's previous user must be done
                            self._wait(posted[i - 2], h, stream)
                        buf, staged = ring.slot(i % 2, hi - lo), True
                        if self.is_sender:
                            gather_blocks(conn.kv, index[lo:hi], out=buf)
                    tag = message_tag(k, i)
                    work = self.pg.send([buf], 1, tag) if self.is_sender else self.pg.recv([buf], 0, tag)
                    posted.append([work, staged])
                    if i == 0:
                        h.t_first_post = time.monotonic()
                    if not self.is_sender and (staged or heads is not None):
                        self._wait(posted[-1], h, stream)
                        if ids is not None and heads is not None:
                            conn.kv[:, :, :, :, heads[0]:heads[1]].index_copy_(0, _index(ids, index, lo, hi, conn), buf)
                        elif ids is not None:
                            scatter_blocks(conn.kv, index[lo:hi], buf)
                    h.nbytes += buf.numel() * buf.element_size()
                h.t_posted = time.monotonic()
                for op in posted:
                    self._wait(op, h, stream)
                if stream is not None:
                    wait_stream(stream, h)
        finally:
            if ring is not None:
                conn.staging.release(ring)

    def _head_slice(self, h: Handoff, ring, i: int, ids, index, lo: int, hi: int, heads) -> torch.Tensor:
        """The buffer of a chunk that moves only KV heads [heads) of each block: the sender
        gathers the blocks and cuts the slice out; the receiver receives into a fresh one."""
        kv = self.conn.kv
        shape = (hi - lo, *kv.shape[1:4], heads[1] - heads[0], kv.shape[5])
        if not self.is_sender or ids is None:
            return torch.empty(shape, dtype=kv.dtype, device=kv.device)
        full = gather_blocks(kv, _index(ids, index, lo, hi, self.conn))
        return full[:, :, :, :, heads[0]:heads[1]].contiguous()

    @staticmethod
    def _wait(op: list, h: Handoff, stream) -> None:
        """op: [work, staged]; waits once (a gloo work waited twice blocks)."""
        work = op[0]
        if work is None:
            return
        if stream is None:  # gloo: a host-blocking wait with the handoff's deadline
            if not work.wait(td(h.deadline - time.monotonic())):
                raise TimeoutError(f"handoff {h.request_id} timed out after {h.timeout_s:.1f} s")
        else:
            work.wait()  # NCCL: orders our stream after the op; the host does not block
        op[0] = None


def wait_stream(stream, h: Handoff) -> None:
    """Polls, so that a dead peer cannot hang us past the deadline: spin for the first
    5 ms (a sleep costs ~0.1 ms of latency), then back off."""
    done = torch.cuda.Event()
    done.record(stream)
    spin_until = time.monotonic() + 0.005
    while not done.query():
        now = time.monotonic()
        if now > h.deadline:
            raise TimeoutError(f"handoff {h.request_id} timed out after {h.timeout_s:.1f} s")
        time.sleep(0 if now < spin_until else 0.0002)
