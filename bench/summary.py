"""Collects the headline numbers of the committed GPU results into bench/results/summary.json.

    python bench/summary.py            # reads bench/results/*.json, writes summary.json

Every value is {"value", "workload", "command"}; goodput entries add the sweep they come from.
"""

from __future__ import annotations

import datetime
import json
import os

from pdserve.bench.report import read_result

RES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ENGINE = ("python3 bench/engine_gpu.py --batches 1,8,64 --prefill 4096 --hf-batches 1,64 --profile "
          "--out bench/results  # one H200 (files renamed engine_gpu_b64.*)")
ONE_RT = ("python3 bench/serving_gpu.py --tokenizer TOKENIZER_DIR --systems disagg --workloads long --num-requests 200 "
          "--long-rates 5,6.5 --out bench/results/serving/one_round_trip  # 2x H200, one host")
WIRE = ("python3 bench/transfer_bench.py --tokens 4096 --out bench/results/serving/one_round_trip  # the same session; "
        "file renamed transfer_4096.json")


def load(*parts):
    return read_result(os.path.join(RES, *parts))


def one_round_trip() -> dict:
    """The decode reservation's wait at ~80% of disaggregated goodput, beside the wire time of the
    same bytes (raw NCCL send/recv of one 4096-token prompt's KV, measured in the same session). Its
    kv_to_first_token was replaced by served_kv_transfer_p50_ms_4k (2 GPUs over CUDA IPC)."""
    res = load("serving", "one_round_trip", "long_disagg.json")
    wire = next(r for r in load("serving", "one_round_trip", "transfer_4096.json") if not r["contiguous"])
    g = res["goodput"]["rps"]
    run = min(res["runs"], key=lambda r: abs(r["rate"] - 0.8 * g))
    wl = (f"synthetic 4096 in / 256 out, 200 requests at {run['rate']:g} req/s ({run['rate'] / g:.0%} of the "
          f"measured disaggregated goodput {g:.2f}), 1 prefill + 1 decode, Llama-3-8B shape, 2x H200")
    return {
        "decode_reserve_p50_ms": {"value": round(run["phase_ms"]["decode_reserve"]["p50"], 2), "workload": wl,
                                  "command": ONE_RT,
                                  "note": "the finished prefill waiting for the decode reservation (off the "
                                          "critical path: the reservation is made while the prompt is prefilled)"},
        "wire_ms_same_bytes": {"value": round(wire["bytes"] / wire["raw_nccl_GBps"] / 1e6, 2),
                               "workload": f"raw NCCL send/recv of {wire['bytes'] >> 20} MiB (one 4096-token prompt's "
                                           f"KV), 2x H200; a whole handoff of it, idle GPUs: "
                                           f"{wire['handoff_ms']:.2f} ms",
                               "command": WIRE},
    }


def kv_capacity() -> dict:
    """Issue 17's headline numbers (one H100, Llama-3-8B shape; the trace run on CPU)."""
    cap = load("kv_capacity", "kv_capacity_llama3-8b_concurrency_restart.json")
    rst = load("kv_capacity", "kv_capacity_llama3-8b_host_restart_overloaded.json")["restart"]
    sim = {(r["host_tokens"], r["routing"]): r for r in load("kv_capacity", "tier_sim.json")["rows"]}
    c = cap["concurrency"]
    cmd = "python3 bench/kv_capacity_gpu.py --tokenizer TOKENIZER_DIR --parts concurrency,restart  # one H100"
    return {
        "paged_over_contiguous": {"value": round(c["peak_over_contiguous"], 2), "command": cmd,
                                  "workload": f"{c['requests']} mixed-length requests (trace x0.25) on "
                                              f"{c['kv_blocks']} blocks vs max_model_len 8192 reserved per request"},
        "int8_blocks_vs_bf16": {"value": round(cap["blocks_per_byte_vs_bf16"]["int8"], 2), "command": cmd,
                                "workload": "KV blocks per byte, head_dim 128, a float32 scale per row"},
        "restart_ttft_speedup": {"value": round(rst["ttft_cold_s"] / rst["ttft_after_restart_s"], 2),
                                 "workload": f"TTFT of a known {rst['prompt_tokens']}-token prefix: cold / after a "
                                             "restart with the persisted host tier",
                                 "command": cmd.replace("concurrency,restart", "host,restart")},
        "host_tier_cache_share": {"value": round(sim[(3200000, "tiers")]["hit_rate"], 3),
                                  "workload": "whole Mooncake trace, 2 workers, 760K GPU tokens + 3.2M host tokens "
                                              f"each (without the tier: {sim[(0, 'tiers')]['hit_rate']:.3f})",
                                  "command": "python3 bench/tier_sim.py  # CPU, the engine's cache code"},
    }


def speculative() -> dict:
    """Issue 18's headline numbers (one H100, Llama-3-8B shape, chain target, k=4)."""
    first = load("spec", "spec_llama3-8b_chain.json")["rows"]
    second = load("spec", "spec_llama3-8b_chain_offswitch2.json")["rows"]  # the off-switch's second version
    merged = load("spec", "spec_llama3-8b_chain_stepmodel.json")["rows"]  # asking the engine's one step model
    cmd = "python3 bench/spec_gpu.py --tokenizer TOKENIZER_DIR  # one H100"
    cmd2 = ("python3 bench/spec_gpu.py --tokenizer TOKENIZER_DIR --batches 1,8,32,64 --acceptance 0,0.7 "
            "--auto-acceptance 0,0.3,0.7 --repeats 3 --name llama3-8b_chain_stepmodel  # bench/gpu_suite.sh spec")

    def mean(rows: list, batch: int, acc: float, auto: bool) -> float:
        g = [r["speedup"] for r in rows if r["batch"] == batch and r["acceptance_target"] == acc and r["auto"] == auto]
        return round(sum(g) / len(g), 2)

    def worst(rows: list) -> tuple:
        return min((mean(rows, b, a, True), b, a) for b in {r["batch"] for r in rows}
                   for a in {r["acceptance_target"] for r in rows if r["auto"]})

    (w1, b1, a1), (w2, b2, a2), (w3, b3, a3) = worst(first), worst(second), worst(merged)
    latest = load("spec", "spec_llama3-8b_chain_stepmodel.json")
    if any(r["batch"] == 1 and r["acceptance_target"] == 0.7 and not r["auto"] for r in merged):
        first, cmd = merged, cmd2  # bench/gpu_suite.sh measures both keys in one run
    dev = {"device": latest["device"]}
    return {
        "spec_speedup_b1_accept70": {"value": mean(first, 1, 0.7, False), "command": cmd, **dev,
                                     "workload": "batch 1, per-token draft acceptance 70%, k=4, 128 tokens, "
                                                 "mean of 3 runs"},
        "spec_off_switch_worst": {"value": w3, "command": cmd2, **dev,
                                  "workload": f"the off-switch's worst mean over batches 1/8/32/64 x acceptance "
                                              f"0/30/70% (batch {b3}, acceptance {a3:.0%}), asking the engine's "
                                              "one step-time model (spec/spec_llama3-8b_chain_stepmodel.md)",
                                  "note": f"with a cost model of its own: {w2} (batch {b2}, acceptance {a2:.0%}); "
                                          f"first version (1-token start-up timings, whole-batch probes): {w1} "
                                          f"(batch {b1}, acceptance {a1:.0%})"},
    }


