#!/bin/bash
# The round's final GPU run, in a clean clone (the caller's working directory): the FP8 bar, the D=128 FP8 pools,
# the head-dim-256 table, then `make test` (VARIANTS=1: the FP8 variants first); the results and logs come back as
# one tar file.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/cpa_site ../.fi/*.whl > /dev/null 2>&1
export CUDA_HOME=/usr/local/cuda FLASHINFER_WORKSPACE_BASE=/tmp PYTHONPATH=/tmp/cpa_site:.
tag=$(cat REV)
L=/tmp/final_logs && mkdir -p $L
timeout 120 python3 benchmarks/bench_decode.py --impls cp_attention cp_attention_fp8 flashinfer_xqa_fp8 \
  --shapes 1x128k 1x1M 16x32k 64x8k --heads --name bench_fp8 > "$L/bench_fp8_$tag.txt" 2>&1; echo "bench_fp8 rc $?"
grep -A6 "cp8/cp graph" "$L/bench_fp8_$tag.txt"
timeout 200 python3 benchmarks/bench_paged.py --sections fp8 --name bench_paged_fp8 > "$L/bench_paged_fp8_$tag.txt" 2>&1; echo "fp8 pools rc $?"
timeout 200 python3 benchmarks/bench_paged.py --sections d256 --name bench_paged_d256 > "$L/bench_paged_d256_$tag.txt" 2>&1; echo "d256 rc $?"
if [ "${VARIANTS:-0}" = 1 ]; then
  timeout 120 python3 benchmarks/bench_fp8_variants.py > "$L/bench_fp8_variants_$tag.txt" 2>&1; echo "variants rc $?"
  cp benchmarks/results/bench_fp8_variants.* $L/
fi
cp benchmarks/results/bench_fp8.* benchmarks/results/bench_paged_fp8.* benchmarks/results/bench_paged_d256.* $L/
for f in $L/bench_paged_fp8_$tag.txt $L/bench_paged_d256_$tag.txt; do tail -6 $f; done
tar -C $L -cf "$OUT/final_$tag.tar" .
timeout 330 make test > "$L/make_test_$tag.txt" 2>&1; echo "make test rc $?"
tail -3 "$L/make_test_$tag.txt"
grep -E "FAILED|ERROR" "$L/make_test_$tag.txt" | head -20
tar -C $L -cf "$OUT/final_$tag.tar" .
