"""Triton kernel for ⊕ across the GPUs of one host over symmetric memory: push, signal, wait, merge.

Note [Symmetric-memory merge]
-----------------------------
Every rank of a group owns one buffer of a symmetric allocation (``torch.distributed._symmetric_memory``:
the same size on every rank, each rank's buffer mapped into every peer's address space over NVLink P2P)
laid out as 32-bit words:

* ``data [W, M, D + 1]`` float32: slot ``r`` holds rank ``r``'s packed states (``o`` then ``lse``) of the
  ``M`` rows (query heads of every request);
* ``flags [2, P, W]`` int32: ``ready[p, r]`` and ``done[p, r]`` for each of the ``P`` programs and ranks.

The local attention writes this rank's states straight into its own slot of its own buffer. Then one
kernel, program ``p`` owning rows ``[p * BLOCK_M, (p + 1) * BLOCK_M)``, on every rank ``me``:

1. for every peer ``r``: wait until ``done[p, r]`` of its own buffer is 1 and set it to 0 (peer ``r`` has
   finished reading what ``me`` pushed in the previous call), then store its rows of slot ``me`` into slot
   ``me`` of peer ``r``'s buffer;
2. a block barrier, then set ``ready[p, me]`` of every peer's buffer to 1 with a release at system scope
   (the barrier orders the block's stores before the release);
3. for every peer ``r``: wait until ``ready[p, r]`` of its own buffer is 1 (acquire, system scope) and set
   it to 0, then a block barrier;
4. ⊕ of the ``W`` slots of its rows in rank order (loads that bypass L1: the bytes came over NVLink), the
   sinks once, the result in q's dtype;
5. a block barrier, then set ``done[p, me]`` of every peer's buffer to 1: this rank has read its data.

Each flag has one writer that sets it (1) and one reader that consumes it (0), and every set happens after
the previous consume (a ready flag is set after the done wait that follows its reader's consume; a done
flag after the ready wait that follows its reader's consume), so no counter or epoch is needed and the
same kernel replays in a CUDA graph forever. The buffers start with ``ready = 0`` and ``done = 1``. There
is no host synchronisation and no collective launch: one kernel, one NVLink store and one flag round trip.
Every rank merges the same ``W`` states in the same order with the same code, so the results are bitwise
identical on every rank. Spinning programs only wait for their counterparts on the peers, never for a
program of their own GPU, so no co-residency beyond one program per rank is assumed.
"""
import triton
import triton.language as tl

from .._dispatch import cdiv, next_pow2
from ._launch import launch
from ._state import add_sink, merge_tile


@triton.jit
def _peer(BUF_PTRS, r):
    """The base (32-bit words) of rank ``r``'s buffer, from the device table of buffer addresses."""
    return tl.load(BUF_PTRS + r).to(tl.pointer_type(tl.float32))


@triton.jit
def _set_flag(p_flag):
    """Set a flag that its reader consumed: a release store at system scope."""
    tl.atomic_xchg(p_flag, 1, sem="release", scope="sys")


@triton.jit
def _consume_flag(p_flag):
    """Wait until a flag is set, then reset it: acquire at system scope."""
    while tl.atomic_cas(p_flag, 1, 0, sem="acquire", scope="sys") != 1:
        pass


