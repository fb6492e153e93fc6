"""Attention states and the exact merge operator ⊕ (torch code path and dispatch).

Note [The merge operator ⊕]
---------------------------
For a set ``I`` of keys with scores ``s_i = sm_scale * q.k_i``, the attention state is
``lse(I) = log sum_{i in I} exp(s_i)`` (natural log, float32) and ``o(I) = sum_i exp(s_i - lse(I)) v_i``.
For disjoint ``I`` and ``J``::

    lse(I ∪ J) = log(exp(lse_I) + exp(lse_J))
    o(I ∪ J)   = (exp(lse_I) o_I + exp(lse_J) o_J) / (exp(lse_I) + exp(lse_J))

⊕ is associative and commutative with identity ``(o = 0, lse = -inf)``. It is evaluated in max-subtracted
form, in float32: with ``m = max_j lse_j`` the weights are ``exp(lse_j - m) <= 1``, so lse values in the
hundreds or thousands never overflow; when every input is empty the reference max is 0, so no
``-inf - -inf`` is ever formed and the result is the empty state, not NaN. The Triton kernels use the
same rule (``ops/_state.py``), subtracting the max before any change of base.

Non-finite lse values are defined, not accidents: a state whose lse equals the max has weight exactly 1,
so states with ``lse = +inf`` (infinite mass) share the result equally and the merged lse is ``+inf``;
a NaN lse in any input makes that row's merged ``o`` and ``lse`` NaN (garbage is never hidden).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _device, _library
from ._constants import FLOAT_DTYPES, LN2, LOG2E
from ._device import use_triton
from ._validate import check_inference, check_int, check_state, check_state_tensors, check_variants

__all__ = ["AttentionState", "merge", "merge_states", "lse_to_base2", "lse_from_base2"]


class AttentionState(NamedTuple):
    """The attention state ``(o, lse)`` of a key set.

    ``o``: ``[..., D]`` normalised output over the key set (float16, bfloat16 or float32).
    ``lse``: ``[...]`` float32, natural-log ``log sum_j exp(sm_scale * q.k_j)``; ``-inf`` for an empty
    key set, whose ``o`` is 0. ``a | b`` is ``a ⊕ b``.

    >>> a = AttentionState(torch.tensor([[1.0, 0.0]]), torch.tensor([0.0]))
    >>> (a | AttentionState.empty((1,), 2)).o
    tensor([[1., 0.]])
    """

    o: torch.Tensor
    lse: torch.Tensor

    def __or__(self, other: "AttentionState") -> "AttentionState":
        return merge(self, other)

    @classmethod
    def empty(cls, shape, head_dim: int, *, dtype=torch.float32, device=None) -> "AttentionState":
        """The identity of ⊕: ``o = 0`` of shape ``[*shape, head_dim]`` in ``dtype`` (float16, bfloat16 or
        float32), ``lse = -inf`` float32."""
        shape = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
        try:
            shape = tuple(check_int(f"shape[{i}]", s, 0) for i, s in enumerate(shape))
        except TypeError:
            raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
        head_dim = check_int("head_dim", head_dim, 1)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        return cls(
            torch.zeros(*shape, head_dim, dtype=dtype, device=device),
            torch.full(shape, float("-inf"), dtype=torch.float32, device=device),
        )


class _MergePrepared(NamedTuple):
    """What a validated CUDA ``merge_states`` call with a given key launches."""

    launcher: object  # ops._launch.Launcher, integer arguments bound
    device: torch.device
    cuda: int
    o_shape: tuple
    lse_shape: tuple
    out_dtype: torch.dtype


_MERGE_PREPARED: dict = {}


def merge_states(o: torch.Tensor, lse: torch.Tensor, *, out_dtype: torch.dtype | None = None,
                 sinks: torch.Tensor | None = None) -> AttentionState:
    """⊕ over dim 0: merge ``N`` states of disjoint key sets into one.

    Args:
        o: ``[N, ..., D]`` float16, bfloat16 or float32.
        lse: ``[N, ...]`` float32, natural log; ``-inf`` marks an empty state.
        out_dtype: dtype of the merged ``o`` (default: ``o.dtype``), written directly by the kernel.
        sinks: ``[H]`` float32 with ``H = o.shape[-2]`` (the query heads): attention sinks, one extra logit per
            head joined once into the merged state, with no value (``lse`` includes it).

    Returns:
        ``AttentionState`` with ``o [..., D]`` in ``out_dtype`` and ``lse [...]`` float32 (natural log).
        Runs the Triton merge kernel for CUDA tensors (and for CPU tensors under ``TRITON_INTERPRET=1``),
        else plain torch; the arithmetic is float32 either way. A CUDA call whose shapes, strides, dtypes and
        alignment were seen before replays the launch prepared then (as ``flash_decode`` does: Note [The decode
        hot path] in ``decode.py``).

    >>> o = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    >>> merge_states(o, torch.zeros(2, 1)).o
    tensor([[0.5000, 0.5000]])
    """
    compiling = torch.compiler.is_compiling()
    key = None
    if (not compiling and o.__class__ is torch.Tensor and lse.__class__ is torch.Tensor and o.is_cuda
            and (sinks is None or sinks.__class__ is torch.Tensor)):
        # CUDA device indices: a key stored by a validated call holds indices >= 0, so only tensors on those
        # devices hit it (cheaper to read than .device)
        op, lp = o.data_ptr(), lse.data_ptr()
        key = (o.shape, o.stride(), o.dtype, o.get_device(), op & 15, lse.shape, lse.stride(), lse.dtype,
               lse.get_device(), lp & 15, out_dtype, None if sinks is None else (sinks.shape, sinks.stride(),
                                                             sinks.dtype, sinks.get_device(), sinks.data_ptr() & 15))
        prep = _MERGE_PREPARED.get(key)
        # an input that requires grad goes on to check_inference, which raises
        if prep is not None and not (torch.is_grad_enabled() and (
                o.requires_grad or lse.requires_grad or (sinks is not None and sinks.requires_grad))):
            out_o = _device.new_buffer(prep.o_shape, prep.out_dtype, prep.device)
            out_lse = _device.new_buffer(prep.lse_shape, torch.float32, prep.device)
            prep.launcher.launch_ptrs(torch._C._cuda_getCurrentRawStream(prep.cuda),
                                      (op, lp, lp if sinks is None else sinks.data_ptr(), out_o.data_ptr(),
                                       out_lse.data_ptr(), lp))
            return AttentionState(out_o, out_lse)
    check_inference("merge_states", ("o", "lse", "sinks"), o, lse, sinks)
    if compiling:  # Dynamo traces: the op (Note [Custom ops under torch.compile], _library.py)
        return _library.merge_states(o, lse, _check_merge(o, lse, out_dtype, sinks), sinks)
    out_dtype = _check_merge(o, lse, out_dtype, sinks)
    n, d = o.shape[0], o.shape[-1]
    lead = tuple(o.shape[1:-1])
    if not use_triton(o):
        return merge_states_torch(o, lse, out_dtype, sinks)
    from .ops.merge import merge_launcher

    m = math.prod(lead)
    o3, lse2 = o.reshape(n, m, d), lse.reshape(n, m)
    # a view keeps the caller's strides (the prepared launch reads them); else a copy, and no prepared launch
    view = o3.stride(-1) == 1 and o3.data_ptr() == o.data_ptr() and lse2.data_ptr() == lse.data_ptr()
    if o3.stride(-1) != 1:
        o3 = o3.contiguous()
    out_o = _device.new_buffer(lead + (d,), out_dtype, o.device)
    out_lse = _device.new_buffer(lead, torch.float32, o.device)
    if m == 0:
        return AttentionState(out_o, out_lse)
    cuda = o.get_device() if o.is_cuda else None
    launcher = merge_launcher(n, m, d, o3.stride()[:2], lse2.stride(), sinks, cuda)
    launcher(o3, lse2, lse2 if sinks is None else sinks, out_o.view(m, d), out_lse.view(m), lse2)
    if key is not None and view and o3.data_ptr() == o.data_ptr():
        if len(_MERGE_PREPARED) >= 4096:
            _MERGE_PREPARED.clear()
        _MERGE_PREPARED[key] = _MergePrepared(launcher, o.device, cuda, lead + (d,), lead, out_dtype)
    return AttentionState(out_o, out_lse)


def _check_merge(o, lse, out_dtype, sinks) -> torch.dtype:
    """:func:`merge_states`' arguments; returns the output dtype."""
    check_state_tensors(o, lse, "o", "lse")
    if o.dim() < 2 or o.shape[0] < 1:
        raise ValueError(f"o must have shape [N, ..., D] with N >= 1, got {tuple(o.shape)}")
    out_dtype = o.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if sinks is not None:
        if o.dim() < 3:
            raise ValueError(f"o must have a head dim [N, ..., H, D] to take sinks, got shape {tuple(o.shape)}")
        check_variants(None, None, sinks, o.shape[-2], o.device)
    return out_dtype


