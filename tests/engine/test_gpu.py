"""GPU: the engine in bf16 (Triton kernels) against Hugging Face in bf16 on the tiny
configs. Skipped without CUDA. bf16 rounding differs between the two implementations
(fused projections, paged attention's accumulation order), so greedy paths of random
models may part after a near-tie; the test reports the agreement and bounds it."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _hf_bf16(model_dir, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                               pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_engine_bf16_agrees_with_hf(name, tiny_models):
    from transformers import AutoTokenizer

    from pdserve import LLM, SamplingParams

    from helpers import PROMPTS

    path = tiny_models[name]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    llm = LLM(path, dtype="bfloat16", gpu_memory_utilization=0.3)
    assert llm.engine.config.use_triton
    ours = [o.outputs[0].token_ids for o in
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))]
    ref = _hf_bf16(path, prompts, 32)
    same = sum(a == b for o, r in zip(ours, ref) for a, b in zip(o, r))
    prefix = sum(next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o)) for o, r in zip(ours, ref))
    total = sum(len(r) for r in ref)
    first = sum(o[0] == r[0] for o, r in zip(ours, ref)) / len(ref)
    print(f"\n{name}: tokens equal {same / total:.1%}, common prefix {prefix / total:.1%}, first {first:.0%}")
    assert first >= 0.75 and prefix / total >= 0.4
    llm.engine.kv.check_all_free()
    del llm  # free this engine's KV cache before the next one sizes itself
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_cuda_graph_decode_equals_eager(tiny_models, kv):
    """int4: the packed store and the tile loader's unpack inside the captured graphs."""
    from pdserve import LLM, SamplingParams

    prompts = [f"Request {i}: tell me about the number {i * 7}" for i in range(13)]  # pads to 16
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    model = tiny_models["llama_hd32" if kv == "int4" else "llama"]
    for eager in (False, True):
        llm = LLM(model, dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=eager, kv_cache_dtype=kv)
        assert bool(llm.engine.runner.graphs) != eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        llm.engine.kv.check_all_free()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]


def test_a_window_past_its_evictions_in_graphs_equals_eager(tiny_models):
    """kv_window_tokens (base/kv_window.py): decode graphs read cache positions and the rotated keys;
    a 150-token prompt and 200 new tokens on a 64-token window give eager's tokens."""
    from pdserve import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM(tiny_models["llama"], dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=eager,
                  max_model_len=256, max_num_batched_tokens=32, kv_window_tokens=64, kv_sink_tokens=4)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate([list(range(300, 450))] * 3, sp)]
        llm.engine.kv.check_all_free()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]


def test_h2o_scores_from_the_decode_kernel_equal_the_cpu_reference_and_evict_alike(tiny_models):
    """kv_evict h2o on CUDA (float32): decodes score blocks in the paged-decode kernel, chunks in the
    torch reference; the per-block scores equal the CPU engine's (reference only) with no eviction,
    and past a 64-token budget the same blocks go and the same tokens come."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    def run(device: str, budget: int):
        eng = LLMEngine(EngineConfig(model=tiny_models["llama"], dtype="float32", device=device, max_model_len=512,
                                     max_num_batched_tokens=32, kv_window_tokens=budget, kv_sink_tokens=4,
                                     kv_evict="h2o", gpu_memory_utilization=0.3))
        req = eng.add_request(list(range(300, 450)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), "h")
        while eng.has_unfinished_requests():
            eng.step()
        eng.kv.check_all_free()
        return req

    for budget in (192, 64):
        gpu, cpu = run("cuda", budget), run("cpu", budget)
        assert gpu.output_token_ids == cpu.output_token_ids and gpu.kv_shift == cpu.kv_shift
        assert np.allclose(gpu.kv_scores, cpu.kv_scores, rtol=1e-3, atol=1e-3)
    assert gpu.kv_shift > 0


def test_piecewise_graphs_for_mixed_steps_equal_eager(tiny_models):
    """Mixed steps (prefill chunks beside decodes, chunks over cached prefixes) replay the
    piecewise graphs of their token bucket with attention between; float32 output equals the
    eager run's token for token."""
    from pdserve import LLM, SamplingParams

    shared = "The history of the city begins with a small village by the river, and then "
    prompts = [shared + f"request {i} asks about the number {i * 7}" for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", gpu_memory_utilization=0.3, max_num_batched_tokens=48, max_num_seqs=8)
    outs, seen = {}, []
    for eager in (True, False):
        llm = LLM(tiny_models["llama"], enforce_eager=eager, **kw)
        if not eager:
            graphs = llm.engine.runner.graphs
            assert sorted(graphs.pieces) == graphs.piece_sizes == [16, 32, 48]
            real = graphs.run_pieces
            graphs.run_pieces = lambda inp, *a, real=real: seen.append((len(inp.ids), len(inp.query_lens))) \
                or real(inp, *a)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        llm.engine.kv.check_all_free()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]
    assert any(q > 1 for _, q in seen), seen  # steps of several sequences through the pieces


