"""Engine on one GPU: decode step time against the HBM floor, prefill throughput against
the bf16 matmul ceiling, and Hugging Face transformers on the same model, same run.

Model: random weights with Llama-3-8B's config in bf16 (speed does not depend on the
values). Ceilings measured here: a large device-to-device copy (bytes read + written
per second) and an 8192^3 bf16 matmul.

    python bench/engine_gpu.py --out bench/results        # prints a table last
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}


def timed(fn, iters: int, warmup: int = 2) -> float:
    """Median seconds of fn() (synchronized)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


KERNEL_KINDS = (("moe experts", ("_moe_",)),
                ("attention", ("paged_decode", "flash", "fmha", "attn", "_mla_decode", "_combine")),
                ("kv store", ("store_kv",)), ("fp8 activation quantize", ("_quant_kernel",)),
                ("gemm", ("gemm", "gemv", "w8a16", "w8a8", "cutlass", "nvjet", "sm90_xmma", "matmul", "splitk")),
                ("fused elementwise", ("add_rmsnorm", "rope", "silu_mul")), ("memcpy / memset", ("memcpy", "memset")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other elementwise / reduce"


def profile_step(fn, steps: int = 5) -> dict:
    """GPU kernel time of one fn() call, by kernel kind (torch profiler, CUPTI; graph replays
    included), against the wall time of the same calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    kinds: dict[str, dict] = {}
    top: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        k = kinds.setdefault(kernel_kind(e.name), {"us": 0.0, "launches": 0})
        k["us"] += us / steps
        k["launches"] += 1 / steps
        row = top.setdefault(e.name, [0.0, 0.0])
        row[0] += us / steps
        row[1] += 1 / steps
    busy = sum(k["us"] for k in kinds.values())
    return {"wall_us": wall * 1e6, "gpu_busy_us": busy, "kinds": kinds,
            "top": sorted(([n[:90], us, n_] for n, (us, n_) in top.items()), key=lambda x: -x[1])[:20]}


def profile_lines(title: str, p: dict, ref: str) -> list[str]:
    lines = ["", f"### {title}: GPU kernel time by kind (torch profiler)", "",
             f"Wall {p['wall_us']:.0f} us per call, GPU busy {p['gpu_busy_us']:.0f} us; {ref}.", "",
             "| kind | us per call | launches per call |", "|---|---|---|"]
    for kind, k in sorted(p["kinds"].items(), key=lambda kv: -kv[1]["us"]):
        lines.append(f"| {kind} | {k['us']:.0f} | {k['launches']:.0f} |")
    lines += ["", "| kernel (top by time) | us per call | launches per call |", "|---|---|---|"]
    return lines + [f"| `{n}` | {us:.1f} | {rest[0]:.0f} |" if rest else f"| `{n}` | {us:.1f} | |"
                    for n, us, *rest in p["top"]]


def ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), 20)
    copy_bw = 2 * a.numel() * 2 / t
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: m @ k, 20, warmup=5)
    return {"copy_GBps": copy_bw / 1e9, "matmul_TFLOPs": 2 * 8192**3 / t / 1e12}


def model_bytes(cfg: dict) -> tuple[int, int]:
    """(parameters read per decode step excluding the embedding table, all parameters)."""
    h, ff, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    layer = h * (h + 2 * kv) + h * h + 3 * h * ff + 2 * h
    body = L * layer + h + V * h  # + final norm + lm_head
    return body, body + V * h


def decode_batch(batch: int, ctx: int, vocab: int, blocks_per_seq: int) -> list:
    """`batch` decode rows of random tokens, each at `ctx` tokens of context in its own blocks: one
    decode step's schedule for ModelRunner.execute."""
    from pdserve.engine.core.request import Request
    from pdserve.engine.core.scheduler import ScheduledRequest
    from pdserve.engine.sampling_params import SamplingParams

    greedy, out = SamplingParams(temperature=0, max_tokens=16), []
    for i in range(batch):
        toks = torch.randint(0, vocab, (ctx + 1,)).tolist()
        r = Request(f"d{batch}-{i}", toks[:ctx], greedy, max_tokens=16)
        r.append_token(toks[ctx])
        r.num_computed_tokens = ctx
        out.append(ScheduledRequest(r, 1, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))))
    return out


