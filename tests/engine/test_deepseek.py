"""DeepSeek-V2 and -V3 (multi-head latent attention, DeepSeek's MoE) against Hugging Face's own
classes (float32, CPU): the configuration read through engine/architectures.py, the latent KV
cache (one row per token and layer), and greedy tokens equal to HF's generate, plain, with
prefix-cache hits, in small prefill chunks, preempted and through the host tier."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.ops.mla_ref import mla_absorbed_ref, mla_expanded_ref

from helpers import ID_PROMPTS, hf_greedy, run_disagg, save_hf

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=256,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
MODELS = {
    # V2-Lite's form: no q_lora, softmax greedy routing, 2 shared experts
    "v2_lite": ("deepseek_v2", dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy")),
    # V2's group-limited routing with a routed scaling factor
    "v2_group": ("deepseek_v2", dict(q_lora_rank=None, n_shared_experts=1, topk_method="group_limited_greedy",
                                     n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    # V3's form: q_lora, sigmoid scores + correction bias, group-limited top-k, YaRN rope
    "v3": ("deepseek_v3", dict(q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               rope_parameters=YARN)),
}
PROMPTS = ID_PROMPTS
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory, tok_dir):
    kind, kw = MODELS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    save_hf(kind, {**BASE, **kw}, path, tok_dir, seed=5)
    return request.param, path


def test_the_configuration_declares_a_latent_cache(model_dir):
    name, path = model_dir
    mc = ModelConfig.from_dir(path)
    spec = mc.kv_cache_spec
    assert (spec.num_heads, spec.head_dim, spec.sharded, spec.parts) == (1, 32 + 16, False, 1)
    assert mc.moe.layers == (False, True, True)
    assert mc.moe.shared_intermediate_size == 32 * (2 if name == "v2_lite" else 1)
    assert mc.moe.routing == {"v2_lite": "softmax", "v2_group": "softmax_group", "v3": "sigmoid_group"}[name]
    assert (mc.mla.q_lora_rank is not None) == (name == "v3")
    if name == "v3":  # YaRN's mscale_all_dim squared on the softmax scale
        mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1.0
        assert mc.mla.softmax_scale == pytest.approx(32 ** -0.5 * mscale ** 2)


def test_the_sliding_kv_window_is_refused_on_a_latent_cache(model_dir):
    """The window rotates cached key heads' rope parts as it moves (engine/base/kv_window.py); an MLA
    cache holds one latent per token: refused in one line before anything loads."""
    _, path = model_dir
    with pytest.raises(ValueError, match="latent-attention \\(MLA\\) model caches one latent per token"):
        EngineConfig(model=path, device="cpu", kv_window_tokens=64).resolve(path)


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_greedy_tokens_equal_hf_generate_with_prefix_hits_and_chunks(model_dir, form):
    """Every prefill chunk in one form (models/mla_attention.py picks by chunk length)."""
    name, path = model_dir
    want = hf_greedy(path, PROMPTS, 8)
    with LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, enable_prefix_caching=True,
             max_num_batched_tokens=16) as llm:
        for layer in llm.engine.runner.model.layers:
            layer.self_attn.attn.absorb_max_query = 0 if form == "expanded" else 1 << 20
        layout = llm.engine.runner.kv.shape
        assert layout[2:] == (1, 16, 1, 48)  # [blocks, layers, one part, block, one row, latent + rope]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        again = llm.generate(PROMPTS[:2], GREEDY)  # their first blocks now come from the prefix cache
        assert [o.outputs[0].token_ids for o in again] == want[:2]
        assert sum(o.num_cached_tokens for o in again) >= 32
        llm.engine.kv.check_all_free()


FEATURES = {
    "preemption": dict(num_gpu_blocks_override=6, max_num_seqs=3),  # 3 prompts needing 3 + 3 + 2 blocks
    "host tier": dict(num_gpu_blocks_override=4, max_num_seqs=1, kv_offloading_size=0.001),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_engine_features_keep_hf_tokens(model_dir, feature):
    """Preemption (recomputed prompts) and the host tier (latent blocks evicted to host memory and
    loaded back on a hit) give HF's greedy tokens."""
    name, path = model_dir
    want = hf_greedy(path, PROMPTS, 8)
    with LLM(path, dtype="float32", max_model_len=128, **FEATURES[feature]) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        stats = llm.engine.stats().as_dict()
    assert got == want and again == want
    if feature == "preemption":
        assert stats["num_preemptions"] > 0
    if feature == "host tier":
        assert stats["prefix_cache_host_hits"] > 0


