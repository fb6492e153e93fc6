"""How per-rank attention states travel between the ranks of a group, chosen once per group.

Note [Exchanges]
----------------
Context-parallel decode ends with ⊕ over every rank's packed states ``[..., D + 1]`` float32 (``o`` then
``lse``; Note [Context-parallel decode]). Two exchanges implement it behind one interface:

* :class:`CollectiveExchange` (NCCL on GPUs, gloo on CPUs): one all-gather of the packed states, then the
  merge kernel over the gathered ``[W, ..., D + 1]`` in rank order;
* :class:`SymmMemExchange` (GPUs of one host with NVLink P2P): the local attention writes its states into
  this rank's part of a persistent symmetric buffer, and one kernel pushes them, flagged, into every
  peer's buffer, waits for the peers' flagged states and merges (Note [Symmetric-memory merge] in
  ``ops/symm_merge.py``). No collective launch, no host synchronisation; a buffer per (shape, device),
  allocated at the first call of that shape (a collective: every rank makes the same calls) and reused by
  every later call and CUDA-graph replay. A call of a new shape inside a CUDA-graph capture cannot
  allocate: it takes the collective path (warm up with the shapes you capture). NVLink multicast stays
  off (``TORCH_SYMM_MEM_DISABLE_MULTICAST`` defaults to 1 here, unless the environment sets it).

Both merge the same states in rank order, so every rank's result is bitwise identical; which exchange a
group uses is decided once, on the first call, from facts every rank agrees on (:func:`exchange_for`), or
set with :func:`set_exchange` (``"auto"``, ``"symm"``, ``"collective"``).
"""
from __future__ import annotations

import math
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .. import _device

from ..ops.symm_merge import buffer_words, push_plan, symm_merge_into
from ..ops.merge import merge_states_into
from ..state import AttentionState, merge_states_torch

EXCHANGES = ("auto", "symm", "collective")
# torch >= 2.13 names the one-tensor all-gather all_gather_single; older releases all_gather_into_tensor
# (and, among the functional collectives, all_gather_tensor).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_gather_traceable(t: torch.Tensor, group=None) -> torch.Tensor:
    """``[W * n]``: ``t [n]`` of every rank of ``group`` (default: the default group), in rank order, through
    torch's functional collectives: the same call eager and under ``torch.compile``."""
    return _funcol_all_gather(t, 0, group if group is not None else dist.group.WORLD)


class Push:
    """Where the kernel that computes a rank's states may also push them to the peers (``ops/symm_merge.py``,
    the producer's push): ``args = (buf_ptrs, rank, world, exchange_block_m)`` for ``push_rows``. The
    producer sets ``done`` when it pushed; else the exchange pushes itself."""

    def __init__(self, args):
        self.args = args
        self.done = False


class CollectiveExchange:
    """One all-gather (NCCL or gloo) of the packed states, then ⊕ over them in rank order."""

    name = "collective"

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)

    def packed_buffer(self, shape, device) -> torch.Tensor:
        """A float32 buffer ``shape = [..., D + 1]`` for this rank's packed states."""
        return _device.new_buffer(tuple(shape), torch.float32, device)

    def gather(self, packed) -> torch.Tensor:
        """``[W, *packed.shape]``: every rank's ``packed`` in rank order."""
        gathered = _device.new_buffer((self.world,) + tuple(packed.shape), torch.float32, packed.device)
        # Flat 1-D buffers: every backend accepts a concatenation along dim 0 (gloo rejects a stack).
        all_gather_single(gathered.view(-1), packed.reshape(-1), group=self.group)
        return gathered

    def push_target(self, packed):
        """A :class:`Push` for the kernel that writes ``packed`` (a :meth:`packed_buffer`), or ``None``."""
        return None

    def merge(self, packed, out_dtype, sinks=None, push=None) -> AttentionState:
        """⊕ of every rank's packed states ``[..., D + 1]``: ``o [..., D]`` in ``out_dtype``, ``lse [...]``;
        ``push``: the :class:`Push` of :meth:`push_target` given to the kernel that wrote ``packed``."""
        return merge_gathered(self.gather(packed), out_dtype, sinks)


