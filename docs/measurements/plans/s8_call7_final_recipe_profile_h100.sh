#!/usr/bin/env bash
# Session 8, device call 7 (nvidia-h100-x1), 2026-11-22: where the final recipe's step goes (kernel table,
# 16x1024, compiled, 40 rows), and its peak memory at the FineWeb defaults with --batch_size 16 (16 micro-batches
# of 16x1024 per step, scripts/throughput.sh, 22 GiB cap), the README's option for cards with less memory.
set -u
mkdir -p /tmp/p40 /tmp/r
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 200 python3 scripts/profile_model.py --model d12_fast --compile --kernels 40 > /tmp/r/prof_final.txt 2>&1
OUTPUT_DIR=/tmp/t/b16 timeout 200 bash scripts/throughput.sh /tmp/p40 d12_fast -- --batch_size 16 > /tmp/r/tp_b16.log 2>&1
cp /tmp/t/b16/*/d12_fast/summary.json /tmp/r/tp_b16.summary.json
tar -czf "$OUT/s8_call7.tgz" -C /tmp/r .
tail -n 1 /tmp/r/tp_b16.log
head -n 50 /tmp/r/prof_final.txt
