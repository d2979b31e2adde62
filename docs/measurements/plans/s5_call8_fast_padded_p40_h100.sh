#!/usr/bin/env bash
# Session 5, device call 8 (nvidia-h100-x1), 2026-11-22: d12_fast's two P40 seeds again at the current code
# (the head's products padded to 50,304 since the headline of call 5), one run at a time, same flags.
# Their time to 5.7047 (d12 seed 0's final loss in call 5) is compared with call 5's d12 (86.4 s).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h timeout 300 bash scripts/bench_p40.sh d12_fast "d12_fast_seed1:d12_fast --seed 1" > "$OUT/h.txt" 2>&1
tar -czf "$OUT/s5_call8.tgz" -C /tmp/h out
