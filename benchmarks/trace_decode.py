"""Where the time of a graphed decode call goes: the GPU kernels of a CUDA graph of 20 calls, from a
torch.profiler trace of one replay, for cp_attention and its peers.

Per case (implementation, B x T, heads Hq/Hkv/D): the graph's µs per call (``bench_graph``, as the other
benchmarks time it), then one profiled replay (L2 flushed before it): per kernel name, its mean duration;
per call, the sum of kernel durations ("busy") and the rest of the replay's span ("gaps": launch latency
between dependent kernels, idle SMs in between). What PDL or fewer kernels could recover is in the gaps;
what a faster kernel could recover is in busy.

    PYTHONPATH=. python3 benchmarks/trace_decode.py --cases cp_attention:1x8192 sdpa_default:1x8192:28/4/128
    PYTHONPATH=. python3 benchmarks/trace_decode.py --eager 3 --cases cp_attention_fp8:1x131072   # under ncu

``--eager N`` only runs N eager calls of each case (after one warm-up call that compiles), for a profiler
such as Nsight Compute to attach to; nothing is timed or written. Otherwise writes
benchmarks/results/<name>.json.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peers  # noqa: E402
from benchmarks._harness import GRAPH_CALLS, bench_graph, capture, table, tqdm, write_json  # noqa: E402
from cp_attention import flash_decode  # noqa: E402

def cp_attention_det(q, k, v):
    """flash_decode with deterministic splits as many as the policy's (``split_size`` = T / S rounded up to
    128): the split kernel, then the combine kernel of deterministic splits."""
    s = peers.cp_splits(q, k)
    size = (-(-k.shape[2] // s) + 127) // 128 * 128
    return lambda: flash_decode(q, k, v, split_size=size)


IMPLS = {
    "cp_attention": peers.cp_attention,
    "cp_attention_det": cp_attention_det,
    "cp_attention_fp8": peers.cp_attention_fp8,
    "cp_attention_paged16": functools.partial(peers.cp_attention_paged, page_size=16),
    "cp_attention_paged64": functools.partial(peers.cp_attention_paged, page_size=64),
    "sdpa_default": peers.sdpa_default,
}


def parse_case(s: str) -> dict:
    """``IMPL:BxT[:HQ/HKV/D]`` -> a case dict (heads default 32/8/128)."""
    parts = s.split(":")
    if len(parts) not in (2, 3) or parts[0] not in IMPLS:
        raise argparse.ArgumentTypeError(f"expected IMPL:BxT[:HQ/HKV/D] with IMPL in {sorted(IMPLS)}, got {s!r}")
    b, t = map(int, parts[1].split("x"))
    hq, hkv, d = map(int, (parts[2] if len(parts) == 3 else "32/8/128").split("/"))
    return {"impl": parts[0], "B": b, "T": t, "heads": f"{hq}/{hkv}/{d}", "Hq": hq, "Hkv": hkv, "D": d}


def build(case: dict, dtype):
    gen = torch.Generator("cuda").manual_seed(0)
    b, t, hq, hkv, d = case["B"], case["T"], case["Hq"], case["Hkv"], case["D"]
    q = torch.randn(b, hq, d, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dtype)
    return IMPLS[case["impl"]](q, k, v)


def replay_kernels(graph, calls: int) -> dict:
    """Kernels of one profiled replay of ``graph`` (``calls`` calls): per name its count per call and mean
    µs; per call the busy µs (sum of durations) and the gaps (span minus busy)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    graph.replay()
    flush.zero_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    ev = sorted((e.time_range.start, e.time_range.elapsed_us(), e.name) for e in prof.events()
                if e.device_type == DeviceType.CUDA)
    if not ev:
        return {"kernels": {}, "busy_us": float("nan"), "gaps_us": float("nan")}
    per = {}
    for _, dur, name in ev:
        per.setdefault(name, []).append(dur)
    span = max(s + d for s, d, _ in ev) - ev[0][0]
    busy = sum(d for _, d, _ in ev)
    return {"kernels": {n: {"per_call": len(ds) / calls, "mean_us": sum(ds) / len(ds)} for n, ds in per.items()},
            "busy_us": busy / calls, "gaps_us": (span - busy) / calls}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", type=parse_case, required=True, metavar="IMPL:BxT[:HQ/HKV/D]")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--eager", type=int, default=0, metavar="N", help="only run N eager calls per case (profilers)")
    ap.add_argument("--name", default="trace_decode")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.eager:
        for case in args.cases:
            fn = build(case, dtype)
            fn()
            torch.cuda.synchronize()
            for _ in range(args.eager):
                fn()
            torch.cuda.synchronize()
            del fn
            torch.cuda.empty_cache()
        return
    rows, graphs = [], []
    for case in tqdm(args.cases, desc="cases"):
        fn = build(case, dtype)
        row = dict(case, graph_us=bench_graph(fn))
        graphs.append((row, fn))
        rows.append(row)
    # Profile last: a profiler session slows later host launches (benchmarks/_harness.py).
    for row, fn in graphs:
        graph = capture(fn, GRAPH_CALLS)
        row.update(replay_kernels(graph, GRAPH_CALLS))
        del graph
    path = write_json(args.name, {"rows": [{k: v for k, v in r.items()} for r in rows]})
    flat = []
    for r in rows:
        for i, (name, k) in enumerate(r["kernels"].items()):
            flat.append({"case": f"{r['impl']} {r['B']}x{r['T']} {r['heads']}" if i == 0 else "",
                         "graph_us": r["graph_us"] if i == 0 else "", "busy_us": r["busy_us"] if i == 0 else "",
                         "gaps_us": r["gaps_us"] if i == 0 else "", "kernel": name[:60],
                         "per_call": k["per_call"], "mean_us": k["mean_us"]})
    print(table(flat, ["case", "graph_us", "busy_us", "gaps_us", "kernel", "per_call", "mean_us"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
