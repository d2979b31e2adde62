#!/usr/bin/env bash
# The main job: set up, download the shards the run reads, and train until FineWeb val loss <= 3.3821.
# For now the recipe is the NoCap baseline (d12, scripts/baseline.sh); it switches to the fast recipe
# once that is measured.
set -euo pipefail
exec bash "$(dirname "$0")/baseline.sh" "$@"
