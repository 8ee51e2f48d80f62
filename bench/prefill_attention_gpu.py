"""One layer's prefill attention over the paged cache, on one GPU: the Triton paged prefill
kernel (engine/ops/triton_prefill.py) against the torch reference it replaced on CUDA
(engine/ops/attention_ref.py: gather the context, repeat K/V heads, mask, SDPA), on the
shapes of the mixed-step and prefix-hit questions.

    python bench/prefill_attention_gpu.py --out bench/results/attention

Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16), 16-token blocks
in shuffled order; medians of 20 timed launches (CUDA events) after 3 warm-ups. Each case
also checks the kernel's output against the reference (relative L2 error).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from pdserve.engine.ops.attention_core import sm_count, split_count
from pdserve.engine.ops.attention_ref import paged_attention_ref
from pdserve.engine.ops.triton_prefill import PrefillLaunch, PrefillPlan, paged_prefill_triton

H, KVH, D, PAGE = 32, 8, 128, 16
# (name, [(context after the step, new tokens), ...])
CASES = [
    ("chunk 64 at 7232", [(7296, 64)]),
    ("chunk 256 at 7232", [(7488, 256)]),
    ("chunk 1024 at 7168", [(8192, 1024)]),
    ("2048 new over 2048 cached", [(4096, 2048)]),
    ("fresh 4096", [(4096, 4096)]),
    ("fresh 512 x 4", [(512, 512)] * 4),
]
# the mixed steps of bench/mixed_step_gpu.py: 16 decodes at ~4K context beside a chunk at the end of an 8K prompt
MIXED_CASES = [("16 decodes + chunk 64 at 8K", [(4096, 1)] * 16 + [(8192, 64)]),
         ("16 decodes + chunk 256 at 8K", [(4096, 1)] * 16 + [(8192, 256)])]
# --sweep: the kernel's tile settings (query rows per program, keys per iteration, warps, pipeline
# stages) and the key splits' programs per SM
SWEEP = {"rows": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3), "per_sm": (2, 8)}


def launch(c: dict) -> PrefillLaunch:
    """A sweep combination as the kernel's tile settings."""
    return PrefillLaunch(c["rows"], c["block_n"], c["num_warps"], c["num_stages"], c["per_sm"])


