"""The attention-state algebra as ``@triton.jit`` helpers, shared by every kernel.

Note [Attention states inside kernels]
--------------------------------------
A state of a key set ``I`` is ``(o, lse)`` with ``lse = log sum_{i in I} exp(s_i)`` and ``o`` the
softmax-weighted mean of the values. Inside kernels every LSE and running max is kept in **base 2**
(``s * log2(e)``) so that ``exp2`` (one MUFU instruction) replaces ``exp``; public APIs see natural
logs. ``LOG2E``/``LN2`` below are the only conversion constants.

A running accumulator is ``(m, l, acc)``: ``m`` the running max (base 2), ``l = sum 2^(x - m)`` and
``acc = sum 2^(x - m) * v``. Adding items with scores ``x`` (a tile of keys, or whole states whose
"score" is their lse and whose "value" is their ``o``) is the same max-subtracted update, so one
helper, :func:`running_max`, computes the rescale factor for level 1 (tiles), level 2 (splits),
level 3 (ranks) and the cascade. Its guard makes ``-inf - -inf`` impossible: when nothing has been
seen yet the reference max is 0, every weight is ``2^-inf = 0`` and the state stays empty (o = 0,
lse = -inf) without a NaN.
"""
import triton
import triton.language as tl

from .. import state
from ._dot import dot

LOG2E = tl.constexpr(state.LOG2E)
LN2 = tl.constexpr(state.LN2)


@triton.jit
def running_max(m_i, m_x):
    """New running max, the finite reference max to subtract, and the rescale of the old sums."""
    m_new = tl.maximum(m_i, m_x)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    return m_new, m_ref, alpha


@triton.jit
def softmax_tile(m_i, l_i, acc, b_s):
    """Level 1 (online softmax): fold a tile of base-2 scores ``b_s [M, N]`` into ``(m, l, acc)``.

    Returns the new ``(m, l)``, the rescaled ``acc`` and the tile's weights ``p [M, N]``; the caller
    adds ``p @ v`` to ``acc``.
    """
    m_new, m_ref, alpha = running_max(m_i, tl.max(b_s, 1))
    p = tl.exp2(b_s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return m_new, l_i, acc, p


@triton.jit
def split_range(SEQ_LENS, i_seq, i_s, T_MAX, TILES_PER_SPLIT, BLOCK_N: tl.constexpr,
                HAS_SEQ_LENS: tl.constexpr):
    """The keys of split ``i_s`` of sequence ``i_seq``: ``[t_start, t_end)`` with splits of
    ``CHUNK = TILES_PER_SPLIT * BLOCK_N`` tokens, cut at the sequence's length (read from ``SEQ_LENS`` and
    clamped to ``[0, T_MAX]``, or ``T_MAX``). Returns ``(seq_len, chunk, t_start, t_end)``; ``t_end <=
    t_start`` is an empty split."""
    if HAS_SEQ_LENS:
        seq_len = tl.load(SEQ_LENS + i_seq).to(tl.int32)
        seq_len = tl.minimum(tl.maximum(seq_len, 0), T_MAX)
    else:
        seq_len = T_MAX
    chunk = TILES_PER_SPLIT * BLOCK_N
    t_start = i_s * chunk
    t_end = tl.minimum(t_start + chunk, seq_len)
    return seq_len, chunk, t_start, t_end


@triton.jit
def attend_tiles(b_q, p_k, p_v, stride_kt, stride_vt, t_start, t_end, qk_scale, o_d, m_d,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Level 1: the query rows ``b_q [BLOCK_M, BLOCK_D]`` attend to the keys ``[t_start, t_end)`` of one KV
    head (key ``t`` at ``p_k + t * stride_kt + o_d``, value likewise), ``BLOCK_N`` keys per tile through
    ``tl.dot``, with the online softmax of :func:`softmax_tile`. ``qk_scale`` is the score scale times
    ``log2(e)``. Returns the normalised state ``(o [BLOCK_M, BLOCK_D] fp32, lse2 [BLOCK_M])``; an empty
    range gives the empty state.
    """
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t0 in range(t_start, t_end, BLOCK_N):
        o_t = t0 + tl.arange(0, BLOCK_N)
        m_t = o_t < t_end
        o_t64 = o_t.to(tl.int64)
        m_td = m_t[:, None] & m_d[None, :]
        b_k = tl.load(p_k + o_t64[:, None] * stride_kt + o_d[None, :], mask=m_td, other=0.0)
        b_s = dot(b_q, tl.trans(b_k), None, INPUT_PRECISION, UPCAST) * qk_scale
        b_s = tl.where(m_t[None, :], b_s, float("-inf"))
        m_i, l_i, acc, p = softmax_tile(m_i, l_i, acc, b_s)
        b_v = tl.load(p_v + o_t64[:, None] * stride_vt + o_d[None, :], mask=m_td, other=0.0)
        acc = dot(p.to(b_v.dtype), b_v, acc, INPUT_PRECISION, UPCAST)
    return finalize(m_i, l_i, acc)


@triton.jit
def add_state(m_i, l_i, acc, b_lse2, b_o):
    """Fold one normalised state per row, ``(b_o [M, D], b_lse2 [M])``, into ``(m, l, acc)``."""
    m_new, m_ref, alpha = running_max(m_i, b_lse2)
    w = tl.exp2(b_lse2 - m_ref)
    l_i = l_i * alpha + w
    acc = acc * alpha[:, None] + w[:, None] * b_o
    return m_new, l_i, acc


@triton.jit
def merge_strided(p_lse, p_o, stride_lse, stride_o, n, o_d, m_d,
                  LSE_SCALE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  CACHE: tl.constexpr):
    """Levels 2 and 3: ⊕ of the ``n`` states of one row, state ``j`` at ``p_lse + j * stride_lse`` (its lse,
    times ``LSE_SCALE`` to make it base 2) and ``p_o + j * stride_o + o_d`` (its ``o``).

    States are read ``BLOCK_S`` at a time (one load round trip per block, not per state): a block is a
    tile of "keys" whose scores are their lse and whose values are their ``o``, folded in with
    :func:`softmax_tile`. Returns ``(o [1, BLOCK_D] fp32, lse2 [1])``.
    """
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, BLOCK_D], tl.float32)
    for j0 in range(0, n, BLOCK_S):
        o_s = j0 + tl.arange(0, BLOCK_S)
        m_s = o_s < n
        o_s64 = o_s.to(tl.int64)
        b_lse2 = tl.load(p_lse + o_s64 * stride_lse, mask=m_s, other=float("-inf"), cache_modifier=CACHE) * LSE_SCALE
        p_os = p_o + o_s64[:, None] * stride_o + o_d[None, :]
        b_o = tl.load(p_os, mask=m_s[:, None] & m_d[None, :], other=0.0, cache_modifier=CACHE).to(tl.float32)
        m_i, l_i, acc, p = softmax_tile(m_i, l_i, acc, b_lse2[None, :])
        acc += tl.sum(tl.trans(p) * b_o, 0, keep_dims=True)
    return finalize(m_i, l_i, acc)


@triton.jit
def finalize(m_i, l_i, acc):
    """``(m, l, acc)`` -> normalised state ``(o [M, D], lse2 [M])``; an empty set gives (0, -inf)."""
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse2 = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
    return o, lse2
