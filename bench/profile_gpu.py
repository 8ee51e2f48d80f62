"""Capacity profiles of the serving runs' model shapes on this GPU (`pdserve profile`), for the
simulator to predict the committed serving runs from (docs/performance.md, capacity planning).

    python bench/profile_gpu.py --tokenizer TOK --shapes llama3-8b,deepseek-v2-lite --device-name "one H200" \\
        --out bench/results/profiles

Each shape is served as the serving runs serve it (bench/serving_gpu.py: random bf16 weights,
max_model_len 8704, 0.85 of the GPU's memory) with the prefill pool's step budget (8192), so
every chunk size the runs meet is timed. Prints a table of what each profile holds last.

    python bench/profile_gpu.py --tokenizer TOK --shapes llama3-8b --sharing

adds to each committed profile what two engines of the shape cost each other on one GPU, as the
one-GPU serving runs run them (0.42 of its memory each; pdserve.sim.sharing: decode b32 at 2048
tokens and prefill chunks of 8192, alone and side by side), leaving its step fit as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from serving_gpu import build_model  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shapes", default="llama3-8b")
    ap.add_argument("--device-name", default="one H200")
    ap.add_argument("--out", default="bench/results/profiles")
    ap.add_argument("--extra", default="", help="more `pdserve profile` flags, space-separated")
    ap.add_argument("--sharing", action="store_true",
                    help="measure two engines sharing the GPU into the committed profiles (no re-profile)")
    ap.add_argument("--seconds", type=float, default=8.0, help="--sharing: each window's seconds")
    return ap


def same_card(profiled: str, here: str) -> bool:
    """Whether a profile's device ("one H200") names this GPU ("NVIDIA H200", "NVIDIA H100 80GB HBM3")."""
    cards = re.findall(r"\b[A-Z]+\d{2,4}[A-Za-z]*\b", profiled)
    return bool(cards) and all(re.search(rf"\b{c}\b", here) for c in cards)


def add_sharing(args) -> int:
    """Two engines of each shape on this GPU, measured into its committed profile (one of this card:
    another card's is refused, naming both)."""
    import torch
    from tqdm import tqdm

    from pdserve.sim.profile import Profile
    from pdserve.sim.sharing import measure

    rows = []
    for shape in args.shapes.split(","):
        path = os.path.join(args.out, f"{shape}.json")
        prof = Profile.load(path)
        here = torch.cuda.get_device_name(0)
        if not same_card(prof.device, here):
            print(f"profile_gpu: {path} was measured on {prof.device!r}, this GPU is {here!r}: sharing factors go "
                  "into a profile of the same card (profile this one first, without --sharing)", file=sys.stderr)
            return 2
        model = build_model(tempfile.mkdtemp(), args.tokenizer, shape)
        engine_args = dict(model=model, load_format="dummy", dtype="bfloat16", max_model_len=8704,
                           gpu_memory_utilization=0.42, max_num_batched_tokens=8192)
        t = time.time()
        with tqdm(total=5, desc=f"sharing {shape}", unit="window") as bar:
            def progress(done: int, total: int, what: str) -> None:
                bar.set_postfix_str(what)
                bar.update(done - bar.n)

            prof.sharing = measure(engine_args, context=2048, batch=32, seconds=args.seconds, progress=progress,
                                   source=f"python3 bench/profile_gpu.py --tokenizer TOK --shapes {shape} --sharing"
                                          f"  # {args.device_name}")
        prof.save(path)
        spread = prof.sharing.spread
        rows.append((shape, *(f"{spread[k]['mean']:.2f} ({spread[k]['median']:.2f} / {spread[k]['p90']:.2f})"
                              for k in ("decode|prefill", "prefill|decode", "decode|decode", "prefill|prefill")),
                     f"{time.time() - t:.0f}"))
    print("\nEach factor: the mean step beside over the mean alone (the median's and the 90th percentile's "
          "ratios)\n\n| shape | decode beside prefill | prefill beside decode | decode beside decode | "
          "prefill beside prefill | s |\n|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


def main() -> int:
    args = parser().parse_args()
    if args.sharing:
        return add_sharing(args)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        model = build_model(tempfile.mkdtemp(), args.tokenizer, shape)
        out = os.path.join(args.out, f"{shape}.json")
        cmd = [sys.executable, "-m", "pdserve", "profile", "--model", model, "--load-format", "dummy",
               "--dtype", "bfloat16", "--max-model-len", "8704", "--gpu-memory-utilization", "0.85",
               "--max-num-batched-tokens", "8192", "--name", shape, "--device-name", args.device_name,
               "--out", out, *args.extra.split()]
        t = time.time()
        res = subprocess.run(cmd, capture_output=True, text=True)
        print(res.stdout[-2000:], res.stderr[-3000:] if res.returncode else "", flush=True)
        if res.returncode:
            rows.append((shape, "failed", "", "", f"{time.time() - t:.0f}"))
            continue
        with open(out) as f:
            p = json.load(f)
        p["command"] = f"python3 bench/profile_gpu.py --tokenizer TOK --shapes {shape}  # {args.device_name}"
        with open(out, "w") as f:
            json.dump(p, f, indent=1)
        c = p["coefficients"]
        rows.append((shape, str(p["samples"]), f"{p['fit_error']:.1%}",
                     f"base {c['base'] * 1e3:.2f} ms, {1 / max(c['per_token'], 1e-12):.0f} tok/s, "
                     f"{c['per_kv_token'] * 1e9:.1f} ns/ctx tok", f"{time.time() - t:.0f}"))
    print("\n| shape | steps | fit error | step model | s |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
