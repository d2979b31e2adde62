#!/usr/bin/env bash
# Session 4, device call 2 (nvidia-h100-x1), 2026-11-22. Everything one after the other.
# The trainer's Muon is now BatchedMuon (Newton-Schulz stacked by shape); call 1 profiled torch.optim.Muon's
# step at 27.6 ms of d12_fast's 66.9 ms profiled 16x1024 step.
# 1. d12_fast throughput at its FineWeb defaults, same protocol as s3_call2 (was 408,690 tokens/s tied).
# 2. Kernel tables of the compiled step: d12_fast (the optimizer's row) and d12_moe (issue 3's 60% rule).
# 3. d12_fast at P40, seed 0, alone: loss and time against the headline's 5.3475 in 14.4 s.
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 120 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
  --run_name tp_fast_batched > "$OUT/x/tp_fast_batched.log" 2>&1
cp /tmp/t/runs/tp_fast_batched/summary.json "$OUT/x/tp_fast_batched.summary.json"
timeout 100 python3 scripts/profile_model.py --model d12_fast --compile --kernels 25 > "$OUT/x/prof_fast.txt" 2>&1
timeout 110 python3 scripts/profile_model.py --model d12_moe --compile --kernels 30 > "$OUT/x/prof_moe.txt" 2>&1
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/f timeout 160 bash scripts/bench_p40.sh d12_fast > "$OUT/x/fast_p40.txt" 2>&1
tar -czf "$OUT/fast_p40.tgz" -C /tmp/f out
