#!/usr/bin/env bash
# Session 3, device call 2 (nvidia-h100-x1), 2026-11-22: options for d12_fast.
# 1. Alone on the GPU: tokens/s, MFU and peak memory at d12_fast's FineWeb defaults (16x1024 x 16) with one
#    option changed each, 14 steps under a 22 GiB cap, same protocol as the earlier throughput table.
# 2. P40 losses (d12_fast's P40 form), 4 runs at once, two seeds: the recipe, and with a SwiGLU MLP (SwiGLU
#    beat GELU by 0.19 on d12 in s3_call1), a tied head (0.06 better in the one-seed ablation), the FP8 head.
mkdir -p /tmp/t/out /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
for spec in "fast:" "fp8:--fp8_head true" "nocap:--logit_softcap 0" "swiglu:--mlp_act swiglu"; do
  name=${spec%%:*}
  timeout 120 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model d12_fast ${spec#*:} \
    --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
    --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
    --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/runs \
    --run_name "tp_$name" > "/tmp/t/out/tp_$name.log" 2>&1
  cp /tmp/t/runs/tp_$name/summary.json "/tmp/t/out/tp_$name.summary.json"
  cp /tmp/t/runs/tp_$name/metrics.jsonl "/tmp/t/out/tp_$name.metrics.jsonl"
  echo "$name $(grep -E '^(tokens_per_s|mfu|peak_mem_mib|compile_s):' /tmp/t/out/tp_$name.log | tr -s ' ' | tr '\n' ' ')"
done
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
specs=("fast:d12_fast" "fast_swiglu:d12_fast --mlp_act swiglu" "fast_tied:d12_fast --tie_embeddings true"
       "fast_fp8:d12_fast --fp8_head true")
P40_WORK=/tmp/l P40_JOBS=4 timeout 170 bash scripts/bench_p40.sh "${specs[@]}" > /tmp/l0.txt 2>&1
P40_FLAGS="$P40_FLAGS --seed 1" P40_TAG=_seed1 P40_WORK=/tmp/l P40_JOBS=4 timeout 170 \
  bash scripts/bench_p40.sh "${specs[@]}" > /tmp/l1.txt 2>&1
grep -E "FineWeb check|failed|Error" /tmp/l0.txt /tmp/l1.txt
cp /tmp/l0.txt /tmp/l1.txt "$OUT/"
tar -czf "$OUT/s3_call2.tgz" --exclude='*.pt' -C /tmp t l