def merge_gathered(gathered: torch.Tensor, out_dtype: torch.dtype, sinks=None) -> AttentionState:
    """⊕ over dim 0 of gathered packed states ``[W, ..., D + 1]`` in rank order, in the layout whose bits the
    symmetric-memory kernel reproduces (``ops/merge.py``, :func:`merge_config` without ``one_warp``), so both
    exchanges give the same bits; on the torch path, plain float32 torch."""
    d = gathered.shape[-1] - 1
    lead = tuple(gathered.shape[1:-1])
    if not _device.use_triton(gathered):
        return merge_states_torch(gathered[..., :d], gathered[..., d], out_dtype, sinks)
    w, m = gathered.shape[0], math.prod(lead)
    o = _device.new_buffer(lead + (d,), out_dtype, gathered.device)
    lse = _device.new_buffer(lead, torch.float32, gathered.device)
    flat = gathered.view(w, m, d + 1)
    merge_states_into(flat[..., :d], flat[..., d], o.view(m, d), lse.view(m), sinks=sinks, one_warp=False)
    return AttentionState(o, lse)


class SymmMemExchange(CollectiveExchange):
    """One kernel over NVLink symmetric memory: push this rank's states with their flags, wait for the
    peers' flagged states, merge (see the Note)."""

    name = "symm"

    def __init__(self, group):
        super().__init__(group)
        self.rank = dist.get_rank(group)
        self.group_name = group.group_name if group is not None else dist.group.WORLD.group_name
        self._buffers = {}  # (shape, device index) -> (handle, this rank's slot [*shape], buffer addresses [W])

    def _buffer(self, shape, device):
        key = (tuple(shape), device.index)
        entry = self._buffers.get(key)
        if entry is None and not torch.cuda.is_current_stream_capturing():
            entry = self._buffers[key] = self._allocate(tuple(shape), device)
        return entry

    def _allocate(self, shape, device):
        from torch.distributed import _symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        d = shape[-1] - 1
        m = math.prod(shape[:-1])
        with torch.cuda.device(device):
            buf = symm_mem.empty(buffer_words(m, d, self.world), dtype=torch.float32, device=device)
            handle = symm_mem.rendezvous(buf, self.group_name)
            buf.view(torch.int32).zero_()  # no flag set, no call made (ops/symm_merge.py)
            # The tensor may start inside its allocation: at the same offset on every rank (symmetric).
            offset = buf.data_ptr() - handle.buffer_ptrs[self.rank]
            ptrs = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
            torch.cuda.synchronize(device)
        dist.barrier(group=self.group, device_ids=[device.index])  # every rank's flags are zeroed before any push
        return handle, buf[:m * (d + 1)].view(shape), ptrs

    def packed_buffer(self, shape, device) -> torch.Tensor:
        entry = self._buffer(shape, device) if device.type == "cuda" else None
        if entry is None:
            return super().packed_buffer(shape, device)
        slot = entry[1]
        if _device.POISON_OUTPUTS:
            slot.fill_(float("nan"))
        return slot

    def _entry_of(self, packed):
        """The buffer entry whose slot ``packed`` is, or ``None`` (not in a symmetric buffer: see the Note)."""
        entry = self._buffers.get((tuple(packed.shape), packed.device.index)) if packed.is_cuda else None
        return entry if entry is not None and packed.data_ptr() == entry[1].data_ptr() else None

    def push_target(self, packed):
        entry = self._entry_of(packed)
        if entry is None:
            return None
        d = packed.shape[-1] - 1
        block_m = push_plan(math.prod(packed.shape[:-1]), d, self.world)
        return None if block_m is None else Push((entry[2], self.rank, self.world, block_m))

    def merge(self, packed, out_dtype, sinks=None, push=None) -> AttentionState:
        entry = self._entry_of(packed)
        if entry is None:
            return super().merge(packed, out_dtype, sinks)
        d = packed.shape[-1] - 1
        lead = tuple(packed.shape[:-1])
        m = math.prod(lead)
        o = _device.new_buffer(lead + (d,), out_dtype, packed.device)
        lse = _device.new_buffer(lead, torch.float32, packed.device)
        if m:
            symm_merge_into(entry[2], self.rank, self.world, m, d, o.view(m, d), lse.view(m), sinks=sinks,
                            pdl=_device.use_pdl(packed.device), pushed=push is not None and push.done)
        return AttentionState(o, lse)