def merge_states_torch(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype, sinks=None) -> AttentionState:
    """:func:`merge_states` on the torch path (float32 math, the states merged in order along dim 0)."""
    out = _merge_states_torch(o, lse)
    if sinks is not None:
        out = add_sinks_torch(out, sinks)
    return AttentionState(out.o.to(out_dtype), out.lse)


def add_sinks_torch(st: AttentionState, sinks: torch.Tensor) -> AttentionState:
    """``st ⊕ (0, sink)`` per query head (dim -2 of ``o``), float32, as the kernels' ``add_sink``: a ``+inf`` sink
    holds all the mass and no value (``o = 0``, ``lse = +inf``)."""
    sink = sinks.float().expand_as(st.lse)
    m = torch.maximum(st.lse, sink)
    one = torch.ones_like(m)
    w = torch.where(st.lse == m, one, torch.exp(st.lse - m))
    total = w + torch.where(sink == m, one, torch.exp(sink - m))
    return AttentionState(st.o.float() * (w / total)[..., None], m + torch.log(total))


def unnormalize(o: torch.Tensor, lse: torch.Tensor, m: torch.Tensor):
    """A state as ``(numerator, denominator)`` relative to the max lse ``m`` (``-inf`` allowed):
    ``(exp(lse - m) * o, exp(lse - m))`` in float32, with ``m`` replaced by 0 where it is ``-inf`` and a
    weight of exactly 1 where ``lse == m`` (see Note [The merge operator ⊕]). The sums of these over
    disjoint key sets, taken relative to one ``m``, go back through :func:`normalize`."""
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w = torch.where(lse == m_ref, torch.ones_like(lse), torch.exp(lse - m_ref))
    return w.unsqueeze(-1) * o.float(), w


