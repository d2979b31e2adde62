#!/usr/bin/env bash
# Session 7, device call 7 (nvidia-h100-x1), 2026-11-22: what a 32x1024 micro-batch would buy, before building
# a chunked head loss to make it fit (session 6: out of memory under the 22 GiB cap, the (tokens x vocab) logits
# and their gradient doubling). tokens/s of d12_fast at its FineWeb defaults (16 micro-batches of 16x1024 per
# step) and with 8 micro-batches of 32x1024 (the same 262,144 tokens per step), both without the memory cap
# so that the second can run; peak memory says how far over 22 GiB it goes.
mkdir -p /tmp/p40 "$OUT/x"
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
export MEMORY_CAP_GIB=none OUTPUT_DIR=/tmp/t/b16
timeout 200 bash scripts/throughput.sh /tmp/p40 d12_fast > "$OUT/x/tp_b16.log" 2>&1
export OUTPUT_DIR=/tmp/t/b32
timeout 220 bash scripts/throughput.sh /tmp/p40 d12_fast -- --batch_size 32 --grad_accumulation_steps 8 \
  > "$OUT/x/tp_b32.log" 2>&1
cp /tmp/t/b16/*/d12_fast/summary.json "$OUT/x/tp_b16.summary.json"
cp /tmp/t/b32/*/d12_fast/summary.json "$OUT/x/tp_b32.summary.json"
grep -E "notice|compile warm|step:14/14 \| loss|rror" "$OUT/x/tp_b16.log" "$OUT/x/tp_b32.log" | tail -n 12
tail -n 3 "$OUT/x/tp_b16.log" "$OUT/x/tp_b32.log"
