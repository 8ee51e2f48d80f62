"""DeepSeek-V2-Lite's latent attention on one GPU: what its KV costs and how fast its decode
kernel reads it.

    python bench/mla_gpu.py --out bench/results/mla

1. KV bytes per token and the requests that fit (`pdserve plan`'s arithmetic, bf16, 4096 in /
   256 out, 0.9 of an H200) against a GQA model of about the same weight size (Qwen3-14B's shape:
   40 layers, 8 KV heads of 128).
2. The MLA decode kernel (ops/triton_mla.py, bf16) at batch 1-128 x context 1K-32K against the
   HBM floor of the latent rows it must read (576 values x 2 bytes per token and layer, over the
   same run's measured device copy bandwidth), V2-Lite's 16 heads; the query's absorption and
   W_UV are not in the kernel's time.
3. `--steps`: the whole model (dummy bf16 weights at V2-Lite's shape) through the engine's runner:
   decode steps at batch 1 and 64 (context --ctx) against the HBM floor of what a step must read
   (every non-expert weight but the embedding table, the experts its batch routes to, the latent
   rows), and a 4096-token prefill's MFU on the activated FLOPs (bench/moe_gpu.bench_model).
Prints a short table last; writes mla_gpu.md, .json and .png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_gpu import ceilings, profile_lines  # noqa: E402

# head_dim: only bench_model's attention FLOPs read it (QK^T over 192 values and PV over 128 per head:
# the FLOPs of a head of 160); the engine reads MLA's dims
V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, head_dim=160,
               hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
               num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6,
               n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
               rms_norm_eps=1e-6, topk_method="greedy", torch_dtype="bfloat16",
               rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
QWEN3_14B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=5120,
                 intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, torch_dtype="bfloat16")


def capacity() -> dict:
    from pdserve.plan import plan

    out = {}
    for name, cfg in (("deepseek-v2-lite (MLA)", V2_LITE), ("qwen3-14b shape (GQA 8x128)", QWEN3_14B)):
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        p = plan(d, [(4096, 256)], gpu="h200", max_model_len=8192)
        out[name] = p
    return out


def graph_time(fn, n: int = 20, reps: int = 5) -> float:
    """Seconds per call of `fn`, n calls captured in one CUDA graph (no launch overhead in the
    time: a decode step replays the kernel inside its graph), the median of `reps` replays."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / n)
    return sorted(times)[reps // 2]


def eager_time(fn, n: int = 10) -> float:
    """Seconds per call of `fn` run eagerly (a prefill chunk's attention runs between the graphs)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def form_sweep(chunks: list[int], contexts: list[int]) -> list[dict]:
    """One chunk of `q` new tokens over a context (bf16, V2-Lite's attention) in each form of
    models/mla_attention.py: expanded (the context's keys and values built, then SDPA) and absorbed
    (each token a decode-kernel row), the layer's attention with its absorption GEMMs."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.models.attention import AttentionMetadata
    from pdserve.engine.models.mla_attention import MLAPagedAttention

    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(V2_LITE, f)
    mla, heads, page = ModelConfig.from_dir(d).mla, V2_LITE["num_attention_heads"], 16
    proj = torch.nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False,
                           device="cuda", dtype=torch.bfloat16)
    attn = MLAPagedAttention(heads, mla, proj, use_triton=True)
    rows = []
    for ctx in contexts:
        blocks = -(-ctx // page)
        cache = torch.randn(blocks, page, 1, mla.latent_dim, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(blocks, device="cuda", dtype=torch.int32)[None]
        for n in chunks:
            q = torch.randn(n, heads, mla.qk_head_dim, device="cuda", dtype=torch.bfloat16)
            row = {"context": ctx, "chunk": n}
            for form, limit in (("expanded_us", 0), ("absorbed_us", n)):
                attn.absorb_max_query = limit
                meta = AttentionMetadata.build(torch.zeros(n, dtype=torch.int64, device="cuda"), tables, [ctx], [n],
                                               device="cuda")
                row[form] = eager_time(lambda m=meta, q=q, c=cache: attn(q, None, None, c, None, m)) * 1e6
            rows.append(row)
            print(f"forms: ctx {ctx} chunk {n}: expanded {row['expanded_us']:.0f} us, absorbed "
                  f"{row['absorbed_us']:.0f} us", flush=True)
    return rows


def kernel_sweep(batches: list[int], contexts: list[int], copy_gbps: float) -> list[dict]:
    from pdserve.engine.ops.triton_mla import mla_decode_triton

    heads, rank, rope, page = 16, 512, 64, 16
    rows = []
    for ctx in contexts:
        for b in batches:
            blocks = b * (ctx // page)
            if blocks * page * (rank + rope) * 2 > 40 << 30:
                continue
            cache = torch.randn(blocks, page, 1, rank + rope, device="cuda", dtype=torch.bfloat16)
            tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(b, ctx // page)
            lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
            q_lat = torch.randn(b, heads, rank, device="cuda", dtype=torch.bfloat16)
            q_rope = torch.randn(b, heads, rope, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q_lat)
            args = (q_lat, q_rope, cache, tables, lens, 0.1)
            t = graph_time(lambda a=args, o=out: mla_decode_triton(*a, out=o))
            read = b * ctx * (rank + rope) * 2
            floor = read / (copy_gbps * 1e9)
            rows.append({"batch": b, "context": ctx, "kernel_us": t * 1e6, "floor_us": floor * 1e6,
                         "ratio_to_floor": t / floor, "GBps": read / t / 1e9})
            del cache, tables
            torch.cuda.empty_cache()
    return rows


TILES = [dict(block_n=n, warps=w, stages=st) for n, w, st in
         ((128, 8, 2), (32, 4, 2), (64, 8, 2), (128, 8, 3), (256, 8, 2), (128, 16, 2), (256, 16, 2))]
TILES += [dict(splits=s) for s in (1, 2, 3, 4, 5, 8, 16)]  # the default tile, key splits forced


def tile_sweep(copy_gbps: float, batch: int = 64, ctx: int = 8192) -> list[dict]:
    """The kernel's tile settings at one shape (the floor-ratio key's): which the default should be."""
    from pdserve.engine.ops.triton_mla import mla_decode_triton

    heads, rank, rope, page = 16, 512, 64, 16
    blocks = batch * (ctx // page)
    cache = torch.randn(blocks, page, 1, rank + rope, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, ctx // page)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q_lat = torch.randn(batch, heads, rank, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q_lat)
    floor = batch * ctx * (rank + rope) * 2 / (copy_gbps * 1e9)
    rows = []
    for tile in TILES:
        try:
            t = graph_time(lambda kw=tile: mla_decode_triton(q_lat, q_rope, cache, tables, lens, 0.1, out=out, **kw))
        except Exception as e:  # noqa: BLE001 - a setting that does not compile (shared memory) is reported
            rows.append({**tile, "error": type(e).__name__})
            continue
        rows.append({**tile, "kernel_us": t * 1e6, "ratio_to_floor": t / floor})
    return rows


def _tile_row(r: dict) -> str:
    what = f"splits {r['splits']}" if "splits" in r else f"{r['block_n']} | {r['warps']} | {r['stages']}"
    if "splits" in r:
        what = f"128 | 8 | 2, {what}"
    return f"| {what} | {r.get('kernel_us', float('nan')):.1f} | {r.get('ratio_to_floor', float('nan')):.2f} " \
           f"{r.get('error', '')} |"


def markdown(res: dict) -> str:
    cap = res["capacity"]
    lines = ["# DeepSeek-V2-Lite's latent attention on one GPU", "",
             f"{res['device']}; `python bench/mla_gpu.py --out bench/results/mla`. Device copy "
             f"{res['ceil']['copy_GBps']:.0f} GB/s (the floor's bandwidth).", "",
             "## KV per token and requests that fit (4096 in / 256 out, bf16, 0.9 of an H200)", "",
             "| model | KV per token | weights | KV budget | requests that fit |", "|---|---|---|---|---|"]
    for name, p in cap.items():
        lines.append(f"| {name} | {p['kv_bytes_per_token'] / 1024:.1f} KiB | {p['weight_bytes_rank'] / 1e9:.1f} GB | "
                     f"{p['kv_budget_bytes_rank'] / 1e9:.1f} GB | {p['max_concurrency_paged']} |")
    if "kernel" in res:
        lines += ["", "## The MLA decode kernel against the HBM floor of the latent rows (16 heads, bf16)", "",
                  "| batch | context | kernel (us) | floor (us) | kernel / floor | GB/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['context']} | {r['kernel_us']:.1f} | {r['floor_us']:.1f} | "
                  f"{r['ratio_to_floor']:.2f} | {r['GBps']:.0f} |" for r in res["kernel"]]
    if "steps" in res:
        st = res["steps"]
        lines += ["", f"## The model's steps (dummy weights, {st['params_B']:.1f}B parameters)", "",
                  "| batch | context | step (ms) | HBM floor (ms) | step / floor | tok/s | experts read |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | "
                  f"{r['ratio_to_floor']:.2f} | {r['tokens_per_s']:.0f} | {r['experts_read']} |" for r in st["decode"]]
        for p in st["prefill"]:
            lines += ["", f"Prefill of {p['tokens']} tokens: {p['ms']:.1f} ms, {p['TFLOPs']:.0f} TFLOP/s on the "
                          f"activated FLOPs, {p['frac_of_matmul']:.2f} of the bf16 matmul ceiling"]
        for r in st["decode"] + st["prefill"]:
            if "profile" in r:
                what = f"decode, batch {r['batch']}" if "batch" in r else f"prefill of {r['tokens']} tokens"
                lines += profile_lines(what, r["profile"], "graph replays included")
    if "forms" in res:
        lines += ["", "## A prefill chunk's attention by form (one layer, eager; models/mla_attention.py)", "",
                  "| context | chunk | expanded (us) | absorbed (us) | faster |", "|---|---|---|---|---|"]
        lines += [f"| {r['context']} | {r['chunk']} | {r['expanded_us']:.0f} | {r['absorbed_us']:.0f} | "
                  f"{'absorbed' if r['absorbed_us'] < r['expanded_us'] else 'expanded'} |" for r in res["forms"]]
    if "tiles" not in res:
        return "\n".join(lines) + "\n"
    lines += ["", "Tile settings at batch 64 x 8K (the default is the first row's):", "",
              "| rows per tile | warps | stages | kernel (us) | kernel / floor |", "|---|---|---|---|---|"]
    lines += [_tile_row(r) for r in res["tiles"]]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if "kernel" not in res:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for ctx in sorted({r["context"] for r in res["kernel"]}):
        rs = [r for r in res["kernel"] if r["context"] == ctx]
        ax.plot([r["batch"] for r in rs], [r["ratio_to_floor"] for r in rs], "o-", label=f"context {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axhline(1.3, color="k", ls="--", lw=0.8, label="goal 1.3")
    ax.set_xlabel("batch")
    ax.set_ylabel("kernel time / HBM floor")
    ax.set_title("MLA decode kernel, DeepSeek-V2-Lite heads (16), bf16", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/mla")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="1024,4096,8192,32768")
    ap.add_argument("--steps", action="store_true", help="also the whole model's decode steps and prefill")
    ap.add_argument("--ctx", type=int, default=4096, help="the decode steps' context")
    ap.add_argument("--profile", action="store_true", help="with --steps: each step's kernels by kind (torch profiler)")
    ap.add_argument("--forms", action="store_true", help="a prefill chunk's attention in each form, by chunk length")
    ap.add_argument("--chunks", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--kernel", action=argparse.BooleanOptionalAction, default=True,
                    help="the decode kernel's sweeps (--no-kernel: the steps only)")
    return ap


def main() -> None:
    args = parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceil = ceilings()
    res = {"device": torch.cuda.get_device_name(0), "ceil": ceil, "capacity": capacity(),
           "command": "python bench/mla_gpu.py " + " ".join(sys.argv[1:])}
    if args.steps:
        from moe_gpu import bench_model

        res["steps"] = bench_model(V2_LITE, [1, 64], args.ctx, 4096, ceil, profile=args.profile)
    if args.forms:
        res["forms"] = form_sweep([int(x) for x in args.chunks.split(",")], [1024, 4096, 16384])
    if args.kernel:
        res["tiles"] = tile_sweep(ceil["copy_GBps"])
        res["kernel"] = kernel_sweep([int(x) for x in args.batches.split(",")],
                                     [int(x) for x in args.contexts.split(",")], ceil["copy_GBps"])
    # --no-kernel: the steps' files, or the forms' alone
    name = os.path.join(args.out, "mla_gpu" if args.kernel else "mla_gpu_steps" if args.steps else "mla_gpu_forms")
    with open(f"{name}.json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    text = markdown(res)
    with open(f"{name}.md", "w") as f:
        f.write(text)
    plot(res, f"{name}.png")
    print(text)


if __name__ == "__main__":
    main()
