#!/usr/bin/env bash
# Session 6, device call 9 (nvidia-h100-x1), 2026-11-22: the final code once more, alone on the GPU. Since call 3
# (454,774 tokens/s) the fused head loss checks for Triton in the compiled forward (a notice where it is
# missing) and the compile warm-up reports out-of-memory as one line. tokens/s at d12_fast's FineWeb defaults
# (protocol of call 3), then the kernel table (call 2: 40.83 ms, loss kernel 1.78 ms).
rm -rf /tmp/t/runs
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 200 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
  --run_name tp_fast_final > "$OUT/x/tp_fast_final.log" 2>&1
cp /tmp/t/runs/tp_fast_final/summary.json "$OUT/x/tp_fast_final.summary.json"
timeout 150 python3 scripts/profile_model.py --model d12_fast --compile --kernels 25 > "$OUT/x/prof_fast_final.txt" 2>&1
grep -E "notice|compile warm|step:14/14 \| loss|tokens_per_s|mfu:|peak_mem|rror" "$OUT/x/tp_fast_final.log" | tail
grep -E "step:|_softcap" "$OUT/x/prof_fast_final.txt"
