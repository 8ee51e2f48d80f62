#!/usr/bin/env bash
# Installs torch==2.13.0 into the active environment before anything else (an unpinned
# torch, resolved by pip as a dependency, would be the multi-GB CUDA build):
#   - a local wheel folder (pip's find-links) holds torch 2.13.0: that build, as it is;
#   - else a host with an NVIDIA GPU (nvidia-smi): PyPI's build (CUDA), what GPUs need;
#   - else the CPU build from PyTorch's CPU index (~190 MB, no CUDA packages).
# PDSERVE_TORCH=cpu|cuda overrides the choice. NumPy comes with it: torch imported without
# NumPy warns that it failed to initialize it. Arguments go to pip (scripts/test.sh: --no-compile).
set -euo pipefail
want="${PDSERVE_TORCH:-}"
if [ -z "$want" ] && pip install -q --dry-run --ignore-installed --no-index --no-deps "torch==2.13.0" >/dev/null 2>&1; then
  pip install -q "$@" "torch==2.13.0" numpy           # the local build
elif [ "$want" = cuda ] || { [ -z "$want" ] && command -v nvidia-smi >/dev/null 2>&1; }; then
  pip install -q "$@" "torch==2.13.0" numpy           # PyPI: the CUDA build
else
  pip install -q "$@" "torch==2.13.0" numpy --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple       # the CPU build
fi
python -c "import torch; print(f'torch {torch.__version__} (CUDA: {torch.cuda.is_available()})')"
