#!/usr/bin/env bash
# Session 6, device call 2 (nvidia-h100-x1), 2026-11-22. Call 1 again after the kernel took tanh.approx and a
# constant cap (call 1: its compiled HeadCrossEntropy failed, so 2 and 3 did not run). Alone on the GPU:
# 1. s6_call2_head_loss_kernel.py: kernel vs inductor at d12_fast's head shapes, launch sweep, and the
#    kernel inside a compiled HeadCrossEntropy (loss and gradients against fp32 autograd);
# 2. the kernel table of d12_fast's compiled step (s5_call7: 42.21 ms, loss kernel 3.01 ms);
# 3. tokens/s at d12_fast's FineWeb defaults, protocol of s5_call7 (440,523).
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > "$OUT/x/versions.txt" 2>&1
timeout 150 python3 docs/measurements/plans/s6_call2_head_loss_kernel.py > "$OUT/x/head_loss_kernel.txt" 2>&1
timeout 120 python3 scripts/profile_model.py --model d12_fast --compile --kernels 25 > "$OUT/x/prof_fast_triton_approx.txt" 2>&1
timeout 150 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
  --run_name tp_fast_triton_approx > "$OUT/x/tp_fast_triton_approx.log" 2>&1
cp /tmp/t/runs/tp_fast_triton_approx/summary.json "$OUT/x/tp_fast_triton_approx.summary.json"
tail -n 3 "$OUT/x/tp_fast_triton_approx.log"; grep -E "step:|triton_|_softcap" "$OUT/x/prof_fast_triton_approx.txt" | head
cat "$OUT/x/head_loss_kernel.txt"
