#!/bin/bash
# The round's final GPU run, in a clean clone (the caller's working directory): the FP8 bar, the head-dim-256
# table, the FP8 variants, then the GPU tests of FP8, the one-warp kernel and the plans.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/cpa_site ../.fi/*.whl > /dev/null 2>&1
export CUDA_HOME=/usr/local/cuda FLASHINFER_WORKSPACE_BASE=/tmp PYTHONPATH=/tmp/cpa_site:.
tag=$(cat REV)
timeout 120 python3 benchmarks/bench_decode.py --impls cp_attention cp_attention_fp8 flashinfer_xqa_fp8 \
  --shapes 1x128k 1x1M 16x32k 64x8k --heads --name bench_fp8 > "$OUT/bench_fp8_$tag.txt" 2>&1; echo "bench_fp8 rc $?"
timeout 200 python3 benchmarks/bench_paged.py --sections d256 --name bench_paged_d256 > "$OUT/bench_paged_d256_$tag.txt" 2>&1; echo "d256 rc $?"
timeout 120 python3 benchmarks/bench_fp8_variants.py > "$OUT/bench_fp8_variants_$tag.txt" 2>&1; echo "variants rc $?"
cp benchmarks/results/bench_fp8.* benchmarks/results/bench_paged_d256.* benchmarks/results/bench_fp8_variants.* "$OUT/"
timeout 150 python3 -m pytest -q -n 8 tests/test_gpu.py tests/test_heuristics.py tests/test_fp8.py -k "one_warp or fp8 or plan or head_dim_256" > "$OUT/gpu_subset_$tag.txt" 2>&1; echo "tests rc $?"
tail -2 "$OUT/gpu_subset_$tag.txt"
grep -A6 "cp8/cp graph" "$OUT/bench_fp8_$tag.txt"
