"""The attention-state algebra as ``@triton.jit`` helpers, shared by every kernel.

Note [Attention states inside kernels]
--------------------------------------
A state of a key set ``I`` is ``(o, lse)`` with ``lse = log sum_{i in I} exp(s_i)`` and ``o`` the
softmax-weighted mean of the values. A running accumulator is ``(m, l, acc)``: ``m`` the running max,
``l = sum w_i`` and ``acc = sum w_i * v_i`` with ``w_i = exp(x_i - m)``. Folding in items with "scores"
``x`` (a tile of keys at level 1; whole states, whose score is their lse and whose value is their ``o``,
at levels 2 and 3 and in the cascade) is one max-subtracted update, :func:`running_max`.

Bases. Level 1 keeps scores in base 2 (``s * log2(e)`` folded into the score scale) so that ``exp2``
(one MUFU instruction) replaces ``exp``. States that leave a kernel, workspaces included, carry a
natural-log lse, and the merge helpers subtract the max *before* converting to base 2
(``exp2((lse - m) * log2(e))``): converting an absolute lse of 1e4 first would cost ~1e-3 of the
exponent in float32 rounding.

Edge cases, one rule each:
* nothing seen yet: the reference max is 0 instead of ``-inf``, every weight is ``2^-inf = 0``, the state
  stays empty (``o = 0``, ``lse = -inf``), and no ``-inf - -inf`` is formed;
* an item equal to the running max has weight exactly 1 (this makes ``lse = +inf`` well defined: the
  states with ``+inf`` share the result equally and the lse stays ``+inf``);
* a NaN lse makes that row's ``o`` and ``lse`` NaN (``tl.maximum`` skips the NaN, its weight does not).

FP8 caches: K/V tiles are loaded as stored and converted to fp16 in registers (exact: every e4m3 and e5m2
value is an fp16 value; one ``cvt`` per pair of values, where bf16 would take three per value through
fp32), so the dots run in fp16. A bf16 query is scaled per row by a power of two that puts its largest
|element| in [2^13, 2^14) and rounded to fp16, exact for every element within 2^-24 of that maximum
(bf16 has 8 significant bits, fp16 11); the power of two leaves through the score scale
(:func:`fp16_query`). The kernels fold ``k_scale`` into the score scale and multiply the normalised ``o``
by ``v_scale`` (see :func:`score_scales`).

Rounding (level 1): the weights ``p`` are rounded to the value dtype for the ``p @ v`` product on the
tensor cores, and ``o`` is normalised by the sum of the *rounded* weights, so it is a convex combination
of the values (``|o| <= max |v|``: an fp16 cache of 65504s gives 65504, not inf); the lse sums the
unrounded weights, so it stays exact to fp32. The split-KV kernel sums the rounded weights on the CUDA
cores (a row reduction per tile); the shared-segment kernel, whose 128-row tiles keep the CUDA cores busy
while its tensor cores wait, sums them on the tensor cores (``RSUM_DOT``: ``p @ ones [N, 16]``
accumulated like ``acc``, every column the sum): the same quantity rounded in the MMA's order, and faster
there (docs/tuning.md).

Note [Paged tiles from registers]
--------------------------------
A paged tile's K/V addresses depend on block-table entries. Loaded inside the loop (one entry per key),
that load feeds the K/V loads' addresses, and Triton's software pipeliner gives it a stage of its own: the
loop keeps one K/V tile in flight instead of two (39 KB of shared memory against the dense loop's 72 KB
for 64-key tiles, 139.5 KB for 128-key ones), which that paged plan makes up for with four programs per SM
and 64-key tiles, still slower than the dense cache. (Hiding that load from the pipeliner, as inline PTX,
gives the dense pipeline but leaves each iteration waiting for the entries of the tile two ahead.) When the
page size is a power of two
of 16 or more and the splits start on a tile, the entries of a split (``SPLIT_PAGES`` at most,
:data:`cp_attention.heuristics.MAX_SPLIT_PAGES`) are loaded once, before the loop, and a tile's pages are
picked from those registers (one page: a ``where`` and a sum of one nonzero entry, exact; several:
``tl.gather``, one round trip through shared memory whose cost does not grow with the entries, where a
where-and-sum over them grows with them): the loop is the dense loop, with the dense plan (sm_90 compile:
139.5 KB, the dense ``cp.async`` count). The FP8 two-warp tiles (``PAGE_GATHER``) gather a one-page tile's
entry too: the where-and-sum crosses both warps through shared memory every tile, and the gather's round
trip is hidden by the SM's other three programs, whereas a bf16 tile of 128 keys, one program per SM, has no
other program to hide it and keeps the where-and-sum. Head dim 256 FP8 tiles gather only on pages of one
tile (32), where the where-and-sum spills (on larger pages the gather was slower; ``split_kv.page_gather``).
FP8 pages of two tiles or more (``PAGE_TILES``, ``DecodePlan.page_tiles``) skip the registers: a tile lies
within one page, so its entry is one uniform load from the block table a tile, which the pipeliner gives a
stage of its own (five stages keep two K/V tiles in flight beside it); no round trip through shared memory,
no barrier; the tile's first row is one scalar offset, its keys' offsets loop-invariant (64-bit products
per key cost more). This is faster than the register table on those pages, and level with it on pages of
one tile (docs/tuning.md). The
gather's index is clamped to the entries: Triton's pipeliner computes the addresses of the tiles it
prefetches, the ones past the split's end included (their loads predicated off), so where a split's
entries fill ``SPLIT_PAGES`` the unclamped index read past the gather's shared memory
(compute-sanitizer: "Invalid __shared__ read"; an illegal-address fault in 3 of 4 processes on the H200,
16/8/256 e4m3, pages of 16, B=16 T=32k in 32-key tiles, 512 entries a split). Where a split of the dense plan
touches more entries than fit, the plan's splits are capped to fit. Pages of 16 and 64 then run within
about 2% of the dense cache (docs/tuning.md).

Note [Key streams]
------------------
The FP8 split kernel (64-key tiles, two warps, four programs per SM) is bound by each warp's chain of
dependent steps per tile (load, convert, dot, row max, exponentials, dot), not by bytes. In the plain loop
the two warps share a tile: the row max and sums cross warps through shared memory and ``p`` changes layout
through it, nine barriers a tile. With ``STREAMS`` (:func:`attend_streams`) the tile's keys form streams
with states of their own, as a 3-D ``tl.dot`` (Triton puts the warps on the leading dimension): with four
streams over two warps every reduction stays inside a warp, each warp runs two independent chains that
the compiler interleaves, and the streams merge by ⊕ once, after the loop (:func:`merge_streams`). The
merge and the 3-D setup cost a fixed ~5 µs of epilogue and prologue per program, so the plan takes streams
only for long splits (:func:`cp_attention.heuristics.key_streams`; docs/tuning.md). The result is the same
attention state; only the order of the additions differs (each stream's ``o`` is still a convex combination
of values). One stream per warp is slower.

Note [FP8 values in pairs]
--------------------------
``p @ v`` reduces over keys, and the tensor cores take a thread's operand as adjacent elements of the
reduction: a 16-bit V tile gets them from ``ldmatrix.trans``, but sm_90 has no transposing 8-bit shared load,
so an FP8 V tile reaches the ``mma`` as single-byte loads and byte packing (128 ``LDS.U8`` a thread for a
32-key tile of head dim 256 in two warps). With ``PAIR_V`` the query rows are doubled, ``(r, e)`` for each
parity ``e`` of a value dim, and the reduction runs over ``(key c, parity e)``: ``o[(r, e'), j] = sum_{c, e}
p2[(r, e'), (c, e)] v2[(c, e), j]`` with ``p2 = p[r, c]`` where ``e == e'`` (else 0) and ``v2[(c, e), j] =
v[c, 2 j + e]`` gives ``o[r, 2 j + e']``, so the two values of a reduction pair are adjacent bytes of one
key. The value columns are also permuted (:func:`pair_values`) so that a thread's pairs are 8 bytes in a
row. For query tiles of at most 8 rows (16 once doubled, one ``mma``'s rows; the value columns halve) the
``mma`` count is unchanged. Triton 3.6, sm_90, e4m3, head dim 256, GQA 2, a 32-key tile: 825 loop
instructions instead of 1160, 168-248 registers instead of 255, no byte loads of V. The zero weights add
exact zeros; the state is the same up to the order of the additions. It pays in
:data:`~cp_attention.heuristics.WIDE_FP8`'s tiles, dense or through the register table; pools whose tiles
load one table entry (``WIDE_FP8_TABLE_LOOP``) were slower paired, and at head dim 128 (64-key tiles of
GQA 4) it did not pay (each warp's chain, not the byte loads, sets the time there), so only ``WIDE_FP8``
tiles pair (``split_kv.pairs_values``; docs/tuning.md).

Note [Loops under the interpreter]
----------------------------------
Triton 3.6's interpreter holds every scalar as a shape-[1] NumPy array and gives ``range()`` a runtime
bound through ``int(array)``, which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted to
Python scalars"); 3.9's squeezes the array first. So under the interpreter (``INTERPRET``, the knob that
made ``@triton.jit`` interpret) a loop with a runtime bound is a ``while`` loop, whose test only needs
``bool(array)``; compiled kernels keep the ``for`` loop (``scf.for``, software-pipelined: a ``while``
would lose the ``cp.async`` pipeline) and never see the other branch. The body is one helper, so both
forms run the same code.
"""
import triton
import triton.language as tl

