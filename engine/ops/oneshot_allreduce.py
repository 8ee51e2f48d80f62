"""A one-shot all-reduce over buffers every rank of a node maps (CUDA IPC): one launch, no NCCL,
capturable in a CUDA graph. The tensor-parallel decode step's all-reduces are small ([batch,
hidden], a few KiB to 2 MiB) and latency-bound; NCCL's ring costs ~60-70 us each on 2x H200
(bench/results/tp), this ~5-10 us.

    oneshot_all_reduce(x, bufs, flags, epochs, rank)   x <- the sum of every rank's x, in place

Each rank owns one buffer of two slots (`bufs[r]`: 2 x SLOT_BYTES) and one flag array (`flags[r]`:
int32 [MAX_RANKS, MAX_PROGRAMS]); every rank holds every rank's buffer and flags mapped
(base/ipc_allreduce.py). Program p of a launch owns bytes [p x CHUNK_BYTES, (p + 1) x CHUNK_BYTES)
of x, whatever x's dtype; its call count `epochs[p]` (this rank's own memory) picks the slot
(count mod 2) and marks the round:

    1. copy its chunk of x into its rank's slot
    2. for each peer q: flags[q][rank, p] = count (a system-scope release after a CTA barrier:
       the chunk is visible before the flag)
    3. for each peer q: wait until flags[rank][q, p] >= count (system-scope acquire)
    4. x's chunk = the sum over ranks 0..N-1, in that order, in float32 (every rank computes the
       same bits), read from each peer's slot

A slot is written again two rounds later, by which time every peer's program p has signalled
the round between, so it has finished reading this one. Every rank runs the same sequence of
calls with the same sizes (the ranks of one engine run the same forward), so the counts agree.
A peer that never arrives is waited for MAX_SPINS polls (seconds), then the launch goes on with
what it has and sets the error word after the counts (`epochs[MAX_PROGRAMS]`): the group reads
it and stops using the path (a dead rank ends its worker anyway: Ray ends the shards with it).

On CPU the kernel runs under Triton's interpreter in the tests, one rank after the other with the
peer's half of a round written beforehand; on CUDA it needs peer access between the GPUs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_RANKS = 8
SLOT_BYTES = 2 << 20  # the largest all-reduce it takes: [128, 8192] bf16
CHUNK_BYTES = 4096  # what one program reduces
MAX_PROGRAMS = SLOT_BYTES // CHUNK_BYTES
MAX_SPINS = 1 << 24  # polls of a peer's flag (~1 us each on a GPU) before the launch gives up on it
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _pick(q: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7):
    p = a0
    if q == 1:
        p = a1
    if q == 2:
        p = a2
    if q == 3:
        p = a3
    if q == 4:
        p = a4
    if q == 5:
        p = a5
    if q == 6:
        p = a6
    if q == 7:
        p = a7
    return p


@triton.jit
def _oneshot_kernel(x_ptr, n, epoch_ptr, slot_elems, b0, b1, b2, b3, b4, b5, b6, b7, f0, f1, f2, f3, f4, f5, f6, f7,
                    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, MAXP: tl.constexpr,
                    MAX_SPINS: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.load(epoch_ptr + pid) + 1
    slot = (e % 2).to(tl.int64) * slot_elems
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m, other=0.0)
    mine = _pick(RANK, b0, b1, b2, b3, b4, b5, b6, b7)
    tl.store(mine + slot + offs, v, mask=m)
    tl.debug_barrier()  # the whole chunk written before any thread raises a flag
    for q in tl.static_range(WORLD):
        if q != RANK:
            fq = _pick(q, f0, f1, f2, f3, f4, f5, f6, f7)
            tl.atomic_xchg(fq + RANK * MAXP + pid, e, sem="release", scope="sys")
    own = _pick(RANK, f0, f1, f2, f3, f4, f5, f6, f7)
    for q in tl.static_range(WORLD):
        if q != RANK:
            seen = tl.atomic_add(own + q * MAXP + pid, 0, sem="acquire", scope="sys")
            spins = 0
            while (seen < e) & (spins < MAX_SPINS):
                seen = tl.atomic_add(own + q * MAXP + pid, 0, sem="acquire", scope="sys")
                spins += 1
            if seen < e:  # the peer never came: say so (the caller stops using this path)
                tl.atomic_xchg(epoch_ptr + MAXP, q + 1)
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for q in tl.static_range(WORLD):
        if q == RANK:
            acc += v.to(tl.float32)
        else:
            bq = _pick(q, b0, b1, b2, b3, b4, b5, b6, b7)
            acc += tl.load(bq + slot + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=m)
    tl.store(epoch_ptr + pid, e)


def fits(x: torch.Tensor) -> bool:
    """Whether `x` can take the one-shot path: contiguous, a float dtype, at most SLOT_BYTES."""
    return x.dtype in DTYPES and x.is_contiguous() and 0 < x.numel() * x.element_size() <= SLOT_BYTES


def oneshot_all_reduce(x: torch.Tensor, bufs: list[torch.Tensor], flags: list[torch.Tensor], epochs: torch.Tensor,
                       rank: int) -> torch.Tensor:
    """x (this rank's part, `fits`) <- the sum over ranks, in place; queued on the current stream.
    `bufs[q]`: rank q's two slots viewed as x's dtype (2 x SLOT_BYTES); `flags[q]`: rank q's
    int32 [MAX_RANKS, MAX_PROGRAMS]; `epochs`: this rank's int32 [MAX_PROGRAMS + 1]: the call counts,
    then an error word (q + 1: a launch stopped waiting for rank q after MAX_SPINS polls)."""
    world = len(bufs)
    if not 1 < world <= MAX_RANKS or not fits(x):
        raise ValueError(f"one-shot all-reduce of {tuple(x.shape)} {x.dtype} over {world} ranks")
    block = CHUNK_BYTES // x.element_size()
    n = x.numel()
    b = bufs + [bufs[0]] * (MAX_RANKS - world)
    f = flags + [flags[0]] * (MAX_RANKS - world)
    _oneshot_kernel[(triton.cdiv(n, block),)](x, n, epochs, SLOT_BYTES // x.element_size(), *b, *f, RANK=rank,
                                             WORLD=world, BLOCK=block, MAXP=MAX_PROGRAMS, MAX_SPINS=MAX_SPINS,
                                             num_warps=4)
    return x