_CHOICE = {}  # group name -> "auto" | "symm" | "collective" (set_exchange)
_EXCHANGES = {}  # (group name, kind) -> the exchange (kept, with its buffers, when the choice changes)
_IN_USE = {}  # group (None for the world) -> its exchange now: the hot path's one lookup


def _check_initialised() -> None:
    if not dist.is_initialized():  # else a cached exchange of a destroyed group, or an AttributeError of None
        raise ValueError("group: exchanging attention states across ranks needs an initialised process group "
                         "(torch.distributed.init_process_group)")


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def set_exchange(kind: str = "auto", group=None) -> None:
    """Choose how ``group`` exchanges states (every rank calls it alike, before the next CP call):
    ``"symm"`` (NVLink symmetric memory; raises ``ValueError`` at the next call if the group's GPUs cannot
    use it), ``"collective"`` (NCCL / gloo all-gather) or ``"auto"`` (symm where possible, the default).
    Raises ``ValueError`` without an initialised process group.

    On every rank of an initialised process group:

    >>> set_exchange("collective")      # e.g. to compare against NCCL in a benchmark
    >>> set_exchange("auto")
    """
    if kind not in EXCHANGES:
        raise ValueError(f"kind must be one of {EXCHANGES}, got {kind!r}")
    _check_initialised()
    _CHOICE[_group_name(group)] = kind
    _IN_USE.clear()


def _p2p_capable(group) -> bool:
    """Every rank of ``group`` is a CUDA device of this host with P2P access to every other rank's (all
    ranks agree: the facts are all-gathered)."""
    mine = (socket.gethostname(), torch.cuda.current_device())
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    ok = all(host == mine[0] for host, _ in everyone) and all(
        dev == mine[1] or torch.cuda.can_device_access_peer(mine[1], dev) for _, dev in everyone)
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        ok = False
    votes = [None] * len(everyone)
    dist.all_gather_object(votes, ok, group=group)
    return all(votes)


def exchange_for(group) -> CollectiveExchange:
    """The exchange of ``group`` (decided at its first call, see Note [Exchanges])."""
    _check_initialised()
    exchange = _IN_USE.get(group)
    if exchange is not None:
        return exchange
    name = _group_name(group)
    kind = _CHOICE.get(name) or os.environ.get("CP_ATTENTION_EXCHANGE", "auto")
    exchange = _EXCHANGES.get((name, kind))
    if exchange is not None:
        _IN_USE[group] = exchange
        return exchange
    if kind not in EXCHANGES:
        raise ValueError(f"CP_ATTENTION_EXCHANGE must be one of {EXCHANGES}, got {kind!r}")
    backend = str(dist.get_backend(group))
    gpu = "nccl" in backend and "gloo" not in backend
    capturing = gpu and torch.cuda.is_current_stream_capturing()
    if kind == "collective" or (kind == "auto" and (not gpu or capturing)):
        exchange = CollectiveExchange(group)
    elif gpu and not capturing and _p2p_capable(group):
        exchange = SymmMemExchange(group)
    elif kind == "symm":
        raise ValueError("set_exchange('symm'): the group is not NCCL over CUDA devices of one host with P2P access"
                         + (" (or the first call is being captured in a CUDA graph)" if capturing else ""))
    else:
        exchange = CollectiveExchange(group)
    if not capturing:
        _EXCHANGES[(name, kind)] = _IN_USE[group] = exchange
    return exchange
