#!/usr/bin/env bash
# Session 6, device call 7 (nvidia-h100-x1), 2026-11-22: the headline at the final recipe. Call 5 ran it with
# the FP8 head in the recipe; call 6's ablation dropped it (bf16 head: 2% fewer tokens to d12's loss, 0.013
# lower at the end, 1.6% lower tokens/s). Since session 5's headline d12_fast's head loss runs in the Triton
# kernel (kernels.py; call 3: +3.2% tokens/s); d12's path is unchanged. d12@P40 and d12_fast at its P40 form,
# two seeds each, one run at a time; bf16 evaluation, no coordinate-descent tuning, as in sessions 2-5.
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h timeout 585 bash scripts/bench_p40.sh d12 d12_fast "d12_fast_seed1:d12_fast --seed 1" \
  "d12_seed1:d12 --seed 1" > "$OUT/h.txt" 2>&1
tar -czf "$OUT/s6_call7.tgz" -C /tmp/h out
