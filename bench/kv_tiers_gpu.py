"""TTFT of a prompt whose prefix is on the GPU, in the host tier, in the disk tier or nowhere
(recomputed), on one GPU (Llama-3-8B shape, random bf16 weights), and the disk's read bandwidth.

    python bench/kv_tiers_gpu.py --tokenizer TOK --out bench/results/kv_tiers   # table last

For each prompt length: an engine with a small GPU cache, a host tier and a disk tier in a
directory of this machine's disk (--disk-dir). The prompt served cold (recomputed), again (a
GPU hit), again after unrelated prompts pushed it out of the GPU cache (a host hit); then the
engine is closed (its host tier goes to disk), the files are dropped from the page cache
(posix_fadvise DONTNEED: the reads hit the disk), and a new engine serves the prompt (a disk
hit, unless the engine predicts recomputing faster: the table says which happened). Every TTFT
is of one request alone, one new token past the shared prefix, eager (prefill-bound).
--shape tiny runs the same on CPU with a tiny model (a check of the script, not a result).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv_capacity_gpu import ttft  # noqa: E402
from serving_gpu import build_model  # noqa: E402

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402


def drop_page_cache(root: str) -> int:
    """Asks the kernel to drop the cached pages of every file under root; their bytes."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def read_gbps(root: str, limit: int = 2 << 30) -> float:
    """The disk's read bandwidth: up to `limit` bytes of the tier's files, out of the page cache."""
    drop_page_cache(root)
    done, t = 0, time.perf_counter()
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                while chunk := f.read(8 << 20):
                    done += len(chunk)
            if done >= limit:
                return done / (time.perf_counter() - t) / 1e9
    return done / max(time.perf_counter() - t, 1e-9) / 1e9


