"""Sweep flash_decode's tile config and split count on the GPU; the results set the defaults in
cp_attention/ops/split_kv.py (default_config) and cp_attention/heuristics.py (decode_num_splits).

    PYTHONPATH=. python benchmarks/tune_decode.py

Writes benchmarks/results/tune_decode.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import bench_eager, bench_graph, table, write_json  # noqa: E402
from cp_attention import flash_decode  # noqa: E402
from cp_attention.decode import _num_sms  # noqa: E402
from cp_attention.heuristics import decode_num_splits  # noqa: E402

CONFIGS = [(128, 4, 3), (64, 4, 3), (128, 8, 3)]
SPLITS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128]
SHAPES = [(1, 2048), (1, 8192), (1, 32768), (1, 131072), (1, 1048576), (4, 8192), (4, 32768), (4, 131072),
          (16, 8192), (16, 32768), (64, 2048), (64, 8192)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rep-ms", type=int, default=30)
    args = ap.parse_args()
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    rows = []
    for b, t in tqdm(SHAPES, desc="shapes"):
        q = torch.randn(b, hq, d, device="cuda", dtype=dt)
        k = torch.randn(b, hkv, t, d, device="cuda", dtype=dt)
        v = torch.randn(b, hkv, t, d, device="cuda", dtype=dt)
        nbytes = 2 * k.numel() * k.element_size()
        best = None
        for cfg in CONFIGS:
            for s in SPLITS:
                if b * hkv * s > 8 * 132 * 4 or (b * hkv >= 256 and s > 2):
                    continue
                # GPU time (graph replay): the split policy decides GPU work only.
                us = bench_graph(lambda: flash_decode(q, k, v, num_splits=s, _config=cfg), args.rep_ms)
                r = {"B": b, "T": t, "cfg": "x".join(map(str, cfg)), "S": s, "us": us, "TBs": nbytes / us / 1e6}
                rows.append(r)
                if best is None or us < best["us"]:
                    best = r
        policy_s = decode_num_splits(b, hkv, t, 64, _num_sms(q.device))
        best = dict(best, policy_S=policy_s, policy_graph_us=bench_graph(lambda: flash_decode(q, k, v)),
                    policy_eager_us=bench_eager(lambda: flash_decode(q, k, v)))
        rows.append(dict(best, kind="best"))
        del q, k, v
        torch.cuda.empty_cache()
    write_json("tune_decode", {"rows": rows})
    bests = [r for r in rows if r.get("kind") == "best"]
    print(table(bests, ["B", "T", "cfg", "S", "us", "TBs", "policy_S", "policy_graph_us", "policy_eager_us"]))
    # Per config: time at the best split count for each shape, to choose one config for all.
    for cfg in CONFIGS:
        c = "x".join(map(str, cfg))
        per = []
        for b, t in SHAPES:
            xs = [r["us"] for r in rows if r.get("cfg") == c and r["B"] == b and r["T"] == t and "kind" not in r]
            per.append(min(xs) if xs else float("nan"))
        print(c, " ".join(f"{x:8.1f}" for x in per))


if __name__ == "__main__":
    main()
