"""KV handoff between two GPUs (two processes, NCCL pair group built at run time)
against a raw NCCL send/recv of the same bytes, measured in the same run; with --link pull,
between the same two GPUs over the same-node link (the receiver pulls the blocks from the
sender's KV mapped through CUDA IPC, transfer/pull.py) against the copy engine's copy of the
same bytes from GPU 0 to GPU 1; or, with --same-gpu, between two processes sharing one GPU
(the same-node link again) against a local device-to-device copy of the same bytes.

Llama-3-8B-shaped KV in bf16: 32 layers x 2 x 8 kv heads x 128 dims x 2 bytes = 128 KiB
per token, 16-token blocks (2 MiB). A handoff is timed from "prefill done" (the
sender's start_send, after a device sync) to "blocks usable on decode" (the
receiver's handoff DONE: received and scattered into its reserved blocks), with
random non-contiguous block ids on both sides; gather and scatter included.

    python bench/transfer_bench.py --out bench/results          # 2 GPUs, NCCL
    python bench/transfer_bench.py --link pull --tokens 2048,8192 --out bench/results/ipc   # 2 GPUs, CUDA IPC
    python bench/transfer_bench.py --same-gpu --tokens 512,2048,8192 --out bench/results/ipc   # 1 GPU
    python bench/transfer_bench.py --device cpu --tokens 512    # gloo smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def kv_cache(num_blocks: int, device: str, small: bool) -> torch.Tensor:
    """Random KV; on CPU on a shared memory file as the engine allocates it (a peer may map it)."""
    from pdserve.engine.exec.kv_cache import zeros_on_demand

    layers, heads, dim = (2, 2, 16) if small else (LAYERS, KV_HEADS, HEAD_DIM)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv = torch.randn(num_blocks, layers, 2, BLOCK, heads, dim, dtype=dtype, device=device)
    return kv if device != "cpu" else zeros_on_demand(tuple(kv.shape), dtype).copy_(kv)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def worker(rank: int, args, q_to_peer, q_from_peer, results) -> None:
    from tqdm import tqdm

    from pdserve.transfer.base import HandoffTarget
    from pdserve.transfer.c10d import C10dConnector

    device = f"cuda:{0 if args.same_gpu else rank}" if args.device == "cuda" else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    max_tokens = max(args.tokens)
    num_blocks = 2 * (max_tokens // BLOCK) + 16
    kv = kv_cache(num_blocks, device, args.device == "cpu")
    name = "prefill" if rank == 0 else "decode"
    conn = C10dConnector(name, kv, default_timeout_s=120, same_node=args.same_gpu or args.link == "pull")
    q_to_peer.put(conn.address)
    peer_addr = q_from_peer.get()
    g = torch.Generator().manual_seed(rank)
    rows = []

    # raw NCCL / gloo send/recv of the same bytes, on a separate pair group (one GPU: NCCL refuses
    # two ranks on one device; the baseline is a local copy)
    raw = None
    if not args.same_gpu and args.link == "nccl":
        host, port = peer_addr.rsplit(":", 1)
        store = conn.store if rank == 1 else dist.TCPStore(host, int(port), is_master=False)
        ps = dist.PrefixStore("raw", store)
        if device.startswith("cuda"):
            raw = dist.ProcessGroupNCCL(ps, rank, 2, dist.ProcessGroupNCCL.Options())
        else:
            raw = dist.ProcessGroupGloo(ps, rank, 2, datetime.timedelta(seconds=60))
    for tokens, contiguous in tqdm([(t, c) for t in args.tokens for c in (False, True)], desc=name,
                                   disable=rank == 1):
        n = -(-tokens // BLOCK)
        nbytes = n * kv[0].numel() * kv.element_size()
        # raw: back-to-back send/recv of one contiguous buffer, timed on the receiver
        buf = torch.empty(n * kv[0].numel(), dtype=kv.dtype, device=device)
        raw_times = []
        for it in range(args.iters + 2 if raw is not None else 0):
            raw.allreduce([torch.zeros(1, device=device)]).wait()  # start together
            sync(device)
            t = time.perf_counter()
            w = raw.send([buf], 1, it) if rank == 0 else raw.recv([buf], 0, it)
            w.wait()
            sync(device)
            if it >= 2:
                raw_times.append(time.perf_counter() - t)
        if raw is None:  # a device-to-device copy of the same bytes: on one GPU, or GPU 0 -> 1 (copy engine)
            src = buf if args.same_gpu or device == "cpu" else torch.empty_like(buf, device="cuda:0")
            dst = torch.empty_like(buf)
            both = [d for d in (src.device, dst.device) if d.type == "cuda"]
            for it in range(args.iters + 2):
                for d in both:
                    torch.cuda.synchronize(d)
                t = time.perf_counter()
                dst.copy_(src)
                for d in both:
                    torch.cuda.synchronize(d)
                if it >= 2:
                    raw_times.append(time.perf_counter() - t)
            del dst, src
        raw_s = statistics.median(raw_times)
        # handoffs: decode reserves random blocks and posts its receive, then prefill sends
        hand, parts = [], []
        for it in range(args.iters + 2):
            if contiguous:  # fresh allocations: a run of consecutive blocks, sent in place
                start = int(torch.randint(0, num_blocks - n, (1,), generator=g))
                ids = list(range(start, start + n))
            else:
                ids = torch.randperm(num_blocks, generator=g)[:n].tolist()
            if rank == 1:
                ch = conn.new_channel("prefill")
                h = conn.start_recv("prefill", f"r{tokens}-{it}", ids, ch)
                q_to_peer.put(ch)
                h.wait(120)
                t1 = time.monotonic()
                assert h.state.name == "DONE", h.error
                t0, checksum, t_sent = q_from_peer.get()
                if it == 0:  # the blocks arrived intact (a float64 checksum of the bf16 values)
                    got = kv[ids].double().sum().item()
                    assert abs(got - checksum) <= 1e-9 * max(1.0, abs(checksum)), (got, checksum)
                if it >= 2:
                    hand.append(t1 - t0)
                    # sender: thread took it, posted its order; receiver: took the order, queued the
                    # copy, saw it done (the link's copy; gather + send over c10d), finished
                    rx = [getattr(h, a, None) for a in ("t_started", "t_first_post", "t_posted")]
                    parts.append((t_sent[0] - t0, t_sent[1] - t0, *[(x if x is not None else t0) - t0 for x in rx],
                                  h.finished_at - t0))
            else:
                ch = q_from_peer.get()
                sync(device)  # "prefill done"
                t0 = time.monotonic()
                h = conn.start_send(HandoffTarget("decode", peer_addr, ch, 0), f"r{tokens}-{it}", ids)
                h.wait(120)
                assert h.state.name == "DONE", h.error
                q_to_peer.put((t0, kv[ids].double().sum().item() if it == 0 else None, (h.t_started, h.t_posted)))
            conn.poll()
        if rank == 1:
            hs = statistics.median(hand)
            rows.append({"tokens": tokens, "contiguous": contiguous, "bytes": nbytes, "handoff_ms": hs * 1e3,
                         "effective_GBps": nbytes / hs / 1e9, "raw_nccl_GBps": nbytes / raw_s / 1e9,
                         "raw_ms": raw_s * 1e3, "efficiency": raw_s / hs,
                         # from "prefill done": sender thread started, sender posted, receiver done
                         "breakdown_ms": [statistics.median(p[i] for p in parts) * 1e3 for i in range(6)],
                         "link": h.link})
    if args.kernel_sweep:
        peer = exchange_slabs(rank, kv, q_to_peer, q_from_peer)
        if rank == 1:
            for r in rows:
                if not r["contiguous"]:
                    r["kernel_sweep"] = kernel_sweep(kv, peer, r["tokens"], num_blocks, g, args.iters)
        q_to_peer.put("swept")
        q_from_peer.get()  # the sender keeps its slab mapped until the receiver is done with it
    if rank == 1:
        results.put(rows)
    time.sleep(0.5)
    os._exit(0)  # never rely on process-group teardown at exit (NCCL may hang there)


SWEEP = ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (16384, 16))  # (elements a load moves, warps)


def exchange_slabs(rank: int, kv: torch.Tensor, q_to_peer, q_from_peer) -> torch.Tensor | None:
    """The receiver maps the sender's KV (the same CUDA IPC mapping the pull uses)."""
    from pdserve.transfer.shared import export, open_peer

    if rank == 0:
        q_to_peer.put(export(kv))
        return None
    peer = open_peer(q_from_peer.get(), kv)
    assert not isinstance(peer, str), peer
    return peer


