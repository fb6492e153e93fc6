"""Split-KV decode kernel (⊕ levels 1 and 2) with the combine fused in.

Note [Split-KV decode with a fused combine]
-------------------------------------------
Grid ``(B * Hkv, S)``. Program ``(i_bh, i_s)`` owns KV head ``i_h`` of sequence ``i_b`` and the token
range ``[i_s * CHUNK, (i_s + 1) * CHUNK) ∩ [0, seq_len)`` with ``CHUNK = TILES_PER_SPLIT * BLOCK_N``.
The ``GROUP_SIZE`` query heads that read this KV head are packed into the ``BLOCK_H`` rows of one tile
(pack-GQA), so each K/V tile is loaded once per group and meets the queries through ``tl.dot``.
Level 1: the online softmax over ``BLOCK_N`` tiles (``attend_tiles``). An empty range leaves the
state empty (o = 0, lse = -inf).

With one split the program writes the output directly. With several, it writes its state to an fp32
workspace ``o [B * Hkv, S, GROUP_SIZE, D]``, ``lse [B * Hkv, S, GROUP_SIZE]`` (natural log; the states
of one (sequence, KV head) are one contiguous block), then takes a ticket from a per-(b, kv-head)
counter with an acq_rel atomic: the program that draws the last ticket merges the states of the
non-empty splits for all its query heads at once (level 2, ``merge_tile``: one load round trip per
``BLOCK_S`` splits) and resets the counter to 0, so the next call (or CUDA-graph replay) starts clean.
One launch, no host synchronisation, no value-dependent allocation. The split layout depends on
``T_max`` only; ``seq_lens`` are read on the device.

The output ``o``/``lse`` may be any strided view (fp32 slots of a caller's workspace included), which is
how cascade levels and context-parallel ranks receive unrounded states.
"""
import triton
import triton.language as tl

from ._dot import dot_flags
from ._state import LN2, LOG2E, attend_tiles, merge_tile, split_range
from .._dispatch import next_pow2