def test_the_absorbed_form_equals_the_expanded_one():
    """The decode form (queries mapped into latent space, one pass over the cached rows) against
    the expanded form over the same paged cache: chunks on top of a cached context, and decodes."""
    torch.manual_seed(0)
    heads, nope, rope, v, rank, bs = 4, 16, 8, 12, 32, 16
    cache = torch.randn(10, bs, 1, rank + rope, dtype=torch.float64)
    w = torch.randn(heads, nope + v, rank, dtype=torch.float64) / rank ** 0.5
    tables = torch.tensor([[3, 7, 1, 0], [9, 2, 5, 4], [8, 6, 0, 0]], dtype=torch.int32)
    seq_lens, query_lens = [40, 64, 1], [1, 17, 1]
    q = torch.randn(sum(query_lens), heads, nope + rope, dtype=torch.float64)
    want = mla_expanded_ref(q, cache, tables, seq_lens, query_lens, w, 0.2)
    got = mla_absorbed_ref(q, cache, tables, seq_lens, query_lens, w, 0.2)
    assert got.shape == (19, heads, v)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("use_triton", [False, True])
def test_each_chunk_runs_in_the_form_its_length_picks(monkeypatch, use_triton):
    """A mixed step (a decode, a chunk of absorb_max_query tokens, a longer chunk): the short chunk
    runs absorbed (with Triton, each token a decode-kernel row over its causal prefix), the long
    one expanded, and every row equals the all-expanded attention."""
    from pdserve.engine.architectures import MLAConfig
    from pdserve.engine.models import mla_attention
    from pdserve.engine.models.attention import AttentionMetadata

    if use_triton:
        pytest.importorskip("triton")
    dtype = torch.float32 if use_triton else torch.float64  # the kernel computes in float32
    dev = "cuda" if use_triton and torch.cuda.is_available() else "cpu"  # else the interpreter
    torch.manual_seed(1)
    heads, nope, rope, v, rank, bs = 4, 16, 16, 12, 32, 16
    mla = MLAConfig(kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, q_lora_rank=None,
                    softmax_scale=0.2)
    proj = torch.nn.Linear(rank, heads * (nope + v), bias=False).to(dev, dtype)
    attn = mla_attention.MLAPagedAttention(heads, mla, proj, use_triton)
    short, long_ = attn.absorb_max_query, attn.absorb_max_query + 5
    seq_lens, query_lens = [40, short + 30, long_ + 20], [1, short, long_]
    width = -(-max(seq_lens) // bs)
    cache = torch.randn(3 * width, bs, 1, rank + rope, dtype=dtype, device=dev)
    tables = torch.randperm(3 * width, dtype=torch.int32).view(3, width).to(dev)
    q = torch.randn(sum(query_lens), heads, nope + rope, dtype=dtype, device=dev)
    ran = []
    for form in ("mla_expanded_ref", "mla_absorbed_ref"):
        real = getattr(mla_attention, form)
        monkeypatch.setattr(mla_attention, form, lambda q, *a, real=real, form=form: ran.append((form, len(q))) or
                            real(q, *a))
    meta = AttentionMetadata.build(torch.zeros(sum(query_lens), dtype=torch.int64, device=dev), tables, seq_lens,
                                   query_lens, device=dev)
    got = attn(q, None, None, cache, None, meta)
    want = mla_expanded_ref(q, cache, tables, seq_lens, query_lens, attn.w_kv_b(), attn.scale)
    tol = 1e-5 if use_triton else 1e-10
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert ("mla_expanded_ref", long_) in ran and ("mla_expanded_ref", short) not in ran
    assert (("mla_absorbed_ref", short) in ran) == (not use_triton)


def test_the_graph_layouts_keep_hf_tokens(model_dir):
    """Steps in the CUDA graphs' layouts (decode rows padded to their bucket, pieces between the
    attentions, mixed steps of chunks beside decodes), run eagerly on CPU."""
    name, path = model_dir
    if name != "v3":
        pytest.skip("one model: the layouts do not depend on the routing")
    want = hf_greedy(path, PROMPTS, 8)
    with LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=24, max_num_seqs=4) as llm:
        llm.engine.runner.use_graph_layouts()
        seen = []
        decode = llm.engine.runner.graphs.run_decode
        llm.engine.runner.graphs.run_decode = lambda inp, *a: seen.append(inp.num_rows) or decode(inp, *a)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert seen  # decode steps ran in the decode graphs' layout


SCORED = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
LONG = [[(37 * i + 11 * j) % 40000 + 100 for i in range(96)] for j in range(1, 4)]


