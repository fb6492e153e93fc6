"""Host cost of one eager ``flash_decode`` call, measured without a GPU (``bench_overhead.py --host-only``).

What runs is the code path of a call on CUDA tensors, with four substitutions (:func:`cuda_path`):

* ``torch.Tensor.is_cuda`` is ``True`` for every tensor (a Python property instead of the C getter), so
  each ``is_cuda`` branch of the library takes its CUDA side (no value checks of index tensors, the
  Triton kernels, the prepared launches);
* ``torch.cuda.current_device()``, ``torch._C._cuda_getDevice()`` and
  ``torch._C._cuda_getCurrentRawStream(i)`` return constants (-1, -1, 0) from Python lambdas;
* a ``@triton.jit`` kernel's first launch returns a stand-in compiled kernel; every later launch goes
  through the library's direct launch as on the GPU, down to the call of the compiled kernel's ``run``
  with its argument tuple, but that ``run`` is a C callable that only takes the tuple
  (``itertools.chain``) where Triton's C launcher parses it and launches;
* the tensors live on the CPU: ``torch.empty`` runs the CPU allocator, not the CUDA caching allocator.

So it measures the library's Python and the torch calls it makes (shape, stride, dtype, device and pointer
reads, allocations), and not: Triton's C launcher and the driver's launch, the CUDA allocator's share of
``torch.empty``, or the C cost of the two CUDA runtime queries.
"""
from __future__ import annotations

import cProfile
import itertools
import pstats
import statistics
import time

import torch


class _StubCompiled:
    """A compiled kernel whose launch does nothing: ``run`` is a C callable that, like Triton's launcher (a
    C function), receives its arguments as one tuple and keeps them (``itertools.chain``)."""

    function = 0
    packed_metadata = None
    run = itertools.chain

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def cuda_path() -> None:
    """Make CPU tensors take the CUDA code path of cp_attention (see the module docstring). Irreversible:
    for a benchmark process only."""
    from triton.runtime.jit import KernelInterface  # of JIT and interpreted kernels alike

    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.current_device = lambda: -1
    torch._C._cuda_getDevice = lambda: -1
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    stub = _StubCompiled()
    KernelInterface.__getitem__ = lambda self, grid: (lambda *args, **kwargs: stub)


def per_call_us(fns: dict, calls: int, repeats: int) -> dict:
    """``{name: (min, median)}`` over ``repeats`` rounds of the mean µs per call of ``calls`` back-to-back
    calls of each function; a round times every function once, so a noisy stretch of the machine hits all
    of them (the minimum is the figure to compare; the median shows the noise)."""
    runs = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(100):
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            runs[name].append((time.perf_counter_ns() - t0) / calls / 1e3)
    return {name: (min(r), statistics.median(r)) for name, r in runs.items()}


