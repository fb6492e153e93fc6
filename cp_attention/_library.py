"""The public functions as ``torch.library`` custom ops (namespace ``cp_attention``), for ``torch.compile``.

Note [Custom ops under torch.compile]
-------------------------------------
Dynamo cannot trace the eager code of the attention functions: it reads host tensors' index values (the
range checks of CPU ``seq_lens``, ``block_table``, ``segment_ids``), keeps Python caches of prepared
launches and launches Triton kernels through its own launcher. So each public function, while Dynamo
traces it (``torch.compiler.is_compiling()``), calls a custom op instead, and the graph holds that op:

* the op's real implementation is the eager function itself, called with plain tensors when the compiled
  graph runs: it validates (index values of host tensors included), plans and launches as an eager call
  does, so a compiled call computes the same bits as an eager one;
* its fake implementation gives the outputs' shapes and dtypes from the inputs' and runs, at trace time,
  the eager argument checks that read no tensor values, so bad input raises while tracing, with the
  eager message naming the argument. The eager validators of ``flash_decode`` and ``cascade_decode``
  also check the values of host index tensors: at trace time they get a zero tensor of the index
  tensor's shape and dtype in its place (:func:`_without_values`), whose values pass every range check,
  so only the checks of shapes, dtypes and devices can fail there. Checks that a public function runs
  before it dispatches (of Python values and tensor metadata only) are traced by Dynamo, and a failing
  one fails the trace with its message too. Scalars that Dynamo traces as symbols are made concrete (a
  guard each);
* an eager call never goes through the dispatcher: the only additions to its path are the
  ``is_compiling()`` test and :func:`cp_attention._validate.check_inference`, so the decode hot path
  keeps its host time (Note [The decode hot path] in ``decode.py``).

Schemas carry what a schema can: optional Python floats and ints as ``float?``/``int?``, an FP8 scale as
a tensor argument and a float argument (one of them given), a ``CascadeLevel`` list as parallel lists of
tensors (``Tensor[]``, ``Tensor?[]``), a process group as its name (``group.group_name``; ``None`` for
the default group), resolved by the real implementation. Every op returns fresh ``(o, lse)`` tensors; a
public function called with ``return_lse=False`` drops ``lse``, and one called with ``out=`` gets the op's
state in ``out``'s dtype and copies it into ``out`` (what the eager call writes there directly). A
``DecodePlan`` (``plan=``) is a Python object that no schema carries: it is refused under compile.
``quantize_kv`` has no op: it is torch code, which Dynamo traces and inductor fuses.

CUDA graphs. ``mode="reduce-overhead"`` runs the ops inside the memory pool of torch.compile's CUDA-graph
trees, which requires every allocation made there to be freed or be a graph output. So the real
implementations give the eager decode calls they make a scratch of their own (:func:`_scratch_of_its_own`)
instead of the kept per-stream one, and a context-parallel exchange must have allocated its buffers
for a shape before (one eager call of that shape: Note [Exchanges] in ``exchange.py``).

Context parallelism: ``check_metadata`` runs in the real implementation (it syncs with the host, which the
compiled graph does not see) and is skipped while a CUDA graph is being captured. ``CPKVCache.append`` is
an op that mutates the cache's buffers and lengths (``mutates_args``), so the compiler orders it before
the reads of a later ``decode``; the cache's host-side length count cannot advance inside a compiled graph
(see :meth:`CPKVCache.append`).
"""
import contextlib
from typing import Optional

import torch
from torch import Tensor

from . import _device
from ._constants import FP8_DTYPES
from ._validate import check_bool, check_sm_scale

# The modules of the public functions import this one, so it imports theirs inside its functions.

# -------------------------------------------------------------------------------------------------------
# Helpers of the real and fake implementations


def _scale(tensor, number):
    """An FP8 scale from its two schema arguments (the tensor one, or the float one, or neither)."""
    return tensor if tensor is not None else number


def _split_scale(scale):
    """``(tensor, float)`` schema arguments of an FP8 scale: a tensor goes in the first, anything else in
    the second (where the schema refuses what is no number)."""
    return (scale, None) if isinstance(scale, Tensor) else (None, scale)


def _group(name):
    """The process group of a schema's group name (``None``: the default group)."""
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _group_name(group):
    return None if group is None else group.group_name


