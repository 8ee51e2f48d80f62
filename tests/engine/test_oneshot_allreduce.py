"""The one-shot all-reduce's protocol (engine/ops/oneshot_allreduce.py) under Triton's interpreter
(CPU): two ranks' launches, one after the other, on buffers both "map" (the same tensors). Rank
1's first half of each round (its chunk in its slot, its flag raised in rank 0's flags) is written
before rank 0 runs, as rank 1's kernel would; rank 1's own launch then finds rank 0's half done.
Rounds of different sizes and dtypes move each program's count and slot on their own. On GPUs,
tests/engine/test_oneshot_gpu.py runs it between two processes."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.ops.oneshot_allreduce import (
    CHUNK_BYTES,
    MAX_PROGRAMS,
    MAX_RANKS,
    SLOT_BYTES,
    fits,
    oneshot_all_reduce,
)


class TwoRanks:
    def __init__(self):
        self.raw = [torch.zeros(2 * SLOT_BYTES, dtype=torch.uint8) for _ in range(2)]
        self.flags = [torch.zeros(MAX_RANKS, MAX_PROGRAMS, dtype=torch.int32) for _ in range(2)]
        self.epochs = [torch.zeros(MAX_PROGRAMS + 1, dtype=torch.int32) for _ in range(2)]

    def peer_half(self, x: torch.Tensor, q: int, r: int) -> None:
        """Rank q's steps 1-2 of its next round for rank r: its chunks in its slots, its flags raised."""
        es, flat = x.element_size(), x.flatten()
        block, slot_elems = CHUNK_BYTES // es, SLOT_BYTES // es
        for p in range(-(-flat.numel() // block)):
            e = int(self.epochs[q][p]) + 1
            chunk = flat[p * block:(p + 1) * block]
            start = (e % 2) * slot_elems + p * block
            self.raw[q].view(x.dtype)[start:start + chunk.numel()] = chunk
            self.flags[r][q, p] = e

    def round(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        ys = [x.clone() for x in xs]
        self.peer_half(xs[1], 1, 0)
        for r in (0, 1):
            oneshot_all_reduce(ys[r], [b.view(ys[r].dtype) for b in self.raw], self.flags, self.epochs[r], r)
        return ys


def test_both_ranks_get_the_same_sum_round_after_round():
    ranks = TwoRanks()
    g = torch.Generator().manual_seed(0)
    for dtype, shape in ((torch.bfloat16, (3, 4096)), (torch.float32, (1, 100)), (torch.bfloat16, (64, 4096)),
                         (torch.float32, (2, 5000)), (torch.float16, (1, 4096)), (torch.bfloat16, (3, 4096))):
        xs = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
        ys = ranks.round(xs)
        assert torch.equal(ys[0], ys[1]), dtype  # bit-equal on every rank: summed in rank order, float32
        want = xs[0].float() + xs[1].float()
        if dtype == torch.float32:
            assert torch.equal(ys[0], want)
        else:  # one rounding of the float32 sum (the interpreter truncates where a GPU rounds)
            torch.testing.assert_close(ys[0].float(), want, rtol=2 ** -7, atol=0)
    # each program counts its own rounds: program 0 took all six, program 70 only the [64, 4096] one
    assert ranks.epochs[0][0] == ranks.epochs[1][0] == 6 and ranks.epochs[0][70] == 1
    assert ranks.epochs[0][MAX_PROGRAMS] == ranks.epochs[1][MAX_PROGRAMS] == 0  # no launch gave up
    # and raised its flag in the peer's array for each
    assert ranks.flags[1][0, 0] == 6 and ranks.flags[0][1, 70] == 1


def test_what_takes_the_one_shot_path():
    assert fits(torch.zeros(128, 8192, dtype=torch.bfloat16))  # 2 MiB
    assert not fits(torch.zeros(129, 8192, dtype=torch.bfloat16))  # larger: NCCL
    assert not fits(torch.zeros(4, 8, dtype=torch.float32).t())  # not contiguous
    assert not fits(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="over 1 ranks"):
        oneshot_all_reduce(torch.zeros(8), [torch.zeros(8)], [torch.zeros(8, dtype=torch.int32)],
                           torch.zeros(8, dtype=torch.int32), 0)


def test_a_peer_that_never_comes_is_named_in_the_error_word(monkeypatch):
    import pdserve.engine.ops.oneshot_allreduce as ops

    monkeypatch.setattr(ops, "MAX_SPINS", 3)  # a few polls, then give up (a GPU waits seconds)
    ranks = TwoRanks()
    x = torch.randn(2, 100)
    ops.oneshot_all_reduce(x, [b.view(x.dtype) for b in ranks.raw], ranks.flags, ranks.epochs[0], 0)
    assert ranks.epochs[0][MAX_PROGRAMS] == 2  # rank 1 (q + 1) never raised its flag
    assert ranks.flags[1][0, 0] == 1  # rank 0 raised its own
