#!/usr/bin/env bash
# The NoCap-Test baseline: d12 with NoCap's published flags (524,288 tokens/step, AdamW lr 0.0018, warmup 256),
# its 4768 steps (2.5B tokens) the longest run. The run sizes its warmdown from its own loss curve (21.5% of what it
# trains, NoCap's share; --lr_schedule target) and stops at the first evaluation with val loss <= 3.3821; where its
# warmdown ends above, it trains on at a tenth of the peak lr for up to 1192 more steps. Extra flags are passed on
# (e.g. --run_name, or --batch_size 8 --grad_accumulation_steps 64 on a card with less memory); NoCap's fixed
# schedule: --lr_schedule trapezoid --lr_floor 0 --overtime_steps 0 --val_loss_every 128. SETUP=0 skips the setup
# (scripts/setup.sh): the machine is ready and the shards are where --input_bin says.
set -euo pipefail
cd "$(dirname "$0")/.."
# Its flags would override another model's recipe (d12_nocap's warmup, say) without a word.
for flag in "$@"; do
  case "$flag" in --model|--model=*)
    echo "error: baseline.sh trains d12 with NoCap's flags; for another model with its own recipe run" \
      "bash scripts/setup.sh 25 && bash scripts/train.sh --model NAME" >&2
    exit 2;;
  esac
done
[ "${SETUP:-1}" = 0 ] || bash scripts/setup.sh 32  # (4768 + 1192) x 524,288 tokens
exec bash scripts/train.sh \
  --input_bin "data/fineweb10B/fineweb_train_*.bin" --input_val_bin "data/fineweb10B/fineweb_val_*.bin" \
  --output_dir logs --model d12 \
  --batch_size 16 --grad_accumulation_steps 32 --sequence_length 1024 \
  --val_batch_size 16 --num_iterations 4768 --weight_decay 0.1 --learning_rate 0.0018 \
  --warmup_iters 256 --warmdown_iters 1024 \
  --lr_schedule target --val_loss_every auto --lr_floor 0.1 --overtime_steps 1192 "$@"