def one_length(model: str, cuda: bool, tokens: int, disk_dir: str, unit: int) -> dict:
    dtype = "bfloat16" if cuda else "float32"
    blocks = -(-tokens // 16)
    kw = dict(model=model, dtype=dtype, load_format="dummy", max_model_len=tokens + 64, enforce_eager=True,
              num_gpu_blocks_override=blocks + 8, max_num_batched_tokens=min(tokens + 16, 16384),
              kv_offloading_size=3 * blocks * unit / (1 << 30), kv_disk_dir=disk_dir,
              kv_disk_size=8 * blocks * unit / (1 << 30))
    prefix = [100 + (7 * i) % 40000 for i in range(tokens)]
    eng = LLMEngine(EngineConfig(**kw))
    ttft(eng, list(range(5, 5 + min(295, tokens))), cuda)  # warm-up
    row = {"tokens": tokens, "kv_bytes": blocks * unit}
    row["recompute_s"] = ttft(eng, prefix + [1], cuda)
    row["gpu_s"] = ttft(eng, prefix + [2], cuda)
    ttft(eng, [200 + (11 * i) % 40000 for i in range(tokens)], cuda)  # pushes the prefix to the host tier
    before = eng.stats().cache.host_hit_tokens
    row["host_s"] = ttft(eng, prefix + [3], cuda)
    row["host_hit_tokens"] = eng.stats().cache.host_hit_tokens - before
    eng.close()  # the host tier to disk
    row["disk_bytes"] = drop_page_cache(disk_dir)
    for key, forced in (("disk_s", False), ("disk_forced_s", True)):  # as the engine decides; read regardless
        eng = LLMEngine(EngineConfig(**kw))
        ttft(eng, list(range(5, 5 + min(295, tokens))), cuda)  # a prefill measured
        drop_page_cache(disk_dir)
        row[f"{key[:-2]}_predicted_read_gbps"] = eng.tiers.get("disk").read_gbps
        if forced:
            eng.tiers.get("disk").read_gbps = 1e6
        row[key] = ttft(eng, prefix + [4 + forced], cuda)
        s = eng.stats().as_dict()
        row[f"{key[:-2]}_hit_tokens"], row[f"{key[:-2]}_skipped_tokens"] = \
            s["prefix_cache_disk_hits"], s["kv_disk_skipped_tokens"]
        eng.close()
    return row


def tier_parser() -> argparse.ArgumentParser:
    """What the tier benches share on their command lines (this one and peer_fetch_gpu.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", choices=("llama3-8b", "tiny"), default="llama3-8b")
    ap.add_argument("--tokens", default="4096,16000")
    ap.add_argument("--out", default="bench/results/kv_tiers")
    return ap


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = tier_parser()
    ap.add_argument("--disk-dir", default=None, help="where the disk tier's files go (default: a temporary dir)")
    return ap


def render(res: dict) -> str:
    lines = [f"# TTFT by the tier a prefix is in ({res['device']}, {res['shape']})", "",
             f"`{res['command']}`; the disk's read bandwidth (files out of the page cache): "
             f"{res['disk_read_gbps']:.2f} GB/s", "",
             "| prompt tokens | KV | recompute (ms) | GPU hit (ms) | host tier (ms) | disk tier, as decided (ms) | "
             "read from disk? | disk tier, read regardless (ms) |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        read = "yes" if r["disk_hit_tokens"] else \
            f"no: recompute predicted faster ({r['disk_predicted_read_gbps']:.2f} GB/s predicted)"
        lines.append(f"| {r['tokens']} | {r['kv_bytes'] / 2**20:.0f} MiB | {r['recompute_s'] * 1e3:.0f} | "
                     f"{r['gpu_s'] * 1e3:.0f} | {r['host_s'] * 1e3:.0f} | {r['disk_s'] * 1e3:.0f} | {read} | "
                     f"{r['disk_forced_s'] * 1e3:.0f} |")
    return "\n".join(lines) + "\n"


def bars(res: dict, path: str, keys: tuple, title: str) -> None:
    """TTFT per (result key, label) of `keys`, one group of bars per prompt length (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        xs = [i + width * (k - (len(keys) - 1) / 2) for i in range(len(res["rows"]))]
        ax.bar(xs, [r[key] * 1e3 for r in res["rows"]], width, label=label)
    ax.set_xticks(range(len(res["rows"])), [f"{r['tokens']:,} tokens" for r in res["rows"]])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(res: dict, path: str) -> None:
    bars(res, path, (("recompute_s", "recompute"), ("gpu_s", "GPU hit"), ("host_s", "host tier"),
                     ("disk_s", "disk tier, as decided"), ("disk_forced_s", "disk tier, read regardless")),
         f"TTFT by the tier a prefix is in ({res['device']}; disk {res['disk_read_gbps']:.2f} GB/s)")


def tier_model(shape: str, d: str, tokenizer: str) -> tuple[str, int]:
    """The model to serve under `d` (Llama-3-8B's shape, or a tiny one on CPU) and its KV bytes per block."""
    if shape == "tiny":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from helpers import save_tiny

        return save_tiny("llama", os.path.join(d, "model"), tokenizer, max_positions=32768), 4096
    return build_model(os.path.join(d, "model"), tokenizer), 2 << 20


def write(res: dict, stem: str, md: str) -> None:
    """`stem`.json and .md (the plot is the caller's); prints the table."""
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)


def main() -> None:
    args = parser().parse_args()
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as d:
        model, unit = tier_model(args.shape, d, args.tokenizer)
        disk_dir = args.disk_dir or os.path.join(d, "kv")
        res = {"device": torch.cuda.get_device_name() if cuda else "CPU", "shape": args.shape,
               "command": "python bench/kv_tiers_gpu.py " + " ".join(sys.argv[1:]), "rows": []}
        for n in (int(x) for x in args.tokens.split(",")):
            shutil.rmtree(disk_dir, ignore_errors=True)
            res["rows"].append(one_length(model, cuda, n, disk_dir, unit))
        res["disk_read_gbps"] = read_gbps(disk_dir)
    stem = os.path.join(args.out, f"kv_tiers_{args.shape}")
    write(res, stem, render(res))
    plot(res, stem + ".png")


if __name__ == "__main__":
    main()
