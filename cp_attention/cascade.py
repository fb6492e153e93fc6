"""``cascade_decode``: decode attention over a cache stored in levels (shared prefixes, then each request's own).

Note [Cascade attention]
------------------------
A request's keys are the concatenation of its segments of every level: e.g. a system prompt shared by
the whole batch, a document shared by a group of requests, then the request's own generated tokens.
The key sets are disjoint, so the attention over their union is the ⊕ of one state per level (the
cascade level of docs/design.md). A level is computed by the kernel that suits its sharing:

* one segment per request (``S == B``, no ``segment_ids``): the split-KV decode kernel
  (:func:`cp_attention.flash_decode`), which streams each request's K/V once;
* shared segments (``S == 1``, or ``segment_ids``): the shared-segment kernel (``ops/prefix.py``), which
  stacks the query rows of all the requests reading a segment into the ``M`` dimension of a tile, so a
  shared K/V tile is read once per 128 query rows and multiplied on the tensor cores instead of being
  re-read by every request (Note [Shared-segment attention as a prefill-shaped tile]).

A level is dense (``[S, Hkv, T, D]``) or paged (a page pool ``[P, page_size, Hkv, D]`` read through a
block table ``[S, max_pages]``). With ``Q`` query rows per request (drafts) the causal rule applies to
the last level, the request's own tokens: its row ``i`` sees the positions ``< len - Q + 1 + i``; rows see
every key of the earlier levels.

Each level writes float32 states straight into slots of one workspace ``[n_slots, B * Q * Hq, D]`` (a
shared level one slot per KV split); one launch of the merge kernel then folds all slots into the output.
Levels with no positions add no slot; a request that reads no key at all gets ``o = 0``, ``lse = -inf``.
The layout (slots, splits, tiles) depends on shapes only, and no device value is read on the host for
CUDA tensors, so a call can be captured in a CUDA graph.

Overlap. A shared level is bound by the tensor cores (one 128-row program per SM, one wave), a
per-request level by bytes. On CUDA the shared levels are launched first and the per-request levels on a
side stream forked before them and joined before the merge, so the per-request programs can run beside
the shared ones on the SMs and read with the bandwidth the shared kernel leaves idle (5-10% of the step:
docs/tuning.md). The kernels and the slots are the same either way, so the result is bitwise the same. In
a CUDA graph the fork and join are captured as two branches, which become ready together, when the kernel
before the fork completes; the overlap needs the shared level's programs placed first. So the
shared-segment kernel is launched with programmatic dependent launch (Note [Programmatic dependent launch]
in ``ops/split_kv.py``: it is placed while the kernel ahead finishes, and waits for it before reading), and
the per-request levels on the side stream without it (placed early, their many programs would take the SMs
first and serialise the levels).

Eager calls. As in Note [The decode hot path] (``decode.py``), a call reads every tensor argument's shape,
strides, dtype, device and 16-byte alignment, and the other arguments' classes, into one key; a CUDA call
whose key a validated call prepared skips the checks and replays what that call prepared (``_Prepared``:
the levels' kinds, the plans, the workspace slots, the shared-segment and merge kernels'
:class:`~cp_attention.ops._launch.Launcher` objects with their integer arguments bound), launching with the
tensors' pointers. What the key does not fix (``sm_scale``, ``return_lse``, the softcap's and float FP8
scales' values, tensor scales' values once per version) is checked at every call; the per-request levels go
through ``flash_decode``'s own hot path. Host tensors (the interpreter) are checked in full at every call.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple, Optional

import torch

from . import _device, _library
from ._constants import FP8_DTYPES
from ._device import use_triton
from ._validate import (PER_REQUEST, SEGMENTS, SHARED_ALL, check_bool, check_cascade_args, check_inference,
                        check_scale_values, kernel_scalars, optional_signature, scale_values_checked, signature)
from .decode import flash_decode
from .heuristics import prefix_plan
from .quant import dequantize
from .state import AttentionState, merge_states

__all__ = ["CascadeLevel", "cascade_decode"]


class CascadeLevel(NamedTuple):
    """One level of a cascade KV cache.

    ``k``, ``v``: ``[S, Hkv, T, D]`` (HND; unit stride in D), the ``S`` segments of this level, q's dtype
    (or FP8, with ``cascade_decode``'s ``k_scale``/``v_scale``) and device; or, with ``block_table``, page
    pools ``[P, page_size, Hkv, D]`` (the vLLM / FlashInfer layout). ``seq_lens``: ``[S]`` int32/int64, valid
    length of each segment (``None``: all ``T``; required with ``block_table``). ``segment_ids``: ``[B]`` int32/int64, the segment each request reads;
    ``None`` when ``S == 1`` (every request reads it) or ``S == B`` (request ``b`` reads segment ``b``).
    ``block_table``: ``[S, max_pages]`` int32/int64: position ``p`` of segment ``s`` lives in page
    ``block_table[s, p // page_size]``, slot ``p % page_size``.
    """

    k: torch.Tensor
    v: torch.Tensor
    seq_lens: Optional[torch.Tensor] = None
    segment_ids: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None


def cascade_decode(q, levels, *, sm_scale=None, k_scale=None, v_scale=None, logit_softcap=None, sinks=None,
                   return_lse=False, _num_splits=None, _config=None, _out=None, _checked=None):
    """Exact decode attention over a cache stored in levels of shared and per-request segments.

    Equals :func:`cp_attention.flash_decode` over, per request, the concatenation of its segments of
    every level (with one query row, in any order: attention does not depend on the order of the keys;
    with ``Q`` draft rows, the causal rule applies to the last level, which then holds the request's own
    tokens, at least ``Q`` of them, and comes last in the concatenation), while a shared
    segment's K/V is read once for all the requests that share it
    (Note [Cascade attention]).

    Args:
        q: ``[B, Hq, D]``, or ``[B, Q, Hq, D]`` (``Q <= 16`` new tokens per request, the causal rule on
            the last level), float16, bfloat16 or float32; last dim contiguous; ``D`` a multiple of 8 in
            ``[32, 256]``.
        levels: non-empty list of :class:`CascadeLevel`; every level has q's dtype (or FP8), device, head dim and
            the same ``Hkv`` (``Hq % Hkv == 0``: query head ``h`` reads KV head ``h // (Hq // Hkv)``).
            ``seq_lens``, ``segment_ids`` and the used pages of ``block_table`` are checked on the host
            for CPU tensors; on the GPU they are clamped to their range.
        sm_scale: score scale (default ``1 / sqrt(D)``).
        k_scale, v_scale: the dequantisation scales of the FP8 levels (levels may be stored in
            ``float8_e4m3fn``/``float8_e5m2`` with ``q`` float16/bfloat16), as in
            :func:`cp_attention.flash_decode`; required when a level is FP8, refused otherwise.
        logit_softcap: scores ``c * tanh(sm_scale * q.k / c)`` on every level, as in :func:`flash_decode`.
        sinks: ``[Hq]`` float32 attention sinks, joined once into the merge of the levels.
        return_lse: also return the natural-log LSE.

    Returns:
        ``o`` of q's shape and dtype, or ``AttentionState(o, lse of shape q.shape[:-1] float32, natural
        log)`` with ``return_lse=True``. A row that reads no key gets ``o = 0``, ``lse = -inf`` (with
        ``sinks``, ``lse`` = its head's sink). CUDA
        tensors run the Triton kernels (no host sync); CPU tensors run them under ``TRITON_INTERPRET=1``,
        else the float32 torch path.

    >>> q = torch.randn(3, 8, 64)
    >>> prefix = CascadeLevel(torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64))
    >>> suffix = CascadeLevel(torch.randn(3, 2, 16, 64), torch.randn(3, 2, 16, 64), torch.tensor([16, 5, 0]))
    >>> cascade_decode(q, [prefix, suffix], return_lse=True).lse.shape
    torch.Size([3, 8])
    """
    check_inference("cascade_decode", ("q", "levels", "k_scale", "v_scale", "sinks"), q, levels, k_scale, v_scale,
                    sinks)
    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        return _library.cascade_decode(q, levels, sm_scale, k_scale, v_scale, logit_softcap, sinks, return_lse,
                                       (_num_splits, _config, _out))
    plain = _checked is None and _out is None and _num_splits is None and _config is None
    key = prep = None
    if plain and q.__class__ is torch.Tensor:  # Note [Cascade attention], eager calls
        try:
            key = _key(q, levels, sm_scale, k_scale, v_scale, logit_softcap, sinks)
            prep = _PREPARED.get(key)
        except (AttributeError, TypeError, ValueError, RuntimeError):  # the checks say what is wrong
            key = prep = None
    if prep is not None and prep.cuda is not None:
        # A CUDA call whose key a validated call prepared: only what the key does not fix is checked.
        if return_lse is not False and return_lse is not True:
            check_bool("return_lse", return_lse)
        scalars = kernel_scalars(prep.sm_scale, sm_scale, logit_softcap, k_scale, v_scale)
        if isinstance(k_scale, torch.Tensor) and not (scale_values_checked(k_scale) and scale_values_checked(v_scale)):
            check_scale_values("k_scale", k_scale)  # once per tensor version, as flash_decode
            check_scale_values("v_scale", v_scale)
        st = _run(prep, q, levels, scalars, (k_scale, v_scale), logit_softcap, sinks, None)
        return st if return_lse else st.o
    if _checked is None:  # (a context-parallel caller checked them in its agreement collective)
        _checked = check_cascade_args(q, levels, sm_scale=sm_scale, return_lse=return_lse, k_scale=k_scale,
                                      v_scale=v_scale, logit_softcap=logit_softcap, sinks=sinks)
    checked, kv_scale = _checked
    scalars = kernel_scalars(1.0 / math.sqrt(q.shape[-1]), sm_scale, logit_softcap, k_scale, v_scale)
    # Levels without positions add nothing to any request.
    if use_triton(q) and q.numel() > 0 and any(lv.t_max > 0 for lv in checked):
        prep = _prepare(q, checked, (k_scale, v_scale, kv_scale), logit_softcap is not None, sinks, _num_splits,
                        _config, _out is None)
        st = _run(prep, q, levels, scalars, (k_scale, v_scale), logit_softcap, sinks, _out)
        if key is not None and prep.cuda is not None:
            if len(_PREPARED) >= _MAX_PREPARED:
                _PREPARED.clear()
            _PREPARED[key] = prep
    else:  # the torch path (fp32), or nothing to read
        work = [lv for lv in checked if lv.t_max > 0]
        st = _cascade_torch(q, work, checked[-1], scalars[0], (k_scale, v_scale, kv_scale), logit_softcap, sinks)
        if _out is not None:
            st = AttentionState(_out[0].copy_(st.o.reshape(_out[0].shape)), _out[1].copy_(st.lse.reshape(-1)))
        else:
            st = AttentionState(st.o.to(q.dtype), st.lse)
    return st if return_lse else st.o


class _Prepared(NamedTuple):
    """What a validated Triton call of a given key launches (Note [Cascade attention], eager calls)."""

    work: tuple  # per level with positions: (index in levels, kind, segments, T_max, FP8, the last level)
    launchers: tuple  # per work level: its shared-segment kernel's Launcher, or None for a per-request level
    starts: tuple  # each work level's first workspace slot, then the slot count
    merge: object  # the merge kernel's Launcher (None when the caller gives the output)
    side: bool  # the per-request levels run on the side stream
    kv_scale: int  # FP8 scales: 0 none, 1 floats, 2 tensors
    rows: int  # B * Q * Hq
    q_rows: int
    cuda: int | None  # CUDA device index; None: the interpreter
    sm_scale: float  # the default, 1 / sqrt(D)


_PREPARED: dict = {}
_MAX_PREPARED = 1024


def _key(q, levels, sm_scale, k_scale, v_scale, logit_softcap, sinks) -> tuple:
    """What a prepared call depends on (Note [Cascade attention], eager calls): every tensor's shape,
    strides, dtype, device and 16-byte alignment; the Python arguments' classes (their values are checked at
    every call). Raises on what is not a list of :class:`CascadeLevel` (the call then takes the checked
    path)."""
    if levels.__class__ is not list and levels.__class__ is not tuple:
        raise TypeError("levels")
    lv = []
    for lvl in levels:
        if lvl.__class__ is not CascadeLevel:
            raise TypeError("levels")
        lv.append((signature(lvl.k), signature(lvl.v), optional_signature(lvl.seq_lens),
                   optional_signature(lvl.segment_ids), optional_signature(lvl.block_table)))
    return (signature(q), tuple(lv), sm_scale.__class__, logit_softcap.__class__, optional_signature(sinks),
            signature(k_scale) if isinstance(k_scale, torch.Tensor) else k_scale.__class__,
            signature(v_scale) if isinstance(v_scale, torch.Tensor) else v_scale.__class__)


def _all_visible(q, t_max):
    """Row limits ``[B, Q, 2]`` that let every query row see every position (a level that is not the last)."""
    limits = torch.zeros((q.shape[0], q.shape[1], 2), dtype=torch.int32, device=q.device)
    limits[..., 1] = t_max
    return limits


def _prepare(q, checked, scales, softcap: bool, sinks, fixed_splits, config, merge: bool) -> _Prepared:
    """The plans and launchers of a validated call on the Triton kernels (``checked``: its
    :class:`~cp_attention._validate.Level` list; ``scales``: ``(k_scale, v_scale, kv_scale mode)``); ``merge``:
    the call allocates its output (no ``_out``)."""
    from .ops.merge import merge_launcher
    from .ops.prefix import prefix_launcher

    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    q_rows = q.shape[1] if q.dim() == 4 else 1
    rows = q.numel() // d  # B * Q * Hq
    cuda = q.get_device() if q.is_cuda else None
    work = [(i, lv) for i, lv in enumerate(checked) if lv.t_max > 0]
    lvl0 = work[0][1].lvl
    hkv = lvl0.k.shape[2] if lvl0.block_table is not None else lvl0.k.shape[1]
    group = hq // hkv
    sms = _device.num_sms(q.device)
    pdl = _device.use_pdl(q.device)
    plans = []  # PrefixPlan, or None for a per-request level
    for _, lv in work:
        if lv.kind == PER_REQUEST:
            plans.append(None)
            continue
        # Segments read by some request: at most min(S, B); 1 when every request reads the one segment.
        n_read = 1 if lv.kind == SHARED_ALL else min(lv.n_seg, b)
        plans.append(prefix_plan(b, q_rows * group, hkv, n_read, lv.t_max, d, q.dtype, sms, fixed_splits, config))
    starts = [0]
    for plan in plans:
        starts.append(starts[-1] + (1 if plan is None else plan.num_splits))
    o_strides, lse_strides = (rows * d, d), (rows, 1)  # the workspace [slots, rows, D] and [slots, rows]
    launchers = []
    for (i, lv), plan in zip(work, plans):
        if plan is None:
            launchers.append(None)
            continue
        lvl = lv.lvl
        layout, k_scale, v_scale, lv_scale = _level_args(lvl, scales)
        launchers.append(prefix_launcher(
            q, lvl.k, lvl.v, lvl.seq_lens, lvl.block_table, o_strides, rows, plan=plan,
            has_segments=lv.kind == SEGMENTS,
            kv_layout=layout, causal=i == len(checked) - 1, k_scale=k_scale, v_scale=v_scale, kv_scale=lv_scale,
            softcap=softcap, pdl=pdl, device=cuda))
    has_shared = any(p is not None for p in plans)
    side = q.is_cuda and has_shared and any(p is None for p in plans)
    merger = merge_launcher(starts[-1], rows, d, o_strides, lse_strides, sinks, cuda) if merge else None
    return _Prepared(tuple((i, lv.kind, lv.n_seg, lv.t_max, lv.lvl.k.dtype in FP8_DTYPES, i == len(checked) - 1)
                           for i, lv in work),
                     tuple(launchers), tuple(starts), merger, side, scales[2], rows, q_rows, cuda, 1.0 / math.sqrt(d))


def _run(prep: _Prepared, q, levels, scalars: tuple, scales: tuple, softcap, sinks, out) -> AttentionState:
    """Launch ``prep``'s kernels for these arguments (of the prepared key): the shared levels, the
    per-request ones (on the side stream), the merge. ``scalars``: the kernels' ``(sm_scale, k_scale, v_scale,
    cap)`` (:func:`~cp_attention._validate.kernel_scalars`); ``scales``: the FP8 scales as given. Tensors go to
    a launcher's first launch (it compiles; the interpreter runs) and to launch hooks; later launches on CUDA
    take their pointers."""
    from .ops.merge import merge_states_into

    d, rows, dev = q.shape[-1], prep.rows, q.device
    n_slots = prep.starts[-1]
    o_all = _device.new_buffer((n_slots, rows, d), torch.float32, dev)
    lse_all = _device.new_buffer((n_slots, rows), torch.float32, dev)
    k_scale, v_scale = scales
    scale, ksf, vsf, cap = scalars
    side = _side_stream(dev) if prep.side else None
    stream = torch._C._cuda_getCurrentRawStream(prep.cuda) if prep.cuda is not None else None
    if side is not None:
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)  # the fork, before the shared levels' launches
    # The shared levels first, then the per-request ones on a side stream (Note [Cascade attention], overlap)
    spans = zip(prep.work, prep.launchers, prep.starts, prep.starts[1:])
    for (i, kind, n_seg, _, fp8, _), launcher, slot, end in spans:
        if launcher is None:
            continue
        lvl = levels[i]
        perm = tiles = q
        if kind == SEGMENTS:
            perm, tiles = _tile_table(lvl.segment_ids, n_seg, prep.q_rows * launcher.constexprs["GROUP_SIZE"],
                                      launcher.constexprs["BLOCK_M"], launcher.grid[0])
        k_sc, v_sc = (k_scale, v_scale) if fp8 and prep.kv_scale == 2 else (q, q)
        ks, vs = (ksf, vsf) if fp8 else (1.0, 1.0)
        sl, bt = (q if t is None else t for t in (lvl.seq_lens, lvl.block_table))
        if launcher.compiled is not None and stream is not None:
            launcher.launch_ptrs(stream, (q.data_ptr(), lvl.k.data_ptr(), lvl.v.data_ptr(), sl.data_ptr(),
                                          bt.data_ptr(), perm.data_ptr(), tiles.data_ptr(), k_sc.data_ptr(),
                                          v_sc.data_ptr(), o_all.data_ptr() + slot * rows * d * 4,
                                          lse_all.data_ptr() + slot * rows * 4, scale, ks, vs, cap))
        else:
            launcher(q, lvl.k, lvl.v, sl, bt, perm, tiles, k_sc, v_sc, o_all[slot:end], lse_all[slot:end], scale, ks,
                     vs, cap)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for (i, _, _, t_max, _, is_last), launcher, slot in zip(prep.work, prep.launchers, prep.starts):
            if launcher is not None:
                continue
            lvl = levels[i]  # its fp32 state goes straight into its slot, unrounded
            layout, lk_scale, lv_scale, _ = _level_args(lvl, (k_scale, v_scale, prep.kv_scale))
            limits = _all_visible(q, t_max) if prep.q_rows > 1 and not is_last else None
            flash_decode(q, lvl.k, lvl.v, lvl.seq_lens, block_table=lvl.block_table, kv_layout=layout,
                         sm_scale=scale, k_scale=lk_scale, v_scale=lv_scale, logit_softcap=softcap, row_limits=limits,
                         _pdl=side is None,
                         out=AttentionState(o_all[slot].view(q.shape), lse_all[slot].view(q.shape[:-1])))
    if side is not None:
        main.wait_stream(side)  # the join, before the merge
    if out is None:
        o = _device.new_buffer(tuple(q.shape), q.dtype, dev)
        lse = _device.new_buffer(tuple(q.shape[:-1]), torch.float32, dev)
        m = prep.merge
        if m.compiled is not None and stream is not None:
            lp = lse_all.data_ptr()
            m.launch_ptrs(stream, (o_all.data_ptr(), lp, lp if sinks is None else sinks.data_ptr(), o.data_ptr(),
                                   lse.data_ptr(), lp))
        else:
            m(o_all, lse_all, lse_all if sinks is None else sinks, o.view(rows, d), lse.view(rows), lse_all)
        return AttentionState(o, lse)
    # An fp32 state of [rows, D] and [rows] views (the context-parallel exchange buffer), and where the
    # merge may push it to the exchange's peers (exchange.Push or None)
    push = out[2] if len(out) > 2 else None
    merge_states_into(o_all, lse_all, out[0], out[1], sinks=sinks, one_warp=True,
                      push=push.args if push is not None else None)
    if push is not None:
        push.done = True
    return AttentionState(out[0], out[1])


def _level_args(lvl, scales):
    """``(kv_layout, k_scale, v_scale, kv_scale)`` of a level: NHD pages or a dense HND cache; the FP8
    scales (``scales``) for an FP8 level, none otherwise."""
    k_scale, v_scale, kv_scale = scales if lvl.k.dtype in FP8_DTYPES else (None, None, 0)
    return ("NHD" if lvl.block_table is not None else "HND"), k_scale, v_scale, kv_scale


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` (one per device, kept) on which the per-request levels run beside the
    shared ones (Note [Cascade attention])."""
    return torch.cuda.Stream(device=device)


