#!/usr/bin/env bash
# Session 5, device call 4 (nvidia-h100-x1), 2026-11-22. Everything one after the other, alone on the GPU.
# d12_fast now takes the fused head loss by default (call 3: +2.2% tokens/s, same 14-step losses).
# 1. d12_fast at P40, seed 0: loss and time against the session-4 headline (5.3476, 13.1 s to 5.7099).
# 2. Quick throughput (bench_p40.sh's P40_QUICK protocol) of d12, d12_flash and d12_lite: the flash
#    backend now really runs flash in bf16 training and no longer splits the compiled graph (session 3's
#    quick table: d12_flash and d12_lite 0.60x / 0.68x d12 with the split).
# 3. d12_mla seed 1, alone (losses; its seed 0 was +0.09).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/f timeout 150 bash scripts/bench_p40.sh d12_fast > "$OUT/fast_p40.txt" 2>&1
tar -czf "$OUT/s5_call4_fast.tgz" -C /tmp/f out
P40_QUICK=1 P40_WORK=/tmp/q timeout 240 bash scripts/bench_p40.sh d12 d12_flash d12_lite > "$OUT/quick.txt" 2>&1
tar -czf "$OUT/s5_call4_quick.tgz" -C /tmp/q out
P40_WORK=/tmp/m timeout 190 bash scripts/bench_p40.sh "d12_mla_seed1:d12_mla --seed 1" > "$OUT/mla.txt" 2>&1
tar -czf "$OUT/s5_call4_mla.tgz" -C /tmp/m out
