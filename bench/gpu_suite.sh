#!/usr/bin/env bash
# Re-measures the headline keys of bench/results/summary.json that one GPU gives, with the
# commands summary.json names, writing the files bench/summary.py reads (then run it):
#
#   bash bench/gpu_suite.sh TOKENIZER_DIR [GROUP ...]      # groups: all (default) or the names below
#   python bench/summary.py                                # the keys, each with its device and date
#
# Each group runs under its own time limit (seconds, below); a group that fails or runs out is
# named at the end and its keys keep their committed values. The two-GPU keys (goodput, handoff)
# and the serving sweeps are not here: they need more GPUs or more than one call's time.
#   group       keys                                                        limit
#   mixed       mixed_step_overhead_ms_{64,256,1024}                        150
#   prefix      prefix_hit_prefill_ratio, chunked_prefill_last_over_first   90
#   spec        spec_speedup_b1_accept70, spec_off_switch_worst             330
#   engine      decode_vs_hf_b{1,64}, decode_mbu, prefill_mfu               240
#   sampling    seeded_sampler_extra_ms_64, seeded_noise_bits_equal_cuda_cpu 60
#   overlap     decode_floor_ratio_b{1,64}, decode_gpu_idle_b64             120
#   fusions     decode_fusions_speedup_b64                                  120
#   grammar     grammar_step_cost_worst                                     180
#   int4        kv_int4_decode_kernel_vs_bf16                               60
# The limits are generous: on H200s (2026-11-28) the groups took 351 s in all, so the suite fits
# one 10-minute call on one GPU (spec 93 s, engine 59 s, fusions 45 s, mixed 43 s, grammar 33 s,
# the rest 18-21 s each).
# SUITE_GPUS=0,1,2,3 deals the groups over those GPUs (each a lane that runs its groups one after
# another, the longest first, to the lane with the least time so far). Lanes share the host's
# CPUs: keys bound by the host read worse there (HF generate's batch-1 step 11.4 -> 17.6 ms, spec at
# batch 64 0.40x -> 0.24x in one such run); measure those groups alone (engine, spec, fusions).
set -uo pipefail
cd "$(dirname "$0")/.."
TOK="${1:?usage: bash bench/gpu_suite.sh TOKENIZER_DIR [GROUP ...]}"
shift
groups=("$@")
[ ${#groups[@]} -eq 0 ] || [ "${groups[0]}" = all ] && groups=(spec engine grammar mixed overlap fusions prefix sampling int4)
R=bench/results
declare -A LIMIT=([mixed]=150 [prefix]=90 [spec]=330 [engine]=240 [sampling]=60 [overlap]=120 [fusions]=120
                  [grammar]=180 [int4]=60)
FAILED=$(mktemp)
run() {  # run GROUP LIMIT CMD...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" >&2
  local t0=$SECONDS
  timeout "$limit" "$@" || echo "$name (exit $?)" >>"$FAILED"
  echo "== $name: $((SECONDS - t0)) s" >&2
}
group() {  # group NAME: one group's bench, under its limit
  local g=$1 l=${LIMIT[$1]:-0}
  case $g in
    mixed) run mixed $l python3 bench/mixed_step_gpu.py --tokenizer "$TOK" --out $R/hybrid --batches 16 --reps 5 \
             --tag _variants --variants ;;
    prefix) run prefix $l python3 bench/prefill_prefix_gpu.py --tokenizer "$TOK" --out $R/attention ;;
    spec) run spec $l python3 bench/spec_gpu.py --tokenizer "$TOK" --batches 1,8,32,64 --acceptance 0,0.7 \
            --auto-acceptance 0,0.3,0.7 --repeats 3 --out $R/spec --name llama3-8b_chain_stepmodel ;;
    engine) run engine $l python3 bench/engine_gpu.py --batches 1,8,64 --prefill 4096 --hf-batches 1,64 --profile \
              --out $R --name engine_gpu_b64 ;;
    sampling) run sampling $l python3 bench/sampling_gpu.py --out $R/sampling ;;
    overlap) run overlap $l python3 bench/decode_overlap_gpu.py --tokenizer "$TOK" --batches 1,16,64 \
               --out $R/overlap/h200 ;;
    fusions) run fusions $l python3 bench/decode_fusions_gpu.py --tokenizer "$TOK" --out $R/fusions ;;
    grammar) run grammar $l python3 bench/grammar_gpu.py --tokenizer "$TOK" --repeats 5 --out $R/grammar ;;
    int4) run int4 $l python3 bench/kv_int4_gpu.py --out $R/kv_int4 ;;
    *) echo "unknown group $g" >&2; echo "$g (unknown)" >>"$FAILED" ;;
  esac
}
gpus=()
[ -n "${SUITE_GPUS:-}" ] && IFS=, read -ra gpus <<<"$SUITE_GPUS"
if [ ${#gpus[@]} -le 1 ]; then
  for g in "${groups[@]}"; do group "$g"; done
else  # deal the groups (in the order given: longest first by default) to the least-loaded lane
  declare -a lane_groups lane_time
  for i in "${!gpus[@]}"; do lane_groups[i]=""; lane_time[i]=0; done
  for g in "${groups[@]}"; do
    best=0
    for i in "${!gpus[@]}"; do [ "${lane_time[i]}" -lt "${lane_time[best]}" ] && best=$i; done
    lane_groups[best]+=" $g"
    lane_time[best]=$((lane_time[best] + ${LIMIT[$g]:-0}))
  done
  for i in "${!gpus[@]}"; do
    [ -z "${lane_groups[i]}" ] && continue
    echo "== GPU ${gpus[i]}:${lane_groups[i]}" >&2
    ( export CUDA_VISIBLE_DEVICES=${gpus[i]}; for g in ${lane_groups[i]}; do group "$g"; done ) 2>&1 \
      | sed -u "s/^/[gpu ${gpus[i]}] /" >&2 &
  done
  wait
fi
mapfile -t failed <"$FAILED"
rm -f "$FAILED"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_suite: not refreshed: ${failed[*]}" >&2
  exit 1
fi
echo "gpu_suite: refreshed ${groups[*]} on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" >&2
