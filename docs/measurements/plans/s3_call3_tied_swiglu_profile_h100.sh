#!/usr/bin/env bash
# Session 3, device call 3 (nvidia-h100-x1, the machine of call 2, still warm), 2026-11-22.
# 1. Alone: the eager per-part profile of d12 (issue 4's d12 table; d12_fast's is from session 2).
# 2. P40 losses, 2 runs at once (4 at once crashed a run in call 2): the seeds call 2 did not finish —
#    the recipe (seed 1), tied head (seeds 0, 1), SwiGLU MLP (seed 1).
timeout 60 python3 scripts/profile_model.py --model d12 > "$OUT/profile_d12.txt" 2>&1
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/m P40_JOBS=2 timeout 380 bash scripts/bench_p40.sh \
  "fast_seed1:d12_fast --seed 1" "fast_tied:d12_fast --tie_embeddings true" \
  "fast_tied_seed1:d12_fast --tie_embeddings true --seed 1" "fast_swiglu_seed1:d12_fast --mlp_act swiglu --seed 1" \
  > /tmp/m.txt 2>&1
cp /tmp/m.txt "$OUT/"
tar -czf "$OUT/s3_call3.tgz" -C /tmp/m out
