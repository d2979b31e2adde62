#!/usr/bin/env bash
# Session 5, device call 2 (nvidia-h100-x1), 2026-11-22. Call 1 ran out of time before GQA and MQA seed 1.
# 1. GQA and MQA seed 1, two at a time (losses only), flags as in every P40 table.
# 2. The missing d12_fast ablation row: Muon momentum warmup off (the P40 recipe warms 0.85 -> 0.95 over 60
#    steps), alone on the GPU, so its time is comparable with the session-4 headline (13.1 s to 5.7099).
# 3. A compiled kernel table of d12_flash (issue 3 asks why the forced flash backend is 0.60x SDPA's choice).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_JOBS=2 P40_WORK=/tmp/v timeout 330 bash scripts/bench_p40.sh "d12_gqa_seed1:d12_gqa --seed 1" \
  "d12_mqa_seed1:d12_mqa --seed 1" > "$OUT/v.txt" 2>&1
tar -czf "$OUT/s5_call2_variants.tgz" -C /tmp/v out
P40_WORK=/tmp/m timeout 140 bash scripts/bench_p40.sh "no_mom_warmup:d12_fast --muon_momentum_warmup 0" \
  > "$OUT/m.txt" 2>&1
tar -czf "$OUT/s5_call2_momentum.tgz" -C /tmp/m out
timeout 110 python3 scripts/profile_model.py --model d12_flash --compile --kernels 25 > "$OUT/prof_flash.txt" 2>&1
