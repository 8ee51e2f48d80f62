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
# On one H200 `mixed prefix spec` fit one 10-minute call, the rest a second one.
set -uo pipefail
cd "$(dirname "$0")/.."
TOK="${1:?usage: bash bench/gpu_suite.sh TOKENIZER_DIR [GROUP ...]}"
shift
groups=("$@")
[ ${#groups[@]} -eq 0 ] || [ "${groups[0]}" = all ] && groups=(mixed prefix spec engine sampling overlap fusions grammar int4)
R=bench/results
failed=()
run() {  # run GROUP LIMIT CMD...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" >&2
  local t0=$SECONDS
  timeout "$limit" "$@" || failed+=("$name (exit $?)")
  echo "== $name: $((SECONDS - t0)) s" >&2
}
for g in "${groups[@]}"; do
  case $g in
    mixed) run mixed 150 python3 bench/mixed_step_gpu.py --tokenizer "$TOK" --out $R/hybrid --batches 16 --reps 5 \
             --tag _variants --variants ;;
    prefix) run prefix 90 python3 bench/prefill_prefix_gpu.py --tokenizer "$TOK" --out $R/attention ;;
    spec) run spec 330 python3 bench/spec_gpu.py --tokenizer "$TOK" --batches 1,8,32,64 --acceptance 0,0.7 \
            --auto-acceptance 0,0.3,0.7 --repeats 3 --out $R/spec --name llama3-8b_chain_stepmodel ;;
    engine) run engine 240 python3 bench/engine_gpu.py --batches 1,8,64 --prefill 4096 --hf-batches 1,64 --profile \
              --out $R --name engine_gpu_b64 ;;
    sampling) run sampling 60 python3 bench/sampling_gpu.py --out $R/sampling ;;
    overlap) run overlap 120 python3 bench/decode_overlap_gpu.py --tokenizer "$TOK" --batches 1,16,64 \
               --out $R/overlap/h200 ;;
    fusions) run fusions 120 python3 bench/decode_fusions_gpu.py --tokenizer "$TOK" --out $R/fusions ;;
    grammar) run grammar 180 python3 bench/grammar_gpu.py --tokenizer "$TOK" --repeats 5 --out $R/grammar ;;
    int4) run int4 60 python3 bench/kv_int4_gpu.py --out $R/kv_int4 ;;
    *) echo "unknown group $g" >&2; failed+=("$g (unknown)") ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_suite: not refreshed: ${failed[*]}" >&2
  exit 1
fi
echo "gpu_suite: refreshed ${groups[*]} on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" >&2
