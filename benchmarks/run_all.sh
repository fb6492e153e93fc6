#!/usr/bin/env bash
# Every GPU measurement of docs/performance.md in one go on a 2-GPU machine, one-GPU benchmarks on both GPUs
# at once, the two-GPU ones after; each step under its own time limit, its output kept even if it fails.
# Each script writes its JSON and PNG under benchmarks/results/ and its tables into docs/performance.md.
#   usage: benchmarks/run_all.sh OUT_DIR [one|two|cp|all]   (from the checkout; FlashInfer wheels in $FI_WHEELS,
#   default .fi/, if present)
# "one": the one-GPU kernel benchmarks (~15 min), "two": context parallel and generation, the native model's and
# transformers' generate() on 1 and 2 GPUs and bench_hf (~40 min with the compiles), "cp": the context-parallel
# part of "two" alone (~4 min), "all" (default).
# Writes OUT_DIR/logs/*.txt (the printed output), the JSON/PNG files of benchmarks/results/ (copied to OUT_DIR
# too), the tables of docs/performance.md and README.md, and OUT_DIR/all.tgz holding the logs and results.
set -u
out=${1:?usage: benchmarks/run_all.sh OUT_DIR [one|two|cp|all]}
part=${2:-all}
cd "$(dirname "$0")/.."
mkdir -p "$out/logs" "$out/prompts"
out=$(cd "$out" && pwd)
wheels=${FI_WHEELS:-.fi}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$out/site" "$wheels"/*.whl &&
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FLASHINFER_WORKSPACE_BASE=$out/site
fi
site=$out/site:.
tr="python3 -m torch.distributed.run --standalone"
t0=$(date +%s)
step() {  # step NAME LIMIT_S CMD...: run CMD with a time limit, log to logs/NAME.txt
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/logs/$name.txt" 2>&1
  local rc=$?
  echo "[$(( $(date +%s) - t0 )) s] $name rc=$rc" | tee -a "$out/logs/steps.txt"
}
if [ "$part" = one ] || [ "$part" = all ]; then
( export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$site
  step bench_decode 330 python3 benchmarks/bench_decode.py --time-budget-s 280
  step bench_overhead 60 python3 benchmarks/bench_overhead.py
  step bench_d256 110 python3 benchmarks/bench_decode.py --shapes 1x128k --heads 16,8,256 \
    --head-shapes 1x8k 1x128k 16x32k 64x2k --name bench_d256
  step bench_cascade 300 python3 benchmarks/bench_cascade.py
  step fp8_accuracy 120 python3 benchmarks/fp8_accuracy.py ) &
( export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$site
  step bench_fp8 120 python3 benchmarks/bench_decode.py --impls cp_attention cp_attention_fp8 flashinfer_xqa_fp8 \
    --shapes 1x128k 1x1M 16x32k 64x8k --heads --name bench_fp8
  step bench_paged 150 python3 benchmarks/bench_paged.py --time-budget-s 120
  step bench_paged_fp8 150 python3 benchmarks/bench_paged.py --sections fp8 --name bench_paged_fp8
  step bench_paged_d256 240 python3 benchmarks/bench_paged.py --sections d256 --name bench_paged_d256
  step bench_variants 60 python3 benchmarks/bench_variants.py
  step bench_fp8_variants 120 python3 benchmarks/bench_fp8_variants.py
  step bench_merge 40 python3 benchmarks/bench_merge.py ) &
wait
fi
export PYTHONPATH=$site
if [ "$part" != one ]; then
step cp_decode 120 $tr --nproc-per-node=2 launch/cp_decode.py --context 131072 --steps 16 --exchange symm collective
step bench_cp 150 $tr --nproc-per-node=2 benchmarks/bench_cp.py --batches 1 8 --contexts 32768 131072 1048576 \
  --split-size 4096 --cascade 128:32768:256
step bench_cp_paged 60 $tr --nproc-per-node=2 benchmarks/bench_cp.py --batches 1 --contexts 131072 1048576 \
  --page-size 16 --exchanges symm --name bench_cp_paged
step bench_cp_fp8 60 $tr --nproc-per-node=2 benchmarks/bench_cp.py --batches 1 16 --contexts 32768 131072 --fp8 \
  --exchanges symm --name bench_cp_fp8
step bench_cp_cascade 90 $tr --nproc-per-node=2 benchmarks/bench_cp.py --batches 1 --contexts 32768 --exchanges symm \
  --cascade 128:32768:256 --name bench_cp_cascade
fi
if [ "$part" = two ] || [ "$part" = all ]; then
python3 -c "import json, random; random.seed(0); json.dump([[1]], open('$out/prompts/p1.json', 'w')); \
json.dump([[random.randrange(128000) for _ in range(131072)]], open('$out/prompts/p128k.json', 'w'))"
gen="launch/generate.py --random-config llama3-8b --prompts"
step generate_w1 150 env CUDA_VISIBLE_DEVICES=0 $tr --nproc-per-node=1 $gen $out/prompts/p1.json --new-tokens 24 \
  --fill-context 32768 131072 524288 --profile-steps 4 --output benchmarks/results/generate_w1.json
step generate_w2 150 $tr --nproc-per-node=2 $gen $out/prompts/p1.json --new-tokens 24 \
  --fill-context 32768 131072 524288 1048576 --profile-steps 4 --output benchmarks/results/generate_w2.json
step prefill_w1 90 env CUDA_VISIBLE_DEVICES=0 $tr --nproc-per-node=1 $gen $out/prompts/p128k.json --new-tokens 2 \
  --output benchmarks/results/generate_prefill_w1.json
step prefill_w2 90 $tr --nproc-per-node=2 $gen $out/prompts/p128k.json --new-tokens 2 --output benchmarks/results/generate_prefill_w2.json
# the same through transformers' generate() (the unmodified model, CPCache, compiled); a 32k prompt's prefill
python3 -c "import json, random; random.seed(1); \
json.dump([[random.randrange(128000) for _ in range(32768)]], open('$out/prompts/p32k.json', 'w'))"
hf="$gen $out/prompts/p1.json --backend transformers --compile --decode-ahead --new-tokens 24"
step generate_hf_w1 420 env CUDA_VISIBLE_DEVICES=0 $tr --nproc-per-node=1 $hf --fill-context 131072 524288 \
  --output benchmarks/results/generate_hf_w1.json
step generate_hf_w2 540 $tr --nproc-per-node=2 $hf --fill-context 131072 524288 1048576 \
  --output benchmarks/results/generate_hf_w2.json
step prefill_hf_w1 120 env CUDA_VISIBLE_DEVICES=0 $tr --nproc-per-node=1 launch/generate.py --random-config llama3-8b \
  --prompts $out/prompts/p32k.json --backend transformers --new-tokens 2 --output benchmarks/results/generate_hf_prefill_w1.json
step prefill_hf_w2 120 $tr --nproc-per-node=2 launch/generate.py --random-config llama3-8b --prompts $out/prompts/p32k.json \
  --backend transformers --new-tokens 2 --output benchmarks/results/generate_hf_prefill_w2.json
step bench_hf 900 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_hf.py --contexts 32768 131072 --new-tokens 40 \
  --prefill 32768
python3 benchmarks/plot_generate.py
fi
python3 -m benchmarks.tables  # the generation table (launch/generate.py writes only its JSON)
cp benchmarks/results/*.json benchmarks/results/*.png "$out/" 2>/dev/null
tar czf "$out/all.tgz" -C "$out" logs $(cd "$out" && ls *.json *.png 2>/dev/null)
