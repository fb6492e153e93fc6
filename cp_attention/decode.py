"""``flash_decode``: exact decode attention over a (ragged) KV cache, split along the sequence.

Note [The decode hot path]
--------------------------
An eager decode call must cost the host about what the kernel launch costs (a few µs), since at batch 1
and short contexts the GPU work itself takes less than 10 µs. A call reads each tensor argument's shape,
strides, dtype, device and pointer (its 16-byte alignment goes in) into one key, with the options (a
Python value with its class: ``num_splits=2.0`` equals ``2`` but is refused), and on a hit replays what
an earlier call with the same key prepared once every check had passed: the plan
(``heuristics.decode_plan``), the kernel's integer arguments bound in a
:class:`~cp_attention.ops._launch.Launcher`, the output's shape. Everything the checks read is in the
key, so a call that would fail them misses the cache and is checked in full; what the key does not fix
(``sm_scale``, ``return_lse``, the softcap's and float FP8 scales' values) is checked at every call. The
kernel then gets the pointers the key read (``Launcher.launch_ptrs``). That is the path of CUDA tensors,
whose index values are never read on the host (no sync; the kernels clamp them); host tensors (the
interpreter) are checked in full at every call and only reuse the prepared launch. The last key found
sits beside the dict, so a call site that repeats its call (a model's layers) compares keys instead of
hashing them. The split workspace and the LSE scratch of calls that do not return it are kept per
(device, stream) and grow when needed; buffers a larger request
replaces stay alive, because a captured CUDA graph may still use them. Where the host time of a call
goes: benchmarks/NOTES.md, "Host path v6".
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from . import _dispatch, _library
from ._constants import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, LOG2E
from ._dispatch import use_triton
from ._validate import (check_bool, check_head_dim, check_index_tensor, check_inference, check_int, check_kv_layout,
                        check_kv_scales, check_sm_scale, check_tensor, check_unit_stride, check_variants)
from .heuristics import (FP8_ONE_WARP, FP8_ONE_WARP_LONG, ONE_WARP_CONFIGS, ONE_WARP_MAX_ROWS, DecodePlan,
                         decode_plan, deterministic_plan, num_sms, one_warp_fp8, one_warp_plan, use_pdl)
from .state import AttentionState

__all__ = ["flash_decode"]


MAX_Q_ROWS = 16


class CacheGeometry(NamedTuple):
    """What :func:`check_decode_args` found: KV heads, capacity ``T_max`` (``max_pages * page_size`` for a
    page pool), query rows per request, page size (0: dense), pages in the pool and the FP8 scale mode
    (0: not FP8, 1: float scales, 2: tensor scales)."""

    hkv: int
    t_max: int
    q_rows: int
    page_size: int
    num_pages: int
    kv_scale: int


def check_decode_args(q, k, v, seq_lens, *, block_table=None, num_splits=None, kv_layout="HND", plan=None,
                      out=None, row_limits=None, k_scale=None, v_scale=None, window_left=None, logit_softcap=None,
                      sinks=None) -> CacheGeometry:
    """Validate :func:`flash_decode`'s tensor arguments (shapes, dtypes, devices, strides; index values of
    host tensors)."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must have 3 dims [B, Hq, D] or 4 dims [B, Q, Hq, D], got shape {tuple(q.shape)}")
    check_unit_stride("q", q)
    check_kv_layout(kv_layout)
    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    q_rows = q.shape[1] if q.dim() == 4 else 1
    if not 1 <= q_rows <= MAX_Q_ROWS:
        raise ValueError(f"q must have 1 to {MAX_Q_ROWS} query rows per request in dim 1, got {q_rows}")
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=4, device=q.device)
        if t.dtype != q.dtype and t.dtype not in FP8_DTYPES:
            raise TypeError(f"{name} must have q's dtype {q.dtype} (or be an FP8 cache), got {t.dtype}")
        check_unit_stride(name, t)
    if v.dtype != k.dtype:
        raise TypeError(f"v must have k's dtype {k.dtype}, got {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"k must have head dim {d} (q.shape[-1]) in dim 3, got shape {tuple(k.shape)}")
    check_head_dim(d)
    paged = block_table is not None
    # dense: [B, Hkv, T, D] / [B, T, Hkv, D]; paged: [pages, Hkv, page, D] / [pages, page, Hkv, D]
    hkv, t_dim = (k.shape[1], 2) if kv_layout == "HND" else (k.shape[2], 1)
    if hkv < 1 or hq < 1 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of the KV heads of k ({hkv}) for "
                         f"kv_layout={kv_layout}")
    if paged:
        check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2, device=q.device)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table must have batch {b} (q.shape[0]) in dim 0, got shape "
                             f"{tuple(block_table.shape)}")
        if seq_lens is None:
            raise ValueError("seq_lens must be given with block_table (a page pool has no length of its own)")
        page_size, num_pages = k.shape[t_dim], k.shape[0]
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"k must be a page pool with at least one page of at least one slot, got shape "
                             f"{tuple(k.shape)}")
        t_max = block_table.shape[1] * page_size
    else:
        if k.shape[0] != b:
            raise ValueError(f"k must have batch {b} (q.shape[0]) in dim 0, got shape {tuple(k.shape)}")
        page_size, num_pages, t_max = 0, 0, k.shape[t_dim]
    if seq_lens is not None:
        check_index_tensor("seq_lens", seq_lens, b, q.device, lo=0, hi=t_max,
                           hi_name="max_pages * page_size" if paged else "T_max")
    if paged and not block_table.is_cuda and b > 0:
        used = torch.arange(block_table.shape[1])[None, :] * page_size < seq_lens.long()[:, None]
        pages = block_table[used]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
            raise ValueError(f"block_table must hold pages in [0, {num_pages - 1}] (k has {num_pages} pages) "
                             f"where seq_lens reach, got values in [{int(pages.min())}, {int(pages.max())}]")
    if row_limits is not None:
        check_tensor("row_limits", row_limits, dtypes=INDEX_DTYPES, ndim=3, device=q.device)
        if tuple(row_limits.shape) != (b, q_rows, 2):
            raise ValueError(f"row_limits must have shape [{b}, {q_rows}, 2], got {tuple(row_limits.shape)}")
        if window_left is not None:
            raise ValueError("window_left must be None with row_limits (the limits fix every row's positions)")
    check_variants(window_left, logit_softcap, sinks, hq, q.device)
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
    kv_scale = check_kv_scales(k_scale, v_scale, k.dtype, q.dtype, hkv, q.device)
    return CacheGeometry(hkv, t_max, q_rows, page_size, num_pages, kv_scale)