def kernel_sweep(kv: torch.Tensor, peer: torch.Tensor, tokens: int, num_blocks: int, g, iters: int) -> list[dict]:
    """The copy kernel alone (ops/block_copy.py), random block ids, between this GPU's KV and the
    peer GPU's mapped here: reading the peer (the pull) and writing into it (what a push would
    do), per (load size, warps); then one cudaMemcpyAsync per block (torch's copy_ of a 2 MiB
    block, reading the peer); CUDA-event time, median of `iters`."""
    from pdserve.engine.ops.block_copy import copy_blocks

    n = -(-tokens // BLOCK)
    nbytes = n * kv[0].numel() * kv.element_size()
    out = []
    for direction in ("read", "write"):
        for block, warps in SWEEP:
            times = []
            for it in range(iters + 2):
                a = torch.randperm(num_blocks, generator=g)[:n].to(kv.device)
                b = torch.randperm(num_blocks, generator=g)[:n].to(kv.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                if direction == "read":
                    copy_blocks(kv, a, peer, b, block=block, num_warps=warps)
                else:
                    copy_blocks(peer, b, kv, a, block=block, num_warps=warps)
                end.record()
                end.synchronize()
                if it >= 2:
                    times.append(start.elapsed_time(end) / 1e3)
            out.append({"dir": direction, "block": block, "warps": warps,
                        "GBps": nbytes / statistics.median(times) / 1e9})
    times = []
    for it in range(iters + 2):
        a = torch.randperm(num_blocks, generator=g)[:n].tolist()
        b = torch.randperm(num_blocks, generator=g)[:n].tolist()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i, j in zip(a, b):
            kv[i].copy_(peer[j], non_blocking=True)
        end.record()
        end.synchronize()
        if it >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    out.append({"dir": "read (cudaMemcpyAsync per block)", "block": 0, "warps": 0,
                "GBps": nbytes / statistics.median(times) / 1e9})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tokens", default="512,2048,8192,32768")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--same-gpu", action="store_true", help="both processes on GPU 0: the same-node (IPC) link")
    ap.add_argument("--link", default="nccl", choices=["nccl", "pull"],
                    help="two GPUs: over the pair's NCCL group, or pulled over CUDA IPC (the same-node link)")
    ap.add_argument("--kernel-sweep", action="store_true",
                    help="with --link pull: also time the copy kernel alone, reading the peer GPU's KV and "
                         "writing into it, per load size and warps")
    args = ap.parse_args()
    if args.kernel_sweep and (args.link != "pull" or args.device != "cuda"):
        ap.error("--kernel-sweep needs --link pull on CUDA")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    ctx = mp.get_context("spawn")
    a, b, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(0, args, a, b, results)),
             ctx.Process(target=worker, args=(1, args, b, a, results))]
    for p in procs:
        p.start()
    rows = results.get(timeout=1200)
    for p in procs:
        p.join(30)
    os.makedirs(args.out, exist_ok=True)
    suffix = ("" if args.device == "cuda" else "_cpu") + ("_same_gpu" if args.same_gpu else "") + \
        ("_pull" if args.link == "pull" and not args.same_gpu else "")
    with open(os.path.join(args.out, f"transfer{suffix}.json"), "w") as f:
        json.dump([{k: r[k] for k in ("tokens", "bytes", "handoff_ms", "effective_GBps", "raw_nccl_GBps",
                                      "raw_ms", "efficiency", "contiguous", "breakdown_ms", "link", "kernel_sweep")
                   if k in r} for r in rows],
                  f, indent=2)
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    base = "local device-to-device copy" if args.same_gpu else \
        ("copy engine GPU 0 -> 1" if args.link == "pull" else "raw send/recv")
    lines = [f"# KV handoff, 2 processes on {dev}{' (one GPU, both processes)' if args.same_gpu else ''}", "",
             "Llama-3-8B-shaped KV, bf16, 128 KiB/token, 16-token blocks, random block ids both sides; "
             f"median of {args.iters}; link: {rows[0]['link']}; `python bench/transfer_bench.py "
             f"{'--same-gpu ' if args.same_gpu else ''}{'--link pull ' if args.link == 'pull' else ''}"
             f"--tokens {','.join(map(str, args.tokens))}`.", "",
             f"| tokens | block ids | MiB | handoff ms | effective GB/s | {base} ms | its GB/s | effective / "
             "baseline | sender: started / posted; receiver: order taken / copy queued / copy done / done (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kind = "one run (in place)" if r["contiguous"] else "random (staged)"
        lines.append(f"| {r['tokens']} | {kind} | {r['bytes'] / 2**20:.0f} | {r['handoff_ms']:.2f} | "
                     f"{r['effective_GBps']:.0f} | {r['raw_ms']:.2f} | {r['raw_nccl_GBps']:.0f} | "
                     f"{r['efficiency']:.0%} | {' / '.join(f'{x:.2f}' for x in r['breakdown_ms'])} |")
    for r in rows:
        if r.get("kernel_sweep"):
            lines += ["", f"Copy kernel alone, {r['tokens']} tokens, random block ids, against the copy engine's "
                      f"{r['raw_nccl_GBps']:.0f} GB/s:", "", "| direction | elements a load | warps | GB/s |",
                      "|---|---|---|---|"]
            lines += [f"| {k['dir']} the peer | {k['block']} | {k['warps']} | {k['GBps']:.0f} |"
                      for k in r["kernel_sweep"]]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, f"transfer{suffix}.md"), "w") as f:
        f.write(md)
    plot(rows, os.path.join(args.out, f"transfer{suffix}.png"), base, dev)
    print(md)


def plot(rows: list[dict], path: str, base: str, dev: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for contiguous, label in ((False, "random block ids"), (True, "one run of blocks")):
        rs = [r for r in rows if r["contiguous"] == contiguous]
        ax.plot([r["tokens"] for r in rs], [r["efficiency"] for r in rs], "o-", label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens (Llama-3-8B KV, 128 KiB/token)")
    ax.set_ylabel(f"handoff bandwidth / {base}")
    ax.set_title(f"KV handoff, {dev}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