def structured_output() -> dict:
    """Issue 21: a decode step with every request under a grammar vs none (one H100)."""
    res = load("grammar", "grammar_llama3-8b.json")
    rows = res["rows"]
    worst = max((sum(r["step_rel"] for r in g) / len(g), b, m) for b in {r["batch"] for r in rows}
                for m in ("regex", "json_object") for g in [[r for r in rows if r["batch"] == b and r["mode"] == m]])
    return {"grammar_step_cost_worst": {
        "value": round(worst[0], 3), "device": res["device"],
        "command": "python3 bench/grammar_gpu.py --tokenizer TOKENIZER_DIR --repeats 5  # bench/gpu_suite.sh grammar",
        "note": "1.03 on an H100 before the overlapped step landed: unconstrained steps overlap since, a "
                "constrained batch runs in turn (its mask needs the previous token on the host), and the "
                "ratio measures that gap too (H200, batch 64: 5.49 ms vs 7.55, host mask 1.09 ms)",
        "workload": f"decode step time with every request constrained (regex / json_object, xgrammar) over "
                    f"unconstrained, Llama-3-8B shape, batch 1-64, mean of 5 runs; "
                    f"worst: batch {worst[1]}, {worst[2]}"}}


BY_SHAPE = {64: "one launch, mixed tiles", 256: "one launch, mixed tiles", 1024: "decodes apart, prefill tiles"}


def mixed_step() -> dict:
    """The step with a prefill chunk minus the same 16 decodes alone, with attention as the
    engine picks it by shape (engine/models/attention.py: one paged-prefill launch in mixed tiles up
    to 256 chunk tokens, decode rows apart and the chunk in prefill tiles from 512), from the
    variants run (piecewise graphs up to 2048 tokens); the graphs/eager table and the torch
    reference path it replaced (gather, mask, SDPA; an earlier call) for comparison."""
    var, res = load("hybrid", "mixed_step_variants.json"), load("hybrid", "mixed_step_graphs.json")
    ref = load("hybrid", "mixed_step_reference.json")

    def extra(rows: list, chunk: int, key: str) -> float:
        by = {r["chunk"]: r[key] for r in rows if r.get("decodes", 16) == 16}
        return by[chunk] - by[0]

    cmd = ("python3 bench/mixed_step_gpu.py --tokenizer TOK --out bench/results/hybrid --batches 16 --reps 5 "
           "--tag _variants --variants  # " + var["device"])
    out = {}
    for chunk, goal in ((64, 2), (256, 5), (1024, 26)):
        out[f"mixed_step_overhead_ms_{chunk}"] = {
            "value": round(extra(var["variants"], chunk, BY_SHAPE[chunk]), 1), "goal": goal, "command": cmd,
            "device": var["device"],
            "workload": f"16 decodes at ~4K context + the last {chunk} tokens of an 8K prompt (the rest cached), "
                        f"Llama-3-8B shape, bf16, median of 5, piecewise graphs, attention: {BY_SHAPE[chunk]}; "
                        f"the --tag _graphs run of the same build before the by-shape choice: "
                        f"{extra(res['rows'], chunk, 'graphs_ms'):.1f} ms in graphs, "
                        f"{extra(res['rows'], chunk, 'eager_ms'):.1f} eager; the torch reference path it replaced: "
                        f"{extra(ref['rows'], chunk, 'mixed_ms'):.1f} ms"}
    pp = load("attention", "prefill_prefix.json")
    pp_cmd = pp["command"] + "  # " + pp["device"]
    out["prefix_hit_prefill_ratio"] = {
        "value": round(pp["prefix_hit_prefill_ratio"], 2), "goal": 0.55, "command": pp_cmd, "device": pp["device"],
        "workload": f"2048 new tokens over a 2048-token cached prefix ({pp['hit_2048_over_2048_ms']:.1f} ms) / a fresh "
                    f"4096-token prompt ({pp['fresh_4096_ms']:.1f} ms), one step each, Llama-3-8B shape, bf16"}
    out["chunked_prefill_last_over_first"] = {
        "value": round(pp["chunked_prefill_last_over_first"], 2), "goal": 1.2, "command": pp_cmd,
        "device": pp["device"],
        "workload": f"an 8K prompt alone in 1024-token chunks: last {pp['chunk_last_ms']:.1f} ms / first "
                    f"{pp['chunk_first_ms']:.1f} ms. The first chunk is a fresh prompt alone (torch's flash "
                    "kernel); the last one's attention over 7K cached keys (~4.1 TFLOP) adds ~12 ms: ~350 "
                    "TFLOP/s in the paged-prefill kernel, about a third of the H100's dense bf16 peak"}
    return out


def colocated_one() -> dict:
    """One engine on one H200 (colocated:1), Llama-3-8B shape, TPOT <= 40 ms: the same runs the one-GPU
    disaggregated and hybrid keys are read against (bench/results/ipc/README.md)."""
    cmd = "python3 bench/serving_gpu.py --tokenizer TOK --systems colocated:1 --num-requests 200 "
    out = {}
    for wl, path, rates, what in (
            ("long", ("moe", "serving", "llama3_8b_long.json.gz"), "3,4,5,6", "4096 in / 256 out, TTFT <= 1 s"),
            ("trace", ("ipc", "serving", "trace_colocated-1-t40.json.gz"), "4,6,8,11",
             "the Mooncake trace (lengths x0.25), TTFT <= 2 s")):
        res = load(*path)
        out[f"colocated1_goodput_{wl}"] = {
            "value": round(res["goodput"]["rps"], 2), "device": "one H200", "date": "2026-11-26",
            "command": cmd + f"--workloads {wl} --{wl}-rates {rates} --out bench/results/{path[0]}/serving  # one H200 "
                       f"(file {path[-1]})",
            "workload": f"{what}, TPOT <= 40 ms, one engine on one GPU, Llama-3-8B shape; SLO attainment by rate: "
                        + ", ".join(f"{r['rate']:g}: {r['slo_attainment']:.0%}" for r in res["runs"])}
    return out


def seeded_sampling() -> dict:
    res = load("sampling", "sampling_gpu.json")
    t = {r["rows"]: r for r in res["sampler_ms"]}
    cmd = "python3 bench/sampling_gpu.py --out bench/results/sampling  # bench/gpu_suite.sh sampling"
    wl = f"sampler call over {res['vocab']:,}-token float32 logits, temperature 0.8, top-p 0.95, {res['device']}"
    b = res["bits"]
    return {
        "seeded_sampler_extra_ms_64": {
            "value": round(t[64]["seeded"] - t[64]["unseeded"], 3), "command": cmd, "device": res["device"],
            "workload": wl + f"; 64 seeded rows vs 64 unseeded ({t[64]['unseeded']:.2f} ms); 1 row: "
                             f"+{t[1]['seeded'] - t[1]['unseeded']:.2f} ms"},
        "seeded_noise_bits_equal_cuda_cpu": {
            "value": round(b["bitwise_equal"] / b["values"], 3), "command": cmd, "device": res["device"],
            "workload": f"{b['pairs']} (seed, index) pairs x 2 rows x the vocabulary, float32 Exp(1) draws on CUDA vs "
                        "CPU (the hash and the uniforms are integer-exact; -log rounds differently by device)"},
    }


