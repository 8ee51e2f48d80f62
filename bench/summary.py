"""Collects the headline numbers of the committed GPU results into bench/results/summary.json.

    python bench/summary.py            # reads bench/results/*.json, writes summary.json

Every value is {"value", "workload", "command"}; goodput entries add the sweep they come from.
"""

from __future__ import annotations

import json
import os

RES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SERVE = ("python3 bench/serving_gpu.py --tokenizer TOKENIZER_DIR --trace TRACE --systems disagg --workloads trace,long "
         "--trace-rates 4,6,8 --long-rates 6,8,10 --out bench/results/serving; the same with --systems colocated "
         "--workloads long --long-rates 2,3 and 4,5,6 (one JSON), and --workloads trace --trace-rates 2,3,4  "
         "# nvidia-h200-x2")
ENGINE = "python3 bench/engine_gpu.py --batches 1,64 --prefill 4096 --hf-batches 1,64 --out bench/results  # one H200"
TRANSFER = "python3 bench/transfer_bench.py --out bench/results  # nvidia-h200-x2"


def load(*parts):
    with open(os.path.join(RES, *parts)) as f:
        return json.load(f)


def goodput_entry(path: str) -> dict:
    res = load("serving", path)
    runs = [{"rate": r["rate"], "slo_attainment": round(r["slo_attainment"], 3)} for r in res["runs"]]
    g = res["goodput"]
    lowest = min(r["rate"] for r in res["runs"])
    note = ("lower bound: every swept rate met 90%" if g["lower_bound"] else
            f"below the lowest swept rate ({lowest:g} req/s): 0 means < {lowest:g}" if g["rps"] == 0 else "")
    return {"value": round(g["rps"], 3), "workload": res["config"]["workload_desc"] +
            f"; SLO TTFT <= {res['config']['ttft_slo']} s, TPOT <= {res['config']['tpot_slo'] * 1000:.0f} ms",
            "command": SERVE, "sweep": runs, **({"note": note} if note else {})}


def main() -> None:
    eng = load("engine_gpu_b64.json")
    dec = {r["batch"]: r for r in eng["decode"]}
    hf = {r["batch"]: r for r in eng["hf"]["decode"]}
    pre = {r["tokens"]: r for r in eng["prefill"]}
    xfer = {r["tokens"]: r for r in load("transfer.json")}
    wl_dec = "Llama-3-8B config, random bf16, context 1024, one H200"
    summary = {
        "goodput_disagg_rps": goodput_entry("long_disagg.json"),
        "goodput_colocated_rps": goodput_entry("long_colocated.json"),
        "decode_vs_hf_b64": {"value": round(dec[64]["tokens_per_s"] / hf[64]["tokens_per_s"], 2),
                             "workload": wl_dec + ", batch 64 (HF generate, same process)", "command": ENGINE},
        "decode_vs_hf_b1": {"value": round(dec[1]["tokens_per_s"] / hf[1]["tokens_per_s"], 2),
                            "workload": wl_dec + ", batch 1", "command": ENGINE},
        "decode_floor_ratio_b1": {"value": round(dec[1]["ratio_to_floor"], 3),
                                  "workload": wl_dec + ", batch 1, CUDA graph step / HBM floor", "command": ENGINE},
        "decode_mbu": {"value": round(dec[64]["floor_ms"] / dec[64]["step_ms"], 3),
                       "workload": wl_dec + ", batch 64: bytes read per step / step time / measured copy bandwidth",
                       "command": ENGINE},
        "prefill_mfu": {"value": round(pre[4096]["frac_of_matmul"], 3),
                        "workload": "4096-token prompt, Llama-3-8B config, one H200, of the measured bf16 matmul "
                                    f"ceiling ({eng['ceilings']['matmul_TFLOPs']:.0f} TFLOP/s)", "command": ENGINE},
        "handoff_efficiency": {"value": round(xfer[2048]["effective_GBps"] / xfer[2048]["raw_nccl_GBps"], 3),
                               "workload": "2048-token handoff (256 MiB of KV, random block ids) vs raw NCCL "
                                           "send/recv of the same bytes, 2x H200", "command": TRANSFER},
    }
    with open(os.path.join(RES, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for k, v in summary.items():
        print(f"{k:24s} {v['value']}")


if __name__ == "__main__":
    main()
