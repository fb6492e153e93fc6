"""Shared-segment attention kernel for cascade decode: many requests' queries meet one K/V segment.

Note [Shared-segment attention as a prefill-shaped tile]
--------------------------------------------------------
A segment of a cascade level (a shared prompt prefix, or one group's shared context) is read by a set of
requests. For KV head ``i_h`` every query row ``(request, new token, query head)`` of those requests with
``query head // GROUP_SIZE == i_h`` attends to the same keys, so the rows are stacked into the ``M``
dimension of a tile: ``BLOCK_M`` rows (requests × the ``Q_ROWS`` new tokens × the ``GROUP_SIZE`` query
heads of one KV head) meet each ``[BLOCK_N, D]`` K/V tile through ``tl.dot`` exactly like a prefill tile,
and the segment's K/V bytes are read once per row tile instead of once per request. The online softmax
over the tiles is ⊕ level 1 (``attend_tiles`` from ``_state.py``). A segment is dense (``[S, Hkv, T, D]``
through its strides) or paged (``IS_PAGED``: pages of a pool through the segment's block-table row).
Rows see every key of a shared level; ``IS_CAUSAL`` applies the multi-row causal rule when the level is
the last one (row ``i`` sees positions ``< seq_len - Q_ROWS + 1 + i``).

Rows are numbered in the *segment-sorted* order: requests sorted by segment id, each expanded to its
``Q_ROWS * GROUP_SIZE`` rows, so a segment's rows are contiguous. A row tile never crosses a segment: the
host builds a table ``TILES [n_tiles, 3] = (segment, first sorted row, valid rows)`` and the permutation
``PERM`` (sorted position -> request). Tiles past the real count have 0 valid rows and do nothing. When
every request reads the one segment (``HAS_SEGMENTS=False``) the table is implicit: sorted row = request
* Q_ROWS * GROUP_SIZE + row within the request.

Grid ``(n_tiles, n_splits, Hkv)``, row tiles fastest so the programs that read the same K/V tiles run
side by side and share them through L2. Split ``i_s`` covers tokens
``[i_s * CHUNK, (i_s + 1) * CHUNK) ∩ [0, seq_len)`` with ``CHUNK = TILES_PER_SPLIT * BLOCK_N``; it writes
one state per (request, new token, query head) into slot ``i_s`` of an fp32 workspace ``[n_splits, B * Q
* Hq, D]`` (lse natural log), an empty range giving the empty state (o = 0, lse = -inf). The splits and
the other levels are then merged with the merge kernel (``merge.py``); every workspace row of every slot
is written, so the workspace needs no initialisation.
"""
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_wait

from .._device import next_pow2
from ._dot import dot_flags
from ._launch import Launcher, pdl_options
from ._state import attend_tiles, fp16_query, kv_bases, score_scales, split_range


