"""Split-KV decode kernel (⊕ levels 1 and 2) with the combine fused in.

Note [Split-KV decode with a fused combine]
-------------------------------------------
Grid ``(B * Hkv, S)``. Program ``(i_bh, i_s)`` owns KV head ``i_h`` of sequence ``i_b`` and the token
range ``[i_s * CHUNK, (i_s + 1) * CHUNK) ∩ [0, seq_len)`` with ``CHUNK = TILES_PER_SPLIT * BLOCK_N``.
The ``GROUP_SIZE`` query heads that read this KV head are packed into the ``BLOCK_H`` rows of one tile
(pack-GQA), so each K/V tile is loaded once per group and meets the queries through ``tl.dot``.
Level 1: the online softmax over ``BLOCK_N`` tiles (``softmax_tile``). An empty range leaves the
state empty (o = 0, lse = -inf).

With one split the program writes the output directly. With several, it writes its state to an fp32
workspace ``[S, B * Hq, D]`` (lse base 2), then takes a ticket from a per-(b, kv-head) counter with an
acq_rel atomic: the program that draws the last ticket merges the states of the non-empty splits
(level 2, ``add_state``) and resets the counter to 0, so the next call (or CUDA-graph replay) starts
clean. One launch, no host synchronisation, no value-dependent allocation. The split layout depends on
``T_max`` only; ``seq_lens`` are read on the device.
"""
import torch
import triton
import triton.language as tl

from .. import _dispatch
from .._dispatch import next_pow2
from ._dot import dot_flags
from ._launch import launch
from ._state import LN2, LOG2E, attend_tiles, split_range, merge_strided


@triton.jit
def _split_kv_kernel(
    Q, K, V, SEQ_LENS, O, LSE, O_PART, COUNTER,
    sm_scale, T_MAX, TILES_PER_SPLIT, NUM_SPLITS, HKV,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, IS_SPLIT: tl.constexpr, FUSE_COMBINE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_s = tl.program_id(1)
    i_b = i_bh // HKV
    i_h = i_bh % HKV
    i_b64 = i_b.to(tl.int64)
    i_h64 = i_h.to(tl.int64)

    seq_len, chunk, t_start, t_end = split_range(SEQ_LENS, i_b, i_s, T_MAX, TILES_PER_SPLIT, BLOCK_N,
                                                 HAS_SEQ_LENS)

    o_g = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < GROUP_SIZE
    m_d = o_d < HEAD_DIM
    m_gd = m_g[:, None] & m_d[None, :]
    o_hq = i_h64 * GROUP_SIZE + o_g  # query heads of this KV head

    p_q = Q + i_b64 * stride_qb + o_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_gd, other=0.0)
    qk_scale = sm_scale * LOG2E

    p_k = K + i_b64 * stride_kb + i_h64 * stride_kh
    p_v = V + i_b64 * stride_vb + i_h64 * stride_vh
    b_o, b_lse2 = attend_tiles(b_q, p_k, p_v, stride_kt, stride_vt, t_start, t_end, qk_scale, o_d, m_d,
                               BLOCK_H, BLOCK_N, BLOCK_D, INPUT_PRECISION, UPCAST)

    p_o = O + i_b64 * stride_ob + o_hq[:, None] * stride_oh + o_d[None, :]
    p_lse = LSE + i_b64 * (HKV * GROUP_SIZE) + o_hq
    if IS_SPLIT:
        # Workspace: o [S, B * Hq, D] then lse [S, B * Hq] (base 2); row = b * Hq + query head.
        n_rows = tl.num_programs(0).to(tl.int64) * GROUP_SIZE
        LSE_PART = O_PART + NUM_SPLITS * n_rows * HEAD_DIM
        o_row = i_b64 * (HKV * GROUP_SIZE) + o_hq
        tl.store(O_PART + (i_s * n_rows + o_row)[:, None] * HEAD_DIM + o_d[None, :], b_o, mask=m_gd)
        tl.store(LSE_PART + i_s * n_rows + o_row, b_lse2, mask=m_g)
        if FUSE_COMBINE:
            tl.debug_barrier()
            ticket = tl.atomic_add(COUNTER + i_bh, 1, sem="acq_rel", scope="gpu")
            if ticket == NUM_SPLITS - 1:
                # Last program of this (b, kv head): merge the non-empty splits (level 2), one query
                # head at a time, BLOCK_S splits per load.
                n_valid = tl.cdiv(seq_len, chunk)
                row0 = i_b64 * (HKV * GROUP_SIZE) + i_h64 * GROUP_SIZE
                for g in range(GROUP_SIZE):
                    b_og, b_lse2g = merge_strided(LSE_PART + row0 + g, O_PART + (row0 + g) * HEAD_DIM,
                                                  n_rows, n_rows * HEAD_DIM, n_valid, o_d, m_d,
                                                  1.0, BLOCK_S, BLOCK_D, ".cg")
                    p_og = O + i_b64 * stride_ob + (i_h64 * GROUP_SIZE + g) * stride_oh + o_d[None, :]
                    tl.store(p_og, b_og.to(O.dtype.element_ty), mask=m_d[None, :])
                    tl.store(LSE + row0 + g + tl.arange(0, 1), b_lse2g * LN2)
                tl.atomic_xchg(COUNTER + i_bh, 0)
    else:
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_gd)
        tl.store(p_lse, b_lse2 * LN2, mask=m_g)


