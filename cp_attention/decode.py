"""``flash_decode``: exact decode attention over a (ragged) KV cache, split along the sequence.

Note [The decode hot path]
--------------------------
An eager decode call must cost the host about what the kernel launch costs (a few µs), since at batch 1
and short contexts the GPU work itself takes less than 10 µs. A call reads each tensor argument's shape,
strides, dtype, device and pointer (its 16-byte alignment goes in) into one key, with the options (a
Python value with its class: ``num_splits=2.0`` equals ``2`` but is refused), and on a hit replays what
an earlier call with the same key prepared once every check had passed: the plan
(``heuristics.plan_decode``), the kernels' integer arguments bound in
:class:`~cp_attention.ops._launch.Launcher` objects (``ops.split_kv.decode_launchers``), the output's shape.
Everything the checks read is in the key, so a call that would fail them misses the cache and is checked in
full; what the key does not fix (``sm_scale``, ``return_lse``, the softcap's and float FP8 scales' values) is
checked at every call by :func:`~cp_attention._validate.kernel_scalars`. The kernel then gets the pointers the key read
(``Launcher.launch_ptrs``). That is the path of CUDA tensors, whose index values are never read on the host
(no sync; the kernels clamp them); host tensors (the interpreter) are checked in full at every call and only
reuse the prepared launch. The last key found sits beside the dict, so a call site that repeats its call (a
model's layers) compares keys instead of hashing them. The split workspace and the LSE scratch of calls that
do not return it are kept per (device, stream) and grow when needed; buffers a larger request replaces stay
alive, because a captured CUDA graph may still use them.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _device, _library
from ._device import use_triton
from ._validate import (CacheGeometry, check_bool, check_decode_args, check_inference, check_scale_values,
                        kernel_scalars, optional_signature, scale_values_checked, signature, unpack_out)
from .heuristics import plan_decode
from .quant import dequantize
from .state import AttentionState

__all__ = ["flash_decode"]


class _Prepared(NamedTuple):
    """What a validated call with a given key launches (see Note [The decode hot path])."""

    launcher: object  # ops._launch.Launcher of the split-KV kernel, its integer arguments bound
    combine: object  # the Launcher of the combine kernel (integer arguments bound), or None without splits
    cuda: int | None  # CUDA device index of the tensors; None: host tensors (the interpreter)
    device: torch.device
    shape: tuple  # o's shape (q's)
    dtype: torch.dtype
    o_like_q: bool  # o is allocated as torch.empty_like(q) (q contiguous), else contiguous
    lse_shape: tuple
    sm_scale: float  # the default, 1 / sqrt(D)
    work_floats: int
    lse_floats: int
    launches: bool  # B > 0


_PREPARED: dict = {}
_MAX_PREPARED = 4096
# The last key found and its _Prepared: a call site that repeats its call (a model's layers) compares
# keys instead of hashing them. One tuple, so threads always read a matching pair.
_LAST: tuple = (None, None)


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _prepare(q, k, v, seq_lens, block_table, row_limits, sinks, scales, num_splits, kv_layout, plan, o, lse,
             geo: CacheGeometry, window_left, softcap: bool, span, split_size, pdl: bool = True) -> _Prepared:
    from .ops.split_kv import decode_launchers

    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    plan = plan_decode(q.device, b, geo.hkv, geo.t_max, d, q.dtype, k.dtype, geo.q_rows, hq // geo.hkv, geo.page_size,
                       num_splits=num_splits, window_left=window_left, row_limits=row_limits is not None, span=span,
                       split_size=split_size, plan=plan)
    cuda = q.get_device() if q.is_cuda else None
    lse_shape = tuple(q.shape[:-1])
    o_like_q = o is None and q.is_contiguous()  # then empty_like(q) has q's strides
    o_strides = o.stride() if o is not None else q.stride() if o_like_q else _contiguous_strides(q.shape)
    lse_strides = lse.stride() if lse is not None else _contiguous_strides(lse_shape)
    launcher, combine, work = decode_launchers(
        q, k, v, seq_lens, block_table, row_limits, sinks, scales, kv_layout, plan, o_strides, lse_strides,
        hkv=geo.hkv, q_rows=geo.q_rows, t_max=geo.t_max, page_size=geo.page_size, num_pages=geo.num_pages,
        kv_scale=geo.kv_scale, window_left=window_left, softcap=softcap, device=cuda,
        pdl=pdl and _device.use_pdl(q.device))
    return _Prepared(launcher, combine, cuda, q.device, tuple(q.shape), q.dtype, o_like_q, lse_shape,
                     1.0 / math.sqrt(d), work, math.prod(lse_shape), b > 0)


class _Scratch:
    """Per (device, stream): the split workspace and the LSE of calls that do not return it, with their sizes
    and pointers."""

    __slots__ = ("work", "lse", "work_n", "lse_n", "ptrs", "retired")

    def __init__(self):
        self.work = self.lse = None
        self.work_n = self.lse_n = -1
        self.ptrs = (0, 0)  # data_ptr() of work, lse
        self.retired = []  # replaced buffers that captured graphs may still use

    def fits(self, prep: _Prepared) -> bool:
        return self.work_n >= prep.work_floats and self.lse_n >= prep.lse_floats

    def grow(self, device, prep: _Prepared) -> None:
        """Make the buffers hold ``prep``'s needs."""
        if self.work_n < prep.work_floats:
            self._retire(self.work)
            self.work = torch.empty(max(prep.work_floats, 1 << 16), dtype=torch.float32, device=device)
        if self.lse_n < prep.lse_floats:
            self._retire(self.lse)
            self.lse = torch.empty(max(prep.lse_floats, 1 << 12), dtype=torch.float32, device=device)
        self.work_n, self.lse_n = self.work.numel(), self.lse.numel()
        self.ptrs = (self.work.data_ptr(), self.lse.data_ptr())

    def _retire(self, buf):
        if buf is not None:
            self.retired.append(buf)


