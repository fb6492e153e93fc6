#!/bin/bash
# Probe X on the device: the one-warp GPU tests with the keys as the mma rows, then A/B processes interleaved.
set -u
cd "$(dirname "$0")/../../.."
timeout 150 python3 -m pytest -q -n 8 tests/test_gpu.py -k "one_warp or fp8" 2>&1 | tail -15 > "$OUT/gpu_one_warp_x.txt"
tail -3 "$OUT/gpu_one_warp_x.txt"
for r in 1 2; do
  for m in 0 1; do
    CP_ATTENTION_FP8_KEYS_M=$m timeout 105 python3 benchmarks/results/logs_twenty_sixth_round/probe_x.py . "m${m}_r${r}" > "$OUT/probe_x_m${m}_r${r}.txt" 2>&1
    echo "mode $m round $r rc $?"
  done
done
