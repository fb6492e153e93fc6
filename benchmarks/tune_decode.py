"""Sweep flash_decode's tile config and split count on the GPU; the results set the defaults of
cp_attention/heuristics.py (decode_config and the split policy of decode_plan).

Hq=32, Hkv=8, D=128 (--heads), bf16 (--dtype: the query's and the dense cache's dtype) on the shapes of
SHAPES (--shapes). For every tile config of --configs and split count S in SPLITS (at most 8 programs per
SM): flash_decode(q, k, v, plan=heuristics.decode_plan(..., splits=S, config=DecodeConfig(*cfg))), timed
per call in a CUDA graph of 20 calls
(benchmarks/_harness.py; the split policy decides GPU work only); per shape the best (config, S) against
the policy's, in a graph and per call. ``--cache`` sweeps another form of the same cache: ``fp8`` (e4m3,
``quantize_kv`` per-tensor scales), ``nhd`` (dense ``[B, T, Hkv, D]``), ``paged1``/``paged16``/``paged64``
(NHD page pools, their page tables scattered as bench_paged.py builds them).

    PYTHONPATH=. python3 benchmarks/tune_decode.py
    PYTHONPATH=. python3 benchmarks/tune_decode.py --cache fp8 --shapes 1x131072 64x8192 --configs 128,4,3 128,8,3 128,8,4
    PYTHONPATH=. python3 benchmarks/tune_decode.py --cache fp8 --dtype float16 --shapes 1x131072 --configs 128,4,3

Writes benchmarks/results/tune_decode[_<cache>][_float16].json.
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


CACHES = ("bf16", "fp8", "nhd", "paged1", "paged16", "paged64")


def cache_form(k, v, cache: str):
    """``(k, v, kwargs)``: the dense HND cache in the form ``cache`` (see the module docstring)."""
    return peers.cache_form(k, v, fp8=cache == "fp8", page_size=page_size(cache) or None, nhd=cache == "nhd")


def page_size(cache: str) -> int:
    """The page size of the cache form ``cache`` (0: dense)."""
    return int(cache[5:]) if cache.startswith("paged") else 0


def candidates(q, k, v, configs, kv_dtype, kwargs, page: int = 0):
    """``(config label, split count, callable)`` for every (tile config, split count) to time on this shape
    (``k``, ``v`` ``[B, Hkv, T, D]`` give the plan's shape; ``kwargs`` hold the cache form's arguments)."""
    b, hkv, t, d = k.shape
    sms = peers.sm_count(q.device)
    splits = [s for s in SPLITS if b * hkv * s <= 8 * sms]
    out = []
    for cfg in configs:
        for s in splits:
            plan = heuristics.decode_plan(b, hkv, t, d, q.dtype, sms, splits=s, config=heuristics.DecodeConfig(*cfg),
                                          kv_dtype=kv_dtype, page_size=page)
            out.append(("x".join(map(str, cfg)), s, lambda plan=plan: flash_decode(q, plan=plan, **kwargs)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, metavar="BxT")
    ap.add_argument("--rep-ms", type=int, default=30, help="do_bench rep per measurement")
    ap.add_argument("--cache", choices=CACHES, default="bf16", help="the form of the cache (module docstring)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                    help="dtype of the query (and of the cache before --cache converts it)")
    ap.add_argument("--heads", default="32/8/128", metavar="HQ/HKV/D", help="query heads, KV heads, head dim")
    ap.add_argument("--configs", nargs="+", default=[",".join(map(str, c)) for c in CONFIGS],
                    metavar="BLOCK_N,WARPS,STAGES", help="tile configs to sweep")
    args = ap.parse_args()
    configs = [tuple(map(int, c.split(","))) for c in args.configs]
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes]
    hq, hkv, d = map(int, args.heads.split("/"))
    dt = getattr(torch, args.dtype)
    rows, bests = [], []
    gen = torch.Generator("cuda").manual_seed(0)
    for b, t in tqdm(shapes, desc="shapes"):
        q = torch.randn(b, hq, d, generator=gen, device="cuda", dtype=dt)
        k = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dt)
        v = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dt)
        kf, vf, kwargs = cache_form(k, v, args.cache)
        nbytes = 2 * kf.numel() * kf.element_size()
        kwargs.update(k=kf, v=vf)
        best = None
        for cfg, s, fn in candidates(q, k, v, configs, kf.dtype, kwargs, page_size(args.cache)):
            us = bench_graph(fn, rep=args.rep_ms)
            r = {"B": b, "T": t, "cfg": cfg, "S": s, "graph_us": us, "TBs": tbs(nbytes, us)}
            rows.append(r)
            if best is None or us < best["graph_us"]:
                best = r
        policy = lambda: flash_decode(q, **kwargs)  # noqa: E731
        plan = heuristics.decode_plan(b, hkv, t, d, q.dtype, peers.sm_count(q.device), kv_dtype=kf.dtype,
                                      page_size=page_size(args.cache))
        bests.append(dict(best, policy_cfg="x".join(map(str, plan.config)), policy_S=plan.num_splits,
                          policy_graph_us=bench_graph(policy, rep=args.rep_ms),
                          policy_call_us=bench_call(policy, rep=args.rep_ms)))
        del q, k, v, kf, vf, kwargs, policy
        torch.cuda.empty_cache()
    name = "tune_decode" + ("" if args.cache == "bf16" else f"_{args.cache}")
    name += "" if dt == torch.bfloat16 else "_float16"
    name += "" if args.heads == "32/8/128" else "_" + args.heads.replace("/", "_")
    path = write_json(name, {"config": {"configs": configs, "cache": args.cache, "dtype": args.dtype,
                                        "heads": args.heads}, "rows": rows,
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
    print(table(bests, ["B", "T", "cfg", "S", "graph_us", "TBs", "policy_cfg", "policy_S", "policy_graph_us",
                        "policy_call_us"]))


if __name__ == "__main__":
    main()