def test_fused_ops_decode_equals_unfused(tiny_models):
    """The fused Triton RMSNorm / rope / SiLU kernels round each step like the torch path,
    but the norm's fp32 sum order and the GPU's exp / rsqrt differ in the last fp32 bits,
    which flip a bf16 rounding now and then; on a tiny random model's near-tied logits the
    greedy paths then part. Bounded like the engine against HF in bf16 (above). The fp32
    CPU test (tests/engine/test_correctness_hf.py) checks the fused math token for token."""
    from pdserve import LLM, SamplingParams

    prompts = [f"Request {i}: tell me about the number {i * 7}" for i in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for fused in (False, True):
        llm = LLM(tiny_models["llama"], dtype="bfloat16", gpu_memory_utilization=0.3, fused_ops=fused)
        assert llm.engine.runner.model.fused == fused
        outs[fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    a, b = outs[True], outs[False]
    first = sum(x[0] == y[0] for x, y in zip(a, b)) / len(b)  # first tokens: the prefill path
    prefix = sum(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b))
    prefix /= sum(len(y) for y in b)
    print(f"\nfused vs unfused: first tokens equal {first:.0%}, common prefix {prefix:.1%}")
    assert first >= 0.75 and prefix >= 0.4


def test_speculative_verification_replays_the_decode_graphs(tiny_models):
    """Drafts (the plain run's own continuation, every third token corrupted) verified through
    the captured decode graphs (a row per query token): output equals plain decoding's, the
    kept drafts are accepted, the cost table covers the verification rows, nothing leaks."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.spec.switch import SpecSwitch

    prompts = [f"Request {i}: tell me about the number {i * 7}" for i in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=8)
    llm = LLM(tiny_models["llama"], **kw)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}
    llm = LLM(tiny_models["llama"], **kw, speculative_config=spec)
    runner, replays = llm.engine.runner, []
    assert max(runner.graphs.decode) == 40 and sorted(llm.engine.step_model.graphs) == sorted(runner.graphs.decode)
    real = runner.graphs.run_decode
    runner.graphs.run_decode = lambda inp, *a: replays.append(inp.num_rows) or real(inp, *a)
    cont = {tuple(llm.engine.tokenizer.encode(p)): w for p, w in zip(prompts, want)}
    llm.engine.drafter.proposer = lambda req, room: [
        t if (req.num_output_tokens + j) % 3 else 0
        for j, t in enumerate(cont[tuple(req.prompt_token_ids)][req.num_output_tokens:][:room])]
    llm.engine.drafter.switch = SpecSwitch()  # always speculate (the off-switch is tested on CPU)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    st = llm.engine.stats().as_dict()
    assert st["spec_decode_acceptance_rate"] > 0.3 and max(replays) > len(prompts), (st, replays)
    llm.engine.kv.check_all_free()


def test_chunks_over_cached_context_through_the_paged_prefill_kernel_equal_the_reference_path(tiny_models):
    """Prefix hits and small chunks send prompts through the Triton paged prefill kernel; float32
    greedy tokens equal those of the torch path it replaced (gather, mask, SDPA)."""
    from pdserve import LLM, SamplingParams

    shared = list(range(100, 180))  # 5 full blocks both prompts share
    prompts = [shared + [7, 8, 9], shared + list(range(300, 340)), shared[:40] + [11] * 3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for path in ("paged", "reference"):
        llm = LLM(tiny_models["llama"], dtype="float32", gpu_memory_utilization=0.3, max_num_batched_tokens=32)
        if path == "reference":
            for m in llm.engine.runner.model.modules():
                if hasattr(m, "attn") and hasattr(m.attn, "_prefill"):
                    m.attn._prefill = None
        outs[path] = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]  # caches the prefix
        outs[path] += [o.outputs[0].token_ids for o in llm.generate(prompts[1:], params)]  # hits it, in chunks
        assert llm.engine.stats().cache.prefix_hits >= 80
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs["paged"] == outs["reference"]


def test_seeded_sampling_is_the_same_across_the_handoff_on_cuda(tiny_models):
    """On CUDA too a seeded, sampled request gives the colocated engine's tokens when one
    engine prefills it and another decodes it (loopback KV copy): the noise's bits are the
    CPU's (sample/sampling_noise.py), and each request runs alone so both sides see equal logits."""
    from pdserve import LLM, SamplingParams
    from pdserve.decode.role import DecodeRole
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.role import Emitted, Reserved
    from pdserve.prefill.role import PrefillRole
    from pdserve.transfer.loopback import LoopbackConnector, LoopbackHub

    from helpers import valid

    path = tiny_models["llama"]
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=24, seed=7, ignore_eos=True)
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]
    # three engines in one process: a fixed KV budget each (a utilization counts the others'
    # memory as taken: the third found none left on an 80 GB GPU)
    kw = dict(model=path, dtype="bfloat16", kv_cache_memory_bytes=256 << 20)
    llm = LLM(**kw)
    want = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]  # one at a time
    del llm
    hub = LoopbackHub()
    pe, de = LLMEngine(EngineConfig(**kw)), LLMEngine(EngineConfig(**kw))
    pw = PrefillRole(pe, LoopbackConnector("prefill-0", pe.runner.kv, hub))
    dw = DecodeRole(de, LoopbackConnector("decode-0", de.runner.kv, hub))
    got = []
    for i, ids in enumerate(prompts):
        pw.add(f"r{i}", valid(pw.engine, ids, sp), "decode-0")
        dw.add(f"r{i}", valid(dw.engine, ids, sp), "prefill-0")
        final = None
        while pw.num_inflight or dw.num_inflight:
            for ev in pw.step() + dw.step():
                if isinstance(ev, Reserved):
                    pw.target(ev.request_id, ev.target)
                elif isinstance(ev, Emitted) and ev.output.finished:
                    final = ev.output
        got.append(final.outputs[0].token_ids)
    assert got == want
    assert len({tuple(t) for t in want}) == 4
    for e in (pe, de):
        e.kv.check_all_free()
    del pw, dw, pe, de
    gc.collect()
    torch.cuda.empty_cache()