from .. import _constants
from ._dot import dot

LOG2E = tl.constexpr(_constants.LOG2E)
LN2 = tl.constexpr(_constants.LN2)
INTERPRET = tl.constexpr(triton.knobs.runtime.interpret)  # Note [Loops under the interpreter]


@triton.jit
def running_max(m_i, m_x, SCALE: tl.constexpr):
    """New running max, the finite reference max to subtract, and the rescale ``2^((m_i - m_ref) *
    SCALE)`` of the old sums (``SCALE``: 1 for base-2 scores, ``LOG2E`` for natural-log states)."""
    m_new = tl.maximum(m_i, m_x)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_i == m_ref, 1.0, tl.exp2((m_i - m_ref) * SCALE))
    return m_new, m_ref, alpha


@triton.jit
def lazy_running_max(m_i, m_x, l_i, r_i, acc, THRESHOLD: tl.constexpr, AX: tl.constexpr = 1):
    """:func:`running_max` for base-2 scores whose reference max moves only when a row's max rises by more
    than ``THRESHOLD`` (then the sums ``l_i``, ``r_i`` and ``acc`` are rescaled; a branch, taken on few tiles):
    otherwise the weights ``2^(s - m_ref)`` are taken against the old max and stay below ``2^THRESHOLD``. The
    state is the same; only the reference of its sums differs. ``AX``: the head dim's axis of ``acc`` (0:
    ``acc [D, M]``, transposed). Returns ``(m_i, m_ref, l_i, r_i, acc)``."""
    m_new, m_ref, alpha = running_max(m_i, m_x, 1.0)
    if tl.max((m_new > m_i + THRESHOLD).to(tl.int32), 0):
        acc = acc * tl.expand_dims(alpha, AX)
        l_i = l_i * alpha
        r_i = r_i * alpha
        m_i = m_new
    m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
    return m_i, m_ref, l_i, r_i, acc


