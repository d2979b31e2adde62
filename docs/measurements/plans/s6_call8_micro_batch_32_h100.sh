#!/usr/bin/env bash
# Session 6, device call 8 (nvidia-h100-x1), 2026-11-22. Does a larger micro-batch pay? d12_fast at its FineWeb
# defaults but 32x1024 micro-batches x 8 (the same 262,144 tokens per step), protocol of call 3 (16x1024 x 16:
# 454,774 tokens/s, 11,656 MiB), under the same 22 GiB cap that a 24 GB card sets.
rm -rf /tmp/t/runs
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 200 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
  --batch_size 32 --grad_accumulation_steps 8 \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
  --run_name tp_fast_mb32 > "$OUT/x/tp_fast_mb32.log" 2>&1
cp /tmp/t/runs/tp_fast_mb32/summary.json "$OUT/x/tp_fast_mb32.summary.json"
grep -E "graph break|compile warm|step:14/14 \| loss|tokens_per_s|mfu:|peak_mem|rror" "$OUT/x/tp_fast_mb32.log" | tail