@triton.jit
def _prefix_kernel(
    Q, K, V, SEQ_LENS, BLOCK_TABLE, PERM, TILES, K_SCALE, V_SCALE, O_PART, LSE_PART,
    sm_scale, k_scale, v_scale, cap, T_MAX, TILES_PER_SPLIT, N_ROWS, NUM_PAGES,
    stride_sl, stride_btb, stride_btp, stride_qb, stride_qq, stride_qh,
    stride_ks, stride_kh, stride_kt,
    stride_vs, stride_vh, stride_vt,
    stride_os, stride_or, stride_ls, stride_ksh, stride_vsh,
    GROUP_SIZE: tl.constexpr, Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_SEGMENTS: tl.constexpr, IS_PAGED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr, KV_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # Note [Programmatic dependent launch] (ops/split_kv.py): nothing is read before the kernel ahead is done
        gdc_wait()
    RPR: tl.constexpr = Q_ROWS * GROUP_SIZE  # rows per request and KV head
    i_t = tl.program_id(0)
    i_s = tl.program_id(1)
    i_h = tl.program_id(2)
    i_h64 = i_h.to(tl.int64)
    n_hq = tl.num_programs(2) * GROUP_SIZE

    if HAS_SEGMENTS:
        i_seg = tl.load(TILES + 3 * i_t).to(tl.int64)
        row0 = tl.load(TILES + 3 * i_t + 1)
        n_rows = tl.load(TILES + 3 * i_t + 2)
    else:
        i_seg = 0
        row0 = i_t * BLOCK_M
        n_rows = N_ROWS - row0
    seq_len, chunk, t_start, t_end = split_range(SEQ_LENS, stride_sl, i_seg, i_s, T_MAX, TILES_PER_SPLIT,
                                                 BLOCK_N, HAS_SEQ_LENS, 0)
    t_end = tl.where(n_rows > 0, t_end, t_start)  # a padding tile reads nothing

    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < n_rows
    m_d = o_d < HEAD_DIM
    m_md = m_m[:, None] & m_d[None, :]
    o_row = row0 + o_m  # segment-sorted row: request slot * RPR + query row * GROUP_SIZE + head in the group
    if HAS_SEGMENTS:
        o_req = tl.load(PERM + o_row // RPR, mask=m_m, other=0).to(tl.int64)
    else:
        o_req = (o_row // RPR).to(tl.int64)
    o_q = ((o_row % RPR) // GROUP_SIZE).to(tl.int64)
    o_hq = i_h64 * GROUP_SIZE + o_row % GROUP_SIZE

    p_q = Q + o_req[:, None] * stride_qb + o_q[:, None] * stride_qq + o_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_md, other=0.0)
    # FP8 segments: k_scale folds into the score scale, v_scale into o
    qk_scale, vs = score_scales(sm_scale, cap, K_SCALE, V_SCALE, k_scale, v_scale, i_h64, stride_ksh, stride_vsh,
                                SOFTCAP, KV_SCALE)
    b_q, qk_scale = fp16_query(b_q, qk_scale, KV_SCALE)
    row_lim = seq_len - Q_ROWS + 1 + o_q.to(tl.int32)  # the causal rule, when IS_CAUSAL

    p_k, p_v = kv_bases(K, V, i_seg, i_h64, stride_ks, stride_kh, stride_vs, stride_vh, IS_PAGED)
    b_o, b_lse = attend_tiles(b_q, row_lim, row_lim, p_k, p_v, stride_kt, stride_vt, BLOCK_TABLE + i_seg * stride_btb,
                              stride_btp, stride_ks, stride_vs, NUM_PAGES, t_start, t_end, qk_scale, cap, o_d, m_d,
                              BLOCK_M, BLOCK_N, BLOCK_D, PAGE_SIZE, IS_PAGED, False, IS_CAUSAL, SOFTCAP,
                              INPUT_PRECISION, UPCAST, RSUM_DOT=True)
    if KV_SCALE != 0:
        b_o = b_o * vs

    o_out = (o_req * Q_ROWS + o_q) * n_hq + o_hq  # workspace row: (request * Q + query row) * Hq + query head
    i_s64 = i_s.to(tl.int64)
    p_o = O_PART + i_s64 * stride_os + o_out[:, None] * stride_or + o_d[None, :]
    tl.store(p_o, b_o, mask=m_md)
    tl.store(LSE_PART + i_s64 * stride_ls + o_out, b_lse, mask=m_m)


def prefix_launcher(q, k, v, seq_lens, block_table, o_strides, lse_stride: int, *, plan, has_segments, kv_layout="HND",
                    causal=False, k_scale=None, v_scale=None, kv_scale=0, softcap=False, pdl=False, device=None):
    """A :class:`~cp_attention.ops._launch.Launcher` of the shared-segment kernel for one level of
    :func:`cp_attention.cascade_decode` (inputs validated there), its integer arguments bound from these
    tensors' shapes and strides. It takes ``(q, k, v, seq_lens or q, block_table or q, perm or q, tiles or q,
    k_scale or q, v_scale or q, o_part, lse_part, sm_scale, k_scale, v_scale, cap)``: tensors of the same
    shapes, strides and dtypes (or, after its first launch, their pointers through ``launch_ptrs``), the
    float FP8 scales (1.0 for tensor scales) and ``cap`` the softcap times ``log2(e)`` (1.0 without).

    ``q [B, Hq, D]`` or ``[B, Q, Hq, D]``; ``k``/``v``: segments ``[S, Hkv, T, D]`` (``kv_layout="HND"``) or
    ``[S, T, Hkv, D]``, or with ``block_table [S, max_pages]`` page pools ``[P, Hkv, page, D]`` / ``[P,
    page, Hkv, D]`` (unit stride in D); ``seq_lens [S]`` or ``None``; ``has_segments``: the level's requests
    read its segments through ``perm [B]`` int64 (segment-sorted position -> request) and ``tiles [n_tiles,
    3]`` int32, else every request reads its one segment; ``plan`` a
    :class:`cp_attention.heuristics.PrefixPlan`; ``causal``: the causal rule of multi-row queries on this
    level; FP8 segments: ``kv_scale`` 1 (float scales) or 2 (0-d / ``[Hkv]`` float32 tensors ``k_scale``,
    ``v_scale``); ``softcap``: scores ``c * tanh(s / c)``. The kernel writes ``o_part [num_splits, B * Q *
    Hq, D]`` float32 and ``lse_part [num_splits, B * Q * Hq]`` float32 (natural log), unit stride in D, of
    (split, row) strides ``o_strides`` and split stride ``lse_stride``.
    ``pdl``: launched with programmatic dependent launch (compute capability 9.0 or more; see Note
    [Cascade attention]). ``device``: the CUDA device index, ``None`` under the interpreter.
    """
    batch, hq, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    q_rows = q.shape[1] if q.dim() == 4 else 1
    paged = block_table is not None
    if kv_layout == "HND":
        hkv, t_dim = k.shape[1], 2
        ks, vs = k.stride()[:3], v.stride()[:3]
    else:
        hkv, t_dim = k.shape[2], 1
        ks, vs = (k.stride(0), k.stride(2), k.stride(1)), (v.stride(0), v.stride(2), v.stride(1))
    page_size = k.shape[t_dim] if paged else 1
    t_max = block_table.shape[1] * page_size if paged else k.shape[t_dim]
    qs = q.stride()
    q_strides = (qs[0], qs[1], qs[2]) if q.dim() == 4 else (qs[0], 0, qs[1])
    tensors = kv_scale == 2
    scale_strides = [(sc.stride(0) if sc.dim() else 0) if tensors else 0 for sc in (k_scale, v_scale)]
    constexprs, options = prefix_launch_config(
        q.dtype, hq // hkv, q_rows, head_dim, page_size, plan.config, has_seq_lens=seq_lens is not None,
        has_segments=has_segments, paged=paged, causal=causal, softcap=softcap, kv_scale=kv_scale, pdl=pdl)
    static = (t_max, plan.tiles_per_split, batch * q_rows * (hq // hkv), k.shape[0] if paged else 0,
              seq_lens.stride(0) if seq_lens is not None else 0, *(block_table.stride() if paged else (0, 0)),
              *q_strides, *ks, *vs, *o_strides, lse_stride, *scale_strides)
    return Launcher(_prefix_kernel, (plan.n_tiles, plan.num_splits, hkv), constexprs, device=device, static=static,
                    **options)


def prefix_launch_config(dtype, group: int, q_rows: int, head_dim: int, page_size: int, cfg, *, has_seq_lens: bool,
                         has_segments: bool, paged: bool, causal: bool, softcap: bool, kv_scale: int,
                         pdl: bool = False) -> tuple:
    """``(constexprs, options)`` of :func:`_prefix_kernel` for a :class:`~cp_attention.heuristics.PrefixConfig`
    ``cfg`` (``page_size`` 1 for a dense level); ``pdl``: programmatic dependent launch."""
    return (dict(GROUP_SIZE=group, Q_ROWS=q_rows, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=next_pow2(head_dim),
                 HAS_SEQ_LENS=has_seq_lens, HAS_SEGMENTS=has_segments, IS_PAGED=paged,
                 IS_CAUSAL=causal and q_rows > 1, SOFTCAP=softcap, KV_SCALE=kv_scale, **dot_flags(dtype), PDL=pdl),
            pdl_options(pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
