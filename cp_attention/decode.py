"""``flash_decode``: exact decode attention over a (ragged) KV cache, split along the sequence.

Note [The decode hot path]
--------------------------
An eager decode call must cost the host about what the kernel launch costs (a few µs), since at batch 1
and short contexts the GPU work itself takes less than 10 µs. A call therefore reads each argument's
shape, strides, dtype, device and pointer alignment into one key, and on a hit replays what an earlier,
fully validated call with the same key prepared: the plan (``heuristics.decode_plan``), every integer
argument of the kernel and a bound :class:`~cp_attention.ops._launch.Launcher`. Only values that the
key does not fix are read again (``sm_scale``). The split workspace, the ticket counters of the fused
combine and the LSE scratch of calls that do not return it are kept per (device, stream) and grow when
needed; buffers a larger request replaces stay alive, because a captured CUDA graph may still use them.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from . import _dispatch
from ._constants import FLOAT_DTYPES
from ._dispatch import use_triton
from ._validate import (check_bool, check_head_dim, check_index_tensor, check_kv_layout, check_sm_scale,
                        check_tensor, check_unit_stride)
from .heuristics import DecodePlan, decode_plan, num_sms
from .state import AttentionState

__all__ = ["flash_decode"]


def check_decode_args(q, k, v, seq_lens, *, num_splits=None, kv_layout="HND", plan=None, out=None):
    """Validate :func:`flash_decode`'s tensor arguments; returns ``(Hkv, T_max)``."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    check_unit_stride("q", q)
    check_kv_layout(kv_layout)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=4, device=q.device)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        check_unit_stride(name, t)
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    b, hq, d = q.shape
    hkv, t_max = (k.shape[1], k.shape[2]) if kv_layout == "HND" else (k.shape[2], k.shape[1])
    if k.shape[0] != b:
        raise ValueError(f"k must have batch {b} (q.shape[0]) in dim 0, got shape {tuple(k.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"k must have head dim {d} (q.shape[2]) in dim 3, got shape {tuple(k.shape)}")
    check_head_dim(d)
    if hkv < 1 or hq < 1 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of the KV heads of k ({hkv}) for "
                         f"kv_layout={kv_layout}")
    if seq_lens is not None:
        check_index_tensor("seq_lens", seq_lens, b, q.device, lo=0, hi=t_max, hi_name="T_max")
    if num_splits is not None:
        if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool):
            raise TypeError(f"num_splits must be an int or None, got {num_splits!r}")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a heuristics.DecodePlan, got {type(plan).__name__}")
        if num_splits is not None:
            raise ValueError("num_splits must be None when plan is given (the plan fixes the splits)")
    if out is not None:
        o_out, lse_out = (out, None) if isinstance(out, torch.Tensor) else _unpack_out(out)
        check_tensor("out", o_out, dtypes=(q.dtype, torch.float32), device=q.device)
        if o_out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(o_out.shape)}")
        check_unit_stride("out", o_out)
        if lse_out is not None:
            check_tensor("out.lse", lse_out, dtypes=(torch.float32,), device=q.device)
            if lse_out.shape != q.shape[:-1]:
                raise ValueError(f"out.lse must have shape {tuple(q.shape[:-1])}, got {tuple(lse_out.shape)}")
    return hkv, t_max


def _unpack_out(out):
    if not isinstance(out, tuple) or len(out) != 2 or not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"out must be a tensor or an AttentionState (o, lse) of tensors, got {type(out).__name__}")
    return out


class _Prepared(NamedTuple):
    """What a validated call with a given key launches (see Note [The decode hot path])."""

    plan: DecodePlan
    launcher: object
    int_args: tuple  # the kernel's arguments after sm_scale
    default_scale: float
    o_shape: tuple
    lse_shape: tuple
    work_floats: int
    counters: int


_PREPARED: dict = {}
_MAX_PREPARED = 4096


