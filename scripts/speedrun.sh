#!/usr/bin/env bash
# The main job: set up, download the FineWeb shards d12_fast reads, and train it until val loss <= 3.3821.
# d12_fast's recipe (model_variants.RECIPES), sized by the run (--lr_schedule target): the learning rate stays at
# the peak until the loss curve says a warmdown as long as the steps before it ends at the target, within at most
# 10,000 steps of 65,536 tokens (0.66B tokens), then up to 5,000 overtime steps at the final learning rate if the
# warmdown ends above the target (--lr_schedule trapezoid: the recipe's fixed 10,000 steps). The run stops at the
# first evaluation at or under the target, scored on rows of 4096 tokens of NoCap's validation tokens (NoCap's
# 1024-token rows are scored, in bf16, where it stops). Evaluations follow the loss curve (--val_loss_every auto):
# sparse far from the target and in bf16 there, dense near it and in fp32, the precision the target is judged in. Extra
# flags are passed on (e.g. --batch_size 8 on a card with less memory: two micro-batches, the same tokens per
# step and the same training); flags that lengthen the run read past the downloaded shards (the trainer says
# so), so fetch more first: python data/fineweb.py -n N.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# Train shards of 100M tokens that the schedule and its overtime can read.
shards=$("$PYTHON" -c "import math; from model_variants import RECIPES; r = RECIPES['d12_fast']
print(math.ceil((r['num_iterations'] + r['overtime_steps']) * r['total_batch_size'] / 100e6))")
bash scripts/setup.sh "$shards"
exec bash scripts/train.sh --model d12_fast \
  --input_bin "data/fineweb10B/fineweb_train_*.bin" --input_val_bin "data/fineweb10B/fineweb_val_*.bin" \
  --lr_schedule target --val_loss_every auto --output_dir logs "$@"
