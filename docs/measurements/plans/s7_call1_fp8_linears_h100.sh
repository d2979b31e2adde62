#!/usr/bin/env bash
# Session 7, device call 1 (nvidia-h100-x1), 2026-11-22: FP8 in the blocks' linear layers (--fp8_linears true:
# forward and both backward products of every attention/MLP projection through FP8Matmul, per-tensor dynamic
# scales). tokens/s at d12_fast's FineWeb defaults through scripts/throughput.sh (its first run on a GPU):
# the recipe, then the recipe + fp8_linears; then the kernel table of the FP8 step (40 kernels) to see what
# the casts cost next to what the products save.
mkdir -p /tmp/p40 "$OUT/x"
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
export OUTPUT_DIR=/tmp/t/base
timeout 220 bash scripts/throughput.sh /tmp/p40 d12_fast > "$OUT/x/tp_base.log" 2>&1
export OUTPUT_DIR=/tmp/t/fp8
timeout 220 bash scripts/throughput.sh /tmp/p40 d12_fast -- --fp8_linears true > "$OUT/x/tp_fp8_linears.log" 2>&1
timeout 150 python3 scripts/profile_model.py --model d12_fast --fp8_linears true --compile --kernels 40 \
  > "$OUT/x/prof_fp8_linears.txt" 2>&1
for f in /tmp/t/base/*/d12_fast/summary.json; do cp "$f" "$OUT/x/tp_base.summary.json"; done
for f in /tmp/t/fp8/*/d12_fast/summary.json; do cp "$f" "$OUT/x/tp_fp8_linears.summary.json"; done
grep -E "notice|compile warm|step:14/14 \| loss|rror" "$OUT/x/tp_base.log" "$OUT/x/tp_fp8_linears.log" | tail -n 12
tail -n 6 "$OUT/x/tp_base.log" "$OUT/x/tp_fp8_linears.log"
grep -E "step:|scaled|fp8|e4m3|e5m2" "$OUT/x/prof_fp8_linears.txt" | head -n 20