def overlap() -> dict:
    """The overlapped step (engine/core/overlap.py): whole LLMEngine.step() calls against the HBM floor."""
    res = load("overlap", "h200", "decode_overlap_gpu.json")  # the device the goals name
    rows = {r["batch"]: r for r in res["rows"]}
    served = load("overlap", "served", "served_tpot_gpu.json")
    cmd = ("python3 bench/decode_overlap_gpu.py --tokenizer TOKENIZER_DIR --batches 1,16,64 "
           "--out bench/results/overlap/h200  # one H200")
    wl = (f"Llama-3-8B config, random bf16, context 1024, {res['device']}, whole LLMEngine.step() (scheduling, "
          "inputs, model, sampling, outputs) with the overlapped step")

    def ratio(b: int) -> dict:
        r = rows[b]
        return {"value": round(r["ratio_on"], 3), "command": cmd,
                "workload": wl + f", batch {b}: {r['step_ms_on']:.2f} ms / floor {r['floor_ms']:.2f} ms (in turn: "
                                 f"{r['ratio_off']:.2f}x)"}

    on = served["served"]["on"]
    fus = load("fusions", "decode_fusions_gpu.json")
    last = {r["variant"]: r for r in fus["rows"] if r["batch"] == 64}  # the later run of "all"
    fcmd = "python3 bench/decode_fusions_gpu.py --tokenizer TOKENIZER_DIR --out bench/results/fusions  # one H200"
    return {
        "decode_fusions_speedup_b64": {
            "value": round(last["none"]["step_ms"] / last["all"]["step_ms"], 3), "command": fcmd,
            "workload": wl.replace(res["device"], fus["device"]) + f", batch 64: without the fusions "
                        f"{last['none']['step_ms']:.3f} ms, {last['none']['launches']} launches; with them "
                        f"{last['all']['step_ms']:.3f} ms, {last['all']['launches']} launches"},
        "decode_floor_ratio_b1": ratio(1), "decode_floor_ratio_b64": ratio(64),
        "decode_gpu_idle_b64": {"value": round(rows[64]["gpu_idle_on"], 3), "command": cmd,
                                "workload": wl + f", batch 64: 1 - kernel time / wall time (in turn: "
                                                 f"{rows[64]['gpu_idle_off']:.1%})"},
        "served_tpot_over_engine_step_b1": {
            "value": round(on["tpot_over_step"], 3),
            "command": "python3 bench/decode_overlap_gpu.py --tokenizer TOKENIZER_DIR --vocab 49152 --batches 1,64 "
                       "--out bench/results/overlap/vocab49k; python3 bench/served_tpot_gpu.py --tokenizer "
                       "TOKENIZER_DIR --engine-json bench/results/overlap/vocab49k/decode_overlap_gpu.json "
                       "--out bench/results/overlap/served  # one H100",
            "workload": f"{served['workload']}, pdserve serve colocated (1 engine), Llama-3-8B shape, "
                        f"{served['device']}: served TPOT p50 {on['tpot_ms_p50']:.2f} ms / LLMEngine.step() at batch 1 "
                        f"{on['engine_step_ms']:.2f} ms"},
    }


def priority() -> dict:
    """Priority scheduling at 1.5x overload (bench/priority_cpu.py, CPU)."""
    res = load("priority", "priority_cpu.json")
    p90 = {pol: [round(r["high"]["ttft_p90_s"], 2) for r in res["runs"] if r["policy"] == pol]
           for pol in ("fcfs", "priority")}
    return {"priority_high_ttft_p90_fcfs_over_priority": {
        "value": round(min(f / p for f, p in zip(p90["fcfs"], p90["priority"])), 1),
        "command": "python bench/priority_cpu.py --out bench/results/priority",
        "workload": f"{res['model']}, {res['device']}, {res['requests']} Poisson arrivals at {res['overload']}x "
                    f"capacity ({res['rate_rps']:.2f} req/s), 20% priority 0: the high class's TTFT p90 under fcfs "
                    f"over under priority, the lower of {len(p90['fcfs'])} repeats (fcfs {p90['fcfs']}, "
                    f"priority {p90['priority']} s)"}}


def kv_int4() -> dict:
    """int4 KV: quality on the default model (bench/kv_quality.py, CPU) and the decode kernel's
    cost against bf16 (bench/kv_int4_gpu.py)."""
    q = {r["kv_cache_dtype"]: r for r in load("kv_quality", "kv_quality_cpu.json")["rows"]}
    k = load("kv_int4", "kv_int4_gpu.json")
    dec = {r["kv_cache_dtype"]: r["us"] for r in k["rows"] if (r.get("batch"), r["context"]) == (64, 4096)
           and r["case"] == "decode"}
    quality = {"command": "python bench/kv_quality.py --out bench/results/kv_quality",
               "workload": "SmolLM2-135M (bf16 weights, CPU), perplexity on docs/architecture.md (4096 tokens) "
                           f"with kv_cache_dtype int4 over auto ({q['int4']['perplexity']:.2f} vs "
                           f"{q['auto']['perplexity']:.2f})"}
    return {
        "kv_int4_blocks_per_byte_vs_bf16": {"value": round(q["auto"]["block_bytes"] / q["int4"]["block_bytes"], 2),
                                            **quality},
        "kv_int4_perplexity_ratio": {"value": round(q["int4"]["perplexity"] / q["auto"]["perplexity"], 3), **quality},
        "kv_int4_decode_kernel_vs_bf16": {
            "value": round(dec["int4"] / dec["auto"], 2),
            "command": "python3 bench/kv_int4_gpu.py --out bench/results/kv_int4", "device": k["gpu"],
            "workload": f"paged decode attention, one Llama-3-8B layer, batch 64 x context 4096, {k['gpu']}: int4 "
                        f"{dec['int4']:.0f} us over bf16 {dec['auto']:.0f} us (int8 {dec['int8']:.0f} us)"},
    }


def attention_core() -> dict:
    """All-decode steps through the paged-prefill kernel against the decode kernel
    (bench/attention_core_gpu.py): whether one kernel could serve both."""
    a = load("attention", "attention_core.json")
    rows = {(r["batch"], r["context"]): r for r in a["rows"]}
    r = rows[(64, 4096)]
    worst = max(a["rows"], key=lambda x: x["ratio"])
    return {"attention_prefill_kernel_on_decodes_b64_4k": {
        "value": round(r["ratio"], 2), "command": a["command"], "device": a["device"],
        "workload": f"one Llama-3-8B attention layer, 64 decode rows x 4096 context, {a['device']}: paged-prefill "
                    f"kernel {r['prefill_kernel_ms']:.3f} ms over decode kernel {r['decode_ms']:.3f} ms; worst of "
                    f"batch 1-128 x context 1K-32K {worst['ratio']:.2f}x at {worst['batch']} x {worst['context']}"}}


def moe() -> dict:
    """Qwen3-30B-A3B's and Qwen3-32B's shapes on the engine, and the fused-MoE kernel
    (bench/moe_gpu.py); goals from the issue that added them."""
    res = load("moe", "moe_gpu.json")
    cmd, dev = res["command"].split(" --out")[0], res["device"]
    models = {m["config"]: m for m in res["models"]}
    moe_m, dense = models["Qwen3MoeForCausalLM"], models["Qwen3ForCausalLM"]
    out = {}
    for name, m, tag in (("moe", moe_m, "Qwen3-30B-A3B"), ("qwen3_32b", dense, "Qwen3-32B")):
        dec = {r["batch"]: r for r in m["decode"]}
        for b, goal in ((1, 1.5 if name == "moe" else None), (64, 1.3 if name == "moe" else None)):
            r = dec[b]
            out[f"{name}_decode_floor_ratio_b{b}"] = {
                "value": round(r["ratio_to_floor"], 2), **({"goal": goal} if goal else {}), "command": cmd,
                "device": dev, "workload": f"{tag} shape, random bf16, batch {b} at context {r['context']}: step "
                f"{r['step_ms']:.2f} ms over the HBM floor {r['floor_ms']:.2f} ms of the bytes it reads"
                + (f" ({r['experts_read']} experts over 48 layers)" if name == "moe" else "")}
        busy = dec[1]["profile"]["gpu_busy_us"] / 1e3
        out[f"{name}_decode_gpu_busy_floor_ratio_b1"] = {
            "value": round(busy / dec[1]["floor_ms"], 2), "command": cmd + " --profile", "device": dev,
            "workload": f"{tag} shape, batch 1: the step's GPU busy time {busy:.2f} ms (torch profiler) over the HBM "
            f"floor {dec[1]['floor_ms']:.2f} ms; the rest of the {dec[1]['step_ms']:.2f} ms step is the runner's host "
            "work around the graph replay (hidden by the overlapped step when serving), which varies by host"}
        p = m["prefill"][0]
        out[f"{name}_prefill_mfu"] = {
            "value": round(p["frac_of_matmul"], 3), **({"goal": 0.6} if name == "moe" else {}), "command": cmd,
            "device": dev, "workload": f"{tag} shape, a {p['tokens']}-token prompt, {p['TFLOPs']:.0f} TFLOP/s on the "
            f"activated FLOPs, of the measured bf16 matmul ceiling ({res['ceil']['matmul_TFLOPs']:.0f} TFLOP/s)"}
    k = {r["tokens"]: r for r in res["kernel"]}
    out["moe_kernel_speedup_over_torch_64"] = {
        "value": round(k[64]["speedup"], 1), "command": cmd, "device": dev,
        "workload": "Qwen3-30B-A3B's experts (128 x 2048 x 768, top-8), 64 tokens: the fused kernel in a CUDA graph "
                    f"{k[64]['fused_graph_ms']:.3f} ms against per-expert torch {k[64]['torch_ms']:.2f} ms; 1-4096 "
                    f"tokens: {min(r['speedup'] for r in k.values()):.0f}-{max(r['speedup'] for r in k.values()):.0f}x"}
    out.update(moe_serving())
    out.update(gemv())
    return out