_SCRATCH: dict = {}


def _scratch(prep: _Prepared, stream: int) -> _Scratch:
    """The scratch of ``prep``'s device and ``stream`` (0 for host tensors), grown to ``prep``'s needs."""
    s = _SCRATCH.get((prep.cuda, stream))
    if s is None:
        s = _SCRATCH[(prep.cuda, stream)] = _Scratch()
    if not s.fits(prep):
        s.grow(prep.device, prep)
    return s


def _out_key(out) -> tuple:
    """The key's part for an ``out`` that is not a plain tensor: a pair of tensors (anything else raises)."""
    if isinstance(out, torch.Tensor):
        return signature(out)
    o, lse = out
    # views of one buffer: whether they share bytes (checked on a miss) depends on where lse starts in it
    rel = lse.data_ptr() - o.data_ptr() if o.untyped_storage().data_ptr() == lse.untyped_storage().data_ptr() else None
    return (out.__class__, signature(o), signature(lse), rel)


def _rare_key(block_table, k_scale, v_scale, window_left, logit_softcap, sinks, plan, num_splits, split_size,
              row_limits, span, export, pdl) -> tuple:
    """The key's part for the less common arguments (one of them is given). Python values go in with their
    class (``num_splits=2.0`` equals ``2`` but is refused), those read at every call (scales, softcap) by
    class only. Anything unexpected raises, and the call then takes the checked path."""
    return (optional_signature(block_table), optional_signature(row_limits), optional_signature(sinks),
            signature(k_scale) if isinstance(k_scale, torch.Tensor) else k_scale.__class__,
            signature(v_scale) if isinstance(v_scale, torch.Tensor) else v_scale.__class__,
            window_left.__class__, window_left, logit_softcap.__class__, plan.__class__, plan,
            num_splits.__class__, num_splits, split_size.__class__, split_size, span,
            None if export is None else export.data_ptr() & 15, pdl)


