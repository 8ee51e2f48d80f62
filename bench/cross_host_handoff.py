"""KV handoff between two hosts against raw TCP between the same two, measured in the same run
(CPU, gloo; root: the hosts are a bed of network namespaces, scripts/hosts.sh).

Each side is a process that enters its host's network namespace first: the sender (prefill) on h1,
the receiver (decode) on h2, each with a `C10dConnector` bound to its host's address (the pair's
gloo group over the bed's bridge, as between two machines: `same_node` off). A handoff is timed
from the sender's start_send to the receiver's DONE (blocks scattered into random reserved ids),
median of `--iters`; raw TCP sends the same bytes over one socket between the same two addresses
(`sendall` of one buffer, `recv_into` one buffer), timed on the receiver from its "go" to the last
byte. With `--tc`, both hosts' links are shaped with that qdisc (default: a 10 Gbit/s token
bucket) and the run is repeated on the shaped link. (netem's delay and loss need the kernel's
sch_netem, which this machine's kernel lacks: "Specified qdisc kind is unknown".)

KV shape: SmolLM2-135M's (30 layers, 3 KV heads of 64) in float32, 16-token blocks: 720 KiB a
block, 45 KiB a token.

    python bench/cross_host_handoff.py --out bench/results/cross_host                # as root
    python bench/cross_host_handoff.py --tokens 512 --iters 2 --out /tmp/x           # a quick check
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "scripts", "hosts.sh")
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
CLONE_NEWNET = 0x40000000


def enter_host(pid: int) -> None:
    """This process joins the network namespace of the bed host whose init is `pid`."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)


