"""Where a computation runs: the Triton kernels (CUDA, or CPU under the interpreter) or plain torch."""
import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors run them under ``TRITON_INTERPRET=1``."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def check_tensor(name: str, t, *, dtypes=None, ndim=None, device=None) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` when ``t`` is not what is expected."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def new_buffer(shape, dtype, device) -> torch.Tensor:
    """Uninitialised buffer for a kernel to fill (tests replace this to poison outputs with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (plain Python: ``triton.cdiv`` costs microseconds per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()
