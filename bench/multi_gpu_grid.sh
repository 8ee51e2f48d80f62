#!/usr/bin/env bash
# The multi-GPU serving grid, one part per call (each fits a 10-minute call on H200s; run the parts
# a session's device time allows, commit what comes back, then `python bench/grid_report.py`):
#
#   bash bench/multi_gpu_grid.sh TOKENIZER_DIR PART [OUT]     # OUT: bench/results/multi_gpu/runs
#
#   part                 GPUs  what
#   g2-colocated         2     colocated:2, long, TPOT 20 and 40, two sweeps each
#   g2-disagg            2     disagg:1:1, long (every TPOT from one sweep), two sweeps
#   g2-hybrid            2     hybrid:1:1, long, TPOT 20 and 40, two sweeps each
#   g4-colocated         4     colocated:4, long at TPOT 20 and 40, trace at 40
#   g4-disagg            4     disagg:2:2 and disagg:1:3, long and trace
#   g4-hybrid            4     hybrid:2:2, long at TPOT 20 and 40, trace at 40
#   g4-adaptive          4     hybrid:2:2:adaptive (the ratio planner), long at TPOT 20 and 40
#   g4-static            4     hybrid:1:3 and hybrid:3:1, long at TPOT 20 and 40 (the static splits)
#   g4-32b               4     Qwen3-32B shape: colocated:2:tp2 against hybrid:1:1:tp2, long at TPOT 20 and 30
#
# Every sweep sends 200 requests a rate (the first rate is the first traffic the healthy server sees:
# its own warm-up only); the second sweep of a system shows the spread and the first rate's gap.
set -uo pipefail
cd "$(dirname "$0")/.."
TOK="${1:?usage: bash bench/multi_gpu_grid.sh TOKENIZER_DIR PART [OUT]}"
PART="${2:?a part: g2-colocated g2-disagg g2-hybrid g4-colocated g4-disagg g4-hybrid g4-adaptive g4-static g4-32b}"
OUT="${3:-bench/results/multi_gpu/runs}"
LONG2=8,10,12,14  # 4x H200 (2 of them): colocated:2 and hybrid:1:1 reach 11-12 req/s at TPOT 40
LONG4=12,16,20,24
LONG4_T40=20,24,28,32  # 4x H200: both colocated:4 and hybrid:2:2 met TPOT 40 at 24 req/s
TRACE4=40,48,56,64  # 4x H200, TPOT 40: colocated:4 49.6-55.4, hybrid:2:2 55.1-64.7 req/s
TRACE4_DISAGG=24,30,36  # disagg:2:2: 31.4-31.6
serve() {  # serve GPUS SYSTEMS WORKLOADS TPOTS RATES_LONG [RATES_TRACE] [more serving_gpu.py args]
  local gpus=$1 systems=$2 workloads=$3 tpots=$4 rates=$5 trace=${6:-$TRACE4}
  shift 5; [ $# -gt 0 ] && shift
  mkdir -p "$OUT/gpus$gpus"
  python3 bench/serving_gpu.py --tokenizer "$TOK" --systems "$systems" --workloads "$workloads" \
    --tpot-slos "$tpots" --long-rates "$rates" --trace-rates "$trace" --num-requests 200 --repeats 2 \
    --out "$OUT/gpus$gpus" "$@"
}
case $PART in
  g2-colocated) serve 2 colocated:2 long 20,40 $LONG2 ;;
  g2-disagg) serve 2 disagg:1:1 long 40 4,6,8,10 ;;  # one prefill GPU: below 10 req/s
  g2-hybrid) serve 2 hybrid:1:1 long 20,40 $LONG2 ;;
  g4-colocated) serve 4 colocated:4 long,trace long:20,trace:40 $LONG4
    serve 4 colocated:4 long 40 $LONG4_T40 ;;
  g4-disagg) serve 4 disagg:2:2,disagg:1:3 long,trace 40 $LONG4 $TRACE4_DISAGG ;;
  g4-hybrid) serve 4 hybrid:2:2 long,trace long:20,trace:40 $LONG4
    serve 4 hybrid:2:2 long 40 $LONG4_T40 ;;
  g4-adaptive) serve 4 hybrid:2:2:adaptive long 20,40 $LONG4 ;;
  g4-static) serve 4 hybrid:1:3,hybrid:3:1 long 20,40 $LONG4 ;;
  g4-32b) serve 4 colocated:2:tp2,hybrid:1:1:tp2 long 20,30 2,3,4,5 "$TRACE4" --shape qwen3-32b ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac
