#!/usr/bin/env bash
# Session 6, device call 6 (nvidia-h100-x1), 2026-11-22. The FP8 head's ablation row: d12_fast at its P40 form
# with --fp8_head false (the head's logits in bf16; everything else the recipe, Triton loss kernel included),
# two seeds, one run at a time, flags of call 5's headline (d12_fast with FP8: 5.3527 / 5.3348). Then the
# kernel table of the recipe's compiled step (call 2: 40.83 ms with the bf16 head).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h timeout 330 bash scripts/bench_p40.sh "d12_fast_bf16_head:d12_fast --fp8_head false" \
  "d12_fast_bf16_head_seed1:d12_fast --fp8_head false --seed 1" > "$OUT/h.txt" 2>&1
tar -czf "$OUT/s6_call6.tgz" -C /tmp/h out
timeout 150 python3 scripts/profile_model.py --model d12_fast --compile --kernels 25 > "$OUT/prof_fast_final.txt" 2>&1
tail -n 4 "$OUT/h.txt"; grep -E "step:|_softcap|qqtst" "$OUT/prof_fast_final.txt"
