#!/usr/bin/env bash
# Session 5, device call 5 (nvidia-h100-x1), 2026-11-22: the headline again at the current code. Since
# session 4's headline (s4_call5) d12_fast computes its head loss with the fused HeadCrossEntropy (call 3:
# +2.2% tokens/s); d12's path is unchanged. d12@P40 and d12_fast at its P40 form, two seeds each, one run
# at a time; bf16 evaluation, no coordinate-descent tuning, as in sessions 2-4.
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h timeout 585 bash scripts/bench_p40.sh d12 d12_fast "d12_fast_seed1:d12_fast --seed 1" \
  "d12_seed1:d12 --seed 1" > "$OUT/h.txt" 2>&1
tar -czf "$OUT/s5_call5.tgz" -C /tmp/h out