def prompt_logprobs(model: str, **kw) -> list[float]:
    """Each prompt token's log-probability, teacher-forced in 16-token chunks: each chunk reads
    the earlier chunks' latent rows as the cache stores them (tests/engine/test_models_kv.py)."""
    with LLM(model, dtype="float32", max_model_len=256, max_num_batched_tokens=16, **kw) as llm:
        outs = llm.generate(LONG, SCORED)
        llm.engine.kv.check_all_free()
    return [e[t] for o, p in zip(outs, LONG) for e, t in zip(o.prompt_logprobs[1:], p[1:])]


@pytest.mark.slow
def test_quantized_latent_kv_costs_little_and_int8_least(model_dir):
    """int8 and fp8 latent rows (one float32 scale per row of kv_lora_rank + rope values): the
    log-probabilities stay close to the unquantized cache's, int8 closer than fp8. Measured
    (mean |dlogp|, spread of log p 1.6): v2_lite int8 0.044 / fp8 0.16, v3 0.076 / 0.27, the band
    of Mixtral's GQA cache on the same measure (0.054 / 0.23, test_models_kv.py); a wrong scale
    gives about the spread. int4 packs groups of 32: rows of 48 values are refused."""
    import statistics

    name, path = model_dir
    if name == "v2_group":
        pytest.skip("the same attention as v2_lite")
    ref = prompt_logprobs(path)
    spread = statistics.pstdev(ref)
    err = {fmt: statistics.mean(abs(a - b) for a, b in zip(prompt_logprobs(path, kv_cache_dtype=fmt), ref))
           for fmt in ("int8", "fp8")}
    assert err["int8"] < err["fp8"] < spread / 4, (err, spread)
    with pytest.raises(ValueError, match="not whole groups"):
        LLM(path, dtype="float32", max_model_len=128, kv_cache_dtype="int4")


@pytest.mark.slow
def test_int4_latent_kv_measured(tmp_path, tok_dir):
    """int4 latent rows (groups of 32 values, a float16 scale and minimum each), on the torch path
    only (the MLA kernels read bf16 / int8 / fp8 rows: refused with Triton). A V2-Lite-like model
    with 48 + 16-value rows, mean |dlogp| against the unquantized cache's: measured int8 / fp8 /
    int4 = 0.044 / 0.17 / 0.56 (spread of log p 1.6), in the band of the GQA caches on the same
    measure (test_models_kv.py: dense Llama 0.027 / 0.13 / 0.38, Mixtral 0.054 / 0.23 / 0.64)."""
    import statistics

    kind, kw = MODELS["v2_lite"]
    save_hf(kind, {**BASE, **kw, "kv_lora_rank": 48}, str(tmp_path), tok_dir, seed=5)
    ref = prompt_logprobs(str(tmp_path), attention_backend="torch")
    spread = statistics.pstdev(ref)
    err = {fmt: statistics.mean(abs(a - b) for a, b in zip(
        prompt_logprobs(str(tmp_path), kv_cache_dtype=fmt, attention_backend="torch"), ref))
        for fmt in ("int8", "fp8", "int4")}
    print(f"mean |dlogp| {err}, spread {spread:.2f}")
    assert err["int8"] < err["fp8"] < err["int4"] < spread / 2, (err, spread)
    with pytest.raises(ValueError, match="runs in torch only"):
        LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_dtype="int4", attention_backend="triton")


@pytest.mark.slow
def test_int8_latent_kv_through_the_host_tier_and_the_persisted_file(model_dir, tmp_path):
    """int8 latent blocks offloaded to the host tier, written to disk at shutdown and restored by a
    new engine: the restored prefix is a hit and the tokens are those of an unbounded int8 cache."""
    name, path = model_dir
    if name != "v3":
        pytest.skip("one model: the tiers see bytes, not the routing")
    shared = [(29 * i + 7) % 40000 + 100 for i in range(64)]
    prompts = [shared + [500 + i, 600 + i] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="int8") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    kw = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=12, max_num_seqs=1,
              kv_offloading_size=0.001, kv_cache_dtype="int8", kv_persist_dir=str(tmp_path))
    with LLM(path, **kw) as llm:
        assert llm.generate(prompts[:1], params)[0].outputs[0].token_ids == want[0]
        llm.generate([list(range(1000, 1150))], params)  # pushes the shared prefix out of the GPU tier
        assert llm.generate(prompts[1:2], params)[0].outputs[0].token_ids == want[1]
        assert llm.engine.stats().cache.host_hit_tokens > 0
    with LLM(path, **kw) as llm:
        assert llm.engine.persist_status.startswith("restored ") and "refused" not in llm.engine.persist_status
        out = llm.generate(prompts[2:], params)[0]
        assert out.outputs[0].token_ids == want[2] and out.num_cached_tokens == 64
        llm.engine.kv.check_all_free()



