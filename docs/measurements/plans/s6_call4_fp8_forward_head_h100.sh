#!/usr/bin/env bash
# Session 6, device call 4 (nvidia-h100-x1), 2026-11-22. The FP8 head inside HeadCrossEntropy reduced to the
# logits' product (call 3: both FP8 products +0.9% tokens/s, but 3 graph breaks and a 0.9 ms slower loss
# kernel). Alone on the GPU:
# 1. s6_call4_fp8_forward_head_loss.py: compiled HeadCrossEntropy, bf16 vs FP8 logits: time, errors;
# 2. tokens/s at d12_fast's FineWeb defaults with --fp8_head true (call 3, bf16 head: 454,774).
rm -rf /tmp/t/runs
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 120 python3 docs/measurements/plans/s6_call4_fp8_forward_head_loss.py > "$OUT/x/fp8_forward_head_loss.txt" 2>&1
timeout 150 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast --fp8_head true \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
  --run_name tp_fast_fp8_forward > "$OUT/x/tp_fast_fp8_forward.log" 2>&1
cp /tmp/t/runs/tp_fast_fp8_forward/summary.json "$OUT/x/tp_fast_fp8_forward.summary.json"
grep -E "graph break|compile warm|tokens_per_s|mfu:|peak_mem" "$OUT/x/tp_fast_fp8_forward.log"
cat "$OUT/x/fp8_forward_head_loss.txt"
