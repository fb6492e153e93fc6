"""Host time per eager call (launch overhead) of flash_decode against its parts and against torch SDPA, on
a cache so small that the GPU work is negligible: wall time of N back-to-back calls / N.

    PYTHONPATH=. python benchmarks/bench_overhead.py
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import table, write_json  # noqa: E402
from cp_attention import flash_decode  # noqa: E402
from cp_attention.decode import _validate  # noqa: E402


def per_call_us(fn, n=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def jit_launch(fn):
    """Per-call time with every launch through Triton's JITFunction (no compiled-kernel cache)."""
    import cp_attention.ops.split_kv as split_kv

    cached = split_kv.launch
    split_kv.launch = lambda kernel, grid, args, constexprs, **opt: kernel[grid](*args, **constexprs, **opt)
    try:
        return per_call_us(fn)
    finally:
        split_kv.launch = cached


def main():
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sl = torch.full((1,), 256, device="cuda", dtype=torch.int32)
    q4 = q.unsqueeze(2)
    rows = [
        {"what": "flash_decode S=1", "us": per_call_us(lambda: flash_decode(q, k, v, num_splits=1))},
        {"what": "flash_decode S=4", "us": per_call_us(lambda: flash_decode(q, k, v, num_splits=4))},
        {"what": "flash_decode S=4 + seq_lens", "us": per_call_us(lambda: flash_decode(q, k, v, sl, num_splits=4))},
        {"what": "flash_decode policy", "us": per_call_us(lambda: flash_decode(q, k, v))},
        {"what": "flash_decode S=4, Triton JIT launch", "us": jit_launch(lambda: flash_decode(q, k, v, num_splits=4))},
        {"what": "_validate", "us": per_call_us(lambda: _validate(q, k, v, None, None, None, "HND", False))},
        {"what": "torch.empty", "us": per_call_us(lambda: torch.empty(1, 32, 128, device="cuda"))},
        {"what": "torch SDPA", "us": per_call_us(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))},
    ]
    write_json("bench_overhead", {"rows": rows})
    print(table(rows, ["what", "us"]))


if __name__ == "__main__":
    main()