def _unpack_out(out):
    if not isinstance(out, tuple) or len(out) != 2 or not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"out must be a tensor or an AttentionState (o, lse) of tensors, got {type(out).__name__}")
    return out


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


def _bqh(strides, multi: bool) -> tuple:
    """(batch, row, head) strides from the strides of ``[B, Q, H, ...]``, or of ``[B, H, ...]`` (row 0)."""
    return (strides[0], strides[1], strides[2]) if multi else (strides[0], 0, strides[1])


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _prepare(q, k, v, seq_lens, block_table, row_limits, sinks, scales, num_splits, kv_layout, plan, o, lse,
             geo: CacheGeometry, window_left, softcap: bool, span, split_size, export: bool) -> _Prepared:
    from .ops._launch import Launcher
    from .ops.split_kv import (_combine_kernel, _split_kv_kernel, combine_launch_config, export_floats, exports,
                               split_kv_launch_config)

    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    multi = q.dim() == 4
    rows = geo.q_rows * (hq // geo.hkv)
    plain = split_size is None  # the domain of the one-warp FP8 kernel beyond dtype and shapes (one_warp_fp8)
    if split_size is not None:
        plan = deterministic_plan(geo.t_max, d, q.dtype, split_size)
    elif plan is None:
        # A window (or a context-parallel rank's share of one) bounds the positions a call reads: the
        # splits tile that span from its first position, not the whole cache.
        reach = geo.t_max if window_left is None else min(geo.t_max, window_left + geo.q_rows)
        reach = reach if span is None else min(reach, span)
        if one_warp_fp8(q.device, k.dtype, d, rows, reach, plain, geo.page_size):
            # splits from a whole tile below the first key
            margin = FP8_ONE_WARP_LONG.block_n - 1 if window_left is not None or row_limits is not None else 0
            plan = one_warp_plan(b, geo.hkv, min(geo.t_max, reach + margin), num_sms(q.device), num_splits,
                                 geo.page_size, rows, d)  # None: splits too short for the rows' states
        if plan is None:
            plan = decode_plan(b, geo.hkv, reach, d, q.dtype, num_sms(q.device), num_splits, kv_dtype=k.dtype,
                               page_size=geo.page_size, aligned=window_left is None and row_limits is None, rows=rows)
    ks, vs = k.stride(), v.stride()
    # The kernel reads k/v through (batch or page, KV head, position or slot) strides.
    if kv_layout == "NHD":
        ks, vs = (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1])
    pdl = use_pdl(q.device)
    constexprs, options, tiling = split_kv_launch_config(
        q.dtype, hq // geo.hkv, geo.q_rows, d, plan, has_seq_lens=seq_lens is not None, page_size=geo.page_size,
        causal=geo.q_rows > 1 and row_limits is None, row_limits=row_limits is not None, kv_scale=geo.kv_scale,
        window=window_left is not None and row_limits is None, softcap=softcap, sinks=sinks is not None, pdl=pdl)
    kernel = _split_kv_kernel
    if plan.config in ONE_WARP_CONFIGS:
        if not (one_warp_fp8(q.device, k.dtype, d, rows, geo.t_max, plain, geo.page_size)
                and plan.page_tiles == (geo.page_size > 0 and geo.page_size % plan.config.block_n == 0)
                and (plan.page_tiles or not geo.page_size or plan.config == FP8_ONE_WARP)
                and not plan.split_pages and plan.streams == 1):
            raise ValueError(f"plan: the one-warp FP8 configs run an FP8 cache of head dim 128 or 256 and more than "
                             f"512 positions read by at most {ONE_WARP_MAX_ROWS} query rows per KV head, dense or paged "
                             f"(page_tiles where a page holds whole tiles, else 16-key tiles with an entry a key), "
                             f"without split_size, on an sm_90 GPU")
        from .ops.split_kv_fp8 import _split_kv_fp8_kernel
        kernel, constexprs = _split_kv_fp8_kernel, dict(constexprs, NUM_STAGES=plan.config.num_stages)
    grid = (b * geo.hkv * tiling.n_rt, plan.num_splits)
    cuda = q.get_device() if q.is_cuda else None
    lse_shape = tuple(q.shape[:-1])
    o_like_q = o is None and q.is_contiguous()  # then empty_like(q) has q's strides
    o_strides = o.stride() if o is not None else q.stride() if o_like_q else _contiguous_strides(q.shape)
    o_strides = _bqh(o_strides, multi)
    lse_strides = _bqh(lse.stride() if lse is not None else _contiguous_strides(lse_shape), multi)
    sink_stride = sinks.stride(0) if sinks is not None else 0
    int_args = (geo.t_max, plan.tiles_per_split, geo.hkv, geo.num_pages, window_left or 0,
                *_bqh(q.stride(), multi), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], *o_strides, *lse_strides,
                seq_lens.stride(0) if seq_lens is not None else 0,
                *(block_table.stride() if block_table is not None else (0, 0)),
                *(row_limits.stride() if row_limits is not None else (0, 0, 0)),
                *((sc.stride(0) if sc.dim() else 0) if geo.kv_scale == 2 else 0 for sc in scales), sink_stride)
    launcher = Launcher(kernel, grid, constexprs, device=cuda, static=int_args, **options)
    combine, work = None, 0
    if exports(plan):
        work = export_floats(b, geo.hkv, tiling, d, plan.num_splits)
        c_constexprs, c_options, c_grid = combine_launch_config(
            hq // geo.hkv, geo.q_rows, d, sinks is not None, None if plan.deterministic else plan.num_splits, pdl,
            plan.config.programs > 1, tiling.block_h)
        combine = Launcher(_combine_kernel, (grid[0], *c_grid), c_constexprs, device=cuda,
                           static=(plan.num_splits, geo.hkv, *o_strides, *lse_strides, sink_stride), **c_options)
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


