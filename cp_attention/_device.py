"""Device facts, read in one place: whether a tensor runs the Triton kernels (or the interpreter), the SM count,
programmatic dependent launch and sm_90; and the buffers kernels fill."""
from __future__ import annotations

import os

import torch

# CPU tensors (the Triton interpreter) are planned as for the H200 the defaults were tuned on, so the
# interpreter runs the split layouts the GPU runs.
REFERENCE_SMS = 132

# Tests set this to True: every buffer a kernel is meant to fill then starts as NaN, so an element the
# kernel leaves unwritten fails the test. Read at every allocation, so it holds whatever way the
# allocating module imported this one.
POISON_OUTPUTS = False

_NUM_SMS: dict = {}
_PDL: dict = {}
_SM90: dict = {}
_INTERPRETED: list = [None]  # whether triton's own @jit functions were made interpreted (set at first need)


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (``TRITON_INTERPRET=1``), read at every call.

    Triton makes its ``@triton.jit`` functions (its own library's among them) interpreted or compiled when
    it defines them, at import: the flag turned on after ``triton`` was imported without it (directly, or by
    ``torch.compile`` or ``cp_attention.distributed``) cannot run them, and raises ``RuntimeError``."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if _INTERPRETED[0] is None:
        from triton.language import standard
        from triton.runtime.jit import JITFunction

        _INTERPRETED[0] = not isinstance(getattr(standard, "cdiv", None), JITFunction)
    if not _INTERPRETED[0]:
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported without it (by your code, "
                           "torch.compile or cp_attention.distributed): Triton's functions are compiled ones, "
                           "which the interpreter cannot run; set it before the process imports triton (e.g. in "
                           "the environment it starts with), or unset it for the CPU torch path")
    return True


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors run them under ``TRITON_INTERPRET=1``, else the torch path."""
    return t.is_cuda or interpreting()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached); :data:`REFERENCE_SMS` for other devices."""
    if device.type != "cuda":
        return REFERENCE_SMS
    n = _NUM_SMS.get(device)
    if n is None:
        n = _NUM_SMS[device] = torch.cuda.get_device_properties(_index(device)).multi_processor_count
    return n


def use_pdl(device: torch.device) -> bool:
    """Whether kernels are launched with programmatic dependent launch on ``device`` (Note [Programmatic
    dependent launch] in ``ops/split_kv.py``): CUDA devices of compute capability 9.0 or more, unless the
    environment sets ``CP_ATTENTION_PDL=0`` (read once per device); never under the Triton interpreter."""
    if device.type != "cuda" or interpreting():
        return False
    use = _PDL.get(device)
    if use is None:
        use = _PDL[device] = (torch.cuda.get_device_capability(_index(device))[0] >= 9
                              and os.environ.get("CP_ATTENTION_PDL", "1") != "0")
    return use


def sm90(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device of compute capability 9.x (the Gluon kernels' target), unless the
    environment sets ``CP_ATTENTION_ONE_WARP=0`` (read once per device); never under the Triton interpreter."""
    if device.type != "cuda" or interpreting():
        return False
    use = _SM90.get(device)
    if use is None:
        use = _SM90[device] = (torch.cuda.get_device_capability(_index(device))[0] == 9
                               and os.environ.get("CP_ATTENTION_ONE_WARP", "1") != "0")
    return use


def new_buffer(shape, dtype, device) -> torch.Tensor:
    """Uninitialised buffer for a kernel to fill (NaN-filled when :data:`POISON_OUTPUTS` is set)."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    # size= as a keyword: torch parses a positional shape ~1-3 µs slower (docs/performance.md, host time)
    return torch.empty(size=shape, dtype=dtype, device=device)


def new_like(t: torch.Tensor) -> torch.Tensor:
    """:func:`new_buffer` of ``t``'s shape, dtype, device and, for a dense ``t``, strides
    (``torch.empty_like``: the cheapest allocation call)."""
    if POISON_OUTPUTS:
        return torch.full_like(t, float("nan"))
    return torch.empty_like(t)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (plain Python: ``triton.cdiv`` costs microseconds per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()