def bench_engine(model_dir: str, cfg: dict, batches: list[int], ctx: int, prefill_lens: list[int],
                 ceil: dict, fused_ops: bool | None = None, profile: bool = False) -> tuple[list, list, bool]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core.request import Request
    from pdserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
    from pdserve.engine.exec.model_runner import ModelRunner
    from pdserve.engine.exec.runner_settings import RunnerSettings
    from pdserve.engine.sampling_params import SamplingParams

    bs = 16
    blocks_per_seq = ctx // bs + 1
    num_blocks = max(max(batches) * blocks_per_seq, max(prefill_lens) // bs + 1) + 8
    ec = EngineConfig(model=model_dir, dtype="bfloat16", num_gpu_blocks_override=num_blocks,
                      max_model_len=max(max(prefill_lens), ctx) + 64, max_num_batched_tokens=max(prefill_lens),
                      max_num_seqs=max(batches), fused_ops=fused_ops)
    ec.resolve(model_dir)
    runner = ModelRunner(RunnerSettings.of(ec), load_format="dummy")
    runner.kv.normal_()  # never time on zeros
    greedy = SamplingParams(temperature=0, max_tokens=16)
    vocab = cfg["vocab_size"]
    body_params, _ = model_bytes(cfg)
    kv_token_bytes = runner.layout.block_bytes // bs
    decode_rows = []
    for B in tqdm(batches, desc="decode"):
        sched = decode_batch(B, ctx, vocab, blocks_per_seq)
        t = timed(lambda s=sched: runner.execute(SchedulerOutput(s)), 10, warmup=3)
        graphs, runner.graphs = runner.graphs, None  # the same step without CUDA graphs
        t_eager = timed(lambda s=sched: runner.execute(SchedulerOutput(s)), 5, warmup=2)
        runner.graphs = graphs
        prof = profile_step(lambda s=sched: runner.execute(SchedulerOutput(s))) if profile else None
        read = body_params * 2 + B * (ctx + 1) * kv_token_bytes + B * cfg["hidden_size"] * 2
        floor = read / (ceil["copy_GBps"] * 1e9)
        decode_rows.append({"batch": B, "context": ctx, "step_ms": t * 1e3, "eager_ms": t_eager * 1e3,
                            "floor_ms": floor * 1e3,
                            "ratio_to_floor": t / floor, "tokens_per_s": B / t,
                            "bytes_read_GB": read / 1e9, **({"profile": prof} if prof else {})})
    prefill_rows = []
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    for n in tqdm(prefill_lens, desc="prefill"):
        toks = torch.randint(0, vocab, (n,)).tolist()
        r = Request(f"p{n}", toks, greedy, max_tokens=16)
        s = [ScheduledRequest(r, n, list(range(-(-n // bs))))]
        t = timed(lambda s=s: runner.execute(SchedulerOutput(s)), 5, warmup=2)
        prof = profile_step(lambda s=s: runner.execute(SchedulerOutput(s)), steps=2) if profile else None
        flops = 2 * n * (body_params - cfg["vocab_size"] * h) + 2 * h * vocab + 2 * n * n * h * L
        prefill_rows.append({"tokens": n, "ms": t * 1e3, "tokens_per_s": n / t, "TFLOPs": flops / t / 1e12,
                             "frac_of_matmul": flops / t / 1e12 / ceil["matmul_TFLOPs"],
                             **({"profile": prof} if prof else {})})
    return decode_rows, prefill_rows, ec.fused_ops  # the runner and its KV cache are freed on return


def bench_hf(cfg: dict, ctx: int, hf_batches: list[int], new_tokens: int, prefill_lens: list[int]) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(conf).eval()
    torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        p.data.uniform_(-0.02, 0.02)
    model.generation_config.eos_token_id = None
    out = {"decode": [], "prefill": []}
    vocab = cfg["vocab_size"]
    with torch.no_grad():
        for B in tqdm(hf_batches, desc="hf generate"):
            x = torch.randint(0, vocab, (B, ctx), device="cuda")
            mask = torch.ones_like(x)
            def gen(n, x=x, mask=mask):
                return model.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)

            t1 = timed(lambda g=gen: g(1), 2, warmup=1)
            tn = timed(lambda g=gen: g(new_tokens), 2, warmup=1)
            out["decode"].append({"batch": B, "context": ctx,
                                  "tokens_per_s": B * (new_tokens - 1) / (tn - t1),
                                  "step_ms": (tn - t1) / (new_tokens - 1) * 1e3})
        h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
        body, _ = model_bytes(cfg)
        for n in tqdm(prefill_lens, desc="hf forward"):
            x = torch.randint(0, vocab, (1, n), device="cuda")
            t = timed(lambda x=x: model(x, use_cache=False, logits_to_keep=1), 5, warmup=2)
            flops = 2 * n * (body - vocab * h) + 2 * h * vocab + 2 * n * n * h * L
            out["prefill"].append({"tokens": n, "ms": t * 1e3, "tokens_per_s": n / t, "TFLOPs": flops / t / 1e12})
    return out


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="engine_gpu", help="file stem of the results")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--prefill", default="2048,4096,8192")
    ap.add_argument("--hf-batches", default="1,64")
    ap.add_argument("--hf-new-tokens", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine's fused Triton elementwise kernels (default: the engine's, on for CUDA)")
    ap.add_argument("--profile", action="store_true", help="kernel time by kind of each decode step (torch profiler)")
    return ap


def main() -> None:
    args = parser().parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    prefill_lens = [int(n) for n in args.prefill.split(",")]
    os.makedirs(args.out, exist_ok=True)
    ceil = ceilings()
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(LLAMA3_8B, f)
        decode, prefill, fused = bench_engine(d, LLAMA3_8B, batches, args.ctx, prefill_lens, ceil, args.fused_ops,
                                       args.profile)
    torch.cuda.empty_cache()
    hf = None if args.no_hf else bench_hf(LLAMA3_8B, args.ctx, [int(b) for b in args.hf_batches.split(",")],
                                           args.hf_new_tokens, prefill_lens)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fused_ops": fused,
              "ceilings": ceil, "decode": decode, "prefill": prefill, "hf": hf}
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# Engine on {result['device']} (Llama-3-8B config, random bf16 weights, "
             f"fused elementwise kernels {'on' if fused else 'off'})", "",
             f"Ceilings measured in the same run: copy {ceil['copy_GBps']:.0f} GB/s (read + write), "
             f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s.", "",
             f"## Decode (one step, context {args.ctx})", "",
             "| batch | step ms (CUDA graph) | eager ms | HBM floor ms | step / floor | tok/s | HF tok/s |",
             "|---|---|---|---|---|---|---|"]
    hf_dec = {r["batch"]: r for r in (hf or {}).get("decode", [])}
    for r in decode:
        hf_tps = f"{hf_dec[r['batch']]['tokens_per_s']:.0f}" if r["batch"] in hf_dec else "-"
        lines.append(f"| {r['batch']} | {r['step_ms']:.2f} | {r['eager_ms']:.2f} | {r['floor_ms']:.2f} | "
                     f"{r['ratio_to_floor']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {hf_tps} |")
    for b, r in hf_dec.items():
        if b not in {x["batch"] for x in decode}:
            lines.append(f"| {b} (HF only) | - | - | - | - | - | {r['tokens_per_s']:.0f} |")
    for r in decode:
        if r.get("profile"):
            lines += profile_lines(f"Decode step at batch {r['batch']}", r["profile"],
                                   f"HBM floor {r['floor_ms'] * 1e3:.0f} us")
    lines += ["", "## Prefill (one request)", "",
              "| tokens | ms | tok/s | TFLOP/s | of matmul ceiling | HF TFLOP/s |", "|---|---|---|---|---|---|"]
    hf_pre = {r["tokens"]: r for r in (hf or {}).get("prefill", [])}
    for r in prefill:
        hf_t = f"{hf_pre[r['tokens']]['TFLOPs']:.0f}" if r["tokens"] in hf_pre else "-"
        lines.append(f"| {r['tokens']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {r['TFLOPs']:.0f} | "
                     f"{r['frac_of_matmul']:.0%} | {hf_t} |")
    for r in prefill:
        if r.get("profile"):
            lines += profile_lines(f"Prefill of {r['tokens']} tokens", r["profile"],
                                   f"{r['TFLOPs']:.0f} TFLOP/s overall")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        xs = [str(r["batch"]) for r in decode]
        ax[0].bar([i - 0.2 for i in range(len(xs))], [r["step_ms"] for r in decode], 0.4, label="pdserve step")
        ax[0].bar([i + 0.2 for i in range(len(xs))], [r["floor_ms"] for r in decode], 0.4, label="HBM floor")
        ax[0].set_xticks(range(len(xs)), xs)
        ax[0].set(xlabel="batch", ylabel="ms", title=f"decode step, ctx {args.ctx}")
        ax[0].legend()
        ax[1].plot([r["tokens"] for r in prefill], [r["TFLOPs"] for r in prefill], "o-", label="pdserve")
        if hf_pre:
            ax[1].plot(list(hf_pre), [r["TFLOPs"] for r in hf_pre.values()], "s--", label="HF transformers")
        ax[1].axhline(ceil["matmul_TFLOPs"], color="gray", ls=":", label="matmul ceiling")
        ax[1].set(xlabel="prompt tokens", ylabel="TFLOP/s", title="prefill")
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"{args.name}.png"), dpi=110)
    except ImportError:
        pass
    print(md)


if __name__ == "__main__":
    main()
