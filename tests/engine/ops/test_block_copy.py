"""ops/block_copy.copy_blocks, the same-node handoff's pull: blocks land at their destination ids
bit for bit, whole or as a head slice (tensor parallel), bf16 or quantized rows, and nothing
else of either slab changes; the Triton kernel (on CUDA, else under Triton's interpreter) and
the torch path agree."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pdserve.engine.ops.block_copy import copy_blocks  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def slab(num_blocks: int, heads: int, row: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, 2, 4, heads, row)  # blocks, layers, k/v, block_size, heads, row
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(DEV)
    return torch.randn(shape, generator=g).to(dtype).to(DEV)


def expected(dst, dst_ids, src, src_ids, dst_heads, src_heads):
    out = dst.clone()
    dl, dh = dst_heads or (0, dst.shape[4])
    sl, sh = src_heads or (0, src.shape[4])
    for d, s in zip(dst_ids, src_ids):
        out[d, :, :, :, dl:dh] = src[s, :, :, :, sl:sh]
    return out


CASES = {
    "whole blocks": (4, 4, None, None),
    "a slice into whole blocks (TP 1 -> 2)": (2, 4, None, (2, 4)),
    "whole blocks into a slice (TP 2 -> 1)": (4, 2, (0, 2), None),
    "slice to slice": (4, 4, (1, 3), (2, 4)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "quantized rows"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_blocks_land_at_their_ids_and_nothing_else_changes(case, dtype, use_triton):
    dst_heads_n, src_heads_n, dst_heads, src_heads = CASES[case]
    row = 16 if dtype == torch.bfloat16 else 24  # quantized: values + scale bytes
    src = slab(9, src_heads_n, row, dtype, 1)
    dst = slab(7, dst_heads_n, row, dtype, 2)
    src_ids, dst_ids = [8, 0, 3, 4], [2, 6, 0, 5]
    want = expected(dst, dst_ids, src, src_ids, dst_heads, src_heads)
    ids = [torch.tensor(x, dtype=torch.int64, device=DEV) for x in (dst_ids, src_ids)]
    before = src.clone()
    copy_blocks(dst, ids[0], src, ids[1], dst_heads, src_heads, use_triton=use_triton)
    assert torch.equal(dst, want) and torch.equal(src, before)


def test_blocks_that_do_not_fit_are_refused_by_name():
    src, dst = slab(3, 4, 16, torch.bfloat16, 1), slab(3, 4, 16, torch.float32, 2)
    one = torch.tensor([0], device=DEV)
    with pytest.raises(ValueError, match="do not fit"):
        copy_blocks(dst, one, src, one)
    with pytest.raises(ValueError, match="head slices differ in width"):
        copy_blocks(slab(3, 4, 16, torch.bfloat16, 2), one, src, one, (0, 2), (0, 3))

