#!/usr/bin/env bash
# Session 5, device call 3 (nvidia-h100-x1), 2026-11-22. Everything one after the other, alone on the GPU.
# New since session 4: (a) notices no longer split compiled graphs and the flash backend looks at autocast's
# dtype (session 4's d12_flash profile: 61.7 ms/step with three graph breaks and cuDNN kernels, not flash);
# (b) --fused_head_loss: the head's softcapped cross-entropy as one autograd function with the logits'
# gradient computed in the forward pass.
# 1. Kernel tables of d12_fast's compiled step with and without the fused head loss (16x1024, one micro-batch).
# 2. Tokens/s at d12_fast's FineWeb defaults with the fused head loss (protocol of s4_call2, part 1:
#    415,443 tokens/s without it).
# 3. The kernel table of d12_flash after the fix (d12's own in session 4: 34.74 ms/step).
# 4. If time is left: the tokens/s row without the fused loss, for a same-call reference.
mkdir -p /tmp/t/out "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 120 python3 scripts/profile_model.py --model d12_fast --compile --kernels 25 --fused_head_loss true \
  > "$OUT/x/prof_fast_fused.txt" 2>&1
throughput() {  # NAME FLAGS...: 14 steps of d12_fast at its FineWeb defaults on the proxy shards
  local name=$1; shift
  timeout 140 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast \
    --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
    --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
    --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
    --run_name "$name" "$@" > "$OUT/x/$name.log" 2>&1
  cp /tmp/t/runs/"$name"/summary.json "$OUT/x/$name.summary.json"
}
throughput tp_fast_fused --fused_head_loss true
timeout 120 python3 scripts/profile_model.py --model d12_fast --compile --kernels 25 > "$OUT/x/prof_fast.txt" 2>&1
timeout 100 python3 scripts/profile_model.py --model d12_flash --compile --kernels 25 > "$OUT/x/prof_flash.txt" 2>&1
throughput tp_fast
