#!/usr/bin/env bash
# Session 7, device call 9 (nvidia-h100-x1), 2026-11-22: the headline at the final recipe, whose micro-batch is
# now 32x1024 (call 8: +5.0% tokens/s at the FineWeb defaults, 19.3 GiB under the 22 GiB cap); its P40 form
# takes each 32,768-token step as one such micro-batch instead of two of 16x1024 (the same tokens and loss).
# Call 5 ran the same four runs at 16x1024. d12's path is unchanged. d12@P40 and d12_fast at its P40 form, two
# seeds each, one run at a time; bf16 evaluation, no coordinate-descent tuning, as in sessions 2-6.
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h9 timeout 585 bash scripts/bench_p40.sh d12 d12_fast "d12_fast_seed1:d12_fast --seed 1" \
  "d12_seed1:d12 --seed 1" > "$OUT/h.txt" 2>&1
tar -czf "$OUT/s7_call9.tgz" -C /tmp/h9 out
tail -n 8 "$OUT/h.txt"