def _sig(t) -> tuple:
    """What a launch prepared for ``t`` depends on: shape, strides, dtype, device, 16-byte alignment."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def _opt_sig(t) -> tuple | None:
    return None if t is None else _sig(t)


def _out_key(out) -> tuple:
    """The key's part for an ``out`` that is not a plain tensor: a pair of tensors (anything else raises)."""
    if isinstance(out, torch.Tensor):
        return _sig(out)
    o, lse = out
    return (out.__class__, _sig(o), _sig(lse))


def _rare_key(block_table, k_scale, v_scale, window_left, logit_softcap, sinks, plan, num_splits, split_size,
              row_limits, span, export) -> tuple:
    """The key's part for the less common arguments (one of them is given). Python values go in with their
    class (``num_splits=2.0`` equals ``2`` but is refused), those read at every call (scales, softcap) by
    class only. Anything unexpected raises, and the call then takes the checked path."""
    return (_opt_sig(block_table), _opt_sig(row_limits), _opt_sig(sinks),
            _sig(k_scale) if isinstance(k_scale, torch.Tensor) else k_scale.__class__,
            _sig(v_scale) if isinstance(v_scale, torch.Tensor) else v_scale.__class__,
            window_left.__class__, window_left, logit_softcap.__class__, plan.__class__, plan,
            num_splits.__class__, num_splits, split_size.__class__, split_size, span,
            None if export is None else export.data_ptr() & 15)


