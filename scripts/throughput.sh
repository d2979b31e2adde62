#!/usr/bin/env bash
# tokens/s of models at their FineWeb defaults, the protocol of docs/RESULTS.md's throughput rows: 40 optimizer
# steps at each model's own batch (its recipe's: 12 micro-batches of 8x4096 for d12_fast) on the P40 proxy
# shards, a fixed schedule of 4 warmup and 4 cooldown steps, one 16k-token evaluation at the end (a recipe's
# self-sizing schedule and planned evaluations off), no coordinate-descent tuning (a recipe's combo kernels stay),
# under a GPU memory cap (default 22 GiB: does it fit a 24 GB card?), at the full attention window (a recipe's
# window warmup off: the run measures the steady state, not its first stage).
# tokens/s is the trainer's steps 11-40, their tokens over their time: thirty steps, so that work done every N steps
# (SOAP's basis refresh, every 10) counts at its share; the compile time is reported beside it, never inside it.
#   bash scripts/throughput.sh DATA_DIR [SPEC ...] [-- extra train_gpt2.py flags for every run]
# A SPEC is a model, or `NAME:MODEL FLAGS` in one argument (a part on a recipe: "vemb:d12_fast --value_embeds 3").
# ROUNDS=N runs the list N times in turn (A B A B on one GPU: a difference is read beside its repeats' spread; the
# k-th round's runs are NAME-k). DATA_DIR holds mix_train_000001.bin, mix_train_000002.bin and mix_val_000000.bin
# (decompressed from ../shared/data/proxy). Default: d12_fast. MEMORY_CAP_GIB=none drops the cap (without a GPU
# there is none).
# Output: logs/throughput-<time>-<4 characters>/<name>/ per run, then the comparison table on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: bash scripts/throughput.sh DATA_DIR [SPEC ...] [-- extra flags]  (DATA_DIR must exist)" >&2
  exit 2
fi
data=$1
shift
models=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do models+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#models[@]} -eq 0 ] && models=(d12_fast)
cap=()
if [ -z "${MEMORY_CAP_GIB:-}" ] && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  MEMORY_CAP_GIB=none  # a cap limits GPU memory: on a CPU the runs go uncapped
fi
[ "${MEMORY_CAP_GIB:-22}" != none ] && cap=(--memory_cap_gib "${MEMORY_CAP_GIB:-22}")
# The recipe's compile tuning, none where it has none (coordinate descent costs compile time only).
compile_tuning() {
  "$PYTHON" -c "import sys; from model_variants import RECIPES
print(RECIPES.get(sys.argv[1], {}).get('compile_tuning', 'none'))" "$1"
}
if ! [[ "${ROUNDS:-1}" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: ROUNDS=$ROUNDS: the number of times to run the list, a whole number from 1" >&2
  exit 2
fi
# Each spec's run name and its words (model, then its own flags).
names=() specs=()
for spec in "${models[@]}"; do
  name=${spec%%:*} text=$spec
  if [ "$name" != "$spec" ] && [[ "$name" != *" "* ]]; then text=${spec#*:}; else name=${spec%% *}; fi
  if [[ " ${names[*]:-} " == *" $name "* ]]; then
    echo "error: two specs are named $name; name one NAME:\"MODEL FLAGS\" so that each run has its own folder" >&2
    exit 2
  fi
  names+=("$name") specs+=("$text")
done
# A folder of its own, even beside a list started in the same second (one per GPU).
mkdir -p "${OUTPUT_DIR:-logs}"
output_dir=$(mktemp -d "${OUTPUT_DIR:-logs}/throughput-$(date +%Y%m%d-%H%M%S)-XXXX")
runs=()
for round in $(seq 1 "${ROUNDS:-1}"); do
  for i in "${!specs[@]}"; do
    read -r -a words <<< "${specs[$i]}"
    name=${names[$i]}
    [ "$round" -gt 1 ] && name="$name-$round"
    "$PYTHON" train_gpt2.py --model "${words[0]}" \
      --input_bin "$data/mix_train_00000[12].bin" --input_val_bin "$data/mix_val_000000.bin" \
      --num_iterations 40 --lr_schedule trapezoid --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 \
      --val_tokens 16384 --target_val_loss 0 --window_iters 0 "${cap[@]}" \
      --compile_tuning "$(compile_tuning "${words[0]}")" --output_dir "$output_dir" --run_name "$name" \
      "$@" "${words[@]:1}"  # a spec's own flags last: they win
    runs+=("$output_dir/$name")
  done
done
# 40 steps say nothing about loss: read the tokens/s, MFU, peak memory and compile columns.
"$PYTHON" scripts/compare_runs.py "${runs[@]}" --target first
