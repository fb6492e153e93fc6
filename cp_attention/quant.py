"""FP8 KV caches: amax scaling into ``float8_e4m3fn`` / ``float8_e5m2`` with per-tensor or per-KV-head scales.

Note [FP8 KV caches]
--------------------
Decode reads every K/V byte once, so storing the cache in 8 bits halves the bytes (and doubles the context
that fits). A cache ``x`` is stored as ``x8 = saturate(x / scale)`` with ``scale = amax(|x|) / fp8_max``
(per tensor, or per KV head), so the largest magnitude maps to the format's largest finite value
(448 for e4m3, 57344 for e5m2) and nothing overflows. The kernels use ``x8.float() * scale``: the K scale
folds into the score scale and the V scale multiplies the normalised output, both exact up to fp32
rounding (``ops/_state.py``). The error is the rounding of ``x / scale`` to 3 (e4m3) or 2 (e5m2) mantissa
bits: a relative error of at most 2^-4 (e4m3) or 2^-3 (e5m2) per element, halved on average, plus the
subnormal range for values far below amax.
"""
from __future__ import annotations

import torch

from ._constants import FP8_DTYPES
from ._validate import check_bool, check_inference, check_kv_layout, check_tensor

__all__ = ["quantize_kv", "quantize", "dequantize", "amax_scale"]


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """``saturate(x / scale)`` in ``dtype``: ``scale`` 0-d, or ``[Hkv]`` applied along dim ``head_dim``.
    Non-finite values (garbage in unused cache slots) stay non-finite or saturate; they never reach a
    result, since the kernels never read past a sequence's length."""
    fmax = torch.finfo(dtype).max
    if scale.dim() == 1:
        shape = [1] * x.dim()
        shape[head_dim] = scale.shape[0]
        scale = scale.view(shape)
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def dequantize(k: torch.Tensor, v: torch.Tensor, k_scale, v_scale, kv_layout: str = "HND"):
    """``(k.float() * k_scale, v.float() * v_scale)`` of an FP8 cache (per-head scales along the KV-head dim:
    1 for ``"HND"``, 2 for ``"NHD"``), for the torch paths; ``(k, v)`` themselves when the cache is not FP8."""
    if k.dtype not in FP8_DTYPES:
        return k, v
    head_dim = 1 if kv_layout == "HND" else 2
    out = []
    for t, sc in ((k, k_scale), (v, v_scale)):
        sc = torch.as_tensor(sc, dtype=torch.float32, device=t.device)
        if sc.dim() == 1:
            shape = [1] * t.dim()
            shape[head_dim] = sc.shape[0]
            sc = sc.view(shape)
        out.append(t.float() * sc)
    return tuple(out)


def amax_scale(x: torch.Tensor, dtype: torch.dtype, head_dim: int | None) -> torch.Tensor:
    """The amax scale of ``x`` in FP8 ``dtype`` (Note [FP8 KV caches]): ``amax(|x|) / fp8_max`` over the finite
    values, per tensor (0-d; ``head_dim`` None) or per index of dim ``head_dim``; 1 where the amax is 0, and at
    least the smallest normal float32 (a positive scale however small the values)."""
    finite = torch.where(torch.isfinite(x), x.float().abs(), torch.zeros((), device=x.device))
    if not x.numel():  # an empty cache: the amax of nothing is 0
        amax = finite.new_zeros(() if head_dim is None else (x.shape[head_dim],))
    elif head_dim is None:
        amax = finite.amax()
    else:
        dims = [d for d in range(x.dim()) if d != head_dim]
        amax = finite.amax(dim=dims)
    scale = (amax / torch.finfo(dtype).max).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(amax > 0, scale, torch.ones_like(amax)).float()


def quantize_kv(k, v, dtype=torch.float8_e4m3fn, *, per_head=False, kv_layout="HND"):
    """Quantize a KV cache (dense, or page pools) to FP8 with amax scaling (Note [FP8 KV caches]).

    Args:
        k, v: float16/bfloat16/float32, 4 dims, one shape: dense ``[B, Hkv, T, D]`` or page pools
            ``[P, Hkv, page, D]`` (``kv_layout="HND"``); ``[B, T, Hkv, D]`` or ``[P, page, Hkv, D]``
            (``"NHD"``). Non-finite values are left out of the amax.
        dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        per_head: one scale per KV head (the KV-head dim: 1 for ``"HND"``, 2 for ``"NHD"``) instead of
            one per tensor.

    Returns:
        ``(k8, v8, k_scale, v_scale)``: the caches in ``dtype`` (k's shape) and float32 scales, 0-d (per
        tensor) or ``[Hkv]``, on k's device, such that ``k8.float() * k_scale`` approximates ``k``; pass
        them to :func:`cp_attention.flash_decode` as ``k_scale=``, ``v_scale=``.

    >>> k = torch.randn(1, 2, 16, 32)
    >>> k8, v8, ks, vs = quantize_kv(k, k, per_head=True)
    >>> k8.dtype, ks.shape, bool(((k8.float() * ks.view(1, 2, 1, 1) - k).abs() <= k.abs().amax() / 8).all())
    (torch.float8_e4m3fn, torch.Size([2]), True)
    """
    check_inference("quantize_kv", ("k", "v"), k, v)
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    check_kv_layout(kv_layout)
    check_bool("per_head", per_head)
    check_tensor("k", k, dtypes=(torch.float16, torch.bfloat16, torch.float32), ndim=4)
    check_tensor("v", v, dtypes=(k.dtype,), ndim=4, device=k.device)
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    head_dim = 1 if kv_layout == "HND" else 2
    out = []
    for x in (k, v):
        scale = amax_scale(x, dtype, head_dim if per_head else None)
        out.append((quantize(x, scale, dtype, head_dim), scale))
    (k8, k_scale), (v8, v_scale) = out
    return k8, v8, k_scale, v_scale
