#!/usr/bin/env bash
# The variants table: run each model at the P40 proxy config (scripts/p40.sh: the same data order and
# validation; the d12@P40 reference schedule, or a recipe's P40 form for d12_fast) and compare them by the
# time to d12's final P40 loss. Default models: d12 and every registered d12_* variant.
#   bash scripts/ablate.sh DATA_DIR [MODEL ...] [-- extra train_gpt2.py flags, e.g. --seed 1]
# DATA_DIR holds mix_train_000001.bin, mix_train_000002.bin and mix_val_000000.bin (decompressed from
# ../shared/data/proxy). Output: logs/ablate-<time>/<model>/ per run, the table on stdout and a plot.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: bash scripts/ablate.sh DATA_DIR [MODEL ...] [-- extra flags]  (DATA_DIR must exist)" >&2
  exit 2
fi
export P40_DATA=$1
shift
models=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do models+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
if [ ${#models[@]} -eq 0 ]; then
  read -r -a models <<< "$(python3 -c "from model_variants import VARIANTS
print(' '.join(n for n in VARIANTS if n == 'd12' or n.startswith('d12_')))")"
fi
output_dir="${OUTPUT_DIR:-logs}/ablate-$(date +%Y%m%d-%H%M%S)"
runs=()
for model in "${models[@]}"; do
  bash scripts/p40.sh "$model" --output_dir "$output_dir" --run_name "$model" "$@"
  runs+=("$output_dir/$model")
done
# P40 losses are not FineWeb losses: the headline is the time to reach the first run's (d12's) final P40 loss.
python3 scripts/compare_runs.py "${runs[@]}" --target first --plot "$output_dir/ablate.png"