@triton.jit
def seq_length(SEQ_LENS, stride_sl, i_seq, T_MAX, HAS_SEQ_LENS: tl.constexpr):
    """The length of sequence ``i_seq``: read from ``SEQ_LENS + i_seq * stride_sl`` and clamped to ``[0,
    T_MAX]``, or ``T_MAX``."""
    if HAS_SEQ_LENS:
        seq_len = tl.load(SEQ_LENS + i_seq * stride_sl).to(tl.int32)
        return tl.minimum(tl.maximum(seq_len, 0), T_MAX)
    else:
        return T_MAX


@triton.jit
def first_position(ROW_LIMITS, stride_rlb, stride_rlq, SEQ_LENS, stride_sl, i_seq, T_MAX, WINDOW,
                   Q_ROWS: tl.constexpr, HAS_SEQ_LENS: tl.constexpr, HAS_ROW_LIMITS: tl.constexpr,
                   HAS_WINDOW: tl.constexpr):
    """The lowest position any query row of sequence ``i_seq`` sees, from which the splits tile the keys
    (:func:`split_range`'s ``base``): the lowest lower limit over the rows (``ROW_LIMITS [B, Q, 2]``, in any
    order), the start of row 0's window (causal rows: row 0's is the lowest), or 0; at least 0."""
    if HAS_ROW_LIMITS:
        p = ROW_LIMITS + i_seq * stride_rlb
        base = tl.load(p)
        for r in range(1, Q_ROWS):
            base = tl.minimum(base, tl.load(p + r * stride_rlq))
        base = tl.maximum(base, 0)
    elif HAS_WINDOW:
        base = tl.maximum(seq_length(SEQ_LENS, stride_sl, i_seq, T_MAX, HAS_SEQ_LENS) - Q_ROWS - WINDOW, 0)
    else:
        base = 0
    return base


@triton.jit
def split_range(SEQ_LENS, stride_sl, i_seq, i_s, T_MAX, TILES_PER_SPLIT, BLOCK_N: tl.constexpr,
                HAS_SEQ_LENS: tl.constexpr, base):
    """The keys of split ``i_s`` of sequence ``i_seq``: ``[t_start, t_end)`` with splits of
    ``CHUNK = TILES_PER_SPLIT * BLOCK_N`` tokens from position ``base`` on, cut at the sequence's length
    (:func:`_seq_len`). Returns ``(seq_len, chunk, t_start, t_end)``; ``t_end <= t_start`` is an empty
    split."""
    seq_len = seq_length(SEQ_LENS, stride_sl, i_seq, T_MAX, HAS_SEQ_LENS)
    chunk = TILES_PER_SPLIT * BLOCK_N
    t_start = base + i_s * chunk
    t_end = tl.minimum(t_start + chunk, seq_len)
    return seq_len, chunk, t_start, t_end


@triton.jit
def kv_bases(K, V, i_seq64, i_h64, stride_ks, stride_kh, stride_vs, stride_vh, IS_PAGED: tl.constexpr):
    """Pointers to KV head ``i_h64`` of sequence (or segment) ``i_seq64`` in a dense cache, or of the pool
    in a paged one (its pages are added per key by :func:`attend_tile`)."""
    if IS_PAGED:
        return K + i_h64 * stride_kh, V + i_h64 * stride_vh
    else:
        return K + i_seq64 * stride_ks + i_h64 * stride_kh, V + i_seq64 * stride_vs + i_h64 * stride_vh


@triton.jit
def score_scales(sm_scale, cap, K_SCALE, V_SCALE, k_scale, v_scale, i_h64, stride_ksh, stride_vsh,
                 SOFTCAP: tl.constexpr, KV_SCALE: tl.constexpr):
    """``(qk_scale, v_scale)`` of KV head ``i_h64``: the factor of ``q.k`` that gives base-2 scores
    (``sm_scale * log2(e)``; with ``SOFTCAP`` the argument of ``cap * tanh``, ``sm_scale / (cap * ln 2)``,
    where ``cap`` comes pre-multiplied by log2(e)) times the FP8 key scale, and the FP8 value scale that
    multiplies the output. The FP8 scales are 1 (``KV_SCALE == 0``: no FP8), the scalar arguments (``1``)
    or loads from ``K_SCALE + i_h * stride_ksh`` (``2``: 0-d or ``[Hkv]`` tensors, stride 0 for 0-d)."""
    if SOFTCAP:
        qk_scale = sm_scale / (cap * LN2)
    else:
        qk_scale = sm_scale * LOG2E
    if KV_SCALE == 2:
        ks = tl.load(K_SCALE + i_h64 * stride_ksh)
        vs = tl.load(V_SCALE + i_h64 * stride_vsh)
        qk_scale = qk_scale * ks
    elif KV_SCALE == 1:
        vs = v_scale
        qk_scale = qk_scale * k_scale
    else:
        vs = 1.0
    return qk_scale, vs


@triton.jit
def fp16_query(b_q, qk_scale, KV_SCALE: tl.constexpr, AX: tl.constexpr = 1):
    """The query rows ``b_q [M, D]`` and score scale for the dots against a K/V tile: unchanged for a
    bf16/fp16 cache; for an FP8 cache (``KV_SCALE != 0``) and a bf16 query, ``(q * 2^(13 - e) in fp16,
    qk_scale * 2^(e - 13) [M, 1])`` per row, with ``2^e <= max |q| < 2^(e + 1)`` (powers of two built from
    their exponent bits: exact), so the dots run in fp16 (Note [Attention states inside kernels], FP8).
    ``AX``: the head dim's axis of ``b_q`` (0: ``q^T [D, M]``, then the scale ``[1, M]``)."""
    if KV_SCALE != 0:  # both tests at compile time
        if b_q.dtype == tl.bfloat16:
            q = b_q.to(tl.float32)
            e = (tl.max(tl.abs(q), AX).to(tl.int32, bitcast=True) >> 23) - 127  # non-negative floats: no sign bit
            e = tl.minimum(tl.maximum(e, -100), 127)
            up = ((140 - e) << 23).to(tl.float32, bitcast=True)  # 2^(13 - e)
            down = ((114 + e) << 23).to(tl.float32, bitcast=True)  # 2^(e - 13)
            b_q = (q * tl.expand_dims(up, AX)).to(tl.float16)
            qk_scale = qk_scale * tl.expand_dims(down, AX)
    return b_q, qk_scale


