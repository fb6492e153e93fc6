"""``flash_decode``: exact single-query attention over a (ragged) KV cache, split along the sequence."""
from __future__ import annotations

import math
import numbers

import torch

from ._dispatch import cdiv
from . import _dispatch
from ._dispatch import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, use_triton
from .heuristics import decode_num_splits
from .state import AttentionState

__all__ = ["flash_decode"]

_NUM_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def _validate(q, k, v, seq_lens, sm_scale, num_splits, kv_layout, return_lse):
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=4, device=q.device)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if q.stride(-1) != 1:
        raise ValueError(f"q must have a contiguous last dim (stride 1), got strides {q.stride()}")
    b, hq, d = q.shape
    hkv = k.shape[1] if kv_layout == "HND" else k.shape[2]
    t_max = k.shape[2] if kv_layout == "HND" else k.shape[1]
    if k.shape[0] != b:
        raise ValueError(f"k must have batch {b} (q.shape[0]) in dim 0, got shape {tuple(k.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"k must have head dim {d} (q.shape[2]) in dim 3, got shape {tuple(k.shape)}")
    if d % 8 != 0 or not 32 <= d <= 256:
        raise ValueError(f"q head dim must be a multiple of 8 in [32, 256], got {d}")
    if hkv < 1 or hq < 1 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of the KV heads of k ({hkv}) for kv_layout={kv_layout}")
    if seq_lens is not None:
        check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1, device=q.device)
        if seq_lens.shape[0] != b:
            raise ValueError(f"seq_lens must have shape [{b}], got {tuple(seq_lens.shape)}")
        if not seq_lens.is_cuda and seq_lens.numel() > 0:
            lo, hi = int(seq_lens.min()), int(seq_lens.max())
            if lo < 0 or hi > t_max:
                raise ValueError(f"seq_lens must lie in [0, {t_max}] (T_max), got values in [{lo}, {hi}]")
    if sm_scale is not None and (not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool)
                                 or not math.isfinite(sm_scale)):
        raise TypeError(f"sm_scale must be a finite real number or None, got {sm_scale!r}")
    if num_splits is not None:
        if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool):
            raise TypeError(f"num_splits must be an int or None, got {num_splits!r}")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    return hkv, t_max


def flash_decode(q, k, v, seq_lens=None, *, sm_scale=None, num_splits=None, kv_layout="HND",
                 return_lse=False, _config=None, _fuse_combine=True):
    """Exact decode attention of one query per head over a KV cache (Flash-Decoding, one launch).

    Args:
        q: ``[B, Hq, D]`` float16, bfloat16 or float32; last dim contiguous.
        k, v: ``[B, Hkv, T_max, D]`` (``kv_layout="HND"``) or ``[B, T_max, Hkv, D]`` (``"NHD"``), q's dtype
            and device; any strides (a slice of a larger cache is fine) but a contiguous last dim.
            ``Hq % Hkv == 0``: query head ``h`` reads KV head ``h // (Hq // Hkv)``. ``D`` is a multiple of
            8 in ``[32, 256]``.
        seq_lens: ``[B]`` int32/int64 on q's device, ``0 <= len <= T_max`` (``None``: all ``T_max``).
            Values are checked on the host for CPU tensors; on the GPU they are clamped to the range.
        sm_scale: score scale (default ``1 / sqrt(D)``).
        num_splits: ``None`` for the tuned policy (decided from shapes and ``T_max``), or a fixed count
            (``1`` = no split; capped at the number of KV tiles).
        return_lse: also return the natural-log LSE.

    Returns:
        ``o [B, Hq, D]`` in q's dtype, or ``AttentionState(o, lse [B, Hq] float32, natural log)`` with
        ``return_lse=True``. An empty sequence gives ``o = 0``, ``lse = -inf``. CUDA tensors run the
        Triton kernel (no host sync: it can be captured in a CUDA graph); CPU tensors run it under
        ``TRITON_INTERPRET=1``, else the float32 torch path.

    >>> q, k = torch.randn(2, 8, 64), torch.randn(2, 2, 100, 64)
    >>> flash_decode(q, k, k, torch.tensor([100, 7]), return_lse=True).lse.shape
    torch.Size([2, 8])
    """
    hkv, t_max = _validate(q, k, v, seq_lens, sm_scale, num_splits, kv_layout, return_lse)
    b, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if not use_triton(q):
        from .reference import attention

        st = attention(q, k, v, seq_lens, sm_scale=scale, kv_layout=kv_layout)
        o, lse = st.o.to(q.dtype), st.lse
        return AttentionState(o, lse) if return_lse else o

    from .ops.split_kv import default_config, split_kv_decode

    if kv_layout == "NHD":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    o = _dispatch.new_buffer((b, hq, d), q.dtype, q.device)
    lse = _dispatch.new_buffer((b, hq), torch.float32, q.device)
    if b == 0:
        return AttentionState(o, lse) if return_lse else o
    config = _config or default_config(d, q.dtype)
    n_blocks = max(1, cdiv(t_max, config[0]))
    if num_splits is None:
        num_splits = decode_num_splits(b, hkv, t_max, config[0], _num_sms(q.device))
    tiles_per_split = cdiv(n_blocks, min(num_splits, n_blocks))
    splits = cdiv(n_blocks, tiles_per_split)
    parts = split_kv_decode(q, k, v, seq_lens, o, lse, sm_scale=scale, num_splits=splits,
                            tiles_per_split=tiles_per_split, config=config, fuse_combine=_fuse_combine)
    if parts is not None:  # separate combine (used to measure the combine's share)
        from .ops.merge import merge_states_into

        merge_states_into(*parts, o.view(b * hq, d), lse.view(b * hq), lse_base2=True)
    return AttentionState(o, lse) if return_lse else o
