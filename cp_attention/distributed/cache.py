"""``CPKVCache``: one rank's shard of a KV cache for context-parallel decode (interleaved placement)."""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from .. import _device, _library
from .._constants import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES
from ..decode import flash_decode
from .._validate import (check_bool, check_device, check_head_dim, check_inference, check_int, check_kv_scales,
                         check_not_taken, check_tensor, check_unit_stride)
from .agree import check_ranks
from .decode import cp_decode
from .shard import interleaved_counts, shard_kv

__all__ = ["CPKVCache"]


class CPKVCache:
    """One rank's shard of a KV cache for context-parallel decode, interleaved placement, dense or paged.

    Global position ``p`` of every sequence lives on rank ``p % W`` at local slot ``p // W`` (the
    ``"interleaved"`` placement of :func:`shard_kv`), so decode tokens go round-robin and the shards stay
    balanced. Every rank calls :meth:`append` with the same tokens; only the owner of each stores it.

    Attributes:
        k, v: dense: ``[B, Hkv, capacity, D]`` views of this rank's buffers (``capacity = ceil(max_seq_len
            / W)``; the buffers, ``k._base``, have one scratch slot more); paged (``page_size`` given): page
            pools ``[num_pages, page_size, Hkv, D]`` (the vLLM / FlashInfer layout) read through
            :attr:`block_table`.
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

    On every rank of an initialised process group (torchrun), with the same tokens on every rank:

    >>> cache = CPKVCache(2, 2, 64, max_seq_len=256, dtype=torch.float32)   # rank, size: the default group's
    >>> for _ in range(5):                                # one token per sequence a step, [B, Hkv, D]
    ...     cache.append(torch.randn(2, 2, 64), torch.randn(2, 2, 64))
    >>> cache.decode(torch.randn(2, 8, 64)).shape         # [B, Hq, D]: attention over the 5 tokens
    torch.Size([2, 8, 64])
    """

    def __init__(self, batch, heads_kv, head_dim, max_seq_len, *, dtype=torch.bfloat16, device=None,
                 rank=None, world_size=None, group=None, page_size=None, k_scale=None, v_scale=None):
        """Empty cache for ``batch`` sequences of up to ``max_seq_len`` tokens each (all ranks together);
        ``page_size`` (int >= 1): keep the shard in pages of that many slots. An FP8 ``dtype``
        (``float8_e4m3fn``/``float8_e5m2``) needs the dequantisation scales ``k_scale``/``v_scale`` (as in
        :func:`flash_decode`); :meth:`append` then quantises float16/bfloat16/float32 tokens with them.

        ``rank`` and ``world_size`` default to this process's rank and size in ``group``; when given while a
        process group is initialised, they are checked against it on every rank (one collective, here:
        Note [Agreement across ranks]).
        """
        grouped = dist.is_available() and dist.is_initialized()
        try:  # with a process group, a rejected argument is raised inside the ranks' check: no rank hangs
            batch = check_int("batch", batch, 1)
            heads_kv = check_int("heads_kv", heads_kv, 1)
            head_dim = check_int("head_dim", head_dim, 1)
            check_head_dim(head_dim, "head_dim:")
            max_seq_len = check_int("max_seq_len", max_seq_len, 1)
            if page_size is not None:
                page_size = check_int("page_size", page_size, 1)
            if dtype not in FLOAT_DTYPES + FP8_DTYPES:
                raise TypeError(f"dtype must be one of {FLOAT_DTYPES + FP8_DTYPES}, got {dtype}")
            device = check_device("device", device)
            check_kv_scales(k_scale, v_scale, dtype, torch.bfloat16, heads_kv, device)
            if (rank is None or world_size is None) and not grouped:
                raise ValueError("CPKVCache: pass rank and world_size, or initialise a process group "
                                 "(torch.distributed.init_process_group) to take them from")
            world_size = check_int("world_size", dist.get_world_size(group) if world_size is None else world_size, 1)
            rank = check_int("rank", dist.get_rank(group) if rank is None else rank, 0, world_size - 1)
            error = None
        except (ValueError, TypeError) as exc:
            error = exc
        if grouped:
            check_ranks(rank if error is None else -1, world_size if error is None else -1, group, error)
        elif error is not None:
            raise error
        self.rank = rank
        self.k_scale, self.v_scale = k_scale, v_scale
        self.world_size = world_size
        self.group = group
        self.max_seq_len = max_seq_len
        self.capacity = -(-max_seq_len // world_size)
        self.page_size = page_size
        if page_size is None:
            shape = (batch, heads_kv, self.capacity + 1, head_dim)  # + 1: the scratch slot of non-owners
            self.block_table, self.kv_layout = None, "HND"
        else:
            pages = -(-self.capacity // page_size)
            # Sequence b owns pages [b * pages, (b + 1) * pages); the last page is the scratch page.
            shape = (batch * pages + 1, page_size, heads_kv, head_dim)
            self.block_table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
            self.kv_layout = "NHD"
        self._k = torch.zeros(shape, dtype=dtype, device=device)  # the buffers, scratch slot or page included
        self._v = torch.zeros(shape, dtype=dtype, device=device)
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

        >>> k, v = torch.randn(2, 2, 100, 64), torch.randn(2, 2, 100, 64)   # the whole prefix, on every rank
        >>> cache = CPKVCache.from_prefix(k, v, torch.tensor([100, 37]), max_seq_len=164)
        >>> cache.global_seq_lens.tolist()
        [100, 37]
        """
        check_tensor("k", k, dtypes=FLOAT_DTYPES + FP8_DTYPES, ndim=4)
        b, hkv, t, d = k.shape
        if isinstance(max_seq_len, numbers.Integral) and max_seq_len < t:
            raise ValueError(f"max_seq_len must be >= the prefix capacity T = {t}, got {max_seq_len}")
        dtype = k.dtype if dtype is None else dtype
        if dtype in FP8_DTYPES and k.dtype not in FP8_DTYPES and k_scale is None and v_scale is None:
            from ..quant import quantize_kv

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
            page = torch.where(mine, self.block_table[b_idx, page_col].long(), self._k.shape[0] - 1)
            off = torch.where(mine, slots % self.page_size, 0)
            self._k[page, off] = k_rows
            self._v[page, off] = v_rows

    def _quantized(self, k_rows, v_rows):
        """``k_rows``/``v_rows [B, n, Hkv, D]`` in the cache's dtype: float rows quantised with the scales of an
        FP8 cache, others as they are."""
        if self._k.dtype not in FP8_DTYPES or k_rows.dtype in FP8_DTYPES:
            return k_rows, v_rows
        from ..quant import quantize

        return tuple(quantize(x, torch.as_tensor(sc, dtype=torch.float32, device=x.device), self._k.dtype, 2)
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
        self.seq_lens.copy_(interleaved_counts(self.global_seq_lens, self.rank, self.world_size))
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
        ``torch._dynamo.mark_static_address``: the buffers (paged: ``k`` and ``v``; dense: ``k._base`` and
        ``v._base``, the buffers with the scratch slot, of which ``k`` and ``v`` are views made at each
        read), ``seq_lens`` and ``global_seq_lens``; and make one eager :meth:`decode` call of each query
        shape, which allocates the exchange's buffers."""
        check_inference("CPKVCache.append", ("k_new", "v_new"), k_new, v_new)
        b, hkv, d = self.seq_lens.shape[0], self._heads_kv, self._head_dim
        dtypes = (self._k.dtype,) + (FLOAT_DTYPES if self._k.dtype in FP8_DTYPES else ())
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            check_tensor(name, t, dtypes=dtypes, device=self._k.device)
            check_unit_stride(name, t)
            t4 = t.unsqueeze(1) if t.dim() == 3 else t
            if t4.dim() != 4 or t4.shape[0] != b or tuple(t4.shape[2:]) != (hkv, d):
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
            raise ValueError(f"CPKVCache is full: {n} more tokens would pass max_seq_len = {self.max_seq_len} "
                             f"({self.free_slots} free)")
        if _device.use_triton(self._k):
            from ..ops.append import append_tokens

            k_new, v_new = self._quantized(k_new, v_new)
            append_tokens(k_new, v_new, self.k, self.v, self.block_table, self.seq_lens, self.global_seq_lens,
                          self.rank, self.world_size, self.capacity)
        else:
            pos = self.global_seq_lens[:, None] + torch.arange(n, device=self._k.device)  # [B, n] global positions
            slots = torch.div(pos, self.world_size, rounding_mode="floor")
            mine = (pos.remainder(self.world_size) == self.rank) & (slots < self.capacity)
            self._store(slots, mine, k_new, v_new)
            self.seq_lens += mine.sum(1).to(self.seq_lens.dtype)
            self.global_seq_lens += n
        self._host_max_len += n

    def rollback(self, n) -> None:
        """Drop the last ``n`` tokens of each sequence (rejected drafts). The slots are overwritten by later
        appends.

        ``n``: an int ``>= 0``, at most the shortest sequence's length (else ``ValueError``: reading the lengths
        is one host sync); or a ``[B]`` int tensor on the cache's device, applied on the device without a host
        sync, where sequence ``b`` drops ``min(max(n[b], 0), length[b])`` tokens (it never goes below empty).
        The host-side capacity count only moves back for an int ``n``."""
        if isinstance(n, torch.Tensor):
            check_tensor("n", n, dtypes=INDEX_DTYPES, ndim=1, device=self.global_seq_lens.device)
            if n.shape[0] != self.global_seq_lens.shape[0]:
                raise ValueError(f"n must have shape [{self.global_seq_lens.shape[0]}], got {tuple(n.shape)}")
            drop = torch.minimum(n.long().clamp(min=0), self.global_seq_lens)
        else:
            drop = check_int("n", n, 0)
            if drop:
                shortest = int(self.global_seq_lens.min())
                if drop > shortest:
                    raise ValueError(f"n must be at most the shortest sequence's length {shortest}, got {drop}")
            self._host_max_len = max(0, self._host_max_len - drop)
        self.global_seq_lens.sub_(drop)
        self.seq_lens.copy_(interleaved_counts(self.global_seq_lens, self.rank, self.world_size))

    def decode(self, q, **kwargs):
        """Attention of ``q [B, Hq, D]``, or ``q [B, Q, Hq, D]`` with the causal rule in global positions,
        over the cache, merged across the ranks (all ranks call it); ``kwargs`` as in
        :func:`cp_flash_decode`, plus ``window_left`` (in global positions, as in :func:`flash_decode`); not
        ``row_limits``, ``block_table``, ``kv_layout``, ``k_scale``, ``v_scale``, which the cache sets itself,
        nor ``out`` (``TypeError``), with or without a process group."""
        check_metadata = kwargs.pop("check_metadata", True)
        window = kwargs.pop("window_left", None)

        given = dict(kwargs)  # the caller's arguments (kwargs gains the cache's own below)

        def pre():
            check_inference("CPKVCache.decode", ("q", *given), q, *given.values())
            check_not_taken("CPKVCache.decode", given, CACHE_OWN)
            if window is not None:
                check_int("window_left", window, 0)

        try:  # a rejected argument is raised inside the agreement collective (cp_decode), so no rank hangs
            pre()
            rejected = None
        except (ValueError, TypeError) as exc:
            rejected = exc
        row_limits = span = None
        n_q = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 1
        if rejected is None and (n_q > 1 or window is not None):
            # Row i sees the global positions [L - Q + i - W, L - Q + 1 + i): on this rank, the owned slots
            # below each end (interleaved placement: counted, not searched).
            end = self.global_seq_lens[:, None] - n_q + 1 + torch.arange(n_q, device=self.seq_lens.device)
            first = end - 1 - window if window is not None else torch.zeros_like(end)
            row_limits = torch.stack([interleaved_counts(x.clamp(min=0), self.rank, self.world_size)
                                      for x in (first, end)], dim=-1).to(torch.int32)
            if window is not None:
                span = -(-(window + n_q) // self.world_size) + 1
        if self.k_scale is not None:
            kwargs = dict(kwargs, k_scale=self.k_scale, v_scale=self.v_scale)
        if self.world_size == 1 and not (dist.is_available() and dist.is_initialized()):  # one process, no group
            if rejected is not None:
                raise rejected
            check_bool("check_metadata", check_metadata)
            return flash_decode(q, self.k, self.v, self.seq_lens, row_limits=row_limits, _span=span,
                                block_table=self.block_table, kv_layout=self.kv_layout, **kwargs)
        return cp_decode(q, self.k, self.v, self.seq_lens, group=self.group, check_metadata=check_metadata,
                         row_limits=row_limits, span=span, window_left=window, global_lens=self.global_seq_lens,
                         what="CPKVCache.decode", pre=None if rejected is None else _raiser(rejected),
                         kwargs=dict(kwargs, block_table=self.block_table, kv_layout=self.kv_layout))

    # A dense cache's k/v are views made from the buffers at each read, never kept: traced code then takes the
    # buffers alone as graph inputs (an input aliasing another, mutated one, keeps CUDA graphs out).
    @property
    def k(self) -> torch.Tensor:
        return self._k[:, :, : self.capacity] if self.block_table is None else self._k

    @property
    def v(self) -> torch.Tensor:
        return self._v[:, :, : self.capacity] if self.block_table is None else self._v

    @property
    def _heads_kv(self) -> int:
        return self._k.shape[1] if self.block_table is None else self._k.shape[2]

    @property
    def _head_dim(self) -> int:
        return self._k.shape[3]


# What CPKVCache.decode sets itself, and why a caller cannot pass it.
CACHE_OWN = {**{name: "the cache has its own" for name in ("block_table", "kv_layout", "k_scale", "v_scale")},
             "row_limits": "the cache derives every row's limits on this rank from its global lengths: the causal "
                           "rule of several query rows and window_left",
             "out": "the local state goes into the exchange buffer across ranks"}


def _raiser(exc: Exception):
    """A check that raises ``exc`` (an argument rejected before the collective that must report it)."""
    def check():
        raise exc
    return check
