#!/usr/bin/env bash
# Session 8, device call 5 (nvidia-h100-x1), 2026-11-22: a 3x MLP (hidden 2304) in d12_fast. Call 4 put the
# recipe at 519k tokens/s; the MLP's products and ReLU^2 are about a third of the step, so a 3x MLP is worth
# measuring for speed, and d12's 3x MLP ended 0.02-0.03 lower at P40 (session 4). tokens/s at the FineWeb
# defaults with --mlp_ratio 3 (scripts/throughput.sh, 22 GiB cap), then P40: the recipe and --mlp_ratio 3,
# two seeds each, one run at a time, the flags of calls 2-3.
set -u
mkdir -p /tmp/p40 /tmp/r
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
OUTPUT_DIR=/tmp/t/mlp3 timeout 150 bash scripts/throughput.sh /tmp/p40 d12_fast -- --mlp_ratio 3 > /tmp/r/tp_mlp3.log 2>&1
cp /tmp/t/mlp3/*/d12_fast/summary.json /tmp/r/tp_mlp3.summary.json
tail -n 1 /tmp/r/tp_mlp3.log
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h5 timeout 400 bash scripts/bench_p40.sh d12_fast "d12_fast_mlp3:d12_fast --mlp_ratio 3" \
  "d12_fast_mlp3_seed1:d12_fast --mlp_ratio 3 --seed 1" "d12_fast_seed1:d12_fast --seed 1" > /tmp/r/h.txt 2>&1
cp -r /tmp/h5/out /tmp/r/p40
tar -czf "$OUT/s8_call5.tgz" -C /tmp/r .
tail -n 8 /tmp/r/h.txt