def flash_decode(q, k, v, seq_lens=None, *, block_table=None, sm_scale=None, num_splits=None, kv_layout="HND",
                 split_size=None, k_scale=None, v_scale=None, window_left=None, logit_softcap=None, sinks=None,
                 return_lse=False, out=None, plan=None, row_limits=None, _span=None, _export=None, _geo=None,
                 _pdl=True):
    """Exact decode attention over a KV cache, dense or paged, for one or a few new tokens per request
    (Flash-Decoding, one launch).

    Args:
        q: ``[B, Hq, D]`` (one new token per request) or ``[B, Q, Hq, D]`` (``1 <= Q <= 16`` new tokens per
            request: speculative-decoding drafts, MTP), float16, bfloat16 or float32; last dim contiguous.
            The ``Q`` new tokens are the last ``Q`` keys of the cache: row ``i`` of request ``b`` attends
            the positions ``p < seq_lens[b] - Q + 1 + i`` (causal among the new rows); a row that sees no
            key gets ``o = 0``, ``lse = -inf``.
        k, v: a dense cache ``[B, Hkv, T_max, D]`` (``kv_layout="HND"``) or ``[B, T_max, Hkv, D]``
            (``"NHD"``); with ``block_table``, page pools ``[num_pages, Hkv, page_size, D]`` (``"HND"``) or
            ``[num_pages, page_size, Hkv, D]`` (``"NHD"``: the vLLM / FlashInfer layout), any
            ``page_size >= 1``. q's dtype (or FP8, see ``k_scale``) and device; any strides (a slice of a
            larger cache, or ``k``/``v`` as views of one ``[num_pages, 2, ...]`` tensor) with a contiguous
            last dim. ``Hq % Hkv == 0``: query head ``h`` reads KV head ``h // (Hq // Hkv)``. ``D`` is a
            multiple of 8 in ``[32, 256]``. Positions past a sequence's length are never read (they may hold
            garbage).
        seq_lens: ``[B]`` int32/int64 on q's device, any stride, ``0 <= len <= T_max`` (``max_pages *
            page_size`` for a page pool, where it is required; ``None``: all ``T_max``). Values are checked
            on the host for CPU tensors; on the GPU they are clamped.
        block_table: ``[B, max_pages]`` int32 or int64 (any strides): token ``p`` of request ``b`` lives in page
            ``block_table[b, p // page_size]``, slot ``p % page_size``. The pages that ``seq_lens`` reach
            are checked to lie in the pool for CPU tensors; on the GPU they are clamped into it.
        sm_scale: score scale (default ``1 / sqrt(D)``); a real number finite in float32 (else
            ``TypeError``). Scores are float32: where ``sm_scale * q.k`` passes the float32 range the output
            is NaN.
        num_splits: ``None`` for the tuned policy (decided from shapes and ``T_max``, or the window), or a
            fixed count (``1`` = no split), capped at the number of KV tiles ``n`` and rounded to the splits of
            ``ceil(n / min(num_splits, n))`` tiles each: ``ceil(n / that)`` splits run.
        split_size: ``S`` (int, a multiple of 16): deterministic splits. Every split covers the absolute
            positions ``[j * S, (j + 1) * S)`` and the splits merge in a fixed order, so a request's output
            is bitwise identical whatever batch it runs in, whatever the cache capacity and the number of
            SMs (batch invariance; Note [Deterministic splits] in ``ops/split_kv.py``). Not with
            ``num_splits``, ``plan`` or ``window_left``. One more launch than the policy's path.
        k_scale, v_scale: required for an FP8 cache (``k``, ``v`` in ``float8_e4m3fn`` or ``float8_e5m2``
            with ``q`` float16 or bfloat16), refused otherwise: positive python floats, 0-d float32 tensors
            or ``[Hkv]`` float32 tensors (per KV head). The key used is ``k.float() * k_scale``, the value
            ``v.float() * v_scale``; the kernel dequantises in registers (``k_scale`` folds into the score
            scale and ``v_scale`` into the output). :func:`cp_attention.quantize_kv` makes such caches.
            Scales must be finite in float32 and > 0 (``ValueError`` otherwise): floats and CPU tensors are checked at
            every call; a CUDA tensor at its first use and after each in-place update (reading it is a host
            sync), not inside CUDA-graph capture or a torch.compile trace, where a replay reads the values
            the tensor holds then.
        window_left: ``W`` (int >= 0): the query at position ``p`` sees only the keys at ``[p - W, p]`` (a
            single-row query sits at ``seq_len - 1``, row ``i`` of ``Q`` at ``seq_len - Q + i``). Only the
            splits and tiles the window reaches are read. ``None``: no window.
        logit_softcap: ``c`` (float > 0, ``c * log2(e)`` finite in float32): scores are
            ``c * tanh(sm_scale * q.k / c)`` (Gemma 2). ``None``: plain scores.
        sinks: ``[Hq]`` float32: one extra logit per query head in the softmax denominator, with no value
            (gpt-oss): ``o = sum_j e^{s_j} v_j / (e^{sink} + sum_j e^{s_j})``; the returned lse includes it,
            and a row that sees no key gets ``o = 0``, ``lse = sink``.
        return_lse: also return the natural-log LSE.
        out: where to write: a tensor of q's shape (q's dtype or float32, unit stride in D), or an
            ``AttentionState(o, lse of shape q.shape[:-1] float32)``; any strides that do not overlap, ``o`` and
            ``lse`` sharing no byte (``[o | lse]`` rows of one buffer are fine). Then no output is allocated.
        plan: a :class:`cp_attention.heuristics.DecodePlan` to run instead of the policy's: its splits must
            cover the positions the call reads (``num_splits * tiles_per_split * block_n >= T_max``, or
            ``window_left + Q`` with a window; else ``ValueError``), its tiles a power of two of at least 16
            keys. Checked on every path; the torch path runs no plan.
        row_limits: ``[B, Q, 2]`` int32/int64 on q's device (``Q = 1`` for a 3-dim ``q``): row ``i`` of
            request ``b`` sees exactly the cache positions ``row_limits[b, i, 0] <= p < row_limits[b, i, 1]``
            (and ``p < seq_lens[b]``) instead of the causal rule; for callers that place keys themselves
            (a context-parallel shard, a left-padded batch). Not with ``window_left``.

    Returns:
        ``o`` of q's shape in q's dtype (or ``out``'s), or ``AttentionState(o, lse of shape q.shape[:-1]
        float32, natural log)`` with ``return_lse=True``. An empty sequence gives ``o = 0``, ``lse =
        -inf``. CUDA tensors run the Triton kernel (no host sync: it can be captured in a CUDA graph); CPU
        tensors run it under ``TRITON_INTERPRET=1`` (set before the process imports triton), else the
        float32 torch path. See Note [The decode hot path].

    >>> q, k = torch.randn(2, 8, 64), torch.randn(2, 2, 100, 64)
    >>> flash_decode(q, k, k, torch.tensor([100, 7]), return_lse=True).lse.shape
    torch.Size([2, 8])
    """
    check_inference("flash_decode", ("q", "k", "v", "sinks", "k_scale", "v_scale", "out"), q, k, v, sinks, k_scale,
                    v_scale, out)
    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        return _library.flash_decode(q, k, v, seq_lens, block_table, sm_scale, num_splits, kv_layout, split_size,
                                     k_scale, v_scale, window_left, logit_softcap, sinks, return_lse, out, plan,
                                     row_limits, _span, _export)
    # The key (Note [The decode hot path]); the pointers it reads are the launch's arguments.
    global _LAST
    key = prep = None
    if q.__class__ is torch.Tensor:
        try:
            qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
            if seq_lens is None:
                slp, sl_key = qp, None
            else:
                slp = seq_lens.data_ptr()
                sl_key = (seq_lens.shape, seq_lens.stride(), seq_lens.dtype, seq_lens.device, slp & 15)
            if out is None:
                op, out_key = None, None
            elif out.__class__ is torch.Tensor:
                op = out.data_ptr()
                out_key = (out.shape, out.stride(), out.dtype, out.device, op & 15)
            else:
                op, out_key = None, _out_key(out)
            key = (q.shape, q.stride(), q.dtype, q.device, qp & 15, k.shape, k.stride(), k.dtype, k.device, kp & 15,
                   v.shape, v.stride(), v.dtype, v.device, vp & 15, kv_layout, sl_key, out_key)
            if not (block_table is None and k_scale is None and v_scale is None and window_left is None
                    and logit_softcap is None and sinks is None and plan is None and num_splits is None
                    and split_size is None and row_limits is None and _span is None and _export is None
                    and _pdl is True):
                key = (key, _rare_key(block_table, k_scale, v_scale, window_left, logit_softcap, sinks, plan,
                                      num_splits, split_size, row_limits, _span, _export, _pdl))
            last = _LAST
            if key == last[0]:
                prep = last[1]
            else:
                prep = _PREPARED.get(key)
                if prep is not None:
                    _LAST = (key, prep)
        except (AttributeError, TypeError, ValueError, RuntimeError):  # the checks say what is wrong
            key = prep = None
    if prep is None or prep.cuda is None:
        return _checked_call(q, k, v, seq_lens, block_table, sm_scale, num_splits, kv_layout, split_size, k_scale,
                             v_scale, window_left, logit_softcap, sinks, return_lse, out, plan, row_limits, _span,
                             _export, key, prep, _geo, _pdl)

    # A CUDA call whose key a validated call prepared: only what the key does not fix is checked.
    if return_lse is not False and return_lse is not True:
        check_bool("return_lse", return_lse)
    scale, ks, vs, cap = kernel_scalars(prep.sm_scale, sm_scale, logit_softcap, k_scale, v_scale)
    if isinstance(k_scale, torch.Tensor):
        kscp, vscp = k_scale.data_ptr(), v_scale.data_ptr()
        if not (scale_values_checked(k_scale) and scale_values_checked(v_scale)):  # once per version
            check_scale_values("k_scale", k_scale)
            check_scale_values("v_scale", v_scale)
    else:  # not FP8, or float scales (an FP8 cache without scales was refused when the key was prepared)
        kscp = vscp = qp
    if out is None:
        o = _device.new_like(q) if prep.o_like_q else _device.new_buffer(prep.shape, prep.dtype, prep.device)
        op, lse_out = o.data_ptr(), None
    elif op is not None:  # a tensor, its pointer read for the key
        o, lse_out = out, None
    else:
        o, lse_out = (out, None) if isinstance(out, torch.Tensor) else out
        op = o.data_ptr()
    if lse_out is None and return_lse:
        lse_out = _device.new_buffer(prep.lse_shape, torch.float32, prep.device)
    stream = torch._C._cuda_getCurrentRawStream(prep.cuda)
    scratch = _SCRATCH.get((prep.cuda, stream))
    if scratch is None or not scratch.fits(prep):
        scratch = _scratch(prep, stream)
    if prep.launches:  # the launchers have compiled: the call that prepared them launched them
        wp, lsep = scratch.ptrs
        if _export is not None:
            wp = _export.data_ptr()
        if lse_out is not None:
            lsep = lse_out.data_ptr()
        sinkp = qp if sinks is None else sinks.data_ptr()
        prep.launcher.launch_ptrs(stream, (qp, kp, vp, slp, qp if block_table is None else block_table.data_ptr(),
                                           qp if row_limits is None else row_limits.data_ptr(), kscp, vscp, sinkp,
                                           op, lsep, wp, scale, ks, vs, cap))
        if prep.combine is not None and _export is None:
            prep.combine.launch_ptrs(stream, (wp, sinkp, op, lsep))
    if return_lse:
        return AttentionState(o, lse_out)
    return o


