"""Fused RMSNorm + residual, rope and SiLU * gate kernels against the model's torch
modules: on CUDA when present, else under Triton's interpreter (set in conftest).
fp32 matches to 1e-6 (the residual add and rope exactly: the kernels repeat torch's
operations and roundings); bf16 within a couple of bf16 steps, because the interpreter
truncates where the GPU rounds to nearest."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pdserve.engine.models.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from pdserve.engine.ops.triton_fused import add_rmsnorm, rope_, silu_mul  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:  # a couple of bf16 steps (8 bits of mantissa) of the operands' scale
        scale = b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=scale * 2 ** -6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N", [(1, 64), (7, 96), (3, 4096)])
def test_add_rmsnorm_matches_residual_add_and_rmsnorm(T, N, dtype):
    g = torch.Generator().manual_seed(T * N)
    norm = RMSNorm(N, 1e-5)
    norm.weight.data = torch.randn(N, generator=g)
    norm = norm.to(DEV, dtype)
    x = torch.randn(T, N, generator=g).to(DEV, dtype)
    r = torch.randn(T, N, generator=g).to(DEV, dtype)
    out, res = add_rmsnorm(x, r, norm.weight, norm.eps)
    close(res, x + r, dtype)
    close(out, norm(res), dtype)  # normalizes the stream it stored
    if dtype == torch.float32:
        assert torch.equal(res, x + r)  # an add rounds alike everywhere; the norm's sum order may not
    out0, res0 = add_rmsnorm(x, None, norm.weight, norm.eps)  # the first layer: no residual yet
    assert res0 is x
    close(out0, norm(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KVH,D", [(4, 2, 32), (6, 2, 64), (32, 8, 128)])
def test_rope_in_place_on_qkv_views_matches_rotary(H, KVH, D, dtype):
    rot = RotaryEmbedding(D, 256, 500000.0, None).to(DEV)
    T = 5
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=torch.Generator().manual_seed(H + D)).to(DEV, dtype)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, KVH, D)  # strided views, as in the model
    pos = torch.tensor([0, 1, 17, 100, 255], device=DEV)
    v_before = v.clone()
    want_q, want_k = rot(pos, q.clone(), k.clone())
    got_q, got_k = rope_(q, k, pos, rot.cos, rot.sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    close(q, want_q, dtype)
    close(k, want_k, dtype)
    assert torch.equal(v, v_before)  # the view's neighbours untouched
    if dtype == torch.float32 and DEV == "cpu":  # the GPU contracts x*cos + y*sin into an FMA
        assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rope_takes_one_launch_for_neighbouring_q_and_k_and_two_otherwise():
    from pdserve.engine.ops.triton_fused import _rope_launches

    H, KVH, D, T = 4, 2, 32, 3
    rot = RotaryEmbedding(D, 64, 10000.0, None).to(DEV)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=torch.Generator().manual_seed(1)).to(DEV)
    q, k, v = (x.view(T, -1, D) for x in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    assert [h for _, h in _rope_launches(q, k)] == [H + KVH]
    assert [h for _, h in _rope_launches(k, v)] == [2 * KVH]  # any neighbours
    assert [h for _, h in _rope_launches(q, v)] == [H, KVH]  # k lies between them
    one = qkv[:1].split([H * D, KVH * D, KVH * D], dim=-1)  # a decode step of one token: view()
    q1, k1 = one[0].view(1, H, D), one[1].view(1, KVH, D)  # gives q and k different row strides
    assert q1.stride(0) != k1.stride(0) and [h for _, h in _rope_launches(q1, k1)] == [H + KVH]
    q2, k2 = q.clone(), k.clone()  # separate tensors: one launch each, the same result
    assert [h for _, h in _rope_launches(q2, k2)] == [H, KVH]
    pos = torch.tensor([3, 9, 60], device=DEV)
    rope_(q, k, pos, rot.cos, rot.sin)
    rope_(q2, k2, pos, rot.cos, rot.sin)
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N", [(1, 80), (4, 1536), (2, 3000)])
def test_silu_mul_matches_torch(T, N, dtype):
    gu = torch.randn(T, 2 * N, generator=torch.Generator().manual_seed(N)).to(DEV, dtype) * 4
    gate, up = gu.chunk(2, dim=-1)
    close(silu_mul(gu), F.silu(gate) * up, dtype)


def test_bad_shapes_are_refused():
    x = torch.randn(3, 8, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm(x, None, torch.ones(4, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm(x, torch.randn(2, 8, device=DEV), torch.ones(8, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="2 \\* N"):
        silu_mul(torch.randn(3, 7, device=DEV))
    cos = torch.randn(16, 8, device=DEV)
    with pytest.raises(ValueError, match="does not fit"):
        rope_(torch.randn(3, 2, 8, device=DEV), torch.randn(3, 1, 6, device=DEV), torch.arange(3, device=DEV),
              cos, cos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,KVH,D", [(7, 4, 2, 32), (1, 32, 4, 128), (3, 6, 2, 64)])
def test_head_rmsnorm_rope_in_place_on_qkv_views_matches_rmsnorm_per_head_then_rotary(T, H, KVH, D, dtype):
    """Qwen3's q/k norm, then rope: every q and k head row of the qkv projection's views normalized
    as RMSNorm(head_dim) rounds it, then rotated as the rotary module rotates it, in place, one
    launch; v untouched. Bad shapes are refused naming them."""
    from pdserve.engine.ops.triton_fused import head_rmsnorm_rope_

    g = torch.Generator().manual_seed(H * D + T)
    rot = RotaryEmbedding(D, 256, 1000000.0, None).to(DEV)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype).to(DEV)
    before = qkv.clone()
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, KVH, D)
    pos = torch.tensor([0, 1, 17, 100, 255, 3, 64][:T], device=DEV)
    nq, nk = RMSNorm(D, 1e-6).to(DEV), RMSNorm(D, 1e-6).to(DEV)
    with torch.no_grad():
        nq.weight.copy_(torch.randn(D, generator=g))
        nk.weight.copy_(torch.randn(D, generator=g))
        nq, nk = nq.to(dtype), nk.to(dtype)
        want_q, want_k = rot(pos, nq(q.clone()), nk(k.clone()))
        head_rmsnorm_rope_(q, k, nq.weight, nk.weight, 1e-6, pos, rot.cos, rot.sin)
    close(q, want_q, dtype)
    close(k, want_k, dtype)
    assert torch.equal(v, before[:, (H + KVH) * D:])
    with pytest.raises(ValueError, match="head_rmsnorm_rope_"):
        head_rmsnorm_rope_(q, k, nq.weight, nk.weight, 1e-6, pos[:1] if T > 1 else pos.repeat(2), rot.cos, rot.sin)
    with pytest.raises(ValueError, match="head_rmsnorm_rope_"):
        head_rmsnorm_rope_(q, k[..., :D // 2], nq.weight, nk.weight, 1e-6, pos, rot.cos, rot.sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_rope_latent_matches_the_deepseek_torch_path(dtype, interleave):
    """mla_rope_latent_: q's rope part rotated in place and kv_a_proj's row made the cached row
    (RMSNorm of the latent, the rotated rope key) as models/deepseek.MLAttention does in torch,
    on a q that is a view of a wider projection; q's no-rope part is left alone."""
    from pdserve.engine.models.deepseek import DeepseekRotary
    from pdserve.engine.ops.triton_fused import mla_rope_latent_

    g = torch.Generator().manual_seed(3)
    T, H, nope, rope, rank = 5, 6, 16, 16, 40
    scaling = {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707}
    rotary = DeepseekRotary(rope, 256, 10000.0, scaling, interleave).to(DEV)
    norm = RMSNorm(rank, 1e-6).to(DEV, dtype)
    norm.weight.data = (1 + 0.2 * torch.randn(rank, generator=g)).to(DEV, dtype)
    q = torch.randn(T, H * (nope + rope) + 8, generator=g).to(DEV, dtype)[:, :H * (nope + rope)].view(T, H, -1)
    kv = torch.randn(T, rank + rope, generator=g).to(DEV, dtype)
    positions = torch.tensor([0, 3, 17, 100, 255], device=DEV)
    want_q = torch.cat((q[..., :nope], rotary(positions, q[..., nope:])), dim=-1)
    want_kv = torch.cat((norm(kv[:, :rank]), rotary(positions, kv[:, None, rank:])[:, 0]), dim=-1)
    mla_rope_latent_(q, kv, positions, rotary.cos, rotary.sin, norm.weight, norm.eps, interleave)
    close(q, want_q, dtype)
    close(kv, want_kv, dtype)
    with pytest.raises(ValueError, match="do not fit"):
        mla_rope_latent_(q, kv[:, :-1], positions, rotary.cos, rotary.sin, norm.weight, norm.eps, interleave)
