"""``tl.dot`` as every kernel here calls it, and its per-dtype flags.

fp32 inputs use ``input_precision="ieee"`` (exact fp32 products, as the float64-oracle tests expect);
fp16/bf16 use the tensor cores. Triton's interpreter (3.9) multiplies bf16 tiles as raw integers, so
under ``TRITON_INTERPRET=1`` bf16 tiles are widened to fp32 first (exact: every bf16 value is an fp32
value); compiled kernels keep the native bf16 ``mma``.
"""
import torch
import triton
import triton.language as tl

from .._device import interpreting


@triton.jit
def dot(a, b, acc, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


def dot_flags(dtype: torch.dtype) -> dict:
    """The ``INPUT_PRECISION``/``UPCAST`` constexprs for tiles of ``dtype``."""
    return {
        "INPUT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST": dtype == torch.bfloat16 and interpreting(),
    }
