#!/usr/bin/env bash
# Session 5, device call 1 (nvidia-h100-x1), 2026-11-22: second seeds still missing for issue 3 — MTP, lite,
# GQA and MQA (seed 1). Two runs at a time (the concurrency that never faulted), so losses only: their times
# and tokens/s mean nothing. Flags as in every P40 table. The reference is the session-4 headline's d12
# (seeds 0 / 1: 5.7099 / 5.7521, same kind of machine).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_JOBS=2 P40_WORK=/tmp/v timeout 585 bash scripts/bench_p40.sh "d12_mtp_seed1:d12_mtp --seed 1" \
  "d12_lite_seed1:d12_lite --seed 1" "d12_gqa_seed1:d12_gqa --seed 1" "d12_mqa_seed1:d12_mqa --seed 1" \
  > "$OUT/v.txt" 2>&1
tar -czf "$OUT/s5_call1.tgz" -C /tmp/v out
