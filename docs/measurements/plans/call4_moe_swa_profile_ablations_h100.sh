#!/usr/bin/env bash
# Device call 4 (nvidia-h100-x1), 2026-11-22. Alone on the GPU: the quick throughput rows of d12_moe and
# d12_swa (issue 3) and an eager profile of d12_fast. Then the rest of d12_fast's ablation rows at its P40
# schedule with their reference in the same call, 3 runs at once (losses only; call 3 ran 5 at once and
# two runs died with CUDA launch failures).
P40_QUICK=1 P40_WORK=/tmp/q bash scripts/bench_p40.sh d12_moe d12_swa > /tmp/q.txt 2>&1
grep -E "^d12_(moe|swa) +1 |failed" /tmp/q.txt
timeout 100 python3 scripts/profile_model.py --model d12_fast --trace /tmp/q/out/d12_fast_trace.json \
  > /tmp/q/out/d12_fast_profile.txt 2>&1; tail -15 /tmp/q/out/d12_fast_profile.txt
gzip -f /tmp/q/out/d12_fast_trace.json
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
FASTP40="--optimizer muon --muon_lr 0.03 --muon_momentum_warmup 60 --learning_rate 0.008 --embed_lr 0.3
 --scalar_lr 0.04 --weight_decay 0 --grad_accumulation_steps 2 --num_iterations 200 --warmup_iters 0
 --warmdown_iters 100 --lr_floor 0.1 --val_loss_every 20"
F="d12_fast $(echo $FASTP40)"
P40_WORK=/tmp/b P40_JOBS=3 timeout 360 bash scripts/bench_p40.sh "fast_ref:$F" \
  "no_embed_norm:$F --embed_norm false" "no_x0_mix:$F --x0_mix false" "no_value_res:$F --value_residual false" \
  "no_unet:$F --unet_skips false" "no_lr_floor:$F --lr_floor 0" "no_cooldown:$F --warmdown_iters 0" \
  > /tmp/b.txt 2>&1
grep -E "FineWeb check|failed" /tmp/b.txt
cp /tmp/q.txt /tmp/b.txt "$OUT/"
tar -czf "$OUT/call4.tgz" --exclude='*.pt' -C /tmp q b
