"""The one place for what every benchmark script shares: timing, CUDA-graph capture, the reference read rate,
dtypes, tolerances, output comparison, the kernels a call launches, JSON results, the text table, and the
tables of docs/performance.md written from the JSON (:func:`write_tables`).

Timing (all medians from ``triton.testing.do_bench``, which flushes the L2 with a 256 MB memset before
every timed run; at least :data:`MIN_RUNS` timed runs each):

* **per call** (:func:`bench_call`): one eager ``fn()`` per timed run. Host time that fits under the
  preceding flush is hidden, so this is close to GPU time unless the host path is slower than the flush.
* **graph** (:func:`bench_graph`): :data:`GRAPH_CALLS` calls of ``fn`` captured in one
  ``torch.cuda.CUDAGraph`` (:func:`capture`), one replay per timed run, divided by :data:`GRAPH_CALLS`.
  The L2 is flushed before each replay only: within a replay, calls after the first find in the L2
  whatever of their inputs it still holds (all of it when K+V is below the L2 size, ``l2_MB`` in
  :func:`environment`).

Profile last: after a torch.profiler session every later kernel launch of the process costs more host
time (H200, torch 2.11: an eager SDPA call went from 17 to 46 µs), so :func:`gpu_activity` and
:func:`kernel_names` run after all the timings of a script.
"""
from __future__ import annotations

import datetime
import functools
import gc
import hashlib
import json
import math
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
import triton
import triton.testing
from tqdm import tqdm  # noqa: F401  (the progress bar of every script)

RESULTS = Path(__file__).resolve().parent / "results"
# References for TB/s by GPU name (read_references): the datasheet's HBM bandwidth, and what a plain Triton
# streaming read of 4 GB reached where it was measured (not a ceiling: the best decode kernels read faster)
HBM_PEAK_TBS = {"H100 80GB HBM3": 3.35, "H200": 4.8}
STREAM_READ_TBS = {"H200": 4.47}
GRAPH_CALLS = 20  # calls captured in one CUDA graph by bench_graph
MIN_RUNS = 25  # timed runs behind every median, however long one run takes


@functools.cache
def read_references(gpu: str | None = None) -> dict:
    """``{"hbm_peak_TBs", "stream_read_TBs"}`` of the GPU named ``gpu`` (default: device 0's name), ``None``
    where this file holds no figure for it."""
    if gpu is None:
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""

    def pick(table):
        return next((v for k, v in table.items() if k in gpu), None)

    return {"hbm_peak_TBs": pick(HBM_PEAK_TBS), "stream_read_TBs": pick(STREAM_READ_TBS)}


def draw_references(ax, refs: dict) -> None:
    """Dashed lines at the known TB/s references ``refs`` (:func:`read_references`) of a plot's GPU."""
    if refs.get("hbm_peak_TBs"):
        ax.axhline(refs["hbm_peak_TBs"], color="k", lw=0.8, ls="-.", label=f"HBM peak {refs['hbm_peak_TBs']} TB/s")
    if refs.get("stream_read_TBs"):
        ax.axhline(refs["stream_read_TBs"], color="k", lw=0.8, ls="--",
                   label=f"Triton streaming read {refs['stream_read_TBs']} TB/s")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
# Largest max |o - o_cp_attention| counted as agreement, by the dtype of the compared cache (bf16 as the
# tests' tolerance against the float64 oracle; fp8 includes the quantization error of the peer's cache).
TOLERANCES = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float8_e4m3fn: 1e-1}


