#!/usr/bin/env bash
# Session 7, device call 5 (nvidia-h100-x1), 2026-11-22: the headline at the final recipe, which now keeps the
# residual stream in bf16 (call 3: +5.1% tokens/s; call 4: P40 losses as before, 6% less time to d12's loss).
# d12's path is unchanged. d12@P40 and d12_fast at its P40 form, two seeds each, one run at a time; bf16
# evaluation, no coordinate-descent tuning, as in sessions 2-6 (s6_call7_headline_h100.sh).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h5 timeout 585 bash scripts/bench_p40.sh d12 d12_fast "d12_fast_seed1:d12_fast --seed 1" \
  "d12_seed1:d12 --seed 1" > "$OUT/h.txt" 2>&1
tar -czf "$OUT/s7_call5.tgz" -C /tmp/h5 out
tail -n 8 "$OUT/h.txt"
