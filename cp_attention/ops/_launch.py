"""Launching ``@triton.jit`` kernels with a small host cost.

Note [Kernel launch cache]
--------------------------
A decode step is microseconds of GPU work, so the host cost of a launch matters in eager mode. Triton's
``JITFunction.run`` rebuilds a key from every argument's specialisation on every call (tens of µs for a
kernel with thirty arguments). A :class:`Launcher` is bound to one kernel, grid, constexprs and launch
options; its first call goes through the JIT (and its disk cache) and keeps the ``CompiledKernel``; later
calls hand the arguments straight to the compiled kernel's launcher on the current stream, with two
savings (Triton 3.6; the H200 figures are in docs/tuning.md):

* tensors are passed as their ``data_ptr()`` ints: for a tensor the launcher calls ``data_ptr`` and then
  ``cuPointerGetAttribute`` (a driver call) per pointer argument, for an int neither;
* no launch metadata is built and no hooks are passed while no launch hook is registered (Triton builds
  them on every launch because its hook chains are never ``None``); with a hook registered (a profiler)
  launches take Triton's own path.

This is only valid while the arguments specialise as they did on the first call: pointers with the same
16-byte alignment, ints with the same "equal to 1", "divisible by 16" and "needs 64 bits" properties.
Callers guarantee it by keying their launchers on everything that decides those properties (shapes,
strides, dtypes, pointer alignment): :func:`specialization` computes the key of one argument list.
Integer arguments that are the same at every launch of a launcher (sizes, strides) are bound to it once
(``static``); a caller that already holds the tensors' pointers (``flash_decode`` reads them for its key)
passes them to :meth:`Launcher.launch_ptrs`. Under ``TRITON_INTERPRET=1`` every launch goes through the
JIT, which is the interpreter.
"""
from __future__ import annotations

import functools
import inspect
import types

import torch
from triton import knobs

from .._device import interpreting

_Tensor = torch.Tensor


def _hooks_registered() -> bool:
    """A launch hook is registered: a hook chain with calls, or (older Triton) a callable."""
    rt = knobs.runtime
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    try:
        return bool(enter.calls or exit_.calls)
    except AttributeError:  # None, or a plain callable
        return any(h is not None and getattr(h, "calls", True) for h in (enter, exit_))


def specialization(args) -> tuple:
    """What Triton specialises a launch on: ints (divisible by 16, equal to 1, needing 64 bits), tensors
    (dtype, 16-byte alignment), and the type of anything else."""
    return tuple((a & 15 == 0) + 2 * (a == 1) + 4 * (a > 0x7FFFFFFF or a < -0x80000000) if a.__class__ is int
                 else (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, _Tensor) else a.__class__ for a in args)


@functools.lru_cache(maxsize=None)
def _launches_plainly(launcher_cls) -> bool:
    """Whether a compiled kernel's ``run`` of class ``launcher_cls`` is a Python wrapper that only allocates
    the scratch buffers the kernel asks for (none when their sizes are 0) and then calls its C ``launch``
    with the launch flags in between (Triton 3.6's ``CudaLauncher``): read from its source."""
    try:
        src = "".join(inspect.getsource(launcher_cls.__call__).split())
    except (AttributeError, OSError, TypeError):
        return False
    return "ifsize>0:" in src and src.endswith(
        "self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,"
        "global_scratch,profile_scratch,*args)")


def _direct_call(compiled) -> tuple:
    """``(call, fixed)``: ``call(*grid, stream, *fixed, *args)`` launches ``compiled`` with its kernel
    arguments ``args``. Skips the Python wrapper of Triton's C launcher when it has nothing to do (no
    scratch buffers): about 1 µs of a launch's host time on the H200 (docs/tuning.md)."""
    run = compiled.run
    launch = getattr(run, "launch", None)
    if (isinstance(launch, types.BuiltinFunctionType) and _launches_plainly(type(run))
            and run.global_scratch_size == 0 and run.profile_scratch_size == 0):
        return launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                        compiled.packed_metadata, None, None, None)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


