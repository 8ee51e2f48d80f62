"""The CUDA graphs' layouts on CPU (exec/graphs.py, without capturing): every step takes the one
path decision, mixed and prefill steps run as the model's pieces over padded static buffers
with attention between, all-decode steps as padded decode rows; greedy output equals the
plain eager run's token for token, with chunked prefill, prefix hits and a sliding window."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.exec.graphs import piece_buckets
from pdserve.engine.settings import AttentionTuning

from helpers import PROMPTS


def test_piece_buckets_pad_by_at_most_an_eighth():
    b = piece_buckets(2048)  # cuda_graph_max_tokens caps what the runner asks for
    assert b[:9] == [16, 32, 48, 64, 80, 96, 112, 128, 144]
    assert b[-1] == 2048 and 1152 in b and 1088 not in b
    for lo, hi in zip(b, b[1:]):
        assert hi - lo <= max(16, lo // 8 + 1)
    assert piece_buckets(40) == [16, 32, 40]


@pytest.mark.parametrize("model,backend,fused,apart", [("llama", "torch", False, False),
                                                       ("mistral", "triton", True, False),
                                                       ("mistral", "triton", True, True)])
@pytest.mark.slow
def test_graph_layouts_equal_eager(model, backend, fused, apart, tiny_models):
    """apart: a mixed step's decode rows through the paged-decode kernel, the chunks through
    paged-prefill (else one paged-prefill launch over every sequence)."""
    if backend == "triton":
        pytest.importorskip("triton")
    shared = "The history of the city begins with a small village by the river, and then "
    prompts = [shared + p for p in PROMPTS[:3]] + [PROMPTS[3]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # a 24-token step budget: prompts arrive in chunks beside decodes (mixed steps), the shared
    # prefix is a cache hit for the later ones (chunks over cached context)
    kw = dict(model=tiny_models[model], max_model_len=256, attention_backend=backend, fused_ops=fused,
              max_num_batched_tokens=24, max_num_seqs=4, attention_tuning=AttentionTuning(decodes_apart=apart))
    with LLM(**kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    with LLM(**kw) as llm:
        runner, seen = llm.engine.runner, []
        runner.use_graph_layouts()
        assert runner.graphs.piece_sizes == [16, 24]
        pieces, decode = runner.graphs.run_pieces, runner.graphs.run_decode
        runner.graphs.run_pieces = lambda inp, *a: seen.append(("pieces", len(inp.ids), inp.padded,
                                                                len(inp.query_lens))) or pieces(inp, *a)
        runner.graphs.run_decode = lambda inp, *a: seen.append(("decode", inp.num_rows, inp.cols.shape[1], 0)) \
            or decode(inp, *a)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        assert llm.engine.kv.prefix_hits > 0
        llm.engine.kv.check_all_free()
    assert got == want
    mixed = [s for s in seen if s[0] == "pieces" and s[3] > 1]
    assert mixed and any(n < padded for _, n, padded, _ in seen), seen  # mixed steps; padding rows
    assert any(s[0] == "decode" for s in seen)


@pytest.mark.slow
def test_warm_up_runs_the_eager_steps_and_writes_nothing(tiny_models):
    """ModelRunner.warm_up (run on CUDA before serving, so no served step waits on a Triton
    compile): on CPU, through Triton's interpreter, every attention variant and the eager steps
    of 2 decodes beside a chunk and a chunk alone, with and without a factor of 16 in their
    token counts, run over block 0; the KV cache is as it was and generation is unchanged."""
    pytest.importorskip("triton")
    kw = dict(model=tiny_models["mistral"], max_model_len=256, attention_backend="triton", fused_ops=True,
              max_num_batched_tokens=64, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(**kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], sp)]
        runner, steps = llm.engine.runner, []
        runner.use_graph_layouts()  # the smallest eager step: past the largest piece bucket (64)
        runner.graphs.piece_sizes = [16, 32]
        runner.graphs.max_piece_tokens = 32
        forward = runner.forward
        runner.forward = lambda inp: steps.append((inp.path, list(inp.query_lens))) or forward(inp)
        before = runner.kv.clone()
        runner.warm_up()
        assert torch.equal(runner.kv, before)
        assert steps == [("eager", [1, 1, 46]), ("eager", [48]), ("eager", [1, 1, 47]), ("eager", [49])], steps
        runner.forward = forward
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], sp)] == want
        llm.engine.kv.check_all_free()
