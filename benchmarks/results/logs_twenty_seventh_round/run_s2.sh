#!/bin/bash
# The D=128 FP8 pools table of the library (clean clone), then probe S2: main and the strided build (.rot, mode 3) ABAB.
set -u
mkdir -p /tmp/ps
python3 -m pip install -q --no-index --no-deps --target /tmp/cpa_site .fi/*.whl > /dev/null 2>&1
(cd .clean && CUDA_HOME=/usr/local/cuda FLASHINFER_WORKSPACE_BASE=/tmp PYTHONPATH=/tmp/cpa_site:. timeout 240 \
  python3 benchmarks/bench_paged.py --sections fp8 --name bench_paged_fp8 > "$OUT/bench_paged_fp8_$(cat REV).txt" 2>&1;
  echo "bench_paged fp8 rc $?"; cp benchmarks/results/bench_paged_fp8.* "$OUT/")
P=benchmarks/results/logs_twenty_seventh_round/probe_s.py
for r in 1 2; do
  for m in main rot3; do
    if [ "$m" = main ]; then dir=.clean; rot=0; else dir=.rot; rot=3; fi
    (cd $dir && TRITON_CACHE_DIR=/tmp/tc_$m CP_ATTENTION_FP8_ROTATE=$rot OUT=/tmp/ps timeout 110 python3 ../$P . "${m}_s2_r$r" \
      > "/tmp/ps/probe_s2_${m}_r$r.txt" 2>&1; echo "$m round $r rc $?")
  done
done
python3 - <<'PY'
import glob, json, os
rows = []
for f in sorted(glob.glob("/tmp/ps/probe_s_*.json")):
    rows += json.load(open(f))
json.dump(rows, open(os.environ["OUT"] + "/probe_s2.json", "w"), indent=1)
for r in rows:
    print(r["tag"], r["B"], r["T"], {k: v for k, v in r.items() if k not in ("tag", "B", "T")})
PY
tail -n 3 /tmp/ps/*.txt > "$OUT/probe_s2_logs.txt"
grep -B2 -A12 "e4m3" "$OUT"/bench_paged_fp8_*.txt | tail -30