def _launch(prep: _Prepared, scratch: _Scratch, q, k, v, seq_lens, block_table, row_limits, k_scale, v_scale, sinks,
            o, lse, export, scale, ks, vs, cap) -> None:
    """Launch ``prep``'s kernels with tensor arguments (placeholders: ``q``): the first launch of a
    :class:`~cp_attention.ops._launch.Launcher` compiles, the interpreter runs, launch hooks see them."""
    k_sc, v_sc = (k_scale, v_scale) if isinstance(k_scale, torch.Tensor) else (q, q)
    work = scratch.work if export is None else export
    lse = scratch.lse if lse is None else lse
    sinks = q if sinks is None else sinks
    prep.launcher(q, k, v, q if seq_lens is None else seq_lens, q if block_table is None else block_table,
                  q if row_limits is None else row_limits, k_sc, v_sc, sinks, o, lse, work, scale, ks, vs, cap)
    if prep.combine is not None and export is None:
        prep.combine(work, sinks, o, lse)


def _checked_call(q, k, v, seq_lens, block_table, sm_scale, num_splits, kv_layout, split_size, k_scale, v_scale,
                  window_left, logit_softcap, sinks, return_lse, out, plan, row_limits, span, export, key, prep, geo,
                  pdl=True):
    """Every check (unless a caller that checked them gives their result ``geo``), then the torch path, or the
    kernels with ``prep`` (prepared now when None; kept under ``key`` unless None). Host tensors (the
    interpreter) come here at every call: their index values are checked each time."""
    if geo is None:
        geo = check_decode_args(q, k, v, seq_lens, block_table=block_table, num_splits=num_splits, kv_layout=kv_layout,
                                plan=plan, out=out, row_limits=row_limits, k_scale=k_scale, v_scale=v_scale,
                                window_left=window_left, logit_softcap=logit_softcap, sinks=sinks, sm_scale=sm_scale,
                                split_size=split_size, return_lse=return_lse)
    if block_table is not None and block_table.shape[1] == 0:  # pools read through no pages: an empty dense cache
        hkv = k.shape[2] if kv_layout == "NHD" else k.shape[1]
        empty = k.new_empty((q.shape[0], hkv, 0, q.shape[-1]))
        return _checked_call(q, empty, empty, seq_lens, None, sm_scale, num_splits, "HND", split_size, k_scale,
                             v_scale, window_left, logit_softcap, sinks, return_lse, out, plan, row_limits, span,
                             export, None, None, None, pdl)
    return decode_checked(q, k, v, seq_lens, geo, block_table=block_table, sm_scale=sm_scale, num_splits=num_splits,
                          kv_layout=kv_layout, split_size=split_size, k_scale=k_scale, v_scale=v_scale,
                          window_left=window_left, logit_softcap=logit_softcap, sinks=sinks, return_lse=return_lse,
                          out=out, plan=plan, row_limits=row_limits, span=span, export=export, key=key, prep=prep,
                          pdl=pdl)


