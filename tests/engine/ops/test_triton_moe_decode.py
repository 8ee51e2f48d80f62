"""The decode path's mixture-of-experts (ops/triton_moe_decode.py: the router with routing in one
launch, each assignment its own block of the experts' GEMMs) against the torch reference, on CUDA when
present, else on CPU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pdserve.engine.architectures import MoEConfig  # noqa: E402
from pdserve.engine.ops.moe_ref import fused_moe_ref, local_ids, moe_ref, route_grouped  # noqa: E402
from pdserve.engine.ops.triton_moe import MoETiles  # noqa: E402
from pdserve.engine.ops.triton_moe_decode import DecodeTiles, GemvTiles, moe_decode_triton  # noqa: E402
from pdserve.engine.ops.triton_moe_route import Routing  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(g, E, H, inter, dtype=torch.float32):
    w1 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).to(dtype).to(DEV)
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(dtype).to(DEV)
    return w1, w2


@pytest.mark.parametrize("T,E,k,H,inter,renorm", [(1, 8, 2, 64, 32, True), (3, 16, 4, 96, 48, False),
                                                  (4, 12, 3, 40, 24, True)])
def test_decode_path_equals_the_reference_from_the_router_weight(T, E, k, H, inter, renorm):
    """Logits from the router weight, the top-k, both GEMMs (tiled, or GEMVs) and the combine: the
    reference's output (ops/moe_ref.moe_ref on F.linear's logits), for tiles that split every
    dimension unevenly; the per-token counters are zero again afterwards (a graph replays the launch)."""
    g = torch.Generator().manual_seed(T * 31 + E)
    x = torch.randn(T, H, generator=g).to(DEV)
    router = torch.randn(E, H, generator=g).to(DEV) / H ** 0.5
    w1, w2 = _weights(g, E, H, inter)
    ref = moe_ref(x, F.linear(x, router), w1, w2, k, renorm, torch.float32)
    arrivals = torch.zeros(4, dtype=torch.int32, device=DEV)
    for tiles in (DecodeTiles(), DecodeTiles(block_e=2, block_k=32, warps=2, experts=MoETiles(16, 16, 16, 2, 1)),
                  DecodeTiles(gemv=GemvTiles(256, 32, 2))):  # the experts as GEMVs, rows and K split unevenly
        out = moe_decode_triton(x, router, w1, w2, Routing.of(E, k, renorm), torch.float32, arrivals, tiles=tiles)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert arrivals.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_adds_only_its_experts_and_the_ranks_sum_to_all(ranks):
    """Expert parallel: a rank holding E / N experts routes over all of them and adds only its
    own; the ranks' outputs sum to one rank's with every expert (the layer's all-reduce)."""
    g = torch.Generator().manual_seed(ranks)
    T, E, k, H, inter = 3, 16, 4, 64, 32
    x = torch.randn(T, H, generator=g).to(DEV)
    router = torch.randn(E, H, generator=g).to(DEV) / H ** 0.5
    w1, w2 = _weights(g, E, H, inter)
    routing = Routing.of(E, k, True)
    arrivals = torch.zeros(4, dtype=torch.int32, device=DEV)
    whole = moe_decode_triton(x, router, w1, w2, routing, torch.float32, arrivals)
    total = torch.zeros_like(x)
    count = E // ranks
    for r in range(ranks):
        mine = slice(r * count, (r + 1) * count)
        part = moe_decode_triton(x, router, w1[mine].contiguous(), w2[mine].contiguous(), routing, torch.float32,
                                 arrivals, held=(r * count, count))
        weights, ids = torch.topk(torch.softmax(F.linear(x, router), -1), k)
        weights = weights / weights.sum(-1, keepdim=True)
        expect = fused_moe_ref(x, w1[mine], w2[mine], weights, local_ids(ids, (r * count, count)))
        torch.testing.assert_close(part, expect, rtol=1e-5, atol=1e-5)
        total += part
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("routing", ["softmax_group", "sigmoid_group"])
def test_deepseek_routing_in_the_decode_router(routing):
    """DeepSeek's router (float32 weight; V2's group-limited softmax, V3's sigmoid with the
    correction bias) through the decode path equals route_grouped and the reference experts."""
    g = torch.Generator().manual_seed(11)
    T, E, k, H, inter = 2, 16, 4, 48, 32
    moe = MoEConfig(num_experts=E, top_k=k, intermediate_size=inter, norm_topk_prob=True, layers=(True,),
                    weights_in_model_dtype=False, routing=routing,
                    n_group=4, topk_group=2, routed_scaling_factor=2.5)
    x = torch.randn(T, H, generator=g).to(DEV)
    router = torch.randn(E, H, generator=g).to(DEV) / H ** 0.5
    bias = torch.randn(E, generator=g).to(DEV) * 0.1 if routing == "sigmoid_group" else None
    w1, w2 = _weights(g, E, H, inter)
    weights, ids = route_grouped(F.linear(x, router), moe, bias)
    renorm = routing == "sigmoid_group"
    out = moe_decode_triton(x, router, w1, w2, Routing.of(E, k, renorm, moe, bias), torch.float32,
                            torch.zeros(4, dtype=torch.int32, device=DEV), correction_bias=bias)
    torch.testing.assert_close(out, fused_moe_ref(x, w1, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_shapes_that_do_not_fit_are_refused():
    x = torch.randn(2, 32, device=DEV)
    w1, w2 = _weights(torch.Generator().manual_seed(0), 4, 32, 16)
    with pytest.raises(ValueError, match="arrivals 1"):
        moe_decode_triton(x, torch.randn(4, 32, device=DEV), w1, w2, Routing.of(4, 2, True), torch.float32,
                          torch.zeros(1, dtype=torch.int32, device=DEV))
