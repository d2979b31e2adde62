#!/usr/bin/env bash
# Session 5, device call 7 (nvidia-h100-x1), 2026-11-22. HeadCrossEntropy now runs the head's products on
# the vocabulary padded to a multiple of 64 (50,304; padded columns masked out of the softmax): call 3's
# kernel table shows one of the three head GEMMs in an sm80 cutlass kernel at 2.42 ms where the aligned
# ones take ~1.75 ms. Alone on the GPU:
# 1. the kernel table of d12_fast's compiled step (call 3, unpadded: 43.73 ms, loss kernel 3.77 ms);
# 2. tokens/s at d12_fast's FineWeb defaults, protocol of call 3 (unpadded: 425,300; its 14 losses to compare).
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 120 python3 scripts/profile_model.py --model d12_fast --compile --kernels 25 > "$OUT/x/prof_fast_padded.txt" 2>&1
timeout 150 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
  --run_name tp_fast_padded > "$OUT/x/tp_fast_padded.log" 2>&1
cp /tmp/t/runs/tp_fast_padded/summary.json "$OUT/x/tp_fast_padded.summary.json"
