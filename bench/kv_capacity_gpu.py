"""KV capacity on one GPU (Llama-3-8B shape, random bf16 weights): paged vs contiguous
concurrency at the same memory, quantized blocks per GPU, the host tier on the Mooncake
trace, and a restart with the tier persisted.

    python bench/kv_capacity_gpu.py --tokenizer TOK --out bench/results/kv_capacity   # table last

1. concurrency  a mixed-length burst (the trace's lengths x 0.25) on a fixed KV budget:
                requests the engine runs at once (peak; mean while others wait) vs what a
                contiguous allocator reserving max_model_len per request admits; `pdserve
                plan`'s prediction for the same budget beside them.
2. host tier    the trace (x 0.25 lengths, 16 output tokens) replayed at its timestamps on
                two engines sharing the GPU (one process, stepped in turn: the same for both
                runs), each with a small GPU cache; requests go to the engine whose tiers
                hold the longest prefix (GPU block 1, host block 0.8, as the registry scores),
                else by the first block's hash. Host tier off vs on: prefix-hit rate, TTFT.
3. restart      a 6K-token prompt served, the engine closed (tier persisted) and started
                again: TTFT of a request sharing the prefix, cold vs after the restart.
--shape tiny runs the same on CPU with a tiny model (a check of the script, not a result).
Parts 2 and 3 run eagerly (no CUDA graph capture: 16 output tokens, prefill-bound).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_gpu import build_model  # noqa: E402

from pdserve import SamplingParams  # noqa: E402
from pdserve.bench.workloads import DEFAULT_TRACE, trace_workload  # noqa: E402
from pdserve.engine.base.hashing import hash_block_tokens  # noqa: E402
from pdserve.engine.base.kv_layout import kv_layout  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.plan import plan  # noqa: E402


def engine(model: str, cuda: bool, **kw) -> LLMEngine:
    dtype = "bfloat16" if cuda else "float32"
    return LLMEngine(EngineConfig(model=model, dtype=dtype, load_format="dummy", max_model_len=8192, **kw))


def concurrency(model: str, cuda: bool, budget: int, n: int) -> dict:
    reqs = trace_workload(DEFAULT_TRACE, n, length_scale=0.25, max_input_len=6000, max_output_len=64, salt=1)
    eng = engine(model, cuda, kv_cache_memory_bytes=budget, max_num_seqs=512, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    for i, (r, p) in enumerate(zip(reqs, params)):
        eng.add_request(r.prompt, p, request_id=str(i))
    running, saturated = [], []
    while eng.has_unfinished_requests():
        eng.step()
        running.append(len(eng.scheduler.running))
        if eng.scheduler.waiting:
            saturated.append(running[-1])
    blocks = eng.kv.num_blocks
    p = plan(model, [(len(r.prompt), r.max_tokens) for r in reqs], kv_cache_memory_bytes=budget,
             dtype=eng.config.dtype, max_model_len=8192, max_num_seqs=512)
    eng.close()
    contiguous = blocks // (8192 // 16)
    return {"requests": n, "kv_blocks": blocks, "peak_running": max(running),
            "mean_running_saturated": statistics.mean(saturated) if saturated else None,
            "contiguous_admits": contiguous, "plan_paged": p["max_concurrency_paged"],
            "peak_over_contiguous": max(running) / contiguous if contiguous else None,
            "preemptions": eng.scheduler.num_preemptions}


def tiers_score(eng: LLMEngine, hashes: list[bytes]) -> float:
    score = 0.0
    for h in hashes:
        if eng.kv.pool.lookup(h) is not None:
            score += 1.0
        elif eng.kv.host is not None and h in eng.kv.host:
            score += 0.8
        else:
            break
    return score


def host_tier(model: str, cuda: bool, gpu_budget: int, host_gib: float, n: int, time_scale: float) -> dict:
    reqs = trace_workload(DEFAULT_TRACE, n, length_scale=0.25, max_input_len=6000, max_output_len=16,
                          time_scale=time_scale, salt=2)
    engines = [engine(model, cuda, kv_cache_memory_bytes=gpu_budget, kv_offloading_size=host_gib, enforce_eager=True)
               for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    t0, i, ttft, arrival = time.monotonic(), 0, {}, {}
    while i < len(reqs) or any(e.has_unfinished_requests() for e in engines):
        now = time.monotonic() - t0
        while i < len(reqs) and reqs[i].arrival <= now:
            hashes = hash_block_tokens(reqs[i].prompt, 16)
            scores = [tiers_score(e, hashes) for e in engines]
            w = max(range(2), key=lambda k: scores[k]) if max(scores) > 0 else hashes[0][0] % 2 if hashes else 0
            engines[w].add_request(reqs[i].prompt, params, request_id=str(i))
            arrival[str(i)] = t0 + reqs[i].arrival
            i += 1
        for e in engines:
            for out in e.step():
                if out.request_id not in ttft and out.outputs[0].token_ids:
                    ttft[out.request_id] = time.monotonic() - arrival[out.request_id]
        if not any(e.has_unfinished_requests() for e in engines) and i < len(reqs):
            time.sleep(max(0.0, min(0.01, reqs[i].arrival - (time.monotonic() - t0))))
    st = [e.stats() for e in engines]
    for e in engines:
        e.close()
    q, hits = sum(s.cache.prefix_queries for s in st), sum(s.cache.prefix_hits for s in st)
    xs = sorted(ttft.values())
    return {"host_gib": host_gib, "requests": len(reqs), "gpu_blocks": engines[0].kv.num_blocks,
            "time_scale": time_scale, "prefix_hit_rate": hits / q if q else 0.0,
            "host_hit_tokens": sum(s.cache.host_hit_tokens or 0 for s in st),
            "load_back_s": sum(s.cache.load_back_seconds or 0.0 for s in st),
            "ttft_p50_s": xs[len(xs) // 2], "ttft_p90_s": xs[int(len(xs) * 0.9)], "wall_s": time.monotonic() - t0}


def ttft(eng: LLMEngine, prompt: list[int], cuda: bool) -> float:
    """Seconds to the first token of one request alone (max_tokens 1), stepping the engine."""
    t = time.perf_counter()
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def restart(model: str, cuda: bool, host_gib: float) -> dict:
    prefix = list(range(1000, 7000))

    with tempfile.TemporaryDirectory() as d:
        kw = dict(kv_cache_memory_bytes=2 << 30, kv_offloading_size=host_gib, kv_persist_dir=d, enforce_eager=True)
        eng = engine(model, cuda, **kw)
        ttft(eng, list(range(5, 300)), cuda)  # warm-up (kernels, allocator)
        cold = ttft(eng, prefix + [1, 2, 3], cuda)
        gpu_hit = ttft(eng, prefix + [7, 8, 9], cuda)  # the prefix still on the GPU: no load-back
        eng.close()  # writes the tier
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)  # index + blocks
        t = time.perf_counter()
        eng = engine(model, cuda, **kw)
        start_s = time.perf_counter() - t
        status = eng.persist_status
        ttft(eng, list(range(5, 300)), cuda)
        warm = ttft(eng, prefix + [4, 5, 6], cuda)
        hits = eng.stats().cache.host_hit_tokens
        eng.close()
    return {"prompt_tokens": len(prefix) + 3, "ttft_cold_s": cold, "ttft_after_restart_s": warm,
            "ttft_gpu_hit_s": gpu_hit,
            "restore": status, "file_bytes": size, "engine_start_s": start_s, "host_hit_tokens": hits}


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", choices=("llama3-8b", "tiny"), default="llama3-8b")
    ap.add_argument("--out", default="bench/results/kv_capacity")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--time-scale", type=float, default=3.0, help="trace replay speed-up")
    ap.add_argument("--parts", default="concurrency,host,restart")
    ap.add_argument("--burst", type=int, default=128, help="requests of part 1's burst (CI's tiny check: fewer)")
    ap.add_argument("--gpu-blocks", type=int, default=800, help="each engine's GPU cache in part 2")
    return ap


def main() -> None:
    args = parser().parse_args()
    parts = args.parts.split(",")
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as d:
        if args.shape == "tiny":
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from helpers import save_tiny

            model = save_tiny("llama", d, args.tokenizer, max_positions=32768)
            unit = 4096  # bytes of a tiny-llama block (float32)
        else:
            model = build_model(d, args.tokenizer)
            unit = 2 << 20  # an 8B block in bf16
        res = {"device": torch.cuda.get_device_name() if cuda else "CPU", "shape": args.shape}
        if "concurrency" in parts:
            res["concurrency"] = concurrency(model, cuda, 5000 * unit, args.burst)
        if "host" in parts:
            res["host_tier"] = [host_tier(model, cuda, args.gpu_blocks * unit, g, args.requests, args.time_scale)
                                for g in (0, 8000 * unit / (1 << 30))]
        if "restart" in parts:
            res["restart"] = restart(model, cuda, 4000 * unit / (1 << 30))
        q = {}
        for fmt in ("auto", "fp8", "int8"):
            cfg = EngineConfig(model=model, dtype="bfloat16", kv_cache_dtype=fmt)
            cfg.resolve(model)
            q[fmt] = kv_layout(cfg).block_bytes
        res["blocks_per_byte_vs_bf16"] = {k: q["auto"] / v for k, v in q.items()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"kv_capacity_{args.shape}_{'_'.join(parts)}.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = render(res)
    with open(os.path.join(args.out, f"kv_capacity_{args.shape}_{'_'.join(parts)}.md"), "w") as f:
        f.write(md)
    print(md)


def render(res: dict) -> str:
    lines = [f"# KV capacity, {res['shape']} on {res['device']}", "", "| measure | value |", "|---|---|",
             f"| blocks per byte vs bf16: fp8 / int8 | {res['blocks_per_byte_vs_bf16']['fp8']:.2f}x / "
             f"{res['blocks_per_byte_vs_bf16']['int8']:.2f}x |"]
    if "concurrency" in res:
        c = res["concurrency"]
        lines += [
            f"| paged: peak concurrent requests ({c['kv_blocks']} blocks, {c['requests']} mixed-length requests) "
            f"| {c['peak_running']} (mean {c['mean_running_saturated'] or 0:.1f} while others waited; plan predicts "
            f"{c['plan_paged']}) |",
            f"| contiguous (max_model_len 8192 reserved each) | {c['contiguous_admits']} |",
            f"| paged / contiguous | {c['peak_over_contiguous']:.2f}x |"]
    if "host_tier" in res:
        off, on = res["host_tier"]
        lines += [
            f"| trace ({on['requests']} requests), 2 engines, small GPU cache: prefix-hit rate host tier off / on | "
            f"{off['prefix_hit_rate']:.1%} / {on['prefix_hit_rate']:.1%} |",
            f"| TTFT p50 off / on (s) | {off['ttft_p50_s']:.3f} / {on['ttft_p50_s']:.3f} |",
            f"| TTFT p90 off / on (s) | {off['ttft_p90_s']:.3f} / {on['ttft_p90_s']:.3f} |",
            f"| host-tier load-back time (s, {on['host_hit_tokens']} tokens) | {on['load_back_s']:.3f} |"]
    if "restart" in res:
        r = res["restart"]
        lines += [
            f"| restart: TTFT of a known {r['prompt_tokens']}-token prefix, cold / after restart (host tier "
            f"from disk) / prefix on the GPU (s) | {r['ttft_cold_s']:.3f} / {r['ttft_after_restart_s']:.3f} / "
            f"{r.get('ttft_gpu_hit_s', float('nan')):.3f} |",
            f"| restart: file, engine start | {r['file_bytes'] / 1e9:.2f} GB, {r['engine_start_s']:.1f} s "
            f"({r['restore'].split(' from ')[0]}) |"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