def _capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _without_values(t):
    """What an eager validator gets at trace time for the index tensor ``t`` (Note [Custom ops under
    torch.compile]): ``t`` itself when it is a CUDA tensor (whose values the validators never read), else a
    real zero tensor of ``t``'s shape, dtype and device. Call it with fake mode unset."""
    if t is None or t.is_cuda:
        return t
    return torch.zeros([int(n) for n in t.shape], dtype=t.dtype, device=t.device)


def _concrete(x):
    """A Python scalar the validators can check: a symbolic int or float made concrete (a guard)."""
    if isinstance(x, torch.SymInt):
        return int(x)
    if isinstance(x, torch.SymFloat):
        return float(x)
    return x


@contextlib.contextmanager
def _scratch_of_its_own():
    """The eager decode calls made inside (on any stream) get scratch buffers of their own (the kernels'
    split workspace and LSE scratch), freed when the op returns, instead of the ones kept per (device,
    stream) (Note [The decode hot path]): ``mode="reduce-overhead"`` runs the op inside the memory pool of
    torch.compile's CUDA-graph trees, where every allocation must be freed or be a graph output, and a
    kept buffer would stay there untracked."""
    from . import decode

    kept = decode._SCRATCH
    decode._SCRATCH = {}
    try:
        yield
    finally:
        decode._SCRATCH = kept


def _no_fake_mode():
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def _new_state(q: Tensor, out: Optional[Tensor]):
    """Fresh ``(o, lse)`` for a state of ``q``'s rows: ``o`` of q's shape in ``out``'s dtype (q's without
    ``out``), ``lse`` float32 of ``q.shape[:-1]``."""
    dtype = q.dtype if out is None else out.dtype
    return (_device.new_buffer(tuple(q.shape), dtype, q.device),
            _device.new_buffer(tuple(q.shape[:-1]), torch.float32, q.device))


def _fake_state(q: Tensor, out: Optional[Tensor] = None):
    dtype = q.dtype if out is None else out.dtype
    return q.new_empty(q.shape, dtype=dtype), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _fresh(t: Tensor) -> Tensor:
    """``t`` in the dense layout an op's outputs have (and owning its memory where it was a view)."""
    return t.contiguous() if t._base is None else t.clone(memory_format=torch.contiguous_format)


def _split_out(out):
    """``(o, lse or None)`` of a public function's ``out=`` (a tensor or a pair of tensors)."""
    if out is None or isinstance(out, Tensor):
        return out, None
    from ._validate import unpack_out

    return unpack_out(out)


def _copy_out(o, lse, out_o, out_lse, return_lse):
    """The public result of an op's ``(o, lse)``: copied into the caller's ``out`` where given."""
    from .state import AttentionState

    if out_o is not None:
        o = out_o.copy_(o)
    if out_lse is not None:
        lse = out_lse.copy_(lse)
    return AttentionState(o, lse) if return_lse else o


# -------------------------------------------------------------------------------------------------------
# flash_decode