def timed(fn, reps: int = 20, warmup: int = 3) -> float:
    """The median of `reps` timed calls of `fn` (CUDA events), in ms, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def timed_graph(fn, reps: int = 20, calls: int = 10) -> float:
    """The median GPU time of one call of `fn` in ms, `calls` of them captured in a CUDA graph and
    replayed `reps` times: kernel time without the host's launch work (as the engine's decode
    graphs run), which `timed` includes when a call is shorter than its launch."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def layout(seqs: list[tuple[int, int]], gen: torch.Generator):
    """A case's paged cache with random contents and shuffled blocks: (context lengths, query
    lengths, K cache, V cache, block tables, q)."""
    seq_lens, q_lens = [c for c, _ in seqs], [n for _, n in seqs]
    width = -(-max(seq_lens) // PAGE)
    num_blocks = len(seqs) * width + 8
    kv = torch.randn(num_blocks, 2, PAGE, KVH, D, dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(num_blocks, generator=gen)[: len(seqs) * width].view(len(seqs), width)
    q = torch.randn(sum(q_lens), H, D, dtype=torch.bfloat16, device="cuda")
    return seq_lens, q_lens, kv[:, 0], kv[:, 1], tables.to(torch.int32).cuda(), q


def case(seqs: list[tuple[int, int]], gen: torch.Generator) -> dict:
    seq_lens, q_lens, kc, vc, tables, q = layout(seqs, gen)
    scale = D ** -0.5
    plan = PrefillPlan.build(q_lens, seq_lens, H // KVH, "cuda")
    out = paged_prefill_triton(q, kc, vc, tables, plan, scale)
    ref = paged_attention_ref(q, kc, vc, tables, seq_lens, q_lens, scale)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    triton_ms = timed(lambda: paged_prefill_triton(q, kc, vc, tables, plan, scale, out=out))
    ref_ms = timed(lambda: paged_attention_ref(q, kc, vc, tables, seq_lens, q_lens, scale))
    splits = split_count(plan.tiles.shape[0] * KVH, plan.max_context, sm_count(q.device), plan.launch.per_sm)
    return {"triton_ms": triton_ms, "reference_ms": ref_ms, "speedup": ref_ms / triton_ms, "rel_err": err,
            "tokens": sum(q_lens), "splits": splits}


def sweep(out_dir: str) -> None:
    """Every combination of SWEEP on every case (mixed steps included): the fastest settings per
    case against the defaults, into prefill_sweep.{json,md}."""
    import itertools

    gen = torch.Generator().manual_seed(0)
    combos = [dict(zip(SWEEP, v)) for v in itertools.product(*SWEEP.values())]
    rows = []
    for name, seqs in MIXED_CASES + CASES:
        seq_lens, q_lens, kc, vc, tables, q = layout(seqs, gen)
        ref = paged_attention_ref(q, kc, vc, tables, seq_lens, q_lens, D ** -0.5).float()
        times = []
        for c in combos:
            plan = PrefillPlan.build(q_lens, seq_lens, H // KVH, "cuda", launch(c))
            try:
                out = paged_prefill_triton(q, kc, vc, tables, plan, D ** -0.5)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ms = timed(lambda a=(q, kc, vc, tables, plan), o=out: paged_prefill_triton(*a, D ** -0.5, out=o))
            except Exception as e:  # noqa: BLE001 - a setting the compiler refuses (shared memory)
                print(name, c, repr(e)[:100], file=sys.stderr)
                continue
            times.append((ms, c, err))
        times.sort(key=lambda t: t[0])
        default = next((t for t in times if launch(t[1]) == PrefillLaunch.for_step(q_lens)), None)
        rows.append({"case": name, "best": [{"ms": t[0], **t[1], "rel_err": t[2]} for t in times[:5]],
                     "default_ms": default[0] if default else None, "all": [[t[0], t[1]] for t in times]})
        print(name, rows[-1]["best"][:2], "default", rows[-1]["default_ms"], file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name()
    with open(os.path.join(out_dir, "prefill_sweep.json"), "w") as f:
        json.dump({"device": device, "sweep": SWEEP, "rows": rows}, f, indent=1)
    lines = [f"Paged-prefill settings, one layer, {device} (`python bench/prefill_attention_gpu.py --sweep`)", "",
             "| case | by shape (ms) | best (ms) | rows | block_n | warps | stages | splits per SM |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        b = r["best"][0]
        lines.append(f"| {r['case']} | {r['default_ms'] or float('nan'):.3f} | {b['ms']:.3f} | {b['rows']} | "
                     f"{b['block_n']} | {b['num_warps']} | {b['num_stages']} | {b['per_sm']} |")
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "prefill_sweep.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def plot_sweep(out_dir: str) -> str:
    """prefill_sweep.json: per case, the kernel with one setting for every step (64 rows, 32 keys,
    2 stages, 8 programs per SM), with the settings by shape (PrefillLaunch.for_step: MIXED or
    PREFILL), and the sweep's best. Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(out_dir, "prefill_sweep.json")) as f:
        res = json.load(f)
    one = PrefillLaunch(rows=64, block_n=32, warps=4, stages=2, per_sm=8)
    bars = {"one setting (64 rows, 32 keys)": [next(ms for ms, c in r["all"] if launch(c) == one) for r in res["rows"]],
            "by shape (mixed / prefill tiles)": [r["default_ms"] for r in res["rows"]],
            "best of the sweep": [r["best"][0]["ms"] for r in res["rows"]]}
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for j, (label, ys) in enumerate(bars.items()):
        ax.bar([i + j * 0.27 for i in range(len(ys))], ys, 0.27, label=label)
    ax.set_xticks([i + 0.27 for i in range(len(res["rows"]))], [r["case"] for r in res["rows"]], rotation=20,
                  ha="right", fontsize=7)
    ax.set_ylabel("ms per layer")
    ax.set_title(f"paged-prefill kernel settings, {res['device']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = os.path.join(out_dir, "prefill_sweep.png")
    fig.savefig(out, dpi=120)
    return out


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/attention")
    ap.add_argument("--sweep", action="store_true", help="the kernel's tile settings on every case")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.sweep:
        os.makedirs(args.out, exist_ok=True)
        sweep(args.out)
        print(plot_sweep(args.out))
        return
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, seqs in CASES:
        r = {"case": name, **case(seqs, gen)}
        rows.append(r)
        print(r, file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "prefill_attention.json")
    with open(path, "w") as f:
        json.dump({"device": device, "shape": {"heads": H, "kv_heads": KVH, "head_dim": D, "block": PAGE},
                   "command": "python bench/prefill_attention_gpu.py --out " + args.out, "rows": rows}, f, indent=1)
    lines = [f"One layer's prefill attention, {device}, Llama-3-8B attention shape, bf16, 16-token blocks "
             "(`python bench/prefill_attention_gpu.py`)", "",
             "| case | Triton paged prefill (ms) | key splits | torch reference (ms) | speedup | rel. error |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['case']} | {r['triton_ms']:.3f} | {r['splits']} | {r['reference_ms']:.3f} | {r['speedup']:.1f}x | "
              f"{r['rel_err']:.1e} |" for r in rows]
    text = "\n".join(lines)
    with open(os.path.join(args.out, "prefill_attention.md"), "w") as f:
        f.write(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["reference_ms"] for r in rows], 0.4, label="torch reference")
        ax.bar([i + 0.2 for i in x], [r["triton_ms"] for r in rows], 0.4, label="Triton paged prefill")
        ax.set_xticks(list(x), [r["case"] for r in rows], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("ms per layer")
        ax.set_yscale("log")
        ax.set_title(f"prefill attention over the paged cache, {device}", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path[: -len(".json")] + ".png", dpi=120)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print(text)


if __name__ == "__main__":
    main()
