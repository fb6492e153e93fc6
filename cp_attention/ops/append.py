"""Triton kernel for ``CPKVCache.append``: the new tokens of every sequence stored on their owner rank, and the
cache's lengths advanced, in one launch."""
import triton
import triton.language as tl

from .._device import next_pow2
from ._launch import launch


@triton.jit
def _append_kernel(
    K_NEW, V_NEW, K, V, BLOCK_TABLE, SEQ_LENS, GLOBAL_SEQ_LENS,
    N_NEW, RANK, WORLD, CAPACITY, PAGE_SIZE, N_HEADS,
    stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh,
    stride_row, stride_slot, stride_head, stride_btb, stride_btp,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
):
    # Program i_b owns sequence i_b: its lengths are read and written by no other program.
    i_b = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_hd = (o_h < N_HEADS)[:, None] & (o_d < HEAD_DIM)[None, :]
    o_kn = i_b * stride_knb + o_h[:, None] * stride_knh + o_d[None, :]
    o_vn = i_b * stride_vnb + o_h[:, None] * stride_vnh + o_d[None, :]
    o_c = o_h[:, None] * stride_head + o_d[None, :]
    b_len = tl.load(GLOBAL_SEQ_LENS + i_b)
    b_owned = tl.zeros([], dtype=tl.int32)
    j = 0
    while j < N_NEW:  # a while loop: Note [Loops under the interpreter] (ops/_state.py)
        p = b_len + j  # global position; local slot p // WORLD on rank p % WORLD
        s = p // WORLD
        if (p % WORLD == RANK) & (s < CAPACITY):
            if PAGED:
                page = tl.load(BLOCK_TABLE + i_b * stride_btb + (s // PAGE_SIZE) * stride_btp).to(tl.int64)
                o_row = page * stride_row + (s % PAGE_SIZE) * stride_slot
            else:
                o_row = i_b * stride_row + s * stride_slot
            b_k = tl.load(K_NEW + o_kn + j * stride_knn, mask=m_hd)
            b_v = tl.load(V_NEW + o_vn + j * stride_vnn, mask=m_hd)
            tl.store(K + o_row + o_c, b_k, mask=m_hd)
            tl.store(V + o_row + o_c, b_v, mask=m_hd)
            b_owned += 1
        j += 1
    tl.store(SEQ_LENS + i_b, tl.load(SEQ_LENS + i_b) + b_owned)
    tl.store(GLOBAL_SEQ_LENS + i_b, b_len + N_NEW)


def append_tokens(k_new, v_new, k, v, block_table, seq_lens, global_seq_lens, rank, world_size, capacity) -> None:
    """Launch the append kernel (one program per sequence; no host sync, nothing allocated).

    ``k_new``, ``v_new`` ``[B, n, Hkv, D]``: the ``n`` new tokens of every sequence, in the cache's dtype
    (float16, bfloat16, float32 or FP8), unit stride in D. Global position ``p = global_seq_lens[b] + j`` of
    token ``j`` goes to local slot ``s = p // world_size`` when ``p % world_size == rank`` and ``s <
    capacity``, else nowhere. ``k``, ``v``: the dense shard ``[B, Hkv, capacity, D]`` (``block_table``
    ``None``), or page pools ``[num_pages, page_size, Hkv, D]`` where slot ``s`` of sequence ``b`` is row
    ``s % page_size`` of page ``block_table[b, s // page_size]`` (``block_table [B, pages]`` int32); ``k``
    and ``v`` share their strides, unit stride in D. Then ``seq_lens [B]`` int32 grows by the tokens stored
    and ``global_seq_lens [B]`` int64 by ``n`` (both unit stride). Inputs are validated by
    :meth:`cp_attention.distributed.CPKVCache.append`.
    """
    b, n, hkv, d = k_new.shape
    paged = block_table is not None
    if paged:
        page_size, stride_row, stride_slot, stride_head = k.shape[1], k.stride(0), k.stride(1), k.stride(2)
        stride_bt = block_table.stride()
    else:
        page_size, stride_row, stride_head, stride_slot = 1, k.stride(0), k.stride(1), k.stride(2)
        stride_bt = (0, 0)
    constexprs, options = append_launch_config(hkv, d, paged)
    launch(
        _append_kernel, (b,),
        (k_new, v_new, k, v, block_table if paged else seq_lens, seq_lens, global_seq_lens,
         n, rank, world_size, capacity, page_size, hkv,
         *k_new.stride()[:3], *v_new.stride()[:3], stride_row, stride_slot, stride_head, *stride_bt),
        constexprs, **options,
    )


def append_launch_config(hkv: int, d: int, paged: bool) -> tuple:
    """``(constexprs, options)`` of :func:`_append_kernel` for ``hkv`` KV heads of head dim ``d``."""
    block_h, block_d = next_pow2(hkv), next_pow2(d)
    return (dict(HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, PAGED=paged),
            dict(num_warps=4 if block_h * block_d >= 1024 else 1))