def profile(fn, calls: int, top: int = 15) -> list[dict]:
    """cProfile of ``calls`` calls: the ``top`` functions by own time, µs per call of ``fn`` (the profiler
    adds ~0.1-0.3 µs to every function call it sees, so small functions look heavier than they are)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [{"function": f"{pstats.func_std_string(func)}", "calls_per_call": nc / calls,
             "own_us": tt / calls * 1e6, "cum_us": ct / calls * 1e6}
            for func, (_, nc, tt, ct, _) in stats.items()]
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


# Stage boundaries in cp_attention/decode.py's flash_decode (lines that start a stage), in order.
STAGES = [
    ("key + lookup", "\n    global _LAST\n"),
    ("scalar checks", "\n    # A CUDA call whose key a validated call prepared"),
    ("output (allocation)", "\n    if out is None:\n        o = _device.new_like"),
    ("stream + scratch", "\n    stream = torch._C._cuda_getCurrentRawStream(prep.cuda)\n"),
    ("launch (pointers, launcher)", "\n    if prep.launches:  # the launchers have compiled"),
]
END = "\n    if return_lse:\n        return AttentionState(o, lse_out)\n    return o\n"  # the last stage ends here


def stages(args: tuple, kwargs: dict, calls: int, repeats: int) -> list[dict]:
    """µs per call spent in each stage of ``flash_decode(*args, **kwargs)``'s prepared path: an instrumented
    copy of ``cp_attention.decode`` records ``perf_counter_ns`` at each :data:`STAGES` line (the minimum over
    ``repeats`` rounds, less a checkpoint's own cost). The last stage ends before the return; the call
    itself (binding the arguments) and the return are outside every stage."""
    import types

    import cp_attention.decode as decode

    src = open(decode.__file__).read()
    for _, line in STAGES:
        if src.count(line) != 1:
            raise RuntimeError(f"stage line not found once in {decode.__file__}: {line!r}")
        src = src.replace(line, "\n    _T(_ns())" + line)
    if src.count(END) != 1:
        raise RuntimeError(f"the end of the prepared path not found once in {decode.__file__}")
    src = src.replace(END, "\n    _T(_ns())" + END)
    marks = []
    mod = types.ModuleType(decode.__name__)
    mod.__dict__.update(__package__=decode.__package__, __file__=decode.__file__, _T=marks.append,
                        _ns=time.perf_counter_ns)
    exec(compile(src, decode.__file__, "exec"), mod.__dict__)
    mod._PREPARED, mod._SCRATCH = decode._PREPARED, decode._SCRATCH
    fn = mod.flash_decode
    fn(*args, **kwargs)
    n = len(STAGES) + 1
    best = [float("inf")] * len(STAGES)
    for _ in range(repeats):
        marks.clear()
        for _ in range(calls):
            fn(*args, **kwargs)
        if len(marks) != calls * n:
            raise RuntimeError("the call did not take the prepared path")
        sums = [sum(marks[i + j + 1] - marks[i + j] for i in range(0, len(marks), n)) for j in range(len(STAGES))]
        best = [min(b, s / calls / 1e3) for b, s in zip(best, sums)]
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        marks.append(time.perf_counter_ns())
    own = (time.perf_counter_ns() - t0) / calls / 1e3
    return [{"stage": name, "us": b - own} for (name, _), b in zip(STAGES, best)]


def gpu_parts(q, k, v, seq_lens, calls: int) -> list[dict]:
    """On the GPU: where the host time of ``flash_decode(q, k, v, seq_lens)`` goes, each part the median
    of ``calls`` single calls issued after a ``torch.cuda.synchronize()``. Reads the library's prepared
    launch (a diagnostic, not an API): the whole call; the call with the launch replaced by a C callable
    that only takes its argument tuple (the library's part, CUDA allocation and queries included); the
    launch alone as the library makes it and through Triton's ``run`` (its Python wrapper, its C launcher
    and the driver); ``torch.empty_like`` as the library allocates, and ``torch.empty`` with a tuple and with
    a positional ``torch.Size`` for comparison."""
    from benchmarks._harness import host_call_us
    from cp_attention import decode, flash_decode

    def median_us(fn):
        return host_call_us(fn, calls, warmup=20)

    def call():
        return flash_decode(q, k, v, seq_lens)

    call()
    call()  # a prepared call: it leaves its launch in decode._LAST
    launcher = decode._LAST[1].launcher
    whole = median_us(call)
    direct = launcher.call
    launcher.call = itertools.chain
    try:
        library = median_us(call)
    finally:
        launcher.call = direct
    compiled, o = launcher.compiled, torch.empty_like(q)
    scratch = next(s for (dev, stream), s in decode._SCRATCH.items() if dev == q.get_device())
    stream = torch._C._cuda_getCurrentRawStream(q.get_device())
    qp = q.data_ptr()
    work, lse = scratch.ptrs
    args = (qp, k.data_ptr(), v.data_ptr(), seq_lens.data_ptr(), qp, qp, qp, qp, qp, o.data_ptr(), lse, work,
            q.shape[-1] ** -0.5, 1.0, 1.0, 1.0) + launcher.tail
    grid = launcher.grid + (stream,)
    triton_args = grid + (compiled.function, compiled.packed_metadata, None, None, None) + args
    shape, size = q.shape, tuple(q.shape)
    return [{"part": "flash_decode(q, k, v, seq_lens)", "us": whole},
            {"part": "  the library (the launch replaced by a no-op)", "us": library},
            {"part": "  the launch as the library makes it", "us": median_us(
                lambda: direct(*(grid + launcher.fixed + args)))},
            {"part": "the launch through Triton's run (wrapper, C launcher, driver)", "us": median_us(
                lambda: compiled.run(*triton_args))},
            {"part": "torch.empty_like(q) (the library's allocation)", "us": median_us(lambda: torch.empty_like(q))},
            {"part": "torch.empty(size=tuple, dtype=, device=)", "us": median_us(
                lambda: torch.empty(size=size, dtype=q.dtype, device=q.device))},
            {"part": "torch.empty(torch.Size, dtype=, device=) (a positional shape)", "us": median_us(
                lambda: torch.empty(shape, dtype=q.dtype, device=q.device))}]
