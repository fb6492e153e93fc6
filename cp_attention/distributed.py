"""Context-parallel decode: a KV cache sharded along the sequence across ranks, merged exactly with ⊕.

Note [Context-parallel decode]
------------------------------
The KV cache of every sequence is split along the token axis over the ``W`` ranks of a process group;
each rank holds one shard ``[B, Hkv, C, D]`` with its valid tokens packed to the front and counted by a
per-rank ``seq_lens``. Decode then takes three steps on every rank:

1. local attention: ``flash_decode`` gives the state ``(o_r, lse_r)`` of this rank's keys (``lse_r =
   -inf``, ``o_r = 0`` for an empty shard), written unrounded (fp32) straight into one packed float32
   buffer ``[B, Hq, D + 1]`` (``o_r`` then ``lse_r``) that the group's exchange provides;
2. the exchange moves the packed states of every rank (Note [Exchanges] in ``exchange.py``): over NVLink
   symmetric memory, one kernel pushes them into every peer's buffer, waits for the peers' and merges;
   otherwise one all-gather (NCCL, gloo) of ``B * Hq * (D + 1)`` floats per rank moves ``o`` and ``lse``
   together;
3. ⊕ over the ``W`` states in rank order (max-subtracted, float32; see Note [The merge operator ⊕] in
   ``state.py``), the attention sinks joined once.

The key sets of the ranks are disjoint and their union is the whole cache, so the result is the attention
over the unsharded cache. Every rank merges the same states in rank order with the same code, so the
result is bitwise identical on every rank. Gathering the states is used rather than Tree Attention's two
all-reduces (a MAX of the lse, then a SUM of rescaled numerators and denominators): one exchange instead
of two, both tiny, and the merge order is fixed instead of being the reduction order of the backend.

Placement. ``"contiguous"``: rank ``r`` owns cache positions ``[r*C, (r+1)*C)`` with
``C = ceil(T_max / W)``; for a prefill it is the natural split, but the shard of the last rank fills
last. ``"interleaved"``: rank ``r`` owns the positions ``p`` with ``p % W == r``; decode appends
(:class:`CPKVCache`) then land round-robin and every shard grows by one token every ``W`` steps, so the
shards stay balanced however long the generation runs. With either placement the valid positions of a
shard (``p < seq_len``) are a prefix of the shard, so packing is a strided copy.
"""
from __future__ import annotations

import datetime
import math
import numbers
import os
import struct

import torch
import torch.distributed as dist

from . import _dispatch, _library
from ._constants import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES
from ._validate import (check_bool, check_index_tensor, check_inference, check_int, check_kv_layout, check_kv_scales,
                        check_sm_scale, check_state, check_tensor, check_unit_stride)
from .cascade import cascade_decode
from .decode import check_decode_args, check_split_size, combine_exported, flash_decode
from .exchange import _all_gather_single, exchange_for, set_exchange
from .state import AttentionState

__all__ = ["all_gather_states", "merge_across_ranks", "shard_kv", "cp_flash_decode", "cp_cascade_decode", "CPKVCache",
           "init_distributed", "set_exchange"]

PLACEMENTS = ("contiguous", "interleaved")
_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(FLOAT_DTYPES)}


def all_gather_states(state, group=None) -> AttentionState:
    """Gather every rank's attention state with one collective.

    Args:
        state: ``AttentionState(o [..., D], lse [...])``: ``o`` float16, bfloat16 or float32, ``lse``
            float32 natural log; the same shape and dtype on every rank of ``group``.
        group: the process group (default: the world). Its backend must support the one-tensor
            all-gather (NCCL and gloo do).

    Returns:
        ``AttentionState(o [W, ..., D] in state.o's dtype, lse [W, ...] float32)`` with ``W`` the group
        size; entry ``r`` is rank ``r``'s state. ``o`` and ``lse`` travel together as one float32 buffer
        ``[..., D + 1]`` (see Note [Context-parallel decode]); for float32 ``o`` both are strided views
        of that buffer.

    >>> # on each of 2 ranks, after dist.init_process_group(...)
    >>> st = all_gather_states(AttentionState(torch.zeros(4, 8, 64), torch.zeros(4, 8)))
    >>> st.o.shape, st.lse.shape
    (torch.Size([2, 4, 8, 64]), torch.Size([2, 4, 8]))
    """
    check_inference("all_gather_states", ("state",), state)
    check_state("state", state)
    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        return _library.all_gather_states(state, group)
    o, lse = state
    exchange = exchange_for(group)
    gathered = exchange.gather(_pack(o, lse, exchange))
    d = o.shape[-1]
    return AttentionState(gathered[..., :d].to(o.dtype), gathered[..., d])


def _pack(o, lse, exchange) -> torch.Tensor:
    """``[o (float32), lse]`` packed as ``[..., D + 1]`` float32 in a buffer of ``exchange``."""
    d = o.shape[-1]
    packed = exchange.packed_buffer(tuple(o.shape[:-1]) + (d + 1,), o.device)
    packed[..., :d].copy_(o)
    packed[..., d].copy_(lse)
    return packed


