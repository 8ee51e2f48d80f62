#!/usr/bin/env bash
# One call's check of the multi-GPU paths on 2+ GPUs of one host (fits a 10-minute call on H200s):
# the GPU tests of tensor parallelism (overlapped TP steps over NCCL, TP workers through Ray and
# `pdserve serve -tp 2`), the pull's copy kernel swept (reads and writes of a peer GPU), and the TP benches.
#
#   bash bench/multi_gpu_check.sh TOKENIZER_DIR OUT          # logs and results under OUT
#
# Each step runs under its own time limit (seconds, below); a step that fails or runs out is named
# at the end and the rest still run.
#   step        limit  what
#   tests       330    pytest -m gpu: tests/engine/test_tp_gpu.py and the TP cluster's GPU tests
#   sweep        40    bench/transfer_bench.py --link pull --kernel-sweep --tokens 2048,8192
#   tp8b         90    bench/tp_gpu.py --shape llama3-8b --tp 1,2 --all-reduce oneshot (with served rows)
#   tp32b        90    bench/tp_gpu.py --shape qwen3-32b --tp 2 --all-reduce oneshot
# (4x H200, 2026-11-28: sweep 13 s, tp8b 61 s, tp32b 71 s; the tests ran past 240 s: a float32 TP
# engine's start compiles every Triton kernel shape it will meet, over 100 s the first time)
set -uo pipefail
cd "$(dirname "$0")/.."
TOK="${1:?usage: bash bench/multi_gpu_check.sh TOKENIZER_DIR OUT}"
OUT="${2:?usage: bash bench/multi_gpu_check.sh TOKENIZER_DIR OUT}"
mkdir -p "$OUT/tp" "$OUT/ipc"
failed=()
run() {  # run NAME LIMIT CMD...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" >&2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || failed+=("$name (exit $?)")
  echo "== $name: $((SECONDS - t0)) s" >&2
  tail -n 14 "$OUT/$name.log"
}
export PDSERVE_TEST_TOKENIZER="$TOK"
run tests 330 python3 -m pytest -q -rf --tb=short -o faulthandler_timeout=200 -m gpu tests/engine/test_tp_gpu.py \
  tests/cluster/test_tensor_parallel_cluster.py
run sweep 40 python3 bench/transfer_bench.py --link pull --kernel-sweep --tokens 2048,8192 --iters 5 --out "$OUT/ipc"
run tp8b 90 python3 bench/tp_gpu.py --shape llama3-8b --tp 1,2 --all-reduce oneshot --tokenizer "$TOK" --out "$OUT/tp"
run tp32b 90 python3 bench/tp_gpu.py --shape qwen3-32b --tp 2 --all-reduce oneshot --tokenizer "$TOK" --out "$OUT/tp"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed or out of time: ${failed[*]}" >&2
  exit 1
fi
