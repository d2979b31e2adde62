#!/usr/bin/env bash
# Session 4, device call 1 (nvidia-h100-x1), 2026-11-22. Everything one after the other (no concurrency).
# 1. d12 vs d12_moe throughput, quick protocol, after the router's bincount -> scatter_add fix (issue 3's 60% rule).
# 2. Kernel tables of the compiled training step of d12_fast and d12 (where d12_fast's time goes; issue 5's 550k).
# 3. The missing ablation row: d12_fast without embed_norm at P40, alone on the GPU.
mkdir -p "$OUT/x"
P40_QUICK=1 P40_WORK=/tmp/moe timeout 190 bash scripts/bench_p40.sh d12 d12_moe > "$OUT/x/moe_quick.txt" 2>&1
tar -czf "$OUT/moe_quick.tgz" -C /tmp/moe out
timeout 110 python3 scripts/profile_model.py --model d12_fast --compile --kernels 25 > "$OUT/x/prof_fast.txt" 2>&1
timeout 90 python3 scripts/profile_model.py --model d12 --compile --kernels 25 > "$OUT/x/prof_d12.txt" 2>&1
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/nen timeout 180 bash scripts/bench_p40.sh "no_embed_norm:d12_fast --embed_norm false" > "$OUT/x/nen.txt" 2>&1
tar -czf "$OUT/nen.tgz" -C /tmp/nen out
