#!/usr/bin/env bash
# P100 on one GPU, part 2 (run in the background on the GPU machine from a copy of the repo, while the
# shards are still being staged into $DATA). Three runs share the GPU (losses and tokens only):
#   d12's horizon at 50M and 200M tokens (two passes) at d12@P100's learning rate (1.2e-3);
#   d12 trained with Muon (the public record's settings: Muon lr 0.02, AdamW 0.0036 on the tied head,
#     no weight decay) at 50M, against d12 at 50M;
#   d12_fast at 65,536 tokens/step and 20M tokens, two seeds each, as it is and with one P40-era choice
#     undone: untied head, 4x MLP, no local attention (every layer over the whole sequence); the untied
#     head and the 4x MLP also at 40M.
# Then, alone on the GPU, the tokens/s of each d12_fast configuration at 65,536 tokens/step (24 steps).
set -u
W=${W:-/tmp/w2}; DATA=${DATA:-/tmp/proxy}; WAIT=${WAIT:-1200}
run() {
  local jobs=$1; shift
  python3 scripts/proxy.py run P100 "$@" --data "$DATA" --work "$W" --jobs "$jobs" --wait "$WAIT" \
    --archive "$W/runs.tgz"
}
F="d12_fast --total_batch_size 65536"
run 3 "d12_200M:d12 --budget 200M" \
  "fast65_s1:$F --budget 20M --seed 1" "untied_s0:$F --budget 20M --tie_embeddings false" \
  "mlp4_s0:$F --budget 20M --mlp_ratio 4" "dense_s0:$F --budget 20M --window 0" \
  "d12_50M:d12 --budget 50M" \
  "muon_50M:d12 --optimizer muon --muon_lr 0.02 --learning_rate 0.0036 --weight_decay 0 --budget 50M" \
  "untied_s1:$F --budget 20M --tie_embeddings false --seed 1" "mlp4_s1:$F --budget 20M --mlp_ratio 4 --seed 1" \
  "dense_s1:$F --budget 20M --window 0 --seed 1" \
  "mlp4_40M:$F --budget 40M --mlp_ratio 4" "untied_40M:$F --budget 40M --tie_embeddings false"
run 1 "tp_fast65:$F --budget 1.6M --val_loss_every 0" \
  "tp_untied:$F --budget 1.6M --val_loss_every 0 --tie_embeddings false" \
  "tp_mlp4:$F --budget 1.6M --val_loss_every 0 --mlp_ratio 4" "tp_dense:$F --budget 1.6M --val_loss_every 0 --window 0"
echo "PLAN DONE"
