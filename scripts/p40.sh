#!/usr/bin/env bash
# The P40 proxy benchmark of ../shared/BENCHMARKS.md: at most 40M tokens of the proxy mix, NoCap validation
# protocol on mix_val_000000.bin, evaluated at the schedule's interval and at the end.
#   bash scripts/p40.sh [MODEL] [extra train_gpt2.py flags...]
# The schedule comes from model_variants.p40_flags: for most models the reference run "d12@P40" (16x1024 x 8
# accumulation = 131,072 tokens/step, 300 steps, AdamW lr 6e-4, wd 0.1, 64 warmup / 96 warmdown, evaluated
# every 40 steps); for a model whose recipe has a P40 form (d12_fast), that form. Later flags override
# earlier ones. P40_DATA names the folder holding mix_train_000001.bin, mix_train_000002.bin and
# mix_val_000000.bin (decompressed from ../shared/data/proxy/*.xz).
set -euo pipefail
cd "$(dirname "$0")/.."
data=${P40_DATA:-/tmp/p40}
model=${1:-d12}
shift || true
read -r -a schedule <<< "$(python3 -c "import sys, model_variants; print(' '.join(model_variants.p40_flags(sys.argv[1])))" "$model")"
exec torchrun --standalone --nproc_per_node=1 train_gpt2.py --model "$model" \
  --input_bin "$data/mix_train_00000[12].bin" --input_val_bin "$data/mix_val_000000.bin" \
  "${schedule[@]}" --target_val_loss 0 "$@"
