#!/usr/bin/env bash
# Session 3, device call 4 (nvidia-h100-x1), 2026-11-22: the headline again, for d12_fast with the tied
# head (adopted after calls 2-3). d12@P40 and d12_fast at its P40 form, two seeds each, one run at a time
# on the GPU; every run evaluates in bf16 and compiles without coordinate-descent tuning, as in session 2.
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h timeout 560 bash scripts/bench_p40.sh d12_fast d12 "d12_fast_seed1:d12_fast --seed 1" \
  "d12_seed1:d12 --seed 1" > /tmp/h.txt 2>&1
cp /tmp/h.txt "$OUT/"
tar -czf "$OUT/s3_call4.tgz" -C /tmp/h out
