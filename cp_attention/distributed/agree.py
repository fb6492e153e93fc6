"""What must be equal on every rank of a context-parallel call, checked with one small collective.

Note [Agreement across ranks]
-----------------------------
Every rank of a context-parallel call merges the same states in the same order, so the arguments that shape
the states or the merge must be the same on every rank: q's shape and dtype, the KV heads, ``sm_scale``,
``split_size`` (and the shards' split slots), ``window_left``, ``logit_softcap``, ``sinks`` (by value),
``k_scale``/``v_scale`` (by value), for a cascade the levels' kinds and ``segment_ids`` (by value: a rank
whose requests read other segments would merge the states of other keys), and for a ``CPKVCache`` the global
lengths of its sequences (by value: every rank must have appended and rolled back the same tokens). A rank
whose arguments differ would not hang: it would merge states of another attention and return a wrong
answer, on some ranks only. The values of ``q`` are not compared (a digest would read ``q`` on the host at every
step). With ``check_metadata=True`` (the default) each rank validates its own arguments and all-gather one
fixed-size vector of int64 words: an ok flag, then each argument's value (``sm_scale`` as the IEEE bits of the
float32 the kernels take, other floats as those of their float64 value, tensors as a 64-bit digest of their
values as float64; ``-0.0`` counts as ``0.0`` and every NaN as one, and an FP8 scale as its value per KV head, so
a float, a 0-d tensor and an ``[Hkv]`` tensor of one value agree; ``tensor(0.01)``, a float32 number, is not the
float ``0.01``). A rank that rejected its arguments raises
its own error, the others raise naming it; a word that differs raises on every rank naming the argument. The
collective syncs with the host (it reads tensor values), so it is skipped while a CUDA graph is being captured:
a replay costs nothing, and the eager calls before the capture (the warm-up) have checked the same arguments. A
:class:`~cp_attention.distributed.CPKVCache` checks its ``rank``/``world_size`` against its group once, when it
is built, and :func:`~cp_attention.distributed.merge_across_ranks` / ``all_gather_states`` compare the state's
shape and dtype (``check_metadata``). The checks a call makes before its collective run inside it, so a rank
that rejects an argument still reaches the collective and every rank raises; only ``check_metadata`` itself must
be the same on every rank (a rank that skips the collective cannot tell the others).
"""
from __future__ import annotations

import hashlib
import math
import struct

import torch
import torch.distributed as dist

from .._constants import FLOAT_DTYPES, FP8_DTYPES
from .._validate import check_decode_args, check_split_size
from .exchange import all_gather_single

