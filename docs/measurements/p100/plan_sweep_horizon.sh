#!/usr/bin/env bash
# P100 on one GPU, part 1 (run in the background on the GPU machine from a copy of the repo, while the
# shards are still being staged into $DATA): d12@P100's learning-rate sweep (6e-4, 1.2e-3, 1.8e-3 at 100M
# tokens), d12_fast's final P100 loss at several schedule lengths at its FineWeb batch (262,144 tokens/step)
# and at 65,536 and 32,768, then d12's horizon (12.5M, 25M, 50M tokens) at the sweep's best learning rate.
# Three runs share the GPU at a time: these runs give losses and tokens; times come from runs alone.
set -u
W=${W:-/tmp/w1}; DATA=${DATA:-/tmp/proxy}; JOBS=${JOBS:-3}; WAIT=${WAIT:-1500}
run() {
  python3 scripts/proxy.py run P100 "$@" --data "$DATA" --work "$W" --jobs "$JOBS" --wait "$WAIT" \
    --archive "$W/runs.tgz"
}
run "d12_lr1.8e-3:d12 --learning_rate 1.8e-3" "d12_lr1.2e-3:d12 --learning_rate 1.2e-3" \
  "d12_lr6e-4:d12 --learning_rate 6e-4" \
  "fast262_42M:d12_fast --budget 42M" "fast262_21M:d12_fast --budget 21M" "fast262_10M:d12_fast --budget 10.5M" \
  "fast65_40M:d12_fast --total_batch_size 65536 --budget 40M" \
  "fast65_20M:d12_fast --total_batch_size 65536 --budget 20M" \
  "fast65_10M:d12_fast --total_batch_size 65536 --budget 10M" \
  "fast65_5M:d12_fast --total_batch_size 65536 --budget 5M" \
  "fast32_20M:d12_fast --total_batch_size 32768 --budget 20M" \
  "fast32_10M:d12_fast --total_batch_size 32768 --budget 10M"
lr=$(python3 - "$W" <<'PY'
import json, os, sys
finals = {}
for lr in ("1.8e-3", "1.2e-3", "6e-4"):
    path = os.path.join(sys.argv[1], "runs", f"d12_lr{lr}", "summary.json")
    if os.path.exists(path):
        finals[lr] = json.load(open(path))["final_val_loss"]
print(min(finals, key=finals.get) if finals else "1.8e-3")
PY
)
echo "d12@P100 learning rate: $lr"
run "d12_50M:d12 --learning_rate $lr --budget 50M" "d12_25M:d12 --learning_rate $lr --budget 25M" \
  "d12_12.5M:d12 --learning_rate $lr --budget 12.5M"
echo "PLAN DONE"
