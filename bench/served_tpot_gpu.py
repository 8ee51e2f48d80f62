"""Served TPOT at one request in flight against the engine's own decode step, on one GPU:
`pdserve serve` (colocated, one engine, the overlapped step on and off) measured by
`pdserve bench --max-concurrency 1`, next to `LLMEngine.step()` at batch 1 of the same model
(bench/decode_overlap_gpu.py --vocab 49152, run first). What the gap holds: the router, the
worker's streaming and the HTTP client, per token.

    python bench/decode_overlap_gpu.py --tokenizer DIR --vocab 49152 --batches 1 --out OUT/engine
    python bench/served_tpot_gpu.py --tokenizer DIR --engine-json OUT/engine/decode_overlap_gpu.json --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from serving_gpu import build_model, server_cmd, stop, wait_healthy


def serve_and_measure(model: str, args, overlap: bool) -> dict:
    cmd = server_cmd("colocated:1", model, args.port) + ["--async-scheduling" if overlap else "--no-async-scheduling"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, proc)
        name = f"served_{'on' if overlap else 'off'}"
        res = subprocess.run([sys.executable, "-m", "pdserve", "bench", "--url", url, "--workload", "synthetic",
                              "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                              "--num-requests", str(args.num_requests), "--rates", "inf", "--max-concurrency", "1",
                              "--label", name, "--out", args.out, "--name", name], capture_output=True, text=True,
                             timeout=900)
        print(res.stdout[-1500:], res.stderr[-1500:] if res.returncode else "", flush=True)
        with open(os.path.join(args.out, f"{name}.json")) as f:
            run = json.load(f)["runs"][0]
        return {"tpot_ms_p50": run["tpot_s"]["p50"] * 1e3, "tpot_ms_p90": run["tpot_s"]["p90"] * 1e3,
                "tpot_ms_mean": run["tpot_s"]["mean"] * 1e3, "ttft_ms_p50": run["ttft_s"]["p50"] * 1e3,
                "completed": run["completed"]}
    finally:
        stop(proc)


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--engine-json", required=True, help="decode_overlap_gpu.py's result for the same model")
    ap.add_argument("--out", default="bench/results/overlap")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    return ap


def main() -> None:
    args = parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(args.engine_json) as f:
        engine = json.load(f)
    (b1,) = [r for r in engine["rows"] if r["batch"] == 1]
    with tempfile.TemporaryDirectory() as d:
        model = build_model(d, args.tokenizer)
        served = {k: serve_and_measure(model, args, k == "on") for k in ("off", "on")}
    device = torch.cuda.get_device_name()
    for k, s in served.items():
        s["engine_step_ms"] = b1[f"step_ms_{k}"]
        s["tpot_over_step"] = s["tpot_ms_p50"] / s["engine_step_ms"]
    with open(os.path.join(args.out, "served_tpot_gpu.json"), "w") as f:
        json.dump({"device": device, "engine_vocab": engine.get("vocab"), "served": served,
                   "workload": f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out, "
                               "one in flight"}, f, indent=2)
    lines = [f"# Served TPOT at one request in flight on {device}", "",
             f"`pdserve serve --mode colocated --decode 1` (Llama-3-8B shape, random bf16, vocabulary 49152), "
             f"`pdserve bench --max-concurrency 1`: {args.num_requests} requests of {args.input_len} tokens in, "
             f"{args.output_len} out. Engine step: `LLMEngine.step()` at batch 1, context 1024, same model "
             "(decode_overlap_gpu.py).", "",
             "| overlapped step | served TPOT p50 ms | p90 ms | engine step ms | served / engine |",
             "|---|---|---|---|---|"]
    for k, s in served.items():
        lines.append(f"| {k} | {s['tpot_ms_p50']:.2f} | {s['tpot_ms_p90']:.2f} | {s['engine_step_ms']:.2f} | "
                     f"{s['tpot_over_step']:.2f} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "served_tpot_gpu.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
