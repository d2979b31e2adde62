#!/usr/bin/env bash
# Session 6, device call 3 (nvidia-h100-x1), 2026-11-22. The Triton head-loss kernel in the trainer, and the FP8
# head inside HeadCrossEntropy (--fp8_head true with the fused head loss). Alone on the GPU:
# 1. s6_call3_fp8_head_loss.py: compiled HeadCrossEntropy, bf16 vs FP8: time and errors against fp32 autograd;
# 2. tokens/s at d12_fast's FineWeb defaults (protocol of s5_call7: 440,523 before the kernel), the recipe
#    as it is (Triton kernel, bf16 head), then with --fp8_head true;
# 3. the kernel table of d12_fast --fp8_head true (call 2: 40.83 ms with the bf16 head).
rm -rf /tmp/t/runs
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 120 python3 docs/measurements/plans/s6_call3_fp8_head_loss.py > "$OUT/x/fp8_head_loss.txt" 2>&1
for run in "tp_fast_triton" "tp_fast_fp8 --fp8_head true"; do
  set -- $run
  timeout 150 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
    --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
    --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
    --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
    --run_name "$@" > "$OUT/x/$1.log" 2>&1
  cp "/tmp/t/runs/$1/summary.json" "$OUT/x/$1.summary.json"
  tail -n 2 "$OUT/x/$1.log"
done
timeout 120 python3 scripts/profile_model.py --model d12_fast --fp8_head true --compile --kernels 25 \
  > "$OUT/x/prof_fast_fp8.txt" 2>&1
grep -E "step:|_softcap|scaled|sm90_xmma|gemm" "$OUT/x/prof_fast_fp8.txt" | head
cat "$OUT/x/fp8_head_loss.txt"
