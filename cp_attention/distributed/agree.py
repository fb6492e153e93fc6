"""Arguments that must agree across the ranks of a context-parallel call, checked with one small collective, so
that a mismatch (or an argument one rank rejected) raises on every rank instead of hanging or merging wrong states."""
from __future__ import annotations

import math
import struct

import torch
import torch.distributed as dist

from .._constants import FLOAT_DTYPES
from .._validate import check_decode_args, check_sm_scale, check_split_size
from .exchange import all_gather_single

_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(FLOAT_DTYPES)}


def _collective_device(group) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _scale_bits(sm_scale, d) -> int:
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def agree(local_meta, group, what: str) -> None:
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
    all_gather_single(everyone, mine, group=group)
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


def decode_meta(q, k_shard, v_shard, seq_lens_shard, kwargs, row_limits):
    geo = check_decode_args(q, k_shard, v_shard, seq_lens_shard, block_table=kwargs.get("block_table"),
                            num_splits=kwargs.get("num_splits"), kv_layout=kwargs.get("kv_layout", "HND"),
                            row_limits=row_limits, k_scale=kwargs.get("k_scale"), v_scale=kwargs.get("v_scale"),
                            window_left=kwargs.get("window_left"), logit_softcap=kwargs.get("logit_softcap"),
                            sinks=kwargs.get("sinks"))
    check_sm_scale(kwargs.get("sm_scale"))
    d = q.shape[-1]
    return [q.shape[0], geo.q_rows, q.shape[-2], d, _DTYPE_CODES[q.dtype], geo.hkv, _scale_bits(kwargs.get("sm_scale"), d),
            split_slots(kwargs.get("split_size"), geo.t_max)]


def split_slots(split_size, t_max) -> int:
    """Deterministic split slots of a shard: it must hold whole splits (Note [Deterministic splits])."""
    if split_size is None:
        return 0
    check_split_size(split_size)
    if t_max % split_size:
        raise ValueError(f"split_size must divide the shard's capacity for deterministic context parallelism "
                         f"(contiguous shards of whole splits), got split_size={split_size} and capacity {t_max}")
    return t_max // split_size
