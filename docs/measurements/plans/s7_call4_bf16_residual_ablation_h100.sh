#!/usr/bin/env bash
# Session 7, device call 4 (nvidia-h100-x1), 2026-11-22: the bf16 residual stream at P40 (call 3: +5.1% tokens/s
# at the FineWeb defaults). d12_fast at its P40 form with --bf16_residual true and without (the recipe), two
# seeds each, one run at a time, the flags of session 6's headline (bf16 evaluation, no coordinate-descent
# tuning). Time and tokens to d12's P40 loss come from compare_runs.py over the runs.
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h timeout 560 bash scripts/bench_p40.sh "d12_fast_bf16res:d12_fast --bf16_residual true" \
  "d12_fast_bf16res_seed1:d12_fast --bf16_residual true --seed 1" d12_fast "d12_fast_seed1:d12_fast --seed 1" \
  > "$OUT/h.txt" 2>&1
tar -czf "$OUT/s7_call4.tgz" -C /tmp/h out
tail -n 8 "$OUT/h.txt"
