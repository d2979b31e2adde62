#!/usr/bin/env bash
# Session 6, device call 5 (nvidia-h100-x1), 2026-11-22: the headline again at the current code. Since
# session 5's headline (s5_call5) d12_fast's head loss runs in the Triton kernel (kernels.py; call 3: +3.2%
# tokens/s) and its logits' product in FP8 (fp8_head, now in the recipe; call 4: +1.9%); d12's path is
# unchanged. d12@P40 and d12_fast at its P40 form, two seeds each, one run at a time; bf16 evaluation, no
# coordinate-descent tuning, as in sessions 2-5.
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h timeout 585 bash scripts/bench_p40.sh d12 d12_fast "d12_fast_seed1:d12_fast --seed 1" \
  "d12_seed1:d12 --seed 1" > "$OUT/h.txt" 2>&1
tar -czf "$OUT/s6_call5.tgz" -C /tmp/h out
