#!/usr/bin/env bash
# The P40 proxy benchmark of ../shared/BENCHMARKS.md: 40M tokens of the proxy mix, NoCap validation
# protocol on mix_val_000000.bin, evaluated every 40 steps (~5.2M tokens) and at the end.
#   bash scripts/p40.sh [MODEL] [extra train_gpt2.py flags...]
# Without extra flags it is the reference run "d12@P40": 16x1024 x 8 accumulation = 131,072 tokens/step,
# 300 steps, AdamW lr 6e-4, wd 0.1, 64 warmup / 96 warmdown. Later flags override earlier ones.
# P40_DATA names the folder holding mix_train_000001.bin, mix_train_000002.bin and mix_val_000000.bin
# (decompressed from ../shared/data/proxy/*.xz).
set -euo pipefail
cd "$(dirname "$0")/.."
data=${P40_DATA:-/tmp/p40}
model=${1:-d12}
shift || true
exec torchrun --standalone --nproc_per_node=1 train_gpt2.py --model "$model" \
  --input_bin "$data/mix_train_00000[12].bin" --input_val_bin "$data/mix_val_000000.bin" \
  --batch_size 16 --grad_accumulation_steps 8 --sequence_length 1024 --num_iterations 300 \
  --learning_rate 6e-4 --weight_decay 0.1 --warmup_iters 64 --warmdown_iters 96 \
  --val_loss_every 40 --val_batch_size 16 --target_val_loss 0 "$@"