@pytest.mark.slow
def test_latent_blocks_travel_in_the_handoff(model_dir):
    """Prefilled by one engine, decoded by another over the loopback connector: greedy tokens are
    HF's, seeded sampled tokens the colocated engine's, and each handoff moves whole latent blocks
    (one row of 48 values per token and layer: a sixth of what GQA's K and V of 4 heads of 24 would be)."""
    from pdserve.decode.role import DecodeRole
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.prefill.role import PrefillRole
    from pdserve.transfer.loopback import LoopbackConnector, LoopbackHub

    name, path = model_dir
    if name == "v2_group":
        pytest.skip("the same attention as v2_lite")
    hub, kw = LoopbackHub(), dict(model=path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)
    pe, de = LLMEngine(EngineConfig(**kw)), LLMEngine(EngineConfig(**kw, num_gpu_blocks_override=8))
    pw = PrefillRole(pe, LoopbackConnector("prefill-0", pe.runner.kv, hub))
    dw = DecodeRole(de, LoopbackConnector("decode-0", de.runner.kv, hub))
    text = [pe.tokenizer.decode(p) for p in PROMPTS]
    ids = [pe.tokenize(t) for t in text]
    outs, sent = run_disagg(pw, dw, text, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, ids, 8)
    block = 16 * 3 * 1 * 48 * 4  # tokens x layers x one part x latent row x float32
    assert all(b % block == 0 and b > 0 for b, _ in sent.values())
    seeded = SamplingParams(temperature=1.0, top_k=50, max_tokens=8, ignore_eos=True, seed=7)
    with LLM(**kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(ids, seeded)]
    outs, _ = run_disagg(pw, dw, text, seeded)
    assert [o.outputs[0].token_ids for o in outs] == want
    for w in (pw, dw):
        w.engine.kv.check_all_free()


def test_the_triton_kernels_keep_hf_tokens(model_dir):
    """The model on its Triton kernels (the interpreter on CPU): the latent rows stored by the
    KV-store kernel, decodes through the MLA decode kernel (ops/triton_mla.py), the router and the
    routed experts through the fused-MoE kernels, the elementwise parts fused (the norms with the
    residual, the ropes with the latent's norm, SiLU x up); int8 latent rows through both paths."""
    pytest.importorskip("triton")
    name, path = model_dir
    if name == "v2_group":
        pytest.skip("the same attention and experts as v2_lite")
    want = hf_greedy(path, PROMPTS, 6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(path, dtype="float32", max_model_len=128, attention_backend="triton", fused_ops=True) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.attn.capturable and llm.engine.runner.model.fused
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    kw = dict(dtype="float32", max_model_len=128, kv_cache_dtype="int8", kv_cache_memory_bytes=8 << 20)
    with LLM(path, **kw, attention_backend="torch") as ref, LLM(path, **kw, attention_backend="triton") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == \
            [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params)]


@pytest.mark.slow
def test_tensor_parallel_2_on_gloo_keeps_hf_tokens(model_dir):
    """Two ranks (gloo processes): each holds half the heads (their query and kv_b_proj rows, their
    o_proj columns), half of every MLP and expert, and the whole latent path, whose rows both
    ranks cache alike; the greedy tokens are HF's."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    name, path = model_dir
    if name == "v2_group":
        pytest.skip("the same shapes as v2_lite")
    with LLM(path, dtype="float32", max_model_len=128, tensor_parallel_size=2, kv_cache_memory_bytes=8 << 20) as llm:
        assert llm.engine.shards is not None and llm.engine.runner.model.layers[0].self_attn.num_heads == 2
        assert llm.engine.runner.kv.shape[2:] == (1, 16, 1, 48)  # the whole latent row on every rank
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == hf_greedy(path, PROMPTS, 8)
    # expert parallel: 4 of the 8 routed experts whole on each rank, the shared experts split as before
    with LLM(path, dtype="float32", max_model_len=128, tensor_parallel_size=2, enable_expert_parallel=True,
             kv_cache_memory_bytes=8 << 20) as llm:
        moe = llm.engine.runner.model.layers[1].mlp
        assert moe.held == (0, 4) and moe.w_gate_up.shape[0] == 4
        assert moe.w_down.shape[2] == BASE["moe_intermediate_size"]  # whole experts
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == got
