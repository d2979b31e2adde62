#!/usr/bin/env bash
# Session 8, device call 6 (nvidia-h100-x1), 2026-11-22: the headline at the final recipe, now with a 3x MLP
# (call 5: 562.8k tokens/s at the FineWeb defaults, 0.04 lower at P40 on both seeds). d12@P40 and d12_fast at
# its P40 form, two seeds each, one run at a time, the flags of calls 2-3; then, in the time left, the recipe's
# tokens/s at the FineWeb defaults (scripts/throughput.sh, 22 GiB cap; call 5 measured the same configuration
# as --mlp_ratio 3 on top of the previous recipe).
set -u
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h6 timeout 480 bash scripts/bench_p40.sh d12 d12_fast "d12_fast_seed1:d12_fast --seed 1" \
  "d12_seed1:d12 --seed 1" > "$OUT/h.txt" 2>&1
[ -f "$OUT/h6.tgz" ] || tar -czf "$OUT/h6.tgz" -C /tmp/h6 out  # cut by the time limit: keep what ran
tail -n 5 "$OUT/h.txt"
OUTPUT_DIR=/tmp/t/recipe timeout 100 bash scripts/throughput.sh /tmp/p40 d12_fast > "$OUT/tp_recipe.log" 2>&1
tail -n 1 "$OUT/tp_recipe.log"
