#!/usr/bin/env bash
# Session 4, device call 6 (nvidia-h100-x1, call 5's machine, still warm), 2026-11-22.
# 0. d12 seed 1 of the headline if call 5's limit cut it (HEADLINE_D12_SEED1=1).
# 1. d12 vs d12_moe, quick protocol, the trainer's defaults (fp32 evaluation, which now runs an MoE eager so
#    the training graph stays whole; s4_call4: 266,554 tokens/s before, 352,485 with bf16 evaluation).
# 2. d12_moe's P40 loss with the headline's flags (its tokens/s too: one run alone on the GPU).
export PYTHONUNBUFFERED=1
if [ "${HEADLINE_D12_SEED1:-0}" = 1 ]; then
  P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning" P40_WORK=/tmp/h timeout 200 \
    bash scripts/bench_p40.sh "d12_seed1:d12 --seed 1" > "$OUT/h1.txt" 2>&1
fi
P40_QUICK=1 P40_WORK=/tmp/mq timeout 150 bash scripts/bench_p40.sh d12 d12_moe > "$OUT/moe_quick.txt" 2>&1
P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning" P40_WORK=/tmp/mp timeout 230 \
  bash scripts/bench_p40.sh d12_moe > "$OUT/moe_p40.txt" 2>&1
tar -czf "$OUT/s4_call6.tgz" -C /tmp mq/out mp/out $( [ -d /tmp/h/out ] && echo h/out )
