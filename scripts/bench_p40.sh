#!/usr/bin/env bash
# On the GPU machine: run the P40 benchmark for each run spec given, score each final checkpoint on the
# real-FineWeb check shard, and print a table last (compare_runs.py: time to the first run's final loss).
#   bash scripts/bench_p40.sh d12 [MODEL ...]                   one run per model, one after the other
#   bash scripts/bench_p40.sh d12 "fast_lr5:d12_fast --muon_lr 0.05"   NAME:MODEL FLAGS... names a run
#   P40_FLAGS="--seed 1" P40_TAG=_seed1 ...    extra flags for every run, and a suffix for the run names
#   P40_JOBS=2 ...     run up to 2 specs at once on the GPU (CUDA_VISIBLE_DEVICES picks it). For losses
#                      only: concurrent runs share the GPU, so their tokens/s and times mean nothing. With
#                      4-5 at once some runs died of CUDA launch failures on an H100 (docs/RESULTS.md).
#   P40_QUICK=1 ...    throughput only: 30 steps, one 16k-token eval, no FineWeb check, no coordinate-
#                      descent tuning
# Expects .bench_data/ (see ../shared/BENCHMARKS.md: the proxy .xz shards + fwtextfixer_val_000000.bin).
# Logs, metrics and summaries go to $P40_WORK/out/<name>.* (default /tmp/bench); with $OUT set (the device
# tool's return folder) they also come back as one archive, $OUT/<work dir name><P40_TAG>.tgz, and the table.
# P40_SRC names the folder of proxy shards (default .bench_data), P40_DATA where they are unpacked.
set -uo pipefail
cd "$(dirname "$0")/.."
work=${P40_WORK:-/tmp/bench}
out=$work/out
runs=$work/runs
src=${P40_SRC:-.bench_data}
export P40_DATA=${P40_DATA:-/tmp/p40} PYTHONUNBUFFERED=1
mkdir -p "$P40_DATA" "$out" "$runs"
for f in "$src"/*.xz; do
  dest="$P40_DATA/$(basename "${f%.xz}")"
  if [ ! -f "$dest" ]; then  # unpacked under a private name, then renamed: two scripts may race here
    xz -dc "$f" > "$dest.$$" && mv -f "$dest.$$" "$dest"
  fi
done
cp "$src/fwtextfixer_val_000000.bin" "$P40_DATA/"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
            torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
quick=()
[ "${P40_QUICK:-0}" = 1 ] && quick=(--num_iterations 30 --warmup_iters 5 --warmdown_iters 5 --val_loss_every 0
                                   --val_tokens 16384 --no-coordinate_descent_tuning)

run_name() {  # "NAME:MODEL FLAGS" -> NAME; "MODEL" -> MODEL; then the P40_TAG suffix
  local spec=$1
  echo "${spec%%:*}" | awk '{print $1}' | sed "s/\$/${P40_TAG:-}/"
}

bench_one() {
  local spec=$1 name words
  name=$(run_name "$spec")
  read -r -a words <<< "${spec#*:}"
  rm -rf "${runs:?}/$name"
  # --line-buffered: a run cut by a time limit keeps in its log what it printed (a block-buffered grep lost it)
  bash scripts/p40.sh "${words[0]}" --output_dir "$runs" --run_name "$name" "${quick[@]}" ${P40_FLAGS:-} \
    "${words[@]:1}" 2>&1 | grep --line-buffered -v -E "^step:[0-9]+/[0-9]+ \| loss" > "$out/$name.log"
  if [ "${P40_QUICK:-0}" = 1 ]; then
    echo "val_loss: nan" > "$runs/$name/fineweb_check.txt"
  elif ls "$runs/$name"/ckpt_*.pt > /dev/null 2>&1; then
    python3 scripts/eval_checkpoint.py --checkpoint "$(ls "$runs/$name"/ckpt_*.pt | tail -1)" \
      --val_bin "$P40_DATA/fwtextfixer_val_000000.bin" --val_tokens 212992 > "$runs/$name/fineweb_check.txt"
  fi
  rm -f "$runs/$name"/ckpt_*.pt  # checkpoints stay on the GPU machine; only logs come back
  for f in metrics.jsonl summary.json config.json fineweb_check.txt; do
    [ -f "$runs/$name/$f" ] && cp "$runs/$name/$f" "$out/$name.$f"
  done
  tail -n 12 "$out/$name.log"
}

for spec in "$@"; do
  while [ "$(jobs -rp | wc -l)" -ge "${P40_JOBS:-1}" ]; do wait -n; done
  bench_one "$spec" &
done
wait

finished=()
for spec in "$@"; do
  name=$(run_name "$spec")
  if [ -f "$runs/$name/summary.json" ]; then
    finished+=("$runs/$name")
    echo "$name FineWeb check $(cat "$runs/$name/fineweb_check.txt" 2>/dev/null)"
  else
    echo "$name failed: see $name.log"
  fi
done
# The table: time to the first run's final P40 loss, throughput, MFU, memory, compile time.
table="$out/table${P40_TAG:-}.txt"
[ ${#finished[@]} -eq 0 ] || python3 scripts/compare_runs.py "${finished[@]}" --target first | tee "$table"
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/$(basename "$work")${P40_TAG:-}.tgz" -C "$out" .
  [ -f "$table" ] && cp "$table" "$OUT/"
fi
exit 0