def gemv() -> dict:
    """The few-row linear (bench/gemv_gpu.py) against cuBLAS at one row, at the kernel's default
    tiles (GemvTiles(); in the committed run one of --tiles, chosen from it)."""
    from pdserve.engine.ops.triton_gemv import GemvTiles

    res = load("gemv", "gemv_gpu.json")
    cmd, dev = res["command"].split(" --out")[0], res["device"]
    t = GemvTiles()
    tiles = f"{t.tile}:{t.max_k}:{t.warps}"
    one = [{**r, "gemv_ms": r["all"][tiles]} for r in res["rows"] if r["rows"] == 1]
    worst = max(one, key=lambda r: r["gemv_ms"] / r["floor_ms"])
    o = next(r for r in one if r["shape"] == "qwen3-30b-a3b o")
    return {"gemv_floor_ratio_worst_b1": {
        "value": round(worst["gemv_ms"] / worst["floor_ms"], 2), "command": cmd, "device": dev,
        "workload": f"7 decode linear shapes (Qwen3-30B-A3B, Qwen3-32B), one row, bf16, tiles {tiles}: the worst, "
        f"{worst['shape']}, over its HBM floor (cuBLAS {worst['cublas_ms'] / worst['floor_ms']:.2f}x); "
        f"Qwen3-30B-A3B's o {o['gemv_ms'] / o['floor_ms']:.2f}x against cuBLAS {o['cublas_ms'] / o['floor_ms']:.2f}x"}}


def fp8() -> dict:
    """FP8 block-scaled linear layers (bench/fp8_gpu.py): one Qwen3-32B layer's prefill GEMMs over
    bf16's, and the decode GEMV at one row over the FP8 floor (layer level, not yet the engine's)."""
    res = load("fp8", "fp8_gpu.json")
    cmd, dev = res["command"].split(" --out")[0], res["device"]
    (tokens, speedup), = res["summary"]["prefill_layer_speedup"].items()
    one = [r for r in res["decode"] if r["rows"] == 1]
    worst = max(one, key=lambda r: r["best_ms"] / r["floor_ms"])
    big = [r for r in one if r["shape"].startswith("qwen3-32b")]
    return {"fp8_linear_prefill_speedup_32b": {
        "value": round(speedup, 2), "command": cmd, "device": dev,
        "workload": f"one Qwen3-32B layer's qkv, o, gate/up, down GEMMs at {tokens} tokens: bf16 (cuBLAS) time over "
        "FP8 block-scaled time (activation quantization + cuBLAS's 1x128/128x128 block-scaled GEMM); the Triton W8A8 "
        f"kernel alone {sum(r['bf16_ms'] for r in res['prefill']) / sum(r['triton_ms'] for r in res['prefill']):.2f}x"},
        "fp8_gemv_floor_ratio_b1": {
        "value": round(sum(r["best_ms"] for r in big) / sum(r["floor_ms"] for r in big), 2), "command": cmd,
        "device": dev,
        "workload": "Qwen3-32B's qkv, o, gate/up, down at one row: the W8A16 GEMV's time over the HBM floor of its FP8 "
        f"bytes (values + scales), summed; the worst shape, {worst['shape']}, "
        f"{worst['best_ms'] / worst['floor_ms']:.2f}x (a 5 us launch-bound GEMV)"},
        **fp8_engine(), **fp8_moe_engine(), **fp8_moe_serving()}


def fp8_engine() -> dict:
    """A whole Qwen3-32B-shape model with its decoder linears held in FP8 in the engine
    (bench/fp8_engine_gpu.py): prefill tokens/s over bf16's, and the b1 decode step over its floor."""
    res = load("fp8", "fp8_engine.json")
    cmd, dev = res["command"].split(" --out")[0], res["gpu"]
    bf16, fp8 = res["runs"]
    b1 = next(d for d in fp8["decode"] if d["batch"] == 1)
    return {"fp8_prefill_speedup_32b": {
        "value": round(res["prefill_speedup"], 2), "command": cmd, "device": dev,
        "workload": f"Qwen3-32B shape (random weights), one {fp8['prefill']['tokens']}-token prompt, the engine: "
        "FP8 block-scaled decoder linears (e4m3 + 128x128 scales, activations quantized per 128) over bf16 tokens/s; "
        "attention is the same bf16 kernel in both"},
        "fp8_decode_floor_ratio_b1": {
        "value": round(b1["ratio_to_floor"], 2), "command": cmd, "device": dev,
        "workload": f"the same model, one row at {b1['context']} tokens of context, the engine's CUDA graph: step time "
        "over the HBM floor of every parameter but the embedding table in its stored dtype (FP8 + scales; norms and "
        f"LM head bf16) and the row's KV; bf16's own ratio {bf16['decode'][0]['ratio_to_floor']:.2f}"}}


def fp8_moe_engine() -> dict:
    """A whole Qwen3-30B-A3B-shape model with its decoder linears and fused experts held in FP8
    (bench/fp8_engine_gpu.py --shape qwen3-30b-a3b), two runs of one sitting: the b1 decode step
    over its floor (the experts the row routes to), and prefill tokens/s over bf16's."""
    runs = [load("fp8", name) for name in ("fp8_moe_engine.json", "fp8_moe_engine_2.json")]
    res = runs[0]
    cmd, dev = res["command"].split(" --out")[0].replace(" --profile", ""), res["gpu"]
    b1 = [next(d for d in r["runs"][1]["decode"] if d["batch"] == 1) for r in runs]
    bf16_b1 = [r["runs"][0]["decode"][0]["ratio_to_floor"] for r in runs]
    return {"fp8_moe_decode_floor_ratio_b1": {
        "value": round(b1[0]["ratio_to_floor"], 2), "command": cmd, "device": dev,
        "workload": f"Qwen3-30B-A3B shape (random weights), one row at {b1[0]['context']} tokens of context, the "
        "engine's CUDA graph: step time over the HBM floor of the bytes it reads (non-expert weights, the 8 experts "
        "per layer it routes to in FP8 + scales, its KV). Goal <= 1.6: missed; second run of the sitting "
        f"{b1[1]['ratio_to_floor']:.2f}; bf16's own {bf16_b1[0]:.2f} / {bf16_b1[1]:.2f}. The floor is 0.83 ms; GPU "
        "busy 2.6 ms in 530 launches (expert GEMVs 0.82, W8A16 projections 0.45, router 0.31, attention 0.28), "
        "the rest host time per step (fp8_moe_engine.md)"},
        "fp8_moe_prefill_speedup": {
        "value": round(res["prefill_speedup"], 2), "command": cmd, "device": dev,
        "workload": "the same model, one 4096-token prompt: FP8 over bf16 tokens/s (the experts W8A16: each tile "
        f"converted in the kernel, slower than bf16's GEMMs; second run {runs[1]['prefill_speedup']:.2f})"}}


