"""``shard_kv``: one rank's shard of a KV cache split along the sequence (Note [Context-parallel decode] in
``distributed/decode.py``)."""
from __future__ import annotations

import torch

from .._constants import FLOAT_DTYPES, FP8_DTYPES
from .._validate import check_index_tensor, check_int, check_kv_layout, check_tensor

__all__ = ["shard_kv", "interleaved_counts", "PLACEMENTS"]

PLACEMENTS = ("contiguous", "interleaved")


def interleaved_counts(seq_lens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
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
        lens = interleaved_counts(seq_lens, rank, world_size)
    shards = []
    for t in (k, v):
        part = t.narrow(t_dim, 0, t_max)[(slice(None),) * t_dim + (idx,)]
        shape = list(t.shape)
        shape[t_dim] = cap
        shard = t.new_zeros(shape)
        shard.narrow(t_dim, 0, part.shape[t_dim]).copy_(part)
        shards.append(shard)
    return shards[0], shards[1], lens.to(seq_lens.dtype)
