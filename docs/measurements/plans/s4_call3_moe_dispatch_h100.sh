#!/usr/bin/env bash
# Session 4, device call 3 (nvidia-h100-x1), 2026-11-22. Everything one after the other.
# The MoE now moves tokens to and from expert order with a permutation whose backward is a gather
# (PermuteRows), where indexing + index_add_ had atomic scatter-adds both ways.
# 1. Kernel table of d12_moe's compiled step, random tokens, as in s4_call2 (52.24 ms per 16x1024 step).
# 2. The same on real batches with the trainer's P40 accumulation (8): s4_call1's trainer ran 66 ms per
#    micro-batch where the profile ran ~46 ms (+ the optimizer): is the difference the data?
# 3. d12 vs d12_moe tokens/s, quick protocol as in s4_call1 (d12 452,692; d12_moe 251,346 = 0.555x).
mkdir -p "$OUT/x" /tmp/p40
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
timeout 100 python3 scripts/profile_model.py --model d12_moe --compile --kernels 30 > "$OUT/x/prof_moe.txt" 2>&1
timeout 150 python3 scripts/profile_model.py --model d12_moe --compile --kernels 30 --grad_accumulation_steps 8 \
  --input_bin "/tmp/p40/mix_train_00000[12].bin" > "$OUT/x/prof_moe_real.txt" 2>&1
P40_QUICK=1 P40_WORK=/tmp/moe timeout 190 bash scripts/bench_p40.sh d12 d12_moe > "$OUT/x/moe_quick.txt" 2>&1
tar -czf "$OUT/moe_quick.tgz" -C /tmp/moe out
