"""Shared timing and reporting for the benchmark scripts: medians from triton.testing.do_bench (L2 flushed
before every call), eager and replayed from a CUDA graph; results as JSON + PNG under benchmarks/results/."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
READ_CEILING_TBS = 4.47  # measured HBM read ceiling of the H200 (Triton streaming read, 4 GB)


def bench_eager(fn, rep_ms: int = 100) -> float:
    """Median µs of ``fn()``."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def capture(fn):
    """Capture ``fn()`` (warmed up on a side stream) into a CUDA graph; returns the graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def bench_graph(fn, rep_ms: int = 100) -> float:
    """Median µs of one replay of a CUDA graph holding ``fn()``."""
    g = capture(fn)
    return bench_eager(g.replay, rep_ms)


def environment() -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, gpus=torch.cuda.device_count())
    return env


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=1))
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    """A plain fixed-width table of ``rows`` (dicts) over ``cols``."""
    def fmt(x):
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)
