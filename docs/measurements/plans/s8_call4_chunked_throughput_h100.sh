#!/usr/bin/env bash
# Session 8, device call 4 (nvidia-h100-x1), 2026-11-22: tokens/s at the FineWeb defaults of the new recipe
# (chunked 256-token blocks in the local layers of LLLG) and of session 7's (--window 0: every layer over the
# whole sequence) on one machine, through scripts/throughput.sh (22 GiB cap). Then the new recipe's kernel table
# (16x1024, compiled, 40 rows) to see what the blocks left of attention's time. Everything in one archive.
set -u
mkdir -p /tmp/p40 /tmp/r
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
tp() {  # tp NAME [FLAGS...]
  local name=$1; shift
  OUTPUT_DIR=/tmp/t/$name timeout 170 bash scripts/throughput.sh /tmp/p40 d12_fast -- "$@" > "/tmp/r/tp_$name.log" 2>&1
  cp /tmp/t/$name/*/d12_fast/summary.json "/tmp/r/tp_$name.summary.json"
}
tp recipe
tp window0 --window 0
timeout 150 python3 scripts/profile_model.py --model d12_fast --compile --kernels 40 > /tmp/r/prof_recipe.txt 2>&1
tar -czf "$OUT/s8_call4.tgz" -C /tmp/r .
for f in /tmp/r/tp_*.log; do echo "$f: $(tail -n 1 "$f")"; done
head -n 30 /tmp/r/prof_recipe.txt