def fp8_moe_serving() -> dict:
    """Qwen3-30B-A3B's shape served by one colocated engine on one H200 with its weights held in FP8,
    beside bf16 in the same sitting (bench/results/fp8/serving/: bf16, fp8 and a second FP8 run)."""
    runs = {k: load("fp8", "serving", k, "long_colocated-1-t40.json") for k in ("bf16", "fp8", "fp8_2")}
    by_rate = {k: ", ".join(f"{r['rate']:g}: {r['slo_attainment']:.0%}" for r in v["runs"]) for k, v in runs.items()}
    gp = {k: v["goodput"]["rps"] for k, v in runs.items()}
    cmd = ("python3 bench/serving_gpu.py --fp8 --tokenizer TOK --systems colocated:1 --num-requests 200 "
           "--shape qwen3-30b-a3b --workloads long --long-rates 2.5,3,3.5,4,5 --out bench/results/fp8/serving/fp8")
    return {"fp8_moe_colocated1_goodput_long": {
        "value": round(gp["fp8"], 2), "command": cmd, "device": "one H200",
        "workload": "4096 in / 256 out, TTFT <= 1 s, TPOT <= 40 ms, one engine on one GPU, Qwen3-30B-A3B shape "
        f"(SmolLM2's vocabulary), weights in FP8 (block-scaled e4m3). SLO attainment by rate: {by_rate['fp8']}; a "
        f"second FP8 run {gp['fp8_2']:.2f} req/s ({by_rate['fp8_2']}); bf16 in the same sitting {gp['bf16']:.2f} req/s "
        f"({by_rate['bf16']}). FP8 serves less: its experts run W8A16 (each tile converted in the kernel), so "
        "prefill is 0.48-0.69x bf16's (the engine's own measure: fp8/serving/README.md) and this workload's 4K "
        "prompts queue; decode is faster (3.6-3.9 ms a step against 4.6) and KV room 45% larger"}}


TRACE_SPLIT = " (7.5 and 9 in a second server start, the runs merged: moe/serving/README.md)"


def moe_serving() -> dict:
    """Qwen3-30B-A3B's shape served through the whole stack on one GPU, beside the same session's
    Llama-3-8B-shape run (bench/results/moe/serving/)."""
    cmd = ("python3 bench/serving_gpu.py --tokenizer TOK --systems colocated:1 --num-requests 200 --shape {shape} "
           "--workloads {wl} --{wl}-rates {rates} --out bench/results/moe/serving  # one H200")
    out = {}
    for wl, what in (("long", "4096 in / 256 out, TTFT <= 1 s"),
                     ("trace", "the Mooncake trace (lengths x0.25, outputs x0.5), TTFT <= 2 s")):
        moe_r, llama = (load("moe", "serving", f"{m}_{wl}.json") for m in ("qwen3_30b_a3b", "llama3_8b"))
        rates = ",".join(f"{r['rate']:g}" for r in moe_r["runs"])
        by_rate = ", ".join(f"{r['rate']:g}: {r['slo_attainment']:.0%}" for r in moe_r["runs"])
        out[f"moe_colocated1_goodput_{wl}"] = {
            "value": round(moe_r["goodput"]["rps"], 2),
            "command": cmd.format(shape="qwen3-30b-a3b", wl=wl, rates=rates),
            "device": "one H200",
            "workload": f"{what}, TPOT <= 40 ms, one engine on one GPU, Qwen3-30B-A3B shape (SmolLM2's vocabulary); "
                        f"SLO attainment by rate: {by_rate}{TRACE_SPLIT if wl == 'trace' else ''}; the same session's "
                        "Llama-3-8B shape: "
                        f"{llama['goodput']['rps']:.2f} req/s (llama3_8b_{wl}.md)"}
    return out


def ipc() -> dict:
    """The same-node link on one H200 (bench/results/ipc/): the handoff against a local copy, and
    served runs whose prefill and decode workers share the GPU (outputs over the output pipe)."""
    rows = {(r["tokens"], r["contiguous"]): r for r in load("ipc", "transfer_same_gpu.json")}
    r2k, r8k = rows[(2048, False)], rows[(8192, False)]
    long_ = load("ipc", "serving", "long_disagg-1-1-one-gpu-pipe.json")
    run = min(long_["runs"], key=lambda r: r["rate"])
    over, k2f = run["phase_ms"]["kv_to_first_token_over_transfer"], run["phase_ms"]["kv_to_first_token"]
    relay = run["phase_ms"]["first_token_relay"]
    ray_run = load("ipc", "serving", "long_disagg-1-1-one-gpu-spans.json")["runs"][0]["phase_ms"]
    by_rate = ", ".join(f"{r['rate']:g}: {r['slo_attainment']:.0%}" for r in long_["runs"])
    serve = ("python3 bench/serving_gpu.py --tokenizer TOK --systems {sys} --one-gpu --num-requests 200 "
             "--workloads {wl} --{wl}-rates {rates} --out bench/results/ipc/serving  # one H200")
    trace = {k: load("ipc", "serving", f"trace_{k}.json") for k in
             ("disagg-1-1-one-gpu-pipe", "hybrid-1-1-t40-one-gpu-pipe", "colocated-1-t40")}
    out = {
        "ipc_handoff_efficiency_2k": {
            "value": round(r2k["efficiency"], 2), "goal": 0.8,
            "command": "python bench/transfer_bench.py --same-gpu --tokens 512,2048,8192 --out bench/results/ipc"
                       "  # one H200",
            "device": "one H200",
            "workload": f"2048-token prompt (256 MiB of Llama-3-8B KV, random block ids) pulled over CUDA IPC by a "
                        f"process sharing the GPU: {r2k['handoff_ms']:.2f} ms against a local copy of "
                        f"{r2k['raw_ms']:.2f} ms; 8192 tokens: {r8k['efficiency']:.0%} (ipc/README.md: the control "
                        "path's ~0.5 ms)"},
        "ipc_kv_to_first_token_over_transfer_ms": {
            "value": round(over["p50"], 1), "goal": 2,
            "command": serve.format(sys="disagg:1:1", wl="long", rates="3,4"), "device": "one H200",
            "workload": f"disaggregated 1:1 on one GPU at {run['rate']:g} req/s, 4096-token prompts: per request, "
                        f"the KV landed -> first token at the cluster, p50 (kv_to_first_token p50 {k2f['p50']:.1f} ms "
                        f"minus the request's own transfer); the output pipe's relay {relay['p50']:.1f} ms p50, "
                        f"Ray's stream before it {ray_run['first_token_relay']['p50']:.1f} ms "
                        f"(over transfer {ray_run['kv_to_first_token_over_transfer']['p50']:.1f} ms)"},
        "one_gpu_disagg_goodput_long": {
            "value": long_["goodput"]["rps"], "command": serve.format(sys="disagg:1:1", wl="long", rates="3,4"),
            "device": "one H200",
            "workload": "4096 in / 256 out, TTFT <= 1 s, TPOT <= 40 ms, a prefill and a decode worker sharing one "
                        f"GPU (handoffs over CUDA IPC); lower bound: both rates met 90% ({by_rate}); "
                        "hybrid 1:1 >= 4.00, colocated:1 5.24 (ipc/README.md)"},
    }
    for key, name, sys_ in (("one_gpu_disagg_goodput_trace", "disagg-1-1-one-gpu-pipe", "disagg:1:1"),
                            ("one_gpu_hybrid_goodput_trace", "hybrid-1-1-t40-one-gpu-pipe", "hybrid:1:1")):
        r = trace[name]
        by_rate = ", ".join(f"{x['rate']:g}: {x['slo_attainment']:.0%}" for x in r["runs"])
        out[key] = {
            "value": round(r["goodput"]["rps"], 2), "command": serve.format(sys=sys_, wl="trace", rates="4,6,8"),
            "device": "one H200",
            "workload": f"the Mooncake trace (lengths x0.25), TTFT <= 2 s, TPOT <= 40 ms, both workers on one GPU; "
                        f"SLO attainment by rate: {by_rate}; colocated:1 the same session "
                        f"{trace['colocated-1-t40']['goodput']['rps']:.2f} req/s (trace_colocated-1-t40.md)"}
    return out


