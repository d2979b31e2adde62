#!/usr/bin/env bash
# The variants table on the P40 quick check (scripts/proxy.py): each model runs the d12@P40 reference schedule
# (or its recipe's P40 form) with the same data order and validation, one after the other, and the table ranks
# them by the time to the first model's (d12's) final P40 loss. Default models: d12 and every d12_* variant.
#   bash scripts/ablate.sh DATA_DIR [MODEL ...] [-- extra train_gpt2.py flags, e.g. --seed 1]
# DATA_DIR holds mix_train_000001.bin, mix_train_000002.bin and mix_val_000000.bin (python scripts/proxy.py
# stage --src ../shared/data/proxy --data DATA_DIR). Output: logs/ablate-<time>/ (runs, logs, table, plot).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: bash scripts/ablate.sh DATA_DIR [MODEL ...] [-- extra flags]  (DATA_DIR must exist)" >&2
  exit 2
fi
data=$1
shift
models=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do models+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
if [ ${#models[@]} -eq 0 ]; then
  read -r -a models <<< "$("$PYTHON" -c "from model_variants import VARIANTS
print(' '.join(n for n in VARIANTS if n == 'd12' or n.startswith('d12_')))")"
fi
work="${OUTPUT_DIR:-logs}/ablate-$(date +%Y%m%d-%H%M%S)"
exec "$PYTHON" scripts/proxy.py run P40 "${models[@]}" --data "$data" --work "$work" --flags "$*" \
  --plot "$work/ablate.png"
