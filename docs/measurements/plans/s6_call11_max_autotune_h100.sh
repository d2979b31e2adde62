#!/usr/bin/env bash
# Session 6, device call 11 (nvidia-h100-x1), 2026-11-22: does inductor's max-autotune pay for d12_fast?
# (TORCHINDUCTOR_MAX_AUTOTUNE=1: Triton GEMM templates benchmarked against cuBLAS, elementwise epilogues fused
# into the winners.) The tokens/s row of call 9 (465,882 without it on another machine), alone on the GPU,
# compile time reported; the same row without it first, on this machine, for a same-machine comparison.
rm -rf /tmp/t/runs
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
row() {  # NAME [ENV...]
  local name=$1; shift
  env "$@" timeout 420 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
    --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
    --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
    --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
    --run_name "$name" > "$OUT/x/$name.log" 2>&1
  cp "/tmp/t/runs/$name/summary.json" "$OUT/x/$name.summary.json"
  grep -E "notice|compile warm|step:14/14 \| loss|tokens_per_s|mfu:|peak_mem|rror" "$OUT/x/$name.log" | tail -n 7
}
row tp_fast_default
row tp_fast_max_autotune TORCHINDUCTOR_MAX_AUTOTUNE=1
