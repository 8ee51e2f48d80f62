"""Mixture-of-experts on one GPU: the fused-MoE kernel against the same GEMMs run expert by
expert through torch, and the engine on Qwen3-30B-A3B's shape (and the dense Qwen3-32B's):
decode steps against the HBM floor of the bytes a step must read, prefill against the bf16
matmul ceiling on the FLOPs a token activates. Random weights (speed does not depend on them).

    python bench/moe_gpu.py --out bench/results/moe        # prints a table last

Kernel: Qwen3-30B-A3B's experts (128 of hidden 2048 x intermediate 768, top-8), random routing
(softmax of Gaussian logits); the fused kernel timed replayed in a CUDA graph (as decode steps run
it) and eager, the per-expert torch path eager (it syncs with the host), medians.
Engine floor: the non-expert weights once, the experts the step's batch routes to (counted in
the step), the KV the batch reads, over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_gpu import ceilings, profile_lines, profile_step, timed  # noqa: E402
from prefill_attention_gpu import timed_graph  # noqa: E402

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120,
    "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}


# (experts, top_k, hidden, intermediate) of the routed experts --experts sweeps
EXPERT_SHAPES = {"qwen3_moe": (128, 8, 2048, 768), "deepseek_v2_lite": (64, 6, 2048, 1408)}


def qwen3_moe_experts(shape: str = "qwen3_moe"):
    """Qwen3-30B-A3B's experts (or another of EXPERT_SHAPES) with random bf16 weights: (E, top_k,
    hidden, intermediate, the generator the inputs are drawn from, w_gate_up, w_down)."""
    E, k, H, inter = EXPERT_SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(E, 2 * inter, H, device="cuda", generator=g, dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, inter, device="cuda", generator=g, dtype=torch.bfloat16) / inter ** 0.5
    return E, k, H, inter, g, w1, w2


def bench_kernel(tokens: list[int], copy_gbs: float) -> list[dict]:
    from pdserve.engine.ops.moe_ref import fused_moe_ref, route
    from pdserve.engine.ops.triton_moe import fused_moe_triton

    E, k, H, inter, g, w1, w2 = qwen3_moe_experts()
    rows = []
    for t in tqdm(tokens, desc="fused MoE kernel"):
        x = torch.randn(t, H, device="cuda", generator=g, dtype=torch.bfloat16)
        weights, ids = route(torch.randn(t, E, device="cuda", generator=g), k, True, torch.bfloat16)
        ref = fused_moe_ref(x, w1, w2, weights, ids)
        out = fused_moe_triton(x, w1, w2, weights, ids)
        experts = int(torch.unique(ids).numel())
        floor = experts * 3 * H * inter * 2 / (copy_gbs * 1e9)
        row = {"tokens": t, "experts_touched": experts,
               "fused_graph_ms": timed_graph(lambda x=x, w=weights, i=ids: fused_moe_triton(x, w1, w2, w, i)),
               "fused_eager_ms": timed(lambda x=x, w=weights, i=ids: fused_moe_triton(x, w1, w2, w, i), 10) * 1e3,
               "torch_ms": timed(lambda x=x, w=weights, i=ids: fused_moe_ref(x, w1, w2, w, i), 5) * 1e3,
               "weights_floor_ms": floor * 1e3,
               "max_rel_err": ((out.float() - ref.float()).norm() / ref.float().norm()).item()}
        row["speedup"] = row["torch_ms"] / row["fused_graph_ms"]
        row["TFLOPs"] = 2 * t * k * 3 * H * inter / row["fused_graph_ms"] / 1e9
        rows.append(row)
    return rows


def sweep(tokens: list[int], shape: str = "qwen3_moe") -> list[dict]:
    """Every tile setting of a grid on Qwen3-30B-A3B's experts (or `shape`'s) at each token count:
    the fused kernel's time replayed in a CUDA graph, fastest first per count."""
    from pdserve.engine.ops.moe_ref import route
    from pdserve.engine.ops.triton_moe import MoETiles, fused_moe_triton

    E, k, H, inter, g, w1, w2 = qwen3_moe_experts(shape)
    out = []
    for t in tokens:
        x = torch.randn(t, H, device="cuda", generator=g, dtype=torch.bfloat16)
        weights, ids = route(torch.randn(t, E, device="cuda", generator=g), k, True, torch.bfloat16)
        m = t * k
        if m <= 64:
            axes = (16,), (16, 32, 64), (64, 128, 256), (2, 4), (2, 4)
        elif m <= 1024:
            axes = (16, 32), (32, 64), (64, 128), (4,), (2, 4)
        else:
            axes = (64, 128), (64, 128, 256), (32, 64, 128), (4, 8), (3, 4)
        grid = [MoETiles(bm, bn, bk, w, s) for bm in axes[0] for bn in axes[1] for bk in axes[2] for w in axes[3]
                for s in axes[4]]
        rows = []
        for tiles in tqdm(grid, desc=f"sweep {t} tokens"):
            try:
                ms = timed_graph(lambda x=x, w=weights, i=ids, tl=tiles: fused_moe_triton(x, w1, w2, w, i, tl))
            except Exception as e:  # a setting past the GPU's shared memory
                print(f"{tiles}: {type(e).__name__}", flush=True)
                continue
            rows.append({"tokens": t, **tiles.__dict__, "ms": ms})
        rows.sort(key=lambda r: r["ms"])
        out += rows
        now = MoETiles.for_rows(t * k)
        mine = [r["ms"] for r in rows if MoETiles(*(r[f] for f in MoETiles.__dataclass_fields__)) == now]
        print(f"{shape} {t} tokens: best {rows[0]}, {2 * t * k * 3 * H * inter / rows[0]['ms'] / 1e9:.0f} TFLOP/s "
              f"(for_rows {now}: {mine[0] if mine else float('nan'):.3f} ms)", flush=True)
    return out


