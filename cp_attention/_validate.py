"""Every argument check of the public functions, once: each raises ``TypeError``/``ValueError`` naming the
argument and what was expected, before any kernel runs."""
from __future__ import annotations

import math
import numbers
import weakref
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from ._constants import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, LOG2E

MAX_Q_ROWS = 16  # query rows per request (speculative drafts, MTP)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, t, *, dtypes=None, ndim=None, device=None) -> None:
    """``t`` is a tensor with a dtype in ``dtypes``, ``ndim`` dims and on ``device`` (each if given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        raise ValueError(f"{name} must hold data (a CPU or CUDA tensor), got a meta tensor")
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


def check_device(name: str, device) -> torch.device:
    """Where a cache is built: ``None`` (the CPU), the CPU or an available CUDA device (a bare ``"cuda"`` as the
    current one, where torch puts the tensors it makes)."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise TypeError(f"{name} must be a torch.device, its name or a CUDA index, got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"{name} {dev} is not an available CUDA device")
        return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cpu":
        raise ValueError(f"{name} must be the CPU or a CUDA device, got {dev}")
    return dev


def check_no_overlap(name: str, t: torch.Tensor) -> None:
    """An output whose elements are distinct memory (no broadcast, no self-overlapping strides): each dim, by
    increasing stride, steps over everything the smaller ones span."""
    span = 0
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride <= span:
            raise ValueError(f"{name} must not overlap itself (an expanded or broadcast view), got shape "
                             f"{tuple(t.shape)} and strides {t.stride()}")
        span += (size - 1) * stride


