#!/usr/bin/env bash
# Make this machine ready to train, checking before it installs anything: a CUDA GPU (ALLOW_CPU=1 goes on
# without one: a CPU takes days), the Python packages, and the FineWeb shards (data/fineweb.py checks the free
# disk before it downloads anything).
#   bash scripts/setup.sh [TRAIN_SHARDS]      default 25: the 2.5B tokens the d12 baseline reads
# Packages go into the active virtual or conda environment, else into .venv here (made with the system's
# packages visible, so a torch installed there is used), which the scripts then run: never into the system
# Python itself. Without a GPU (ALLOW_CPU=1) torch is torch's CPU build. Complete shards are skipped, so running
# it again is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
torch_sees_gpu() { "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }
cpu_only=0
if ! { nvidia-smi -L 2>/dev/null | grep -q '^GPU' || torch_sees_gpu; }; then
  if [ "${ALLOW_CPU:-0}" != 1 ]; then
    echo "error: no CUDA GPU here (nvidia-smi lists none, and torch sees none), and this job would train for days" \
      "on the CPU; run it on a machine with an NVIDIA GPU, or set ALLOW_CPU=1 to go ahead anyway" >&2
    exit 2
  fi
  cpu_only=1
fi
if ! "$PYTHON" -c "import torch, numpy, tiktoken, tqdm, huggingface_hub" 2>/dev/null; then
  if [ "$PYTHON" = python3 ] && [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]; then
    echo "setup: no virtual environment is active, so the requirements go into .venv (the scripts use it)"
    if ! python3 -m venv --system-site-packages .venv; then
      echo "error: python3 -m venv failed; install Python's venv module (Debian: apt install python3-venv) or" \
        "activate an environment of your own, then run this again" >&2
      exit 2
    fi
    source scripts/env.sh
  fi
  if [ "$cpu_only" = 1 ]; then  # PyPI's torch for Linux is a CUDA build of several GB
    "$PYTHON" -m pip install "$(sed -n 's/ *#.*//; s/ //g; /^torch[<>=!]/p' requirements.txt)" \
      --index-url https://download.pytorch.org/whl/cpu
  fi
  "$PYTHON" -m pip install -r requirements.txt
fi
if [ "$cpu_only" = 0 ] && ! torch_sees_gpu; then
  echo "error: nvidia-smi lists a GPU but torch ($("$PYTHON" -c 'import torch; print(torch.__version__)')) cannot" \
    "use it: its CUDA build may need a newer driver; install a torch build for this driver, then run this again" >&2
  exit 2
fi
"$PYTHON" data/fineweb.py --source cached -n "${1:-25}"
