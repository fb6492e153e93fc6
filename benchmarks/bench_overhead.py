"""Host cost of one eager decode call with the GPU idle: a tiny decode (B=1, T=256, bf16, Hq=32, Hkv=8,
D=128) whose GPU work is a few µs, so the host path sets the pace.

For each call -- flash_decode (default; with seq_lens; with return_lse=True; with a caller-owned ``out=``
tensor, without and with seq_lens) and torch SDPA (default backend selection) -- three numbers:

* ``loop_us``: wall clock of N back-to-back calls / N, one ``torch.cuda.synchronize()`` at the end: the
  throughput of the host path;
* ``call_us``: median wall time from the start of one call to its return, each call issued after a
  ``torch.cuda.synchronize()`` (the host time of one call);
* ``gpu_gap_us``: from a torch.profiler trace of 50 back-to-back calls, the mean gap between the starts of
  consecutive GPU activities (kernels, and memsets or copies if the call issues any; ``gpu_per_call``
  of them per call): with an idle GPU this is the host time per activity as the GPU sees it, profiler
  overhead included. The traces are taken after all the other timings (a profiler session slows every
  later launch of the process: benchmarks/_harness.py).

    PYTHONPATH=. python3 benchmarks/bench_overhead.py

Then the parts of one ``flash_decode(q, k, v, seq_lens)`` call (``benchmarks/_host_only.py``,
``gpu_parts``): the library's Python and allocation, Triton's C launcher with the driver's launch, and
``torch.empty``. Writes benchmarks/results/bench_overhead.json.

Without a GPU, ``--host-only`` times the library's Python part of the same call on CPU tensors made to
take the CUDA code path, with Triton's C launcher replaced by a no-op (``benchmarks/_host_only.py`` says
exactly what is and is not measured): B=1, Hq=32, Hkv=8, D=128, T=2048, bf16, µs per call of back-to-back
calls (min and median of the rounds), the stages of the call with seq_lens, and a cProfile of it. It
writes nothing.

    .venv/bin/python benchmarks/bench_overhead.py --host-only
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peers  # noqa: E402
from benchmarks._harness import gpu_activity, host_call_us, kernel_names, table, tqdm, write_json, write_tables  # noqa: E402
from cp_attention import flash_decode  # noqa: E402

PROFILED_CALLS = 50


def loop_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def gpu_gap_us(fn) -> tuple[float, int]:
    """Mean gap between consecutive GPU activity starts over PROFILED_CALLS calls, and activities per call."""
    starts = [start for _, start, _ in gpu_activity(fn, PROFILED_CALLS)]
    gap = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else float("nan")
    return gap, len(starts) // PROFILED_CALLS


def host_only(calls: int, repeats: int) -> None:
    from benchmarks import _host_only

    _host_only.cuda_path()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 128, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 2048, 128, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(k.shape, generator=gen, dtype=torch.bfloat16)
    seq_lens = torch.full((1,), 2048, dtype=torch.int32)
    out = torch.empty_like(q)
    shape, dtype, device = q.shape, q.dtype, q.device
    calls_ = {
        "flash_decode": lambda: flash_decode(q, k, v),
        "flash_decode seq_lens": lambda: flash_decode(q, k, v, seq_lens),
        "flash_decode out=": lambda: flash_decode(q, k, v, out=out),
        "flash_decode seq_lens out=": lambda: flash_decode(q, k, v, seq_lens, out=out),
        "flash_decode seq_lens return_lse": lambda: flash_decode(q, k, v, seq_lens, return_lse=True),
        "(reference) torch.empty(q.shape, dtype=, device=)": lambda: torch.empty(shape, dtype=dtype, device=device),
        "(reference) torch.empty(size=tuple(q.shape), dtype=, device=)": lambda: torch.empty(
            size=tuple(shape), dtype=dtype, device=device),
        "(reference) an empty lambda": lambda: None,
    }
    rows = [{"what": what, "min_us": lo, "median_us": med}
            for what, (lo, med) in _host_only.per_call_us(calls_, calls, repeats).items()]
    print(f"host-only (CPU, CUDA code path, no-op C launcher), {calls} calls x {repeats} repeats:")
    print(table(rows, ["what", "min_us", "median_us"]))
    print("\nstages of flash_decode(q, k, v, seq_lens) (µs per call, min over the repeats):")
    print(table(_host_only.stages((q, k, v, seq_lens), {}, calls, repeats), ["stage", "us"]))
    print("\nthe same with out=:")
    print(table(_host_only.stages((q, k, v, seq_lens), {"out": out}, calls, repeats), ["stage", "us"]))
    print("\ncProfile of 10000 calls of flash_decode(q, k, v, seq_lens) (µs per call; the profiler's own cost "
          "inflates every function it sees):")
    print(table(_host_only.profile(calls_["flash_decode seq_lens"], 10_000),
                ["function", "calls_per_call", "own_us", "cum_us"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=None,
                    help="N of the back-to-back loop (default 2000; --host-only: 3000 per round)")
    ap.add_argument("--single", type=int, default=500, help="synchronized single calls per median")
    ap.add_argument("--host-only", action="store_true", help="no GPU: time the Python part on the CPU")
    ap.add_argument("--repeats", type=int, default=21, help="--host-only: rounds of --calls calls")
    args = ap.parse_args()
    if args.host_only:
        return host_only(args.calls or 3000, args.repeats)
    args.calls = args.calls or 2000

    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, 32, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 256, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seq_lens = torch.full((1,), 256, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    calls = {
        "flash_decode": lambda: flash_decode(q, k, v),
        "flash_decode seq_lens": lambda: flash_decode(q, k, v, seq_lens),
        "flash_decode return_lse": lambda: flash_decode(q, k, v, return_lse=True),
        "flash_decode out=": lambda: flash_decode(q, k, v, out=out),
        "flash_decode seq_lens out=": lambda: flash_decode(q, k, v, seq_lens, out=out),
        "sdpa (default)": peers.sdpa_default(q, k, v),
    }

    rows = [{"what": what, "loop_us": loop_us(fn, args.calls), "call_us": host_call_us(fn, args.single)}
            for what, fn in tqdm(calls.items(), desc="host overhead")]
    from benchmarks import _host_only

    parts = _host_only.gpu_parts(q, k, v, seq_lens, args.single)
    for row, fn in zip(rows, calls.values()):  # profiled last
        row["gpu_gap_us"], row["gpu_per_call"] = gpu_gap_us(fn)
        row["kernels"] = kernel_names(fn)
    path = write_json("bench_overhead", {"config": {"B": 1, "T": 256, "Hq": 32, "Hkv": 8, "D": 128, "dtype": "bf16",
                                                    "loop_calls": args.calls, "single_calls": args.single,
                                                    "profiled_calls": PROFILED_CALLS}, "rows": rows,
                                         "parts": parts})
    for r in rows:
        print(f"{r['what']}: {r['kernels']}")
    print(f"wrote {path}")
    write_tables("bench_overhead")
    print(table(rows, ["what", "loop_us", "call_us", "gpu_gap_us", "gpu_per_call"]))
    print("\nparts of one flash_decode(q, k, v, seq_lens) call (median µs of single synchronized calls):")
    print(table(parts, ["part", "us"]))


if __name__ == "__main__":
    main()