def mla_steps() -> dict:
    """DeepSeek-V2-Lite's whole model through the runner (dummy weights), one H200."""
    res = load("mla", "mla_gpu.json")
    st, cmd = res["steps"], res["command"] + "  # one H200"
    out = {}
    for r in st["decode"]:
        out[f"mla_decode_floor_ratio_b{r['batch']}"] = {
            "value": round(r["ratio_to_floor"], 2), "goal": 1.5 if r["batch"] == 1 else 1.3, "command": cmd,
            "device": "one H200",
            "workload": f"DeepSeek-V2-Lite's shape (dummy bf16 weights), a decode step of batch {r['batch']} at "
                        f"context {r['context']}: {r['step_ms']:.2f} ms against {r['floor_ms']:.2f} ms to read the "
                        f"non-expert weights, the {r['experts_read']} experts it routes to and the latent rows "
                        "(mla/README.md)"}
    p = st["prefill"][0]
    out["mla_prefill_mfu"] = {
        "value": round(p["frac_of_matmul"], 2), "goal": 0.5, "command": cmd, "device": "one H200",
        "workload": f"a {p['tokens']}-token prompt through DeepSeek-V2-Lite's shape: {p['ms']:.1f} ms, "
                    f"{p['TFLOPs']:.0f} TFLOP/s on the activated FLOPs against the measured bf16 matmul ceiling "
                    "(0.45-0.49 over this build's runs: mla/README.md)"}
    forms = load("mla", "mla_gpu_forms.json")["forms"]
    wins = {c: max([r["chunk"] for r in forms if r["context"] == c and r["absorbed_us"] < r["expanded_us"]] or [0])
            for c in sorted({r["context"] for r in forms})}
    out["mla_absorbed_chunk_max"] = {
        "value": min(wins.values()), "device": "one H200",
        "command": "python bench/mla_gpu.py --forms --no-kernel --out bench/results/mla  # one H200",
        "workload": "the longest prefill chunk at which the absorbed form (decode-kernel rows) beats the expanded "
                    "one (keys and values built, SDPA) at every context; the largest such chunk by context: "
                    + ", ".join(f"{c}: {w}" for c, w in wins.items()) + " (models/mla_attention.ABSORB_MAX_QUERY)"}
    return out


def mla() -> dict:
    """DeepSeek-V2-Lite's latent attention on one H200 (bench/results/mla/)."""
    res = load("mla", "mla_gpu.json")
    cap = res["capacity"]
    mla_p, gqa = cap["deepseek-v2-lite (MLA)"], cap["qwen3-14b shape (GQA 8x128)"]
    k = next(r for r in res["kernel"] if r["batch"] == 64 and r["context"] == 8192)
    big = next(r for r in res["kernel"] if r["batch"] == 128 and r["context"] == 32768)
    cmd = res["command"] + "  # one H200"
    served = load("mla", "serving", "deepseek_v2_lite_long.json")
    trace = load("mla", "serving", "trace_colocated-1-t40.json")
    handoff = load("mla", "serving", "one_gpu_long_disagg-1-1_handoff.json")
    return {
        "mla_kv_bytes_per_token": {
            "value": mla_p["kv_bytes_per_token"], "command": cmd, "device": "one H200",
            "workload": "DeepSeek-V2-Lite's shape, bf16: 27 layers x one 576-value latent row (512 + 64 rope); a GQA "
                        f"model of about its weight size (Qwen3-14B's shape) caches {gqa['kv_bytes_per_token']} bytes"},
        "mla_concurrency_vs_gqa": {
            "value": round(mla_p["max_concurrency_paged"] / gqa["max_concurrency_paged"], 2), "command": cmd,
            "device": "one H200",
            "workload": f"4096 in / 256 out requests whose KV fits 0.9 of an H200 after the weights: "
                        f"{mla_p['max_concurrency_paged']} for DeepSeek-V2-Lite "
                        f"({mla_p['weight_bytes_rank'] / 1e9:.1f} GB of weights) against "
                        f"{gqa['max_concurrency_paged']} for Qwen3-14B's shape "
                        f"({gqa['weight_bytes_rank'] / 1e9:.1f} GB); pdserve plan's arithmetic"},
        **mla_steps(),
        "mla_colocated1_goodput_long": {
            "value": round(served["goodput"]["rps"], 2), "device": "one H200",
            "command": "python3 bench/serving_gpu.py --tokenizer TOK --systems colocated:1 --shape deepseek-v2-lite "
                       "--num-requests 200 --workloads long --long-rates 3,5 (then 7,9: runs merged) "
                       "--out bench/results/mla/serving  # one H200",
            "workload": "4096 in / 256 out, TTFT <= 1 s, TPOT <= 40 ms, one engine, DeepSeek-V2-Lite's shape (dummy "
                        "bf16 weights); SLO attainment by rate: "
                        + ", ".join(f"{r['rate']:g}: {r['slo_attainment']:.0%}" for r in served["runs"])
                        + "; Llama-3-8B's shape 5.24 (moe/serving/llama3_8b_long.md)"},
        "mla_colocated1_goodput_trace": {
            "value": round(trace["goodput"]["rps"], 2), "device": "one H200",
            "command": "python3 bench/serving_gpu.py --tokenizer TOK --systems colocated:1 --shape deepseek-v2-lite "
                       "--num-requests 200 --workloads trace --trace-rates 4,7 --out bench/results/mla/serving  "
                       "# one H200",
            "workload": "the Mooncake trace (lengths x0.25, outputs x0.5), TTFT <= 2 s, TPOT <= 40 ms, one engine, "
                        "DeepSeek-V2-Lite's shape; SLO attainment by rate: "
                        + ", ".join(f"{r['rate']:g}: {r['slo_attainment']:.0%}" for r in trace["runs"])
                        + " (a lower bound: the highest rate run met the SLO); Llama-3-8B's shape 8.61 "
                        "(one_gpu_colocated in ipc/README.md)"},
        "mla_handoff_mib_per_request": {
            "value": round(handoff["bytes_per_handoff"] / 2 ** 20, 1), "device": "one H200",
            "command": "python3 bench/serving_gpu.py --tokenizer TOK --systems disagg:1:1 --one-gpu --shape "
                       "deepseek-v2-lite --num-requests 200 --workloads long --long-rates 3 "
                       "--out bench/results/mla/serving (files prefixed one_gpu_)  # one H200",
            "workload": f"KV bytes per handoff of a 4096-token prompt, served disaggregated ({handoff['handoffs']:.0f} "
                        "handoffs, pdserve:kv_handoff_bytes); Llama-3-8B's shape moves 512 MiB for the same prompt "
                        "(4096 x 131,072 bytes)"},
        "mla_decode_attention_floor_ratio": {
            "value": round(k["ratio_to_floor"], 2), "goal": 1.3, "command": cmd, "device": "one H200",
            "workload": f"the MLA decode kernel (ops/triton_mla.py), batch 64 x 8192 context, 16 heads, bf16: "
                        f"{k['kernel_us']:.0f} us against {k['floor_us']:.0f} us to read the latent rows at the "
                        f"measured copy bandwidth; 128 x 32K: {big['ratio_to_floor']:.2f} (mla/README.md)"},
    }