def _tile_table(segment_ids, n_seg, group, block_m, n_tiles):
    """Requests sorted by segment (``perm [B]`` int64) and the row-tile table ``[n_tiles, 3]`` int32 of
    (segment, first segment-sorted row, valid rows), built with device ops only (no host sync).

    Rows are numbered request-major in the sorted order (``row = sorted position * group + row in the
    request``, ``group`` rows per request and KV head); a segment's ``count * group`` rows are cut into
    ``ceil(rows / block_m)`` tiles; tiles past the total have 0 valid rows.
    """
    dev = segment_ids.device
    seg = segment_ids.long().clamp(0, n_seg - 1)
    counts = torch.zeros(n_seg, dtype=torch.long, device=dev).scatter_add_(0, seg, torch.ones_like(seg))
    perm = torch.argsort(seg, stable=True)
    rows = counts * group
    seg_tiles = (rows + block_m - 1) // block_m
    tile_end = torch.cumsum(seg_tiles, 0)
    t = torch.arange(n_tiles, device=dev)
    t_seg = torch.searchsorted(tile_end, t, right=True)
    valid = t_seg < n_seg
    t_seg = t_seg.clamp(max=n_seg - 1)
    local_row0 = (t - (tile_end - seg_tiles)[t_seg]) * block_m
    n_rows = torch.where(valid, (rows[t_seg] - local_row0).clamp(max=block_m), torch.zeros_like(t))
    row0 = (torch.cumsum(rows, 0) - rows)[t_seg] + local_row0
    return perm, torch.stack([t_seg, row0, n_rows], dim=1).to(torch.int32)