@triton.jit
def table_entries(p_bt, stride_btp, i_pg, mask, num_pages):
    """Entries ``i_pg`` of the block-table row ``p_bt`` where ``mask`` (else 0), clamped into the pool
    ``[0, num_pages)``."""
    page = tl.load(p_bt + i_pg * stride_btp, mask=mask, other=0)
    return tl.minimum(tl.maximum(page, 0), num_pages - 1)


@triton.jit
def attend_tiles(b_q, row_lo, row_hi, p_k, p_v, stride_kt, stride_vt, p_bt, stride_btp, stride_kp, stride_vp,
                 num_pages, t_start, t_end, qk_scale, cap, o_d, m_d,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 IS_PAGED: tl.constexpr, HAS_ROW_LO: tl.constexpr, HAS_ROW_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_PAGES: tl.constexpr = 0,
                 RSUM_DOT: tl.constexpr = False, STREAMS: tl.constexpr = 1, PAGE_GATHER: tl.constexpr = False,
                 PAGE_TILES: tl.constexpr = False, PAIR_V: tl.constexpr = 0):
    """Level 1: the query rows ``b_q [BLOCK_M, BLOCK_D]`` attend to the keys ``[t_start, t_end)`` of one KV
    head, ``BLOCK_N`` keys per tile through ``tl.dot``, with the online softmax. In a dense cache key ``t``
    is at ``p_k + t * stride_kt + o_d``; in a page pool (``IS_PAGED``) at ``p_k + page * stride_kp + (t %
    PAGE_SIZE) * stride_kt + o_d`` with ``page`` from the block-table row ``p_bt`` (values likewise). With
    ``HAS_ROW_HI``, row ``m`` sees only the keys ``t < row_hi[m]`` (the causal rule of multi-row queries);
    with ``HAS_ROW_LO``, only ``t >= row_lo[m]`` (a sliding window). Scores: ``qk_scale * q.k`` (the score
    scale times ``log2(e)``), or with ``SOFTCAP`` ``cap * tanh(qk_scale * q.k)`` (then ``qk_scale`` is the
    score scale over the cap and ``cap`` the cap times ``log2(e)``). Returns the normalised state ``(o
    [BLOCK_M, BLOCK_D] fp32, lse [BLOCK_M] natural log)``; a row that sees no key gets the empty state.
    Keys outside the range are never loaded (a cache may hold garbage there).

    ``SPLIT_PAGES`` > 0 (paged; ``PAGE_SIZE`` and ``BLOCK_N`` powers of two; ``t_start`` a multiple of
    ``BLOCK_N``; at most ``SPLIT_PAGES`` pages in the range): the range's block-table entries are loaded
    once, before the loop, into registers; a tile's pages are picked from them by arithmetic, so no load
    inside the loop feeds a K/V address (Note [Paged tiles from registers]); ``PAGE_GATHER``: a tile within
    one page picks its entry by ``tl.gather`` too, not by a where-and-sum over the entries.

    ``PAGE_TILES`` (paged, ``SPLIT_PAGES`` 0; ``PAGE_SIZE`` a multiple of ``BLOCK_N``, ``t_start`` a multiple of
    ``BLOCK_N``): each tile lies within one page, whose entry is one load from the block table a tile.

    ``RSUM_DOT``: the sum of the rounded weights on the tensor cores (Note [Attention states inside
    kernels], Rounding).

    ``PAIR_V`` > 0 (FP8 tiles of at most 8 rows; the program's warps): ``p @ v`` over (key, value-dim
    parity) pairs, every row doubled (Note [FP8 values in pairs]); the same state.

    ``STREAMS`` > 1 (a dense cache; ``BLOCK_N`` a multiple of ``16 * STREAMS``): each tile's keys are cut
    into ``STREAMS`` streams of ``BLOCK_N // STREAMS`` with running states of their own, merged by ⊕ after
    the loop (:func:`attend_streams`, Note [Key streams]).
    """
    if STREAMS > 1:
        return attend_streams(b_q, row_lo, row_hi, p_k, p_v, stride_kt, stride_vt, t_start, t_end, qk_scale, cap,
                              o_d, m_d, BLOCK_M, BLOCK_N, BLOCK_D, HAS_ROW_LO, HAS_ROW_HI, SOFTCAP, INPUT_PRECISION,
                              UPCAST, STREAMS)
    if PAIR_V:  # Note [FP8 values in pairs]: row 2 r + e is row r, for value dims of parity e
        b_q = pair_rows(b_q)
        qk_scale = pair_rows(qk_scale * tl.full([BLOCK_M, 1], 1.0, tl.float32))
        if HAS_ROW_LO:
            row_lo = pair_entries(row_lo)
        if HAS_ROW_HI:
            row_hi = pair_entries(row_hi)
        ROWS: tl.constexpr = 2 * BLOCK_M
        COLS: tl.constexpr = BLOCK_D // 2
    else:
        ROWS: tl.constexpr = BLOCK_M
        COLS: tl.constexpr = BLOCK_D
    if SPLIT_PAGES > 0:
        o_pg = tl.arange(0, SPLIT_PAGES)
        pg0 = t_start // PAGE_SIZE
        pages = table_entries(p_bt, stride_btp, pg0 + o_pg, o_pg < (t_end - 1) // PAGE_SIZE - pg0 + 1, num_pages)
    else:
        pg0 = 0
        pages = tl.zeros([1], tl.int32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)  # sum of the weights: the lse
    if RSUM_DOT:  # the sum of the rounded weights, which normalises o (with RSUM_DOT in each of 16 columns)
        r_i = tl.zeros([ROWS, 16], tl.float32)
    else:
        r_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, COLS], tl.float32)
    if INTERPRET:  # Note [Loops under the interpreter]
        t0 = t_start
        while t0 < t_end:
            m_i, l_i, r_i, acc = attend_tile(m_i, l_i, r_i, acc, b_q, row_lo, row_hi, p_k, p_v, stride_kt, stride_vt,
                                           p_bt, stride_btp, stride_kp, stride_vp, num_pages, t0, t_end, qk_scale,
                                           cap, o_d, m_d, pages, pg0, BLOCK_N, PAGE_SIZE, IS_PAGED, HAS_ROW_LO,
                                           HAS_ROW_HI, SOFTCAP, INPUT_PRECISION, UPCAST, SPLIT_PAGES, RSUM_DOT,
                                           PAGE_GATHER, PAGE_TILES, PAIR_V)
            t0 += BLOCK_N
    else:
        for t0 in range(t_start, t_end, BLOCK_N):
            m_i, l_i, r_i, acc = attend_tile(m_i, l_i, r_i, acc, b_q, row_lo, row_hi, p_k, p_v, stride_kt, stride_vt,
                                           p_bt, stride_btp, stride_kp, stride_vp, num_pages, t0, t_end, qk_scale,
                                           cap, o_d, m_d, pages, pg0, BLOCK_N, PAGE_SIZE, IS_PAGED, HAS_ROW_LO,
                                           HAS_ROW_HI, SOFTCAP, INPUT_PRECISION, UPCAST, SPLIT_PAGES, RSUM_DOT,
                                           PAGE_GATHER, PAGE_TILES, PAIR_V)
    if RSUM_DOT:
        o, _ = finalize(m_i, tl.max(r_i, 1), acc, LN2)
    else:
        o, _ = finalize(m_i, r_i, acc, LN2)
    _, lse = finalize(m_i, l_i, acc, LN2)
    if PAIR_V:
        o, lse = unpair_state(o, lse, BLOCK_M, BLOCK_D, PAIR_V)
    return o, lse