GRID_SERVE = ("python3 bench/serving_gpu.py --tokenizer TOK --systems {systems} --workloads {wl} --tpot-slos {tpot} "
              "--{wl}-rates {rates} --num-requests 200 --repeats 2 --out bench/results/multi_gpu/runs/gpus{gpus}")
GRID_RUNS = {  # (gpus, workload, tpot ms) -> the serving_gpu.py runs behind the grid's point (one per part)
    (4, "long", 20): [dict(systems="hybrid:2:2,colocated:4", rates="16,20,24")],
    (4, "long", 40): [dict(systems="hybrid:2:2,colocated:4", rates="20,24,28,32")],
    (4, "trace", 40): [dict(systems="hybrid:2:2,colocated:4,disagg:2:2", rates="24,30,36"),
                       dict(systems="hybrid:2:2,colocated:4", rates="40,46,52"),
                       dict(systems="hybrid:2:2,colocated:4", rates="56,62,68")],
    (2, "long", 40): [dict(systems="hybrid:1:1,colocated:2", rates="10,12,14")],  # disagg:1:1: 2026-11-28's
}
GRID_DEVICES = {4: "4x H200 (NV18), one host", 2: "2x H200 (nvidia-h200-x2, a host of its own)"}


def multi_gpu() -> dict:
    """The multi-GPU grid's ratios (bench/results/multi_gpu/grid.json, bench/grid_report.py): hybrid
    against the better pure mode on the same GPUs, and the first rate's gap after health."""
    rows = {(r["gpus"], r["workload"], r["tpot_ms"]): r for r in load("multi_gpu", "grid.json")}
    out = {}
    for (gpus, wl, ms), parts in GRID_RUNS.items():
        row = rows[(gpus, wl, ms)]
        cmd = "; ".join(GRID_SERVE.format(wl=wl, tpot=ms, gpus=gpus, **p) for p in parts)
        cmd += "; python3 bench/grid_report.py"
        cells = [row[f] for f in ("colocated", "disagg", "hybrid") if row[f]]
        work = f"{wl}, TPOT <= {ms} ms, 200 requests a rate, two sweeps each: " + "; ".join(
            f"{c['system']} below {c['below']:g} req/s (the lowest rate swept)" if c.get("below") else
            f"{c['system']} {'>= ' if c.get('lower_bound') else ''}{c['rps']:.2f} req/s "
            f"({min(c['repeats']):.2f}-{max(c['repeats']):.2f})" for c in cells)
        out[f"hybrid_vs_best_pure_{gpus}gpu_{wl}_t{ms}"] = {
            "value": row.get("hybrid_vs_best_pure"), "goal": 0.97, "workload": work, "command": cmd,
            "device": GRID_DEVICES[gpus]}
    t20 = rows[(4, "long", 20)]
    out["first_rate_attainment_gap_colocated4"] = {
        "value": t20["first_rate_gap"].get(t20["colocated"]["system"]), "goal": 2.0,
        "workload": "long, TPOT <= 20 ms, colocated:4: attainment at the first rate after /health (16 req/s), "
                    "second sweep minus first, points",
        "command": GRID_SERVE.format(wl="long", tpot=20, gpus=4, **GRID_RUNS[(4, "long", 20)][0]),
        "device": "4x H200 (NV18), one host"}
    return out


def kv_tiers() -> dict:
    """The disk tier and peer fetch on the Mooncake trace (bench/results/kv_tiers/, CPU)."""
    res = load("kv_tiers", "tier_sim_disk.json")
    gpu = load("kv_tiers", "kv_tiers_llama3-8b.json")
    a, b = (next(r for r in gpu["rows"] if r["tokens"] == n) for n in (4096, 16000))
    peer = load("kv_tiers", "peer_fetch_llama3-8b.json")
    pa, pb = (next(r for r in peer["rows"] if r["tokens"] == n) for n in (4096, 16000))
    rows = res["rows"]
    disk = next(r for r in rows if r["disk_tokens"] and not r["peer"] and r["routing"] == "tiers")
    ceiling = next(r for r in rows if r["host_tokens"] >= 10**9 and r["routing"] == "tiers")
    work = (f"the whole Mooncake trace ({res['requests']} requests) through the engine's cache code, 2 workers, "
            f"GPU {disk['gpu_tokens']:,} tokens each")
    return {
        "kv_cache_share_with_disk": {
            "value": round(disk["hit_rate"], 3), "command": res["command"], "device": "CPU (a simulation)",
            "workload": f"{work}, host {disk['host_tokens']:,} + disk {disk['disk_tokens']:,} tokens per worker "
                        f"(400 GB + 4 TB at Llama-3-8B's 128 KiB per token), tier-aware routing: GPU "
                        f"{disk['gpu_hit_rate']:.1%}, host {disk['host_hit_rate']:.1%}, disk "
                        f"{disk['disk_hit_rate']:.1%}; the ceiling is kv_cache_share_ceiling"},
        "kv_disk_decided_ttft_over_recompute_16k": {
            "value": round(b["disk_s"] / b["recompute_s"], 2), "command": gpu["command"] + "  # one H200",
            "device": "one H200",
            "workload": f"TTFT of a 16,000-token prompt whose prefix is on the disk tier, as the engine decides "
                        f"(the disk read {gpu['disk_read_gbps']:.2f} GB/s: recompute predicted faster, so recomputed), "
                        f"over recomputing: {b['disk_s'] * 1e3:.0f} / {b['recompute_s'] * 1e3:.0f} ms; read regardless "
                        f"{b['disk_forced_s'] * 1e3:.0f} ms, host tier {b['host_s'] * 1e3:.0f} ms, GPU hit "
                        f"{b['gpu_s'] * 1e3:.0f} ms (Llama-3-8B's shape)"},
        "kv_host_ttft_over_recompute_16k": {
            "value": round(b["host_s"] / b["recompute_s"], 2), "command": gpu["command"] + "  # one H200",
            "device": "one H200",
            "workload": f"TTFT of a 16,000-token prompt whose prefix is in the host tier over recomputing it: "
                        f"{b['host_s'] * 1e3:.0f} / {b['recompute_s'] * 1e3:.0f} ms (4,096 tokens: "
                        f"{a['host_s'] * 1e3:.0f} / {a['recompute_s'] * 1e3:.0f} ms; Llama-3-8B's shape)"},
        "kv_peer_ttft_over_recompute_16k": {
            "value": round(pb["peer_s"] / pb["recompute_s"], 2), "command": peer["command"] + "  # one H200",
            "device": "one H200 (two worker processes sharing it)",
            "workload": f"TTFT of a 16,000-token prompt whose prefix another worker's GPU holds, fetched from it "
                        f"({peer['link']}) over recomputing it: {pb['peer_s'] * 1e3:.0f} / "
                        f"{pb['recompute_s'] * 1e3:.0f} ms, of which the fetch {pb['fetch_s'] * 1e3:.0f} ms at "
                        f"{pb['link_gbps']:.0f} GB/s (4,096 tokens: {pa['peer_s'] * 1e3:.0f} / "
                        f"{pa['recompute_s'] * 1e3:.0f} ms; Llama-3-8B's shape)"},
        "kv_cache_share_ceiling": {
            "value": round(ceiling["hit_rate"], 3), "command": res["command"], "device": "CPU (a simulation)",
            "workload": f"{work}, an unbounded host tier, tier-aware routing: all the reuse the trace has"},
    }


def kv_window() -> dict:
    """Sink + window eviction against full attention (bench/kv_window_quality.py, CPU)."""
    res = load("kv_window", "kv_window_quality.json")
    ppl = {(r["window"], r["sink_tokens"]): r["perplexity"] for r in res["rows"]}
    return {"kv_window_1024_perplexity_vs_full": {
        "value": round(ppl[(1024, 4)] / ppl[(None, 0)], 3),
        "command": "python bench/kv_window_quality.py --out bench/results/kv_window",
        "workload": f"{res['model']}, {res['device']}, {res['tokens']} tokens of the docs prefilled in {res['chunk']}-"
                    f"token steps: a 1024-token window + sinks over full attention (no sinks: "
                    f"{ppl[(1024, 0)] / ppl[(None, 0)]:.2f}x)"}}


