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

from .. import _device, _library
from .._constants import FLOAT_DTYPES
from .._validate import (check_bool, check_cascade_args, check_decode_args, check_inference, check_not_taken,
                         check_state, check_tensor)
from ..cascade import cascade_decode
from ..decode import flash_decode, merge_packed_torch
from ..ops.split_kv import combine_exported
from ..state import AttentionState
from .agree import STATE_FIELDS, agree, cascade_meta, decode_meta, split_slots, state_meta
from .exchange import exchange_for

__all__ = ["all_gather_states", "merge_across_ranks", "cp_flash_decode", "cp_cascade_decode", "init_distributed"]


def all_gather_states(state, group=None, *, check_metadata=True) -> AttentionState:
    """Gather every rank's attention state with one collective.

    Args:
        state: ``AttentionState(o [..., D], lse [...])``: ``o`` float16, bfloat16 or float32, ``lse``
            float32 natural log; the same shape and dtype on every rank of ``group``.
        group: the process group (default: the world). Its backend must support the one-tensor
            all-gather (NCCL and gloo do).
        check_metadata: compare the state's shape and dtype across the ranks first (one small collective, a
            host sync; skipped while a CUDA graph is captured): a mismatch raises ``ValueError`` on every
            rank. ``False`` on a hot path whose shapes are known to agree.

    Returns:
        ``AttentionState(o [W, ..., D] in state.o's dtype, lse [W, ...] float32)`` with ``W`` the group
        size; entry ``r`` is rank ``r``'s state. ``o`` and ``lse`` travel together as one float32 buffer
        ``[..., D + 1]`` (see Note [Context-parallel decode]); for float32 ``o`` both are strided views
        of that buffer.

    On every rank of an initialised process group of ``W`` ranks (here one):

    >>> st = all_gather_states(AttentionState(torch.zeros(4, 8, 64), torch.zeros(4, 8)))
    >>> st.o.shape, st.lse.shape                      # [W, 4, 8, 64], [W, 4, 8]
    (torch.Size([1, 4, 8, 64]), torch.Size([1, 4, 8]))
    """
    _check_exchange("all_gather_states", state, group, check_metadata)
    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        return _library.all_gather_states(state, group, check_metadata)
    o, lse = state
    exchange = exchange_for(group)
    gathered = exchange.gather(_pack(o, lse, exchange))
    d = o.shape[-1]
    return AttentionState(gathered[..., :d].to(o.dtype), gathered[..., d])


def _check_exchange(what: str, state, group, check_metadata) -> None:
    """``state`` checked, and with ``check_metadata`` (outside CUDA-graph capture and tracing) its shape and dtype
    compared across the ranks in one collective: a mismatch raises on every rank (Note [Agreement across
    ranks]) instead of a crash or a merge of unrelated rows."""
    def checks():
        check_inference(what, ("state",), state)
        check_bool("check_metadata", check_metadata)
        check_state("state", state)

    if torch.compiler.is_compiling() or not joins_agreement(state[0] if isinstance(state, tuple) and state else None,
                                                             check_metadata) or not dist.is_initialized():
        checks()
    else:
        agree(lambda: (checks(), state_meta(state))[1], group, what, STATE_FIELDS)


def _pack(o, lse, exchange) -> torch.Tensor:
    """``[o (float32), lse]`` packed as ``[..., D + 1]`` float32 in a buffer of ``exchange``."""
    d = o.shape[-1]
    packed = exchange.packed_buffer(tuple(o.shape[:-1]) + (d + 1,), o.device)
    packed[..., :d].copy_(o)
    packed[..., d].copy_(lse)
    return packed


def merge_across_ranks(state, group=None, *, check_metadata=True) -> AttentionState:
    """⊕ of every rank's attention state: the state of the union of the ranks' (disjoint) key sets.

    Args:
        state: ``AttentionState(o [..., D], lse [...])`` as in :func:`all_gather_states`.
        group: the process group (default: the world).
        check_metadata: as in :func:`all_gather_states`.

    Returns:
        ``AttentionState(o [..., D] in state.o's dtype, lse [...] float32, natural log)``, bitwise
        identical on every rank (every rank merges the same gathered states in rank order).

    Each rank passes the state of its own keys and gets the state of all keys:

    >>> merged = merge_across_ranks(AttentionState(torch.ones(2, 8, 64), torch.zeros(2, 8)))
    >>> merged.o.shape, merged.lse.shape               # the state of every rank's keys together
    (torch.Size([2, 8, 64]), torch.Size([2, 8]))
    """
    _check_exchange("merge_across_ranks", state, group, check_metadata)
    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        return _library.merge_across_ranks(state, group, check_metadata)
    o, lse = state
    exchange = exchange_for(group)
    return exchange.merge(_pack(o, lse, exchange), o.dtype)