def decode_checked(q, k, v, seq_lens, geo: CacheGeometry, *, block_table=None, sm_scale=None, num_splits=None,
                   kv_layout="HND", split_size=None, k_scale=None, v_scale=None, window_left=None, logit_softcap=None,
                   sinks=None, return_lse=False, out=None, plan=None, row_limits=None, span=None, export=None,
                   key=None, prep=None, pdl=True):
    """:func:`flash_decode` of arguments that :func:`~cp_attention._validate.check_decode_args` accepted (its
    result ``geo``): the torch path, or the kernels (prepared now unless ``prep`` is given; kept under ``key``
    unless None). ``export``: an fp32 buffer that receives the deterministic splits' states instead of the
    combine (context parallelism, Note [Deterministic splits]). ``pdl=False``: launched without programmatic
    dependent launch (the per-request levels of a cascade, Note [Cascade attention])."""
    o_out, lse_out = (None, None) if out is None else unpack_out(out)
    # the checked ints as Python ints (a NumPy integer passes the checks; kernels take Python scalars)
    window_left, split_size = (None if x is None else int(x) for x in (window_left, split_size))
    if not use_triton(q):
        k, v = dequantize(k, v, k_scale, v_scale, kv_layout)
        if block_table is not None:
            from .reference import paged_to_dense

            k, v = (paged_to_dense(t, block_table, kv_layout) for t in (k, v))
        if split_size is not None:
            states = split_states_torch(q, k, v, seq_lens, split_size, geo.t_max, sm_scale=sm_scale,
                                        kv_layout=kv_layout, row_limits=row_limits, logit_softcap=logit_softcap)
            if export is not None:
                export.copy_(states.reshape(-1))
                return None
            st = merge_packed_torch(states, q.dtype if o_out is None else o_out.dtype, sinks)
        else:
            from .reference import attention

            st = attention(q, k, v, seq_lens, sm_scale=sm_scale, kv_layout=kv_layout, row_limits=row_limits,
                           window_left=window_left, logit_softcap=logit_softcap, sinks=sinks)
            st = AttentionState(st.o.to(q.dtype if o_out is None else o_out.dtype), st.lse)
        o = st.o if o_out is None else o_out.copy_(st.o)
        lse = st.lse if lse_out is None else lse_out.copy_(st.lse)
        return AttentionState(o, lse) if return_lse else o
    new = prep is None
    if new:
        prep = _prepare(q, k, v, seq_lens, block_table, row_limits, sinks, (k_scale, v_scale), num_splits,
                        kv_layout, plan, o_out, lse_out, geo, window_left, logit_softcap is not None, span, split_size,
                        pdl)
    if o_out is not None:
        o = o_out
    else:
        o = _device.new_like(q) if prep.o_like_q else _device.new_buffer(prep.shape, prep.dtype, prep.device)
    if lse_out is None and return_lse:
        lse_out = _device.new_buffer(prep.lse_shape, torch.float32, prep.device)
    if prep.launches:
        stream = torch._C._cuda_getCurrentRawStream(prep.cuda) if prep.cuda is not None else 0
        scale, ks, vs, cap = kernel_scalars(prep.sm_scale, sm_scale, logit_softcap, k_scale, v_scale)
        _launch(prep, _scratch(prep, stream), q, k, v, seq_lens, block_table, row_limits, k_scale, v_scale, sinks, o,
                lse_out, export, scale, ks, vs, cap)
    if new and key is not None:  # kept once launched: a later call with this key takes the launchers' direct path
        if len(_PREPARED) >= _MAX_PREPARED:
            _PREPARED.clear()
        _PREPARED[key] = prep
    return AttentionState(o, lse_out) if return_lse else o


