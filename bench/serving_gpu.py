"""Serving benchmark on one host's GPUs: pdserve disaggregated (1 prefill + 1 decode),
pdserve hybrid (the same pools, SLO-aware placement), pdserve colocated (2 engines,
chunked prefill) and Hugging Face `generate` (batched, one replica per GPU), each behind
an OpenAI endpoint, all measured by `pdserve bench`.

    python bench/serving_gpu.py --tokenizer DIR --systems disagg,hybrid,colocated,hf \\
        --workloads long,trace --tpot-slos 20,40 --out bench/results/serving

Model (`--shape`): Llama-3-8B's shape (32 layers, 4096 hidden, GQA 32:8, 14336 MLP; the default),
Qwen3-32B's or Llama-3-70B's (dense, for TP workers: `--systems hybrid:1:1:tp2`), Qwen3-30B-A3B's or
DeepSeek-V2-Lite's (mixture of experts) with random bf16 weights (`--fp8`: held in FP8 with block
scales); the vocabulary is the given tokenizer's (SmolLM2's 49,152 tokens, so outputs detokenize),
not the models' own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from pdserve.bench.workloads import DEFAULT_TRACE

HERE = os.path.dirname(os.path.abspath(__file__))

# workload -> pdserve bench arguments (SLOs and why: bench/results/serving.md)
WORKLOADS = {
    "long": ["--workload", "synthetic", "--input-len", "4096", "--output-len", "256",
             "--slo-ttft", "1.0", "--slo-tpot", "0.04"],
    "trace": ["--workload", "trace", "--length-scale", "0.25", "--output-scale", "0.5",
              "--max-input-len", "8000", "--max-output-len", "512", "--trace-start", "0",
              "--slo-ttft", "2.0", "--slo-tpot", "0.04"],
}
# the trace's requests of one 3 s tick all at one instant (the replay of earlier rounds)
WORKLOADS["trace-bursts"] = WORKLOADS["trace"] + ["--trace-bursts"]
RATES = {"long": "4,6,8,10,12", "trace": "4,6,8,11,15", "trace-bursts": "4,8"}


# Model shapes served (random bf16 weights, the given tokenizer's vocabulary, so outputs detokenize);
# 16K positions so the 8K-prompt benches have room to decode (the engine refuses a max_model_len
# past max_position_embeddings)
SHAPES = {
    "llama3-8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                  "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 500000.0},
    # Qwen3-32B's and Llama-3-70B's matrices in the Llama family (dense; for TP2 workers: --systems ...:tp2)
    "qwen3-32b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120,
                  "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                  "max_position_embeddings": 16384, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0},
    "llama3-70b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                   "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                   "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 500000.0},
    # Qwen3-30B-A3B: 48 layers, 128 experts of 768, top-8, per-head q/k norm
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                      "rope_theta": 1000000.0},
    # DeepSeek-V2-Lite: 27 layers, latent attention (512 + 64 rope, 16 heads), 64 experts of 1408 top-6
    # + 2 shared, the first layer dense (bench/results/mla/)
    "deepseek-v2-lite": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
                         "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
                         "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                         "v_head_dim": 128, "topk_method": "greedy", "max_position_embeddings": 16384,
                         "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
}


# the `quantization_config` of the -FP8 releases (DeepSeek-V3, Qwen3-*-FP8): e4m3 weights, a scale per 128 x 128
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def build_model(out_dir: str, tokenizer_dir: str, shape: str = "llama3-8b", fp8: bool = False) -> str:
    """A config-only model directory of `shape` with the tokenizer's files (served with dummy weights);
    `fp8`: its config carries FP8's quantization_config, so the loader holds the decoder linears and
    fused experts in FP8 as it does a checkpoint's."""
    cfg = {**SHAPES[shape], "vocab_size": 49152, "tie_word_embeddings": False, "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": "bfloat16", "initializer_range": 0.02,
           **({"quantization_config": FP8} if fp8 else {})}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens", "chat_template")