def init_distributed(device_type: str = "cuda", timeout_s: float = 600.0) -> torch.device:
    """Join the default process group of a ``torchrun`` launch: NCCL on this rank's GPU (``LOCAL_RANK``,
    NVLink multicast off unless the environment sets ``NCCL_NVLS_ENABLE``/``TORCH_SYMM_MEM_DISABLE_MULTICAST``)
    or gloo on the CPU. Returns the device this rank computes on.

    Under ``torchrun --nproc-per-node=<GPUs>``:

    >>> device = init_distributed("cuda")  # doctest: +SKIP
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


def cp_decode(q, k_shard, v_shard, seq_lens_shard, *, group, check_metadata, row_limits, span, kwargs,
              window_left=None, global_lens=None, what="cp_flash_decode", pre=None):
    """Local attention written unrounded into the exchange buffer, then ⊕ across the ranks. Every argument is
    checked once: inside the agreement collective with ``check_metadata`` (Note [Agreement across ranks]), else
    by ``flash_decode`` itself. ``window_left``: the window a caller (``CPKVCache.decode``) turned into
    ``row_limits``, and ``global_lens``, its global sequence lengths, for the agreement check; ``pre``: the
    caller's own checks, run there too (a rank that rejects an argument raises on every rank, none hangs)."""
    def checks():
        if pre is not None:
            pre()
        check_bool("check_metadata", check_metadata)
        check_not_taken(what, kwargs, {"out": "the local state goes into the exchange buffer"})

    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        checks()
        return _library.cp_decode(q, k_shard, v_shard, seq_lens_shard, group, check_metadata, row_limits, span, kwargs,
                                  window_left, what)
    geo = None
    if joins_agreement(q, check_metadata):
        geo = agree(lambda: (checks(), decode_meta(q, k_shard, v_shard, seq_lens_shard, kwargs, row_limits,
                                                   window_left, global_lens))[1], group, what)
    else:
        checks()
    kwargs = dict(kwargs)
    return_lse = kwargs.pop("return_lse", False)
    check_bool("return_lse", return_lse)
    sinks = kwargs.pop("sinks", None)
    if kwargs.get("split_size") is not None:
        if geo is None:
            geo = check_decode_args(q, k_shard, v_shard, seq_lens_shard, row_limits=row_limits, sinks=sinks, **kwargs)
        return _cp_decode_deterministic(q, k_shard, v_shard, seq_lens_shard, geo, row_limits, group, return_lse,
                                        sinks, kwargs)
    return _exchange(q, lambda o, lse, _: flash_decode(q, k_shard, v_shard, seq_lens_shard, out=AttentionState(o, lse),
                                                       row_limits=row_limits, _span=span, _geo=geo, **kwargs),
                     group=group, return_lse=return_lse, sinks=sinks)


def _capturing(q) -> bool:
    return isinstance(q, torch.Tensor) and q.is_cuda and torch.cuda.is_current_stream_capturing()


def joins_agreement(q, check_metadata) -> bool:
    """Whether a call takes part in the agreement collective: unless ``check_metadata`` is ``False`` (a value
    that is not a bool joins it and is rejected there, so that the other ranks do not wait) or a CUDA graph is
    being captured."""
    return check_metadata is not False and not _capturing(q)


