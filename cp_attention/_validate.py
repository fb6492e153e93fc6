"""Argument checks shared by every public function: each raises ``TypeError``/``ValueError`` naming the
argument and what was expected, before any kernel runs."""
from __future__ import annotations

import math
import numbers

import torch

from ._constants import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, t, *, dtypes=None, ndim=None, device=None) -> None:
    """``t`` is a tensor with a dtype in ``dtypes``, ``ndim`` dims and on ``device`` (each if given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {_dtype_name(t.dtype)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """The last dim of ``t`` is contiguous (the kernels load rows of ``D`` with 16-byte accesses)."""
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def check_head_dim(d: int, name: str = "q") -> None:
    if d % 8 != 0 or not 32 <= d <= 256:
        raise ValueError(f"{name} head dim must be a multiple of 8 in [32, 256], got {d}")


def check_index_tensor(name: str, t, length: int, device, *, lo: int, hi: int, hi_name: str) -> None:
    """An int32/int64 vector of ``length`` on ``device``; for host tensors its values lie in ``[lo, hi]``.

    On the GPU a value check would need a host sync, so the kernels clamp the values instead.
    """
    check_tensor(name, t, dtypes=INDEX_DTYPES, ndim=1, device=device)
    if t.shape[0] != length:
        raise ValueError(f"{name} must have shape [{length}], got {tuple(t.shape)}")
    if not t.is_cuda and t.numel() > 0:
        vmin, vmax = int(t.min()), int(t.max())
        if vmin < lo or vmax > hi:
            raise ValueError(f"{name} must lie in [{lo}, {hi}] ({hi_name}), got values in [{vmin}, {vmax}]")


def check_sm_scale(sm_scale) -> None:
    if sm_scale is not None and (not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool)
                                 or not math.isfinite(sm_scale)):
        raise TypeError(f"sm_scale must be a finite real number or None, got {sm_scale!r}")


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    """A Python int (not a bool) in ``[lo, hi]``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        expected = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return int(value)


def check_kv_layout(kv_layout) -> None:
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")


def check_state(name: str, state) -> None:
    """An attention state ``(o [..., D] float, lse [...] float32)`` on one device."""
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"{name} must be an AttentionState (o, lse), got {type(state).__name__}")
    check_state_tensors(state[0], state[1], f"{name}.o", f"{name}.lse")


def check_state_tensors(o, lse, o_name: str, lse_name: str) -> None:
    check_tensor(o_name, o, dtypes=FLOAT_DTYPES)
    check_tensor(lse_name, lse, dtypes=(torch.float32,), device=o.device)
    if o.dim() < 1 or tuple(lse.shape) != tuple(o.shape[:-1]):
        raise ValueError(f"{lse_name} must have shape {tuple(o.shape[:-1])} (= {o_name}.shape[:-1]), "
                         f"got {tuple(lse.shape)}")


def check_kv_scales(k_scale, v_scale, kv_dtype, q_dtype, hkv: int, device) -> int:
    """The dequantisation scales of an FP8 cache: each a positive finite python float, a 0-d float32
    tensor or an ``[Hkv]`` float32 tensor on ``device``; required for an FP8 cache, refused otherwise.
    Returns the kernels' ``KV_SCALE`` mode: 0 (no FP8), 1 (float scales), 2 (tensor scales)."""
    if kv_dtype not in FP8_DTYPES:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is not None:
                raise ValueError(f"{name} is only for an FP8 cache (float8_e4m3fn or float8_e5m2), the cache is "
                                 f"{_dtype_name(kv_dtype)}")
        return 0
    if q_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be float16 or bfloat16 with an FP8 cache, got {_dtype_name(q_dtype)}")
    kinds = set()
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None:
            raise ValueError(f"{name} must be given for an FP8 cache (k.float() * k_scale is the key used)")
        if isinstance(sc, torch.Tensor):
            check_tensor(name, sc, dtypes=(torch.float32,), device=device)
            if sc.dim() > 1 or (sc.dim() == 1 and sc.shape[0] != hkv):
                raise ValueError(f"{name} must be a 0-d or [{hkv}] (one per KV head) float32 tensor, got shape "
                                 f"{tuple(sc.shape)}")
            kinds.add(2)
        elif isinstance(sc, numbers.Real) and not isinstance(sc, bool):
            if not (math.isfinite(sc) and sc > 0):
                raise ValueError(f"{name} must be a positive finite number, got {sc!r}")
            kinds.add(1)
        else:
            raise TypeError(f"{name} must be a float, a 0-d or an [Hkv] float32 tensor, got {type(sc).__name__}")
    if len(kinds) > 1:
        raise TypeError("k_scale and v_scale must both be floats or both be tensors")
    return kinds.pop()


def check_variants(window_left, logit_softcap, sinks, hq: int, device) -> None:
    """A sliding window (int >= 0), a logit softcap (finite float > 0) and attention sinks (``[Hq]`` float32
    on ``device``), each optional."""
    if window_left is not None:
        check_int("window_left", window_left, 0)
    if logit_softcap is not None:
        if not isinstance(logit_softcap, numbers.Real) or isinstance(logit_softcap, bool):
            raise TypeError(f"logit_softcap must be a float > 0 or None, got {logit_softcap!r}")
        if not (math.isfinite(logit_softcap) and logit_softcap > 0):
            raise ValueError(f"logit_softcap must be a finite float > 0, got {logit_softcap!r}")
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), ndim=1, device=device)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must have shape [{hq}] (one logit per query head), got {tuple(sinks.shape)}")



def check_inference(fn: str, names: tuple, *args) -> None:
    """``fn`` is an inference op (it has no backward): while grad mode is on, none of ``args`` (named by
    ``names``; tensors, ``None``, Python scalars, or tuples and lists of them such as an ``AttentionState``
    or a list of ``CascadeLevel``) may require grad, since its output would silently carry no gradient.
    Raises ``ValueError`` naming ``fn`` and the argument. Under ``torch.no_grad()`` or
    ``torch.inference_mode()`` it reads the grad mode only; else the common arguments (``None``, plain
    tensors that require no grad) cost one test each."""
    if not torch.is_grad_enabled():
        return
    tensor = torch.Tensor
    for x in args:
        if x is not None and (x.__class__ is not tensor or x.requires_grad):
            break
    else:
        return
    for name, x in zip(names, args):
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                raise ValueError(f"{fn} is an inference op: {name} requires grad; call it under torch.no_grad() "
                                 f"or torch.inference_mode(), or detach the input")
        elif isinstance(x, (tuple, list)):
            fields = getattr(x, "_fields", None)
            check_inference(fn, tuple(f"{name}.{f}" for f in fields) if fields is not None
                            else tuple(f"{name}[{i}]" for i in range(len(x))), *x)
