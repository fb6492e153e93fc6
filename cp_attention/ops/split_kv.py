"""Split-KV decode kernels: level 1 of ⊕ in the split kernel, level 2 in the combine kernel.

Note [Split-KV decode]
----------------------
Grid ``(B * Hkv * N_RT, S)``. Program ``(i_p, i_s)`` owns row tile ``i_rt`` of KV head ``i_h`` of
sequence ``i_b`` and the token range ``[i_s * CHUNK, (i_s + 1) * CHUNK) ∩ [0, seq_len)`` with
``CHUNK = TILES_PER_SPLIT * BLOCK_N``. Its query rows are the ``Q_ROWS * GROUP_SIZE`` pairs (query row,
query head) that read this KV head -- the ``GROUP_SIZE`` query heads of the GQA group for each of the
``Q_ROWS`` new tokens (row ``r`` is token ``r // GROUP_SIZE``, head ``r % GROUP_SIZE``) -- packed into
the ``BLOCK_H`` rows of one tile (pack-GQA, and the drafts of speculative decoding), so each K/V tile is
loaded once per tile of rows and meets the queries through ``tl.dot``; ``N_RT`` tiles when the rows do
not fit one. Level 1: the online softmax over ``BLOCK_N`` tiles (``attend_tiles``). With several query
rows the causal rule applies: row ``i`` sees the positions ``< seq_len - Q_ROWS + 1 + i``
(``IS_CAUSAL``), or the limits of a ``ROW_LIMITS [B, Q_ROWS]`` tensor (``HAS_ROW_LIMITS``: what a
context-parallel rank sees of the global causal rule). A row that sees no key keeps the empty state
(o = 0, lse = -inf). The cache is dense ``[B, Hkv, T, D]`` (through its strides) or a page pool read
through a block table (``IS_PAGED``; ``ops/_state.py``).

With one split the program writes the output directly. With several (``EXPORT``), it writes its state
into slot ``i_s`` of a split-major fp32 workspace: slot ``j`` holds ``o [P * ROWS_T, D]`` then ``lse
[P * ROWS_T]`` (``P = B * Hkv * N_RT`` programs of ``ROWS_T`` rows; natural log), and ``_combine_kernel``
merges the slots (Note [Level 2 in its own kernel]). No host synchronisation, no value-dependent
allocation: the split layout depends on ``T_max`` only; ``seq_lens`` are read on the device, and a split
past a sequence's end holds the empty state, whose weight in the merge is exactly 0.

Note [Level 2 in its own kernel]
--------------------------------
``_combine_kernel`` runs one program per query row (grid ``(P, ROWS_T, D_CHUNKS)``), each reading its row's
states of every split in one load round trip (``BLOCK_S`` states at a time) and writing the output row; more
than 64 splits of head dim 128 (the one-warp FP8 plans at long contexts) are read at once in chunks of the
head dim, one program a chunk (:func:`combine_launch_config`), rather than 64 at a time in several round
trips after the split kernel. Merging in the split kernel's last program (a combine fused in through a
ticket counter) is slower: one SM pulls every state of a (sequence, KV head) from L2 at about 10 GB/s, a
round trip of ``BLOCK_S`` states at a time, so the tail grows with the split count times the GQA group,
while a program per row reads its 32 states in one round trip on its own SM (docs/tuning.md). With
programmatic dependent launch the combine's launch overlaps the split kernel's last state writes.

The output ``o``/``lse`` may be any strided view (fp32 slots of a caller's workspace included), which is
how cascade levels and context-parallel ranks receive unrounded states.

Note [Deterministic splits]
---------------------------
With a fixed ``split_size`` the splits cover absolute positions ``[j * split_size, (j + 1) * split_size)``
(tiles of a size that divides it), independent of the batch, the SM count and the cache capacity. The
split kernel then exports every split's state (``EXPORT``: split-major slots ``[o (P * ROWS_T, D), lse
(P * ROWS_T)]``) and ``_combine_kernel`` merges all the slots of a row in slot order with constexprs that
depend only on the model's shapes (``BLOCK_S`` fixed by the head dim). Slots past a sequence's end
hold the empty state, whose fold is exact (weights of exactly 0 and 1), so a request's output is the
same bits whatever batch, capacity or GPU it runs on. A context-parallel rank whose contiguous shard holds
whole splits exports its slots the same way; the all-gather concatenates them in rank order, which is
global split order, and the same ``_combine_kernel`` merges them: bitwise the single-GPU result. (The
policy's splits go through the same two kernels; their ``BLOCK_S`` follows the split count.)

Note [Programmatic dependent launch]
------------------------------------
On sm_90 and later the split kernel is launched with programmatic dependent launch (``PDL``; Triton's
``launch_pdl``): the driver may start launching it before the kernel ahead of it in the stream has
finished, once every program of that kernel has called ``griddepcontrol.launch_dependents`` (or exited).
Its programs first execute ``griddepcontrol.wait``, which returns when the kernel ahead has completed and
its memory is visible, so they read nothing (q, the cache, ``seq_lens``, the workspace) before it. Each
split program calls ``launch_dependents`` once its K/V reads are done, so the combine kernel (also launched
with PDL) is placed on the SMs while the last states are written. The combine calls it on entry, so the
next decode's split kernel is launched while it merges, except behind a split config that packs several
programs per SM as one wave (``DecodeConfig.programs``: FP8, paged, short contexts), where it calls it
after its stores: split programs placed while combine programs still hold an SM's registers do not all
fit, and the ones left over would run as a second wave. Behind one program per SM (bf16 128-key tiles) a
combine program fits beside it, and the early trigger saves a fraction of a µs of a short decode
(docs/tuning.md). A kernel that follows without the attribute simply waits for this one to finish, so the
instructions change nothing else.
"""
from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._dot import dot_flags
from ._launch import pdl_options
from ._state import (add_sink, attend_tiles, first_position, fp16_query, kv_bases, merge_tile, score_scales,
                     split_range)
