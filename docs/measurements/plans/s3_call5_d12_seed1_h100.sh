#!/usr/bin/env bash
# Session 3, device call 5 (nvidia-h100-x1, the machine of call 4, still warm), 2026-11-22.
# 1. d12 seed 1 of the headline (call 4's time limit cut it), same flags as call 4.
# 2. Alone: tokens/s, MFU and peak memory of d12_fast (now with the tied head) at its FineWeb defaults,
#    the protocol of s3_call2 (14 steps under a 22 GiB cap, no coordinate-descent tuning).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h timeout 250 bash scripts/bench_p40.sh "d12_seed1:d12 --seed 1" > /tmp/h1.txt 2>&1
mkdir -p /tmp/t
timeout 150 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
  --run_name tp_fast_tied > /tmp/t/tp.log 2>&1
cp /tmp/h1.txt /tmp/t/tp.log /tmp/t/runs/tp_fast_tied/summary.json /tmp/t/runs/tp_fast_tied/metrics.jsonl "$OUT/"
tar -czf "$OUT/s3_call5.tgz" -C /tmp/h out