def bench_call(fn, warmup: int = 25, rep: int = 100, min_runs: int = MIN_RUNS) -> float:
    """Median µs of one eager ``fn()`` (L2 flushed before each) over ``rep`` ms of timed runs, and at least
    ``min_runs`` of them (``do_bench`` fits its count to ``rep``: a 40 ms call would get 2)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est_ms = (time.perf_counter() - t0) * 1e3
    rep = max(rep, math.ceil(1.2 * min_runs * est_ms))
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def host_call_us(fn, n: int, warmup: int = 0) -> float:
    """Median µs from the start of one ``fn()`` to its return, each of ``n`` calls issued after a
    ``torch.cuda.synchronize()`` (the host time of one call with the GPU idle), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def capture(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph holding ``calls`` back-to-back calls of ``fn``, captured after three warm-up calls on a
    side stream (lazy initialisation and JIT compiles happen there, outside the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph


def bench_graph(fn, calls: int = GRAPH_CALLS, warmup: int = 25, rep: int = 100) -> float:
    """Median µs per call of ``fn`` replayed from a graph of ``calls`` calls (L2 flushed before each replay)."""
    graph = capture(fn, calls)
    us = bench_call(graph.replay, warmup, rep) / calls
    del graph
    torch.cuda.empty_cache()
    return us


def tbs(nbytes: float, us: float) -> float:
    """TB/s of ``nbytes`` moved in ``us`` µs."""
    return nbytes / us / 1e6


def max_abs_diff(out: torch.Tensor, ref: torch.Tensor) -> float | str:
    """max |out - ref| over ``ref``'s shape, or ``"non-finite"`` when ``out`` holds a NaN or an inf."""
    out = out.reshape(ref.shape).float()
    if not torch.isfinite(out).all():
        return "non-finite"
    return float((out - ref.float()).abs().max())


def measure(row: dict, name: str, build, ref=None, where: str = "") -> None:
    """``fn = build()``; ``max |fn() - ref|`` into ``row[name + "_maxdiff"]`` (when ``ref`` is given); its µs
    per call and per call in a graph into ``row[name + "_call_us"]`` and ``row[name + "_graph_us"]``. A
    failure is recorded in ``row[name + "_error"]`` (and printed with ``where``), never raised, so one
    failing implementation does not lose the others' numbers; the implementation's memory is freed after."""
    fn = None
    try:
        fn = build()
        out = fn()
        if ref is not None:
            row[f"{name}_maxdiff"] = max_abs_diff(out, ref)
        del out
        row[f"{name}_call_us"] = bench_call(fn)
        row[f"{name}_graph_us"] = bench_graph(fn)
    except Exception as e:  # noqa: BLE001 - recorded, see the docstring
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:400]
        tqdm.write(f"[{where}] {name}: {row[f'{name}_error']}", file=sys.stderr)
    finally:
        del fn
        gc.collect()
        torch.cuda.empty_cache()


def gpu_activity(fn, calls: int = 1) -> list[tuple[str, float, float]]:
    """``(name, start µs, duration µs)`` of every GPU activity (kernels, memsets, copies) that ``calls``
    eager calls of ``fn`` launch, in start order, from a torch.profiler trace (``fn`` runs once first).
    Slows every later launch of the process: call it after the timings (module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
              if e.device_type == DeviceType.CUDA]
    return sorted(events, key=lambda e: e[1])


def kernel_names(fn) -> list[str]:
    """Names of the GPU kernels (and memsets/copies) one eager call of ``fn`` launches, in order."""
    return [name for name, _, _ in gpu_activity(fn)]


def source_sha() -> str:
    """SHA-256 (first 12 hex digits) of the library's source files, so a result names the code it measured
    (a copy of the working tree may carry no, or a stale, git history)."""
    h = hashlib.sha256()
    for path in sorted((RESULTS.parent.parent / "cp_attention").rglob("*.py")):
        h.update(path.relative_to(RESULTS.parent.parent).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def environment() -> dict:
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
           "torch": torch.__version__, "triton": triton.__version__, "cp_attention_sha": source_sha(),
           "page_order": "scattered (a random permutation of the pool)"}  # benchmarks/peers.py, paged()
    try:
        env["flashinfer"] = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, gpus=torch.cuda.device_count(),
                   memory_GB=round(p.total_memory / 1e9, 1))
        l2 = getattr(p, "L2_cache_size", None)
        if l2:
            env["l2_MB"] = round(l2 / 2**20, 1)
    return env


def write_json(name: str, payload: dict) -> Path:
    """``benchmarks/results/<name>.json``: ``{"environment": ..., **payload}``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=1, default=str))
    return path


def write_tables(name: str) -> None:
    """Rewrite the tables drawn from ``benchmarks/results/<name>.json`` in docs/performance.md and README.md
    (``benchmarks/tables.py``; ``python -m benchmarks.tables`` rewrites them all without a GPU)."""
    from benchmarks import tables

    for doc in tables.update(name):
        print(f"rewrote the {name} tables of {doc.relative_to(tables.ROOT)}")


def fmt(x) -> str:
    """A table cell: floats with 3 significant digits below 10, one decimal above."""
    if x is None:
        return ""
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def table(rows: list[dict], cols: list[str]) -> str:
    """A fixed-width text table of ``rows`` (dicts) over the columns of ``cols`` that some row has."""
    cols = [c for c in cols if any(c in r for r in rows)]
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
