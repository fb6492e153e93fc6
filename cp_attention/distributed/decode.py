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
import numbers
import os

import torch
import torch.distributed as dist

from .. import _device
from .._constants import FLOAT_DTYPES
from .._validate import check_bool, check_cascade_args, check_decode_args, check_state, check_tensor
from ..cascade import cascade_decode
from ..decode import flash_decode
from ..ops.split_kv import combine_exported
from ..state import AttentionState
from .agree import _DTYPE_CODES, _scale_bits, agree, decode_meta, split_slots
from .exchange import exchange_for

__all__ = ["all_gather_states", "merge_across_ranks", "cp_flash_decode", "cp_cascade_decode", "init_distributed"]


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
    check_state("state", state)
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
    check_state("state", state)
    o, lse = state
    exchange = exchange_for(group)
    return exchange.merge(_pack(o, lse, exchange), o.dtype)


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


def cp_decode(q, k_shard, v_shard, seq_lens_shard, *, group, check_metadata, row_limits, span, kwargs):
    """Local attention written unrounded into the exchange buffer, then ⊕ across the ranks."""
    check_bool("check_metadata", check_metadata)
    check_bool("return_lse", kwargs.get("return_lse", False))
    if "out" in kwargs:
        raise TypeError("cp_flash_decode does not take out (the local state goes into the exchange buffer)")
    if check_metadata:
        agree(lambda: decode_meta(q, k_shard, v_shard, seq_lens_shard, kwargs, row_limits), group, "cp_flash_decode")
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
    from ..ops.split_kv import export_floats, row_tiling

    geo = check_decode_args(q, k_shard, v_shard, seq_lens_shard, block_table=kwargs.get("block_table"),
                            kv_layout=kwargs.get("kv_layout", "HND"))
    slots = split_slots(kwargs["split_size"], geo.t_max)
    hq, d = q.shape[-2], q.shape[-1]
    tiling = row_tiling(geo.q_rows, hq // geo.hkv)
    exported = _device.new_buffer((export_floats(q.shape[0], geo.hkv, tiling, d, slots),), torch.float32, q.device)
    flash_decode(q, k_shard, v_shard, seq_lens_shard, _export=exported, **kwargs)
    gathered = exchange_for(group).gather(exported)
    o = _device.new_buffer(tuple(q.shape), q.dtype, q.device)
    lse = _device.new_buffer(tuple(q.shape[:-1]), torch.float32, q.device)
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
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        raise ValueError("q must have 3 dims [B, Hq, D] in cp_flash_decode: several query rows need the causal "
                         "rule in global positions, which CPKVCache.decode applies")
    if flash_decode_kwargs.get("window_left") is not None:
        raise TypeError("window_left needs global positions, which cp_flash_decode does not have: use "
                        "CPKVCache.decode")
    return cp_decode(q, k_shard, v_shard, seq_lens_shard, group=group, check_metadata=check_metadata,
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
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] > 1:
        raise ValueError("q must have one row per request in cp_cascade_decode: several query rows need the causal "
                         "rule in global positions")
    check_bool("check_metadata", check_metadata)
    check_bool("return_lse", cascade_kwargs.get("return_lse", False))
    if check_metadata:
        def meta():
            check_cascade_args(q, levels, sm_scale=cascade_kwargs.get("sm_scale"),
                               return_lse=cascade_kwargs.get("return_lse", False), k_scale=cascade_kwargs.get("k_scale"),
                               v_scale=cascade_kwargs.get("v_scale"), logit_softcap=cascade_kwargs.get("logit_softcap"),
                               sinks=cascade_kwargs.get("sinks"))
            lvl = levels[0]
            hkv = lvl.k.shape[2] if lvl.block_table is not None else lvl.k.shape[1]
            d = q.shape[-1]
            return [q.shape[0], 1, q.shape[-2], d, _DTYPE_CODES[q.dtype], hkv,
                    _scale_bits(cascade_kwargs.get("sm_scale"), d), 0]

        agree(meta, group, "cp_cascade_decode")
    kwargs = dict(cascade_kwargs)
    return_lse = kwargs.pop("return_lse", False)
    sinks = kwargs.pop("sinks", None)
    d = q.shape[-1]
    return _exchange(q, lambda o, lse, push: cascade_decode(q, levels, _out=(o.reshape(-1, d), lse.reshape(-1), push),
                                                            **kwargs),
                     group=group, return_lse=return_lse, sinks=sinks, pushes=True)