def _cascade_torch(q, work, last, scale, scales, softcap, sinks) -> AttentionState:
    """The float32 torch path: each level gathered per request, attended by the reference (the causal rule
    on the last level only), merged by ⊕; returns an fp32 state."""
    from .reference import attention, paged_to_dense

    b = q.shape[0]
    q_rows = q.shape[1] if q.dim() == 4 else 1
    states = []
    for lv in work:
        lvl = lv.lvl
        if lv.kind == PER_REQUEST:
            idx = torch.arange(b, device=q.device)
        elif lv.kind == SHARED_ALL:
            idx = torch.zeros(b, dtype=torch.long, device=q.device)
        else:
            idx = lvl.segment_ids.long()
        k, v = lvl.k, lvl.v
        if k.dtype in FP8_DTYPES:
            k, v = dequantize(k, v, scales[0], scales[1], "NHD" if lvl.block_table is not None else "HND")
        if lvl.block_table is not None:  # [S, T, Hkv, D] -> [S, Hkv, T, D]
            k, v = (paged_to_dense(t, lvl.block_table, "NHD").transpose(1, 2) for t in (k, v))
        seq = lvl.seq_lens[idx] if lvl.seq_lens is not None else None
        limits = _all_visible(q, lv.t_max) if q_rows > 1 and lv is not last else None
        states.append(attention(q, k[idx], v[idx], seq, sm_scale=scale, row_limits=limits, logit_softcap=softcap))
    if not states:
        st = AttentionState.empty(tuple(q.shape[:-1]), q.shape[-1], device=q.device)
        return st if sinks is None else AttentionState(st.o, sinks.float().expand(st.lse.shape).clone())
    return merge_states(torch.stack([s.o.float() for s in states]), torch.stack([s.lse for s in states]),
                        sinks=sinks)
