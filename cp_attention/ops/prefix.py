"""Shared-segment attention kernel for cascade decode: many requests' queries meet one K/V segment.

Note [Shared-segment attention as a prefill-shaped tile]
--------------------------------------------------------
A segment of a cascade level (a shared prompt prefix, or one group's shared context) is read by a set of
requests. For KV head ``i_h`` every query row ``(request, query head)`` of those requests with
``query head // GROUP_SIZE == i_h`` attends to the same keys, so the rows are stacked into the ``M``
dimension of a tile: ``BLOCK_M`` rows (requests × the ``GROUP_SIZE`` query heads of one KV head) meet each
``[BLOCK_N, D]`` K/V tile through ``tl.dot`` exactly like a prefill tile, and the segment's K/V bytes are
read once per row tile instead of once per request. The online softmax over the tiles is ⊕ level 1
(``softmax_tile``/``finalize`` from ``_state.py``).

Rows are numbered in the *segment-sorted* order: requests sorted by segment id, each expanded to its
``GROUP_SIZE`` heads, so a segment's rows are contiguous. A row tile never crosses a segment: the host
builds a table ``TILES [n_tiles, 3] = (segment, first sorted row, valid rows)`` and the permutation
``PERM`` (sorted position -> request). Tiles past the real count have 0 valid rows and do nothing. When
every request reads the one segment (``HAS_SEGMENTS=False``) the table is implicit: sorted row = request
* GROUP_SIZE + head.

Grid ``(n_tiles, n_splits, Hkv)``, row tiles fastest so the programs that read the same K/V tiles run
side by side and share them through L2. Split ``i_s`` covers tokens
``[i_s * CHUNK, (i_s + 1) * CHUNK) ∩ [0, seq_len)`` with ``CHUNK = TILES_PER_SPLIT * BLOCK_N``; it writes
one state per (request, query head) into slot ``i_s`` of an fp32 workspace ``[n_splits, B * Hq, D]`` (lse
natural log), an empty range giving the empty state (o = 0, lse = -inf). The splits and the other levels
are then merged with the merge kernel (``merge.py``); every workspace row of every slot is written, so
the workspace needs no initialisation.
"""
import triton
import triton.language as tl

from .._dispatch import next_pow2
from ._dot import dot_flags
from ._launch import launch
from ._state import LOG2E, attend_tiles, split_range


@triton.jit
def _prefix_kernel(
    Q, K, V, SEQ_LENS, PERM, TILES, O_PART, LSE_PART,
    sm_scale, T_MAX, TILES_PER_SPLIT, N_ROWS,
    stride_sl, stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kt,
    stride_vs, stride_vh, stride_vt,
    stride_os, stride_or, stride_ls,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
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
                                                 BLOCK_N, HAS_SEQ_LENS)
    t_end = tl.where(n_rows > 0, t_end, t_start)  # a padding tile reads nothing

    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < n_rows
    m_d = o_d < HEAD_DIM
    m_md = m_m[:, None] & m_d[None, :]
    o_row = row0 + o_m  # segment-sorted row: request slot * GROUP_SIZE + head in the group
    if HAS_SEGMENTS:
        o_req = tl.load(PERM + o_row // GROUP_SIZE, mask=m_m, other=0).to(tl.int64)
    else:
        o_req = (o_row // GROUP_SIZE).to(tl.int64)
    o_hq = i_h64 * GROUP_SIZE + o_row % GROUP_SIZE

    p_q = Q + o_req[:, None] * stride_qb + o_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_md, other=0.0)
    qk_scale = sm_scale * LOG2E

    p_k = K + i_seg * stride_ks + i_h64 * stride_kh
    p_v = V + i_seg * stride_vs + i_h64 * stride_vh
    b_o, b_lse = attend_tiles(b_q, p_k, p_v, stride_kt, stride_vt, t_start, t_end, qk_scale, o_d, m_d,
                               BLOCK_M, BLOCK_N, BLOCK_D, INPUT_PRECISION, UPCAST)

    o_out = o_req * n_hq + o_hq  # workspace row: request * Hq + query head
    i_s64 = i_s.to(tl.int64)
    p_o = O_PART + i_s64 * stride_os + o_out[:, None] * stride_or + o_d[None, :]
    tl.store(p_o, b_o, mask=m_md)
    tl.store(LSE_PART + i_s64 * stride_ls + o_out, b_lse, mask=m_m)


# Realistic sm_90 compiles of this file's kernel (bf16, D = 128, Hq/Hkv = 4), checked by tests/test_aot.py.
_PTRS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "SEQ_LENS": "*i32", "PERM": "*i64", "TILES": "*i32",
         "O_PART": "*fp32", "LSE_PART": "*fp32", "sm_scale": "fp32"}
AOT_SPECS = [
    {
        "kernel": _prefix_kernel,
        "signature": _PTRS,
        "constexprs": dict(GROUP_SIZE=4, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, BLOCK_D=128,
                           HAS_SEQ_LENS=has_seq_lens, HAS_SEGMENTS=has_segments,
                           INPUT_PRECISION="tf32", UPCAST=False),
        "options": {"num_warps": 8, "num_stages": 3},
    }
    for has_seq_lens, has_segments in ((False, False), (True, True))
]


def prefix_attention(q, k, v, seq_lens, perm, tiles, o_part, lse_part, *, sm_scale, plan):
    """Launch the shared-segment kernel; inputs were validated by :func:`cp_attention.cascade_decode`.

    ``q [B, Hq, D]``; ``k``/``v [S, Hkv, T, D]`` (unit stride in D); ``seq_lens [S]`` or ``None``;
    ``perm [B]`` int64 (segment-sorted position -> request) and ``tiles [n_tiles, 3]`` int32, or both
    ``None`` when the level has one segment read by every request; ``plan`` a
    :class:`cp_attention.heuristics.PrefixPlan`. Writes ``o_part [num_splits, B * Hq, D]`` float32 and
    ``lse_part [num_splits, B * Hq]`` float32 (natural log), unit stride in D.
    """
    batch, hq, head_dim = q.shape
    hkv, t_max = k.shape[1], k.shape[2]
    cfg = plan.config
    has_segments = tiles is not None
    launch(
        _prefix_kernel, (plan.n_tiles, plan.num_splits, hkv),
        (q, k, v, seq_lens if seq_lens is not None else q, perm if has_segments else q,
         tiles if has_segments else q, o_part, lse_part,
         float(sm_scale), t_max, plan.tiles_per_split, batch * (hq // hkv),
         seq_lens.stride(0) if seq_lens is not None else 0, q.stride(0), q.stride(1),
         k.stride(0), k.stride(1), k.stride(2),
         v.stride(0), v.stride(1), v.stride(2),
         o_part.stride(0), o_part.stride(1), lse_part.stride(0)),
        dict(GROUP_SIZE=hq // hkv, HEAD_DIM=head_dim,
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=next_pow2(head_dim),
             HAS_SEQ_LENS=seq_lens is not None, HAS_SEGMENTS=has_segments,
             **dot_flags(q.dtype)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
