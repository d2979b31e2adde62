#!/usr/bin/env bash
# Session 3, device call 1 (nvidia-h200-x2), 2026-11-22: the P40 losses of the variants not yet measured.
# GPU 0: d12 (the reference of this call) and SwiGLU, MTP, MLA, 4 runs at once (losses only).
# GPU 1: first d12_moe's quick throughput alone on its GPU (the >= 60%-of-d12 rule; d12's quick row is in
# RESULTS), then the P40 losses of d12_swa, d12_lite and d12_moe, 3 at once.
# Every run: bf16 evaluation and no coordinate-descent tuning, as in the earlier variant rows.
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
CUDA_VISIBLE_DEVICES=0 P40_WORK=/tmp/g0 P40_JOBS=4 timeout 540 bash scripts/bench_p40.sh \
  d12 d12_swiglu d12_mtp d12_mla > /tmp/g0.txt 2>&1 &
(
  CUDA_VISIBLE_DEVICES=1 P40_WORK=/tmp/q1 P40_QUICK=1 timeout 150 bash scripts/bench_p40.sh d12_moe
  CUDA_VISIBLE_DEVICES=1 P40_WORK=/tmp/g1 P40_JOBS=3 timeout 380 bash scripts/bench_p40.sh \
    d12_swa d12_lite d12_moe
) > /tmp/g1.txt 2>&1 &
wait
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1 > "$OUT/gpu.txt"
cp /tmp/g0.txt /tmp/g1.txt "$OUT/"
tar -czf "$OUT/s3_call1.tgz" --exclude='*.pt' -C /tmp g0 q1 g1