_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(FLOAT_DTYPES + FP8_DTYPES)}
# The words every rank contributes, in order (after the ok flag).
FIELDS = ("q.shape[0]", "q rows", "q heads", "head dim", "q.dtype", "KV heads", "sm_scale", "split_size",
          "split slots", "window_left", "logit_softcap", "k_scale", "v_scale", "sinks", "levels", "segment_ids",
          "cache lengths")


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _digest(t: torch.Tensor) -> int:
    """A 64-bit digest of a tensor's shape, dtype and values (a host copy: one sync for a CUDA tensor)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return struct.unpack("<q", h.digest())[0]


def value_word(x) -> int:
    """The word of an optional integer argument or tensor: 0 for None, an integer as itself (+1), a tensor's
    digest."""
    if x is None:
        return 0
    if isinstance(x, torch.Tensor):
        return _digest(x)
    return int(x) + 1


def scale_word(sm_scale, head_dim: int) -> int:
    """The word of ``sm_scale`` as the kernels take it, a float32 (None: ``1 / sqrt(D)``): ``32 ** -0.5`` and
    ``1 / math.sqrt(32)``, one float64 ulp apart, give the same bits and agree."""
    value = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return real_word(struct.unpack("<f", struct.pack("<f", value))[0])


def real_word(x, per: int | None = None) -> int:
    """The word of an optional real argument, the same for equal values in any form: 0 for None, the value's
    bits as a float64 (``30`` and ``30.0`` agree; so do ``tensor(0.5)`` and ``0.5``, ``-0.0`` and ``0.0``, and any
    two NaNs), a tensor of several values by the digest of its values as float64. ``per``: the value is one
    per KV head (an FP8 scale), a single value standing for all ``per`` of them."""
    if x is None:
        return 0
    if not isinstance(x, torch.Tensor) and (per is None or per == 1):  # a plain number: no tensor ops
        value = float(x) + 0.0  # -0.0 + 0.0 is 0.0
        return _bits(math.nan if value != value else value) or 1
    values = x.detach().double().reshape(-1) if isinstance(x, torch.Tensor) else torch.tensor([float(x)],
                                                                                               dtype=torch.float64)
    if per is not None and values.numel() == 1:
        values = values.expand(per)
    values = values + 0.0  # -0.0 + 0.0 is 0.0
    values = torch.where(torch.isnan(values), math.nan, values)
    word = _bits(values.item()) if values.numel() == 1 else _digest(values)
    return word or 1  # 0.0's bits are 0, None's word


def _collective_device(group) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(local, group, what: str, fields=FIELDS):
    """Run ``local()`` (validates this rank's arguments; returns ``(words, result)`` with ``len(fields)`` int
    words, or raises ``ValueError``/``TypeError``), all-gather the words of every rank and raise on every rank
    if a rank rejected its arguments or a word differs across ranks, naming the arguments; else return
    ``result``. See Note [Agreement across ranks]."""
    if not dist.is_initialized():  # the arguments first, so that an error names the argument
        local()
        raise ValueError(f"group: {what} needs an initialised process group (torch.distributed.init_process_group)")
    error, result = None, None
    try:
        words, result = local()
        meta = [1, *words]
    except (ValueError, TypeError) as exc:
        error = exc
        meta = [0] * (1 + len(fields))
    if len(meta) != 1 + len(fields):
        raise AssertionError(f"{what}: {len(meta) - 1} agreement words for {len(fields)} fields")
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
    differ = [name for i, name in enumerate(fields) if len({row[1 + i] for row in rows}) > 1]
    if differ:
        ranks = {name: [r for r, row in enumerate(rows) if row[1 + fields.index(name)] != rows[0][1 + fields.index(name)]]
                 for name in differ}
        detail = "; ".join(f"{name} differs from rank 0's on rank(s) {ranks[name]}" for name in differ)
        raise ValueError(f"{', '.join(differ)} must be equal on every rank of the group ({what}): {detail}")
    return result


def decode_meta(q, k_shard, v_shard, seq_lens_shard, kwargs, row_limits, window_left=None, global_lens=None):
    """:func:`agree`'s ``local`` of a context-parallel decode: checks every argument once (returns the
    :class:`~cp_attention._validate.CacheGeometry`) and gives the words that must agree (``global_lens``: a
    ``CPKVCache``'s global sequence lengths)."""
    geo = check_decode_args(q, k_shard, v_shard, seq_lens_shard, row_limits=row_limits, **kwargs)
    d = q.shape[-1]
    split_size = kwargs.get("split_size")
    words = [q.shape[0], geo.q_rows, q.shape[-2], d, _DTYPE_CODES[q.dtype], geo.hkv,
             scale_word(kwargs.get("sm_scale"), d), value_word(split_size),
             split_slots(split_size, geo.t_max), value_word(window_left), real_word(kwargs.get("logit_softcap")),
             real_word(kwargs.get("k_scale"), geo.hkv), real_word(kwargs.get("v_scale"), geo.hkv),
             real_word(kwargs.get("sinks")), 0, 0, value_word(global_lens)]
    return words, geo


def cascade_meta(q, checked, kwargs) -> list:
    """The words of a context-parallel cascade (its levels checked: ``[_validate.Level]``)."""
    d = q.shape[-1]
    kinds = hashlib.blake2b(repr([lv.kind for lv in checked]).encode(), digest_size=8).digest()
    hkv = checked[0].lvl.k.shape[2 if checked[0].lvl.block_table is not None else 1]
    return [q.shape[0], q.shape[1] if q.dim() == 4 else 1, q.shape[-2], d, _DTYPE_CODES[q.dtype], hkv,
            scale_word(kwargs.get("sm_scale"), d), 0, 0, 0,
            real_word(kwargs.get("logit_softcap")), real_word(kwargs.get("k_scale"), hkv),
            real_word(kwargs.get("v_scale"), hkv), real_word(kwargs.get("sinks")), struct.unpack("<q", kinds)[0],
            segments_word(checked), 0]


def segments_word(checked) -> int:
    """The word of a cascade's ``segment_ids``: a digest of every level's, ``None`` or its values (as int64, so
    equal ids in int32 and int64 agree; a CUDA tensor is read on the host, as ``sinks`` are)."""
    h = hashlib.blake2b(digest_size=8)
    for lv in checked:
        ids = lv.lvl.segment_ids
        h.update(b"none" if ids is None else struct.pack("<q", _digest(ids.long())))
    return struct.unpack("<q", h.digest())[0]


STATE_FIELDS = ("state.o.shape", "state.o.dtype")


def state_meta(state) -> tuple:
    """The words of an exchange of a checked ``state``: its shape and dtype."""
    shape = hashlib.blake2b(repr(tuple(state.o.shape)).encode(), digest_size=8).digest()
    return [struct.unpack("<q", shape)[0], _DTYPE_CODES.get(state.o.dtype, 0)], None


def split_slots(split_size, t_max) -> int:
    """Deterministic split slots of a shard: it must hold whole splits (Note [Deterministic splits])."""
    if split_size is None:
        return 0
    check_split_size(split_size)
    if t_max % split_size:
        raise ValueError(f"split_size must divide the shard's capacity for deterministic context parallelism "
                         f"(contiguous shards of whole splits), got split_size={split_size} and capacity {t_max}")
    return t_max // split_size


def check_ranks(rank: int, world_size: int, group, error: Exception | None = None) -> None:
    """A cache built for ``rank`` of ``world_size`` is rank ``rank`` of ``group`` of that size, on every rank (one
    collective, at construction). ``error``: this rank's rejection of its other arguments, raised here after the
    collective (the other ranks raise naming this rank), so that no rank waits for one that gave up."""
    true_rank, true_world = dist.get_rank(group), dist.get_world_size(group)
    device = _collective_device(group)
    mine = torch.tensor([rank, world_size, true_rank, true_world, error is None], dtype=torch.int64, device=device)
    everyone = torch.empty(5 * true_world, dtype=torch.int64, device=device)
    all_gather_single(everyone, mine, group=group)
    rows = everyone.view(true_world, 5).tolist()
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(rows) if not row[4]]
    if bad:
        raise ValueError(f"CPKVCache: rank(s) {bad} rejected their arguments (see their error)")
    bad_world = [r for r, row in enumerate(rows) if row[1] != row[3]]
    if bad_world:
        raise ValueError(f"world_size must be the group's size {true_world} on every rank, got "
                         f"{[row[1] for row in rows]} on ranks {list(range(true_world))}")
    bad_rank = [r for r, row in enumerate(rows) if row[0] != row[2]]
    if bad_rank:
        raise ValueError(f"rank must be this process's rank in the group on every rank, got "
                         f"{[row[0] for row in rows]} on ranks {list(range(true_world))}")