def raw_tcp(rank: int, addr: str, peer_ctl, q_to_peer, q_from_peer, nbytes: int, iters: int) -> float:
    """Median seconds for `nbytes` over one TCP connection between the two hosts."""
    times = []
    if rank == 1:
        srv = socket.create_server((addr, 0))
        q_to_peer.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        buf = bytearray(nbytes)
        view = memoryview(buf)
        for _ in range(iters + 1):
            t = time.monotonic()
            conn.sendall(b"g")
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)
            times.append(time.monotonic() - t)
        conn.close()
        srv.close()
        return statistics.median(times[1:])
    port = q_from_peer.get()
    conn = socket.create_connection((peer_ctl, port))
    data = os.urandom(1024) * (nbytes // 1024 + 1)
    data = memoryview(data)[:nbytes]
    for _ in range(iters + 1):
        conn.recv(1)
        conn.sendall(data)
    conn.close()
    return 0.0


def worker(rank: int, pids: list[int], addrs: list[str], args, q_to_peer, q_from_peer, results) -> None:
    from pdserve.transfer.base import HandoffTarget
    from pdserve.transfer.c10d import C10dConnector

    enter_host(pids[rank])
    torch.set_num_threads(1)
    n_max = -(-max(args.tokens) // BLOCK)
    num_blocks = 2 * n_max + 16
    kv = torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    name = ("prefill", "decode")[rank]
    conn = C10dConnector(name, kv, host=addrs[rank], default_timeout_s=120, same_node=False)
    q_to_peer.put(conn.address)
    peer_addr = q_from_peer.get()
    g = torch.Generator().manual_seed(rank)
    rows = []
    from tqdm import tqdm

    for tokens in tqdm(args.tokens, desc="prompt sizes", disable=rank == 0):
        n = -(-tokens // BLOCK)
        nbytes = n * kv[0].numel() * kv.element_size()
        raw_s = raw_tcp(rank, addrs[rank], addrs[1 - rank], q_to_peer, q_from_peer, nbytes, args.iters)
        hand = []
        for it in range(args.iters + 1):
            ids = torch.randperm(num_blocks, generator=g)[:n].tolist()
            if rank == 1:
                ch = conn.new_channel("prefill")
                h = conn.start_recv("prefill", f"r{tokens}-{it}", ids, ch)
                q_to_peer.put(ch)
                h.wait(120)
                t1 = time.monotonic()
                assert h.state.name == "DONE", h.error
                t0, checksum = q_from_peer.get()
                if it == 0:  # the blocks arrived intact
                    got = kv[ids].double().sum().item()
                    assert abs(got - checksum) <= 1e-9 * max(1.0, abs(checksum)), (got, checksum)
                else:
                    hand.append(t1 - t0)
            else:
                ch = q_from_peer.get()
                t0 = time.monotonic()
                h = conn.start_send(HandoffTarget("decode", peer_addr, ch, 0), f"r{tokens}-{it}", ids)
                h.wait(120)
                assert h.state.name == "DONE", h.error
                q_to_peer.put((t0, kv[ids].double().sum().item() if it == 0 else None))
            conn.poll()
        if rank == 1:
            hs = statistics.median(hand)
            rows.append({"tokens": tokens, "bytes": nbytes, "handoff_ms": hs * 1e3, "handoff_GBps": nbytes / hs / 1e9,
                         "raw_tcp_ms": raw_s * 1e3, "raw_tcp_GBps": nbytes / raw_s / 1e9,
                         "efficiency": raw_s / hs, "spread_ms": [min(hand) * 1e3, max(hand) * 1e3],
                         "link": h.link, "between": [conn.address, peer_addr]})
    if rank == 1:
        results.put(rows)
    time.sleep(0.5)
    os._exit(0)  # never rely on process-group teardown at exit


def bed(cmd: str, *args: str) -> str:
    return subprocess.run(["bash", HOSTS, cmd, "--name", "xhost", *args], check=True, capture_output=True,
                          text=True).stdout


def measure(args, pids: list[int], addrs: list[str]) -> list[dict]:
    ctx = mp.get_context("spawn")
    a, b, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(0, pids, addrs, args, a, b, results)),
             ctx.Process(target=worker, args=(1, pids, addrs, args, b, a, results))]
    for p in procs:
        p.start()
    rows = results.get(timeout=1800)
    for p in procs:
        p.join(60)
    return rows


def render(res: dict) -> str:
    lines = [f"# KV handoff between two hosts against raw TCP ({res['device']})", "",
             "Two hosts of a bed on one machine (scripts/hosts.sh: network namespaces on a bridge); the pair's",
             "gloo group between their addresses against one TCP socket between the same two, the same bytes.",
             f"KV: {res['kv']}. Median of {res['iters']} after one warm-up.", ""]
    for link, rows in res["runs"].items():
        lines += [f"## link: {link}", "", "| tokens | MiB | handoff ms | handoff GB/s | raw TCP ms | raw TCP GB/s | "
                  "handoff / raw | spread ms |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['tokens']} | {r['bytes'] / 2**20:.1f} | {r['handoff_ms']:.1f} | "
                         f"{r['handoff_GBps']:.2f} | {r['raw_tcp_ms']:.1f} | {r['raw_tcp_GBps']:.2f} | "
                         f"{r['efficiency']:.2f} | "
                         f"{r['spread_ms'][0]:.1f}-{r['spread_ms'][1]:.1f} |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for link, rows in res["runs"].items():
        t = [r["tokens"] for r in rows]
        ax.plot(t, [r["handoff_GBps"] for r in rows], "o-", label=f"handoff ({link})")
        ax.plot(t, [r["raw_tcp_GBps"] for r in rows], "s--", label=f"raw TCP ({link})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("GB/s")
    ax.set_title("KV handoff between two hosts vs raw TCP")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048,8192", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tc", default="tbf rate 10gbit burst 1mb latency 10ms",
                    help="the qdisc of the shaped run, as `tc qdisc add dev eth0 root` takes it ('' for none)")
    ap.add_argument("--out", default="bench/results/cross_host")
    args = ap.parse_args()
    bed("down")
    out = bed("up", "2")
    addrs = [line.split()[1] for line in out.strip().splitlines()]
    pids = [int(open(f"/run/pdserve-hosts/xhost/h{i}.pid").read()) for i in (1, 2)]
    res = {"device": "CPU, two network namespaces of one machine, gloo", "iters": args.iters,
           "kv": f"{LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} float32, {BLOCK}-token blocks", "runs": {}}
    try:
        res["runs"]["veth"] = measure(args, pids, addrs)
        if args.tc:
            for h in ("h1", "h2"):
                bed("run", h, "--", "tc", "qdisc", "add", "dev", "eth0", "root", *args.tc.split())
            res["runs"][args.tc] = measure(args, pids, addrs)
    finally:
        bed("down")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cross_host_handoff.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = render(res)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(md)
    plot(res, os.path.join(args.out, "cross_host_handoff.png"))
    print(md)


if __name__ == "__main__":
    main()