from .._device import next_pow2
from ..heuristics import FP8_TWO_WARPS, ONE_WARP_CONFIGS, WIDE_FP8


@triton.jit
def row_heads(o_r, i_h64, GROUP_SIZE: tl.constexpr, Q_ROWS: tl.constexpr):
    """Query row ``o_r`` of KV head ``i_h64`` -> (new token, query head), int64: row ``r`` is token
    ``r // GROUP_SIZE`` and head ``i_h * GROUP_SIZE + r % GROUP_SIZE``."""
    if Q_ROWS == 1:
        return o_r.to(tl.int64) * 0, i_h64 * GROUP_SIZE + o_r
    else:
        return (o_r // GROUP_SIZE).to(tl.int64), i_h64 * GROUP_SIZE + o_r % GROUP_SIZE


@triton.jit
def _split_kv_kernel(
    Q, K, V, SEQ_LENS, BLOCK_TABLE, ROW_LIMITS, K_SCALE, V_SCALE, SINKS, O, LSE, WORK,
    sm_scale, k_scale, v_scale, cap, T_MAX, TILES_PER_SPLIT, HKV, NUM_PAGES, WINDOW,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oq, stride_oh,
    stride_lb, stride_lq, stride_lh,
    stride_sl, stride_btb, stride_btp, stride_rlb, stride_rlq, stride_rlx, stride_ksh, stride_vsh, stride_sink,
    GROUP_SIZE: tl.constexpr, Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, IS_PAGED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_ROW_LIMITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_SCALE: tl.constexpr,
    EXPORT: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_PAGES: tl.constexpr,
    PDL: tl.constexpr, STREAMS: tl.constexpr, PAGE_GATHER: tl.constexpr, PAGE_TILES: tl.constexpr,
    PAIR_V: tl.constexpr,
):
    if PDL:  # Note [Programmatic dependent launch]: nothing is read before the previous kernel is done
        gdc_wait()
    ROWS: tl.constexpr = Q_ROWS * GROUP_SIZE  # query rows per KV head
    N_RT: tl.constexpr = (ROWS + BLOCK_H - 1) // BLOCK_H  # row tiles
    ROWS_T: tl.constexpr = BLOCK_H if ROWS > BLOCK_H else ROWS  # rows of a full tile
    i_p = tl.program_id(0)
    i_s = tl.program_id(1)
    i_bh = i_p // N_RT
    i_rt = i_p % N_RT
    i_b = i_bh // HKV
    i_h = i_bh % HKV
    i_b64 = i_b.to(tl.int64)
    i_h64 = i_h.to(tl.int64)

    # The splits tile the keys any row may see, from the lowest one
    base = first_position(ROW_LIMITS, stride_rlb, stride_rlq, SEQ_LENS, stride_sl, i_b64, T_MAX, WINDOW, Q_ROWS,
                          HAS_SEQ_LENS, HAS_ROW_LIMITS, HAS_WINDOW)
    seq_len, chunk, t_start, t_end = split_range(SEQ_LENS, stride_sl, i_b64, i_s, T_MAX, TILES_PER_SPLIT,
                                                 BLOCK_N, HAS_SEQ_LENS, base)

    o_r = i_rt * BLOCK_H + tl.arange(0, BLOCK_H)  # query rows of this tile
    o_d = tl.arange(0, BLOCK_D)
    m_r = o_r < ROWS
    m_d = o_d < HEAD_DIM
    m_rd = m_r[:, None] & m_d[None, :]
    o_q, o_hq = row_heads(o_r, i_h64, GROUP_SIZE, Q_ROWS)

    b_q = tl.load(Q + i_b64 * stride_qb + (o_q * stride_qq + o_hq * stride_qh)[:, None] + o_d[None, :],
                  mask=m_rd, other=0.0)
    # Row i is the query at position seq_len - Q_ROWS + i: it sees positions < seq_len - Q_ROWS + 1 + i
    # (the drafts are causal among themselves) and, in a window, >= seq_len - Q_ROWS + i - WINDOW.
    row_hi = seq_len - Q_ROWS + 1 + o_q.to(tl.int32)
    row_lo = row_hi - 1 - WINDOW
    if HAS_ROW_LIMITS:  # [B, Q, 2]: (first, end) of the positions each row sees, on this shard
        p_rl = ROW_LIMITS + i_b64 * stride_rlb + o_q * stride_rlq
        row_lo = tl.load(p_rl, mask=m_r, other=0)
        row_hi = tl.load(p_rl + stride_rlx, mask=m_r, other=0)
    # FP8 cache: k_scale folds into the score scale, v_scale into o
    qk_scale, vs = score_scales(sm_scale, cap, K_SCALE, V_SCALE, k_scale, v_scale, i_h64, stride_ksh, stride_vsh,
                                SOFTCAP, KV_SCALE)
    b_q, qk_scale = fp16_query(b_q, qk_scale, KV_SCALE)
    p_k, p_v = kv_bases(K, V, i_b64, i_h64, stride_kb, stride_kh, stride_vb, stride_vh, IS_PAGED)
    b_o, b_lse = attend_tiles(b_q, row_lo, row_hi, p_k, p_v, stride_kt, stride_vt, BLOCK_TABLE + i_b64 * stride_btb,
                              stride_btp, stride_kb, stride_vb, NUM_PAGES, t_start, t_end, qk_scale, cap, o_d, m_d,
                              BLOCK_H, BLOCK_N, BLOCK_D, PAGE_SIZE, IS_PAGED, HAS_WINDOW or HAS_ROW_LIMITS,
                              IS_CAUSAL or HAS_ROW_LIMITS, SOFTCAP, INPUT_PRECISION, UPCAST, SPLIT_PAGES,
                              STREAMS=STREAMS, PAGE_GATHER=PAGE_GATHER, PAGE_TILES=PAGE_TILES, PAIR_V=PAIR_V)
    if PDL:  # the K/V reads are done: the next kernel may start its launch
        gdc_launch_dependents()
    if KV_SCALE != 0:
        b_o = b_o * vs

    if EXPORT:
        # Split-major states for _combine_kernel: slot i_s holds o [P * ROWS_T, HEAD_DIM] then lse
        # [P * ROWS_T] (Note [Split-KV decode]).
        n_rows = tl.num_programs(0).to(tl.int64) * ROWS_T
        o_rt = tl.arange(0, BLOCK_H)
        m_rt = (o_rt < ROWS_T) & m_r
        p_slot = WORK + i_s.to(tl.int64) * n_rows * (HEAD_DIM + 1)
        row0 = i_p.to(tl.int64) * ROWS_T
        tl.store(p_slot + (row0 + o_rt)[:, None] * HEAD_DIM + o_d[None, :], b_o, mask=m_rt[:, None] & m_d[None, :])
        tl.store(p_slot + n_rows * HEAD_DIM + row0 + o_rt, b_lse, mask=m_rt)
    else:
        if HAS_SINKS:
            b_o, b_lse = add_sink(b_o, b_lse, tl.load(SINKS + o_hq * stride_sink, mask=m_r, other=0.0))
        p_o = O + i_b64 * stride_ob + (o_q * stride_oq + o_hq * stride_oh)[:, None] + o_d[None, :]
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_rd)
        tl.store(LSE + i_b64 * stride_lb + o_q * stride_lq + o_hq * stride_lh, b_lse, mask=m_r)


