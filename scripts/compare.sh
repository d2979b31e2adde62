#!/usr/bin/env bash
# Train two or more models one after the other with the same data order and evaluation, each with its
# own recipe (model_variants.RECIPES; NoCap's baseline flags for a variant without one), and the same extra
# flags; then compare them with scripts/compare_runs.py and a plot. Without models: d12 against d12_fast,
# each stopping at val loss <= 3.3821 (the baseline reads 2.5B tokens: hours).
#   bash scripts/compare.sh [MODEL_A MODEL_B ...] [-- extra train_gpt2.py flags]
# e.g.  bash scripts/compare.sh d12 d12_gqa -- --num_iterations 1000 --warmdown_iters 256
# Data: FineWeb shards in data/fineweb10B (bash scripts/setup.sh), or --input_bin/--input_val_bin.
# Output: logs/compare-<time>-<model>/ per run, the table on stdout, logs/compare-<time>.png.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
models=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do models+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#models[@]} -eq 0 ] && models=(d12 d12_fast)
if [ ${#models[@]} -lt 2 ]; then
  echo "usage: bash scripts/compare.sh [MODEL_A MODEL_B ...] [-- extra train_gpt2.py flags]  (two or more models)" >&2
  exit 2
fi
output_dir=${OUTPUT_DIR:-logs}
stamp=$(date +%Y%m%d-%H%M%S)
runs=()
for model in "${models[@]}"; do
  bash scripts/train.sh --model "$model" \
    --output_dir "$output_dir" --run_name "compare-$stamp-$model" "$@"
  runs+=("$output_dir/compare-$stamp-$model")
done
"$PYTHON" scripts/compare_runs.py "${runs[@]}" --plot "$output_dir/compare-$stamp.png"