def split_states_torch(q, k, v, seq_lens, split_size: int, t_max: int, *, sm_scale=None, kv_layout="HND",
                       row_limits=None, logit_softcap=None) -> torch.Tensor:
    """The torch path's deterministic splits (Note [Deterministic splits] in ``ops/split_kv.py``): split ``j``
    covers the positions ``[j * S, (j + 1) * S)`` of the dense cache ``k``, ``v``; its state is the float32
    reference attention over exactly those ``S`` positions, packed ``[n_splits, *q.shape[:-1], D + 1]`` (``o``
    then ``lse``). The state of a split depends only on its positions, so a context-parallel rank holding whole
    splits computes the same bits for them."""
    from .reference import attention

    n_q = q.shape[1] if q.dim() == 4 else 1
    b, d = q.shape[0], q.shape[-1]
    t_dim = 2 if kv_layout == "HND" else 1
    lens = (torch.full((b,), t_max, device=q.device) if seq_lens is None else seq_lens).long()
    if row_limits is None:  # the causal rule of Q rows
        hi = lens[:, None] - n_q + 1 + torch.arange(n_q, device=q.device)[None, :]
        limits = torch.stack([torch.zeros_like(hi), hi], dim=-1)
    else:
        limits = row_limits.long()
    n_splits = max(1, -(-t_max // split_size))
    packed = torch.empty((n_splits, *q.shape[:-1], d + 1), dtype=torch.float32, device=q.device)
    for j in range(n_splits):
        lo = j * split_size
        kj, vj = (t.narrow(t_dim, lo, max(0, min(split_size, t.shape[t_dim] - lo))) for t in (k, v))
        st = attention(q, kj, vj, (lens - lo).clamp(0, kj.shape[t_dim]), sm_scale=sm_scale, kv_layout=kv_layout,
                       row_limits=(limits - lo).clamp(min=0), logit_softcap=logit_softcap)
        packed[j, ..., :d] = st.o.reshape(*q.shape[:-1], d)
        packed[j, ..., d] = st.lse.reshape(q.shape[:-1])
    return packed


def merge_packed_torch(states: torch.Tensor, dtype: torch.dtype, sinks=None) -> AttentionState:
    """⊕ over dim 0 of packed states ``[N, ..., D + 1]`` (``o`` then ``lse``), in order, on the torch path."""
    from .state import merge_states_torch

    d = states.shape[-1] - 1
    return merge_states_torch(states[..., :d], states[..., d], dtype, sinks)