@triton.jit
def _split_kv_kernel(
    Q, K, V, SEQ_LENS, O, LSE, WORK, COUNTER,
    sm_scale, T_MAX, TILES_PER_SPLIT, NUM_SPLITS, HKV,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_lb, stride_lh, stride_sl,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, IS_SPLIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tl.static_assert(BLOCK_H >= GROUP_SIZE)
    tl.static_assert(BLOCK_G >= GROUP_SIZE)
    i_bh = tl.program_id(0)
    i_s = tl.program_id(1)
    i_b = i_bh // HKV
    i_h = i_bh % HKV
    i_b64 = i_b.to(tl.int64)
    i_h64 = i_h.to(tl.int64)

    seq_len, chunk, t_start, t_end = split_range(SEQ_LENS, stride_sl, i_b64, i_s, T_MAX, TILES_PER_SPLIT,
                                                 BLOCK_N, HAS_SEQ_LENS)

    o_g = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < GROUP_SIZE
    m_d = o_d < HEAD_DIM
    m_gd = m_g[:, None] & m_d[None, :]
    o_hq = i_h64 * GROUP_SIZE + o_g  # query heads of this KV head

    b_q = tl.load(Q + i_b64 * stride_qb + o_hq[:, None] * stride_qh + o_d[None, :], mask=m_gd, other=0.0)
    qk_scale = sm_scale * LOG2E
    p_k = K + i_b64 * stride_kb + i_h64 * stride_kh
    p_v = V + i_b64 * stride_vb + i_h64 * stride_vh
    b_o, b_lse = attend_tiles(b_q, p_k, p_v, stride_kt, stride_vt, t_start, t_end, qk_scale, o_d, m_d,
                              BLOCK_H, BLOCK_N, BLOCK_D, INPUT_PRECISION, UPCAST)

    if IS_SPLIT:
        # Workspace: o [B * Hkv, S, GROUP_SIZE, HEAD_DIM], then lse [B * Hkv, S, GROUP_SIZE].
        n_states = tl.num_programs(0).to(tl.int64) * NUM_SPLITS * GROUP_SIZE
        WORK_LSE = WORK + n_states * HEAD_DIM
        row0 = (i_bh.to(tl.int64) * NUM_SPLITS + i_s) * GROUP_SIZE  # this program's first state
        tl.store(WORK + (row0 + o_g)[:, None] * HEAD_DIM + o_d[None, :], b_o, mask=m_gd)
        tl.store(WORK_LSE + row0 + o_g, b_lse, mask=m_g)
        tl.debug_barrier()
        ticket = tl.atomic_add(COUNTER + i_bh, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:
            # Last program of this (b, kv head): merge the non-empty splits of all its query heads.
            first = i_bh.to(tl.int64) * NUM_SPLITS * GROUP_SIZE
            o_gm = tl.arange(0, BLOCK_G)
            m_gm = o_gm < GROUP_SIZE
            b_om, b_lsem = merge_tile(WORK_LSE + first, WORK + first * HEAD_DIM, tl.cdiv(seq_len, chunk),
                                      GROUP_SIZE, 1, GROUP_SIZE * HEAD_DIM, HEAD_DIM, o_gm, m_gm, o_d, m_d,
                                      BLOCK_S, BLOCK_G, BLOCK_D, ".cg")
            o_hqm = i_h64 * GROUP_SIZE + o_gm
            p_o = O + i_b64 * stride_ob + o_hqm[:, None] * stride_oh + o_d[None, :]
            tl.store(p_o, b_om.to(O.dtype.element_ty), mask=m_gm[:, None] & m_d[None, :])
            tl.store(LSE + i_b64 * stride_lb + o_hqm * stride_lh, b_lsem, mask=m_gm)
            tl.atomic_xchg(COUNTER + i_bh, 0)
    else:
        p_o = O + i_b64 * stride_ob + o_hq[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_gd)
        tl.store(LSE + i_b64 * stride_lb + o_hq * stride_lh, b_lse, mask=m_g)


def workspace_floats(batch: int, hkv: int, group: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of the split workspace (0 without splits)."""
    return 0 if num_splits == 1 else batch * hkv * num_splits * group * (head_dim + 1)


def combine_block_s(num_splits: int, block_g: int, block_d: int) -> int:
    """Splits the combine reads per load: it holds ``BLOCK_S x BLOCK_G x BLOCK_D`` fp32 in registers, at
    most 8192 (64 per thread of 4 warps)."""
    return max(1, min(next_pow2(num_splits), 8192 // (block_g * block_d)))


def split_kv_launch_config(dtype, hq: int, hkv: int, head_dim: int, plan, has_seq_lens: bool):
    """``(constexprs, launch options)`` of the split-KV kernel for a :class:`~cp_attention.heuristics.DecodePlan`.

    The kernel's arguments, in order: ``q [B, Hq, D]``; ``k``, ``v`` read as ``[B, Hkv, T, D]`` through
    their strides (unit stride in D); ``seq_lens [B]`` (any stride; any tensor when unused); ``o [B, Hq,
    D]`` (any float dtype, unit stride in D) and ``lse [B, Hq]`` float32 natural log, any strides; the
    fp32 workspace (:func:`workspace_floats` elements) and ``B * Hkv`` zeroed int32 tickets (left zeroed);
    ``sm_scale``; then ``T_max``, the plan's tiles per split and splits, ``Hkv`` and the strides.
    """
    group = hq // hkv
    block_g = next_pow2(group)
    block_d = next_pow2(head_dim)
    constexprs = dict(GROUP_SIZE=group, HEAD_DIM=head_dim, BLOCK_H=max(16, block_g), BLOCK_N=plan.config.block_n,
                      BLOCK_D=block_d, BLOCK_G=block_g,
                      BLOCK_S=combine_block_s(plan.num_splits, block_g, block_d),
                      HAS_SEQ_LENS=has_seq_lens, IS_SPLIT=plan.num_splits > 1, **dot_flags(dtype))
    return constexprs, dict(num_warps=plan.config.num_warps, num_stages=plan.config.num_stages)


# Realistic sm_90 compiles of this file's kernel, checked on the CPU by tests/test_aot.py.
_PTRS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "SEQ_LENS": "*i32", "O": "*bf16", "LSE": "*fp32",
         "WORK": "*fp32", "COUNTER": "*i32", "sm_scale": "fp32"}
AOT_SPECS = [
    {
        "kernel": _split_kv_kernel,
        "signature": _PTRS,
        "constexprs": dict(GROUP_SIZE=group, HEAD_DIM=128, BLOCK_H=16, BLOCK_N=128, BLOCK_D=128,
                           BLOCK_G=next_pow2(group), BLOCK_S=combine_block_s(16, next_pow2(group), 128), HAS_SEQ_LENS=True, IS_SPLIT=split,
                           INPUT_PRECISION="tf32", UPCAST=False),
        "options": {"num_warps": 4, "num_stages": 3},
    }
    for group, split in ((4, True), (5, False), (8, True))
]