def normalize(acc: torch.Tensor, l: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> AttentionState:
    """Summed ``(numerator [..., D], denominator [...])`` relative to ``m`` -> the state ``(o, lse)``; a zero
    denominator gives the empty state (o = 0, lse = -inf)."""
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    empty = l == 0  # (a NaN sum is not empty: it stays NaN)
    l_safe = torch.where(empty, torch.ones_like(l), l)
    out_o = acc / l_safe.unsqueeze(-1)
    out_lse = torch.where(empty, torch.full_like(l, float("-inf")), m_ref + torch.log(l_safe))
    return AttentionState(out_o.to(dtype), out_lse)


def _merge_states_torch(o: torch.Tensor, lse: torch.Tensor) -> AttentionState:
    m = lse.amax(dim=0)
    acc, w = unnormalize(o, lse, m)
    return normalize(acc.sum(dim=0), w.sum(dim=0), m, o.dtype)


def merge(a: AttentionState, b: AttentionState) -> AttentionState:
    """``a ⊕ b``: exact merge of the states of two disjoint key sets (float32 math).

    ``a.o`` and ``b.o``: ``[..., D]`` of one shape; ``a.lse``/``b.lse``: ``[...]`` float32, natural log.
    The result's ``o`` has ``a.o``'s dtype.

    >>> a = AttentionState(torch.tensor([[1.0, 0.0]]), torch.tensor([0.0]))
    >>> b = AttentionState(torch.tensor([[0.0, 1.0]]), torch.tensor([0.0]))
    >>> merge(a, b).lse
    tensor([0.6931])
    """
    check_inference("merge", ("a", "b"), a, b)
    check_state("a", a)
    check_state("b", b)
    if a[0].shape != b[0].shape:
        raise ValueError(f"b.o must have a.o's shape {tuple(a[0].shape)}, got {tuple(b[0].shape)}")
    if a[0].device != b[0].device:
        raise ValueError(f"b must be on a's device {a[0].device}, got {b[0].device}")
    oa, ob = a[0], b[0]
    if oa.dtype != ob.dtype:
        oa, ob = oa.float(), ob.float()
    out = merge_states(torch.stack([oa, ob]), torch.stack([a[1], b[1]]))
    return AttentionState(out.o.to(a[0].dtype), out.lse)


def lse_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE -> base-2 LSE (FlashInfer's convention): ``lse * log2(e)``, in ``lse``'s floating dtype."""
    _check_lse("lse", lse)
    return lse * LOG2E


def lse_from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """Base-2 LSE (FlashInfer's convention) -> natural-log LSE: ``lse2 * ln(2)``, in ``lse2``'s floating dtype."""
    _check_lse("lse2", lse2)
    return lse2 * LN2


def _check_lse(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got "
                        f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