@torch.library.custom_op("cp_attention::flash_decode", mutates_args=())
def flash_decode_op(q: Tensor, k: Tensor, v: Tensor, seq_lens: Optional[Tensor], block_table: Optional[Tensor],
                    row_limits: Optional[Tensor], sinks: Optional[Tensor], k_scale: Optional[Tensor],
                    v_scale: Optional[Tensor], k_scale_float: Optional[float], v_scale_float: Optional[float],
                    sm_scale: Optional[float], num_splits: Optional[int], split_size: Optional[int], kv_layout: str,
                    window_left: Optional[int], logit_softcap: Optional[float], out: Optional[Tensor],
                    out_lse: Optional[Tensor], span: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """:func:`cp_attention.flash_decode` with ``return_lse=True``; ``out``/``out_lse``: the caller's
    ``out=``, read for its dtype (``o`` comes in it) and checked, not written."""
    from .decode import flash_decode
    from .state import AttentionState

    o, lse = _new_state(q, out)
    with _scratch_of_its_own():
        flash_decode(q, k, v, seq_lens, block_table=block_table, sm_scale=sm_scale, num_splits=num_splits,
                     kv_layout=kv_layout, split_size=split_size, k_scale=_scale(k_scale, k_scale_float),
                     v_scale=_scale(v_scale, v_scale_float), window_left=window_left, logit_softcap=logit_softcap,
                     sinks=sinks, row_limits=row_limits, return_lse=True, out=AttentionState(o, lse), _span=span)
    return o, lse


@flash_decode_op.register_fake
def _(q, k, v, seq_lens, block_table, row_limits, sinks, k_scale, v_scale, k_scale_float, v_scale_float, sm_scale,
      num_splits, split_size, kv_layout, window_left, logit_softcap, out, out_lse, span=None):
    from ._validate import check_decode_args, check_split_size

    sm_scale, num_splits, split_size, window_left, logit_softcap, k_scale_float, v_scale_float = map(
        _concrete, (sm_scale, num_splits, split_size, window_left, logit_softcap, k_scale_float, v_scale_float))
    with _no_fake_mode():
        check_decode_args(q, k, v, _without_values(seq_lens), block_table=_without_values(block_table),
                          num_splits=num_splits, kv_layout=kv_layout, row_limits=row_limits,
                          out=out if out_lse is None else (out, out_lse), k_scale=_scale(k_scale, k_scale_float),
                          v_scale=_scale(v_scale, v_scale_float), window_left=window_left,
                          logit_softcap=logit_softcap, sinks=sinks)
    check_sm_scale(sm_scale)
    check_split_size(split_size, num_splits=num_splits, window_left=window_left)
    return _fake_state(q, out)


def flash_decode(q, k, v, seq_lens, block_table, sm_scale, num_splits, kv_layout, split_size, k_scale, v_scale,
                 window_left, logit_softcap, sinks, return_lse, out, plan, row_limits, span, export):
    """:func:`cp_attention.flash_decode` while Dynamo traces it: the op, then ``out`` and ``return_lse``."""
    if plan is not None:
        raise TypeError("plan is not supported under torch.compile (a DecodePlan is a Python object that the "
                        "cp_attention::flash_decode op cannot carry); leave it None")
    if export is not None:
        raise TypeError("_export is for the context-parallel code, which runs it eagerly")
    check_bool("return_lse", return_lse)
    out_o, out_lse = _split_out(out)
    ks, ksf = _split_scale(k_scale)
    vs, vsf = _split_scale(v_scale)
    o, lse = flash_decode_op(q, k, v, seq_lens, block_table, row_limits, sinks, ks, vs, ksf, vsf, sm_scale,
                             num_splits, split_size, kv_layout, window_left, logit_softcap, out_o, out_lse, span)
    return _copy_out(o, lse, out_o, out_lse, return_lse)


# -------------------------------------------------------------------------------------------------------
# merge_states (merge traces into it)


@torch.library.custom_op("cp_attention::merge_states", mutates_args=())
def merge_states_op(o: Tensor, lse: Tensor, out_dtype: Optional[torch.dtype],
                    sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`cp_attention.merge_states`."""
    from .state import merge_states

    st = merge_states(o, lse, out_dtype=out_dtype, sinks=sinks)
    return _fresh(st.o), _fresh(st.lse)


@merge_states_op.register_fake
def _(o, lse, out_dtype, sinks):
    # merge_states checks its arguments (metadata only) before it dispatches: Dynamo traces those checks
    return (o.new_empty(o.shape[1:], dtype=o.dtype if out_dtype is None else out_dtype),
            lse.new_empty(lse.shape[1:]))


def merge_states(o, lse, out_dtype, sinks):
    from .state import AttentionState

    return AttentionState(*merge_states_op(o, lse, out_dtype, sinks))


# -------------------------------------------------------------------------------------------------------
# cascade_decode


def _levels(k, v, seq_lens, segment_ids, block_table, values: bool):
    """``CascadeLevel``s of the flattened lists; without ``values``, index tensors as
    :func:`_without_values` gives them."""
    from .cascade import CascadeLevel

    f = (lambda t: t) if values else _without_values
    return [CascadeLevel(*lvl[:2], *(f(t) for t in lvl[2:]))
            for lvl in zip(k, v, seq_lens, segment_ids, block_table)]


def _flat_levels(levels):
    """The op's parallel lists of ``levels`` (a list or tuple of ``CascadeLevel``)."""
    from .cascade import CascadeLevel

    if isinstance(levels, CascadeLevel) or not isinstance(levels, (list, tuple)):
        raise TypeError(f"levels must be a list or tuple of CascadeLevel, got {type(levels).__name__}")
    for i, lvl in enumerate(levels):
        if not isinstance(lvl, CascadeLevel):
            raise TypeError(f"levels[{i}] must be a CascadeLevel, got {type(lvl).__name__}")
    return tuple(list(part) for part in zip(*levels)) if levels else ([], [], [], [], [])


@torch.library.custom_op("cp_attention::cascade_decode", mutates_args=())
def cascade_decode_op(q: Tensor, k: list[Tensor], v: list[Tensor], seq_lens: list[Optional[Tensor]],
                      segment_ids: list[Optional[Tensor]], block_table: list[Optional[Tensor]],
                      sm_scale: Optional[float], k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                      k_scale_float: Optional[float], v_scale_float: Optional[float], logit_softcap: Optional[float],
                      sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`cp_attention.cascade_decode` with ``return_lse=True``, the levels as parallel lists."""
    from .cascade import cascade_decode

    with _scratch_of_its_own():
        st = cascade_decode(q, _levels(k, v, seq_lens, segment_ids, block_table, True), sm_scale=sm_scale,
                            k_scale=_scale(k_scale, k_scale_float), v_scale=_scale(v_scale, v_scale_float),
                            logit_softcap=logit_softcap, sinks=sinks, return_lse=True)
    return _fresh(st.o), _fresh(st.lse)


@cascade_decode_op.register_fake
def _cascade_decode_fake(q, k, v, seq_lens, segment_ids, block_table, sm_scale, k_scale, v_scale, k_scale_float,
                         v_scale_float, logit_softcap, sinks):
    from ._validate import check_cascade_args

    sm_scale, k_scale_float, v_scale_float, logit_softcap = map(
        _concrete, (sm_scale, k_scale_float, v_scale_float, logit_softcap))
    with _no_fake_mode():
        check_cascade_args(q, _levels(k, v, seq_lens, segment_ids, block_table, False), sm_scale=sm_scale,
                           return_lse=True, k_scale=_scale(k_scale, k_scale_float),
                           v_scale=_scale(v_scale, v_scale_float), logit_softcap=logit_softcap, sinks=sinks)
    return _fake_state(q)


def cascade_decode(q, levels, sm_scale, k_scale, v_scale, logit_softcap, sinks, return_lse, private):
    """:func:`cp_attention.cascade_decode` while Dynamo traces it; ``private``: its private arguments,
    which only eager callers pass."""
    if any(x is not None for x in private):
        raise TypeError("the private arguments of cascade_decode are not supported under torch.compile")
    check_bool("return_lse", return_lse)
    ks, ksf = _split_scale(k_scale)
    vs, vsf = _split_scale(v_scale)
    o, lse = cascade_decode_op(q, *_flat_levels(levels), sm_scale, ks, vs, ksf, vsf, logit_softcap, sinks)
    return _copy_out(o, lse, None, None, return_lse)


# -------------------------------------------------------------------------------------------------------
# Context parallelism: the exchanges


@torch.library.custom_op("cp_attention::all_gather_states", mutates_args=())
def all_gather_states_op(o: Tensor, lse: Tensor, group_name: Optional[str], check_metadata: bool) -> tuple[Tensor, Tensor]:
    """:func:`cp_attention.distributed.all_gather_states` (o and lse own their memory: no views of one
    buffer)."""
    from .distributed.decode import all_gather_states
    from .state import AttentionState

    st = all_gather_states(AttentionState(o, lse), _group(group_name), check_metadata=check_metadata)
    return _fresh(st.o), _fresh(st.lse)


@all_gather_states_op.register_fake
def _(o, lse, group_name, check_metadata):
    import torch.distributed as dist

    world = dist.get_world_size(_group(group_name))
    return o.new_empty((world, *o.shape)), lse.new_empty((world, *lse.shape))


@torch.library.custom_op("cp_attention::merge_across_ranks", mutates_args=())
def merge_across_ranks_op(o: Tensor, lse: Tensor, group_name: Optional[str], check_metadata: bool) -> tuple[Tensor, Tensor]:
    """:func:`cp_attention.distributed.merge_across_ranks`."""
    from .distributed.decode import merge_across_ranks
    from .state import AttentionState

    st = merge_across_ranks(AttentionState(o, lse), _group(group_name), check_metadata=check_metadata)
    return _fresh(st.o), _fresh(st.lse)


@merge_across_ranks_op.register_fake
def _(o, lse, group_name, check_metadata):
    return torch.empty_like(o, memory_format=torch.contiguous_format), torch.empty_like(lse)


def all_gather_states(state, group, check_metadata):
    """``all_gather_states`` while Dynamo traces it (``state`` checked by the caller)."""
    from .state import AttentionState

    return AttentionState(*all_gather_states_op(state[0], state[1], _group_name(group), check_metadata))


def merge_across_ranks(state, group, check_metadata):
    from .state import AttentionState

    return AttentionState(*merge_across_ranks_op(state[0], state[1], _group_name(group), check_metadata))


# -------------------------------------------------------------------------------------------------------
# Context parallelism: decode


@torch.library.custom_op("cp_attention::cp_flash_decode", mutates_args=())
def cp_flash_decode_op(q: Tensor, k_shard: Tensor, v_shard: Tensor, seq_lens_shard: Optional[Tensor],
                       group_name: Optional[str], check_metadata: bool, block_table: Optional[Tensor],
                       row_limits: Optional[Tensor], span: Optional[int], sinks: Optional[Tensor],
                       k_scale: Optional[Tensor], v_scale: Optional[Tensor], k_scale_float: Optional[float],
                       v_scale_float: Optional[float], sm_scale: Optional[float], num_splits: Optional[int],
                       split_size: Optional[int], kv_layout: str, logit_softcap: Optional[float],
                       window_left: Optional[int]) -> tuple[Tensor, Tensor]:
    """The context-parallel decode of :func:`cp_attention.distributed.cp_flash_decode` and
    :meth:`~cp_attention.distributed.CPKVCache.decode` (``row_limits``, ``span``: the causal rule and the
    window in global positions) with ``return_lse=True``; ``check_metadata`` is skipped in a CUDA-graph
    capture."""
    from .distributed.decode import cp_decode

    kwargs = dict(block_table=block_table, sinks=sinks, k_scale=_scale(k_scale, k_scale_float),
                  v_scale=_scale(v_scale, v_scale_float), sm_scale=sm_scale, num_splits=num_splits,
                  split_size=split_size, kv_layout=kv_layout, logit_softcap=logit_softcap, return_lse=True)
    with _scratch_of_its_own():
        st = cp_decode(q, k_shard, v_shard, seq_lens_shard, group=_group(group_name),
                       check_metadata=check_metadata and not _capturing(q), row_limits=row_limits, span=span,
                       kwargs={name: x for name, x in kwargs.items() if x is not None}, window_left=window_left)
    return _fresh(st.o), _fresh(st.lse)


@cp_flash_decode_op.register_fake
def _(q, k_shard, v_shard, seq_lens_shard, group_name, check_metadata, block_table, row_limits, span, sinks,
      k_scale, v_scale, k_scale_float, v_scale_float, sm_scale, num_splits, split_size, kv_layout, logit_softcap,
      window_left):
    from ._validate import check_decode_args
    from .distributed.agree import split_slots

    sm_scale, num_splits, split_size, logit_softcap, k_scale_float, v_scale_float = map(
        _concrete, (sm_scale, num_splits, split_size, logit_softcap, k_scale_float, v_scale_float))
    with _no_fake_mode():
        geo = check_decode_args(q, k_shard, v_shard, _without_values(seq_lens_shard),
                                block_table=_without_values(block_table), num_splits=num_splits, kv_layout=kv_layout,
                                row_limits=row_limits, k_scale=_scale(k_scale, k_scale_float),
                                v_scale=_scale(v_scale, v_scale_float), logit_softcap=logit_softcap, sinks=sinks)
    check_sm_scale(sm_scale)
    split_slots(split_size, geo.t_max)
    return _fake_state(q)


_CP_DECODE_KWARGS = ("block_table", "sinks", "k_scale", "v_scale", "sm_scale", "num_splits", "split_size", "kv_layout",
                     "logit_softcap", "return_lse")


def cp_decode(q, k_shard, v_shard, seq_lens_shard, group, check_metadata, row_limits, span, kwargs, window_left=None,
              what="cp_flash_decode"):
    """The context-parallel decode while Dynamo traces it (``check_metadata``, ``return_lse`` and ``out``
    checked by the caller): the op, then ``return_lse``."""
    unknown = sorted(set(kwargs) - set(_CP_DECODE_KWARGS))
    if unknown:
        raise TypeError(f"{what} got unexpected keyword arguments {unknown} (under torch.compile it "
                        f"takes {', '.join(_CP_DECODE_KWARGS)})")
    ks, ksf = _split_scale(kwargs.get("k_scale"))
    vs, vsf = _split_scale(kwargs.get("v_scale"))
    o, lse = cp_flash_decode_op(q, k_shard, v_shard, seq_lens_shard, _group_name(group), check_metadata,
                                kwargs.get("block_table"), row_limits, span, kwargs.get("sinks"), ks, vs, ksf, vsf,
                                kwargs.get("sm_scale"), kwargs.get("num_splits"), kwargs.get("split_size"),
                                kwargs.get("kv_layout", "HND"), kwargs.get("logit_softcap"), window_left)
    return _copy_out(o, lse, None, None, kwargs.get("return_lse", False))


@torch.library.custom_op("cp_attention::cp_cascade_decode", mutates_args=())
def cp_cascade_decode_op(q: Tensor, k: list[Tensor], v: list[Tensor], seq_lens: list[Optional[Tensor]],
                         segment_ids: list[Optional[Tensor]], block_table: list[Optional[Tensor]],
                         group_name: Optional[str], check_metadata: bool, sm_scale: Optional[float],
                         k_scale: Optional[Tensor], v_scale: Optional[Tensor], k_scale_float: Optional[float],
                         v_scale_float: Optional[float], logit_softcap: Optional[float],
                         sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`cp_attention.distributed.cp_cascade_decode` with ``return_lse=True``; ``check_metadata`` is
    skipped in a CUDA-graph capture."""
    from .distributed.decode import cp_cascade_decode

    kwargs = dict(sm_scale=sm_scale, k_scale=_scale(k_scale, k_scale_float), v_scale=_scale(v_scale, v_scale_float),
                  logit_softcap=logit_softcap, sinks=sinks)
    with _scratch_of_its_own():
        st = cp_cascade_decode(q, _levels(k, v, seq_lens, segment_ids, block_table, True),
                               group=_group(group_name), check_metadata=check_metadata and not _capturing(q),
                               return_lse=True, **{name: x for name, x in kwargs.items() if x is not None})
    return _fresh(st.o), _fresh(st.lse)


@cp_cascade_decode_op.register_fake
def _(q, k, v, seq_lens, segment_ids, block_table, group_name, check_metadata, sm_scale, k_scale, v_scale,
      k_scale_float, v_scale_float, logit_softcap, sinks):
    return _cascade_decode_fake(q, k, v, seq_lens, segment_ids, block_table, sm_scale, k_scale, v_scale, k_scale_float,
                                v_scale_float, logit_softcap, sinks)


_CP_CASCADE_KWARGS = ("sm_scale", "k_scale", "v_scale", "logit_softcap", "sinks", "return_lse")


def cp_cascade_decode(q, levels, group, check_metadata, kwargs):
    """:func:`cp_attention.distributed.cp_cascade_decode` while Dynamo traces it (``check_metadata``,
    ``return_lse`` and the query rows checked by the caller)."""
    unknown = sorted(set(kwargs) - set(_CP_CASCADE_KWARGS))
    if unknown:
        raise TypeError(f"cp_cascade_decode got unexpected keyword arguments {unknown} (under torch.compile it "
                        f"takes {', '.join(_CP_CASCADE_KWARGS)})")
    ks, ksf = _split_scale(kwargs.get("k_scale"))
    vs, vsf = _split_scale(kwargs.get("v_scale"))
    o, lse = cp_cascade_decode_op(q, *_flat_levels(levels), _group_name(group), check_metadata,
                                  kwargs.get("sm_scale"), ks, vs, ksf, vsf, kwargs.get("logit_softcap"),
                                  kwargs.get("sinks"))
    return _copy_out(o, lse, None, None, kwargs.get("return_lse", False))


# -------------------------------------------------------------------------------------------------------
# CPKVCache.append


@torch.library.custom_op("cp_attention::cp_kv_append",
                         mutates_args=("k_cache", "v_cache", "seq_lens", "global_seq_lens"))
def cp_kv_append_op(k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Optional[Tensor],
                    seq_lens: Tensor, global_seq_lens: Tensor, rank: int, world_size: int, capacity: int,
                    k_scale: Optional[Tensor], v_scale: Optional[Tensor], k_scale_float: Optional[float],
                    v_scale_float: Optional[float]) -> None:
    """What :meth:`~cp_attention.distributed.CPKVCache.append` does to a cache's tensors (validated by it):
    ``k_new``, ``v_new`` ``[B, n, Hkv, D]``; ``k_cache``, ``v_cache`` the whole buffers, scratch slot or
    page included: dense ``[B, Hkv, capacity + 1, D]`` (``block_table`` None) or page pools
    ``[num_pages + 1, page_size, Hkv, D]``. A token this rank does not own goes nowhere (the Triton
    kernel) or, on the torch path, to the scratch slot or page, which is never read."""
    if k_cache.dtype in FP8_DTYPES and k_new.dtype not in FP8_DTYPES:
        from .quant import quantize

        k_new, v_new = (quantize(x, torch.as_tensor(sc, dtype=torch.float32, device=x.device), k_cache.dtype, 2)
                        for x, sc in ((k_new, _scale(k_scale, k_scale_float)), (v_new, _scale(v_scale, v_scale_float))))
    paged = block_table is not None
    if _device.use_triton(k_cache):
        from .ops.append import append_tokens

        k, v = (k_cache, v_cache) if paged else (k_cache[:, :, :capacity], v_cache[:, :, :capacity])
        append_tokens(k_new, v_new, k, v, block_table, seq_lens, global_seq_lens, rank, world_size, capacity)
        return
    b, n = k_new.shape[:2]
    pos = global_seq_lens[:, None] + torch.arange(n, device=k_cache.device)  # [B, n] global positions
    slots = torch.div(pos, world_size, rounding_mode="floor")
    mine = (pos.remainder(world_size) == rank) & (slots < capacity)
    b_idx = torch.arange(b, device=k_cache.device)[:, None].expand_as(slots)
    if not paged:
        slot = torch.where(mine, slots, capacity)
        k_cache[b_idx, :, slot] = k_new
        v_cache[b_idx, :, slot] = v_new
    else:
        page_size = k_cache.shape[1]
        page_col = (slots // page_size).clamp(max=block_table.shape[1] - 1)
        page = torch.where(mine, block_table[b_idx, page_col].long(), k_cache.shape[0] - 1)
        off = torch.where(mine, slots % page_size, 0)
        k_cache[page, off] = k_new
        v_cache[page, off] = v_new
    seq_lens += mine.sum(1).to(seq_lens.dtype)
    global_seq_lens += n


@cp_kv_append_op.register_fake
def _(k_new, v_new, k_cache, v_cache, block_table, seq_lens, global_seq_lens, rank, world_size, capacity, k_scale,
      v_scale, k_scale_float, v_scale_float):
    return None  # CPKVCache.append checks the tokens before it dispatches; nothing is returned


def cp_kv_append(cache, k_new, v_new) -> None:
    """``cache.append(k_new, v_new)`` while Dynamo traces it (the tokens checked by it)."""
    if k_new.dim() == 3:
        k_new, v_new = k_new.unsqueeze(1), v_new.unsqueeze(1)
    ks, ksf = _split_scale(cache.k_scale)
    vs, vsf = _split_scale(cache.v_scale)
    cp_kv_append_op(k_new, v_new, cache._k, cache._v, cache.block_table,
                    cache.seq_lens, cache.global_seq_lens, cache.rank, cache.world_size, cache.capacity, ks, vs, ksf,
                    vsf)


__all__ = ["flash_decode_op", "merge_states_op", "cascade_decode_op", "all_gather_states_op", "merge_across_ranks_op",
           "cp_flash_decode_op", "cp_cascade_decode_op", "cp_kv_append_op"]
