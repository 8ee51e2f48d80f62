"""The link between two GPUs of one node, as a pair of workers would use it: peer access, the
copy engine's one-way bandwidth GPU 0 -> GPU 1 (the raw copy a handoff across GPUs is measured
against), and a CUDA IPC mapping across GPUs (a process on GPU 1 copying from a tensor that a
process on GPU 0 shared), each in the same run.

    python bench/cross_gpu_copy.py --out bench/results/ipc      # 2 GPUs; prints a table last
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.multiprocessing as mp

SIZES_MIB = (2, 16, 64, 256, 1024)


def copy_gbps(src: torch.Tensor, dst: torch.Tensor, iters: int = 10) -> float:
    dst.copy_(src)
    torch.cuda.synchronize(src.device)
    torch.cuda.synchronize(dst.device)
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(src.device)
    torch.cuda.synchronize(dst.device)
    return src.numel() * src.element_size() * iters / (time.perf_counter() - t) / 1e9


def _reader(q_in, q_out) -> None:
    src = q_in.get()  # mapped through CUDA IPC (torch.multiprocessing's reduction)
    rows = []
    for mib in SIZES_MIB:
        n = mib << 20
        dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
        rows.append({"mib": mib, "ipc_gbps": copy_gbps(src[:n], dst)})
    q_out.put(rows)
    q_in.get()  # hold the mapping until the owner is done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/ipc")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    peer = torch.cuda.can_device_access_peer(0, 1)
    big = max(SIZES_MIB) << 20
    src = torch.randint(0, 255, (big,), dtype=torch.uint8, device="cuda:0")
    rows = []
    for mib in SIZES_MIB:
        n = mib << 20
        dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
        rows.append({"mib": mib, "copy_gbps": copy_gbps(src[:n], dst)})
    ipc, why = None, None
    try:
        ctx = mp.get_context("spawn")
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_reader, args=(q_in, q_out))
        p.start()
        q_in.put(src)
        ipc = q_out.get(timeout=120)
        q_in.put(None)
        p.join(30)
    except Exception as e:  # noqa: BLE001 - reported: the IPC link may be unavailable here
        why = f"{type(e).__name__}: {e}"
    for r, i in zip(rows, ipc or [{}] * len(rows)):
        r.update(i)
    out = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "peer_access": peer,
           "ipc_error": why, "rows": rows, "command": "python bench/cross_gpu_copy.py --out " + args.out}
    with open(os.path.join(args.out, "cross_gpu_copy.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(write_report(out, args.out))


def write_report(out: dict, where: str) -> str:
    """cross_gpu_copy.{md,png} beside the json; returns the md."""
    lines = [f"# GPU 0 -> GPU 1 on {out['device']} x{out['gpus']}", "", f"`{out['command']}`", "",
             f"Peer access: {out['peer_access']}; CUDA IPC across GPUs: "
             f"{'works' if out['ipc_error'] is None else out['ipc_error']}.", "",
             "| MiB | copy engine GB/s (one process) | over CUDA IPC GB/s (process on GPU 1) |", "|---|---|---|"]
    lines += [f"| {r['mib']} | {r['copy_gbps']:.0f} | {r.get('ipc_gbps', float('nan')):.0f} |" for r in out["rows"]]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(where, "cross_gpu_copy.md"), "w") as f:
        f.write(md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["mib"] for r in out["rows"]]
    ax.plot(xs, [r["copy_gbps"] for r in out["rows"]], "o-", label="copy engine, one process")
    ax.plot(xs, [r.get("ipc_gbps", float("nan")) for r in out["rows"]], "s--", label="over CUDA IPC, process on GPU 1")
    ax.set(xscale="log", xlabel="MiB copied", ylabel="GB/s", title=f"GPU 0 -> GPU 1, {out['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(where, "cross_gpu_copy.png"), dpi=120)
    return md


if __name__ == "__main__":
    main()
