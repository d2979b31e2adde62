#!/usr/bin/env bash
# Session 7, device call 2 (nvidia-h100-x1), 2026-11-22: where the trainer's per-micro-batch time beyond the
# profiled single micro-batch goes. Call 1's row: 567.4 ms per step of 16 micro-batches = 35.5 ms each, against
# ~33.4 ms for a profiled micro-batch's forward + backward (s6 call 9: 40.75 ms minus the optimizer). Kernel
# tables of d12_fast, compiled, with 16 and with 1 micro-batch per step (60 rows each; the all-kernels line is
# the GPU's busy share); the 16-micro-batch one reads the proxy shard through the trainer's loader.
mkdir -p "$OUT/x" /tmp/p40
xz -dc .bench_data/mix_train_000001.bin.xz > /tmp/p40/mix_train_000001.bin
timeout 240 python3 scripts/profile_model.py --model d12_fast --compile --grad_accumulation_steps 16 --steps 2 \
  --input_bin /tmp/p40/mix_train_000001.bin --kernels 60 > "$OUT/x/prof_accum16.txt" 2>&1
timeout 150 python3 scripts/profile_model.py --model d12_fast --compile --grad_accumulation_steps 1 \
  --kernels 60 > "$OUT/x/prof_accum1.txt" 2>&1
grep -E "step:|all kernels|elementwise|multi_tensor|Memcpy|fill|copy_" "$OUT/x/prof_accum16.txt" | head -n 20
grep -E "step:|all kernels|elementwise|multi_tensor|Memcpy|fill|copy_" "$OUT/x/prof_accum1.txt" | head -n 20
