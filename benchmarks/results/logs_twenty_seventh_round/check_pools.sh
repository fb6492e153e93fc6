#!/bin/bash
# After pools went back to ranges (clean clone): the GPU tests of the one-warp kernel and FP8, the D=128 FP8 pools
# table, the FP8 bar; logs and results back as one tar file.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/cpa_site ../.fi/*.whl > /dev/null 2>&1
export CUDA_HOME=/usr/local/cuda FLASHINFER_WORKSPACE_BASE=/tmp PYTHONPATH=/tmp/cpa_site:.
tag=$(cat REV)
L=/tmp/check_logs && mkdir -p $L
timeout 100 python3 -m pytest -q -n 8 tests/test_gpu.py -k "one_warp or fp8" > "$L/gpu_one_warp_$tag.txt" 2>&1; echo "tests rc $?"
tail -1 "$L/gpu_one_warp_$tag.txt"
timeout 110 python3 benchmarks/bench_paged.py --sections fp8 --name bench_paged_fp8 > "$L/bench_paged_fp8_$tag.txt" 2>&1; echo "fp8 pools rc $?"
tail -5 "$L/bench_paged_fp8_$tag.txt"
timeout 45 python3 benchmarks/bench_decode.py --impls cp_attention cp_attention_fp8 flashinfer_xqa_fp8 \
  --shapes 1x128k 1x1M 16x32k 64x8k --heads --name bench_fp8 > "$L/bench_fp8_$tag.txt" 2>&1; echo "bench_fp8 rc $?"
grep -A5 "cp8/cp graph" "$L/bench_fp8_$tag.txt"
cp benchmarks/results/bench_fp8.* benchmarks/results/bench_paged_fp8.* $L/ 2>/dev/null
tar -C $L -cf "$OUT/check_$tag.tar" .