@triton.jit
def capped(b_s, cap, SOFTCAP: tl.constexpr):
    """The scores ``b_s``, or with ``SOFTCAP`` ``cap * tanh(b_s)``: ``1 - 2 / (1 + e^{2x})`` (exact limits +-1
    for large |x|), and below |x| = 1/8 its odd Taylor polynomial to x^7, where the subtraction would lose
    tanh's relative precision (its absolute error of a float32 ulp of 1, times ``cap``, would swamp the
    scores of a very large cap)."""
    if SOFTCAP:
        x2 = b_s * b_s
        series = b_s * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        b_s = cap * tl.where(x2 < 0.015625, series, 1.0 - 2.0 / (1.0 + tl.exp2(b_s * (2.0 * LOG2E))))
    return b_s


@triton.jit
def seen_scores(b_s, o_t, m_t, row_lo, row_hi, HAS_ROW_LO: tl.constexpr, HAS_ROW_HI: tl.constexpr):
    """The scores ``b_s [..., M, N]`` with ``-inf`` where row ``m`` does not see key ``o_t [..., N]``: keys
    outside the range (``m_t`` false), and with ``HAS_ROW_HI`` / ``HAS_ROW_LO`` the keys ``>= row_hi[m]`` /
    ``< row_lo[m]`` (``row_lo``, ``row_hi [M]``)."""
    m_ts = tl.expand_dims(m_t, -2)
    if HAS_ROW_HI:
        m_ts = m_ts & (tl.expand_dims(o_t, -2) < tl.expand_dims(row_hi, -1))
    if HAS_ROW_LO:
        m_ts = m_ts & (tl.expand_dims(o_t, -2) >= tl.expand_dims(row_lo, -1))
    return tl.where(m_ts, b_s, float("-inf"))


