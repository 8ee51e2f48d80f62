"""Tensor parallelism on GPUs: a TP=N engine's decode step (batch 1 and 64) against the
HBM floor of ONE rank's bytes, and its 4K prefill against the matmul ceiling of one
rank's FLOPs (random bf16 weights: speed does not depend on the values).

    python bench/tp_gpu.py --shape llama3-70b --tp 2 --tokenizer TOK --out bench/results/tp
    python bench/tp_gpu.py --shape llama3-8b --tp 1,2 --tokenizer TOK --out bench/results/tp
    python bench/tp_gpu.py --shape qwen3-32b --tp 2 --tokenizer TOK --out bench/results/tp
    python bench/tp_gpu.py --shape llama3-70b --rank-of 2 ...   # one GPU: one rank's shapes
                                                                # (no all-reduce: the compute part)
    python bench/tp_gpu.py --shape qwen3-30b-a3b --tp 1,2 --ep ...  # MoE: TP=2 and EP=2 beside TP=1
A mixture-of-experts shape's floor counts the experts a step's batch is expected to touch on
the rank (uniform routing, as `pdserve plan` counts them: random weights route near uniformly),
and its prefill the parameters a token activates; `--ep` adds each TP size's run with its
experts whole, E / N a rank (enable_expert_parallel).
Ranks 1..N-1 run as child processes (engine/exec/shard.py), one GPU each; rank 0 is this
process. TP > 1 runs once per --all-reduce: the one-shot kernel over CUDA IPC buffers for the
small all-reduces (engine/base/ipc_allreduce.py; the default engine) and NCCL for all.
Prints a table last; writes tp_gpu_<shape>.{json,md,png} under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_gpu import LLAMA3_8B, ceilings, timed  # noqa: E402
from moe_gpu import QWEN3_30B_A3B  # noqa: E402

LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}
# Qwen3-32B's matrices (64 layers, hidden 5120, 64 q / 8 KV heads of 128, MLP 25600, vocab 151936) in
# the Llama family (its per-head q/k norms cost no bytes to speak of)
QWEN3_32B = {**LLAMA3_8B, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
             "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "qwen3-32b": QWEN3_32B, "qwen3-30b-a3b": QWEN3_30B_A3B}


class RankBytes:
    """What one rank of a (TP or EP) engine reads and computes: its weights but the embedding
    table, and for a mixture-of-experts model its experts apart (the local ones: all E, I / N
    wide, under TP; E / N whole under EP)."""

    def __init__(self, model, top_k: int = 0, num_experts: int = 0):
        params = dict(model.named_parameters())
        self.weights = sum(p.numel() * p.element_size() for n, p in params.items() if "embed" not in n)
        self.elem = next(iter(params.values())).element_size()
        experts = [p for n, p in params.items() if n.endswith(("w_gate_up", "w_down"))]
        self.expert_bytes = sum(p.numel() * p.element_size() for p in experts)
        self.local = experts[0].shape[0] if experts else 0  # experts a sparse layer holds on this rank
        self.layers = len(experts) // 2
        self.one = self.expert_bytes / (self.layers * self.local) if experts else 0.0  # one local expert
        self.top_k, self.num_experts = top_k, num_experts

    def touched(self, batch: int) -> float:
        """Local experts a decode batch is expected to route to, per sparse layer (uniform routing)."""
        if not self.local:
            return 0.0
        return self.local * (1 - (1 - self.top_k / self.num_experts) ** batch)

    def decode_bytes(self, batch: int) -> float:
        return self.weights - self.expert_bytes + self.layers * self.touched(batch) * self.one

    def active_params(self) -> float:
        """Parameters one token runs on this rank: its top_k experts' local share."""
        share = self.top_k * self.local / self.num_experts if self.local else 0
        return (self.weights - self.expert_bytes + self.layers * share * self.one) / self.elem


