#!/usr/bin/env bash
# Session 8, device call 1 (nvidia-h100-x1), 2026-11-22: chunked local attention (--window_kind chunked: the
# sequence cut into aligned blocks of --window positions in the local layers of an LLLG pattern, run by SDPA's
# fused kernels over the blocks as a batch). tokens/s at the FineWeb defaults through scripts/throughput.sh
# (22 GiB cap): the recipe, then the recipe with chunks of 512, 256 and 128. Then one P40 seed each of
# chunks 256 and 512 (the recipe's P40 form, session 7 flags), a first look at what the blocks cost in loss.
set -u
mkdir -p /tmp/p40 "$OUT/x"
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
tp() {  # tp NAME [FLAGS...]
  local name=$1; shift
  OUTPUT_DIR=/tmp/t/$name timeout 150 bash scripts/throughput.sh /tmp/p40 d12_fast -- "$@" > "$OUT/x/tp_$name.log" 2>&1
  cp /tmp/t/$name/*/d12_fast/summary.json "$OUT/x/tp_$name.summary.json"
}
chunk() { echo --window "$1" --window_pattern LLLG --window_kind chunked; }
tp recipe
tp chunk512 $(chunk 512)
tp chunk256 $(chunk 256)
tp chunk128 $(chunk 128)
grep -hE "notice|rror" "$OUT"/x/tp_*.log | sort | uniq -c | head
for f in "$OUT"/x/tp_*.log; do echo "$f: $(tail -n 2 "$f" | head -n 1)"; done
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
P40_WORK=/tmp/h timeout 200 bash scripts/bench_p40.sh "d12_fast_chunk256:d12_fast $(chunk 256)" \
  "d12_fast_chunk512:d12_fast $(chunk 512)" > "$OUT/h.txt" 2>&1
tail -n 6 "$OUT/h.txt"