@triton.jit
def _symm_merge_kernel(
    BUF_PTRS, SINKS, O_OUT, LSE_OUT,
    rank, M, N_HEADS, stride_oom, stride_lom, stride_sink,
    WORLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_F: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    ROW: tl.constexpr = HEAD_DIM + 1
    i_m = i_p.to(tl.int64) * BLOCK_M
    n_rows = tl.minimum(M - i_m, BLOCK_M)
    slot = M.to(tl.int64) * ROW  # words per slot
    p_mine = _peer(BUF_PTRS, rank)
    p_flags = (p_mine + WORLD * slot).to(tl.pointer_type(tl.int32))  # this rank's flags
    o_f = tl.arange(0, BLOCK_F)
    m_f = o_f < n_rows * ROW
    # 1. push this rank's rows into slot `rank` of every peer, once the peer has read the last ones
    b_x = tl.load(p_mine + rank * slot + i_m * ROW + o_f, mask=m_f)
    for r in tl.static_range(WORLD):
        if r != rank:
            _consume_flag(p_flags + (n_p + i_p) * WORLD + r)
            tl.store(_peer(BUF_PTRS, r) + rank * slot + i_m * ROW + o_f, b_x, mask=m_f)
    # 2. publish: the block's stores, then ready[i_p, rank] on every peer
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != rank:
            p_peer_flags = (_peer(BUF_PTRS, r) + WORLD * slot).to(tl.pointer_type(tl.int32))
            _set_flag(p_peer_flags + i_p * WORLD + rank)
    # 3. wait for every peer's rows
    for r in tl.static_range(WORLD):
        if r != rank:
            _consume_flag(p_flags + i_p * WORLD + r)
    tl.debug_barrier()
    # 4. ⊕ over the slots in rank order, the sinks once
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_r = o_r < n_rows
    m_d = o_d < HEAD_DIM
    p_rows = p_mine + i_m * ROW
    b_o, b_lse = merge_tile(p_rows + HEAD_DIM, p_rows, WORLD, slot, ROW, slot, ROW, o_r, m_r, o_d, m_d,
                            BLOCK_S, BLOCK_M, BLOCK_D, ".cv")
    if HAS_SINKS:  # row m is query head m % N_HEADS
        b_o, b_lse = add_sink(b_o, b_lse, tl.load(SINKS + ((i_m + o_r) % N_HEADS) * stride_sink, mask=m_r, other=0.0))
    tl.store(O_OUT + (i_m + o_r)[:, None] * stride_oom + o_d[None, :], b_o.to(O_OUT.dtype.element_ty),
             mask=m_r[:, None] & m_d[None, :])
    tl.store(LSE_OUT + (i_m + o_r) * stride_lom, b_lse, mask=m_r)
    # 5. this rank has read its slots: the peers may push the next call's rows
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != rank:
            p_peer_flags = (_peer(BUF_PTRS, r) + WORLD * slot).to(tl.pointer_type(tl.int32))
            _set_flag(p_peer_flags + (n_p + i_p) * WORLD + rank)


def symm_plan(m: int, d: int, world: int):
    """``(programs, BLOCK_M)`` for ``m`` rows of head dim ``d`` over ``world`` ranks: at most 128 programs,
    each a power-of-two number of rows."""
    block_m = next_pow2(cdiv(m, 128))
    return cdiv(m, block_m), block_m


def flag_words(m: int, d: int, world: int) -> int:
    """Words of flags after the data of a buffer (``[2, P, W]`` int32, see the Note)."""
    return 2 * symm_plan(m, d, world)[0] * world


def symm_merge_into(buf_ptrs, rank, world, m, d, o_out, lse_out, sinks=None) -> None:
    """Launch the exchange-and-merge kernel of Note [Symmetric-memory merge].

    ``buf_ptrs [W]`` int64 (device): every rank's buffer address; this rank's packed states ``[M, D + 1]``
    float32 are in its slot ``rank``. Writes ``o_out [M, D]`` (any float dtype, unit stride in D) and
    ``lse_out [M]`` float32 natural log; ``sinks [H]`` float32 join once (row ``m`` is head ``m % H``). Every
    rank of the group must launch it with the same ``m``, ``d`` and ``world``; callers validate.
    """
    programs, block_m = symm_plan(m, d, world)
    has_sinks = sinks is not None
    launch(
        _symm_merge_kernel, (programs,),
        (buf_ptrs, sinks if has_sinks else lse_out, o_out, lse_out, rank, m,
         sinks.shape[0] if has_sinks else 1, o_out.stride(0), lse_out.stride(0), sinks.stride(0) if has_sinks else 0),
        dict(WORLD=world, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=next_pow2(d), BLOCK_F=next_pow2(block_m * (d + 1)),
             BLOCK_S=next_pow2(world), HAS_SINKS=has_sinks),
        num_warps=4,
    )


# Realistic sm_90 compiles of this file's kernel, checked on the CPU by tests/test_aot.py.
AOT_SPECS = [
    {
        "kernel": _symm_merge_kernel,
        "signature": {"BUF_PTRS": "*i64", "SINKS": "*fp32", "O_OUT": "*bf16", "LSE_OUT": "*fp32"},
        "constexprs": {"WORLD": world, "HEAD_DIM": 128, "BLOCK_M": 1, "BLOCK_D": 128, "BLOCK_F": 256,
                       "BLOCK_S": next_pow2(world), "HAS_SINKS": sinks},
        "options": {"num_warps": 4},
    }
    for world, sinks in ((2, False), (8, True))
]
