#!/usr/bin/env bash
# Session 7, device call 8 (nvidia-h100-x1), 2026-11-22: d12_fast's recipe now takes micro-batches of 32x1024
# (8 per 262,144-token step; call 7 without a cap: +5.0% tokens/s, 19.3 GiB peak). Does it run under the
# 22 GiB cap that stands for a 24 GB card? tokens/s at the FineWeb defaults through scripts/throughput.sh with
# its default cap, the recipe (32x1024) and the recipe with --batch_size 16 (16 micro-batches of 16x1024).
mkdir -p /tmp/p40 "$OUT/x"
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
export OUTPUT_DIR=/tmp/t/b32
timeout 220 bash scripts/throughput.sh /tmp/p40 d12_fast > "$OUT/x/tp_b32_cap22.log" 2>&1
export OUTPUT_DIR=/tmp/t/b16
timeout 200 bash scripts/throughput.sh /tmp/p40 d12_fast -- --batch_size 16 > "$OUT/x/tp_b16_cap22.log" 2>&1
cp /tmp/t/b32/*/d12_fast/summary.json "$OUT/x/tp_b32_cap22.summary.json"
cp /tmp/t/b16/*/d12_fast/summary.json "$OUT/x/tp_b16_cap22.summary.json"
grep -E "notice|model d12_fast|compile warm|step:14/14 \| loss|rror" "$OUT/x/tp_b32_cap22.log" "$OUT/x/tp_b16_cap22.log" | tail -n 12
tail -n 3 "$OUT/x/tp_b32_cap22.log" "$OUT/x/tp_b16_cap22.log"
