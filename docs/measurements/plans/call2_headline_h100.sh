#!/usr/bin/env bash
# Device call 2 (nvidia-h100-x1), 2026-11-22: the headline. d12@P40 and d12_fast at its P40 schedule,
# two seeds each, one run at a time on the same GPU; every run evaluates in bf16 and compiles without
# coordinate-descent tuning (identical settings for all four).
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
# d12_fast at P40: its recipe with the budget cut to 6.55M tokens (200 steps of 32,768), cooldown over the
# second half; muon_lr 0.03 and the 32k batch chosen by the call-1 sweep.
FASTP40="--optimizer muon --muon_lr 0.03 --muon_momentum_warmup 60 --learning_rate 0.008 --embed_lr 0.3
 --scalar_lr 0.04 --weight_decay 0 --grad_accumulation_steps 2 --num_iterations 200 --warmup_iters 0
 --warmdown_iters 100 --lr_floor 0.1 --val_loss_every 20"
FASTP40=$(echo $FASTP40)
P40_WORK=/tmp/h bash scripts/bench_p40.sh d12 "d12_fast:d12_fast $FASTP40" \
  "d12_fast_seed1:d12_fast $FASTP40 --seed 1" "d12_seed1:d12 --seed 1" > /tmp/h.txt 2>&1
tail -8 /tmp/h.txt
cp /tmp/h.txt "$OUT/"
tar -czf "$OUT/call2.tgz" --exclude='*.pt' -C /tmp h