def decode_sweep(tokens: list[int], copy_gbs: float) -> list[dict]:
    """A decode step's MoE layer from its router weight (Qwen3-30B-A3B's experts): the grouped path
    (router GEMM, routing, alignment, gate/up, down, combine) against the decode path
    (ops/triton_moe_decode.py) at its default tiles and with one tile axis changed at a time,
    replayed in a CUDA graph; the weights floor is the bytes of the experts touched and the router."""
    from dataclasses import replace

    import torch.nn.functional as F

    from pdserve.engine.ops.triton_moe import MoETiles, moe_triton
    from pdserve.engine.ops.triton_moe_decode import DecodeTiles, moe_decode_triton
    from pdserve.engine.ops.triton_moe_route import Routing

    E, k, H, inter, g, w1, w2 = qwen3_moe_experts()
    router = torch.randn(E, H, device="cuda", generator=g, dtype=torch.bfloat16) / H ** 0.5
    routing, arrivals = Routing.of(E, k, True), torch.zeros(8, dtype=torch.int32, device="cuda")
    base = DecodeTiles()
    axes = {"block_e": (1, 2, 8), "block_k": (1024,), "warps": (2, 4),
            "experts": (MoETiles(16, 32, 128, 2, 4), MoETiles(16, 64, 128, 4, 2))}
    settings = [base] + [replace(base, **{a: v}) for a, vs in axes.items() for v in vs]
    rows = []
    for t in tokens:
        x = torch.randn(t, H, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = moe_triton(x, F.linear(x, router), w1, w2, k, True, torch.bfloat16)
        touched = int(torch.unique(torch.topk(F.linear(x, router).float(), k).indices).numel())
        floor = (touched * 3 * H * inter + E * H) * 2 / (copy_gbs * 1e9) * 1e3
        grouped = timed_graph(lambda x=x: moe_triton(x, F.linear(x, router), w1, w2, k, True, torch.bfloat16))
        for tiles in tqdm(settings, desc=f"decode path, {t} tokens"):
            fn = (lambda x=x, tl=tiles: moe_decode_triton(x, router, w1, w2, routing, torch.bfloat16, arrivals,
                                                          tiles=tl))
            err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
            rows.append({"tokens": t, "experts_touched": touched, "floor_ms": floor, "grouped_ms": grouped,
                         **tiles.__dict__, "experts": str(tiles.experts), "decode_ms": timed_graph(fn),
                         "rel_err": err})
        best = min((r for r in rows if r["tokens"] == t), key=lambda r: r["decode_ms"])
        print(f"{t} tokens: grouped {grouped:.4f} ms, decode path best {best['decode_ms']:.4f} ms "
              f"({ {a: best[a] for a in axes} }), floor {floor:.4f} ms", flush=True)
    return rows


def fp8_decode_sweep(tokens: list[int], copy_gbs: float) -> list[dict]:
    """The decode path's MoE layer (Qwen3-30B-A3B's experts), bf16 and with FP8 experts (e4m3, 128 x
    128 block scales): the experts as GEMVs (ops/triton_moe_decode.GemvTiles, over a grid) against
    the tiled GEMMs at their default tiles, replayed in a CUDA graph; each format's floor is the
    touched experts' bytes and the router's."""
    import itertools

    from pdserve.engine.ops.triton_moe import Fp8Experts
    from pdserve.engine.ops.triton_moe_decode import DecodeTiles, GemvTiles, moe_decode_triton
    from pdserve.engine.ops.triton_moe_route import Routing

    E, k, H, inter, g, w1, w2 = qwen3_moe_experts()
    (q1, s1), (q2, s2) = (_fp8_blocks(w) for w in (w1, w2))
    formats = {"bf16": (w1, w2, None, 2), "fp8": (q1, q2, Fp8Experts(s1, s2, (128, 128)), 1)}
    router = torch.randn(E, H, device="cuda", generator=g, dtype=torch.bfloat16) / H ** 0.5
    routing, arrivals = Routing.of(E, k, True), torch.zeros(8, dtype=torch.int32, device="cuda")
    grid = [GemvTiles(tile, max_k, w) for tile, max_k, w in itertools.product((4096, 8192, 16384), (1024, 2048),
                                                                             (2, 4, 8))]
    rows = []
    for t in tokens:
        x = torch.randn(t, H, device="cuda", generator=g, dtype=torch.bfloat16)
        touched = int(torch.unique(torch.topk(torch.nn.functional.linear(x, router).float(), k).indices).numel())
        for fmt, (a, b, fp8, width) in formats.items():
            floor = (touched * 3 * H * inter * width + E * H * 2) / (copy_gbs * 1e9) * 1e3
            tiled_tiles = DecodeTiles(experts=DecodeTiles().experts_tiles(t, k, fp8 is not None))
            tiled = timed_graph(lambda x=x, a=a, b=b, f=fp8, tl=tiled_tiles: moe_decode_triton(
                x, router, a, b, routing, torch.bfloat16, arrivals, tiles=tl, fp8=f))
            for tiles in tqdm([GemvTiles(), *grid], desc=f"{fmt} GEMVs, {t} tokens"):
                fn = (lambda x=x, a=a, b=b, f=fp8, tl=tiles: moe_decode_triton(
                    x, router, a, b, routing, torch.bfloat16, arrivals, tiles=DecodeTiles(gemv=tl), fp8=f))
                rows.append({"tokens": t, "format": fmt, "floor_ms": floor, "tiled_ms": tiled, **tiles.__dict__,
                             "gemv_ms": timed_graph(fn), "default": tiles == GemvTiles()})
            mine = [r for r in rows if r["tokens"] == t and r["format"] == fmt]
            best = min(mine, key=lambda r: r["gemv_ms"])
            print(f"{t} tokens {fmt}: tiled {tiled:.4f} ms, GEMVs default {mine[0]['gemv_ms']:.4f} ms, best "
                  f"{best['gemv_ms']:.4f} ms ({ {c: best[c] for c in ('tile', 'max_k', 'warps')} }), "
                  f"floor {floor:.4f} ms", flush=True)
    return rows


def fp8_sweep_report(res: dict, out: str, name: str) -> list[str]:
    """NAME.md (per token count and format: tiled, default and best GEMVs, floor) and NAME.png
    from --fp8-decode-sweep's rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    lines = [f"# One Qwen3-30B-A3B MoE layer on the decode path, {res['device']}", "", f"`{res['command']}`", "",
             f"![layer time]({name}.png)", "",
             "| tokens | format | tiled GEMMs us | GEMVs, default us | GEMVs, best us (tile, max_k, warps) "
             "| floor us |",
             "| --- | --- | --- | --- | --- | --- |"]
    groups = sorted({(r["tokens"], r["format"]) for r in rows})
    best = {}
    for t, fmt in groups:
        mine = [r for r in rows if r["tokens"] == t and r["format"] == fmt]
        b, d = min(mine, key=lambda r: r["gemv_ms"]), next(r for r in mine if r["default"])
        best[t, fmt] = (mine[0]["tiled_ms"], b["gemv_ms"], mine[0]["floor_ms"])
        lines.append(f"| {t} | {fmt} | {mine[0]['tiled_ms'] * 1e3:.1f} | {d['gemv_ms'] * 1e3:.1f} | "
                     f"{b['gemv_ms'] * 1e3:.1f} ({b['tile']}, {b['max_k']}, {b['warps']}) | "
                     f"{mine[0]['floor_ms'] * 1e3:.1f} |")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (tiled, gemv, floor) in enumerate(best.values()):
        ax.bar([i - 0.2, i + 0.2], [tiled * 1e3, gemv * 1e3], 0.38, color=["#888", "#2a7"],
               label=["tiled GEMMs", "GEMVs (best)"] if i == 0 else None)
        ax.scatter([i], [floor * 1e3], marker="_", s=500, color="k", label="HBM floor" if i == 0 else None)
    ax.set_xticks(range(len(best)), [f"{t} tok {fmt}" for t, fmt in best])
    ax.set_ylabel("us per layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=110)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] (multiples of 128) -> e4m3 values and a float32 scale per 128 x 128 block."""
    E, r, c = w.shape
    t = w.float().view(E, r // 128, 128, c // 128, 128)
    s = t.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    return (t / s[:, :, None, :, None]).to(torch.float8_e4m3fn).view(E, r, c), s


def expert_counter(model):
    """Counts, per decode step, the distinct experts each sparse layer routes to (forward hooks)."""
    from pdserve.engine.models.moe import SparseMoE

    seen: list[int] = []

    def hook(mod, inputs, _out):
        logits = torch.nn.functional.linear(inputs[0].float(), mod.gate.weight.float())  # DeepSeek: a float32 router
        seen.append(int(torch.unique(torch.topk(logits, mod.moe.top_k, dim=-1).indices).numel()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, SparseMoE)]
    return seen, handles


def bench_model(cfg: dict, batches: list[int], ctx: int, prefill: int, ceil: dict, profile: bool = False) -> dict:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core.request import Request
    from pdserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
    from pdserve.engine.exec.model_runner import ModelRunner
    from pdserve.engine.exec.runner_settings import RunnerSettings
    from pdserve.engine.sampling_params import SamplingParams

    bs = 16
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        per_seq = ctx // bs + 1
        ec = EngineConfig(model=d, dtype="bfloat16", num_gpu_blocks_override=max(max(batches) * per_seq,
                                                                                 prefill // bs + 1) + 8,
                          max_model_len=max(prefill, ctx) + 64, max_num_batched_tokens=prefill,
                          max_num_seqs=max(batches))
        ec.resolve(d)
        runner = ModelRunner(RunnerSettings.of(ec), load_format="dummy")
    runner.kv.normal_()
    model = runner.model
    moe = ec.model_config.moe
    expert_params = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("w_gate_up", "w_down")))
    all_params = sum(p.numel() for p in model.parameters())
    embed = model.embed_tokens.weight.numel()
    one_expert = 3 * cfg["hidden_size"] * (moe.intermediate_size if moe else 0)
    dense_read = (all_params - expert_params - embed) * 2  # every non-expert weight but the embedding table
    kv_tok = runner.layout.block_bytes // bs
    greedy = SamplingParams(temperature=0, max_tokens=16)
    out = {"config": cfg["architectures"][0], "params_B": all_params / 1e9, "decode": [], "prefill": []}
    for B in tqdm(batches, desc=f"{cfg['model_type']} decode"):
        sched = []
        for i in range(B):
            toks = torch.randint(0, cfg["vocab_size"], (ctx + 1,)).tolist()
            r = Request(f"d{B}-{i}", toks[:ctx], greedy, max_tokens=16)
            r.append_token(toks[ctx])
            r.num_computed_tokens = ctx
            sched.append(ScheduledRequest(r, 1, list(range(i * per_seq, (i + 1) * per_seq))))
        t = timed(lambda s=sched: runner.execute(SchedulerOutput(s)), 10, warmup=3)
        touched = 0
        if moe:  # the experts this batch routes to, per layer, counted in an eager step
            graphs, runner.graphs = runner.graphs, None
            seen, handles = expert_counter(model)
            runner.execute(SchedulerOutput(sched))
            for h in handles:
                h.remove()
            runner.graphs = graphs
            touched = sum(seen)
        read = dense_read + touched * one_expert * 2 + B * (ctx + 1) * kv_tok
        floor = read / (ceil["copy_GBps"] * 1e9)
        out["decode"].append({"batch": B, "context": ctx, "step_ms": t * 1e3, "floor_ms": floor * 1e3,
                              "ratio_to_floor": t / floor, "tokens_per_s": B / t, "experts_read": touched,
                              "bytes_read_GB": read / 1e9})
        if profile:  # where the step's time goes: kernels by kind against the wall time
            out["decode"][-1]["profile"] = profile_step(lambda s=sched: runner.execute(SchedulerOutput(s)), 10)
    toks = torch.randint(0, cfg["vocab_size"], (prefill,)).tolist()
    s = [ScheduledRequest(Request("p", toks, greedy, max_tokens=16), prefill, list(range(-(-prefill // bs))))]
    t = timed(lambda: runner.execute(SchedulerOutput(s)), 5, warmup=2)
    active = all_params - embed - (expert_params * (1 - moe.top_k / moe.num_experts) if moe else 0)
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    attn = 2 * prefill * prefill * cfg["num_attention_heads"] * cfg["head_dim"] * L  # causal QK^T and PV
    flops = 2 * prefill * (active - cfg["vocab_size"] * h) + 2 * h * cfg["vocab_size"] + attn
    out["prefill"].append({"tokens": prefill, "ms": t * 1e3, "TFLOPs": flops / t / 1e12,
                           "frac_of_matmul": flops / t / 1e12 / ceil["matmul_TFLOPs"]})
    if profile:
        out["prefill"][-1]["profile"] = profile_step(lambda: runner.execute(SchedulerOutput(s)), 3)
    return out  # the runner, its weights and KV are freed with this frame


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/moe")
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096", help="token counts for the kernel alone")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--models", default="qwen3_moe,qwen3", help="qwen3_moe (30B-A3B shape), qwen3 (32B shape)")
    ap.add_argument("--sweep", default="", help="token counts to sweep the kernel's tile settings at (alone)")
    ap.add_argument("--experts", default="qwen3_moe", choices=sorted(EXPERT_SHAPES), help="the experts --sweep runs")
    ap.add_argument("--decode-sweep", default="", help="token counts: decode path vs grouped")
    ap.add_argument("--fp8-decode-sweep", default="", help="token counts: the decode path's expert GEMVs, bf16 and FP8")
    ap.add_argument("--profile", action="store_true", help="add each step's kernel time by kind (torch profiler)")
    return ap


def report(res: dict) -> list[str]:
    lines = [f"Mixture-of-experts on {res['device']} (`python bench/moe_gpu.py`); copy "
             f"{res['ceil']['copy_GBps']:.0f} GB/s, bf16 matmul {res['ceil']['matmul_TFLOPs']:.0f} TFLOP/s "
             "measured in the run.", "",
             "## The fused-MoE kernel (Qwen3-30B-A3B experts: 128 x 2048 x 768, top-8)", "",
             "| tokens | experts touched | fused, graph (ms) | fused, eager (ms) | per-expert torch (ms) | speed-up |"
             " | weights floor (ms) | TFLOP/s | rel. error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["kernel"]:
        lines.append(f"| {r['tokens']} | {r['experts_touched']} | {r['fused_graph_ms']:.3f} | {r['fused_eager_ms']:.3f}"
                     f" | {r['torch_ms']:.3f} | {r['speedup']:.1f}x | {r['weights_floor_ms']:.3f} | "
                     f"{r['TFLOPs']:.0f} | {r['max_rel_err']:.1e} |")
    for m in res["models"]:
        lines += ["", f"## {m['config']} shape ({m['params_B']:.1f}B parameters), engine on one GPU", "",
                  "| batch | context | step (ms) | HBM floor (ms) | step / floor | tok/s | experts read |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | "
                  f"{r['ratio_to_floor']:.2f} | {r['tokens_per_s']:.0f} | {r['experts_read']} |" for r in m["decode"]]
        lines += ["", "| prefill tokens | ms | TFLOP/s (activated) | of matmul ceiling |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['tokens']} | {r['ms']:.1f} | {r['TFLOPs']:.0f} | {r['frac_of_matmul']:.0%} |"
                  for r in m["prefill"]]
        for r in m["decode"] + m["prefill"]:
            if "profile" in r:
                what = f"decode batch {r['batch']}" if "batch" in r else f"prefill {r['tokens']} tokens"
                lines += profile_lines(f"{m['config']}, {what}", r["profile"], "runner.execute, 10 steps")
    return lines


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = res["kernel"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog([r["tokens"] for r in k], [r["fused_graph_ms"] for r in k], "o-", label="fused kernel (graph)")
    ax.loglog([r["tokens"] for r in k], [r["torch_ms"] for r in k], "s-", label="per-expert torch")
    ax.loglog([r["tokens"] for r in k], [r["weights_floor_ms"] for r in k], "k--", label="weights floor")
    ax.set_xlabel("tokens")
    ax.set_ylabel("ms per MoE layer")
    ax.set_title(f"Qwen3-30B-A3B MoE layer, {res['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.sweep:
        rows = sweep([int(t) for t in args.sweep.split(",")], args.experts)
        name = "moe_sweep" if args.experts == "qwen3_moe" else f"moe_sweep_{args.experts}"
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        return
    ceil = ceilings()
    for tokens, run, name in ((args.fp8_decode_sweep, fp8_decode_sweep, "moe_fp8_decode_sweep"),
                              (args.decode_sweep, decode_sweep, "moe_decode_sweep")):
        if tokens:  # one sweep alone, its rows to NAME.json
            rows = run([int(t) for t in tokens.split(",")], ceil["copy_GBps"])
            res = {"device": torch.cuda.get_device_name(), "command": "python bench/moe_gpu.py "
                   + " ".join(sys.argv[1:]), "rows": rows}
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(res, f, indent=1)
            if run is fp8_decode_sweep:
                print("\n".join(fp8_sweep_report(res, args.out, name)))  # the short table last
            return
    res = {"device": torch.cuda.get_device_name(), "ceil": ceil,
           "command": "python bench/moe_gpu.py " + " ".join(sys.argv[1:]),
           "kernel": bench_kernel([int(t) for t in args.tokens.split(",")], ceil["copy_GBps"]), "models": []}
    shapes = {"qwen3_moe": QWEN3_30B_A3B, "qwen3": QWEN3_32B}
    for name in args.models.split(","):
        if name:
            res["models"].append(bench_model(shapes[name], [int(b) for b in args.batches.split(",")], args.ctx,
                                             args.prefill, ceil, args.profile))
            gc.collect()
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "moe_gpu.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = report(res)
    with open(os.path.join(args.out, "moe_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(res, os.path.join(args.out, "moe_gpu.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
