#!/usr/bin/env bash
# Session 4, device call 4 (nvidia-h100-x1), 2026-11-22. Why does the trainer run d12_moe at ~62 ms per
# 16x1024 micro-batch (s4_call3: 495 ms per 8-micro-batch step, and a 6.7 s first step) where the profiler's
# compiled step on the same real batches takes 47 ms? The profiler never runs the trainer's fp32 evaluation,
# which takes the per-expert loop (a graph break) in the same compiled model.
# 1. Quick protocol with TORCH_LOGS=recompiles,graph_breaks: what recompiles at step 1, and why.
# 2. Quick protocol with --val_dtype bf16 (evaluation on the grouped matmul, no break): tokens/s.
mkdir -p "$OUT/x"
export TORCH_LOGS=recompiles,graph_breaks
P40_QUICK=1 P40_WORK=/tmp/m1 timeout 150 bash scripts/bench_p40.sh d12_moe > "$OUT/x/moe_logs.txt" 2>&1
unset TORCH_LOGS
P40_QUICK=1 P40_FLAGS="--val_dtype bf16" P40_TAG=_bf16eval P40_WORK=/tmp/m2 timeout 150 \
  bash scripts/bench_p40.sh d12_moe > "$OUT/x/moe_bf16eval.txt" 2>&1
tar -czf "$OUT/moe_gap.tgz" -C /tmp m1/out m2/out