def _cp_decode_deterministic(q, k_shard, v_shard, seq_lens_shard, geo, row_limits, group, return_lse, sinks, kwargs):
    """Each rank exports its shard's deterministic split states; one all-gather puts them in global split
    order; the single-GPU combine (or, on the torch path, the same ⊕ in the same order) merges them: bitwise
    ``flash_decode(..., split_size=...)`` on the unsharded cache (Note [Deterministic splits])."""
    from ..ops.split_kv import export_floats, row_tiling

    slots = split_slots(kwargs["split_size"], geo.t_max)
    hq, d = q.shape[-2], q.shape[-1]
    world = dist.get_world_size(group)
    if _device.use_triton(q):
        tiling = row_tiling(geo.q_rows, hq // geo.hkv)
        n = export_floats(q.shape[0], geo.hkv, tiling, d, slots)
    else:
        n = slots * q.numel() // d * (d + 1)
    exported = _device.new_buffer((n,), torch.float32, q.device)
    flash_decode(q, k_shard, v_shard, seq_lens_shard, row_limits=row_limits, _export=exported, _geo=geo, **kwargs)
    gathered = exchange_for(group).gather(exported)
    if not _device.use_triton(q):
        st = merge_packed_torch(gathered.view(world * slots, *q.shape[:-1], d + 1), q.dtype, sinks)
        return st if return_lse else st.o
    o = _device.new_buffer(tuple(q.shape), q.dtype, q.device)
    lse = _device.new_buffer(tuple(q.shape[:-1]), torch.float32, q.device)
    combine_exported(q, geo.hkv, gathered, world * slots, o, lse, sinks)
    return AttentionState(o, lse) if return_lse else o


def cp_flash_decode(q, k_shard, v_shard, seq_lens_shard, *, group=None, check_metadata=True,
                    **flash_decode_kwargs):
    """Decode attention over a KV cache sharded across ranks: equals :func:`flash_decode` on the
    unsharded cache (see Note [Context-parallel decode]). Every rank of ``group`` calls it.

    Args:
        q: ``[B, Hq, D]`` float16, bfloat16 or float32; the same query on every rank. (Several query rows,
            sliding windows and row limits need global positions: use :meth:`CPKVCache.decode`.)
        k_shard, v_shard: this rank's shard, ``[B, Hkv, C, D]`` (HND; ``kv_layout="NHD"`` for
            ``[B, C, Hkv, D]``), or this rank's page pools with ``block_table=``, q's dtype (or FP8) and
            device. ``C`` may differ across ranks.
        seq_lens_shard: ``[B]`` int32/int64, valid tokens of this shard (0 for an empty shard), or ``None``.
        group: the process group (default: the world).
        check_metadata: check every argument once and all-gather what must be equal on every rank (q's shape
            and dtype, the KV heads, ``sm_scale``, ``split_size``, ``logit_softcap``, ``sinks`` and the FP8
            scales, by value): a mismatch raises ``ValueError`` on every rank naming the argument; an argument
            that a rank rejects raises that rank's own ``ValueError``/``TypeError`` there and, on the other
            ranks, a ``ValueError`` naming the rejecting ranks; never a hang or a wrong merge
            (Note [Agreement across ranks] in ``distributed/agree.py``). It syncs with the host, and is skipped
            while a CUDA graph is captured; pass ``False`` on the hot path once the arguments are known to agree.
        **flash_decode_kwargs: ``block_table``, ``sm_scale``, ``num_splits``, ``split_size``, ``kv_layout``,
            ``k_scale``, ``v_scale``, ``logit_softcap``, ``sinks``, ``return_lse`` as in :func:`flash_decode`
            (``block_table`` and ``num_splits`` are this rank's; the others must be equal on every rank). The
            sinks join once, after the merge across ranks.
            With ``split_size=S`` and contiguous shards of the same capacity, a multiple of ``S`` (e.g.
            :func:`shard_kv` of a cache whose ``T_max`` is a multiple of ``W * S``), the result is bitwise
            ``flash_decode(..., split_size=S)`` on the unsharded cache, for any world size: every rank
            exchanges its per-split states and all run the single-GPU combine (Note [Deterministic splits]
            in ``ops/split_kv.py``); on the CPU torch path the same splits merge in the same order, bitwise
            ``flash_decode(..., split_size=S)`` there too.

    Returns:
        ``o [B, Hq, D]`` in q's dtype, or ``AttentionState(o, lse [B, Hq] float32, natural log)`` with
        ``return_lse=True``; bitwise identical on every rank. No host sync with ``check_metadata=False``
        on CUDA (it can be captured in a CUDA graph; NCCL collectives can be).

    On every rank of an initialised process group, each holding its shard of the same cache:

    >>> from cp_attention import flash_decode
    >>> from cp_attention.distributed import shard_kv
    >>> _ = torch.manual_seed(0)                       # the same full cache on every rank
    >>> q, k, v = torch.randn(2, 8, 64), torch.randn(2, 2, 300, 64), torch.randn(2, 2, 300, 64)
    >>> seq_lens = torch.tensor([300, 41])
    >>> ks, vs, lens = shard_kv(k, v, seq_lens, dist.get_rank(), dist.get_world_size())
    >>> o = cp_flash_decode(q, ks, vs, lens)
    >>> torch.allclose(o, flash_decode(q, k, v, seq_lens), atol=1e-5)
    True
    """
    def pre():
        check_inference("cp_flash_decode", ("q", "k_shard", "v_shard", *flash_decode_kwargs), q, k_shard, v_shard,
                        *flash_decode_kwargs.values())
        if isinstance(q, torch.Tensor) and q.dim() == 4:
            raise ValueError("q must have 3 dims [B, Hq, D] in cp_flash_decode: several query rows need the causal "
                             "rule in global positions, which CPKVCache.decode applies")
        if flash_decode_kwargs.get("window_left") is not None:
            raise TypeError("window_left needs global positions, which cp_flash_decode does not have: use "
                            "CPKVCache.decode")
        check_not_taken("cp_flash_decode", flash_decode_kwargs,
                        {"row_limits": "a rank's limits would be positions in its shard, not in the cache: "
                                       "CPKVCache.decode derives them from the global lengths"})

    return cp_decode(q, k_shard, v_shard, seq_lens_shard, group=group, check_metadata=check_metadata,
                     row_limits=None, span=None, kwargs=flash_decode_kwargs, pre=pre)


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

    On every rank of an initialised process group: a prefix shared by 4 requests and 20 tokens of each, both
    sharded:

    >>> from cp_attention import CascadeLevel, cascade_decode
    >>> from cp_attention.distributed import shard_kv
    >>> rank, world = dist.get_rank(), dist.get_world_size()
    >>> _ = torch.manual_seed(0)                                               # the same levels on every rank
    >>> pk, pv = torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64)        # one shared segment
    >>> ok, ov = torch.randn(4, 2, 20, 64), torch.randn(4, 2, 20, 64)          # one segment a request
    >>> q = torch.randn(4, 8, 64)
    >>> shards = [CascadeLevel(*shard_kv(pk, pv, None, rank, world)), CascadeLevel(*shard_kv(ok, ov, None, rank, world))]
    >>> o = cp_cascade_decode(q, shards)
    >>> torch.allclose(o, cascade_decode(q, [CascadeLevel(pk, pv), CascadeLevel(ok, ov)]), atol=1e-5)
    True
    """
    def pre():
        check_inference("cp_cascade_decode", ("q", "levels", *cascade_kwargs), q, levels, *cascade_kwargs.values())
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] > 1:
            raise ValueError("q must have one row per request in cp_cascade_decode: several query rows need the "
                             "causal rule in global positions")
        check_bool("check_metadata", check_metadata)
        check_bool("return_lse", cascade_kwargs.get("return_lse", False))

    if torch.compiler.is_compiling():  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        pre()
        return _library.cp_cascade_decode(q, levels, group, check_metadata, cascade_kwargs)
    kwargs = dict(cascade_kwargs)
    checked = None
    if joins_agreement(q, check_metadata):  # the checks run inside the collective: every rank raises, none hangs
        def local():
            pre()
            levels_checked = check_cascade_args(q, levels, **kwargs)
            return cascade_meta(q, levels_checked[0], kwargs), levels_checked

        checked = agree(local, group, "cp_cascade_decode")
    else:
        pre()
    return_lse = kwargs.pop("return_lse", False)
    sinks = kwargs.pop("sinks", None)
    d = q.shape[-1]
    return _exchange(q, lambda o, lse, push: cascade_decode(q, levels, _out=(o.reshape(-1, d), lse.reshape(-1), push),
                                                            _checked=checked, **kwargs),
                     group=group, return_lse=return_lse, sinks=sinks, pushes=True)
