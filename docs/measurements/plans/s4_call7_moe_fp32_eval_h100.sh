#!/usr/bin/env bash
# Session 4, device call 7 (nvidia-h100-x1, call 6's machine, still warm), 2026-11-22. Call 6's quick
# d12_moe run came back with an empty log (its 150 s limit cut the pipe), so d12_moe ran again alone in the
# quick protocol at the trainer's defaults (fp32 evaluation, now eager for an MoE), without bench_p40.sh.
mkdir -p /tmp/p40
for f in .bench_data/*.xz; do
  [ -f "/tmp/p40/$(basename "${f%.xz}")" ] || xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"
done
timeout 250 bash scripts/p40.sh d12_moe --output_dir /tmp/q --run_name moe_fp32eval --num_iterations 30 \
  --warmup_iters 5 --warmdown_iters 5 --val_loss_every 0 --val_tokens 16384 --no-coordinate_descent_tuning \
  > "$OUT/moe_fp32eval.log" 2>&1
cp /tmp/q/moe_fp32eval/metrics.jsonl "$OUT/"
