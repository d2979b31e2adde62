#!/usr/bin/env bash
# Session 5, device call 6 (nvidia-h100-x1), 2026-11-22: d12_fast's tokens/s at its FineWeb defaults WITH
# inductor's coordinate-descent tuning, the trainer's default (every earlier throughput row turned it off
# to keep compile time inside a call). Same 14-step protocol as call 3 (425,300 tokens/s without it), with
# the whole call's time for the compile.
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 560 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --output_dir /tmp/t/runs --run_name tp_fast_cdt \
  > "$OUT/x/tp_fast_cdt.log" 2>&1
cp /tmp/t/runs/tp_fast_cdt/summary.json "$OUT/x/tp_fast_cdt.summary.json"
