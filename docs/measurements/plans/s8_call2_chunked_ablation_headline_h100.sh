#!/usr/bin/env bash
# Session 8, device call 2 (nvidia-h100-x1), 2026-11-22: chunked local attention at P40, two seeds, beside the
# headline pair. Call 1: chunks of 256 in the local layers of LLLG ended seed 0's P40 run at 5.2957 (the recipe's
# seed 0 in session 7's call 9: 5.3396) at ~+1% tokens/s. Here, one run at a time: d12@P40, the recipe (d12_fast),
# the recipe with --window 256 --window_pattern LLLG --window_kind chunked, each two seeds; bf16 evaluation, no
# coordinate-descent tuning, as in sessions 2-7. compare_runs.py's table: time to d12's final P40 loss.
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
chunk="--window 256 --window_pattern LLLG --window_kind chunked"
P40_WORK=/tmp/h2 timeout 590 bash scripts/bench_p40.sh d12 d12_fast "d12_fast_chunk256:d12_fast $chunk" \
  "d12_fast_chunk256_seed1:d12_fast $chunk --seed 1" "d12_fast_seed1:d12_fast --seed 1" "d12_seed1:d12 --seed 1" \
  > "$OUT/h.txt" 2>&1
[ -f "$OUT/h2.tgz" ] || tar -czf "$OUT/h2.tgz" -C /tmp/h2 out  # cut by the time limit: keep what ran
tail -n 12 "$OUT/h.txt"
