#!/usr/bin/env bash
# An A/B of the GPU suite on one host, in one call: each group runs on BASE's tree (a git worktree
# of that commit) and on this tree, alternating (base, this, base, this), on the same GPU, so that a
# host's speed (which moves host-bound keys such as decode_vs_hf, spec and grammar by 2x between
# lent hosts) cancels out. Prints each run's result table; the files land under OUT/{base,this}-N.
#
#   bash bench/suite_ab.sh TOKENIZER_DIR BASE_COMMIT [GROUP ...]     # groups as bench/gpu_suite.sh's
set -uo pipefail
cd "$(dirname "$0")/.."
TOK="${1:?usage: bash bench/suite_ab.sh TOKENIZER_DIR BASE_COMMIT [GROUP ...]}"
BASE="${2:?a base commit}"
shift 2
groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(engine spec grammar)
OUT=${SUITE_AB_OUT:-/tmp/suite_ab}
WT=$(mktemp -d)/base
git worktree add -q --detach "$WT" "$BASE" || { echo "suite_ab: no commit $BASE" >&2; exit 2; }
trap 'python3 -m pip install -q --no-deps --no-build-isolation -e "$PWD" >/dev/null; git worktree remove --force "$WT"' EXIT
for round in 1 2; do
  for side in base this; do
    dir=$PWD; [ $side = base ] && dir=$WT
    echo "== $side, round $round: ${groups[*]}" >&2
    # the tree's own pdserve (an editable install maps its folders into one namespace)
    python3 -m pip install -q --no-deps --no-build-isolation -e "$dir" >/dev/null || exit 1
    (cd "$dir" && bash bench/gpu_suite.sh "$TOK" "${groups[@]}")
    mkdir -p "$OUT/$side-$round"
    (cd "$dir" && git status --porcelain bench/results | awk '{print $2}' | xargs -r cp --parents -t "$OUT/$side-$round")
    (cd "$dir" && git checkout -q -- bench/results)
  done
done
echo "suite_ab: results under $OUT" >&2