def flash_decode(q, k, v, seq_lens=None, *, block_table=None, sm_scale=None, num_splits=None, kv_layout="HND",
                 split_size=None, k_scale=None, v_scale=None, window_left=None, logit_softcap=None, sinks=None,
                 return_lse=False, out=None, plan=None, row_limits=None, _span=None, _export=None):
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
        block_table: ``[B, max_pages]`` int32 (any strides): token ``p`` of request ``b`` lives in page
            ``block_table[b, p // page_size]``, slot ``p % page_size``. The pages that ``seq_lens`` reach
            are checked to lie in the pool for CPU tensors; on the GPU they are clamped into it.
        sm_scale: score scale (default ``1 / sqrt(D)``).
        num_splits: ``None`` for the tuned policy (decided from shapes and ``T_max``, or the window), or a
            fixed count (``1`` = no split; capped at the number of KV tiles).
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
        window_left: ``W`` (int >= 0): the query at position ``p`` sees only the keys at ``[p - W, p]`` (a
            single-row query sits at ``seq_len - 1``, row ``i`` of ``Q`` at ``seq_len - Q + i``). Only the
            splits and tiles the window reaches are read. ``None``: no window.
        logit_softcap: ``c`` (float > 0): scores are ``c * tanh(sm_scale * q.k / c)`` (Gemma 2). ``None``:
            plain scores.
        sinks: ``[Hq]`` float32: one extra logit per query head in the softmax denominator, with no value
            (gpt-oss): ``o = sum_j e^{s_j} v_j / (e^{sink} + sum_j e^{s_j})``; the returned lse includes it,
            and a row that sees no key gets ``o = 0``, ``lse = sink``.
        return_lse: also return the natural-log LSE.
        out: where to write: a tensor of q's shape (q's dtype or float32, unit stride in D), or an
            ``AttentionState(o, lse of shape q.shape[:-1] float32)``; any strides. Then no output is
            allocated.
        plan: a :class:`cp_attention.heuristics.DecodePlan` to run instead of the policy's.
        row_limits: ``[B, Q, 2]`` int32/int64 on q's device (``Q = 1`` for a 3-dim ``q``): row ``i`` of
            request ``b`` sees exactly the cache positions ``row_limits[b, i, 0] <= p < row_limits[b, i, 1]``
            (and ``p < seq_lens[b]``) instead of the causal rule; for callers that place keys themselves
            (a context-parallel shard, a left-padded batch). Not with ``window_left``.

    Returns:
        ``o`` of q's shape in q's dtype (or ``out``'s), or ``AttentionState(o, lse of shape q.shape[:-1]
        float32, natural log)`` with ``return_lse=True``. An empty sequence gives ``o = 0``, ``lse =
        -inf``. CUDA tensors run the Triton kernel (no host sync: it can be captured in a CUDA graph); CPU
        tensors run it under ``TRITON_INTERPRET=1``, else the float32 torch path. See Note [The decode hot
        path].

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
                    and split_size is None and row_limits is None and _span is None and _export is None):
                key = (key, _rare_key(block_table, k_scale, v_scale, window_left, logit_softcap, sinks, plan,
                                      num_splits, split_size, row_limits, _span, _export))
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
                             _export, key, prep)

    # A CUDA call whose key a validated call prepared: only what the key does not fix is checked.
    if sm_scale is None:
        scale = prep.sm_scale
    else:
        if sm_scale.__class__ is not float or not math.isfinite(sm_scale):
            check_sm_scale(sm_scale)
        scale = float(sm_scale)
    if return_lse is not False and return_lse is not True:
        check_bool("return_lse", return_lse)
    cap = 1.0 if logit_softcap is None else _softcap_log2(logit_softcap)
    if k_scale is None:  # not FP8 (an FP8 cache without scales was refused when the key was prepared)
        ks = vs = 1.0
        kscp = vscp = qp
    elif isinstance(k_scale, torch.Tensor):
        ks = vs = 1.0
        kscp, vscp = k_scale.data_ptr(), v_scale.data_ptr()
    else:
        ks, vs = _float_scales(k_scale, v_scale, k.dtype, q.dtype)
        kscp = vscp = qp
    if out is None:
        o = _dispatch.new_like(q) if prep.o_like_q else _dispatch.new_buffer(prep.shape, prep.dtype, prep.device)
        op, lse_out = o.data_ptr(), None
    elif op is not None:  # a tensor, its pointer read for the key
        o, lse_out = out, None
    else:
        o, lse_out = (out, None) if isinstance(out, torch.Tensor) else out
        op = o.data_ptr()
    if lse_out is None and return_lse:
        lse_out = _dispatch.new_buffer(prep.lse_shape, torch.float32, prep.device)
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