def rank_shape(cfg: dict, n: int) -> dict:
    """A one-GPU model with one rank's matrices of a TP=n split (heads, KV heads, MLP, LM
    head divided; hidden size kept): the compute of a rank without its all-reduces."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return {**cfg, "num_attention_heads": cfg["num_attention_heads"] // n, "head_dim": head_dim,
            "num_key_value_heads": max(1, cfg["num_key_value_heads"] // n),
            "intermediate_size": cfg["intermediate_size"] // n, "vocab_size": -(-cfg["vocab_size"] // n)}


def run(cfg: dict, tp: int, tokenizer: str, batches: list[int], ctx: int, prefill: int, ceil: dict,
        all_reduce: str = "oneshot", ep: bool = False) -> dict:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core.request import Request
    from pdserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    bs, per_seq = 16, ctx // 16 + 1
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        ec = EngineConfig(model=d, tokenizer=tokenizer, dtype="bfloat16", tensor_parallel_size=tp,
                          load_format="dummy",
                          num_gpu_blocks_override=max(max(batches) * (per_seq + SERVED_STEPS // bs + 2),
                                                      prefill // bs) + 8,
                          max_model_len=max(prefill, ctx) + 64, max_num_batched_tokens=prefill,
                          max_num_seqs=max(batches), disable_custom_all_reduce=all_reduce == "nccl",
                          enable_expert_parallel=ep)
        engine = LLMEngine(ec)
    if tp > 1 and all_reduce == "oneshot" and engine.tp.oneshot is None:
        print(f"TP={tp}: the one-shot all-reduce is off: {engine.tp.oneshot_why}")
    runner = engine.runner
    try:
        runner.kv.normal_()
        rank = RankBytes(runner.model, cfg.get("num_experts_per_tok", 0), cfg.get("num_experts", 0))
        kv_tok = runner.layout.block_bytes // bs
        greedy, vocab = SamplingParams(temperature=0, max_tokens=16), cfg["vocab_size"]
        rows = []
        for b in tqdm(batches, desc=f"decode TP={tp}"):
            sched = []
            for i in range(b):
                toks = torch.randint(0, min(vocab, 32000), (ctx + 1,)).tolist()
                r = Request(f"d{b}-{i}", toks[:ctx], greedy, max_tokens=16)
                r.append_token(toks[ctx])
                r.num_computed_tokens = ctx
                sched.append(ScheduledRequest(r, 1, list(range(i * per_seq, (i + 1) * per_seq))))
            t = timed(lambda s=sched: runner.execute(SchedulerOutput(s)), 10, warmup=3)
            floor = (rank.decode_bytes(b) + b * (ctx + 1) * kv_tok) / (ceil["copy_GBps"] * 1e9)
            rows.append({"kind": "decode", "batch": b, "context": ctx, "ms": t * 1e3, "floor_ms": floor * 1e3,
                         "ratio": t / floor})
            t = served_step(engine, b, ctx, vocab)
            rows.append({"kind": "served", "batch": b, "context": ctx, "ms": t * 1e3, "floor_ms": floor * 1e3,
                         "ratio": t / floor})
        toks = torch.randint(0, min(vocab, 32000), (prefill,)).tolist()
        s = [ScheduledRequest(Request("p", toks, greedy, max_tokens=16), prefill, list(range(-(-prefill // bs))))]
        t = timed(lambda: runner.execute(SchedulerOutput(s)), 5, warmup=2)
        h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
        heads_dim = engine.model_config.num_heads * engine.model_config.head_dim // tp  # this rank's q width
        flops = 2 * prefill * rank.active_params() + 4 * prefill * prefill * heads_dim * L / 2  # causal attention
        rows.append({"kind": "prefill", "tokens": prefill, "ms": t * 1e3, "TFLOPs": flops / t / 1e12,
                     "frac_of_matmul": flops / t / 1e12 / ceil["matmul_TFLOPs"]})
        label = "-" if tp == 1 else ("one-shot (IPC)" if engine.tp.oneshot is not None else "NCCL")
        return {"tp": tp, "ep": ep, "all_reduce": label, "rank_weight_GB": rank.weights / 1e9, "hidden": h,
                "rank_experts": rank.local, "rows": rows}
    finally:
        engine.close()


SERVED_STEPS = 40


def served_step(engine, b: int, ctx: int, vocab: int) -> float:
    """Seconds per engine.step() with b greedy requests decoding at ~ctx tokens of context: what a
    worker serves (scheduling, inputs, overlapped steps, outputs), where `runner.execute` is one
    step alone. Their prompts are prefilled first; they are aborted after."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=SERVED_STEPS + 16, ignore_eos=True)
    ids = [f"served-{b}-{i}" for i in range(b)]
    for rid in ids:
        engine.add_request(torch.randint(0, min(vocab, 32000), (ctx,)).tolist(), params, request_id=rid)
    while engine.scheduler.waiting or not all(r.is_decoding for r in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(SERVED_STEPS - 8):
        engine.step()
    engine.resolve()
    sync()
    t = (time.perf_counter() - t0) / (SERVED_STEPS - 8)
    for rid in ids:
        engine.abort_request(rid)
    return t


def parser() -> argparse.ArgumentParser:
    """The command line (a CPU test parses it: tests/bench/test_gpu_benches.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-70b")
    ap.add_argument("--tp", default="2", help="comma-separated TP sizes")
    ap.add_argument("--rank-of", type=int, default=1, help="run one rank's shapes of a TP=N split on one GPU")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--all-reduce", default="oneshot,nccl",
                    help="TP > 1: the decode all-reduces to run, comma-separated: oneshot (CUDA IPC) | nccl")
    ap.add_argument("--ep", action="store_true",
                    help="a mixture-of-experts shape: also each TP > 1 size with its experts whole, E / N a rank")
    ap.add_argument("--out", default="bench/results/tp")
    return ap


def main() -> None:
    args = parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.rank_of > 1 and "num_experts" in SHAPES[args.shape]:
        raise SystemExit(f"--rank-of: {args.shape} is a mixture-of-experts shape; run it with --tp N (and --ep)")
    if args.ep and "num_experts" not in SHAPES[args.shape]:
        raise SystemExit(f"--ep: {args.shape} has no experts")
    cfg = SHAPES[args.shape] if args.rank_of == 1 else rank_shape(SHAPES[args.shape], args.rank_of)
    ceil = ceilings()
    torch.cuda.empty_cache()
    runs = [(int(tp), ar, ep) for tp in args.tp.split(",")
            for ar in (args.all_reduce.split(",") if int(tp) > 1 else ["oneshot"])
            for ep in ((False, True) if args.ep and int(tp) > 1 else (False,))]
    results = [run(cfg, tp, args.tokenizer, [int(b) for b in args.batches.split(",")], args.ctx, args.prefill, ceil,
                   ar, ep) for tp, ar, ep in runs]
    name = f"tp_gpu_{args.shape}" + (f"_rank_of_{args.rank_of}" if args.rank_of > 1 else "")
    out = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "shape": args.shape,
           "rank_of": args.rank_of, "ceilings": ceil, "results": results}
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(out, f, indent=2)
    what = f"one rank of TP={args.rank_of} alone (no all-reduce)" if args.rank_of > 1 else "TP engine"
    lines = [f"# {args.shape}, {what}, on {out['device']}", "",
             f"Ceilings (same run): copy {ceil['copy_GBps']:.0f} GB/s, "
             f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s.",
             "", "| TP | all-reduce | rank weights GB | step | ms | floor / ceiling | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        tp = f"{r['tp']}{' EP' if r['ep'] else ''}"
        for row in r["rows"]:
            if row["kind"] in ("decode", "served"):
                what = "decode" if row["kind"] == "decode" else "served decode (engine.step)"
                lines.append(f"| {tp} | {r['all_reduce']} | {r['rank_weight_GB']:.1f} | "
                             f"{what} b={row['batch']} ctx {row['context']} | "
                             f"{row['ms']:.2f} | HBM floor {row['floor_ms']:.2f} ms | {row['ratio']:.2f}x floor |")
            else:
                lines.append(f"| {tp} | {r['all_reduce']} | {r['rank_weight_GB']:.1f} | "
                             f"prefill {row['tokens']} | {row['ms']:.1f} | "
                             f"{row['TFLOPs']:.0f} TFLOP/s | {row['frac_of_matmul']:.0%} of matmul |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        labels, got, floor = [], [], []
        for r in results:
            for row in r["rows"]:
                if row["kind"] == "decode":
                    labels.append(f"{'EP' if r['ep'] else 'TP'}{r['tp']}"
                                  f"{'' if r['tp'] == 1 else ' ' + r['all_reduce'][:4]} b{row['batch']}")
                    got.append(row["ms"])
                    floor.append(row["floor_ms"])
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], got, 0.4, label="decode step")
        ax.bar([x + 0.2 for x in xs], floor, 0.4, label="HBM floor (one rank's bytes)")
        ax.set_xticks(list(xs), labels)
        ax.set(ylabel="ms", title=f"{args.shape}: {what}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, name + ".png"), dpi=120)
    except ImportError:
        pass
    print(md)


if __name__ == "__main__":
    main()
