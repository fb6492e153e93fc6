"""Where a computation runs (the Triton kernels, or plain torch) and the buffers kernels fill."""
import os

import torch

# Tests set this to True: every buffer a kernel is meant to fill then starts as NaN, so an element the
# kernel leaves unwritten fails the test. Read at every allocation, so it holds whatever way the
# allocating module imported this one.
POISON_OUTPUTS = False


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors run them under ``TRITON_INTERPRET=1``."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def new_buffer(shape, dtype, device) -> torch.Tensor:
    """Uninitialised buffer for a kernel to fill (NaN-filled when :data:`POISON_OUTPUTS` is set)."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    # size= as a keyword: torch parses a positional shape ~1-3 µs slower (CPU, torch 2.13)
    return torch.empty(size=shape, dtype=dtype, device=device)


def new_like(t: torch.Tensor) -> torch.Tensor:
    """:func:`new_buffer` of ``t``'s shape, dtype, device and, for a dense ``t``, strides
    (``torch.empty_like``: the cheapest allocation call, 0.5 µs under ``torch.empty`` on the H200)."""
    if POISON_OUTPUTS:
        return torch.full_like(t, float("nan"))
    return torch.empty_like(t)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (plain Python: ``triton.cdiv`` costs microseconds per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()
