#!/usr/bin/env bash
# Session 7, device call 3 (nvidia-h100-x1), 2026-11-22: the residual stream in bf16 (--bf16_residual true).
# Call 2 found ~10.5 ms of each 16k-token micro-batch's ~34 ms in bandwidth-bound elementwise kernels (norms,
# residual adds and mixes, ReLU^2), many of them over the fp32 residual stream. tokens/s at d12_fast's FineWeb
# defaults through scripts/throughput.sh, the recipe and the recipe + bf16_residual in one table, then the
# kernel table of the bf16-residual step (40 rows).
mkdir -p /tmp/p40 "$OUT/x"
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
export OUTPUT_DIR=/tmp/t/base
timeout 220 bash scripts/throughput.sh /tmp/p40 d12_fast > "$OUT/x/tp_base.log" 2>&1
export OUTPUT_DIR=/tmp/t/bf16res
timeout 220 bash scripts/throughput.sh /tmp/p40 d12_fast -- --bf16_residual true > "$OUT/x/tp_bf16_residual.log" 2>&1
timeout 150 python3 scripts/profile_model.py --model d12_fast --bf16_residual true --compile --kernels 40 \
  > "$OUT/x/prof_bf16_residual.txt" 2>&1
for f in /tmp/t/base/*/d12_fast/summary.json; do cp "$f" "$OUT/x/tp_base.summary.json"; done
for f in /tmp/t/bf16res/*/d12_fast/summary.json; do cp "$f" "$OUT/x/tp_bf16_residual.summary.json"; done
grep -E "notice|compile warm|step:14/14 \| loss|rror" "$OUT/x/tp_base.log" "$OUT/x/tp_bf16_residual.log" | tail -n 12
tail -n 3 "$OUT/x/tp_base.log" "$OUT/x/tp_bf16_residual.log"
grep -E "step:|all kernels" "$OUT/x/prof_bf16_residual.txt"
