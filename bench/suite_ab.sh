#!/usr/bin/env bash
# An A/B of the GPU suite on one host, in one call: each group runs on BASE's tree and on this tree,
# alternating (base, this[, base, this]), on the same GPU, so that a host's speed (which moves
# host-bound keys such as decode_vs_hf, spec and grammar by 2x between lent hosts) cancels out.
# Prints each run's result table; the files each run wrote land under OUT/{base,this}-N.
#
#   bash bench/suite_ab.sh TOKENIZER_DIR BASE [GROUP ...]     # groups as bench/gpu_suite.sh's
#
# BASE is a commit (checked out as a git worktree) or a directory holding the base tree (a machine
# without this repository's history: `git archive COMMIT | xz > base.tar.xz` here, unpacked there).
# SUITE_AB_ROUNDS (default 2) sets the alternations; one round of engine + spec + grammar takes
# about 6 minutes on an H200 host, so two need two calls of a 10-minute limit.
set -uo pipefail
cd "$(dirname "$0")/.."
TOK="${1:?usage: bash bench/suite_ab.sh TOKENIZER_DIR BASE [GROUP ...]}"
BASE="${2:?a base commit or directory}"
shift 2
groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(engine spec grammar)
OUT=${SUITE_AB_OUT:-/tmp/suite_ab}
ROUNDS=${SUITE_AB_ROUNDS:-2}
# one lane, both sides: a base whose gpu_suite.sh deals groups over every GPU it sees by default
# (3fb8024 did) would otherwise run its groups side by side and load its host more than this side's
export SUITE_GPUS=${SUITE_GPUS:-${CUDA_VISIBLE_DEVICES:-0}}
[[ $SUITE_GPUS == *,* ]] && { echo "suite_ab: one GPU only (SUITE_GPUS=$SUITE_GPUS)" >&2; exit 2; }
HERE=$PWD
if [ -d "$BASE" ]; then
  WT=$(cd "$BASE" && pwd)
  trap 'python3 -m pip install -q --no-deps --no-build-isolation -e "$HERE" >/dev/null' EXIT
else
  WT=$(mktemp -d)/base
  git worktree add -q --detach "$WT" "$BASE" || { echo "suite_ab: no commit $BASE" >&2; exit 2; }
  trap 'python3 -m pip install -q --no-deps --no-build-isolation -e "$HERE" >/dev/null; git worktree remove --force "$WT"' EXIT
fi
STAMP=$(mktemp)
for round in $(seq 1 "$ROUNDS"); do
  for side in base this; do
    dir=$HERE; [ $side = base ] && dir=$WT
    echo "== $side, round $round: ${groups[*]}" >&2
    # the tree's own pdserve (an editable install maps its folders into one namespace)
    python3 -m pip install -q --no-deps --no-build-isolation -e "$dir" >/dev/null || exit 1
    touch "$STAMP"
    sleep 1
    (cd "$dir" && bash bench/gpu_suite.sh "$TOK" "${groups[@]}")
    mkdir -p "$OUT/$side-$round"
    (cd "$dir" && find bench/results -type f -newer "$STAMP" | xargs -r cp --parents -t "$OUT/$side-$round")
    # a tree under git gets its committed results back (the A/B compares; it does not refresh)
    (cd "$dir" && git rev-parse --git-dir >/dev/null 2>&1 && git checkout -q -- bench/results)
  done
done
rm -f "$STAMP"
echo "suite_ab: results under $OUT" >&2
