#!/usr/bin/env bash
# Session 7, device call 6 (nvidia-h100-x1), 2026-11-22: compiled autograd, tried before it is a flag. Call 2
# found 1,095 gradient-accumulation adds (9.2 ms) and 384 weight-gradient casts (1.7 ms) per 16-micro-batch
# step outside the compiled graphs; with torch._dynamo.config.compiled_autograd the backward, accumulation
# included, is one inductor graph that could fuse them. The tokens/s row of the recipe (scripts/throughput.sh),
# then the same 14 steps and flags with compiled autograd switched on around train_gpt2.main.
mkdir -p /tmp/p40 "$OUT/x"
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
export OUTPUT_DIR=/tmp/t/base
timeout 200 bash scripts/throughput.sh /tmp/p40 d12_fast > "$OUT/x/tp_base.log" 2>&1
timeout 330 python3 -c "import sys, torch._dynamo; torch._dynamo.config.compiled_autograd = True
sys.path.insert(0, '.'); import train_gpt2; sys.exit(train_gpt2.main(sys.argv[1:]))" --model d12_fast \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
  --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
  --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/t/ca \
  --run_name d12_fast_compiled_autograd > "$OUT/x/tp_compiled_autograd.log" 2>&1
cp /tmp/t/base/*/d12_fast/summary.json "$OUT/x/tp_base.summary.json"
cp /tmp/t/ca/d12_fast_compiled_autograd/summary.json "$OUT/x/tp_compiled_autograd.summary.json"
grep -E "notice|compile warm|step:14/14 \| loss|rror" "$OUT/x/tp_base.log" "$OUT/x/tp_compiled_autograd.log" | tail -n 12
tail -n 12 "$OUT/x/tp_compiled_autograd.log"
