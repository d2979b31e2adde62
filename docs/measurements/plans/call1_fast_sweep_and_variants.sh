#!/usr/bin/env bash
# Device call 1 (nvidia-h200-x2), 2026-11-22. GPU 0: the d12_fast recipe at P40 with 10.5M tokens and
# neighbours of its settings, 8 runs at once (losses only). GPU 1: P40 losses of d12 and four variants,
# 3 runs at once (losses only; their throughput is the sequential quick sweep in docs/RESULTS.md).
# Both: bf16 evaluation and no coordinate-descent tuning (sweep settings), same for every run compared.
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
FAST="--optimizer muon --muon_lr 0.05 --muon_momentum_warmup 50 --learning_rate 0.008 --embed_lr 0.3
 --scalar_lr 0.04 --weight_decay 0 --grad_accumulation_steps 4 --num_iterations 160 --warmup_iters 0
 --warmdown_iters 80 --lr_floor 0.1 --val_loss_every 20"
FAST=$(echo $FAST)
CUDA_VISIBLE_DEVICES=0 P40_WORK=/tmp/g0 P40_JOBS=8 timeout 530 bash scripts/bench_p40.sh \
  "f_base:d12_fast $FAST" \
  "f_mlr03:d12_fast $FAST --muon_lr 0.03" \
  "f_mlr08:d12_fast $FAST --muon_lr 0.08" \
  "f_emb05:d12_fast $FAST --embed_lr 0.05" \
  "f_b32k:d12_fast $FAST --grad_accumulation_steps 2 --num_iterations 320 --warmdown_iters 160 --muon_momentum_warmup 100 --val_loss_every 40" \
  "f_b131k:d12_fast $FAST --grad_accumulation_steps 8 --num_iterations 80 --warmdown_iters 40 --muon_momentum_warmup 25 --val_loss_every 10" \
  "f_21m:d12_fast $FAST --num_iterations 320 --warmdown_iters 160" \
  "d12_65k:d12 --grad_accumulation_steps 4 --num_iterations 160 --learning_rate 3e-3 --warmup_iters 16 --warmdown_iters 80 --val_loss_every 20" \
  > /tmp/g0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 P40_WORK=/tmp/g1 P40_JOBS=3 timeout 530 bash scripts/bench_p40.sh \
  d12 d12_gqa d12_mqa d12_mlp3 > /tmp/g1.txt 2>&1 &
wait
cp /tmp/g0.txt /tmp/g1.txt "$OUT/"
tar -czf "$OUT/call1.tgz" --exclude='*.pt' -C /tmp g0 g1
