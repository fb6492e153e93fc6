"""Launching ``@triton.jit`` kernels with a small host cost.

Note [Kernel launch cache]
--------------------------
A decode step is microseconds of GPU work, so the host cost of a launch matters in eager mode. Triton's
``JITFunction.run`` rebuilds a key from every argument's specialisation on every call (tens of µs for a
kernel with thirty arguments). A :class:`Launcher` is bound to one kernel, grid, constexprs and launch
options; its first call goes through the JIT (and its disk cache) and keeps the ``CompiledKernel``; later
calls hand the arguments straight to the compiled kernel's launcher on the current stream, with two
savings measured on the H200 with Triton 3.6 (14 µs per launch before, see benchmarks/NOTES.md):

* tensors are passed as their ``data_ptr()`` ints: for a tensor the launcher calls ``data_ptr`` and then
  ``cuPointerGetAttribute`` (a driver call) per pointer argument, for an int neither;
* no launch metadata is built and no hooks are passed while no launch hook is registered (Triton builds
  them on every launch because its hook chains are never ``None``); with a hook registered (a profiler)
  launches take Triton's own path.

This is only valid while the arguments specialise as they did on the first call: pointers with the same
16-byte alignment, ints with the same "equal to 1", "divisible by 16" and "needs 64 bits" properties.
Callers guarantee it by keying their launchers on everything that decides those properties (shapes,
strides, dtypes, pointer alignment): :func:`specialization` computes the key of one argument list.
Under ``TRITON_INTERPRET=1`` every launch goes through the JIT, which is the interpreter.
"""
from __future__ import annotations

import os

import torch
from triton import knobs

_Tensor = torch.Tensor


def _hooks_registered() -> bool:
    rt = knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def specialization(args) -> tuple:
    """What Triton specialises a launch on: ints (divisible by 16, equal to 1, needing 64 bits), tensors
    (dtype, 16-byte alignment), and the type of anything else."""
    return tuple((a & 15 == 0) + 2 * (a == 1) + 4 * (a > 0x7FFFFFFF or a < -0x80000000) if a.__class__ is int
                 else (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, _Tensor) else a.__class__ for a in args)


class Launcher:
    """``kernel[grid](*args, **constexprs, **options)`` bound once, cheap to call again (see the Note)."""

    __slots__ = ("kernel", "grid", "constexprs", "options", "compiled", "device", "tensors", "tail")

    def __init__(self, kernel, grid, constexprs: dict, *, device: int | None = None, **options):
        if list(constexprs) != kernel.arg_names[len(kernel.arg_names) - len(constexprs):]:
            raise ValueError(f"constexprs of {kernel.__name__} must be its trailing parameters in order")
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = constexprs
        self.options = options
        self.compiled = None
        self.device = device  # CUDA device index of the tensors (None: the interpreter)
        self.tensors = ()  # positions of the tensor arguments
        self.tail = tuple(constexprs.values())

    def __call__(self, *args) -> None:
        compiled = self.compiled
        if self.device is None:  # the interpreter
            self.kernel[self.grid](*args, **self.constexprs, **self.options)
            return
        if torch.cuda.current_device() != self.device:
            with torch.cuda.device(self.device):
                return self(*args)
        if compiled is None:
            self.compiled = self.kernel[self.grid](*args, **self.constexprs, **self.options)
            self.tensors = tuple(i for i, a in enumerate(args) if isinstance(a, _Tensor))
            return
        if self.tensors is None or _hooks_registered():  # profilers see Triton's own launch path
            compiled[self.grid](*args, *self.tail)
            return
        ptrs = list(args)
        for i in self.tensors:
            ptrs[i] = ptrs[i].data_ptr()
        stream = torch._C._cuda_getCurrentRawStream(self.device)
        try:
            compiled.run(*self.grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *ptrs, *self.tail)
        except TypeError:  # a Triton whose launcher takes other arguments: its own path from now on
            self.tensors = None
            compiled[self.grid](*args, *self.tail)


_CACHE: dict = {}


def launch(kernel, grid, args: tuple, constexprs: dict, **options) -> None:
    """``kernel[grid](*args, **constexprs, **options)`` through a :class:`Launcher` cached under the
    arguments' specialisation, the grid, the constexprs and the options.

    ``constexprs`` must name the kernel's trailing parameters in signature order.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        kernel[grid](*args, **constexprs, **options)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, tuple(grid), specialization(args), *constexprs.values(), *options.values())
    runner = _CACHE.get(key)
    if runner is None:
        runner = _CACHE[key] = Launcher(kernel, grid, constexprs, device=device, **options)
    runner(*args)