def _softcap_log2(logit_softcap) -> float:
    """The kernels' softcap argument, ``c * log2(e)``, of a validated-kind ``logit_softcap``."""
    if not (logit_softcap > 0 and math.isfinite(logit_softcap)):
        check_variants(None, logit_softcap, None, 1, None)
    return float(logit_softcap) * LOG2E


def _float_scales(k_scale, v_scale, kv_dtype, q_dtype) -> tuple:
    if not (k_scale > 0 and v_scale > 0 and math.isfinite(k_scale) and math.isfinite(v_scale)):
        check_kv_scales(k_scale, v_scale, kv_dtype, q_dtype, 1, None)
    return float(k_scale), float(v_scale)


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
                  window_left, logit_softcap, sinks, return_lse, out, plan, row_limits, span, export, key, prep):
    """Every check, then the torch path, or the kernels with ``prep`` (prepared now when None; kept under
    ``key`` unless None). Host tensors (the interpreter) come here at every call: their index values are
    checked each time."""
    check_bool("return_lse", return_lse)
    geo = check_decode_args(q, k, v, seq_lens, block_table=block_table, num_splits=num_splits, kv_layout=kv_layout,
                            plan=plan, out=out, row_limits=row_limits, k_scale=k_scale, v_scale=v_scale,
                            window_left=window_left, logit_softcap=logit_softcap, sinks=sinks)
    check_sm_scale(sm_scale)
    check_split_size(split_size, num_splits=num_splits, plan=plan, window_left=window_left)
    o_out, lse_out = (None, None) if out is None else (out, None) if isinstance(out, torch.Tensor) else out
    if not use_triton(q):
        if export is not None:
            raise ValueError("the exported states of deterministic splits need the Triton kernels")
        k, v = _dequantize(k, v, k_scale, v_scale, kv_layout, geo.kv_scale)
        return _torch_path(q, k, v, seq_lens, block_table, row_limits, sm_scale, kv_layout, window_left,
                           logit_softcap, sinks, return_lse, o_out, lse_out)
    new = prep is None
    if new:
        prep = _prepare(q, k, v, seq_lens, block_table, row_limits, sinks, (k_scale, v_scale), num_splits,
                        kv_layout, plan, o_out, lse_out, geo, window_left, logit_softcap is not None, span, split_size,
                        export is not None)
    if o_out is not None:
        o = o_out
    else:
        o = _dispatch.new_like(q) if prep.o_like_q else _dispatch.new_buffer(prep.shape, prep.dtype, prep.device)
    if lse_out is None and return_lse:
        lse_out = _dispatch.new_buffer(prep.lse_shape, torch.float32, prep.device)
    if prep.launches:
        stream = torch._C._cuda_getCurrentRawStream(prep.cuda) if prep.cuda is not None else 0
        ks, vs = (1.0, 1.0) if geo.kv_scale != 1 else (float(k_scale), float(v_scale))
        cap = 1.0 if logit_softcap is None else float(logit_softcap) * LOG2E
        scale = prep.sm_scale if sm_scale is None else float(sm_scale)
        _launch(prep, _scratch(prep, stream), q, k, v, seq_lens, block_table, row_limits, k_scale, v_scale, sinks, o,
                lse_out, export, scale, ks, vs, cap)
    if new and key is not None:  # kept once launched: a later call with this key takes the launchers' direct path
        if len(_PREPARED) >= _MAX_PREPARED:
            _PREPARED.clear()
        _PREPARED[key] = prep
    return AttentionState(o, lse_out) if return_lse else o