@triton.jit
def attend_streams(b_q, row_lo, row_hi, p_k, p_v, stride_kt, stride_vt, t_start, t_end, qk_scale, cap, o_d, m_d,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROW_LO: tl.constexpr,
                   HAS_ROW_HI: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, S: tl.constexpr):
    """:func:`attend_tiles` of a dense cache with the tile's keys in ``S`` streams (Note [Key streams]):
    stream ``j`` of the tile at ``t0`` holds the keys ``t0 + j * BLOCK_N // S + [0, BLOCK_N // S)``; the
    products are 3-D dots over the streams, each stream keeps its own ``(m, l, r, acc)``, and
    :func:`merge_streams` folds them after the loop. Same arguments and result as :func:`attend_tiles`."""
    q3 = tl.broadcast_to(b_q[None, :, :], [S, BLOCK_M, BLOCK_D])
    m_i = tl.full([S, BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([S, BLOCK_M], tl.float32)
    r_i = tl.zeros([S, BLOCK_M], tl.float32)
    acc = tl.zeros([S, BLOCK_M, BLOCK_D], tl.float32)
    o_n = tl.arange(0, S)[:, None] * (BLOCK_N // S) + tl.arange(0, BLOCK_N // S)[None, :]  # [S, BLOCK_N // S]
    if INTERPRET:  # Note [Loops under the interpreter]
        t0 = t_start
        while t0 < t_end:
            m_i, l_i, r_i, acc = attend_stream_tile(m_i, l_i, r_i, acc, q3, row_lo, row_hi, p_k, p_v, stride_kt,
                                                    stride_vt, t0 + o_n, t_end, qk_scale, cap, o_d, m_d, HAS_ROW_LO,
                                                    HAS_ROW_HI, SOFTCAP, INPUT_PRECISION, UPCAST)
            t0 += BLOCK_N
    else:
        for t0 in range(t_start, t_end, BLOCK_N):
            m_i, l_i, r_i, acc = attend_stream_tile(m_i, l_i, r_i, acc, q3, row_lo, row_hi, p_k, p_v, stride_kt,
                                                    stride_vt, t0 + o_n, t_end, qk_scale, cap, o_d, m_d, HAS_ROW_LO,
                                                    HAS_ROW_HI, SOFTCAP, INPUT_PRECISION, UPCAST)
    m_i, l_i, r_i, acc = merge_streams(m_i, l_i, r_i, acc)
    o, _ = finalize(m_i, r_i, acc, LN2)
    _, lse = finalize(m_i, l_i, acc, LN2)
    return o, lse


@triton.jit
def attend_stream_tile(m_i, l_i, r_i, acc, q3, row_lo, row_hi, p_k, p_v, stride_kt, stride_vt, o_t, t_end, qk_scale,
                       cap, o_d, m_d, HAS_ROW_LO: tl.constexpr, HAS_ROW_HI: tl.constexpr, SOFTCAP: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One step of :func:`attend_streams`: fold the keys ``o_t [S, N]`` (those below ``t_end``) into each
    stream's state, as :func:`attend_tile` folds a tile."""
    m_t = o_t < t_end
    m_td = m_t[:, :, None] & m_d[None, None, :]
    o_t64 = o_t.to(tl.int64)
    b_k = tl.load(p_k + (o_t64 * stride_kt)[:, :, None] + o_d[None, None, :], mask=m_td, other=0.0).to(q3.dtype)
    b_s = capped(dot(q3, tl.trans(b_k, (0, 2, 1)), None, INPUT_PRECISION, UPCAST) * qk_scale, cap, SOFTCAP)
    b_s = seen_scores(b_s, o_t, m_t, row_lo, row_hi, HAS_ROW_LO, HAS_ROW_HI)
    m_i, m_ref, alpha = running_max(m_i, tl.max(b_s, 2), 1.0)
    b_v = tl.load(p_v + (o_t64 * stride_vt)[:, :, None] + o_d[None, None, :], mask=m_td, other=0.0).to(q3.dtype)
    l_i, r_i, acc = fold_weights(l_i, r_i, acc, b_s, m_ref, alpha, b_v, 2, INPUT_PRECISION, UPCAST, False)
    return m_i, l_i, r_i, acc


@triton.jit
def attend_tile(m_i, l_i, r_i, acc, b_q, row_lo, row_hi, p_k, p_v, stride_kt, stride_vt, p_bt, stride_btp, stride_kp,
                stride_vp, num_pages, t0, t_end, qk_scale, cap, o_d, m_d, pages, pg0,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr, HAS_ROW_LO: tl.constexpr,
                HAS_ROW_HI: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                SPLIT_PAGES: tl.constexpr, RSUM_DOT: tl.constexpr, PAGE_GATHER: tl.constexpr,
                PAGE_TILES: tl.constexpr, PAIR_V: tl.constexpr):
    """One step of :func:`attend_tiles`: fold the keys ``[t0, min(t0 + BLOCK_N, t_end))``."""
    o_t = t0 + tl.arange(0, BLOCK_N)
    m_t = o_t < t_end
    m_td = m_t[:, None] & m_d[None, :]
    if PAGE_TILES:  # the tile within one page: one entry, one uniform load; the tile's first row as a scalar
        page = table_entries(p_bt, stride_btp, t0 // PAGE_SIZE, t0 < t_end, num_pages).to(tl.int64)
        slot0 = (t0 % PAGE_SIZE).to(tl.int64)
        o_n = tl.arange(0, BLOCK_N).to(tl.int64)
        o_k = (page * stride_kp + slot0 * stride_kt) + o_n * stride_kt
        o_v = (page * stride_vp + slot0 * stride_vt) + o_n * stride_vt
    elif IS_PAGED:
        if SPLIT_PAGES > 0:  # the tile's pages, from the registers (Note [Paged tiles from registers])
            i_pg = t0 // PAGE_SIZE - pg0  # the tile's first page among the range's
            if BLOCK_N <= PAGE_SIZE and not PAGE_GATHER:  # one page (tl.sum of one nonzero entry: exact)
                o_pg = tl.arange(0, SPLIT_PAGES)
                page = tl.sum(tl.where(o_pg == i_pg, pages, 0), 0).to(tl.int64)
                slot = (t0 % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
            else:  # each key's page, gathered (one round trip through shared memory)
                o_kk = t0 % PAGE_SIZE + tl.arange(0, BLOCK_N)  # offsets from the first page's start
                # clamped: the software pipeliner also computes the addresses of the tiles past the split's end
                # (their loads predicated off), and an index past the entries reads past the gather's shared
                # memory (Note [Paged tiles from registers])
                i_kp = tl.minimum(i_pg + o_kk // PAGE_SIZE, SPLIT_PAGES - 1)
                page = tl.gather(pages, i_kp, 0).to(tl.int64)
                slot = (o_kk % PAGE_SIZE).to(tl.int64)
        else:  # one table entry per key
            page = table_entries(p_bt, stride_btp, o_t // PAGE_SIZE, m_t, num_pages).to(tl.int64)
            slot = (o_t % PAGE_SIZE).to(tl.int64)
        o_k = page * stride_kp + slot * stride_kt
        o_v = page * stride_vp + slot * stride_vt
    else:
        o_t64 = o_t.to(tl.int64)
        o_k = o_t64 * stride_kt
        o_v = o_t64 * stride_vt
    b_k = tl.load(p_k + o_k[:, None] + o_d[None, :], mask=m_td, other=0.0).to(b_q.dtype)  # FP8: dequantised
    b_s = capped(dot(b_q, tl.trans(b_k), None, INPUT_PRECISION, UPCAST) * qk_scale, cap, SOFTCAP)
    b_s = seen_scores(b_s, o_t, m_t, row_lo, row_hi, HAS_ROW_LO, HAS_ROW_HI)
    m_i, m_ref, alpha = running_max(m_i, tl.max(b_s, 1), 1.0)
    b_v = tl.load(p_v + o_v[:, None] + o_d[None, :], mask=m_td, other=0.0)
    if PAIR_V:  # Note [FP8 values in pairs]
        b_v = pair_values(b_v, PAIR_V)
    l_i, r_i, acc = fold_weights(l_i, r_i, acc, b_s, m_ref, alpha, b_v.to(b_q.dtype), 1, INPUT_PRECISION, UPCAST,
                                 RSUM_DOT, PAIR_V)
    return m_i, l_i, r_i, acc


@triton.jit
def take_weights(b_s, m_ref, l_i, r_i, dtype: tl.constexpr, AX: tl.constexpr, SUM_ROUNDED: tl.constexpr = True):
    """A tile's weights ``2^(s - m_ref)`` of its masked base-2 scores ``b_s`` (the keys on axis ``AX``) against
    the reference max ``m_ref``: ``(p rounded to dtype, l_i + the sum of the weights, r_i + the sum of the
    rounded ones)`` (Note [Attention states inside kernels]; the Triton kernels' :func:`fold_weights`, the
    Gluon FP8 kernel's ``_attend_tile``); ``SUM_ROUNDED`` False: ``r_i`` as given (summed by the caller)."""
    p = tl.exp2(b_s - tl.expand_dims(m_ref, AX))
    l_i = l_i + tl.sum(p, AX)
    p = p.to(dtype)
    if SUM_ROUNDED:
        r_i = r_i + tl.sum(p.to(tl.float32), AX)
    return p, l_i, r_i


@triton.jit
def fold_weights(l_i, r_i, acc, b_s, m_ref, alpha, b_v, AX: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr, RSUM_DOT: tl.constexpr, PAIR_V: tl.constexpr = 0):
    """The online-softmax step of level 1 after :func:`running_max` gave ``(m_ref, alpha)``: a tile's masked
    base-2 scores ``b_s [..., M, N]`` (the keys on axis ``AX``, the last) become weights ``2^(s - m_ref)``,
    and the sums and ``acc`` are rescaled by ``alpha`` and take them (Note [Attention states inside
    kernels]): ``l`` sums the weights, ``r`` the weights rounded to the value dtype (``RSUM_DOT``: on the
    tensor cores, 2-D tiles), ``acc`` the products of the rounded weights with the values ``b_v [..., N, D]``.
    Returns ``(l, r, acc)``."""
    if RSUM_DOT:
        p, l_i, _ = take_weights(b_s, m_ref, l_i * alpha, r_i, b_v.dtype, AX, False)
        r_i = dot(p, tl.full([b_s.shape[AX], 16], 1.0, p.dtype), r_i * alpha[:, None], INPUT_PRECISION, UPCAST)
    else:
        p, l_i, r_i = take_weights(b_s, m_ref, l_i * alpha, r_i * alpha, b_v.dtype, AX)
    if PAIR_V:  # Note [FP8 values in pairs]
        p = pair_weights(p)
    acc = dot(p, b_v, acc * tl.expand_dims(alpha, AX), INPUT_PRECISION, UPCAST)
    return l_i, r_i, acc


@triton.jit
def pair_rows(x):
    """``x [M, K]`` -> ``[2 M, K]``, row ``2 r + e`` a copy of row ``r`` (Note [FP8 values in pairs])."""
    return tl.reshape(tl.permute(tl.join(x, x), (0, 2, 1)), (2 * x.shape[0], x.shape[1]))


@triton.jit
def pair_entries(x):
    """``x [M]`` -> ``[2 M]``, entry ``2 r + e`` a copy of entry ``r`` (Note [FP8 values in pairs])."""
    return tl.reshape(tl.join(x, x), (2 * x.shape[0],))


@triton.jit
def pair_weights(p):
    """The weights ``p [2 M, N]`` of paired rows -> ``[2 M, 2 N]``: column ``2 c + e`` of row ``(r, e')``
    holds ``p[(r, e'), c]`` where ``e == e'``, else 0 (Note [FP8 values in pairs])."""
    even = (tl.arange(0, p.shape[0]) % 2 == 0)[:, None]
    return tl.reshape(tl.join(tl.where(even, p, 0.0), tl.where(even, 0.0, p)), (p.shape[0], 2 * p.shape[1]))


@triton.jit
def pair_values(v, W: tl.constexpr):
    """A value tile ``v [N, D]`` -> ``[2 N, D / 2]`` for ``W`` warps (``D`` a multiple of ``16 W``): row ``2 c +
    e``, column ``n = 8 (W a + w) + g`` holds ``v[c, 16 g + 2 A w + 2 a + e]`` (``A = D / (16 W)``), so the
    bytes a thread reads for the tensor cores are adjacent (Note [FP8 values in pairs])."""
    tl.static_assert(v.shape[1] % (16 * W) == 0)
    v5 = tl.reshape(v, (v.shape[0], 8, W, v.shape[1] // (16 * W), 2))
    return tl.reshape(tl.permute(v5, (0, 4, 3, 2, 1)), (2 * v.shape[0], v.shape[1] // 2))


@triton.jit
def unpair_state(o, lse, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, W: tl.constexpr):
    """The paired state ``(o [2 M, D / 2], lse [2 M])`` -> ``(o [M, D], lse [M])`` (the inverse of
    :func:`pair_values`' column order; both rows of a pair hold the same lse)."""
    o = tl.reshape(tl.permute(tl.reshape(o, (BLOCK_M, 2, BLOCK_D // (16 * W), W, 8)), (0, 4, 3, 2, 1)),
                   (BLOCK_M, BLOCK_D))
    lse, _ = tl.split(tl.reshape(lse, (BLOCK_M, 2)))
    return o, lse


@triton.jit
def add_sink(o, lse, sink, AX: tl.constexpr = 1):
    """``(o, lse) ⊕ (0, sink)``: one extra logit per row in the softmax denominator, with no value (attention
    sinks). A row that saw no key gets ``o = 0``, ``lse = sink``; a ``+inf`` sink holds all the mass: ``o = 0``,
    ``lse = +inf``. As in every merge here, the term equal to the max weighs exactly 1 (no ``inf - inf``).
    ``AX``: the head dim's axis of ``o``."""
    m = tl.maximum(lse, sink)
    w = tl.where(lse == m, 1.0, tl.exp2((lse - m) * LOG2E))
    total = w + tl.where(sink == m, 1.0, tl.exp2((sink - m) * LOG2E))
    return o * tl.expand_dims(w / total, AX), m + tl.log2(total) * LN2


@triton.jit
def fold_states(m_i, l_i, acc, b_lse, b_o):
    """Fold a block of natural-log states into ``(m [G], l [G], acc [G, D])``: ``b_lse [S, G]`` and
    ``b_o [S, G, D]`` fp32, ``S`` states for each of ``G`` rows."""
    m_i, m_ref, alpha = running_max(m_i, tl.max(b_lse, 0), LOG2E)
    w = tl.where(b_lse == m_ref[None, :], 1.0, tl.exp2((b_lse - m_ref[None, :]) * LOG2E))
    l_i = l_i * alpha + tl.sum(w, 0)
    acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * b_o, 0)
    return m_i, l_i, acc


@triton.jit
def merge_streams(m_i, l_i, r_i, acc):
    """⊕ of ``S`` running accumulators of the same rows, base-2 maxes: ``m_i``, ``l_i``, ``r_i [S, M]``,
    ``acc [S, M, D]`` -> ``(m [M], l [M], r [M], acc [M, D])``; each state weighs ``2^(m_s - m)``, and
    empty streams (``m_s = -inf``) weigh 0 (the rules of :func:`running_max`)."""
    _, _, w = running_max(m_i, tl.max(m_i, 0)[None, :], 1.0)
    return tl.max(m_i, 0), tl.sum(w * l_i, 0), tl.sum(w * r_i, 0), tl.sum(w[:, :, None] * acc, 0)


@triton.jit
def merge_tile(p_lse, p_o, n, stride_ls, stride_lg, stride_os, stride_og, o_g, m_g, o_d, m_d,
               BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """Levels 2 and 3: ⊕ of ``n`` states for each of ``BLOCK_G`` rows. State ``j`` of row ``g`` is at
    ``p_lse + j * stride_ls + g * stride_lg`` (natural-log lse) and ``p_o + j * stride_os + g * stride_og +
    o_d`` (its ``o``). States are read ``BLOCK_S`` at a time for all the rows at once, so the whole merge of
    up to ``BLOCK_S`` states is one load round trip. Returns ``(o [BLOCK_G, BLOCK_D] fp32, lse [BLOCK_G]
    natural log)``.
    """
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if INTERPRET:  # Note [Loops under the interpreter]
        j0 = 0
        while j0 < n:
            m_i, l_i, acc = merge_block(m_i, l_i, acc, p_lse, p_o, j0, n, stride_ls, stride_lg, stride_os,
                                        stride_og, o_g, m_g, o_d, m_d, BLOCK_S, CACHE)
            j0 += BLOCK_S
    else:
        for j0 in range(0, n, BLOCK_S):
            m_i, l_i, acc = merge_block(m_i, l_i, acc, p_lse, p_o, j0, n, stride_ls, stride_lg, stride_os,
                                        stride_og, o_g, m_g, o_d, m_d, BLOCK_S, CACHE)
    return finalize(m_i, l_i, acc, 1.0)


@triton.jit
def merge_block(m_i, l_i, acc, p_lse, p_o, j0, n, stride_ls, stride_lg, stride_os, stride_og, o_g, m_g, o_d, m_d,
                BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """One step of :func:`merge_tile`: fold the states ``[j0, min(j0 + BLOCK_S, n))`` of every row."""
    o_s = (j0 + tl.arange(0, BLOCK_S)).to(tl.int64)
    m_s = o_s < n
    m_sg = m_s[:, None] & m_g[None, :]
    b_lse = tl.load(p_lse + o_s[:, None] * stride_ls + o_g[None, :] * stride_lg, mask=m_sg,
                    other=float("-inf"), cache_modifier=CACHE)
    p_os = p_o + o_s[:, None, None] * stride_os + o_g[None, :, None] * stride_og + o_d[None, None, :]
    b_o = tl.load(p_os, mask=m_sg[:, :, None] & m_d[None, None, :], other=0.0, cache_modifier=CACHE).to(tl.float32)
    return fold_states(m_i, l_i, acc, b_lse, b_o)


@triton.jit
def finalize(m_i, l_i, acc, M_SCALE: tl.constexpr, AX: tl.constexpr = 1):
    """``(m, l, acc)`` -> the normalised state ``(o [M, D], lse [M])``, natural log:
    ``lse = m * M_SCALE + ln(l)`` (``M_SCALE``: ``LN2`` for a base-2 running max, 1 for a natural-log
    one). An empty set (``l = 0``) gives ``(0, -inf)``. ``AX``: the head dim's axis of ``acc`` (0: ``acc [D,
    M]`` gives ``o [D, M]``)."""
    empty = l_i == 0.0  # (a NaN sum is not empty: it stays NaN)
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / tl.expand_dims(l_safe, AX)
    lse = tl.where(empty, float("-inf"), m_i * M_SCALE + tl.log2(l_safe) * LN2)
    return o, lse
