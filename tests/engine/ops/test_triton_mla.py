"""The MLA decode kernel (ops/triton_mla.py) against the torch absorbed form (ops/mla_ref.py): on
CUDA when present, else on CPU tensors under Triton's interpreter. Latent rows in a block-major
one-part cache, bf16/fp32 and int8/fp8 rows with their scales, one and several head blocks, with
and without key splits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pdserve.engine.ops import kv_quant  # noqa: E402
from pdserve.engine.ops.mla_ref import mla_absorbed_ref  # noqa: E402
from pdserve.engine.ops.triton_mla import mla_decode_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def setup(heads: int, rank: int, rope: int, lens: list[int], dtype, kv_dtype: str = "auto", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    page, nope, v = 16, 16, 16
    blocks = sum(-(-n // page) for n in lens) + 3
    latent = torch.randn(blocks, 2, 1, page, 1, rank + rope, generator=g).to(dtype).to(DEV)  # [b, layers, part, ...]
    if kv_dtype == "auto":
        raw, cache = latent, latent[:, 1, 0]
    else:
        raw = torch.zeros(blocks, 2, 1, page, 1, kv_quant.row_bytes(kv_dtype, rank + rope), dtype=torch.uint8,
                          device=DEV)
        cache = kv_quant.views(raw[:, 1, 0], kv_dtype)
        slots = torch.arange(blocks * page, device=DEV)
        kv_quant.store(latent[:, 1, 0].reshape(-1, 1, rank + rope), None, cache, None, slots)
    perm = torch.randperm(blocks, generator=g).to(DEV)
    width = max(-(-n // page) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32, device=DEV)
    at = 0
    for i, n in enumerate(lens):
        k = -(-n // page)
        tables[i, :k] = perm[at:at + k].to(torch.int32)
        at += k
    q = torch.randn(len(lens), heads, nope + rope, generator=g).to(dtype).to(DEV)
    w = (torch.randn(heads, nope + v, rank, generator=g) / rank ** 0.5).to(dtype).to(DEV)
    return q, cache, tables, w, nope


CASES = {  # heads, rank, rope, context lengths, splits
    "one head block": (16, 64, 16, [1, 17, 40], 1),
    "splits": (16, 64, 16, [300, 33, 1], 3),
    "two head blocks, padded": (20, 32, 16, [64, 5], 1),
    "many heads, splits": (40, 32, 16, [200, 130], 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mla_decode_kernel_equals_the_absorbed_form(case, dtype):
    heads, rank, rope, lens, splits = CASES[case]
    q, cache, tables, w, nope = setup(heads, rank, rope, lens, dtype)
    want = mla_absorbed_ref(q.float(), cache.float(), tables, lens, [1] * len(lens), w.float(), 0.3)
    q_lat = torch.einsum("thn,hnr->thr", q[..., :nope], w[:, :nope])
    o_lat = mla_decode_triton(q_lat, q[..., nope:].contiguous(), cache, tables,
                              torch.tensor(lens, dtype=torch.int32, device=DEV), 0.3, splits=splits)
    got = torch.einsum("thr,hvr->thv", o_lat.float(), w[:, nope:].float())
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_latent_rows_are_read_with_their_scales(kv_dtype):
    heads, rank, rope, lens = 16, 64, 16, [70, 9]
    q, cache, tables, w, nope = setup(heads, rank, rope, lens, torch.float32, kv_dtype)
    want = mla_absorbed_ref(q, cache, tables, lens, [1] * len(lens), w, 0.3)
    q_lat = torch.einsum("thn,hnr->thr", q[..., :nope], w[:, :nope])
    o_lat = mla_decode_triton(q_lat, q[..., nope:].contiguous(), cache, tables,
                              torch.tensor(lens, dtype=torch.int32, device=DEV), 0.3, splits=2)
    torch.testing.assert_close(torch.einsum("thr,hvr->thv", o_lat, w[:, nope:]), want, rtol=1e-4, atol=1e-4)
