#!/usr/bin/env bash
# Make this machine ready to train: Python packages (if missing), a CUDA GPU that torch can see (unless
# ALLOW_CPU=1: a CPU takes days), and the FineWeb shards (if missing; data/fineweb.py checks the free disk
# before it downloads anything).
#   bash scripts/setup.sh [TRAIN_SHARDS]      default 25: the 2.5B tokens the d12 baseline reads
# Shards already downloaded and complete are skipped, so running it again is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, numpy, tiktoken, tqdm, huggingface_hub, datasets" 2>/dev/null; then
  python3 -m pip install -r requirements.txt
fi
if [ "${ALLOW_CPU:-0}" != 1 ] && ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "error: torch sees no CUDA GPU, and this job would train for days on the CPU; install a CUDA build of" \
    "torch on a machine with an NVIDIA GPU, or set ALLOW_CPU=1 to go ahead anyway" >&2
  exit 2
fi
python3 data/fineweb.py --source cached -n "${1:-25}"
