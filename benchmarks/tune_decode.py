"""Sweep flash_decode's tile config and split count on the GPU; the results set the defaults of
cp_attention/heuristics.py (decode_config and the split policy of decode_plan).

bf16, Hq=32, Hkv=8, D=128 on the shapes of SHAPES (--shapes). For every tile config of CONFIGS and split
count S in SPLITS (at most 8 programs per SM): flash_decode(q, k, v, plan=heuristics.decode_plan(...,
splits=S, config=DecodeConfig(*cfg))), timed per call in a CUDA graph of 20 calls
(benchmarks/_harness.py; the split policy decides GPU work only); per shape the best (config, S) against
the policy's, in a graph and per call.

    PYTHONPATH=. python3 benchmarks/tune_decode.py

Writes benchmarks/results/tune_decode.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peers  # noqa: E402
from benchmarks._harness import bench_call, bench_graph, table, tbs, tqdm, write_json  # noqa: E402
from cp_attention import flash_decode, heuristics  # noqa: E402

CONFIGS = [(128, 4, 3), (64, 4, 3), (128, 8, 3), (128, 4, 2), (64, 4, 4), (64, 4, 2)]  # (block_n, warps, stages)
SPLITS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128]
SHAPES = ["1x2048", "1x8192", "1x32768", "1x131072", "1x1048576", "4x8192", "4x32768", "4x131072", "16x8192",
          "16x32768", "64x2048", "64x8192"]


def candidates(q, k, v):
    """``(config label, split count, callable)`` for every (tile config, split count) to time on this shape."""
    b, hkv, t, d = k.shape
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = [s for s in SPLITS if b * hkv * s <= 8 * sms]
    out = []
    for cfg in CONFIGS:
        for s in splits:
            plan = heuristics.decode_plan(b, hkv, t, d, q.dtype, sms, splits=s, config=heuristics.DecodeConfig(*cfg))
            out.append(("x".join(map(str, cfg)), s, lambda plan=plan: flash_decode(q, k, v, plan=plan)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, metavar="BxT")
    ap.add_argument("--rep-ms", type=int, default=30, help="do_bench rep per measurement")
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes]
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    rows, bests = [], []
    gen = torch.Generator("cuda").manual_seed(0)
    for b, t in tqdm(shapes, desc="shapes"):
        q = torch.randn(b, hq, d, generator=gen, device="cuda", dtype=dt)
        k = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dt)
        v = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dt)
        nbytes = 2 * k.numel() * k.element_size()
        best = None
        for cfg, s, fn in candidates(q, k, v):
            us = bench_graph(fn, rep=args.rep_ms)
            r = {"B": b, "T": t, "cfg": cfg, "S": s, "graph_us": us, "TBs": tbs(nbytes, us)}
            rows.append(r)
            if best is None or us < best["graph_us"]:
                best = r
        policy = peers.cp_attention(q, k, v)
        bests.append(dict(best, policy_S=peers.cp_splits(q, k), policy_graph_us=bench_graph(policy, rep=args.rep_ms),
                          policy_call_us=bench_call(policy, rep=args.rep_ms)))
        del q, k, v, policy
        torch.cuda.empty_cache()
    path = write_json("tune_decode", {"config": {"configs": CONFIGS}, "rows": rows,
                                      "best": bests})
    # Per tile config: its time at its best split count on each shape, to choose one config for all.
    per_cfg = []
    for cfg in dict.fromkeys(r["cfg"] for r in rows):
        per = {"cfg": cfg}
        for b, t in shapes:
            xs = [r["graph_us"] for r in rows if r["cfg"] == cfg and r["B"] == b and r["T"] == t]
            if xs:
                per[f"{b}x{t}"] = min(xs)
        per_cfg.append(per)
    print(table(per_cfg, ["cfg"] + args.shapes))
    print(f"wrote {path}")
    print(table(bests, ["B", "T", "cfg", "S", "graph_us", "TBs", "policy_S", "policy_graph_us", "policy_call_us"]))


if __name__ == "__main__":
    main()