def check_split_size(split_size, *, num_splits=None, plan=None, window_left=None) -> None:
    if split_size is None:
        return
    check_int("split_size", split_size, 16)
    if split_size % 16:
        raise ValueError(f"split_size must be a multiple of 16, got {split_size}")
    for name, value in (("num_splits", num_splits), ("plan", plan), ("window_left", window_left)):
        if value is not None:
            raise ValueError(f"split_size fixes the splits: {name} must be None with it, got {value!r}")


def combine_exported(q, hkv: int, slots, n_slots: int, o, lse, sinks=None) -> None:
    """Merge ``n_slots`` exported deterministic split states (``slots``, fp32, split-major: several ranks'
    exports concatenated in rank order) into ``o`` (q's shape) and ``lse`` (``q.shape[:-1]``): the combine
    that ``flash_decode(split_size=...)`` runs, so the bits are the same (Note [Deterministic splits])."""
    from .ops._launch import launch
    from .ops.split_kv import _combine_kernel, combine_launch_config, row_tiling

    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    q_rows = q.shape[1] if q.dim() == 4 else 1
    constexprs, options, c_grid = combine_launch_config(hq // hkv, q_rows, d, sinks is not None)
    multi = q.dim() == 4
    launch(_combine_kernel, (b * hkv * row_tiling(q_rows, hq // hkv).n_rt, *c_grid),
           (slots, q if sinks is None else sinks, o, lse, n_slots, hkv, *_bqh(o.stride(), multi),
            *_bqh(lse.stride(), multi), sinks.stride(0) if sinks is not None else 0), constexprs, **options)


def _dequantize(k, v, k_scale, v_scale, kv_layout, mode):
    """``k.float() * k_scale``, ``v.float() * v_scale`` (per-head scales on the KV-head dim) for the torch
    path; the cache itself when it is not FP8."""
    if mode == 0:
        return k, v
    head_dim = 1 if kv_layout == "HND" else 2
    out = []
    for t, sc in ((k, k_scale), (v, v_scale)):
        sc = torch.as_tensor(sc, dtype=torch.float32, device=t.device)
        if sc.dim() == 1:
            shape = [1, 1, 1, 1]
            shape[head_dim] = sc.shape[0]
            sc = sc.view(shape)
        out.append(t.float() * sc)
    return out


def _torch_path(q, k, v, seq_lens, block_table, row_limits, sm_scale, kv_layout, window_left, logit_softcap, sinks,
                return_lse, o_out, lse_out):
    from .reference import attention, paged_to_dense

    if block_table is not None:
        k, v = (paged_to_dense(t, block_table, kv_layout) for t in (k, v))
    st = attention(q, k, v, seq_lens, sm_scale=sm_scale, kv_layout=kv_layout, row_limits=row_limits,
                   window_left=window_left, logit_softcap=logit_softcap, sinks=sinks)
    o = st.o.to(q.dtype if o_out is None else o_out.dtype)
    if o_out is not None:
        o = o_out.copy_(o)
    lse = st.lse if lse_out is None else lse_out.copy_(st.lse)
    return AttentionState(o, lse) if return_lse else o
