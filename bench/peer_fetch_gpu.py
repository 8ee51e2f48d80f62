"""TTFT of a prompt whose prefix another worker's GPU caches: fetched from it (transfer/fetch.py)
against recomputed, on one GPU shared by two worker processes (Llama-3-8B shape, random bf16
weights). The fetch moves over the link a pair of workers on one GPU uses: CUDA IPC, the receiver
pulling the holder's blocks (on CPU: shared memory).

    python bench/peer_fetch_gpu.py --tokenizer TOK --out bench/results/kv_tiers   # table last

For each prompt length: the holder process prefills the prefix; the receiver (this process, a
decode role as a worker runs it) serves a different prompt of the same length cold (recompute),
then the prompt with the holder's prefix under a FetchPlan (peer), then that prompt again (now a
GPU hit of its own). Every TTFT is of one request alone, one new token past the shared prefix,
eager (prefill-bound). --shape tiny runs the same on CPU with a tiny model (a check of the script).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv_capacity_gpu import ttft  # noqa: E402
from kv_tiers_gpu import bars, tier_model, tier_parser, write  # noqa: E402

from pdserve.decode.role import DecodeRole  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.role import Emitted, Fetching  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.validation import check_request  # noqa: E402
from pdserve.transfer.c10d import C10dConnector  # noqa: E402
from pdserve.transfer.fetch import FetchPlan, PeerFetches  # noqa: E402

ONE = SamplingParams(temperature=0, max_tokens=1)


def worker(name: str, kw: dict) -> tuple[LLMEngine, C10dConnector]:
    """An engine and its connector, in a process whose GIL turns are a worker actor's."""
    sys.setswitchinterval(0.0005)
    eng = LLMEngine(EngineConfig(**kw))
    return eng, C10dConnector(name, eng.runner.kv, host="127.0.0.1", kv_cache_dtype=eng.config.kv_cache_dtype)


def holder(conn, kw: dict, cuda: bool) -> None:
    """The holder's process: prefills what it is sent, serves fetches, polls its sends."""
    eng, connector = worker("holder", kw)
    fetches = PeerFetches(eng, connector)
    conn.send("ready")
    while True:
        if conn.poll(0.0005):
            msg = conn.recv()
            if msg[0] == "prefill":
                conn.send(ttft(eng, msg[1], cuda))
            elif msg[0] == "serve":
                conn.send(fetches.serve(*msg[1:]))
            else:
                break
        fetches.take(connector.poll())
    connector.close()


def served(role: DecodeRole, conn, rid: str, ids: list[int], fetch: FetchPlan | None, cuda: bool) -> float:
    """Seconds to the first token of one request on the receiver, its fetch (if any) included."""
    t = time.perf_counter()
    e = role.engine  # the bench is the edge: it validates what a cluster's dispatcher would
    role.add(rid, check_request(ids, ONE, e.config.max_model_len, e.model_config.vocab_size), None, fetch)
    while True:
        for ev in role.step():
            if isinstance(ev, Fetching):
                conn.send(("serve", ev.request_id, ev.hashes, ev.target))
                if not conn.recv():
                    role.fetches.refused(ev.request_id, "refused")
            elif isinstance(ev, Emitted) and ev.output.finished:
                if cuda:
                    torch.cuda.synchronize()
                return time.perf_counter() - t


def one_length(role: DecodeRole, conn, cuda: bool, tokens: int, unit: int) -> dict:
    prefix = [100 + (7 * i + tokens) % 40000 for i in range(tokens)]
    other = [200 + (11 * i + tokens) % 40000 for i in range(tokens)]
    blocks = tokens // 16
    row = {"tokens": tokens, "kv_bytes": blocks * unit}
    row["recompute_s"] = served(role, conn, f"cold-{tokens}", other + [1], None, cuda)
    conn.send(("prefill", prefix + [9]))
    row["holder_prefill_s"] = conn.recv()
    before = role.fetches.stats().as_dict()
    row["peer_s"] = served(role, conn, f"peer-{tokens}", prefix + [2], FetchPlan("holder", blocks), cuda)
    after = role.fetches.stats().as_dict()
    row["peer_hit_tokens"] = after["prefix_cache_peer_hits"] - before["prefix_cache_peer_hits"]
    row["fetched_bytes"] = after["kv_peer_fetched_bytes"] - before["kv_peer_fetched_bytes"]
    row["fetch_s"] = after["kv_peer_fetch_seconds"] * after["kv_peer_fetches"] - \
        before["kv_peer_fetch_seconds"] * before["kv_peer_fetches"]
    row["link_gbps"] = row["fetched_bytes"] / row["fetch_s"] / 1e9 if row["fetch_s"] else None
    row["gpu_s"] = served(role, conn, f"gpu-{tokens}", prefix + [3], None, cuda)
    return row


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    return tier_parser()


def render(res: dict) -> str:
    lines = [f"# TTFT with the prefix on a peer worker's GPU ({res['device']}, {res['shape']})", "",
             f"`{res['command']}`; two worker processes on one GPU, the fetch over {res['link']}", "",
             "| prompt tokens | KV | recompute (ms) | fetched from the peer (ms) | of which the fetch (ms) | "
             "fetch GB/s | own GPU hit (ms) |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        gbps = f"{r['link_gbps']:.1f}" if r["link_gbps"] else "-"
        lines.append(f"| {r['tokens']} | {r['kv_bytes'] / 2**20:.0f} MiB | {r['recompute_s'] * 1e3:.0f} | "
                     f"{r['peer_s'] * 1e3:.0f} | {r['fetch_s'] * 1e3:.0f} | {gbps} | {r['gpu_s'] * 1e3:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parser().parse_args()
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as d:
        model, unit = tier_model(args.shape, d, args.tokenizer)
        lengths = [int(x) for x in args.tokens.split(",")]
        blocks = sum(-(-n // 16) for n in lengths) * 2 + 64
        kw = dict(model=model, dtype="bfloat16" if cuda else "float32", load_format="dummy",
                  max_model_len=max(lengths) + 64, enforce_eager=True, num_gpu_blocks_override=blocks,
                  max_num_batched_tokens=min(max(lengths) + 16, 16384), gpu_memory_utilization=0.45)
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=holder, args=(child, kw, cuda), daemon=True)
        proc.start()
        eng, connector = worker("receiver", kw)
        role = DecodeRole(eng, connector)
        assert conn.recv() == "ready"
        ttft(eng, list(range(5, 300)), cuda)  # warm-up
        conn.send(("prefill", list(range(1000, 1300))))
        conn.recv()
        # the pair connects (and maps the holder's KV) on its first fetch: not part of a TTFT below
        served(role, conn, "warm", list(range(1000, 1300)) + [7], FetchPlan("holder", 18), cuda)
        res = {"device": torch.cuda.get_device_name() if cuda else "CPU", "shape": args.shape,
               "command": "python bench/peer_fetch_gpu.py " + " ".join(sys.argv[1:]),
               "rows": [one_length(role, conn, cuda, n, unit) for n in lengths]}
        res["link"] = next((link.link for link in connector.links()), None)
        conn.send(("stop",))
        proc.join(30)
        connector.close()
    stem = os.path.join(args.out, f"peer_fetch_{args.shape}")
    write(res, stem, render(res))
    bars(res, stem + ".png", (("recompute_s", "recompute"), ("peer_s", "fetched from the peer"),
                              ("gpu_s", "own GPU hit")),
         f"TTFT with the prefix on a peer's GPU ({res['device']}, {res['link']})")


if __name__ == "__main__":
    main()