def check_disjoint(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Two outputs in distinct memory: no byte of one lies in the other (views interleaved in one buffer, such
    as ``[o | lse]`` rows, pass). The addresses are compared only where the two spans meet."""
    if is_fake(a) or is_fake(b) or not a.numel() or not b.numel():
        return
    rel = b.data_ptr() - a.data_ptr()
    if -_span_bytes(b) < rel < _span_bytes(a) and _addresses_meet(a, b, rel):
        raise ValueError(f"{name_a} and {name_b} must not share memory, got views with bytes in common")


def _span_bytes(t: torch.Tensor) -> int:
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    off = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        off = off[..., None] + torch.arange(size) * stride
    return off.reshape(-1)


def _addresses_meet(a: torch.Tensor, b: torch.Tensor, rel: int) -> bool:
    """Whether a byte of ``b`` (``rel`` bytes after ``a``'s first) lies in an element of ``a`` (host arithmetic
    on the strides; no device work)."""
    starts = torch.sort(_element_offsets(a) * a.element_size()).values
    addresses = (rel + _element_offsets(b)[:, None] * b.element_size() + torch.arange(b.element_size())).reshape(-1)
    i = (torch.searchsorted(starts, addresses, right=True) - 1).clamp(min=0)
    return bool(((addresses >= starts[i]) & (addresses < starts[i] + a.element_size())).any())


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


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def finite_float32(x, bound: float = FLOAT32_MAX) -> bool:
    """A real number that float32 holds as a finite value (``abs(x) <= bound``, ``FLOAT32_MAX`` unless given)."""
    try:
        return math.isfinite(float(x)) and abs(float(x)) <= bound
    except OverflowError:  # an int beyond any float
        return False


# The kernels take the softcap times log2(e) as a float32 scalar.
SOFTCAP_MAX = FLOAT32_MAX / LOG2E


def check_sm_scale(sm_scale) -> None:
    if sm_scale is not None and (not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool)
                                 or not finite_float32(sm_scale)):
        raise TypeError(f"sm_scale must be a real number finite in float32 or None, got {sm_scale!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


INT32_MAX = 2**31 - 1


def check_not_taken(fn: str, given, reasons: dict) -> None:
    """None of the arguments named in ``reasons`` (name -> why ``fn`` sets it itself) is in ``given`` (the
    caller's keyword arguments)."""
    for name, why in reasons.items():
        if name in given:
            raise TypeError(f"{fn} takes no {name} ({why})")


def check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    """A Python int (not a bool) in ``[lo, hi]``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    hi = INT32_MAX if hi is None else hi  # what a kernel's int32 argument holds
    if value < lo or value > hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
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
            check_scale_values(name, sc)
            kinds.add(2)
        elif isinstance(sc, numbers.Real) and not isinstance(sc, bool):
            if not (finite_float32(sc) and sc > 0):
                raise ValueError(f"{name} must be a positive number finite in float32, got {sc!r}")
            kinds.add(1)
        else:
            raise TypeError(f"{name} must be a float, a 0-d or an [Hkv] float32 tensor, got {type(sc).__name__}")
    if len(kinds) > 1:
        raise TypeError("k_scale and v_scale must both be floats or both be tensors")
    return kinds.pop()


# CUDA scale tensors whose values were checked: id -> (a weak reference to the tensor, the version checked). Keyed
# by the tensor itself, not its address: a new tensor the allocator places where a checked one lived is checked anew.
_CHECKED_SCALES: dict = {}


def check_scale_values(name: str, sc: torch.Tensor) -> None:
    """The values of an FP8 scale tensor are finite and > 0. A CPU tensor is checked at every call; a CUDA tensor
    once per tensor and in-place version, since reading it is a host sync: again after an in-place update, not
    while a CUDA graph is being captured (a replay reads whatever the tensor holds then), nor for the fake
    tensors of a torch.compile trace."""
    if is_fake(sc):
        return
    if sc.is_cuda and (scale_values_checked(sc) or torch.cuda.is_current_stream_capturing()):
        return
    bad = ~(torch.isfinite(sc) & (sc > 0))
    if bool(bad.any()):
        raise ValueError(f"{name} must hold positive finite scales, got {sc[bad].flatten()[:4].tolist()}")
    if sc.is_cuda:
        if len(_CHECKED_SCALES) > 4096:
            _CHECKED_SCALES.clear()
        _CHECKED_SCALES[id(sc)] = (weakref.ref(sc), sc._version)


def scale_values_checked(sc: torch.Tensor) -> bool:
    """Whether this CUDA scale tensor, at its current version, was checked (the decode hot path's test)."""
    seen = _CHECKED_SCALES.get(id(sc))
    return seen is not None and seen[0]() is sc and seen[1] == sc._version


def check_variants(window_left, logit_softcap, sinks, hq: int, device) -> None:
    """A sliding window (int >= 0), a logit softcap (a float > 0 whose product with log2(e), the kernels' scalar,
    is finite in float32) and attention sinks (``[Hq]`` float32 on ``device``), each optional."""
    if window_left is not None:
        check_int("window_left", window_left, 0)
    if logit_softcap is not None:
        if not isinstance(logit_softcap, numbers.Real) or isinstance(logit_softcap, bool):
            raise TypeError(f"logit_softcap must be a float > 0 or None, got {logit_softcap!r}")
        if not (finite_float32(logit_softcap, SOFTCAP_MAX) and logit_softcap > 0):
            raise ValueError(f"logit_softcap must be a float in (0, {SOFTCAP_MAX:.4g}] (times log2(e), finite in "
                             f"float32), got {logit_softcap!r}")
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), ndim=1, device=device)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must have shape [{hq}] (one logit per query head), got {tuple(sinks.shape)}")


def check_query(q) -> int:
    """``q [B, Hq, D]`` or ``[B, Q, Hq, D]`` (``1 <= Q <= MAX_Q_ROWS``) in a float dtype, unit stride in D, a
    supported head dim. Returns ``Q`` (1 for a 3-dim ``q``)."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must have 3 dims [B, Hq, D] or 4 dims [B, Q, Hq, D], got shape {tuple(q.shape)}")
    check_unit_stride("q", q)
    q_rows = q.shape[1] if q.dim() == 4 else 1
    if not 1 <= q_rows <= MAX_Q_ROWS:
        raise ValueError(f"q must have 1 to {MAX_Q_ROWS} query rows per request in dim 1, got {q_rows}")
    check_head_dim(q.shape[-1])
    return q_rows


class Cache(NamedTuple):
    """What :func:`check_cache` found: KV heads, sequences (or segments), capacity ``T_max`` (``max_pages *
    page_size`` for a page pool), page size (0: dense) and pages in the pool."""

    hkv: int
    n_seq: int
    t_max: int
    page_size: int
    num_pages: int


def check_cache(q, k, v, seq_lens, block_table, kv_layout: str, prefix: str = "", batch: int | None = None) -> Cache:
    """A KV cache for ``q`` (checked by :func:`check_query`): ``k``, ``v`` dense ``[N, Hkv, T, D]`` (``"HND"``)
    / ``[N, T, Hkv, D]`` (``"NHD"``), or page pools ``[P, Hkv, page, D]`` / ``[P, page, Hkv, D]`` read through
    ``block_table [N, max_pages]``; q's device and dtype (or FP8), unit stride in D, q's head dim, ``Hq % Hkv ==
    0``; ``seq_lens [N]`` in ``[0, T_max]`` (required with a block table), and the pages they reach inside the
    pool, both checked on the host for CPU tensors. ``prefix`` names the arguments (``"levels[0]."``); ``batch``:
    the ``N`` required (``q.shape[0]``), if any."""
    check_kv_layout(kv_layout)
    d, hq = q.shape[-1], q.shape[-2]
    kn, vn = f"{prefix}k", f"{prefix}v"
    for name, t in ((kn, k), (vn, v)):
        check_tensor(name, t, ndim=4, device=q.device)
        if t.dtype != q.dtype and t.dtype not in FP8_DTYPES:
            raise TypeError(f"{name} must have q's dtype {q.dtype} (or be an FP8 cache), got {t.dtype}")
        check_unit_stride(name, t)
    if v.dtype != k.dtype:
        raise TypeError(f"{vn} must have {kn}'s dtype {k.dtype}, got {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{vn} must have {kn}'s shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"{kn} must have head dim {d} (q.shape[-1]) in dim 3, got shape {tuple(k.shape)}")
    # dense: [N, Hkv, T, D] / [N, T, Hkv, D]; paged: [pages, Hkv, page, D] / [pages, page, Hkv, D]
    hkv, t_dim = (k.shape[1], 2) if kv_layout == "HND" else (k.shape[2], 1)
    if hkv < 1 or hq < 1 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of the KV heads of {kn} ({hkv}) for "
                         f"kv_layout={kv_layout}")
    if block_table is not None:
        bn = f"{prefix}block_table"
        check_tensor(bn, block_table, dtypes=INDEX_DTYPES, ndim=2, device=q.device)
        if seq_lens is None:
            raise ValueError(f"{prefix}seq_lens must be given with {bn} (a page pool has no length of its own)")
        page_size, num_pages = k.shape[t_dim], k.shape[0]
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"{kn} must be a page pool with at least one page of at least one slot, got shape "
                             f"{tuple(k.shape)}")
        n_seq, t_max = block_table.shape[0], block_table.shape[1] * page_size
    else:
        page_size, num_pages, n_seq, t_max = 0, 0, k.shape[0], k.shape[t_dim]
    if batch is not None and n_seq != batch:
        name, shape = (f"{prefix}block_table", block_table.shape) if block_table is not None else (kn, k.shape)
        raise ValueError(f"{name} must have batch {batch} (q.shape[0]) in dim 0, got shape {tuple(shape)}")
    if seq_lens is not None:
        check_index_tensor(f"{prefix}seq_lens", seq_lens, n_seq, q.device, lo=0, hi=t_max,
                           hi_name="max_pages * page_size" if page_size else f"T_max = {kn}.shape[{t_dim}]")
    if block_table is not None and not block_table.is_cuda and n_seq > 0:
        used = torch.arange(block_table.shape[1])[None, :] * page_size < seq_lens.long()[:, None]
        pages = block_table[used]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
            raise ValueError(f"{prefix}block_table must hold pages in [0, {num_pages - 1}] ({kn} has {num_pages} "
                             f"pages) where seq_lens reach, got values in [{int(pages.min())}, {int(pages.max())}]")
    return Cache(hkv, n_seq, t_max, page_size, num_pages)


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


def check_split_size(split_size, *, num_splits=None, plan=None, window_left=None) -> None:
    """``split_size``: None, or an int multiple of 16, without the arguments it replaces."""
    if split_size is None:
        return
    check_int("split_size", split_size, 16)
    if split_size % 16:
        raise ValueError(f"split_size must be a multiple of 16, got {split_size}")
    for name, value in (("num_splits", num_splits), ("plan", plan), ("window_left", window_left)):
        if value is not None:
            raise ValueError(f"split_size fixes the splits: {name} must be None with it, got {value!r}")


def check_plan(plan, *, t_max: int, q_rows: int, page_size: int, window_left=None, row_limits=False) -> None:
    """A :class:`~cp_attention.heuristics.DecodePlan` given to :func:`cp_attention.flash_decode` (checked on
    every path, though the torch path runs no plan): positive ints where the kernels need them, tiles of a
    power of two of at least 16 keys, warps a power of two, and splits that cover the positions a call reads
    (``num_splits * tiles_per_split * block_n`` of at least ``T_max``, or with a window its ``window_left +
    Q``; the one-warp kernel's splits start a tile below the first key, one tile more): a plan that reads
    fewer would leave keys out of the softmax. ``split_pages`` > 0 (a paged cache's entries of a split in
    registers, used without a window or row limits): a power of two of at least the entries a split touches,
    on pages of a power of two of at least 16 positions."""
    from .heuristics import MAX_SPLIT_PAGES, ONE_WARP_CONFIGS, DecodeConfig, DecodePlan, positions_read

    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must be a heuristics.DecodePlan, got {type(plan).__name__}")
    cfg = plan.config
    if not isinstance(cfg, DecodeConfig):
        raise TypeError(f"plan.config must be a heuristics.DecodeConfig, got {type(cfg).__name__}")
    block_n = check_int("plan.config.block_n", cfg.block_n, 16, 1024)
    warps = check_int("plan.config.num_warps", cfg.num_warps, 1, 32)
    for name, value, hint in (("block_n", block_n, "keys"), ("num_warps", warps, "warps")):
        if value & (value - 1):
            raise ValueError(f"plan.config.{name} must be a power of two ({hint}), got {value}")
    check_int("plan.config.num_stages", cfg.num_stages, 1, 8)
    for name in ("programs", "maxnreg", "warp_rows"):
        check_int(f"plan.config.{name}", getattr(cfg, name), 0, 255)
    splits = check_int("plan.num_splits", plan.num_splits, 1)
    tiles = check_int("plan.tiles_per_split", plan.tiles_per_split, 1)
    check_int("plan.streams", plan.streams, 1, block_n // 16)
    check_bool("plan.deterministic", plan.deterministic)
    check_bool("plan.page_tiles", plan.page_tiles)
    unaligned = window_left is not None or row_limits  # splits from the first key, not from a tile
    reach = positions_read(t_max, q_rows, window_left)
    if unaligned and cfg in ONE_WARP_CONFIGS:
        reach = min(t_max, reach + block_n - 1)
    if splits * tiles * block_n < reach:
        raise ValueError(f"plan covers {splits} splits x {tiles} tiles x {block_n} keys = {splits * tiles * block_n} "
                         f"positions, fewer than the {reach} this call reads (the cache's T_max, or the window's "
                         f"reach): heuristics.decode_plan(...) with this call's shapes gives one that covers them")
    pages = check_int("plan.split_pages", plan.split_pages, 0, MAX_SPLIT_PAGES)
    if pages and page_size and not unaligned:
        need = -(-tiles * block_n // page_size) + (page_size > block_n)  # a split starting mid-page: one more
        if page_size < 16 or page_size & (page_size - 1) or pages & (pages - 1) or pages < need:
            raise ValueError(f"plan.split_pages ({pages}) must be a power of two of at least the {need} block-table "
                             f"entries a split touches, on pages of a power of two of at least 16 positions "
                             f"(got {page_size}); 0 reads an entry a key")


def unpack_out(out):
    """``out`` of :func:`cp_attention.flash_decode` as ``(o, lse or None)``."""
    if isinstance(out, torch.Tensor):
        return out, None
    if not isinstance(out, tuple) or len(out) != 2 or not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"out must be a tensor or an AttentionState (o, lse) of tensors, got {type(out).__name__}")
    return out


def check_decode_args(q, k, v, seq_lens, *, block_table=None, num_splits=None, kv_layout="HND", plan=None,
                      out=None, row_limits=None, k_scale=None, v_scale=None, window_left=None, logit_softcap=None,
                      sinks=None, sm_scale=None, split_size=None, return_lse=False) -> CacheGeometry:
    """Every argument of :func:`cp_attention.flash_decode` (shapes, dtypes, devices, strides; index values of
    host tensors)."""
    q_rows = check_query(q)
    b, hq = q.shape[0], q.shape[-2]
    cache = check_cache(q, k, v, seq_lens, block_table, kv_layout, batch=b)
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
        check_plan(plan, t_max=cache.t_max, q_rows=q_rows, page_size=cache.page_size, window_left=window_left,
                   row_limits=row_limits is not None)
        if num_splits is not None:
            raise ValueError("num_splits must be None when plan is given (the plan fixes the splits)")
    if out is not None:
        o_out, lse_out = unpack_out(out)
        dtypes = (q.dtype,) if q.dtype == torch.float32 else (q.dtype, torch.float32)
        check_tensor("out", o_out, dtypes=dtypes, device=q.device)
        if o_out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(o_out.shape)}")
        check_unit_stride("out", o_out)
        check_no_overlap("out", o_out)
        if lse_out is not None:
            check_tensor("out.lse", lse_out, dtypes=(torch.float32,), device=q.device)
            if lse_out.shape != q.shape[:-1]:
                raise ValueError(f"out.lse must have shape {tuple(q.shape[:-1])}, got {tuple(lse_out.shape)}")
            check_no_overlap("out.lse", lse_out)
            check_disjoint("out", o_out, "out.lse", lse_out)
    check_sm_scale(sm_scale)
    check_split_size(split_size, num_splits=num_splits, plan=plan, window_left=window_left)
    check_bool("return_lse", return_lse)
    kv_scale = check_kv_scales(k_scale, v_scale, k.dtype, q.dtype, cache.hkv, q.device)
    return CacheGeometry(cache.hkv, cache.t_max, q_rows, cache.page_size, cache.num_pages, kv_scale)


# Kinds of cascade level (how its segments are read).
PER_REQUEST, SHARED_ALL, SEGMENTS = "per_request", "shared_all", "segments"


class Level(NamedTuple):
    """A validated :class:`cp_attention.CascadeLevel`: its kind, segment count and capacity (``max_pages *
    page_size`` when paged)."""

    lvl: tuple
    kind: str
    n_seg: int
    t_max: int


def check_cascade_args(q, levels, *, sm_scale=None, return_lse=False, k_scale=None, v_scale=None,
                       logit_softcap=None, sinks=None) -> tuple:
    """Every argument of :func:`cp_attention.cascade_decode`. Returns ``([Level], kv_scale mode)``."""
    from .cascade import CascadeLevel

    check_query(q)
    b, hq = q.shape[0], q.shape[-2]
    if isinstance(levels, CascadeLevel):
        raise TypeError("levels must be a list or tuple of CascadeLevel, got one CascadeLevel (wrap it in a list)")
    if not isinstance(levels, (list, tuple)):
        raise TypeError(f"levels must be a list or tuple of CascadeLevel, got {type(levels).__name__}")
    if len(levels) == 0:
        raise ValueError("levels must hold at least one CascadeLevel, got none")
    out, hkv0 = [], None
    for i, lvl in enumerate(levels):
        name = f"levels[{i}]"
        if not isinstance(lvl, CascadeLevel):
            raise TypeError(f"{name} must be a CascadeLevel, got {type(lvl).__name__}")
        # dense levels are [S, Hkv, T, D]; page pools [P, page, Hkv, D] (the vLLM / FlashInfer layout)
        cache = check_cache(q, lvl.k, lvl.v, lvl.seq_lens, lvl.block_table,
                            "NHD" if lvl.block_table is not None else "HND", prefix=f"{name}.")
        if cache.n_seq < 1:
            raise ValueError(f"{name} must have at least one segment, got shape {tuple(lvl.k.shape)}"
                             + (f" and block_table {tuple(lvl.block_table.shape)}" if cache.page_size else ""))
        if hkv0 is None:
            hkv0 = cache.hkv
        elif cache.hkv != hkv0:
            raise ValueError(f"{name}.k must have {hkv0} KV heads (as levels[0].k), got shape {tuple(lvl.k.shape)}")
        ids = lvl.segment_ids
        if ids is None:
            if cache.n_seq == b:
                kind = PER_REQUEST
            elif cache.n_seq == 1:
                kind = SHARED_ALL
            else:
                raise ValueError(f"{name}.segment_ids is None, so {name} must have 1 or B = {b} segments, "
                                 f"got {cache.n_seq}")
        else:
            check_index_tensor(f"{name}.segment_ids", ids, b, q.device, lo=0, hi=cache.n_seq - 1,
                               hi_name=f"{name} has {cache.n_seq} segments")
            kind = SEGMENTS
        out.append(Level(lvl, kind, cache.n_seq, cache.t_max))
    check_sm_scale(sm_scale)
    check_bool("return_lse", return_lse)
    check_variants(None, logit_softcap, sinks, hq, q.device)
    fp8 = [lv.lvl.k.dtype for lv in out if lv.lvl.k.dtype in FP8_DTYPES]
    kv_scale = check_kv_scales(k_scale, v_scale, fp8[0] if fp8 else q.dtype, q.dtype, hkv0, q.device)
    return out, kv_scale


def signature(t) -> tuple:
    """What a prepared call depends on of tensor ``t`` (the keys of Note [The decode hot path] and Note
    [Cascade attention]: everything the checks read of a CUDA tensor, and the launch's specialisation):
    shape, strides, dtype, device, 16-byte alignment."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def optional_signature(t) -> tuple | None:
    """:func:`signature`, or ``None`` for an absent tensor."""
    return None if t is None else signature(t)


def kernel_scalars(default_scale: float, sm_scale, logit_softcap, k_scale, v_scale) -> tuple:
    """The kernels' scalar arguments ``(sm_scale, k_scale, v_scale, softcap * log2(e))`` of arguments whose kinds
    were checked (the keys of Note [The decode hot path] and Note [Cascade attention] hold their classes); the
    values, which the keys do not hold, are checked here. Tensor FP8 scales are read by the kernels: 1.0 here.
    ``default_scale``: ``1 / sqrt(D)``, for ``sm_scale=None``."""
    if sm_scale is None:
        scale = default_scale
    else:
        if sm_scale.__class__ is not float or not -FLOAT32_MAX <= sm_scale <= FLOAT32_MAX:
            check_sm_scale(sm_scale)
        scale = float(sm_scale)
    if logit_softcap is None:
        cap = 1.0
    else:
        if not 0 < logit_softcap <= SOFTCAP_MAX:
            check_variants(None, logit_softcap, None, 1, None)
        cap = float(logit_softcap) * LOG2E
    if k_scale is None or isinstance(k_scale, torch.Tensor):
        return scale, 1.0, 1.0, cap
    if not (0 < k_scale <= FLOAT32_MAX and 0 < v_scale <= FLOAT32_MAX):
        check_kv_scales(k_scale, v_scale, torch.float8_e4m3fn, torch.bfloat16, 1, None)
    return scale, float(k_scale), float(v_scale), cap


def check_inference(fn: str, names: tuple, *args) -> None:
    """``fn`` is an inference op (it has no backward): while grad mode is on, none of ``args`` (named by
    ``names``; tensors, ``None``, Python scalars, or tuples and lists of them such as an ``AttentionState``
    or a list of ``CascadeLevel``) may require grad, since its output would silently carry no gradient.
    Raises ``ValueError`` naming ``fn`` and the argument. Under ``torch.no_grad()`` or
    ``torch.inference_mode()`` it reads the grad mode only; else each tensor costs one test, and names are
    built only for an argument that requires grad."""
    if torch.is_grad_enabled() and _requires_grad(args):
        _name_requires_grad(fn, names, args)


def _requires_grad(args) -> bool:
    """Whether a tensor in ``args`` (nested in tuples and lists) requires grad."""
    tensor = torch.Tensor
    for x in args:
        if x is None:
            continue
        if x.__class__ is tensor or isinstance(x, tensor):
            if x.requires_grad:
                return True
        elif isinstance(x, (tuple, list)) and _requires_grad(x):
            return True
    return False


def _name_requires_grad(fn: str, names: tuple, args) -> None:
    """Raise for the first argument of ``args`` (named by ``names``) holding a tensor that requires grad."""
    for name, x in zip(names, args):
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                raise ValueError(f"{fn} is an inference op: {name} requires grad; call it under torch.no_grad() "
                                 f"or torch.inference_mode(), or detach the input")
        elif isinstance(x, (tuple, list)):
            fields = getattr(x, "_fields", None)
            _name_requires_grad(fn, tuple(f"{name}.{f}" for f in fields) if fields is not None
                                else tuple(f"{name}[{i}]" for i in range(len(x))), x)