class Launcher:
    """``kernel[grid](*args, *static, **constexprs, **options)`` bound once, cheap to call again (see the
    Note). ``static``: trailing runtime arguments fixed for every launch (strides, sizes)."""

    __slots__ = ("kernel", "grid", "constexprs", "options", "compiled", "device", "tensors", "static", "tail",
                 "call", "fixed", "guard")

    def __init__(self, kernel, grid, constexprs: dict, *, device: int | None = None, static: tuple = (), **options):
        if list(constexprs) != kernel.arg_names[len(kernel.arg_names) - len(constexprs):]:
            raise ValueError(f"constexprs of {kernel.__name__} must be its trailing parameters in order")
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = constexprs
        self.options = options
        self.compiled = None
        self.device = device  # CUDA device index of the tensors (None: the interpreter)
        self.tensors = ()  # positions of the tensor arguments; None: Triton's own launch path only
        self.static = tuple(static)
        self.tail = self.static + tuple(constexprs.values())  # what the compiled launcher takes after args
        self.call = self.fixed = None  # _direct_call of the compiled kernel
        self.guard = True  # whether launch_ptrs checks the current device (not with one visible GPU)

    def __call__(self, *args) -> None:
        """Launch with ``args`` (tensors as tensors), then the static arguments, on the current stream."""
        if self.device is None:  # the interpreter
            self.kernel[self.grid](*args, *self.static, **self.constexprs, **self.options)
            return
        if torch._C._cuda_getDevice() != self.device:
            with torch.cuda.device(self.device):
                return self(*args)
        if self.compiled is None:
            compiled = self.kernel[self.grid](*args, *self.static, **self.constexprs, **self.options)
            self.call, self.fixed = _direct_call(compiled)
            self.guard = torch.cuda.device_count() > 1
            self.tensors = tuple(i for i, a in enumerate(args) if isinstance(a, _Tensor))
            self.compiled = compiled
            return
        if self.tensors is None or _hooks_registered():
            self.compiled[self.grid](*args, *self.tail)
            return
        ptrs = list(args)
        for i in self.tensors:
            ptrs[i] = ptrs[i].data_ptr()
        self.launch_ptrs(torch._C._cuda_getCurrentRawStream(self.device), tuple(ptrs))

    def launch_ptrs(self, stream: int, args: tuple) -> None:
        """A launch after the first: ``args`` as in :meth:`__call__` but every tensor given as its
        ``data_ptr()``, on ``stream`` (the current stream of the launcher's device), straight through the
        compiled kernel's launcher; Triton's own path while a launch hook is registered."""
        c = self.compiled
        if c is None:
            raise RuntimeError(f"{self.kernel.__name__}: the first launch takes tensors (it compiles the kernel)")
        if self.guard and torch._C._cuda_getDevice() != self.device:
            with torch.cuda.device(self.device):
                return self.launch_ptrs(stream, args)
        if self.tensors is None or _hooks_registered():  # profilers see Triton's own launch path
            c[self.grid](*args, *self.tail)
            return
        try:  # one tuple for the launcher's arguments: concatenation builds it faster than star arguments
            self.call(*(self.grid + (stream,) + self.fixed + args + self.tail))
        except TypeError:  # a Triton whose launcher takes other arguments: its own path from now on
            self.tensors = None
            c[self.grid](*args, *self.tail)


def pdl_options(pdl: bool, **options) -> dict:
    """Launch ``options``, plus Triton's ``launch_pdl`` when ``pdl`` (programmatic dependent launch; the key
    is left out otherwise, as Triton's default)."""
    return {**options, "launch_pdl": True} if pdl else options


_CACHE: dict = {}


def launch(kernel, grid, args: tuple, constexprs: dict, **options) -> None:
    """``kernel[grid](*args, **constexprs, **options)`` through a :class:`Launcher` cached under the
    arguments' specialisation, the grid, the constexprs and the options.

    ``constexprs`` must name the kernel's trailing parameters in signature order.
    """
    if interpreting():
        kernel[grid](*args, **constexprs, **options)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, tuple(grid), specialization(args), *constexprs.values(), *options.values())
    runner = _CACHE.get(key)
    if runner is None:
        runner = _CACHE[key] = Launcher(kernel, grid, constexprs, device=device, **options)
    runner(*args)
