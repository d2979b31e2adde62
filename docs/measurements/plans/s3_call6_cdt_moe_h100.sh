#!/usr/bin/env bash
# Session 3, device call 6 (nvidia-h100-x1, the machine of calls 4-5, still warm), 2026-11-22.
# 1. Alone: d12_fast's FineWeb-default throughput with coordinate-descent tuning (the trainer's default).
#    Result: compile did not finish within the 200 s limit; no number.
# 2. Alone: d12_moe at the d12@P40 config (loss and tokens/s), flags as in the headline.
mkdir -p /tmp/t2 "$OUT/x"
timeout 200 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --output_dir /tmp/t2/runs --run_name tp_fast_tied_cdt \
  > "$OUT/x/tp_cdt.log" 2>&1
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/moe timeout 300 bash scripts/bench_p40.sh d12_moe > "$OUT/x/moe.txt" 2>&1
tar -czf "$OUT/s3_call6.tgz" -C /tmp/moe out
