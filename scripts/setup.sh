#!/usr/bin/env bash
# Make this machine ready to train: Python packages (if missing) and FineWeb shards (if missing).
#   bash scripts/setup.sh [TRAIN_SHARDS]      default 25: the 2.5B tokens the d12 baseline reads
# Shards already downloaded and complete are skipped, so running it again is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, numpy, tiktoken, tqdm, huggingface_hub, datasets" 2>/dev/null; then
  python3 -m pip install -r requirements.txt
fi
python3 data/fineweb.py --source cached -n "${1:-25}"
