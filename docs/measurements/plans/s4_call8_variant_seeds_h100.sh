#!/usr/bin/env bash
# Session 4, device call 8 (nvidia-h100-x1), 2026-11-22: P40 losses still missing for issue 3 — d12_flash
# (seed 0) and second seeds of SwiGLU, the 3x MLP and the LLLG window. Two runs at a time (the concurrency
# that never faulted), so losses only: their times and tokens/s mean nothing. Flags as in every P40 table.
# The reference is the session-4 headline's d12 (seeds 0 / 1: 5.7099 / 5.7521, same kind of machine).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_JOBS=2 P40_WORK=/tmp/v timeout 585 bash scripts/bench_p40.sh d12_flash "d12_swiglu_seed1:d12_swiglu --seed 1" \
  "d12_mlp3_seed1:d12_mlp3 --seed 1" "d12_swa_seed1:d12_swa --seed 1" > "$OUT/v.txt" 2>&1
tar -czf "$OUT/s4_call8.tgz" -C /tmp/v out
