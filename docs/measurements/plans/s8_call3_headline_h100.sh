#!/usr/bin/env bash
# Session 8, device call 3 (nvidia-h100-x1), 2026-11-22: the headline at the new recipe. d12_fast now attends
# within aligned 256-token blocks in three of four layers (window 256, LLLG, chunked; call 2: 0.04 lower at P40
# on both seeds). d12@P40 and d12_fast at its P40 form, two seeds each, one run at a time; bf16 evaluation, no
# coordinate-descent tuning, as in sessions 2-7 (call 2 ran out of time before d12's second seed).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h3 timeout 590 bash scripts/bench_p40.sh d12 d12_fast "d12_fast_seed1:d12_fast --seed 1" \
  "d12_seed1:d12 --seed 1" > "$OUT/h.txt" 2>&1
[ -f "$OUT/h3.tgz" ] || tar -czf "$OUT/h3.tgz" -C /tmp/h3 out  # cut by the time limit: keep what ran
tail -n 8 "$OUT/h.txt"
