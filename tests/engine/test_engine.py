"""The engine's request handling on the default model: stop conditions, seeds,
bad input, aborts, counters; every block free after each test."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256)


@pytest.fixture(autouse=True)
def all_blocks_free(request):
    yield
    if "llm" in request.fixturenames:
        eng = request.getfixturevalue("llm").engine
        assert not eng.has_unfinished_requests()
        eng.kv.check_all_free()


def test_vllm_shaped_output_from_text_and_ids(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    a, b = llm.generate(["The capital of France is", ids], SamplingParams(temperature=0, max_tokens=8))
    assert a.prompt == "The capital of France is" and a.prompt_token_ids == ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) <= 8
    assert a.outputs[0].text == b.outputs[0].text and "Paris" in a.outputs[0].text
    assert a.finished and a.outputs[0].finish_reason in ("stop", "length")


def test_max_tokens_stop_strings_and_stop_ids(llm):
    p = "Count: 1, 2, 3, 4,"
    full = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(full.token_ids) == 20 and full.finish_reason == "length"
    # stop string: text is cut before it, reason names it
    stop = full.text.strip()[4:7]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.text.startswith(out.text)
    # stop token id: generation ends on that token
    tid = full.token_ids[5]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tid]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(tid) + 1]
    assert out.stop_reason == tid


def test_eos_and_ignore_eos(llm):
    msgs = [{"role": "user", "content": "Say hi."}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    out2 = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 3,
                                         ignore_eos=True))[0].outputs[0]
    assert out2.finish_reason == "length" and out2.token_ids[: len(out.token_ids)] == out.token_ids


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=12, ignore_eos=True)
    a = llm.generate(["Once upon a time", "Tell me a story"], sp)
    b = llm.generate(["Tell me a story", "Once upon a time"], sp)
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids
    unseeded = llm.generate(["Once upon a time"] * 4, SamplingParams(temperature=1.5, max_tokens=12))
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_streaming_deltas_add_up(llm):
    eng = llm.engine
    req = eng.add_request("Write a haiku about autumn.", SamplingParams(temperature=0, max_tokens=24))
    text, ids, final = "", [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            text += out.delta_text
            ids += out.delta_token_ids
            final = out
    assert final.finished and final.request_id == req.request_id
    assert text == final.outputs[0].text and ids == final.outputs[0].token_ids


@pytest.mark.parametrize("prompt, kwargs, match", [
    ("", {}, "empty"),
    ([], {}, "empty"),
    ([10**9], {}, "out of vocabulary"),
    ("hello " * 300, {"max_tokens": 4}, "max_model_len"),
    ("hello", {"max_tokens": 256}, "max_model_len"),
    ("hello", {"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids token ids out of vocabulary"),  # fuzz
])
def test_bad_input_raises_and_engine_keeps_serving(llm, prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(**kwargs))
    # a batch with one bad prompt queues nothing; the engine still serves
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) >= 1


def test_a_request_validated_at_the_edge_is_admitted_checking_only_the_engines_capacity(tiny_models):
    """What a worker gets (check_request's ValidRequest): its engine checks no model limit again,
    only what it alone knows, its KV capacity; the prefill role's part asks one token."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.validation import InvalidRequest, check_request

    eng = LLMEngine(EngineConfig(model=tiny_models["llama"], max_model_len=512, num_gpu_blocks_override=4))
    ids = list(range(10, 50))
    valid = check_request(ids, SamplingParams(max_tokens=20, min_tokens=5), 512, eng.model_config.vocab_size)
    req = eng.admit(valid, "r0")
    assert (req.prompt_token_ids, req.max_tokens) == (ids, 20) and req.request_id == "r0"
    first = valid.first_token()
    assert (first.max_tokens, first.params.max_tokens, first.params.min_tokens) == (1, 1, 1)
    assert (valid.params.max_tokens, valid.params.min_tokens) == (20, 5)  # the request's own stays
    # within max_model_len (the edge passed it), past this engine's 4 blocks of 16 tokens
    big = check_request(ids, SamplingParams(max_tokens=100), 512, eng.model_config.vocab_size)
    with pytest.raises(InvalidRequest, match=r"prompt \+ max_tokens = 140 tokens cannot fit in the KV cache \(64"):
        eng.admit(big, "r1")
    assert eng.admit(big.first_token(), "r1").max_tokens == 1  # its prefill alone fits
    with pytest.raises(ValueError, match="n=2: an engine request is one sequence"):
        eng.admit(check_request(ids, SamplingParams(n=2, max_tokens=2), 512, eng.model_config.vocab_size))
    assert [v.params.seed for v in check_request(ids, SamplingParams(n=2, max_tokens=2, seed=7), 512,
                                                  eng.model_config.vocab_size).samples()] == [7, 8]


def test_an_engine_whose_kv_room_cannot_hold_its_decode_batch_refuses_to_start(tiny_models):
    """decode_batch_len: 20 blocks of 16 tokens hold 5 sequences of 64 tokens, fewer than a decode
    batch of 8: refused in one line with the numbers and what to change; a batch of 5 starts.
    Out of [1, max_model_len] it is refused by name."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    cfg = dict(model=tiny_models["llama"], max_model_len=512, num_gpu_blocks_override=20, decode_batch_len=64)
    with pytest.raises(ValueError) as e:
        LLMEngine(EngineConfig(max_num_seqs=8, **cfg))
    assert str(e.value).startswith("decode_batch_len 64: this worker's KV room, 20 blocks of 16 = 320 tokens, holds "
                                   "5 sequences of 64 tokens, fewer than its decode batch (max_num_seqs 8): lower "
                                   "max_num_seqs to 5") and "\n" not in str(e.value)
    eng = LLMEngine(EngineConfig(max_num_seqs=5, **cfg))
    assert eng.kv.num_blocks == 20
    eng.close()
    with pytest.raises(ValueError, match=r"decode_batch_len must be in \[1, max_model_len 512\], got 513"):
        LLMEngine(EngineConfig(**{**cfg, "decode_batch_len": 513}))


def test_the_engine_is_assembled_in_one_pass_each_part_given_what_it_reads(tiny_models):
    """assembly.assemble builds every part with the parts it uses (nothing wired afterwards): the
    sampler holds the engine's grammars, speculation's off-switch the engine's step model, and
    the scheduler and step model their settings group alone, which cannot reach another group."""
    from pdserve.engine.assembly import assemble
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.settings import SchedulerSettings

    cfg = EngineConfig(model=tiny_models["llama"], max_model_len=256, num_gpu_blocks_override=32, max_num_seqs=6,
                       max_num_batched_tokens=96, slo_tpot_s=0.05, scheduling_policy="priority",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    cfg.resolve(tiny_models["llama"])
    parts = assemble(cfg, "auto")
    assert parts.runner.sampler.grammars is parts.grammars
    assert parts.drafter.switch.model is parts.step_model and parts.drafter.max_model_len == 256
    assert (parts.scheduler.kv, parts.scheduler.max_num_seqs, parts.scheduler.max_num_batched_tokens,
            parts.scheduler.policy) == (parts.kv, 6, 96, "priority")
    assert (parts.step_model.max_tokens, parts.step_model.slo_tpot_s) == (96, 0.05)
    assert parts.kv.num_blocks == parts.runner.num_blocks == 32
    batch = SchedulerSettings.of(cfg)
    assert type(batch) is SchedulerSettings and not hasattr(batch, "block_size")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        SchedulerSettings.of(SimpleNamespace(**{**vars(batch), "max_num_seqs": 0}))


def test_abort_frees_blocks(llm):
    eng = llm.engine
    reqs = [eng.add_request(f"Story number {i}:", SamplingParams(max_tokens=50)) for i in range(4)]
    for _ in range(3):
        eng.step()
    assert eng.stats().placement.kv_blocks_used > 0 and eng.stats().placement.num_running == 4
    for r in reqs:
        assert eng.abort_request(r.request_id)
    assert not eng.abort_request("no-such-request")
    assert eng.stats().placement.kv_blocks_used == 0


def test_counters(llm):
    before = llm.engine.stats().as_dict()
    llm.generate(["The same long system prompt. " * 8 + "A"], SamplingParams(max_tokens=2))
    llm.generate(["The same long system prompt. " * 8 + "B"], SamplingParams(max_tokens=2))
    after = llm.engine.stats().as_dict()
    assert after["prefix_cache_queries"] > before["prefix_cache_queries"]
    assert after["prefix_cache_hits"] >= before["prefix_cache_hits"] + 16
    assert after["kv_blocks_total"] > 0 and after["num_running"] == after["num_waiting"] == 0


def test_the_stats_carry_the_step_model_fitted_to_the_engine_s_own_steps(llm):
    """What a worker's status shows and a profile taken where the worker runs reads: the step
    model's coefficients, in a profile's terms, and how many steps of each kind the fit holds."""
    llm.generate(["Count the steps. " * 4 + str(i) for i in range(4)], SamplingParams(max_tokens=24, ignore_eos=True))
    model, cost = llm.engine.step_model, llm.engine.stats().step_cost
    assert cost is not None and cost.coefficients() == model.coefficients()
    assert set(cost.coefficients()) == {"base", "mixed", "per_seq", "per_token", "per_kv_token", "per_attn", "graph"}
    assert cost.decode_steps == len(model.decode_steps) > 0 and cost.mixed_steps == len(model.mixed_steps) > 0
    assert llm.engine.stats().as_dict()["step_cost"]["decode_steps"] == cost.decode_steps


def test_bad_model_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="supported"):
        LLM(str(tmp_path))
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(str(tmp_path), max_num_sequences=3)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantized_kv_cache(llm, fmt):
    """KV quantized to 1-byte values with a float32 scale per (token, head) row, in the same
    slab (ops/kv_quant.py): 64 + 16 bytes per row of SmolLM2 (values, scale, padding to 16 bytes)
    against float32's 256; greedy output agrees with the full-precision cache's on the first
    tokens of every prompt."""
    from helpers import PROMPTS

    q = LLM(max_model_len=256, kv_cache_dtype=fmt)
    kv = q.engine.runner.kv
    assert kv.dtype == torch.uint8 and kv.shape[-1] == 64 + 16
    assert q.engine.runner.layout.block_bytes * 256 == llm.engine.runner.layout.block_bytes * 80
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in q.generate(PROMPTS, sp)]
    b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    assert [x[:2] for x in a] == [y[:2] for y in b]  # later tokens may drift with rounding
    agree = sum(x == y for u, w in zip(a, b) for x, y in zip(u, w)) / sum(map(len, b))
    assert agree >= 0.85, agree
    q.engine.kv.check_all_free()


@pytest.mark.slow
def test_int4_kv_cache(llm, tiny_models):
    """int4 KV: 32 bytes of codes + two float16 (scale, min) pairs per 64-value row of SmolLM2
    (40 bytes against float32's 256); greedy output agrees with the full-precision cache's on
    most tokens. A head_dim int4 cannot pack (16) is refused by name."""
    from helpers import PROMPTS

    q = LLM(max_model_len=256, kv_cache_dtype="int4")
    kv = q.engine.runner.kv
    assert kv.dtype == torch.uint8 and kv.shape[-1] == 32 + 8
    assert q.engine.runner.layout.block_bytes * 256 == llm.engine.runner.layout.block_bytes * 40
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in q.generate(PROMPTS, sp)]
    b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    agree = sum(x == y for u, w in zip(a, b) for x, y in zip(u, w)) / sum(map(len, b))
    assert agree >= 0.5, agree  # a wrong unpack or scale gives ~0; near-ties part greedy paths early
    q.engine.kv.check_all_free()
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'.*power-of-two head_dim >= 32: .* head_dim 16 is not"):
        LLM(tiny_models["llama"], kv_cache_dtype="int4")


def test_delta_outputs_accumulate_to_the_cumulative_ones(llm):
    """Workers stream delta outputs (no prompt ids, no whole text per token); merged when a
    consumer falls behind and accumulated once at the edge, they equal the engine's own
    cumulative outputs, log-probs included (a merge that dropped one delta's entries misaligned
    the router's per-token log-probs: a 500 under load)."""
    from pdserve.engine.outputs import Accumulator, merge_outputs

    eng, p = llm.engine, "Tell me about the sea."
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["zzz"], logprobs=2)
    eng.add_request(p, sp, "cumulative")
    cumulative = []
    while eng.has_unfinished_requests():
        cumulative += eng.step()
    eng.stream_deltas = True
    try:
        req = eng.add_request(p, sp, "delta")
        deltas = []
        while eng.has_unfinished_requests():
            deltas += eng.step()
    finally:
        eng.stream_deltas = False
    assert len(deltas) == 12 and all(o.prompt_token_ids == [] and len(o.outputs[0].token_ids) == 1 for o in deltas)
    merged = merge_outputs(*copy.deepcopy(deltas[4:6]))
    assert [t in e for t, e in zip(merged.delta_token_ids, merged.outputs[0].logprobs, strict=True)] == [True, True]
    acc = Accumulator(p, req.prompt_token_ids)
    rebuilt = [acc.add(o) for o in [deltas[0], merge_outputs(deltas[1], deltas[2]), *deltas[3:]]]
    last, ref = rebuilt[-1], cumulative[-1]
    assert last.outputs[0].token_ids == ref.outputs[0].token_ids and last.outputs[0].text == ref.outputs[0].text
    assert last.prompt_token_ids == ref.prompt_token_ids and last.finished
    assert rebuilt[1].outputs[0].token_ids == ref.outputs[0].token_ids[:3]  # the merged item carries both deltas
    assert last.outputs[0].logprobs == ref.outputs[0].logprobs and len(ref.outputs[0].logprobs) == 12


def test_a_generic_tokenizer_loads_without_auto_tokenizer_and_is_the_same(default_model_dir, tmp_path):
    """The default model names the generic fast class: load_tokenizer takes the direct path
    and gives AutoTokenizer's tokenizer (text, special tokens, chat template); a directory
    that names another class still goes through AutoTokenizer."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from pdserve.engine.tokenizer import _generic, load_tokenizer

    assert _generic(default_model_dir)
    ours, auto = load_tokenizer(default_model_dir), AutoTokenizer.from_pretrained(default_model_dir)
    for text in ("Hello world", " leading space", "Ünïcödé 🤖\n\nnew", "<|im_start|>user"):
        assert ours.encode(text) == auto.encode(text)
    assert ours.all_special_ids == auto.all_special_ids and len(ours) == len(auto)
    msgs = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    other = tmp_path / "other"
    shutil.copytree(default_model_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    assert not _generic(str(other)) and load_tokenizer(str(other)).encode("Hello world") == auto.encode("Hello world")


def test_the_engines_tokenizer_reads_tokenizer_json_alone_and_gives_transformers_ids_and_text(default_model_dir,
                                                                                             tmp_path):
    """For the generic fast class over a tokenizer.json used as it is, the engine's tokenizer
    reads it with `tokenizers` alone (no transformers in a fresh process: 1.1 s of CPU per
    worker) and gives the ids, text and EOS that transformers' tokenizer of the directory gives;
    a config that makes transformers change the file (here a special token of its own, added
    as a new id) goes through transformers, with the same results."""
    import json
    import shutil
    import subprocess
    import sys

    from pdserve.engine.tokenizer import ModelTokenizer, load_tokenizer

    code = ("import sys; from pdserve.engine.tokenizer import ModelTokenizer; t = ModelTokenizer(sys.argv[1]); "
            "t.decode(t.encode('hi there')); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, default_model_dir], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"], out.stderr[-2000:]
    texts = ("Hello world", " leading space", "Ünïcödé 🤖\n\nnew", "<|im_start|>user\nHi<|im_end|>", "a  b\t\tc ",
             "<|endoftext|><repo_name>x", "<pad>", "")
    other = tmp_path / "bos"
    shutil.copytree(default_model_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "pad_token": "<pad>"}))  # not in the file
    for path, direct in ((default_model_dir, True), (str(other), False)):
        ours, hf = ModelTokenizer(path), load_tokenizer(path)
        assert (ours._rust is not None) == direct, path
        assert ours.eos_token_id == hf.eos_token_id is not None
        for text in texts:
            ids = ours.encode(text)
            assert ids == hf.encode(text) and ours.encode(text, False) == hf.encode(text, add_special_tokens=False)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert ModelTokenizer(str(other)).encode("<pad>") == [49152] != ModelTokenizer(default_model_dir).encode("<pad>")


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_detokenizing_equals_decoding_the_whole_output(default_model_dir, skip_special):
    """Pushed one token at a time (straight to the Rust tokenizer), the pieces add up to what
    transformers' decode of the whole output gives: multi-byte characters split across tokens,
    special tokens, spaces after the prompt."""
    from pdserve.engine.tokenizer import IncrementalDetokenizer, ModelTokenizer, load_tokenizer

    tok = load_tokenizer(default_model_dir)
    prompt = tok.encode("Say it in three languages:")
    out = tok.encode(" Grüße, 你好 — naïve café 🎉🎉 ok") + [tok.eos_token_id] + tok.encode(" end")
    det = IncrementalDetokenizer(ModelTokenizer(default_model_dir), prompt, skip_special)
    assert det.tokenizer._rust is not None  # the direct path, for a tokenizer without clean-up of spaces
    text = "".join(det.push(t) for t in out)
    full = tok.decode(prompt + out, skip_special_tokens=skip_special)
    assert full.endswith(text) and text == tok.decode(out, skip_special_tokens=skip_special)


def test_priority_policy_serves_high_priority_first_with_the_same_tokens(tiny_models):
    """Two sequences at a time and KV for about two: four priority-5 requests arrive before two
    priority-0 ones. Under "priority" the two come back first (their first tokens before any
    priority-5 request's first token); under fcfs last. Every request's tokens equal its tokens
    run alone, preempted or not."""
    model = tiny_models["llama"]
    prompts = [[(13 * i + j) % 900 + 100 for j in range(20)] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model, max_model_len=128).generate(prompts, sp)]
    for policy in ("fcfs", "priority"):
        llm = LLM(model, max_model_len=128, max_num_seqs=2, num_gpu_blocks_override=7, scheduling_policy=policy)
        outs = llm.generate(prompts, sp, priority=[5, 5, 5, 5, 0, 0])
        assert [o.outputs[0].token_ids for o in outs] == want, policy
        first = [o.metrics.first_token_time for o in outs]
        high_first = max(first[4:]) < min(first[2:4])  # before the requests queued with them
        assert high_first == (policy == "priority"), (policy, first)
        llm.engine.kv.check_all_free()
    with pytest.raises(ValueError, match="6 prompts but 2 priorities"):
        llm.generate(prompts, sp, priority=[0, 1])