def kv_h2o() -> dict:
    """Heavy hitters against sink + window, and what their scores cost a decode step (bench/results/kv_h2o/)."""
    q = load("kv_h2o", "kv_h2o_quality.json")
    ppl = {(r["budget"], r["evict"]): r["perplexity"] for r in q["rows"]}
    budgets = sorted({b for b, _ in ppl}, reverse=True)
    ratio = {b: ppl[(b, "h2o")] / ppl[(b, "window")] for b in budgets}
    quarter = min(budgets, key=lambda b: abs(b - q["tokens"] / 4))
    cost = {r["batch"]: r for r in load("kv_h2o", "kv_h2o_gpu.json")["rows"]}
    gpu = "python bench/kv_h2o_gpu.py --out bench/results/kv_h2o  # one H200"
    shape = "Llama-3-8B config, random bf16, context 4096, batch {}: a decode step in CUDA graphs with h2o's score " \
            "tracking over the same without"
    return {
        "kv_h2o_vs_window_ppl_quarter": {
            "value": round(ratio[quarter], 3),
            "command": "python bench/kv_window_quality.py --h2o --out bench/results/kv_h2o",
            "workload": f"{q['model']}, {q['device']}, {q['tokens']} tokens of the docs prefilled in {q['chunk']}-"
                        f"token steps: H2O's perplexity over sink + window's at a {quarter}-token budget, "
                        f"{q['sink_tokens']} sink tokens; "
                        + ", ".join(f"{b}: {ratio[b]:.3f}" for b in budgets if b != quarter)},
        "kv_h2o_decode_overhead_b64": {"value": round(cost[64]["overhead"], 3), "goal": 0.1, "command": gpu,
                                       "workload": shape.format(64)},
        "kv_h2o_decode_overhead_b1": {"value": round(cost[1]["overhead"], 3), "command": gpu,
                                      "workload": shape.format(1)},
    }


def plan() -> dict:
    """The capacity simulator against the committed serving runs (bench/plan_validate.py, CPU;
    profiles of one H200)."""
    val = load("plan", "validation.json")
    st = val["stats"]
    wl = (f"{st['runs']} committed serving runs predicted from their recorded commands, profiles of one H200, "
          "further rates simulated where the runs' own do not bound the prediction; against a measured lower "
          "bound only a shortfall counts (bench/results/plan/validation.md)")
    cmd = "python3 bench/plan_validate.py  # CPU"
    return {
        "plan_goodput_error_median": {"value": st["median_abs_error"], "workload": wl, "command": cmd},
        "plan_goodput_error_worst": {"value": st["worst_abs_error"], "workload": wl, "command": cmd},
        "plan_winner_agreement": {"value": st["winner_agreement"], "command": cmd,
                                  "workload": f"{st.get('winner_groups_judged', len(st['winners']))} of "
                                              f"{len(st['winners'])} groups of runs of one model, workload and GPU "
                                              "count (a measured lower bound leaves the rest open): the predicted "
                                              "winner is the measured one"},
        **adaptive(),
    }


def adaptive() -> dict:
    """The ratio policy against the best static split, simulated (bench/plan_adaptive.py, CPU)."""
    ad = load("plan", "adaptive", "adaptive.json")
    out = {}
    for p in ad["points"]:
        out[f"adaptive_vs_best_static_sim_{p['gpus']}"] = {
            "value": p["adaptive_vs_best_static"], "goal": 0.97, "command": ad["command"] + "  # CPU",
            "workload": f"Llama-3-8B H200 profile, {p['gpus']} GPUs whole, the Mooncake trace at its own arrival "
                        f"times, {ad['num_requests']} requests a probe, TPOT {ad['tpot_slo_s'] * 1000:g} ms: "
                        f"{p['adaptive']} {p['adaptive_goodput']:g} req/s against {p['best_static']} "
                        f"{p['best_static_goodput']:g} (bench/results/plan/adaptive/adaptive.md)"}
    return out


def device_of(command: str) -> str:
    """The machine a command's note names (`... # one H100`), else CPU for a CPU script."""
    note = command.rsplit("#", 1)[1].split("(")[0].split(";")[0].strip() if "#" in command else ""
    return note or ("CPU" if "_gpu.py" not in command else "unknown GPU")


def provenance(summary: dict, previous: dict) -> dict:
    """Every key names the machine and the date of its measurement. A key whose value is what
    the committed summary says keeps that entry's device and date; a new or changed value takes
    its own device (the result file's), else the one its command names, and its own date, else today's (a key
    measured again by another command is new); a kept entry keeps its `second_sitting` (a re-run's value,
    date and files). Keys
    the committed summary has that no function here makes (entered by hand with their result)
    stay as they are."""
    out = {}
    for k, v in summary.items():
        old = previous.get(k, {})
        same = old.get("value") == v["value"] and old.get("command") == v["command"] and "date" in old
        v["device"] = old["device"] if same else v.get("device") or device_of(v["command"])
        v["date"] = old["date"] if same else v.get("date") or datetime.date.today().isoformat()
        if same and "second_sitting" in old:  # a re-run's value beside it (issue 82's check), kept with it
            v["second_sitting"] = old["second_sitting"]
        out[k] = v
    return {**out, **{k: v for k, v in previous.items() if k not in out}}


def main() -> None:
    eng = load("engine_gpu_b64.json")
    dec = {r["batch"]: r for r in eng["decode"]}
    hf = {r["batch"]: r for r in eng["hf"]["decode"]}
    pre = {r["tokens"]: r for r in eng["prefill"]}
    wl_dec = "Llama-3-8B config, random bf16, context 1024, one H200"
    summary = {
        "decode_vs_hf_b64": {"value": round(dec[64]["tokens_per_s"] / hf[64]["tokens_per_s"], 2),
                             "workload": wl_dec + ", batch 64 (HF generate, same process)", "command": ENGINE},
        "decode_vs_hf_b1": {"value": round(dec[1]["tokens_per_s"] / hf[1]["tokens_per_s"], 2),
                            "workload": wl_dec + ", batch 1", "command": ENGINE},
        "decode_mbu": {"value": round(dec[64]["floor_ms"] / dec[64]["step_ms"], 3),
                       "workload": wl_dec + ", batch 64: bytes read per step / step time / measured copy bandwidth",
                       "command": ENGINE},
        "prefill_mfu": {"value": round(pre[4096]["frac_of_matmul"], 3),
                        "workload": "4096-token prompt, Llama-3-8B config, one H200, of the measured bf16 matmul "
                                    f"ceiling ({eng['ceilings']['matmul_TFLOPs']:.0f} TFLOP/s)", "command": ENGINE},
    }
    summary.update(one_round_trip())
    summary.update(kv_capacity())
    summary.update(speculative())
    summary.update(structured_output())
    summary.update(mixed_step())
    summary.update(colocated_one())
    summary.update(seeded_sampling())
    summary.update(overlap())
    summary.update(priority())
    summary.update(kv_int4())
    summary.update(kv_window())
    summary.update(kv_h2o())
    summary.update(attention_core())
    summary.update(moe())
    summary.update(ipc())
    summary.update(mla())
    summary.update(kv_tiers())
    summary.update(multi_gpu())
    summary.update(plan())
    summary.update(fp8())
    path = os.path.join(RES, "summary.json")
    with open(path) as f:
        previous = json.load(f)
    summary = provenance(summary, previous)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    for k, v in summary.items():
        print(f"{k:24s} {v['value']}")


if __name__ == "__main__":
    main()