def _prepare(q, k, v, seq_lens, num_splits, kv_layout, plan, o, lse, hkv, t_max) -> _Prepared:
    from .ops._launch import Launcher
    from .ops.split_kv import _split_kv_kernel, split_kv_launch_config, workspace_floats

    b, hq, d = q.shape
    if plan is None:
        plan = decode_plan(b, hkv, t_max, d, q.dtype, num_sms(q.device), num_splits)
    ks, vs = k.stride(), v.stride()
    if kv_layout == "NHD":  # [B, T, Hkv, D] read as [B, Hkv, T, D]
        ks, vs = (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1])
    constexprs, options = split_kv_launch_config(q.dtype, hq, hkv, d, plan, seq_lens is not None)
    grid = (b * hkv, plan.num_splits)
    launcher = Launcher(_split_kv_kernel, grid, constexprs, device=q.get_device() if q.is_cuda else None,
                        **options)
    lse_strides = lse.stride() if lse is not None else (hq, 1)
    o_strides = o.stride() if o is not None else (hq * d, d)
    int_args = (t_max, plan.tiles_per_split, plan.num_splits, hkv, q.stride(0), q.stride(1),
                ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], o_strides[0], o_strides[1],
                lse_strides[0], lse_strides[1], seq_lens.stride(0) if seq_lens is not None else 0)
    return _Prepared(plan, launcher, int_args, 1.0 / math.sqrt(d), (b, hq, d), (b, hq),
                     workspace_floats(b, hkv, hq // hkv, d, plan.num_splits), b * hkv)


class _Scratch:
    """Per (device, stream): the split workspace, the combine's ticket counters (zeroed; the kernel leaves
    them zeroed) and the LSE of calls that do not return it."""

    def __init__(self):
        self.work = self.counter = self.lse = None
        self.retired = []  # replaced buffers that captured graphs may still use
        self.counter_unset = False  # allocated during a capture: zeroed only when the graph replays

    def get(self, device, work_floats, counters, lse_floats):
        if self.work is None or self.work.numel() < work_floats:
            self._retire(self.work)
            self.work = torch.empty(max(work_floats, 1 << 16), dtype=torch.float32, device=device)
        if self.lse is None or self.lse.numel() < lse_floats:
            self._retire(self.lse)
            self.lse = torch.empty(max(lse_floats, 1 << 12), dtype=torch.float32, device=device)
        if self.counter is None or self.counter.numel() < counters:
            self._retire(self.counter)
            self.counter = torch.zeros(max(counters, 1024), dtype=torch.int32, device=device)
            self.counter_unset = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        elif self.counter_unset and not torch.cuda.is_current_stream_capturing():
            self.counter.zero_()
            self.counter_unset = False
        return self.work, self.counter, self.lse

    def _retire(self, buf):
        if buf is not None:
            self.retired.append(buf)


_SCRATCH: dict = {}


def _scratch(device: torch.device) -> _Scratch:
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream)
    s = _SCRATCH.get(key)
    if s is None:
        s = _SCRATCH[key] = _Scratch()
    return s


def _key(q, k, v, seq_lens, num_splits, kv_layout, plan, out):
    sig = (q.shape, q.stride(), q.dtype, q.get_device(), q.data_ptr() & 15,
           k.shape, k.stride(), k.dtype, k.get_device(), k.data_ptr() & 15,
           v.shape, v.stride(), v.dtype, v.get_device(), v.data_ptr() & 15, num_splits, kv_layout, plan)
    if seq_lens is not None:
        sig += (seq_lens.shape, seq_lens.stride(), seq_lens.dtype, seq_lens.get_device(), seq_lens.data_ptr() & 15)
    if out is not None:
        o, lse = (out, None) if isinstance(out, torch.Tensor) else out
        sig += (o.shape, o.stride(), o.dtype, o.get_device(), o.data_ptr() & 15)
        if lse is not None:
            sig += (lse.shape, lse.stride(), lse.get_device(), lse.data_ptr() & 15)
    return sig


def flash_decode(q, k, v, seq_lens=None, *, sm_scale=None, num_splits=None, kv_layout="HND",
                 return_lse=False, out=None, plan=None):
    """Exact decode attention of one query per head over a KV cache (Flash-Decoding, one launch).

    Args:
        q: ``[B, Hq, D]`` float16, bfloat16 or float32; last dim contiguous.
        k, v: ``[B, Hkv, T_max, D]`` (``kv_layout="HND"``) or ``[B, T_max, Hkv, D]`` (``"NHD"``), q's dtype
            and device; any strides (a slice of a larger cache is fine) but a contiguous last dim.
            ``Hq % Hkv == 0``: query head ``h`` reads KV head ``h // (Hq // Hkv)``. ``D`` is a multiple of
            8 in ``[32, 256]``. Positions past a sequence's length are never read (they may hold garbage).
        seq_lens: ``[B]`` int32/int64 on q's device, any stride, ``0 <= len <= T_max`` (``None``: all
            ``T_max``). Values are checked on the host for CPU tensors; on the GPU they are clamped.
        sm_scale: score scale (default ``1 / sqrt(D)``).
        num_splits: ``None`` for the tuned policy (decided from shapes and ``T_max``), or a fixed count
            (``1`` = no split; capped at the number of KV tiles).
        return_lse: also return the natural-log LSE.
        out: where to write: a tensor ``[B, Hq, D]`` (q's dtype or float32, unit stride in D), or an
            ``AttentionState(o, lse [B, Hq] float32)``; any strides. Then no output is allocated.
        plan: a :class:`cp_attention.heuristics.DecodePlan` to run instead of the policy's.

    Returns:
        ``o [B, Hq, D]`` in q's dtype (or ``out``'s), or ``AttentionState(o, lse [B, Hq] float32, natural
        log)`` with ``return_lse=True``. An empty sequence gives ``o = 0``, ``lse = -inf``. CUDA tensors
        run the Triton kernel (no host sync: it can be captured in a CUDA graph); CPU tensors run it
        under ``TRITON_INTERPRET=1``, else the float32 torch path. See Note [The decode hot path].

    >>> q, k = torch.randn(2, 8, 64), torch.randn(2, 2, 100, 64)
    >>> flash_decode(q, k, k, torch.tensor([100, 7]), return_lse=True).lse.shape
    torch.Size([2, 8])
    """
    prep = key = None
    if q.__class__ is torch.Tensor and q.is_cuda:
        try:
            key = _key(q, k, v, seq_lens, num_splits, kv_layout, plan, out)
            prep = _PREPARED.get(key)
        except (AttributeError, TypeError):  # not tensors: the full checks below say what is wrong
            key = None
    o_out, lse_out = (None, None) if out is None else (out, None) if isinstance(out, torch.Tensor) else out
    if prep is None:
        check_bool("return_lse", return_lse)
        hkv, t_max = check_decode_args(q, k, v, seq_lens, num_splits=num_splits, kv_layout=kv_layout,
                                       plan=plan, out=out)
        check_sm_scale(sm_scale)
        if not use_triton(q):
            return _torch_path(q, k, v, seq_lens, sm_scale, kv_layout, return_lse, o_out, lse_out)
        prep = _prepare(q, k, v, seq_lens, num_splits, kv_layout, plan, o_out, lse_out, hkv, t_max)
        if key is not None:
            if len(_PREPARED) >= _MAX_PREPARED:
                _PREPARED.clear()
            _PREPARED[key] = prep
    if sm_scale is None:
        scale = prep.default_scale
    else:
        check_sm_scale(sm_scale)
        scale = float(sm_scale)
    if return_lse is not True and return_lse is not False:
        check_bool("return_lse", return_lse)
    o = _dispatch.new_buffer(prep.o_shape, q.dtype, q.device) if o_out is None else o_out
    work, counter, scratch_lse = _scratch(q.device).get(q.device, prep.work_floats, prep.counters,
                                                        prep.lse_shape[0] * prep.lse_shape[1])
    if lse_out is not None:
        lse = lse_out
    elif return_lse:
        lse = _dispatch.new_buffer(prep.lse_shape, torch.float32, q.device)
    else:
        lse = scratch_lse
    if prep.o_shape[0] > 0:
        prep.launcher(q, k, v, q if seq_lens is None else seq_lens, o, lse, work, counter, scale, *prep.int_args)
    return AttentionState(o, lse) if return_lse else o


def _torch_path(q, k, v, seq_lens, sm_scale, kv_layout, return_lse, o_out, lse_out):
    from .reference import attention

    st = attention(q, k, v, seq_lens, sm_scale=sm_scale, kv_layout=kv_layout)
    o = st.o.to(q.dtype if o_out is None else o_out.dtype)
    if o_out is not None:
        o = o_out.copy_(o)
    lse = st.lse if lse_out is None else lse_out.copy_(st.lse)
    return AttentionState(o, lse) if return_lse else o