_COUNTERS: dict = {}


def _counter(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` tickets; the kernel leaves it zeroed.

    Kept per (device, stream): two decodes in flight on different streams must not share tickets.
    """
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def default_config(head_dim: int, dtype: torch.dtype) -> tuple:
    """Kernel tile config ``(BLOCK_N, num_warps, num_stages)``: tuned on the H200, see benchmarks/NOTES.md."""
    if dtype == torch.float32:
        return (64, 4, 2) if head_dim <= 128 else (32, 4, 2)
    return (128, 4, 3) if head_dim <= 128 else (64, 4, 2)


def split_kv_decode(q, k, v, seq_lens, o, lse, *, sm_scale, num_splits, tiles_per_split,
                    config, fuse_combine=True):
    """Launch the split-KV kernel on ``k``/``v`` viewed as ``[B, Hkv, T, D]`` (any strides, unit stride in
    D); inputs were validated by :func:`cp_attention.flash_decode`.

    Writes ``o [B, Hq, D]`` (q.dtype) and ``lse [B, Hq]`` (float32, natural log). With
    ``fuse_combine=False`` and ``num_splits > 1`` it returns the workspace ``(o_part [S, B*Hq, D],
    lse_part [S, B*Hq] base 2)`` for a separate merge instead of writing ``o``/``lse``.
    """
    batch, hq, head_dim = q.shape
    hkv, t_max = k.shape[1], k.shape[2]
    block_n, num_warps, num_stages = config
    is_split = num_splits > 1
    if is_split:
        rows = num_splits * batch * hq
        work = _dispatch.new_buffer((rows * (head_dim + 1),), torch.float32, q.device)
        counter = _counter(q.device, batch * hkv)
    else:
        work = counter = o  # unused
    group = hq // hkv
    launch(
        _split_kv_kernel, (batch * hkv, num_splits),
        (q, k, v, seq_lens if seq_lens is not None else q, o, lse, work, counter,
         sm_scale, t_max, tiles_per_split, num_splits, hkv,
         *q.stride()[:2], *k.stride()[:3], *v.stride()[:3], *o.stride()[:2]),
        dict(GROUP_SIZE=group, HEAD_DIM=head_dim,
             BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n,
             BLOCK_D=next_pow2(head_dim), BLOCK_S=min(32, next_pow2(num_splits)),
             HAS_SEQ_LENS=seq_lens is not None, IS_SPLIT=is_split, FUSE_COMBINE=fuse_combine,
             **dot_flags(q.dtype)),
        num_warps=num_warps, num_stages=num_stages,
    )
    if is_split and not fuse_combine:
        o_part = work[: rows * head_dim].view(num_splits, batch * hq, head_dim)
        return o_part, work[rows * head_dim:].view(num_splits, batch * hq)
    return None


# Realistic sm_90 compiles of this file's kernels, checked on the CPU by tests/test_aot.py.
_PTRS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "SEQ_LENS": "*i32", "O": "*bf16", "LSE": "*fp32",
         "O_PART": "*fp32", "COUNTER": "*i32", "sm_scale": "fp32"}
AOT_SPECS = [
    {
        "kernel": _split_kv_kernel,
        "signature": _PTRS,
        "constexprs": dict(GROUP_SIZE=group, HEAD_DIM=128, BLOCK_H=16, BLOCK_N=128, BLOCK_D=128, BLOCK_S=16,
                           HAS_SEQ_LENS=True, IS_SPLIT=split, FUSE_COMBINE=True,
                           INPUT_PRECISION="tf32", UPCAST=False),
        "options": {"num_warps": 4, "num_stages": 3},
    }
    for group, split in ((4, True), (5, False))
]
