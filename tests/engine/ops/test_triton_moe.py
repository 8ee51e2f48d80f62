"""The fused-MoE Triton kernel against the torch reference (ops/moe_ref.py): the alignment of
assignments to expert blocks, and the two grouped GEMMs with the combine, on CUDA when present,
else on CPU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pdserve.engine.ops.moe_ref import fused_moe_ref, route  # noqa: E402
from pdserve.engine.ops.triton_moe import MoETiles, align, fused_moe_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_puts_every_assignment_once_in_a_block_of_its_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3], [3, 0]], device=DEV)  # 5 tokens, top-2 of 4
    al = align(ids, 4, block_m=4)
    rows = al.rows.tolist()
    m = ids.numel()
    assert sorted(r for r in rows if r < m) == list(range(m))
    flat = ids.flatten().tolist()
    for b, e in enumerate(al.experts.tolist()[: int(al.used) // 4]):
        block = [r for r in rows[4 * b: 4 * b + 4] if r < m]
        assert block and all(flat[r] == e for r in block), (b, e, block)
    # expert 0: 3 rows, 1: 1, 2: 1, 3: 5 -> 1 + 1 + 1 + 2 blocks of 4
    assert int(al.used) == 20 and al.rows.shape[0] == (-(-m // 4) + 4) * 4
    assert al.experts.tolist()[:5] == [0, 1, 2, 3, 3]


@pytest.mark.parametrize("T,E,k,H,inter", [(1, 8, 2, 64, 32), (5, 4, 2, 32, 48), (37, 16, 4, 64, 96),
                                           (130, 8, 2, 128, 64), (300, 8, 4, 32, 16)])  # 1200 assignments: placed apart
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_the_reference(T, E, k, H, inter, dtype):
    if DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter computes in fp32")
    g = torch.Generator().manual_seed(T * 100 + E)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEV)
    w1 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).to(dtype).to(DEV)
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(dtype).to(DEV)
    logits = torch.randn(T, E, generator=g).to(DEV)
    weights, ids = route(logits, k, renormalize=True, out_dtype=dtype)
    ref = fused_moe_ref(x, w1, w2, weights, ids)
    for tiles in (None, MoETiles(16, 32, 32, 4, 2), MoETiles(64, 64, 64, 4, 2)):
        out = fused_moe_triton(x, w1, w2, weights, ids, tiles)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("T,E,k,ranks", [(1, 8, 2, 2), (37, 16, 4, 4), (300, 8, 4, 2)])  # 1200: placed apart
def test_each_rank_runs_only_its_experts_and_the_ranks_sum_to_all_of_them(T, E, k, ranks):
    """Expert parallelism: a rank holds E / N experts whole; ids of the others' (local_ids: the
    sentinel E / N) are skipped, never computed and read as zero. Each rank's kernel output equals
    the reference over its experts, and the ranks' outputs sum to every expert's (what the layer's
    all-reduce does)."""
    from pdserve.engine.ops.moe_ref import local_ids, moe_ref
    from pdserve.engine.ops.triton_moe import moe_triton

    g = torch.Generator().manual_seed(T + E)
    H, inter = 32, 48
    x = torch.randn(T, H, generator=g).to(DEV)
    w1 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).to(DEV)
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(DEV)
    logits = torch.randn(T, E, generator=g).to(DEV)
    weights, ids = route(logits, k, renormalize=True, out_dtype=torch.float32)
    whole = fused_moe_ref(x, w1, w2, weights, ids)
    per, total = E // ranks, torch.zeros_like(whole)
    for r in range(ranks):
        held = (r * per, per)
        local = local_ids(ids, held)
        assert ((local == per) == ((ids < r * per) | (ids >= (r + 1) * per))).all()
        mine = slice(r * per, (r + 1) * per)
        ref = fused_moe_ref(x, w1[mine], w2[mine], weights, local)
        out = fused_moe_triton(x, w1[mine].contiguous(), w2[mine].contiguous(), weights, local, skip=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        from_logits = moe_triton(x, logits, w1[mine].contiguous(), w2[mine].contiguous(), k, True, torch.float32,
                                 held=held)
        torch.testing.assert_close(from_logits, moe_ref(x, logits, w1[mine], w2[mine], k, True, torch.float32,
                                                        held=held), rtol=1e-5, atol=1e-5)
        total += out
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_fused_moe_refuses_shapes_that_do_not_fit():
    x = torch.randn(3, 32, device=DEV)
    w1, w2 = torch.randn(4, 64, 32, device=DEV), torch.randn(4, 32, 16, device=DEV)  # down's I is not 32
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="experts do not fit"):
        fused_moe_triton(x, w1, w2, torch.ones(3, 2, device=DEV), ids)
    with pytest.raises(ValueError, match="must both be"):
        fused_moe_triton(x, w1, torch.randn(4, 32, 32, device=DEV), torch.ones(3, 1, device=DEV), ids)


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_in_one_launch_matches_the_reference_and_ranks_each_expert(renormalize):
    """route_triton: the reference's experts and weights (highest first), and ranks that number
    each expert's assignments 0..count-1; moe_triton from logits equals the reference path."""
    from pdserve.engine.ops.moe_ref import moe_ref
    from pdserve.engine.ops.triton_moe import moe_triton
    from pdserve.engine.ops.triton_moe_route import route_triton

    g = torch.Generator().manual_seed(5)
    T, E, k, H, inter = 23, 12, 3, 32, 16
    logits = torch.randn(T, E, generator=g).to(DEV)
    weights, ids, (counts, rank) = route_triton(logits, k, renormalize, torch.float32)
    ref_w, ref_ids = route(logits, k, renormalize, torch.float32)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    assert counts.tolist() == torch.bincount(ref_ids.flatten(), minlength=E).tolist()
    for e in range(E):
        assert sorted(rank[ids.flatten() == e].tolist()) == list(range(int(counts[e])))
    x = torch.randn(T, H, generator=g).to(DEV)
    w1 = torch.randn(E, 2 * inter, H, generator=g).to(DEV) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g).to(DEV) / inter ** 0.5
    torch.testing.assert_close(moe_triton(x, logits, w1, w2, k, renormalize, torch.float32),
                               moe_ref(x, logits, w1, w2, k, renormalize, torch.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("routing", ["softmax", "softmax_group", "sigmoid_group"])
def test_deepseek_routing_in_one_launch_matches_route_grouped(routing):
    """route_triton with a MoEConfig: DeepSeek's router (V2's greedy and group-limited softmax,
    V3's sigmoid + correction bias over the two best of each group, renormalized) picks
    route_grouped's experts with its scaled weights; the groups not kept get none."""
    from pdserve.engine.architectures import MoEConfig
    from pdserve.engine.ops.moe_ref import route_grouped
    from pdserve.engine.ops.triton_moe_route import route_triton

    g = torch.Generator().manual_seed(11)
    T, E, k = 29, 16, 3
    common = dict(num_experts=E, top_k=k, intermediate_size=8, norm_topk_prob=True, layers=(True,),
                  weights_in_model_dtype=False)
    moe = MoEConfig(**common, routing=routing,
                    n_group=1 if routing == "softmax" else 4, topk_group=1 if routing == "softmax" else 2,
                    routed_scaling_factor=2.5)
    logits = torch.randn(T, E, generator=g).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.5).to(DEV) if routing == "sigmoid_group" else None
    renorm = routing == "sigmoid_group"
    weights, ids, (counts, _) = route_triton(logits, k, renorm, torch.float32, moe, bias)
    ref_w, ref_ids = route_grouped(logits, moe, bias)
    order = ref_ids.sort(dim=1)
    mine = ids.long().sort(dim=1)
    assert torch.equal(mine.values, order.values)  # the same experts (the reference's order is unsorted)
    torch.testing.assert_close(weights.gather(1, mine.indices), ref_w.gather(1, order.indices), rtol=1e-5, atol=1e-6)
    assert counts.tolist() == torch.bincount(ref_ids.flatten(), minlength=E).tolist()
    if routing != "softmax":  # every token's experts come from at most topk_group groups
        assert max(len(set((ids[t] // (E // 4)).tolist())) for t in range(T)) <= 2
    with pytest.raises(ValueError, match="correction bias"):
        route_triton(logits, k, renorm, torch.float32, MoEConfig(**common, routing="sigmoid_group", n_group=4,
                                                                   topk_group=2))


def fp8_experts(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] -> (e4m3 values, float32 scale per block): each block's amax maps to 448."""
    br, bc = block
    E, rows, cols = w.shape
    t = torch.nn.functional.pad(w.float(), (0, -cols % bc, 0, -rows % br))
    t = t.view(E, t.shape[1] // br, br, t.shape[2] // bc, bc)
    s = t.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    q = (t / s[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(E, -1, t.shape[3] * bc)
    return q[:, :rows, :cols].contiguous(), s


@pytest.mark.parametrize("T,E,k,H,inter,block", [(1, 8, 2, 64, 32, (16, 32)), (3, 8, 2, 96, 64, (32, 32)),
                                                 (37, 16, 4, 64, 96, (32, 16)), (130, 8, 2, 128, 64, (64, 64))])
def test_fp8_experts_equal_the_reference_over_their_dequantized_weights(T, E, k, H, inter, block):
    """FP8 experts (e4m3 weights, a float32 scale per block, converted and scaled in the kernel):
    the grouped path and the decode path's equal the torch reference over the dequantized weights,
    whatever the tiles (each held to a block); a scale shape that does not fit is refused."""
    from pdserve.engine.fp8 import dequantize
    from pdserve.engine.ops.triton_moe import Fp8Experts
    from pdserve.engine.ops.triton_moe_decode import DECODE_TOKENS, DecodeTiles, moe_decode_triton
    from pdserve.engine.ops.triton_moe_route import Routing

    g = torch.Generator().manual_seed(T + E + H)
    x = torch.randn(T, H, generator=g).to(DEV)
    (q1, s1), (q2, s2) = fp8_experts(torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5, block), \
        fp8_experts(torch.randn(E, H, inter, generator=g) / inter ** 0.5, block)
    q1, s1, q2, s2 = q1.to(DEV), s1.to(DEV), q2.to(DEV), s2.to(DEV)
    fp8 = Fp8Experts(s1, s2, block)
    router = torch.randn(E, H, generator=g).to(DEV)
    weights, ids = route(x @ router.t(), k, renormalize=True, out_dtype=torch.float32)
    ref = fused_moe_ref(x, dequantize(q1, s1, block, torch.float32), dequantize(q2, s2, block, torch.float32),
                        weights, ids)
    for tiles in (None, MoETiles(16, 32, 32, 4, 2), MoETiles(32, 64, 64, 4, 2)):
        out = fused_moe_triton(x, q1, q2, weights, ids, tiles, fp8=fp8)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)  # the scale applied per K step
    if T <= DECODE_TOKENS:  # the decode path: GEMVs (FP8's default) and the tiled GEMMs
        arrivals = torch.zeros(DECODE_TOKENS, dtype=torch.int32, device=DEV)
        for tiles in (DecodeTiles(), DecodeTiles(experts=MoETiles(16, 32, 32, 2, 2))):
            out = moe_decode_triton(x, router, q1, q2, Routing.of(E, k, True), torch.float32, arrivals, tiles=tiles,
                                    fp8=fp8)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit blocks"):
        fused_moe_triton(x, q1, q2, weights, ids, fp8=Fp8Experts(s1[:, 1:], s2, block))


def fused_moe_w8a8_ref(x, q1, s1, q2, s2, block, weights, ids):
    """W8A8's arithmetic in torch, float32: x and each assignment's SiLU(gate) x up quantized per
    (row, block[1] columns) to e4m3 (quantize_groups_ref), over the dequantized weights."""
    from pdserve.engine.fp8 import dequantize
    from pdserve.engine.ops.triton_fp8 import dequantize_groups, quantize_groups_ref

    bk = block[1]

    def through_e4m3(t):
        return dequantize_groups(*quantize_groups_ref(t, bk), bk)

    w1, w2 = dequantize(q1, s1, block, torch.float32), dequantize(q2, s2, block, torch.float32)
    xd, out = through_e4m3(x.float()), torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        gate, up = torch.nn.functional.linear(xd[tok], w1[e]).chunk(2, dim=-1)
        h = through_e4m3(torch.nn.functional.silu(gate) * up)
        out.index_add_(0, tok, torch.nn.functional.linear(h, w2[e]) * weights[tok, slot, None].float())
    return out.to(x.dtype)


@pytest.mark.parametrize("T,H,block,dtype", [(70, 128, (32, 32), torch.float32), (3, 96, (32, 16), torch.float32),
                                             (40, 128, (64, 32), torch.bfloat16)])
def test_fp8_experts_past_a8_rows_quantize_their_activations_as_deepseek_v3_does(T, H, block, dtype):
    """Past `a8_rows` assignments the experts run W8A8: x and h quantized per (row, 128) group, one
    FP8 dot a K step; the kernels equal that arithmetic in torch, and differ from the unquantized
    activations' result by what the quantization costs (a few percent), no more."""
    from pdserve.engine.fp8 import dequantize
    from pdserve.engine.ops.triton_moe import A8_ROWS, Fp8Experts

    E, k, inter = 8, 2, 64
    g = torch.Generator().manual_seed(T + H)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    (q1, s1), (q2, s2) = fp8_experts(torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5, block), \
        fp8_experts(torch.randn(E, H, inter, generator=g) / inter ** 0.5, block)
    q1, s1, q2, s2 = q1.to(DEV), s1.to(DEV), q2.to(DEV), s2.to(DEV)
    weights, ids = route(torch.randn(T, E, generator=g).to(DEV), k, renormalize=True, out_dtype=torch.float32)
    a8 = Fp8Experts(s1, s2, block, a8_rows=0)
    assert a8.quantizes(1) and not Fp8Experts(s1, s2, block).quantizes(1 << 20)  # W8A16 unless asked
    assert Fp8Experts(s1, s2, block, A8_ROWS).quantizes(A8_ROWS + 1)
    assert not Fp8Experts(s1, s2, (16, 32), a8_rows=0).quantizes(1)  # a block wider than tall: W8A16
    ref = fused_moe_w8a8_ref(x, q1, s1, q2, s2, block, weights, ids).float()
    exact = fused_moe_ref(x.float(), dequantize(q1, s1, block, torch.float32), dequantize(q2, s2, block, torch.float32),
                          weights, ids)

    def err(a, b):
        return ((a - b).norm() / b.norm()).item()

    for tiles in (None, MoETiles(16, 64, 64, 4, 2)):
        out = fused_moe_triton(x, q1, q2, weights, ids, tiles, fp8=a8).float()
        # the same products summed in another order; an h value on an e4m3 rounding edge may round
        # the other way (one e4m3 step), and bf16 rounds x, h's inputs and the output
        assert err(out, ref) < (2e-3 if dtype == torch.float32 else 1.5e-2), err(out, ref)
        assert 2e-3 < err(ref, exact) < 0.08 and err(out, exact) < 0.08
    if dtype == torch.float32:  # (the interpreter's e4m3 -> bf16 cast, which W8A16 makes, is not exact)
        w8a16 = fused_moe_triton(x, q1, q2, weights, ids, fp8=Fp8Experts(s1, s2, block)).float()
        assert err(w8a16, exact) < 1e-5