@triton.jit
def _combine_kernel(
    WORK, SINKS, O, LSE,
    N_SLOTS, HKV,
    stride_ob, stride_oq, stride_oh, stride_lb, stride_lq, stride_lh, stride_sink,
    GROUP_SIZE: tl.constexpr, Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr, PDL: tl.constexpr, TRIGGER_EARLY: tl.constexpr,
):
    """Level 2 of the exported split states: program ``(i_p, i_r, i_d)`` merges row ``i_r`` of row tile
    ``i_p`` (a row tile of a (sequence, KV head), as in ``_split_kv_kernel``) over the ``N_SLOTS``
    split-major slots of ``WORK``, in slot order, ``BLOCK_S`` slots per load, then adds the sink once (Note
    [Level 2 in its own kernel]): head dims ``[i_d * BLOCK_D, (i_d + 1) * BLOCK_D)`` of ``o``, and the lse
    from chunk 0."""
    if PDL:  # the split kernel that wrote WORK is done (Note [Programmatic dependent launch])
        gdc_wait()
        if TRIGGER_EARLY:
            gdc_launch_dependents()
    ROWS: tl.constexpr = Q_ROWS * GROUP_SIZE
    N_RT: tl.constexpr = (ROWS + BLOCK_H - 1) // BLOCK_H
    ROWS_T: tl.constexpr = BLOCK_H if ROWS > BLOCK_H else ROWS
    i_p = tl.program_id(0)
    i_r = tl.program_id(1)
    i_bh = i_p // N_RT
    i_rt = i_p % N_RT
    i_b64 = (i_bh // HKV).to(tl.int64)
    i_h64 = (i_bh % HKV).to(tl.int64)
    i_d = tl.program_id(2)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    n_rows = tl.num_programs(0).to(tl.int64) * ROWS_T
    row0 = i_p.to(tl.int64) * ROWS_T  # the tile's first row in every slot
    o_g = i_r + tl.arange(0, 1)  # this program's row of the tile, as a one-row tile for merge_tile
    o_rg = i_rt * BLOCK_H + o_g
    m_g = o_rg < ROWS
    stride_slot = n_rows * (HEAD_DIM + 1)
    b_o, b_lse = merge_tile(WORK + n_rows * HEAD_DIM + row0, WORK + row0 * HEAD_DIM, N_SLOTS, stride_slot, 1,
                            stride_slot, HEAD_DIM, o_g, m_g, o_d, m_d, BLOCK_S, 1, BLOCK_D, "")
    o_q, o_h = row_heads(o_rg, i_h64, GROUP_SIZE, Q_ROWS)
    if HAS_SINKS:  # the sink joins once, after every split
        b_o, b_lse = add_sink(b_o, b_lse, tl.load(SINKS + o_h * stride_sink, mask=m_g, other=0.0))
    p_out = O + i_b64 * stride_ob + (o_q * stride_oq + o_h * stride_oh)[:, None] + o_d[None, :]
    tl.store(p_out, b_o.to(O.dtype.element_ty), mask=m_g[:, None] & m_d[None, :])
    if i_d == 0:  # the lse once a row, from the first chunk of the head dim
        tl.store(LSE + i_b64 * stride_lb + o_q * stride_lq + o_h * stride_lh, b_lse, mask=m_g)
    if PDL and not TRIGGER_EARLY:
        gdc_launch_dependents()


class RowTiling(NamedTuple):
    """How the ``Q_ROWS * GROUP_SIZE`` query rows of a KV head are tiled: ``n_rt`` tiles of ``block_h``
    rows (a full tile holds ``rows_t``)."""

    block_h: int
    n_rt: int
    rows_t: int


def row_tiling(q_rows: int, group: int, paired: bool = False, max_rows: int = 64) -> RowTiling:
    """Tiles of at most ``max_rows`` rows (64; the one-warp FP8 kernel's 16: :func:`kernel_rows`), 16 at least
    (the smallest ``tl.dot`` tile; 8 for ``paired`` rows, which the kernel doubles: Note [FP8 values in
    pairs])."""
    rows = q_rows * group
    block_h = max(8 if paired else 16, min(max_rows, next_pow2(rows)))
    return RowTiling(block_h, -(-rows // block_h), min(rows, block_h))


def exports(plan) -> bool:
    """Whether the split kernel of ``plan`` exports split states for ``_combine_kernel`` (several splits, or
    deterministic splits) instead of writing the output."""
    return plan.num_splits > 1 or plan.deterministic


def split_kv_launch_config(dtype, group: int, q_rows: int, head_dim: int, plan, *, has_seq_lens: bool,
                           page_size: int, causal: bool, row_limits: bool, kv_scale: int = 0, window: bool = False,
                           softcap: bool = False, sinks: bool = False, pdl: bool = False):
    """``(constexprs, launch options, row tiling)`` of the split-KV kernel for a
    :class:`~cp_attention.heuristics.DecodePlan`; ``page_size`` 0 for a dense cache. With several splits
    (or deterministic ones) it exports their states and ``_combine_kernel`` (:func:`combine_launch_config`)
    writes the output.

    The kernel's arguments, in order: ``q [B, Q, Hq, D]`` (unit stride in D); ``k``, ``v`` (a dense cache
    read as ``[B, Hkv, T, D]``, or page pools read as ``[pages, Hkv, page_size, D]``, through their
    strides, unit stride in D; FP8 with ``kv_scale`` 1 (scalar scales) or 2 (scale tensors)); ``seq_lens
    [B]``, ``block_table [B, max_pages]``, ``row_limits [B, Q, 2]`` (each row's first and end position on
    this cache), the K and V scale tensors, ``sinks [Hq]`` (any strides; any tensor when unused); ``o [B, Q,
    Hq, D]`` (any float dtype, unit stride in D) and ``lse [B, Q, Hq]`` float32 natural log, any strides;
    the fp32 workspace of the exported states (:func:`export_floats` elements); ``sm_scale``, ``k_scale``,
    ``v_scale``, the softcap times ``log2(e)``; then ``T_max``, the plan's tiles per split, ``Hkv``, the
    pool's pages, the window and the strides.
    ``pdl``: launched with programmatic dependent launch (Note [Programmatic dependent launch]; a CUDA
    device of compute capability 9 or more, never the interpreter).
    """
    paired = pairs_values(plan.config, kv_scale, q_rows * group)
    tiling = row_tiling(q_rows, group, paired, kernel_rows(plan.config))
    export = exports(plan)
    one_warp = plan.config in ONE_WARP_CONFIGS  # its splits start on a whole tile (Note [One-warp FP8 tiles])
    if plan.streams > 1 and (page_size or tiling.block_h != 16 or plan.config.block_n % (16 * plan.streams)):
        raise ValueError(f"plan: {plan.streams} key streams need a dense cache, query tiles of 16 rows and "
                         f"tiles of a multiple of {16 * plan.streams} keys")
    if plan.page_tiles and (page_size % plan.config.block_n or plan.split_pages):
        raise ValueError(f"plan: one table entry a tile needs pages of a multiple of {plan.config.block_n} "
                         f"positions (got {page_size}) and no entries in registers")
    constexprs = dict(GROUP_SIZE=group, Q_ROWS=q_rows, HEAD_DIM=head_dim, PAGE_SIZE=max(page_size, 1),
                      BLOCK_H=tiling.block_h, BLOCK_N=plan.config.block_n, BLOCK_D=next_pow2(head_dim),
                      HAS_SEQ_LENS=has_seq_lens, IS_PAGED=page_size > 0, IS_CAUSAL=causal, HAS_ROW_LIMITS=row_limits,
                      HAS_WINDOW=window, SOFTCAP=softcap, HAS_SINKS=sinks and not export, KV_SCALE=kv_scale,
                      EXPORT=export, **dot_flags(dtype),
                      SPLIT_PAGES=0 if window or row_limits or not page_size else plan.split_pages, PDL=pdl,
                      STREAMS=plan.streams, PAGE_GATHER=page_gather(plan.config, page_size),
                      PAGE_TILES=plan.page_tiles and page_size > 0 and (one_warp or not (window or row_limits)),
                      PAIR_V=plan.config.num_warps if paired else 0)
    return constexprs, split_kv_options(plan.config, pdl), tiling


def kernel_rows(config) -> int:
    """The most query rows a program of ``config`` takes: 16 a warp for the one-warp FP8 kernel (one
    ``m16n8k16`` row block each; more rows run as more row tiles, Note [One-warp FP8 tiles]), else 64."""
    return config.warp_rows * config.num_warps if config in ONE_WARP_CONFIGS else 64


def pairs_values(config, kv_scale: int, rows: int) -> bool:
    """Whether the split kernel runs ``p @ v`` over value pairs (``PAIR_V``, Note [FP8 values in pairs]): FP8
    caches (``kv_scale`` != 0) in :data:`~cp_attention.heuristics.WIDE_FP8`'s tiles (head dims over 128, dense
    or through the register table) read by at most 8 query rows per KV head, where it is faster; pools of one
    entry loaded a tile (``WIDE_FP8_TABLE_LOOP``) and head dim 128 do not gain (docs/tuning.md)."""
    return kv_scale != 0 and rows <= 8 and config == WIDE_FP8


def page_gather(config, page_size: int) -> bool:
    """Whether a split of ``config`` through the register table gathers a one-page tile's entry
    (``PAGE_GATHER``): the FP8 two-warp tiles, whose other programs on the SM hide the gather's round trip
    (Note [Paged tiles from registers]), and the head-dim-256 FP8 tiles on pages of one tile, where the
    where-and-sum spills (Triton 3.6, sm_90). On larger pages the gather was slower there (docs/tuning.md)."""
    return config == FP8_TWO_WARPS or (config == WIDE_FP8 and page_size == config.block_n)


def split_kv_options(config, pdl: bool) -> dict:
    """Triton launch options of the split-KV kernel for a :class:`~cp_attention.heuristics.DecodeConfig`:
    its warps and stages, its register cap (``maxnreg``, where the config sets one) and ``launch_pdl``."""
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.maxnreg:
        options["maxnreg"] = config.maxnreg
    return pdl_options(pdl, **options)


def combine_launch_config(group: int, q_rows: int, head_dim: int, sinks: bool, num_splits: int | None = None,
                          pdl: bool = False, packed: bool = False, max_rows: int = 64):
    """``(constexprs, launch options, (rows, d_chunks))`` of ``_combine_kernel``, launched on a grid ``(B * Hkv *
    n_rt, rows, d_chunks)``: one program per query row and chunk of the head dim, ``BLOCK_S`` states per load
    (at most 8192 fp32 in registers, 64 per thread). ``num_splits`` None: the deterministic splits, whose
    ``BLOCK_S`` only the model's shapes decide (Note [Deterministic splits]), the whole head dim a program;
    else ``num_splits`` (rounded up to a power of two, at most 256) at once, in ``d_chunks`` chunks of the head
    dim of at least 32 where the whole head dim does not fit (Note [Level 2 in its own kernel]). ``packed``:
    the split kernel's config packs several programs per SM (``DecodeConfig.programs``), so the combine lets
    the next kernel launch only after its stores (Note [Programmatic dependent launch]). ``max_rows``: the split
    kernel's row tiles (:func:`row_tiling`, :func:`kernel_rows`). Its arguments: the
    exported slots (fp32), ``sinks [Hq]`` (any tensor when unused), ``o``, ``lse`` as the split kernel's; the
    number of slots, ``Hkv`` and the strides.

    >>> [combine_launch_config(4, 1, 128, False, n)[::2] for n in (8, 64, 131)]  # doctest: +NORMALIZE_WHITESPACE
    [({'GROUP_SIZE': 4, 'Q_ROWS': 1, 'HEAD_DIM': 128, 'BLOCK_H': 16, 'BLOCK_D': 128, 'BLOCK_S': 8, 'HAS_SINKS': False,
       'PDL': False, 'TRIGGER_EARLY': True}, (4, 1)),
     ({'GROUP_SIZE': 4, 'Q_ROWS': 1, 'HEAD_DIM': 128, 'BLOCK_H': 16, 'BLOCK_D': 128, 'BLOCK_S': 64, 'HAS_SINKS': False,
       'PDL': False, 'TRIGGER_EARLY': True}, (4, 1)),
     ({'GROUP_SIZE': 4, 'Q_ROWS': 1, 'HEAD_DIM': 128, 'BLOCK_H': 16, 'BLOCK_D': 32, 'BLOCK_S': 256, 'HAS_SINKS': False,
       'PDL': False, 'TRIGGER_EARLY': True}, (4, 4))]
    """
    tiling = row_tiling(q_rows, group, max_rows=max_rows)
    block_d = next_pow2(head_dim)
    if num_splits is None:
        block_s = 8192 // block_d
    else:
        block_s = min(next_pow2(num_splits), 256)
        block_d = max(32, min(block_d, 8192 // block_s))
        block_s = min(block_s, 8192 // block_d)
    return (dict(GROUP_SIZE=group, Q_ROWS=q_rows, HEAD_DIM=head_dim, BLOCK_H=tiling.block_h, BLOCK_D=block_d,
                 BLOCK_S=block_s, HAS_SINKS=sinks, PDL=pdl, TRIGGER_EARLY=not packed), pdl_options(pdl, num_warps=4),
            (tiling.rows_t, -(-head_dim // block_d)))


def export_floats(batch: int, hkv: int, tiling: RowTiling, head_dim: int, num_splits: int) -> int:
    """fp32 elements of the exported split states (Note [Split-KV decode])."""
    return num_splits * batch * hkv * tiling.n_rt * tiling.rows_t * (head_dim + 1)


def _bqh(strides, multi: bool) -> tuple:
    """(batch, row, head) strides from the strides of ``[B, Q, H, ...]``, or of ``[B, H, ...]`` (row 0)."""
    return (strides[0], strides[1], strides[2]) if multi else (strides[0], 0, strides[1])


def decode_launchers(q, k, v, seq_lens, block_table, row_limits, sinks, scales, kv_layout: str, plan, o_strides,
                     lse_strides, *, hkv: int, q_rows: int, t_max: int, page_size: int, num_pages: int, kv_scale: int,
                     window_left, softcap: bool, device: int | None, pdl: bool):
    """``(split launcher, combine launcher or None, workspace floats)`` of one decode call: the split-KV kernel
    of ``plan`` (the one-warp FP8 kernel for its configs, ``ops/split_kv_fp8.py``) and, where it exports split
    states, :func:`_combine_kernel`, each a :class:`~cp_attention.ops._launch.Launcher` with its integer
    arguments (sizes, strides) bound. Tensor arguments as in :func:`split_kv_launch_config`; ``scales`` the
    ``(k_scale, v_scale)`` tensors for ``kv_scale == 2``; ``o_strides``/``lse_strides`` the strides of the
    output's ``[B, (Q,) Hq, D]`` and ``[B, (Q,) Hq]``; ``device`` the CUDA device index (None: the interpreter).
    """
    from ._launch import Launcher

    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    multi = q.dim() == 4
    group = hq // hkv
    ks, vs = k.stride(), v.stride()
    # The kernel reads k/v through (batch or page, KV head, position or slot) strides.
    if kv_layout == "NHD":
        ks, vs = (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1])
    constexprs, options, tiling = split_kv_launch_config(
        q.dtype, group, q_rows, d, plan, has_seq_lens=seq_lens is not None, page_size=page_size,
        causal=q_rows > 1 and row_limits is None, row_limits=row_limits is not None, kv_scale=kv_scale,
        window=window_left is not None and row_limits is None, softcap=softcap, sinks=sinks is not None, pdl=pdl)
    kernel = _split_kv_kernel
    if plan.config in ONE_WARP_CONFIGS:
        from .split_kv_fp8 import _split_kv_fp8_kernel

        kernel, constexprs = _split_kv_fp8_kernel, dict(constexprs, NUM_STAGES=plan.config.num_stages)
    grid = (b * hkv * tiling.n_rt, plan.num_splits)
    o_strides, lse_strides = _bqh(o_strides, multi), _bqh(lse_strides, multi)
    sink_stride = sinks.stride(0) if sinks is not None else 0
    int_args = (t_max, plan.tiles_per_split, hkv, num_pages, window_left or 0,
                *_bqh(q.stride(), multi), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], *o_strides, *lse_strides,
                seq_lens.stride(0) if seq_lens is not None else 0,
                *(block_table.stride() if block_table is not None else (0, 0)),
                *(row_limits.stride() if row_limits is not None else (0, 0, 0)),
                *((sc.stride(0) if sc.dim() else 0) if kv_scale == 2 else 0 for sc in scales), sink_stride)
    launcher = Launcher(kernel, grid, constexprs, device=device, static=int_args, **options)
    if not exports(plan):
        return launcher, None, 0
    c_constexprs, c_options, c_grid = combine_launch_config(
        group, q_rows, d, sinks is not None, None if plan.deterministic else plan.num_splits, pdl,
        plan.config.programs > 1, tiling.block_h)
    combine = Launcher(_combine_kernel, (grid[0], *c_grid), c_constexprs, device=device,
                       static=(plan.num_splits, hkv, *o_strides, *lse_strides, sink_stride), **c_options)
    return launcher, combine, export_floats(b, hkv, tiling, d, plan.num_splits)


def combine_exported(q, hkv: int, slots, n_slots: int, o, lse, sinks=None) -> None:
    """Merge ``n_slots`` exported deterministic split states (``slots``, fp32, split-major: several ranks'
    exports concatenated in rank order) into ``o`` (q's shape) and ``lse`` (``q.shape[:-1]``): the combine
    that ``flash_decode(split_size=...)`` runs, so the bits are the same (Note [Deterministic splits])."""
    from ._launch import launch

    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    q_rows = q.shape[1] if q.dim() == 4 else 1
    constexprs, options, c_grid = combine_launch_config(hq // hkv, q_rows, d, sinks is not None)
    multi = q.dim() == 4
    launch(_combine_kernel, (b * hkv * row_tiling(q_rows, hq // hkv).n_rt, *c_grid),
           (slots, q if sinks is None else sinks, o, lse, n_slots, hkv, *_bqh(o.stride(), multi),
            *_bqh(lse.stride(), multi), sinks.stride(0) if sinks is not None else 0), constexprs, **options)
