#!/bin/bash
# Probe S on the device: processes of the library (main, from .clean) and of the rotation build (.rot) interleaved.
set -u
mkdir -p /tmp/ps
P=benchmarks/results/logs_twenty_seventh_round/probe_s.py
for r in 1 2; do
  for m in main rot1 rot0 rot2; do
    if [ "$m" = main ]; then dir=.clean; rot=0; else dir=.rot; rot=${m#rot}; fi
    (cd $dir && TRITON_CACHE_DIR=/tmp/tc_$m CP_ATTENTION_FP8_ROTATE=$rot OUT=/tmp/ps timeout 110 python3 ../$P . "${m}_r$r" \
      > "/tmp/ps/probe_s_${m}_r$r.txt" 2>&1; echo "$m round $r rc $?")
  done
done
(cd .rot && CP_ATTENTION_FP8_ROTATE=1 TRITON_CACHE_DIR=/tmp/tc_rot1 timeout 150 python3 -m pytest -q -n 8 tests/test_gpu.py \
  -k "one_warp or fp8" 2>&1 | tail -5 > "$OUT/gpu_rot1.txt"; tail -2 "$OUT/gpu_rot1.txt")
python3 - <<'PY'
import glob, json, os
rows = []
for f in sorted(glob.glob("/tmp/ps/probe_s_*.json")):
    rows += json.load(open(f))
json.dump(rows, open(os.environ["OUT"] + "/probe_s.json", "w"), indent=1)
for r in rows:
    print(r["tag"], r["B"], r["T"], {k: v for k, v in r.items() if k not in ("tag", "B", "T") and "maxdiff" not in k})
PY
tail -n 3 /tmp/ps/*.txt > "$OUT/probe_s_logs.txt"
