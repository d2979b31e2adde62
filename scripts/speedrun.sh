#!/usr/bin/env bash
# The main job: set this machine up (scripts/setup.sh: a GPU, the packages, the FineWeb shards d12_fast can read),
# then train `--model d12_fast` until val loss <= 3.3821. The model's recipe (model_variants.RECIPES) is the whole
# job: the run sizes its schedule and plans its evaluations from its own loss curve, and stops at the first
# evaluation at or under the target. Extra flags are passed on (e.g. --batch_size 8 on a card with less memory: two
# micro-batches, the same tokens per step and the same training); flags that lengthen the run read past the
# downloaded shards (the trainer says so), so fetch more first: python data/fineweb.py -n N.
# SETUP=0 skips the setup: the machine is ready and the shards are where --input_bin says.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ "${SETUP:-1}" != 0 ]; then
  # Train shards of 100M tokens that the longest schedule and its overtime can read.
  shards=$(python3 -c "import math; from model_variants import RECIPES; r = RECIPES['d12_fast']
print(math.ceil((r['num_iterations'] + r['overtime_steps']) * r['total_batch_size'] / 100e6))")
  bash scripts/setup.sh "$shards"
fi
exec bash scripts/train.sh --model d12_fast "$@"
