#!/usr/bin/env bash
# On the GPU machine: run the P40 benchmark for each model named, one after the other in this one call,
# score each final checkpoint on the real-FineWeb check shard, and print a table last (compare_runs.py).
#   bash scripts/bench_p40.sh d12 [d12_other ...]        (extra train flags: P40_FLAGS="--seed 1")
#   P40_QUICK=1 bash scripts/bench_p40.sh d12 d12_gqa ... throughput only: 30 steps, one 16k-token eval,
#                                                         no FineWeb check, no coordinate-descent tuning
# Expects .bench_data/ (see ../shared/BENCHMARKS.md: the proxy .xz shards + fwtextfixer_val_000000.bin).
# Logs and summaries go to $OUT (the device tool's return folder) or /tmp/bench_out.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/bench_out}
runs=/tmp/bench_runs
export P40_DATA=/tmp/p40 PYTHONUNBUFFERED=1
mkdir -p "$P40_DATA" "$out" "$runs"
for f in .bench_data/*.xz; do
  dest="$P40_DATA/$(basename "${f%.xz}")"
  [ -f "$dest" ] || xz -dc "$f" > "$dest"
done
cp .bench_data/fwtextfixer_val_000000.bin "$P40_DATA/"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
quick=()
[ "${P40_QUICK:-0}" = 1 ] && quick=(--num_iterations 30 --warmup_iters 5 --warmdown_iters 5 --val_loss_every 0
                                   --val_tokens 16384 --no-coordinate_descent_tuning)
for model in "$@"; do
  name="${model}${P40_TAG:-}"
  rm -rf "${runs:?}/$name"
  bash scripts/p40.sh "$model" --output_dir "$runs" --run_name "$name" "${quick[@]}" ${P40_FLAGS:-} 2>&1 \
    | grep -v -E "^step:[0-9]+/[0-9]+ \| loss" | tee "$out/$name.log"
  if [ "${P40_QUICK:-0}" = 1 ]; then
    echo "val_loss: nan" > "$runs/$name/fineweb_check.txt"
  else
    python3 scripts/eval_checkpoint.py --checkpoint "$(ls "$runs/$name"/ckpt_*.pt | tail -1)" \
      --val_bin "$P40_DATA/fwtextfixer_val_000000.bin" --val_tokens 212992 | tee "$runs/$name/fineweb_check.txt"
  fi
  rm -f "$runs/$name"/ckpt_*.pt  # checkpoints stay on the GPU machine; only logs come back
  cp "$runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl"
  cp "$runs/$name/summary.json" "$out/$name.summary.json"
done
finished=()
for model in "$@"; do
  name="${model}${P40_TAG:-}"
  if [ -f "$runs/$name/summary.json" ]; then
    finished+=("$runs/$name")
    echo "$name FineWeb check $(cat "$runs/$name/fineweb_check.txt")"
  else
    echo "$name failed: see $name.log"
  fi
done
# The table: time to the first run's final P40 loss, throughput, MFU, memory, compile time.
[ ${#finished[@]} -eq 0 ] || python3 scripts/compare_runs.py "${finished[@]}" --target first
