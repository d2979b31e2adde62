#!/usr/bin/env bash
# Launch train_gpt2.py on NPROC processes (default 1), with the flags given. One process runs it directly,
# so a signal reaches it and its exit code (0, 1 diverged, 2 bad input, 128 + a signal) reaches the shell
# unchanged. Several go through torchrun, which reports any non-zero exit of a worker as its own failure:
# exit 1 and a ChildFailedError report after the trainer's line.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ "${NPROC:-1}" = 1 ]; then
  exec "$PYTHON" train_gpt2.py "$@"
fi
exec "$TORCHRUN" --standalone --nproc_per_node="$NPROC" train_gpt2.py "$@"
