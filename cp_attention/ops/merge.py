"""Triton kernel for ``merge_states``: ⊕ over the leading dim of ``N`` attention states (and, for a final
merge, the attention sinks); it can also push its float32 results to the peers of a symmetric-memory
exchange (``ops/symm_merge.py``, the producer's push)."""
import triton
import triton.language as tl

from .._device import next_pow2
from ._launch import launch
from ._state import add_sink, merge_tile
from .symm_merge import push_rows


@triton.jit
def _merge_states_kernel(
    O, LSE, SINKS, O_OUT, LSE_OUT, BUF_PTRS,
    N, M, N_HEADS, rank,
    stride_on, stride_om, stride_ln, stride_lm, stride_oom, stride_lom, stride_sink,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr, WORLD: tl.constexpr, EXCHANGE_BLOCK_M: tl.constexpr,
):
    i_m = tl.program_id(0).to(tl.int64) * BLOCK_M
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_r = i_m + o_r < M
    m_d = o_d < HEAD_DIM
    b_o, b_lse = merge_tile(LSE + i_m * stride_lm, O + i_m * stride_om, N, stride_ln, stride_lm, stride_on,
                            stride_om, o_r, m_r, o_d, m_d, BLOCK_S, BLOCK_M, BLOCK_D, "")
    if HAS_SINKS:  # row m is query head m % N_HEADS: its sink joins once, in this final merge
        b_o, b_lse = add_sink(b_o, b_lse, tl.load(SINKS + ((i_m + o_r) % N_HEADS) * stride_sink, mask=m_r, other=0.0))
    p_out = O_OUT + (i_m + o_r)[:, None] * stride_oom + o_d[None, :]
    tl.store(p_out, b_o.to(O_OUT.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
    tl.store(LSE_OUT + (i_m + o_r) * stride_lom, b_lse, mask=m_r)
    if EXCHANGE_BLOCK_M > 0:  # the float32 rows to the exchange's peers too (the producer's push)
        push_rows(BUF_PTRS, rank, M, i_m + o_r, m_r, o_d, m_d, b_o, b_lse, WORLD, HEAD_DIM, EXCHANGE_BLOCK_M)


def merge_states_into(o, lse, o_out, lse_out, sinks=None, one_warp=False, push=None) -> None:
    """Launch the merge kernel: ``o [N, M, D]`` (unit stride in D), ``lse [N, M]`` float32 natural log, into
    ``o_out [M, D]`` (any float dtype, unit stride in D) and ``lse_out [M]`` float32 natural log, any strides.
    Each program merges ``BLOCK_M`` rows, ``BLOCK_S`` states per load (:func:`merge_config`). ``sinks [H]``
    float32: row ``m`` is query head ``m % H``, whose sink logit joins the merge once. Inputs are validated
    by the callers (:func:`cp_attention.state.merge_states`, the cascade and context-parallel merges).
    ``push``: ``(buf_ptrs, rank, world, exchange_block_m)`` of a symmetric-memory exchange whose ``own``
    rows ``o_out``/``lse_out`` are (float32): the results also go to the peers (``push_rows``).
    """
    n, m, d = o.shape
    if m == 0:
        return
    buf_ptrs, rank, world, exchange_block_m = push if push is not None else (lse, 0, 1, 0)
    has_sinks = sinks is not None
    constexprs, options = merge_launch_config(n, d, has_sinks, one_warp, world, exchange_block_m)
    launch(
        _merge_states_kernel, (-(-m // constexprs["BLOCK_M"]),),
        (o, lse, sinks if has_sinks else lse, o_out, lse_out, buf_ptrs, n, m, sinks.shape[0] if has_sinks else 1,
         rank, o.stride(0), o.stride(1), lse.stride(0), lse.stride(1), o_out.stride(0), lse_out.stride(0),
         sinks.stride(0) if has_sinks else 0),
        constexprs, **options,
    )


def merge_launcher(n: int, m: int, d: int, o_strides, lse_strides, sinks, device: int | None, one_warp: bool = True):
    """A :class:`~cp_attention.ops._launch.Launcher` of :func:`_merge_states_kernel` merging ``n`` states of ``m``
    rows with their integer arguments bound (``o_strides``/``lse_strides``: the (state, row) strides of ``o [N, M,
    D]`` and ``lse [N, M]``; the outputs contiguous ``[M, D]`` and ``[M]``); it takes ``(o, lse, sinks or lse,
    o_out, lse_out, lse)``."""
    from ._launch import Launcher

    constexprs, options = merge_launch_config(n, d, sinks is not None, one_warp)
    static = (n, m, sinks.shape[0] if sinks is not None else 1, 0, *o_strides, *lse_strides, d, 1,
              sinks.stride(0) if sinks is not None else 0)
    return Launcher(_merge_states_kernel, (-(-m // constexprs["BLOCK_M"]),), constexprs, device=device, static=static,
                    **options)


def merge_launch_config(n: int, d: int, sinks: bool, one_warp: bool = False, world: int = 1,
                        exchange_block_m: int = 0) -> tuple:
    """``(constexprs, options)`` of :func:`_merge_states_kernel` merging ``n`` states of head dim ``d``
    (:func:`merge_config`); ``world``/``exchange_block_m``: the push to a symmetric-memory exchange's peers."""
    block_m, block_s, num_warps = merge_config(n, d, one_warp)
    if exchange_block_m % block_m:
        raise ValueError(f"push: exchange programs of {exchange_block_m} rows cannot own whole programs of {block_m}")
    return (dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_S=block_s, BLOCK_D=next_pow2(d), HAS_SINKS=sinks, WORLD=world,
                 EXCHANGE_BLOCK_M=exchange_block_m), dict(num_warps=num_warps))


def merge_config(n: int, d: int, one_warp: bool) -> tuple:
    """``(BLOCK_M, BLOCK_S, num_warps)`` of the merge of ``n`` states of head dim ``d``: up to 16 states per
    load; independent of the row count, so a row's bits do not depend on the batch.

    Default: rows per program up to 8 and 4096 values, four warps from 2048 values: the layout whose bits
    the symmetric-memory exchange's merge (``ops/symm_merge.py``) reproduces, which the all-gather path of
    ``merge_across_ranks`` must match bit for bit. ``one_warp``: one warp a program, which keeps the max and
    the sums over the states in registers instead of crossing warps through shared memory, 2 rows a program
    up to 4 states and 4 rows from 8 (at most 4096 values): faster (docs/tuning.md), with other roundings
    (the products and sums over the states contract differently). Used by ``merge_states`` and the merges of
    cascade levels, which no other path has to reproduce.
    """
    block_d, block_s = next_pow2(d), min(16, next_pow2(n))
    if one_warp:
        return max(1, min(2 if block_s <= 4 else 4, 4096 // (block_s * block_d))), block_s, 1
    block_m = max(1, min(8, 4096 // (block_s * block_d)))
    return block_m, block_s, 4 if block_m * block_s * block_d >= 2048 else 1
