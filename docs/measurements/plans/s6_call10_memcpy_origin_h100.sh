#!/usr/bin/env bash
# Session 6, device call 10 (nvidia-h100-x1), 2026-11-22: where d12_fast's 38 device-to-device copies per
# compiled step come from (s6_call10_memcpy_origin.py), alone on the GPU.
mkdir -p "$OUT/x"
timeout 240 python3 docs/measurements/plans/s6_call10_memcpy_origin.py > "$OUT/x/memcpy_origin.txt" 2>&1
grep -v "^W1122" "$OUT/x/memcpy_origin.txt" | tail -40
