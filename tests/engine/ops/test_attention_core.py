"""The one attention core the decode and paged-prefill kernels share (ops/attention_core.py):
a decode row's output does not depend on the step it runs in, whichever kernel takes it;
one split planner; one launch check. On CUDA when present, else under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pdserve.engine.models.attention import AttentionMetadata, AttentionPlanner, PagedAttention  # noqa: E402
from pdserve.engine.ops.attention_core import MAX_SPLITS, split_count  # noqa: E402
from pdserve.engine.settings import AttentionTuning  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16


def step(layer, q, kc, vc, tables, seq_lens, query_lens, tuning):
    planner = AttentionPlanner(True, layer.num_heads // layer.num_kv_heads, layer.sliding_window is not None,
                               tuning=tuning)
    meta = AttentionMetadata.build(torch.full((q.shape[0],), -1), tables, seq_lens, query_lens, DEV, planner)
    return layer(q, None, None, kc, vc, meta), meta.plan


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_row_gives_identical_output_in_an_all_decode_step_and_in_a_mixed_step(dtype, window):
    """The decodes of a mixed step run in the paged-prefill kernel's tiles (a short chunk beside
    them) or apart in the decode kernel (a long one); every route gives the decode rows the
    same bits as the all-decode step: the same scores (fp32 scaling), softmax and key tiles
    (bf16 on CUDA, fp32 through the interpreter)."""
    if DEV == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter computes in fp32 whatever the dtype")
    H, KVH, D = 8, 2, 64
    decode_lens = [1, 17, 64, 65, 150, 300]  # contexts across one, two and five 64-key tiles
    chunk_ctx, chunk_len = 120, 24  # a prefill chunk over 96 cached tokens
    seq_lens = decode_lens + [chunk_ctx]
    width = -(-max(seq_lens) // PAGE)
    g = torch.Generator(device="cpu").manual_seed(7)
    num_blocks = len(seq_lens) * width + 1
    tables = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * width].view(len(seq_lens), width)
    tables = tables.to(torch.int32).to(DEV)
    kv = torch.randn(num_blocks, 2, PAGE, KVH, D, generator=g).to(dtype).to(DEV)
    kc, vc = kv[:, 0], kv[:, 1]
    nd = len(decode_lens)
    q = torch.randn(nd + chunk_len, H, D, generator=g).to(dtype).to(DEV)
    layer = PagedAttention(H, KVH, D, D ** -0.5, window, use_triton=True)

    alone, plan = step(layer, q[:nd].clone(), kc, vc, tables[:nd], decode_lens, [1] * nd, AttentionTuning())
    assert plan.decode_only
    for apart in (False, True):
        mixed, plan = step(layer, q.clone(), kc, vc, tables, seq_lens, [1] * nd + [chunk_len],
                           AttentionTuning(decodes_apart=apart))
        assert plan.apart == (nd if apart else 0)
        assert plan.tiles.seqs.shape[0] == len(seq_lens) - plan.apart  # built with the metadata, before a layer
        if DEV == "cuda" and dtype == torch.float32:
            # fp32 on CUDA: tl.dot's IEEE path sums in an order that follows the tile's shape (1 ulp)
            torch.testing.assert_close(mixed[:nd], alone, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(mixed[:nd], alone), (apart, (mixed[:nd].float() - alone.float()).abs().max().item())


def test_one_split_planner_for_every_kernel():
    """Pieces per sequence (decode) or tile (prefill) so that a launch has about `per_sm`
    programs per SM; 1 once `full_at` programs per SM are there; at least 256 keys a piece (the
    MLA kernel's: a tile, and never a second, partly filled wave)."""
    from pdserve.engine.ops.triton_mla import MLA_SPLITS

    assert split_count(512, 8192, sms=132, per_sm=2, full_at=1) == 1  # 64 decodes x 8 kv heads fill 132 SMs
    assert split_count(8, 8192, sms=132, per_sm=2, full_at=1) == MAX_SPLITS  # 33 wanted, capped
    assert split_count(32, 8192, sms=132, per_sm=2, full_at=1) == 9
    assert split_count(8, 1024, sms=132, per_sm=2, full_at=1) == 4  # at least 256 keys per split
    assert split_count(8, 100, sms=132, per_sm=2, full_at=1) == 1
    assert split_count(200, 8192, sms=132, per_sm=8) == 6  # prefill: 8 per SM wanted, not yet full
    assert split_count(8 * 132, 8192, sms=132, per_sm=8) == 1
    assert split_count(64, 8192, sms=132, min_keys=128, **MLA_SPLITS) == 2  # 132 / 64 rounded down
    assert split_count(1, 8192, sms=132, min_keys=128, **MLA_SPLITS) == MAX_SPLITS
    assert split_count(1, 1000, sms=132, min_keys=128, **MLA_SPLITS) == 7  # a tile of keys each at least
    assert split_count(132, 8192, sms=132, min_keys=128, **MLA_SPLITS) == 1
    assert split_count(100, 8192, sms=132, min_keys=128, **MLA_SPLITS) == 1  # a second wave would be partial


def test_one_launch_check_names_what_is_wrong():
    from pdserve.engine.ops.triton_attention import paged_decode_triton
    from pdserve.engine.ops.triton_prefill import PrefillPlan, paged_prefill_triton

    kv = torch.randn(4, 2, PAGE, 2, 32, device=DEV)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEV)
    lens = torch.ones(1, dtype=torch.int32, device=DEV)
    plan = PrefillPlan.build([1], [1], 2, DEV)
    bad = torch.randn(1, 3, 32, device=DEV)  # 3 heads over 2 kv heads
    for call in (lambda: paged_decode_triton(bad, kv[:, 0], kv[:, 1], tables, lens, 1.0),
                 lambda: paged_prefill_triton(bad, kv[:, 0], kv[:, 1], tables, plan, 1.0)):
        with pytest.raises(ValueError, match="GQA"):
            call()
    q = torch.randn(1, 4, 32, device=DEV)
    for call in (lambda: paged_decode_triton(q, kv[:, 0], kv[:, 1], tables.long(), lens, 1.0),
                 lambda: paged_prefill_triton(q, kv[:, 0], kv[:, 1], tables.long(), plan, 1.0)):
        with pytest.raises(ValueError, match="block_tables"):
            call()
    for call in (lambda: paged_decode_triton(q, kv[:, 0], kv[:, 1], tables, lens, 1.0, splits=MAX_SPLITS + 1),
                 lambda: paged_prefill_triton(q, kv[:, 0], kv[:, 1], tables, plan, 1.0, splits=0)):
        with pytest.raises(ValueError, match="splits must be in"):
            call()


@pytest.mark.parametrize("windowed", [False, True])
def test_the_plan_of_a_fresh_prompt_has_tiles_only_where_a_layer_has_a_window(windowed):
    """A fresh prompt alone runs torch's flash kernel in a layer without a sliding window; the
    plan builds the paged-prefill tiles before the first layer only for a model with a windowed
    layer (which takes the paged kernel), and a step of decodes only needs none."""
    from pdserve.engine.models.attention import AttentionMetadata, AttentionPlanner

    planner = AttentionPlanner(True, 4, windowed)
    tables = torch.zeros(1, 4, dtype=torch.int32, device=DEV)
    fresh = AttentionMetadata.build(torch.full((40,), -1), tables, [40], [40], DEV, planner).plan
    assert fresh.fresh and (fresh.tiles is not None) == windowed
    decodes = AttentionMetadata.build(torch.full((2,), -1), tables.expand(2, -1), [40, 9], [1, 1], DEV, planner).plan
    assert decodes.decode_only and decodes.tiles is None
    reference = AttentionMetadata.build(torch.full((40,), -1), tables, [40], [40], DEV).plan
    assert not reference.kernels and reference.tiles is None
