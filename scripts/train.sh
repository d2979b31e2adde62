#!/usr/bin/env bash
# Launch train_gpt2.py on NPROC processes (default 1), with the flags given. One process runs it directly, so a
# signal reaches it and its exit code (0, 1 diverged, 2 bad input, 128 + a signal) reaches the shell unchanged.
# Several go through torchrun by way of scripts/launch.py, which leaves torchrun's own report of a failed process
# out and exits with that process's code: the same lines and exit codes as one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ "${NPROC:-1}" = 1 ]; then
  exec "$PYTHON" train_gpt2.py "$@"
fi
exec "$PYTHON" scripts/launch.py "$NPROC" train_gpt2.py "$@"
