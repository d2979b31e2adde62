#!/usr/bin/env bash
# Device call 3 (nvidia-h100-x1), 2026-11-22. First, alone on the GPU: tokens/s, MFU and peak memory of
# d12 and d12_fast at their FineWeb defaults (d12: NoCap's 16x1024 x 32 accumulation; d12_fast: its recipe,
# 16x1024 x 16), 14 steps each under a 22 GiB cap. Then the ablation rows of d12_fast at its P40 schedule
# (call 2), each with one part of the recipe taken away, 5 runs at once (losses only); the other rows
# are call 4's.
mkdir -p /tmp/p40 /tmp/a/out
for f in .bench_data/*.xz; do xz -dc "$f" > "/tmp/p40/$(basename "${f%.xz}")"; done
for model in d12 d12_fast; do
  timeout 150 torchrun --standalone --nproc_per_node=1 train_gpt2.py --model $model \
    --input_bin "/tmp/p40/mix_train_00000[12].bin" --input_val_bin /tmp/p40/mix_val_000000.bin \
    --num_iterations 14 --warmup_iters 4 --warmdown_iters 4 --val_loss_every 0 --val_tokens 16384 \
    --target_val_loss 0 --memory_cap_gib 22 --no-coordinate_descent_tuning --output_dir /tmp/a/runs \
    --run_name "${model}_fineweb_config" 2>&1 | grep -v "^step:" | tail -4
  cp /tmp/a/runs/${model}_fineweb_config/{summary.json,metrics.jsonl} /tmp/a/out/ 2>/dev/null
  for f in summary.json metrics.jsonl; do mv /tmp/a/out/$f /tmp/a/out/${model}_fineweb_config.$f; done
done
export P40_FLAGS="--val_dtype bf16 --no-coordinate_descent_tuning"
FASTP40="--optimizer muon --muon_lr 0.03 --muon_momentum_warmup 60 --learning_rate 0.008 --embed_lr 0.3
 --scalar_lr 0.04 --weight_decay 0 --grad_accumulation_steps 2 --num_iterations 200 --warmup_iters 0
 --warmdown_iters 100 --lr_floor 0.1 --val_loss_every 20"
F="d12_fast $(echo $FASTP40)"
P40_WORK=/tmp/a P40_JOBS=5 timeout 400 bash scripts/bench_p40.sh "fast_ref:$F" \
  "no_muon:$F --optimizer adamw --learning_rate 0.003 --warmup_iters 20" \
  "heads12:$F --n_head 12" "no_qk_norm:$F --qk_norm false" "gelu:$F --mlp_act gelu" \
  "no_zero_init:$F --zero_init_proj false" "attn_scale:$F --scale_attn_branch true" \
  "tied:$F --tie_embeddings true" "no_softcap:$F --logit_softcap 0" "no_embed_norm:$F --embed_norm false" \
  > /tmp/a.txt 2>&1
grep -E "FineWeb check|failed" /tmp/a.txt; tail -18 /tmp/a.txt | grep -E "^[a-z_0-9]+ +1 "
cp /tmp/a.txt "$OUT/"
tar -czf "$OUT/call3.tgz" --exclude='*.pt' -C /tmp a
