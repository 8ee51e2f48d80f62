"""The tensor-parallel all-reduce on two GPUs of one node: the one-shot kernel over CUDA IPC
buffers (engine/base/ipc_allreduce.py) against NCCL's, per call, for a decode step's sizes
([batch, hidden] bf16), each timed as 64 calls replayed from one CUDA graph (as a decode step
runs them), results checked against NCCL's.

    python bench/allreduce_gpu.py --out bench/results/tp

Two processes (one per GPU) build a TP group as the engine does (exec/tp.TPGroup). Prints a
table last; writes allreduce_gpu.{json,md,png} under --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.multiprocessing as mp

SIZES = [(1, 4096), (8, 4096), (64, 4096), (1, 5120), (64, 5120), (128, 8192)]
CALLS = 64


def _graph_time(fn, xs, iters: int = 20) -> float:
    """Seconds per call of `fn` over `xs`, captured CALLS at a time in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x in xs:
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for x in xs:
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters / len(xs)


def _rank(rank: int, address, out) -> None:
    from pdserve.engine.base.tp import TPGroup

    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        tp = TPGroup.serve(2) if rank == 0 else TPGroup(1, 2)
        if rank == 0:
            address.put(tp.address)
        tp.connect(dev, None if rank == 0 else address.get())
        info = {"oneshot": tp.oneshot is not None, "why": tp.oneshot_why}
        if tp.oneshot is None:
            out.put((rank, info))
            return
        rows = []
        for shape in SIZES:
            x = torch.randn(shape, device=dev).to(torch.bfloat16)
            want = x.clone()
            tp.dev.allreduce([want]).wait()
            got = tp.all_reduce(x.clone())
            xs = [torch.randn(shape, device=dev).to(torch.bfloat16) for _ in range(CALLS)]
            one = _graph_time(tp.oneshot, xs)
            nccl = _graph_time(lambda t: tp.dev.allreduce([t]).wait(), xs)
            rows.append({"shape": list(shape), "KiB": x.numel() * 2 / 1024, "oneshot_us": one * 1e6,
                         "nccl_us": nccl * 1e6, "max_abs_diff": (got.float() - want.float()).abs().max().item()})
        info.update(rows=rows, error=tp.oneshot.error())
        out.put((rank, info))
    except BaseException as e:  # noqa: BLE001 - reported
        out.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        out.close()
        out.join_thread()  # the result written to the pipe before the process ends
        os._exit(0)


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/tp")
    return ap


def main() -> None:
    args = parser().parse_args()
    ctx = mp.get_context("spawn")
    address, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, address, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(30)
    r0 = res[0]
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name(0)
    with open(os.path.join(args.out, "allreduce_gpu.json"), "w") as f:
        json.dump({"device": dev, "gpus": 2, "ranks": res}, f, indent=2)
    lines = [f"# TP all-reduce, 2x {dev}", "", f"`python bench/allreduce_gpu.py`; per call, {CALLS} calls replayed "
             "from one CUDA graph; bf16.", ""]
    if "rows" not in r0:
        lines.append(f"The one-shot path did not run: {res}")
    else:
        lines += ["| shape | KiB | one-shot us | NCCL us | NCCL / one-shot | max diff vs NCCL |",
                  "|---|---|---|---|---|---|"]
        for r in r0["rows"]:
            lines.append(f"| {r['shape']} | {r['KiB']:.0f} | {r['oneshot_us']:.1f} | {r['nccl_us']:.1f} | "
                         f"{r['nccl_us'] / r['oneshot_us']:.1f}x | {r['max_abs_diff']:.3g} |")
        plot(r0["rows"], os.path.join(args.out, "allreduce_gpu.png"), dev)
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "allreduce_gpu.md"), "w") as f:
        f.write(md)
    print(md)


def plot(rows: list[dict], path: str, dev: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["oneshot_us"] for r in rows], 0.4, label="one-shot (CUDA IPC)")
    ax.bar([x + 0.2 for x in xs], [r["nccl_us"] for r in rows], 0.4, label="NCCL")
    ax.set_xticks(list(xs), [f"{r['shape'][0]}x{r['shape'][1]}" for r in rows])
    ax.set(ylabel="us per all-reduce", title=f"TP=2 all-reduce, bf16, 2x {dev}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