def test_overlapped_steps_equal_steps_in_turn_with_cuda_graphs(tiny_models):
    """engine/core/overlap.py on CUDA: the pending ids patched into the graphs' buffers on the
    device, the sampled ids copied back behind the next step; greedy and seeded requests of
    different lengths (no EOS: the batches' shapes match step for step) give the same tokens."""
    from pdserve import LLM, SamplingParams

    from helpers import PROMPTS

    sps = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=8 + 5 * i, ignore_eos=True)
           for i in range(8)]
    outs = {}
    for overlap in (False, True):
        llm = LLM(tiny_models["llama"], dtype="bfloat16", gpu_memory_utilization=0.3, async_scheduling=overlap)
        assert llm.engine.runner.graphs is not None and llm.engine.overlaps == overlap
        outs[overlap] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:8], sps)]
        llm.engine.kv.check_all_free()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]


def test_a_moe_model_in_cuda_graphs_equals_eager_and_its_torch_experts(tmp_path, request):
    """Qwen3-MoE in float32: the fused-MoE kernel inside the decode and piecewise graphs gives eager's
    tokens, at 13 sequences and at 3 (the few-token decode path, ops/triton_moe_decode.py), and the
    experts' torch path (eager) agrees on most. In bf16 a padded graph batch can
    round a router logit differently (cuBLAS picks its kernel by the rows), and one ulp there
    picks another expert: routing is discrete, so the comparison runs in float32."""
    from pdserve import LLM, SamplingParams

    from helpers import save_hf

    tok_dir = os.environ.get("PDSERVE_TEST_TOKENIZER") or request.getfixturevalue("default_model_dir")
    save_hf("qwen3_moe", dict(vocab_size=49152, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, initializer_range=0.15,
                              max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2),
            str(tmp_path), tok_dir)
    prompts = [[(31 * i + 7 * j) % 40000 + 100 for i in range(20 + 9 * j)] for j in range(13)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for name, kw in (("graphs", {}), ("eager", dict(enforce_eager=True)),
                     ("torch", dict(enforce_eager=True, attention_backend="torch"))):
        llm = LLM(str(tmp_path), **{"dtype": "float32", "gpu_memory_utilization": 0.3, **kw})
        assert bool(llm.engine.runner.graphs) == (name == "graphs")
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        outs[name + " few"] = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], sp)]
        llm.engine.kv.check_all_free()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs["graphs"] == outs["eager"] and outs["graphs few"] == outs["eager few"]
    assert sum(a[:4] == b[:4] for a, b in zip(outs["eager few"], outs["torch few"])) >= 2
    first = sum(a[:4] == b[:4] for a, b in zip(outs["eager"], outs["torch"]))
    assert first >= 10, (outs["eager"], outs["torch"])


def test_nothing_compiles_once_warm_when_decodes_run_apart_from_chunks(tmp_path, tok_dir):
    """A warm engine meets no new kernel variant: decodes beside chunks of a long prompt over its
    cached context (the decodes apart, the prefill kernel handed `block_tables[nd:]`, off a 16-byte
    boundary when nd x width is not a multiple of 4) and tables of every width. A fresh hybrid
    decode worker's first such step once waited ~1 s for that compile (ops/compile_watch.py found it)."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.ops.compile_watch import CompileWatch
    from pdserve.engine.settings import AttentionTuning

    from helpers import save_tiny

    path = save_tiny("llama", str(tmp_path / "llama"), tok_dir, max_positions=2048)
    llm = LLM(path, dtype="bfloat16", gpu_memory_utilization=0.3, max_num_batched_tokens=256,
              attention_tuning=AttentionTuning(decodes_apart=True))
    watch = CompileWatch.arm()
    before = watch.count
    short = [[7 + i] * (9 + 5 * i) for i in range(3)]  # decoding while the long prompts' chunks run
    for n in (700, 1090, 1500):  # widths 16..97 blocks over the chunks: aligned and not, 16 | width and not
        outs = llm.generate(short + [[11] * n], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert watch.count == before, watch.recent()
    llm.engine.kv.check_all_free()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
