"""FP8 block-scaled linear layers (ops/triton_fp8.py): the Triton kernels (on CPU through the
interpreter) against the same arithmetic in torch, and against the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.fp8 import dequantize
from pdserve.engine.ops.triton_fp8 import (
    FEW_ROWS,
    Fp8Tiles,
    fp8_linear,
    fp8_linear_ref,
    quantize_groups,
    quantize_groups_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = Fp8Tiles(block_m=16, block_n=64, group_m=2, warps=4, stages=2, gemv_tile=2048, gemv_max_k=256)


def fp8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    wq = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand((n + 127) // 128, (k + 127) // 128, generator=g) / (64 * k ** 0.5) + 1e-4
    return wq.to(DEV), ws.to(DEV)


def test_activations_round_to_e4m3_as_torch_does_ties_and_carries_included():
    # 126.5 of a group whose amax is 448 rounds up into the next binade (128): the interpreter's own
    # cast gave 64 there; 1.99 likewise (2.0), and 0.0 / subnormals stay exact
    row = torch.tensor([448.0, 126.5, -126.5, 1.99, 124.0, 0.0, 0.001, -447.0] * 16 + [3.0] * 72)
    x = torch.stack([row, row * 0.5, torch.linspace(-3, 3, 200)]).to(DEV)
    q, s = quantize_groups(x)
    qr, sr = quantize_groups_ref(x)
    assert s.shape == (3, 2) and torch.equal(s, sr)
    assert torch.equal(q.float(), qr.float())
    assert q.float()[0, 1].item() == 128.0 and q.float()[0, 3].item() == 2.0


@pytest.mark.parametrize("m", [1, 3, FEW_ROWS, FEW_ROWS + 1, 37])
@pytest.mark.parametrize("n,k", [(200, 320), (256, 512), (130, 200)])
def test_fp8_linear_matches_its_torch_arithmetic_and_the_dequantized_weight(m, n, k):
    wq, ws = fp8_weight(n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEV, torch.bfloat16)
    y = fp8_linear(x, wq, ws, tiles=SMALL)
    ref = fp8_linear_ref(x, wq, ws)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # the same products, summed in another order, both rounded to bf16: at most a bf16 step apart
    assert torch.allclose(y.float(), ref.float(), atol=2e-3, rtol=1e-2), (y.float() - ref.float()).abs().max()
    exact = x.float() @ dequantize(wq, ws, (128, 128), torch.float32).t()
    err = ((y.float() - exact).norm() / exact.norm()).item()
    # the GEMV keeps x as it is; W8A8 quantizes x to e4m3 (3 mantissa bits: a few percent per value)
    assert err < (0.01 if m <= FEW_ROWS else 0.05), err


def test_a_weight_whose_scales_do_not_fit_is_refused_naming_both_shapes():
    wq, ws = fp8_weight(256, 256)
    x = torch.randn(2, 256).to(DEV, torch.bfloat16)
    with pytest.raises(ValueError, match=r"scales \(1, 2\).*wq \(256, 256\)"):
        fp8_linear(x, wq, ws[:1])
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        fp8_linear(x[:, :100], wq, ws)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's block-scaled GEMM: a GPU")
def test_on_a_gpu_the_engine_path_and_the_triton_kernel_agree():
    wq, ws = fp8_weight(1024, 2048)
    x = torch.randn(300, 2048, device="cuda", dtype=torch.bfloat16)
    ref = fp8_linear_ref(x, wq, ws).float()
    for tiles in (Fp8Tiles(), Fp8Tiles(cublas=False)):
        y = fp8_linear(x, wq, ws, tiles=tiles).float()
        assert ((y - ref).norm() / ref.norm()).item() < 1e-2