def copy_tokenizer(tokenizer_dir: str, out_dir: str) -> None:
    """The tokenizer's files only: a model directory given as TOK (its config.json, its weights)
    must not replace the shape's (a run with the default model's directory served a 135M model)."""
    for name in os.listdir(tokenizer_dir):
        if name.startswith(TOKENIZER_FILES):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)


def save_ratio_plot(fig, ax, json_path: str, xlabel: str, ylabel: str, title: str, **legend) -> str:
    """The GPU scripts' plots of a ratio against batch: the 1.0 line, a log2 batch axis, labels;
    saved beside the result as PNG. Returns its path."""
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(**legend)
    out = json_path[: -len(".json")] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def server_cmd(system: str, model: str, port: int, one_gpu: bool = False) -> list[str]:
    """system: disagg[:P:D] (default 1:1), hybrid[:P:D] (default 1:1), colocated[:N] (default 2),
    hf[:GPUS] (default 2); a trailing ":cN" sets the chunk budget (the prefill pool's, for disagg),
    ":nofetch" turns peer fetch off, ":adaptive" lets the ratio planner move workers between the pools,
    ":tpN" makes every worker tensor-parallel over N GPUs (":ptpN" /
    ":dtpN": the prefill / decode pool's only). `one_gpu`: two workers share one GPU (num_gpus 0.5
    and 0.42 of its memory each; their handoffs and fetches go over CUDA IPC)."""
    kind, *sizes = system.split(":")
    budget = [x[1:] for x in sizes if x.startswith("c")]
    fetch = "nofetch" not in sizes  # a trailing ":nofetch": handoff.peer_fetch false (recompute what peers hold)
    adaptive = "adaptive" in sizes  # ":adaptive": the ratio planner moves workers between pools (pools/ratio.py)
    tp = {k: x[len(k):] for x in sizes for k in ("tp", "ptp", "dtp") if x.startswith(k) and x[len(k):].isdigit()}
    sizes = [x for x in sizes if not x.startswith(("c", "tp", "ptp", "dtp")) and x not in ("nofetch", "adaptive")]
    share = one_gpu and kind in ("disagg", "hybrid", "colocated")
    cfg = os.path.join(tempfile.mkdtemp(), "serving.yaml")
    with open(cfg, "w") as f:
        f.write(f"handoff: {{peer_fetch: {str(fetch).lower()}}}\n")
        if adaptive:
            f.write("autoscale: {enabled: true, policy: ratio, cooldown_s: 20, window_s: 30}\n")
        if share:
            f.write("prefill: {num_gpus: 0.5}\ndecode: {num_gpus: 0.5}\n")
    common = ["--model", model, "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "8704",
              "--port", str(port), "--gpu-memory-utilization", "0.42" if share else "0.85", "--max-queue", "4096",
              "--config", cfg]
    if kind in ("disagg", "hybrid"):
        p, d = (sizes + ["1", "1"])[:2] if sizes else ("1", "1")
        extra = ["--prefill-max-num-batched-tokens", budget[0]] if budget else []
        for role in ("prefill", "decode"):
            n = tp.get(role[0] + "tp", tp.get("tp"))
            extra += [f"--{role}-tp", n] if n else []
        return [sys.executable, "-m", "pdserve", "serve", "--mode", kind, "--prefill", p, "--decode", d,
                *common, *extra]
    if kind == "colocated":
        extra = ["--max-num-batched-tokens", budget[0]] if budget else []
        extra += ["--tensor-parallel-size", tp["tp"]] if "tp" in tp else []
        return [sys.executable, "-m", "pdserve", "serve", "--mode", "colocated", "--decode",
                sizes[0] if sizes else "2", *common, *extra]
    if kind == "hf":
        return [sys.executable, os.path.join(HERE, "hf_server.py"), "--model", model, "--dummy", "--gpus",
                sizes[0] if sizes else "2", "--max-batch", "32", "--port", str(port)]
    raise ValueError(f"unknown system {system!r}: disagg[:P:D] | colocated[:N] | hf[:GPUS]")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError("server did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    """Ends the server (its own Ray goes with it: `pdserve serve` starts and shuts down its own),
    and, should that hang, its process group: what this script started, nothing else."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a server that hung (Ray's processes)
    except ProcessLookupError:
        pass
    proc.wait()


def sweeps(system: str, workloads: str, tpot_slos: str, repeats: int) -> list[tuple[str, str | None, int, int]]:
    """(workload, TPOT SLO in ms or None, repeat, seed) of each sweep one server runs, in order. A
    hybrid or colocated server is told each TPOT SLO in turn (POST /admin/slo: its engines size
    their prefill chunks by it); the others do not depend on it (their goodput at any TPOT SLO
    comes from one sweep). Seeds: 100 x the workload's place, plus the sweep's count within it: no
    sweep replays one before it on the same server (its prefix cache would serve it), and every
    system's first sweeps of a workload see the same prompts in the same order."""
    out = []
    for w, wl in enumerate(workloads.split(",")):
        slos = [None]
        if system.startswith(("hybrid", "colocated")):
            slos = [x.split(":")[-1] for x in tpot_slos.split(",") if ":" not in x or x.startswith(wl + ":")]
        out += [(wl, tpot, rep, 100 * w + i) for i, (tpot, rep) in
                enumerate((t, r) for t in slos for r in range(1, repeats + 1))]
    return out


def run_workload(args, url: str, system: str, wl: str, tpot_ms: str | None, rep: int = 1, seed: int = 0) -> tuple:
    """One rate sweep of one workload (`rep` > 1: a repeat, its results named -r<rep>); a hybrid or
    colocated server first learns the SLO it serves. `seed`: the sweep's prompts and arrivals; each
    sweep on one server takes its own, or a repeat would be served from the prefix cache the sweep
    before it filled."""
    wargs = list(WORKLOADS[wl])
    name = f"{wl}_{system.replace(':', '-')}"
    if tpot_ms is not None:
        ttft = wargs[wargs.index("--slo-ttft") + 1]
        wargs[wargs.index("--slo-tpot") + 1] = str(float(tpot_ms) / 1000)
        body = json.dumps({"ttft_s": float(ttft), "tpot_s": float(tpot_ms) / 1000}).encode()
        urllib.request.urlopen(urllib.request.Request(url + "/admin/slo", data=body,
                                                      headers={"Content-Type": "application/json"}), timeout=60)
        name += f"-t{tpot_ms}"
    name += f"-r{rep}" if rep > 1 else ""
    rates = getattr(args, f"{wl.replace('-', '_')}_rates")
    cmd = [sys.executable, "-m", "pdserve", "bench", "--url", url, *wargs, "--rates", rates,
           "--num-requests", str(args.num_requests), "--label", name.split("_", 1)[1], "--out", args.out,
           "--name", name, "--seed", str(seed)]
    if wl.startswith("trace"):
        cmd += ["--trace", args.trace]
    t = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(res.stdout[-3000:], flush=True)
    if res.returncode != 0:
        print(res.stderr[-3000:], flush=True)
    with open(os.path.join(args.out, f"{name}.json")) as f:
        g = json.load(f)["goodput"]
    try:  # the workers' own view at the end (step-time model, placement counts)
        with urllib.request.urlopen(url + "/admin/status", timeout=60) as r, \
                open(os.path.join(args.out, f"{name}_status.json"), "w") as f:
            f.write(r.read().decode())
    except OSError as e:
        print(f"status: {e}")
    handoffs(url, os.path.join(args.out, f"{name}_handoff.json"))
    return wl, name, g["rps"], g["lower_bound"], time.time() - t


def handoffs(url: str, path: str) -> None:
    """The KV bytes the server's handoffs moved so far and how many (its /metrics), into `path`:
    bytes per handoff is what a prompt's KV costs the link. Nothing for a server without handoffs."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            text = r.read().decode()
    except OSError as e:
        print(f"metrics: {e}")
        return

    def total(metric: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metric + "{"))

    n, nbytes = total("pdserve:kv_handoff_seconds_count"), total("pdserve:kv_handoff_bytes_total")
    if n:
        with open(path, "w") as f:
            json.dump({"handoffs": n, "bytes": nbytes, "bytes_per_handoff": nbytes / n}, f, indent=1)
        print(f"handoffs: {n:.0f}, {nbytes / n / 2**20:.1f} MiB each", flush=True)


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="the served model's shape")
    ap.add_argument("--fp8", action="store_true",
                    help="the model's weights held in FP8 (block-scaled e4m3, as the -FP8 checkpoints ship)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="disagg / hybrid: the prefill and decode workers share one GPU (handoffs over CUDA IPC)")
    ap.add_argument("--systems", default="disagg,colocated,hf",
                    help="comma-separated: disagg[:P:D], hybrid[:P:D], colocated[:N], hf[:GPUS] (e.g. disagg:2:1 "
                         "on 3 GPUs); :tpN for TP workers (hybrid:1:1:tp2 on 4 GPUs)")
    ap.add_argument("--workloads", default="long,trace")
    ap.add_argument("--out", default="bench/results/serving")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--long-rates", default=RATES["long"])
    ap.add_argument("--trace-rates", default=RATES["trace"])
    ap.add_argument("--trace-bursts-rates", default=RATES["trace-bursts"])
    ap.add_argument("--num-requests", type=int, default=96, help="per rate")
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--tpot-slos", default="40",
                    help="TPOT SLOs (ms) a hybrid server runs at in turn: MS (every workload) or WL:MS")
    ap.add_argument("--warm-up", choices=("server", "client"), default="server",
                    help="server: the first rate is the first traffic the healthy server sees (its own warm-up "
                         "only); client: 8 requests of ours before it")
    ap.add_argument("--repeats", type=int, default=1,
                    help="sweeps of each workload on the same server (their spread: results named -r2, -r3, ...)")
    return ap


def main() -> None:
    args = parser().parse_args()
    # a SIGTERM (`timeout`, a job's end) unwinds like an error: each server is stopped in `finally`,
    # so a cut run leaves no server (and its GPUs' memory) behind for the next
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # 8192-token prompts + their outputs on shapes trained to 8192 positions: dummy weights, nothing to degrade
    os.environ.setdefault("PDSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    model = build_model(os.path.join(tempfile.mkdtemp(), f"{args.shape}-shape"), args.tokenizer, args.shape,
                        fp8=args.fp8)
    url = f"http://127.0.0.1:{args.port}"
    summary = []
    for system in args.systems.split(","):
        log = open(os.path.join(tempfile.gettempdir(), f"server-{system.replace(':', '-')}.log"), "w")
        proc = subprocess.Popen(server_cmd(system, model, args.port, args.one_gpu), stdout=log,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)  # a process group of its own: stop() ends only it
        try:
            up = wait_healthy(url, proc)
            print(f"== {system}: healthy after {up:.0f} s", flush=True)
            if args.warm_up == "client":  # 8 requests first (the server warms itself before /health says ready)
                subprocess.run([sys.executable, "-m", "pdserve", "bench", "--url", url, "--workload", "synthetic",
                                "--input-len", "2048", "--output-len", "16", "--num-requests", "8", "--rate", "inf"],
                               capture_output=True, timeout=300)
            for wl, tpot, rep, seed in sweeps(system, args.workloads, args.tpot_slos, args.repeats):
                summary.append(run_workload(args, url, system, wl, tpot, rep, seed=seed))
        except Exception as e:  # noqa: BLE001 - keep the other systems' results
            print(f"== {system} failed: {e}", flush=True)
            log.flush()
            with open(log.name) as f:
                print(f.read()[-4000:], flush=True)
        finally:
            stop(proc)
            log.close()
    print("\n| workload | system | goodput (req/s) | wall (s) |\n| --- | --- | --- | --- |")
    for wl, system, rps, lb, wall in summary:
        print(f"| {wl} | {system} | {'>= ' if lb else ''}{rps:.2f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
