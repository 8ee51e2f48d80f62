"""The few-row linear (ops/triton_gemv.py) against F.linear: every row count it takes, with and
without a bias, tiles that cut K and N unevenly; on CUDA when present, else on CPU under
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pdserve.engine.ops.triton_gemv import MAX_ROWS, GemvTiles, gemv_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("M", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_f_linear(M, bias):
    g = torch.Generator().manual_seed(M)
    N, K = 37, 100
    x = torch.randn(M, K, generator=g).to(DEV)
    w = torch.randn(N, K, generator=g).to(DEV)
    b = torch.randn(N, generator=g).to(DEV) if bias else None
    for tiles in (GemvTiles(), GemvTiles(tile=64, max_k=32, warps=2)):  # one load of K; 4 loads of 32, 2 rows each
        torch.testing.assert_close(gemv_triton(x, w, b, tiles), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_strided_row_view_and_too_many_rows():
    """x may be a view with a row stride (the last dim contiguous); more than MAX_ROWS rows or a
    weight of another K are refused."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3, 80, generator=g).to(DEV)
    w = torch.randn(16, 40, generator=g).to(DEV)
    torch.testing.assert_close(gemv_triton(big[:, :40], w), F.linear(big[:, :40], w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv_triton(torch.randn(MAX_ROWS + 1, 40, device=DEV), w)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv_triton(torch.randn(2, 41, device=DEV), w)