def merge_across_ranks(state, group=None) -> AttentionState:
    """⊕ of every rank's attention state: the state of the union of the ranks' (disjoint) key sets.

    Args:
        state: ``AttentionState(o [..., D], lse [...])`` as in :func:`all_gather_states`.
        group: the process group (default: the world).

    Returns:
        ``AttentionState(o [..., D] in state.o's dtype, lse [...] float32, natural log)``, bitwise
        identical on every rank (every rank merges the same gathered states in rank order).

    >>> # rank r holds the state of its own keys; every rank gets the state of all keys
    >>> merged = merge_across_ranks(AttentionState(o_local, lse_local))
    """
    check_inference("merge_across_ranks", ("state",), state)
    check_state("state", state)
    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        return _library.merge_across_ranks(state, group)
    o, lse = state
    exchange = exchange_for(group)
    return exchange.merge(_pack(o, lse, exchange), o.dtype)


def _interleaved_counts(seq_lens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """How many positions ``p < seq_len`` have ``p % world_size == rank``: ``ceil((seq_len - rank) / W)``,
    at least 0 (``seq_len - rank + W - 1 >= 0`` since ``rank < W``, so floor division is exact)."""
    return torch.div(seq_lens - rank + world_size - 1, world_size, rounding_mode="floor")


def shard_kv(k, v, seq_lens, rank, world_size, placement="contiguous", *, kv_layout="HND"):
    """One rank's shard of a KV cache split along the sequence (see Note [Context-parallel decode]).

    Args:
        k, v: ``[B, Hkv, T_max, D]`` (``kv_layout="HND"``) or ``[B, T_max, Hkv, D]`` (``"NHD"``), one shape,
            dtype and device; any float dtype (FP8 included), any strides.
        seq_lens: ``[B]`` int32/int64 on k's device (any stride), ``0 <= len <= T_max``, or ``None`` (all
            ``T_max``).
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks, ``>= 1``.
        placement: ``"contiguous"`` (rank ``r`` owns positions ``[r*C, (r+1)*C)``, ``C = ceil(T_max / W)``)
            or ``"interleaved"`` (positions ``p`` with ``p % W == r``).
        kv_layout: the layout of ``k``/``v``, and of the shards returned.

    Returns:
        ``(k_shard, v_shard, seq_lens_shard)``: ``k_shard``/``v_shard`` contiguous copies in ``kv_layout``
        with ``C = ceil(T_max / W)`` positions for both placements (slots past the owned positions are
        zero), the valid tokens (positions ``< seq_len``) in order at the front, and ``seq_lens_shard [B]``
        (seq_lens' dtype, int64 for ``None``) counting them; 0 is normal. Computed with device ops, no host
        sync except the range check of CPU ``seq_lens``.

    >>> k = torch.randn(2, 1, 10, 32)
    >>> ks, vs, lens = shard_kv(k, k, torch.tensor([10, 3]), rank=1, world_size=4, placement="interleaved")
    >>> ks.shape, lens.tolist()
    (torch.Size([2, 1, 3, 32]), [3, 1])
    """
    world_size = check_int("world_size", world_size, 1)
    rank = check_int("rank", rank, 0, world_size - 1)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    check_kv_layout(kv_layout)
    check_tensor("k", k, dtypes=FLOAT_DTYPES + FP8_DTYPES, ndim=4)
    check_tensor("v", v, dtypes=(k.dtype,), ndim=4, device=k.device)
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    t_dim = 2 if kv_layout == "HND" else 1
    b, t_max = k.shape[0], k.shape[t_dim]
    if seq_lens is None:
        seq_lens = torch.full((b,), t_max, dtype=torch.int64, device=k.device)
    check_index_tensor("seq_lens", seq_lens, b, k.device, lo=0, hi=t_max, hi_name=f"T_max = k.shape[{t_dim}]")
    cap = -(-t_max // world_size)
    if placement == "contiguous":
        start = rank * cap
        idx = slice(start, min(start + cap, t_max))
        lens = (seq_lens - start).clamp(0, cap)
    else:
        idx = slice(rank, t_max, world_size)
        lens = _interleaved_counts(seq_lens, rank, world_size)
    shards = []
    for t in (k, v):
        part = t.narrow(t_dim, 0, t_max)[(slice(None),) * t_dim + (idx,)]
        shape = list(t.shape)
        shape[t_dim] = cap
        shard = t.new_zeros(shape)
        shard.narrow(t_dim, 0, part.shape[t_dim]).copy_(part)
        shards.append(shard)
    return shards[0], shards[1], lens.to(seq_lens.dtype)


def init_distributed(device_type: str = "cuda", timeout_s: float = 600.0) -> torch.device:
    """Join the default process group of a ``torchrun`` launch: NCCL on this rank's GPU (``LOCAL_RANK``,
    NVLink multicast left off) or gloo on the CPU. Returns the device this rank computes on.

    >>> device = init_distributed("cuda")          # under torchrun --nproc-per-node=<GPUs>
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cpu":
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timeout)
    return device


def _collective_device(group) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _scale_bits(sm_scale, d) -> int:
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _agree(local_meta, group, what: str) -> None:
    """All-gather ``(ok, B, Q, Hq, D, dtype, Hkv, sm_scale bits)`` from ``local_meta()`` (which validates this
    rank's arguments and may raise), so that an argument rejected on one rank, or shapes that differ across
    ranks, raise on every rank instead of hanging."""
    error = None
    try:
        meta = [1, *local_meta()]
    except (ValueError, TypeError) as exc:
        error = exc
        meta = [0] * 9
    world = dist.get_world_size(group)
    device = _collective_device(group)
    mine = torch.tensor(meta, dtype=torch.int64, device=device)
    everyone = torch.empty(world * len(meta), dtype=torch.int64, device=device)
    _all_gather_single(everyone, mine, group=group)
    rows = everyone.view(world, len(meta)).tolist()
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(rows) if row[0] == 0]
    if bad:
        raise ValueError(f"{what}: rank(s) {bad} rejected their arguments (see their error)")
    names = ("B", "Q", "Hq", "D", "dtype", "Hkv", "sm_scale", "split slots")
    codes = {c: str(t).replace("torch.", "") for t, c in _DTYPE_CODES.items()}

    def describe(row):
        vals = dict(zip(names, row[1:]))
        vals["dtype"] = codes[vals["dtype"]]
        vals["sm_scale"] = struct.unpack("<d", struct.pack("<q", vals["sm_scale"]))[0]
        return ", ".join(f"{n}={vals[n]}" for n in names)

    if any(row != rows[0] for row in rows):
        detail = "; ".join(f"rank {r}: {describe(row)}" for r, row in enumerate(rows))
        raise ValueError(f"{what}: q (batch, rows, heads, head dim, dtype), the KV heads, sm_scale and (with "
                         f"split_size) the shards' split slots must match on every rank, got {detail}")


def _decode_meta(q, k_shard, v_shard, seq_lens_shard, kwargs, row_limits):
    geo = check_decode_args(q, k_shard, v_shard, seq_lens_shard, block_table=kwargs.get("block_table"),
                            num_splits=kwargs.get("num_splits"), kv_layout=kwargs.get("kv_layout", "HND"),
                            row_limits=row_limits, k_scale=kwargs.get("k_scale"), v_scale=kwargs.get("v_scale"),
                            window_left=kwargs.get("window_left"), logit_softcap=kwargs.get("logit_softcap"),
                            sinks=kwargs.get("sinks"))
    check_sm_scale(kwargs.get("sm_scale"))
    d = q.shape[-1]
    return [q.shape[0], geo.q_rows, q.shape[-2], d, _DTYPE_CODES[q.dtype], geo.hkv, _scale_bits(kwargs.get("sm_scale"), d),
            _split_slots(kwargs.get("split_size"), geo.t_max)]


def _split_slots(split_size, t_max) -> int:
    """Deterministic split slots of a shard: it must hold whole splits (Note [Deterministic splits])."""
    if split_size is None:
        return 0
    check_split_size(split_size)
    if t_max % split_size:
        raise ValueError(f"split_size must divide the shard's capacity for deterministic context parallelism "
                         f"(contiguous shards of whole splits), got split_size={split_size} and capacity {t_max}")
    return t_max // split_size


def _exchange(q, local_into, *, group, return_lse, sinks, pushes=False):
    """``local_into(o_view, lse_view, push)`` writes this rank's unrounded fp32 state straight into the
    exchange's buffer (and, for a caller that ``pushes``, may push it to the peers itself: ``push``, an
    ``exchange.Push`` or ``None``); the exchange then merges across the ranks in rank order (bitwise
    identical on every rank), with the attention sinks joined once. The callers have checked
    ``return_lse``."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES)
    d = q.shape[-1]
    exchange = exchange_for(group)
    packed = exchange.packed_buffer(tuple(q.shape[:-1]) + (d + 1,), q.device)
    push = exchange.push_target(packed) if pushes else None
    local_into(packed[..., :d], packed[..., d], push)
    merged = exchange.merge(packed, q.dtype, sinks, push)
    return merged if return_lse else merged.o


def _cp_decode(q, k_shard, v_shard, seq_lens_shard, *, group, check_metadata, row_limits, span, kwargs):
    """Local attention written unrounded into the exchange buffer, then ⊕ across the ranks."""
    check_bool("check_metadata", check_metadata)
    check_bool("return_lse", kwargs.get("return_lse", False))
    if "out" in kwargs:
        raise TypeError("cp_flash_decode does not take out (the local state goes into the exchange buffer)")
    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        return _library.cp_decode(q, k_shard, v_shard, seq_lens_shard, group, check_metadata, row_limits, span, kwargs)
    if check_metadata:
        _agree(lambda: _decode_meta(q, k_shard, v_shard, seq_lens_shard, kwargs, row_limits), group, "cp_flash_decode")
    return_lse = kwargs.pop("return_lse", False)
    sinks = kwargs.pop("sinks", None)
    if kwargs.get("split_size") is not None:
        return _cp_decode_deterministic(q, k_shard, v_shard, seq_lens_shard, group, return_lse, sinks, kwargs)
    return _exchange(q, lambda o, lse, _: flash_decode(q, k_shard, v_shard, seq_lens_shard, out=AttentionState(o, lse),
                                                       row_limits=row_limits, _span=span, **kwargs),
                     group=group, return_lse=return_lse, sinks=sinks)


def _cp_decode_deterministic(q, k_shard, v_shard, seq_lens_shard, group, return_lse, sinks, kwargs):
    """Each rank exports its shard's deterministic split states; one all-gather puts them in global split
    order; the single-GPU combine merges them: bitwise ``flash_decode(split_size=...)`` on the unsharded
    cache (Note [Deterministic splits])."""
    from .ops.split_kv import export_floats, row_tiling

    geo = check_decode_args(q, k_shard, v_shard, seq_lens_shard, block_table=kwargs.get("block_table"),
                            kv_layout=kwargs.get("kv_layout", "HND"))
    slots = _split_slots(kwargs["split_size"], geo.t_max)
    hq, d = q.shape[-2], q.shape[-1]
    tiling = row_tiling(geo.q_rows, hq // geo.hkv)
    exported = _dispatch.new_buffer((export_floats(q.shape[0], geo.hkv, tiling, d, slots),), torch.float32, q.device)
    flash_decode(q, k_shard, v_shard, seq_lens_shard, _export=exported, **kwargs)
    gathered = exchange_for(group).gather(exported)
    o = _dispatch.new_buffer(tuple(q.shape), q.dtype, q.device)
    lse = _dispatch.new_buffer(tuple(q.shape[:-1]), torch.float32, q.device)
    combine_exported(q, geo.hkv, gathered, dist.get_world_size(group) * slots, o, lse, sinks)
    return AttentionState(o, lse) if return_lse else o


def cp_flash_decode(q, k_shard, v_shard, seq_lens_shard, *, group=None, check_metadata=True,
                    **flash_decode_kwargs):
    """Decode attention over a KV cache sharded across ranks: equals :func:`flash_decode` on the
    unsharded cache (see Note [Context-parallel decode]). Every rank of ``group`` calls it.

    Args:
        q: ``[B, Hq, D]`` float16, bfloat16 or float32; the same query on every rank. (Several query rows and
            sliding windows need global positions: use :meth:`CPKVCache.decode`.)
        k_shard, v_shard: this rank's shard, ``[B, Hkv, C, D]`` (HND; ``kv_layout="NHD"`` for
            ``[B, C, Hkv, D]``), or this rank's page pools with ``block_table=``, q's dtype (or FP8) and
            device. ``C`` may differ across ranks.
        seq_lens_shard: ``[B]`` int32/int64, valid tokens of this shard (0 for an empty shard), or ``None``.
        group: the process group (default: the world).
        check_metadata: all-gather ``(B, Hq, D, dtype, Hkv, sm_scale)`` first and raise ``ValueError`` on
            every rank if they differ or if any rank rejected its arguments (instead of a hang or a wrong
            merge). It syncs with the host: pass ``False`` on the hot path and inside CUDA graphs.
        **flash_decode_kwargs: ``block_table``, ``sm_scale``, ``num_splits``, ``split_size``, ``kv_layout``,
            ``k_scale``, ``v_scale``, ``logit_softcap``, ``sinks``, ``return_lse`` as in :func:`flash_decode`
            (``sm_scale``, ``logit_softcap`` and ``sinks`` the same on every rank; ``block_table`` is this
            rank's; FP8 scales may differ across ranks). The sinks join once, after the merge across ranks.
            With ``split_size=S`` and contiguous shards of the same capacity, a multiple of ``S`` (e.g.
            :func:`shard_kv` of a cache whose ``T_max`` is a multiple of ``W * S``), the result is bitwise
            ``flash_decode(..., split_size=S)`` on the unsharded cache, for any world size: every rank
            exchanges its per-split states and all run the single-GPU combine (Note [Deterministic splits]
            in ``ops/split_kv.py``).

    Returns:
        ``o [B, Hq, D]`` in q's dtype, or ``AttentionState(o, lse [B, Hq] float32, natural log)`` with
        ``return_lse=True``; bitwise identical on every rank. No host sync with ``check_metadata=False``
        on CUDA (it can be captured in a CUDA graph; NCCL collectives can be).

    >>> # rank r of W, after dist.init_process_group(...); k, v [B, Hkv, T, D] the full cache
    >>> ks, vs, lens = shard_kv(k, v, seq_lens, dist.get_rank(), dist.get_world_size())
    >>> o = cp_flash_decode(q, ks, vs, lens)          # == flash_decode(q, k, v, seq_lens)
    """
    check_inference("cp_flash_decode", ("q", "k_shard", "v_shard", *flash_decode_kwargs), q, k_shard, v_shard,
                    *flash_decode_kwargs.values())
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        raise ValueError("q must have 3 dims [B, Hq, D] in cp_flash_decode: several query rows need the causal "
                         "rule in global positions, which CPKVCache.decode applies")
    if flash_decode_kwargs.get("window_left") is not None:
        raise TypeError("window_left needs global positions, which cp_flash_decode does not have: use "
                        "CPKVCache.decode")
    return _cp_decode(q, k_shard, v_shard, seq_lens_shard, group=group, check_metadata=check_metadata,
                      row_limits=None, span=None, kwargs=flash_decode_kwargs)


def cp_cascade_decode(q, levels, *, group=None, check_metadata=True, **cascade_kwargs):
    """Cascade decode over levels sharded across ranks: equals :func:`cp_attention.cascade_decode` on the
    unsharded levels. Every rank of ``group`` calls it with its shard of every level -- a shared prefix too
    (e.g. :func:`shard_kv` of the prefix), so each GPU reads its part of the prefix once for all the
    requests that share it.

    Args:
        q: ``[B, Hq, D]``, the same on every rank.
        levels: this rank's :class:`cp_attention.CascadeLevel` shards (the same number of levels, kinds and
            ``segment_ids`` on every rank; segment lengths are the shards').
        group, check_metadata: as in :func:`cp_flash_decode`.
        **cascade_kwargs: ``sm_scale``, ``k_scale``, ``v_scale``, ``logit_softcap``, ``sinks``,
            ``return_lse`` as in :func:`cascade_decode`; the sinks join once, after the merge across ranks.

    Returns:
        As :func:`cascade_decode`, bitwise identical on every rank.

    >>> ks, vs, lens = shard_kv(prefix_k, prefix_v, None, rank, world)       # [1, Hkv, C, D] each
    >>> o = cp_cascade_decode(q, [CascadeLevel(ks, vs, lens), own_tokens_shard])
    """
    check_inference("cp_cascade_decode", ("q", "levels", *cascade_kwargs), q, levels, *cascade_kwargs.values())
    from .cascade import _validate

    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] > 1:
        raise ValueError("q must have one row per request in cp_cascade_decode: several query rows need the causal "
                         "rule in global positions")
    check_bool("check_metadata", check_metadata)
    check_bool("return_lse", cascade_kwargs.get("return_lse", False))
    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        return _library.cp_cascade_decode(q, levels, group, check_metadata, cascade_kwargs)
    if check_metadata:
        def meta():
            _validate(q, levels, cascade_kwargs.get("sm_scale"), cascade_kwargs.get("return_lse", False),
                      cascade_kwargs.get("k_scale"), cascade_kwargs.get("v_scale"),
                      cascade_kwargs.get("logit_softcap"), cascade_kwargs.get("sinks"))
            lvl = levels[0]
            hkv = lvl.k.shape[2] if lvl.block_table is not None else lvl.k.shape[1]
            d = q.shape[-1]
            return [q.shape[0], 1, q.shape[-2], d, _DTYPE_CODES[q.dtype], hkv,
                    _scale_bits(cascade_kwargs.get("sm_scale"), d), 0]

        _agree(meta, group, "cp_cascade_decode")
    kwargs = dict(cascade_kwargs)
    return_lse = kwargs.pop("return_lse", False)
    sinks = kwargs.pop("sinks", None)
    d = q.shape[-1]
    return _exchange(q, lambda o, lse, push: cascade_decode(q, levels, _out=(o.reshape(-1, d), lse.reshape(-1), push),
                                                            **kwargs),
                     group=group, return_lse=return_lse, sinks=sinks, pushes=True)


class CPKVCache:
    """One rank's shard of a KV cache for context-parallel decode, interleaved placement, dense or paged.

    Global position ``p`` of every sequence lives on rank ``p % W`` at local slot ``p // W`` (the
    ``"interleaved"`` placement of :func:`shard_kv`), so decode tokens go round-robin and the shards stay
    balanced. Every rank calls :meth:`append` with the same tokens; only the owner of each stores it.

    Attributes:
        k, v: dense: ``[B, Hkv, capacity, D]`` views of this rank's buffers (``capacity = ceil(max_seq_len
            / W)``); paged (``page_size`` given): page pools ``[num_pages, page_size, Hkv, D]`` (the vLLM /
            FlashInfer layout) read through :attr:`block_table`.
        block_table: ``[B, pages_per_sequence]`` int32 (paged), else ``None``.
        kv_layout: ``"HND"`` (dense) or ``"NHD"`` (paged): how :meth:`decode` reads :attr:`k`/:attr:`v`.
        seq_lens: ``[B]`` int32 on ``device``: valid tokens of this shard.
        global_seq_lens: ``[B]`` int64 on ``device``: length of each whole sequence.

    Multi-token steps (speculative decoding). :meth:`append` takes ``Q`` tokens per sequence at once and
    places each by its global position; :meth:`decode` with ``Q`` query rows applies the causal rule in
    global positions: row ``i`` sees the global positions ``< L - Q + 1 + i`` (``L`` the sequence's
    length), which on this rank are its local slots ``< ceil((L - Q + 1 + i - rank) / W)``;
    :meth:`rollback` drops rejected drafts.

    CUDA graphs. :meth:`append` decides owners and slots on the device from ``global_seq_lens``; a
    non-owner writes nothing (the Triton kernel decides on the device) or, on the torch path, into a
    scratch slot (dense) or scratch page (paged) that is never read, so every rank runs the same kernels
    whatever the step. Hence one captured graph of ``cache.append(k_in, v_in);
    o_out.copy_(cache.decode(q_in, check_metadata=False))`` with static ``k_in``, ``v_in``, ``q_in`` (fill
    them with ``copy_`` before each replay) is replayed step after step. The host-side count that guards
    the capacity is not advanced by replays: the caller bounds them by :attr:`free_slots` (beyond it,
    tokens are dropped on the device, never written out of bounds).

    >>> cache = CPKVCache(2, 8, 128, max_seq_len=4096, rank=dist.get_rank(), world_size=dist.get_world_size())
    >>> cache.append(k_tok, v_tok)     # [2, 8, 128] each, the same on every rank
    >>> o = cache.decode(q)            # [2, Hq, 128], attention over all appended tokens
    """

    def __init__(self, batch, heads_kv, head_dim, max_seq_len, *, dtype=torch.bfloat16, device=None,
                 rank=None, world_size=None, group=None, page_size=None, k_scale=None, v_scale=None):
        """Empty cache for ``batch`` sequences of up to ``max_seq_len`` tokens each (all ranks together);
        ``page_size`` (int >= 1): keep the shard in pages of that many slots. An FP8 ``dtype``
        (``float8_e4m3fn``/``float8_e5m2``) needs the dequantisation scales ``k_scale``/``v_scale`` (as in
        :func:`flash_decode`); :meth:`append` then quantises float16/bfloat16/float32 tokens with them.

        ``rank`` and ``world_size`` default to this process's rank and size in ``group``.
        """
        batch = check_int("batch", batch, 1)
        heads_kv = check_int("heads_kv", heads_kv, 1)
        head_dim = check_int("head_dim", head_dim, 1)
        max_seq_len = check_int("max_seq_len", max_seq_len, 1)
        if page_size is not None:
            page_size = check_int("page_size", page_size, 1)
        if dtype not in FLOAT_DTYPES + FP8_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES + FP8_DTYPES}, got {dtype}")
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:  # where torch puts tensors made on "cuda"
            device = torch.device("cuda", torch.cuda.current_device())
        check_kv_scales(k_scale, v_scale, dtype, torch.bfloat16, heads_kv, device)
        self.k_scale, self.v_scale = k_scale, v_scale
        world_size = dist.get_world_size(group) if world_size is None else world_size
        world_size = check_int("world_size", world_size, 1)
        rank = dist.get_rank(group) if rank is None else rank
        self.rank = check_int("rank", rank, 0, world_size - 1)
        self.world_size = world_size
        self.group = group
        self.max_seq_len = max_seq_len
        self.capacity = -(-max_seq_len // world_size)
        self.page_size = page_size
        if page_size is None:
            shape = (batch, heads_kv, self.capacity + 1, head_dim)  # + 1: the scratch slot of non-owners
            self._k = torch.zeros(shape, dtype=dtype, device=device)
            self._v = torch.zeros(shape, dtype=dtype, device=device)
            self.k = self._k[:, :, : self.capacity]
            self.v = self._v[:, :, : self.capacity]
            self.block_table, self.kv_layout = None, "HND"
        else:
            pages = -(-self.capacity // page_size)
            # Sequence b owns pages [b * pages, (b + 1) * pages); the last page is the scratch page.
            shape = (batch * pages + 1, page_size, heads_kv, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
            self.block_table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
            self.kv_layout = "NHD"
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.global_seq_lens = torch.zeros(batch, dtype=torch.int64, device=device)
        self._batch_idx = torch.arange(batch, device=device)
        self._host_max_len = 0

    @classmethod
    def from_prefix(cls, k, v, seq_lens, max_seq_len, *, rank=None, world_size=None, group=None, page_size=None,
                    dtype=None, k_scale=None, v_scale=None):
        """Cache holding this rank's interleaved shard of a prefix ``k``, ``v`` ``[B, Hkv, T, D]`` with
        ``seq_lens [B]`` (``None``: all ``T``), room for ``max_seq_len >= T`` tokens per sequence. ``dtype``
        (default k's) may be FP8: the prefix is quantised with ``k_scale``/``v_scale``, or with the per-tensor
        amax scales of :func:`cp_attention.quantize_kv` of the whole prefix when they are not given (the same
        on every rank, which holds the same prefix).

        >>> cache = CPKVCache.from_prefix(k, v, seq_lens, max_seq_len=k.shape[2] + 64)
        """
        check_tensor("k", k, dtypes=FLOAT_DTYPES + FP8_DTYPES, ndim=4)
        b, hkv, t, d = k.shape
        if isinstance(max_seq_len, numbers.Integral) and max_seq_len < t:
            raise ValueError(f"max_seq_len must be >= the prefix capacity T = {t}, got {max_seq_len}")
        dtype = k.dtype if dtype is None else dtype
        if dtype in FP8_DTYPES and k.dtype not in FP8_DTYPES and k_scale is None and v_scale is None:
            from .quant import quantize_kv

            k, v, k_scale, v_scale = quantize_kv(k, v, dtype)
        cache = cls(b, hkv, d, max_seq_len, dtype=dtype, device=k.device, rank=rank, world_size=world_size,
                    group=group, page_size=page_size, k_scale=k_scale, v_scale=v_scale)
        k_shard, v_shard, _ = shard_kv(k, v, seq_lens, cache.rank, cache.world_size, "interleaved")
        n = k_shard.shape[2]
        slots = torch.arange(n, device=k.device).expand(b, n)
        cache._store(slots, torch.ones_like(slots, dtype=torch.bool), k_shard.transpose(1, 2), v_shard.transpose(1, 2))
        cache.set_lengths(torch.full((b,), t, device=k.device) if seq_lens is None else seq_lens)
        return cache

    def _store(self, slots, mine, k_rows, v_rows) -> None:
        """Write ``k_rows``/``v_rows [B, n, Hkv, D]`` at local ``slots [B, n]`` where ``mine`` (quantised with
        the cache's scales if it is FP8 and they are not); the others go to the scratch slot or page."""
        k_rows, v_rows = self._quantized(k_rows, v_rows)
        b_idx = self._batch_idx[:, None].expand_as(slots)
        if self.block_table is None:
            slot = torch.where(mine, slots, self.capacity)
            self._k[b_idx, :, slot] = k_rows
            self._v[b_idx, :, slot] = v_rows
        else:
            page_col = (slots // self.page_size).clamp(max=self.block_table.shape[1] - 1)
            page = torch.where(mine, self.block_table[b_idx, page_col].long(), self.k.shape[0] - 1)
            off = torch.where(mine, slots % self.page_size, 0)
            self.k[page, off] = k_rows
            self.v[page, off] = v_rows

    def _quantized(self, k_rows, v_rows):
        """``k_rows``/``v_rows [B, n, Hkv, D]`` in the cache's dtype: float rows quantised with the scales of an
        FP8 cache, others as they are."""
        if self.k.dtype not in FP8_DTYPES or k_rows.dtype in FP8_DTYPES:
            return k_rows, v_rows
        from .quant import quantize

        return tuple(quantize(x, torch.as_tensor(sc, dtype=torch.float32, device=x.device), self.k.dtype, 2)
                     for x, sc in ((k_rows, self.k_scale), (v_rows, self.v_scale)))

    def set_lengths(self, seq_lens) -> None:
        """Declare the whole-sequence lengths ``seq_lens [B]`` (int, ``<= max_seq_len``) of the tokens already
        in the buffers (interleaved placement); sets :attr:`seq_lens` to this rank's share. One host sync.

        Used after filling :attr:`k`/:attr:`v` directly, e.g. with a shard generated on this rank.
        """
        check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1, device=self.seq_lens.device)
        if seq_lens.shape[0] != self.seq_lens.shape[0]:
            raise ValueError(f"seq_lens must have shape [{self.seq_lens.shape[0]}], got {tuple(seq_lens.shape)}")
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > self.max_seq_len:
            raise ValueError(f"seq_lens must lie in [0, {self.max_seq_len}] (max_seq_len), got [{lo}, {hi}]")
        self.global_seq_lens.copy_(seq_lens)
        self.seq_lens.copy_(_interleaved_counts(self.global_seq_lens, self.rank, self.world_size))
        self._host_max_len = hi

    @property
    def free_slots(self) -> int:
        """Appends left before the longest sequence reaches ``max_seq_len`` (host-side count)."""
        return self.max_seq_len - self._host_max_len

    def append(self, k_new, v_new) -> None:
        """Append one token (``[B, Hkv, D]``) or ``Q`` tokens (``[B, Q, Hkv, D]``) per sequence, in the
        cache's dtype (an FP8 cache also takes float16/bfloat16/float32 tokens and quantises them with its
        scales) and device, the same on every rank, unit stride in D. Global position ``len + j`` goes to
        rank ``(len + j) % W``; no host sync. With the Triton kernels one launch stores the tokens and
        advances the lengths (``ops/append.py``; non-owners write nothing).

        Under ``torch.compile`` the append is the op ``cp_attention::cp_kv_append``, which mutates the
        buffers and lengths on the device; the host-side count behind :attr:`free_slots` does not advance
        inside a compiled graph (as in CUDA-graph replays, see the class docstring). A compiled caller
        bounds its steps by :attr:`free_slots` read before them (beyond it, tokens are dropped on the
        device, never written out of bounds), and may bring the count up to date outside the compiled
        code with ``cache.set_lengths(cache.global_seq_lens)`` (one host sync). For
        ``mode="reduce-overhead"`` (CUDA graphs), first mark the tensors the graph mutates static with
        ``torch._dynamo.mark_static_address``: ``k``, ``v`` (and for a dense cache ``k._base``,
        ``v._base``, the buffers with the scratch slot), ``seq_lens`` and ``global_seq_lens``; and make one
        eager :meth:`decode` call of each query shape, which allocates the exchange's buffers."""
        check_inference("CPKVCache.append", ("k_new", "v_new"), k_new, v_new)
        b, hkv, d = self.seq_lens.shape[0], self._heads_kv, self._head_dim
        dtypes = (self.k.dtype,) + (FLOAT_DTYPES if self.k.dtype in FP8_DTYPES else ())
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            check_tensor(name, t, dtypes=dtypes, device=self.k.device)
            check_unit_stride(name, t)
            if t.dim() == 3:
                t = t.unsqueeze(1)
            if t.dim() != 4 or t.shape[0] != b or tuple(t.shape[2:]) != (hkv, d):
                raise ValueError(f"{name} must have shape [{b}, {hkv}, {d}] or [{b}, Q, {hkv}, {d}] "
                                 f"([B, Hkv, D] or [B, Q, Hkv, D]), got {tuple(t.shape)}")
        if k_new.shape != v_new.shape:
            raise ValueError(f"v_new must have k_new's shape {tuple(k_new.shape)}, got {tuple(v_new.shape)}")
        if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
            return _library.cp_kv_append(self, k_new, v_new)
        if k_new.dim() == 3:
            k_new, v_new = k_new.unsqueeze(1), v_new.unsqueeze(1)
        n = k_new.shape[1]
        if self.free_slots < n:
            raise RuntimeError(f"CPKVCache is full: {n} more tokens would pass max_seq_len = {self.max_seq_len} "
                               f"({self.free_slots} free)")
        if _dispatch.use_triton(self.k):
            from .ops.append import append_tokens

            k_new, v_new = self._quantized(k_new, v_new)
            append_tokens(k_new, v_new, self.k, self.v, self.block_table, self.seq_lens, self.global_seq_lens,
                          self.rank, self.world_size, self.capacity)
        else:
            pos = self.global_seq_lens[:, None] + torch.arange(n, device=self.k.device)  # [B, n] global positions
            slots = torch.div(pos, self.world_size, rounding_mode="floor")
            mine = (pos.remainder(self.world_size) == self.rank) & (slots < self.capacity)
            self._store(slots, mine, k_new, v_new)
            self.seq_lens += mine.sum(1).to(self.seq_lens.dtype)
            self.global_seq_lens += n
        self._host_max_len += n

    def rollback(self, n) -> None:
        """Drop the last ``n`` tokens of each sequence (rejected drafts): an int, or ``[B]`` int tensor on the
        cache's device (no host sync). The slots are overwritten by later appends. The host-side capacity
        count only moves back for an int ``n``."""
        if isinstance(n, torch.Tensor):
            check_tensor("n", n, dtypes=INDEX_DTYPES, ndim=1, device=self.global_seq_lens.device)
            if n.shape[0] != self.global_seq_lens.shape[0]:
                raise ValueError(f"n must have shape [{self.global_seq_lens.shape[0]}], got {tuple(n.shape)}")
            drop = n.long().clamp(min=0)
        else:
            drop = check_int("n", n, 0)
            self._host_max_len = max(0, self._host_max_len - drop)
        self.global_seq_lens.sub_(drop).clamp_(min=0)
        self.seq_lens.copy_(_interleaved_counts(self.global_seq_lens, self.rank, self.world_size))

    def decode(self, q, **kwargs):
        """Attention of ``q [B, Hq, D]``, or ``q [B, Q, Hq, D]`` with the causal rule in global positions,
        over the cache, merged across the ranks (all ranks call it); ``kwargs`` as in
        :func:`cp_flash_decode`, plus ``window_left`` (in global positions, as in :func:`flash_decode`)."""
        check_inference("CPKVCache.decode", ("q", *kwargs), q, *kwargs.values())
        for own in ("block_table", "kv_layout", "k_scale", "v_scale"):
            if own in kwargs:
                raise TypeError(f"CPKVCache.decode takes no {own} (the cache has its own)")
        check_metadata = kwargs.pop("check_metadata", True)
        window = kwargs.pop("window_left", None)
        if window is not None:
            check_int("window_left", window, 0)
        row_limits = span = None
        n_q = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 1
        if n_q > 1 or window is not None:
            # Row i sees the global positions [L - Q + i - W, L - Q + 1 + i): on this rank, the owned slots
            # below each end (interleaved placement: counted, not searched).
            end = self.global_seq_lens[:, None] - n_q + 1 + torch.arange(n_q, device=self.seq_lens.device)
            first = end - 1 - window if window is not None else torch.zeros_like(end)
            row_limits = torch.stack([_interleaved_counts(x.clamp(min=0), self.rank, self.world_size)
                                      for x in (first, end)], dim=-1).to(torch.int32)
            if window is not None:
                span = -(-(window + n_q) // self.world_size) + 1
        if self.k_scale is not None:
            kwargs = dict(kwargs, k_scale=self.k_scale, v_scale=self.v_scale)
        return _cp_decode(q, self.k, self.v, self.seq_lens, group=self.group, check_metadata=check_metadata,
                          row_limits=row_limits, span=span, kwargs=dict(kwargs, block_table=self.block_table,
                                                                        kv_layout=self.kv_layout))

    @property
    def _heads_kv(self) -> int:
        return self.k.shape[1] if self.block_table is None else self.k.shape[2]

    @property
    def _head_dim(self) -> int:
        return self.k.shape[3]
