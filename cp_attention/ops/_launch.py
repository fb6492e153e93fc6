"""Launching ``@triton.jit`` kernels with a small host cost.

Note [Kernel launch cache]
--------------------------
A decode step is microseconds of GPU work, so the host cost of a launch matters in eager mode. Triton's
``JITFunction.run`` rebuilds a string key from every argument's specialisation on every call (tens of µs
for a kernel with thirty arguments). :func:`launch` keeps the ``CompiledKernel`` that the JIT returned,
under a key that is at least as fine as the JIT's own specialisation (tensor dtype and 16-byte alignment;
for ints: equal to 1, divisible by 16, needing 64 bits; constexpr values; launch options), and calls it
directly on later launches. The first launch of each key goes through the JIT (and its disk cache).
Under ``TRITON_INTERPRET=1`` every launch goes through the JIT, which is the interpreter.
"""
from __future__ import annotations

import os

import torch

_CACHE: dict = {}
_Tensor = torch.Tensor


def _key(kernel, args, constexprs, options) -> tuple:
    # ints: divisible by 16, equal to 1, needs 64 bits; tensors: dtype and 16-byte alignment.
    spec = [(a & 15 == 0) + 2 * (a == 1) + 4 * (a > 0x7FFFFFFF or a < -0x80000000) if a.__class__ is int
            else (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, _Tensor) else a.__class__ for a in args]
    return (kernel, torch.cuda.current_device(), *spec, *constexprs.values(), *options.values())


def launch(kernel, grid, args: tuple, constexprs: dict, **options) -> None:
    """``kernel[grid](*args, **constexprs, **options)``, reusing the compiled kernel when the key matches.

    ``constexprs`` must name the kernel's trailing parameters in signature order.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        kernel[grid](*args, **constexprs, **options)
        return
    key = _key(kernel, args, constexprs, options)
    compiled = _CACHE.get(key)
    if compiled is None:
        if list(constexprs) != kernel.arg_names[len(args):]:
            raise ValueError(f"constexprs of {kernel.__name__} must follow its signature order")
        _CACHE[key] = kernel[grid](*args, **constexprs, **options)
        return
    compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *constexprs.values())
