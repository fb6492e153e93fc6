"""Triton kernel for ⊕ across the GPUs of one host over symmetric memory: pushes with flags, then the merge.

Note [Symmetric-memory merge]
-----------------------------
Every rank of a group owns one buffer of a symmetric allocation (``torch.distributed._symmetric_memory``:
the same size on every rank, each rank's buffer mapped into every peer's address space over NVLink P2P)
laid out as:

* ``own [M, D + 1]`` float32 (padded to an even number of words): this rank's packed states (``o`` then
  ``lse``) of the ``M`` rows (query heads of every request), written there by the local attention;
* ``recv [2, W, M, D + 1]`` 64-bit words: in half ``e % 2``, slot ``r`` receives rank ``r``'s states of
  call ``e``, each 32-bit value in the low half of a word whose high half is ``e`` (the flag travels with
  the data, as in NCCL's LL protocol);
* ``epoch [P]`` int32: how many calls program ``p`` of this rank has made (only that program reads it);
* ``flags [W, P]`` int32: ``flags[r, p]``, the last call whose rows program ``p`` of rank ``r`` has put
  into this rank's ``recv`` with the bulk protocol.

One kernel, program ``p`` owning rows ``[p * BLOCK_M, (p + 1) * BLOCK_M)``, on every rank ``me``, call
``e = epoch[p] + 1``:

1. read its rows of ``own`` and store them, each value with ``e`` as its flag, into slot ``me`` of half
   ``e % 2`` of every rank's ``recv`` (its own included): relaxed stores at system scope, one 8-byte store
   per value, which a reader sees whole or not at all; nothing is waited for;
2. load its rows of the ``W`` slots of its own half ``e % 2`` (volatile loads) until every word carries
   flag ``e``: the data came with its flag, so no fence, release or second round trip is needed. Each
   thread spins on the words it holds, on its own (``_await_flag``). A loop whose exit is a reduction over
   the program must not be used here: Triton assumes that threads holding copies of one element hold the
   same value and reduces such copies within a warp only, so warps that load a word at different times
   leave such a loop in different iterations and the program hangs at its next barrier (intermittently,
   when one rank comes late);
3. ⊕ of the ``W`` states in rank order, the sinks once, the result in q's dtype; after a barrier (every
   warp has read ``epoch[p]``), ``epoch[p] = e``.

That is the protocol for latency: no fence and no second trip, at twice the bytes. Merges of
:data:`BULK_MIN_ROWS` rows or more (a cascade of 128 requests: 4096 rows, 2.1 MB of states per rank) are
bound by the bytes instead, and take the bulk protocol, the same buffer with each slot's first half read as
``[M, D + 1]`` float32:

1. store its rows as plain float32 into slot ``me`` of half ``e % 2`` of every peer's ``recv``; a
   barrier, then thread 0 makes one system-scope fence (cumulative: it orders every store of the program
   that the barrier ordered before it) and stores ``flags[me, p] = e`` on every peer (relaxed, system
   scope). One fence a program, not a fence in every thread with a release store after it: every
   ``st.release.sys`` is one more system-scope fence (slower at 4096 rows: docs/tuning.md);
2. every thread waits, on its own (acquire loads at system scope, as above no reduction), until
   ``flags[r, p] - e >= 0`` for every peer ``r``, then loads the peers' slots and its own rows (from
   ``own``) past L1 (``.cg``);
3. as above.

**The push in the producer** (:func:`push_rows`). The kernel that computes the states -- the merge of
a cascade's levels -- can store them itself: each of its programs stores its rows into ``own`` and, as
float32, into slot ``me`` of half ``e % 2`` of every peer's ``recv`` (``e``: one more than ``epoch`` of the
exchange program that owns the rows, read from this rank's buffer), and exits: no fence, no flag. The
exchange kernel (``PUSHED``) then skips only the stores of step 1: it waits for the producer's grid
(``griddepcontrol.wait``: its writes are performed and visible to this grid), then thread 0's fence is
cumulative over them and its relaxed flag publishes them, as in the bulk protocol. The 2.1 MB cross
NVLink while the merge still runs, and no program of the producer waits on a fence (a fence per
producer program would keep its SMs for the whole transfer).

Why a half is free when it is written: a rank writes half ``e % 2`` of its peers in call ``e`` only after
finishing call ``e - 1``, which needed every peer's call ``e - 1`` data, which each peer sent at the start
of its call ``e - 1``, after finishing call ``e - 2`` (the last reader of half ``e % 2``). So no rank runs
more than one call ahead of another, a half is never overwritten while it is read, a word holds either
flag ``e - 2`` (stale) or ``e``, and ``flags[r, p]`` is ``e - 1``, ``e`` or ``e + 1`` while a program waits
for call ``e``. Every rank picks the same protocol (from ``M``; a buffer must keep one). Nothing is reset,
so the same kernel replays in a CUDA graph forever; the buffers start zeroed (flags 0, epochs 0). There is
no host synchronisation and no collective launch: one kernel and one NVLink store per value (and one flag
per program and peer in the bulk protocol). Every rank merges the same ``W`` states in the same order with
the same code, so the results are bitwise identical on every rank. Programs only wait for their
counterparts on the peers (at most 256 programs of 128 or 256 threads: all resident at once).

The kernel is launched with programmatic dependent launch where the split-KV kernel is (Note [Programmatic
dependent launch] in ``ops/split_kv.py``): its programs wait (``griddepcontrol.wait``) before reading
anything, so its launch overlaps the local attention's last merge.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .._device import cdiv, next_pow2
from ._launch import launch, pdl_options
from ._state import add_sink, finalize, fold_states

MAX_PROGRAMS = 256  # programs of one merge at most, all resident at once (fewer were slower: docs/tuning.md)
BULK_MIN_ROWS = 1024  # merges of this many rows or more take the bulk protocol (Note [Symmetric-memory merge];
# below it the fence and flag cost more than the flagged words' doubled bytes: docs/tuning.md)


@triton.jit
def _peer(BUF_PTRS, r):
    """The base (32-bit words) of rank ``r``'s buffer, from the device table of buffer addresses."""
    return tl.load(BUF_PTRS + r).to(tl.pointer_type(tl.float32))


@triton.jit
def _recv(p_buf, own_words):
    """``recv`` of the buffer at ``p_buf`` (64-bit words, after ``own``)."""
    return (p_buf + own_words).to(tl.pointer_type(tl.int64))


@triton.jit
def _epochs(p_buf, own_words, slot, WORLD: tl.constexpr):
    """``epoch`` of the buffer at ``p_buf`` (int32, after the ``4 * W * slot`` words of ``recv``); ``flags``
    follow it, ``P`` words on."""
    return (p_buf + own_words + 4 * WORLD * slot).to(tl.pointer_type(tl.int32))


@triton.jit
def _layout(M, HEAD_DIM: tl.constexpr):
    """``(own_words, slot)``: the 32-bit words of ``own`` (padded to whole 8-byte words) and the 8-byte words
    of one slot of ``recv``."""
    ROW: tl.constexpr = HEAD_DIM + 1
    return (M.to(tl.int64) * ROW + 1) // 2 * 2, M.to(tl.int64) * ROW


@triton.jit
def _call(p_epoch, slot, WORLD: tl.constexpr):
    """``(e, half)``: the call ``e`` of the program whose epoch is at ``p_epoch`` and the offset (64-bit words)
    of half ``e % 2`` of ``recv``."""
    e = tl.load(p_epoch, volatile=True) + 1
    return e, (e & 1).to(tl.int64) * WORLD * slot


@triton.jit
def _slot_of(BUF_PTRS, r, own_words, half, rank, slot):
    """Slot ``rank`` of the current half of rank ``r``'s ``recv`` (64-bit words)."""
    return _recv(_peer(BUF_PTRS, r), own_words) + half + rank * slot


@triton.jit
def push_rows(BUF_PTRS, rank, M, rows, m_r, o_d, m_d, b_o, b_lse,
              WORLD: tl.constexpr, HEAD_DIM: tl.constexpr, EXCHANGE_BLOCK_M: tl.constexpr):
    """The producer's push (Note [Symmetric-memory merge]): this program's states ``b_o [R, BLOCK_D]``,
    ``b_lse [R]`` float32 of rows ``rows [R]`` (int64, ``m_r`` valid; all owned by one exchange program of
    ``EXCHANGE_BLOCK_M`` rows) into slot ``rank`` of every peer's current half. No fence, no flag: the
    exchange kernel publishes them."""
    ROW: tl.constexpr = HEAD_DIM + 1
    own_words, slot = _layout(M, HEAD_DIM)
    e, half = _call(_epochs(_peer(BUF_PTRS, rank), own_words, slot, WORLD) + tl.min(rows, 0) // EXCHANGE_BLOCK_M,
                    slot, WORLD)
    for r in tl.static_range(WORLD):
        if r != rank:
            p_slot = _slot_of(BUF_PTRS, r, own_words, half, rank, slot).to(tl.pointer_type(tl.float32))
            tl.store(p_slot + rows[:, None] * ROW + o_d[None, :], b_o, mask=m_r[:, None] & m_d[None, :])
            tl.store(p_slot + rows * ROW + HEAD_DIM, b_lse, mask=m_r)


@triton.jit
def _store_sys(p_words, words, mask):
    """``*p_words = words`` where ``mask``: one relaxed 8-byte store at system scope per word (a reader on
    any GPU sees a word whole or not at all)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,l,r", [p_words, words, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _await_flag(words, p_words, e, mask):
    """``words`` (64-bit words loaded from ``p_words``) where ``mask``, each reloaded (volatile) until its
    high half is the flag ``e``: a spin per element and per thread, with no barrier and no reduction, so
    every thread leaves with words it saw flagged itself (Note [Symmetric-memory merge])."""
    ready = tl.where(mask, words, e.to(tl.int64) << 32)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 hi; mov.b64 $0, $1; WAIT: mov.b64 {_, hi}, $0; setp.eq.b32 p, hi, $3; "
        "@p bra DONE; ld.volatile.global.b64 $0, [$2]; bra WAIT; DONE: }",
        "=l,l,l,r", [ready, p_words, tl.zeros_like(mask.to(tl.int32)) + e], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _fence_sys_thread0():
    """``fence.acq_rel.sys`` in thread 0 of the program (after a barrier: cumulative over the program's
    earlier stores)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; @!p bra SKIP; fence.acq_rel.sys; "
        "SKIP: mov.u32 $0, 0; }", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_flag(p_flag, e):
    """``*p_flag = e`` by thread 0 of the program: a relaxed store at system scope (after
    :func:`_fence_sys_thread0`, a release)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p st.relaxed.sys.global.b32 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [p_flag, e], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _acquire_flag(p_flag, e):
    """Spin until ``*p_flag - e >= 0`` (int32, wrap-safe), every thread on its own: acquire loads at system
    scope, no barrier and no reduction (Note [Symmetric-memory merge])."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 d; WAIT: ld.acquire.sys.global.b32 $0, [$1]; sub.s32 d, $0, $2; "
        "setp.lt.s32 p, d, 0; @p bra WAIT; }",
        "=r,l,r", [p_flag, e], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _symm_merge_kernel(
    BUF_PTRS, SINKS, O_OUT, LSE_OUT,
    rank, M, N_HEADS, stride_oom, stride_lom, stride_sink,
    WORLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_F: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr, BULK: tl.constexpr, PUSHED: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the local attention that wrote `own` is done
        gdc_wait()
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    ROW: tl.constexpr = HEAD_DIM + 1
    i_m = i_p.to(tl.int64) * BLOCK_M
    n_rows = tl.minimum(M - i_m, BLOCK_M)
    own_words, slot = _layout(M, HEAD_DIM)
    p_mine = _peer(BUF_PTRS, rank)
    p_epoch = _epochs(p_mine, own_words, slot, WORLD) + i_p
    e, half = _call(p_epoch, slot, WORLD)
    o_f = tl.arange(0, BLOCK_F)
    m_f = o_f < n_rows * ROW
    o_s = tl.arange(0, BLOCK_S)
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_r = o_r < n_rows
    m_d = o_d < HEAD_DIM
    m_sr = (o_s < WORLD)[:, None] & m_r[None, :]
    m_srd = m_sr[:, :, None] & m_d[None, None, :]
    p_half = _recv(p_mine, own_words) + half
    if BULK:
        if not PUSHED:  # 1. this rank's rows as float32 into slot `rank` of every peer's current half
            b_x = tl.load(p_mine + i_m * ROW + o_f, mask=m_f)
            for r in tl.static_range(WORLD):
                if r != rank:
                    p_recv = _slot_of(BUF_PTRS, r, own_words, half, rank, slot).to(tl.pointer_type(tl.float32))
                    tl.store(p_recv + i_m * ROW + o_f, b_x, mask=m_f)
        # then flag e: one fence, cumulative over this program's stores (the barrier ordered them before it)
        # and over the producer's (its grid is done), and relaxed flag stores
        tl.debug_barrier()
        _fence_sys_thread0()
        for r in tl.static_range(WORLD):
            if r != rank:
                _store_flag(_epochs(_peer(BUF_PTRS, r), own_words, slot, WORLD) + n_p + rank * n_p + i_p, e)
        # 2. every peer's flag e (or later) for this program
        for r in tl.static_range(WORLD):
            if r != rank:
                _acquire_flag(p_epoch + n_p + r * n_p, e)
        # the W slots (this rank's own rows from `own`) past L1: the peers' came over NVLink
        p_slots = tl.where(o_s == rank, p_mine, p_half.to(tl.pointer_type(tl.float32)) + o_s.to(tl.int64) * 2 * slot)
        p_rows = p_slots[:, None] + (i_m + o_r)[None, :] * ROW
        b_o = tl.load(p_rows[:, :, None] + o_d[None, None, :], mask=m_srd, other=0.0, cache_modifier=".cg")
        b_lse = tl.load(p_rows + HEAD_DIM, mask=m_sr, other=float("-inf"), cache_modifier=".cg")
    else:
        # 1. this rank's rows, flagged with e, into slot `rank` of every rank's current half
        bits = tl.load(p_mine + i_m * ROW + o_f, mask=m_f).to(tl.int32, bitcast=True)
        words = (e.to(tl.int64) << 32) | (bits.to(tl.int64) & 0xFFFFFFFF)
        for r in tl.static_range(WORLD):
            _store_sys(_slot_of(BUF_PTRS, r, own_words, half, rank, slot) + i_m * ROW + o_f, words, m_f)
        # 2. the W slots of this rank's half, until every word carries flag e
        p_rows = p_half + o_s[:, None] * slot + (i_m + o_r)[None, :] * ROW
        p_o = p_rows[:, :, None] + o_d[None, None, :]
        w_o = _await_flag(tl.load(p_o, mask=m_srd, other=0, volatile=True), p_o, e, m_srd)
        w_l = _await_flag(tl.load(p_rows + HEAD_DIM, mask=m_sr, other=0, volatile=True), p_rows + HEAD_DIM, e, m_sr)
        b_o = w_o.to(tl.int32).to(tl.float32, bitcast=True)
        b_lse = tl.where(m_sr, w_l.to(tl.int32).to(tl.float32, bitcast=True), float("-inf"))
    # 3. ⊕ over the slots in rank order
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = fold_states(m_i, l_i, acc, b_lse, b_o)
    b_o, b_lse = finalize(m_i, l_i, acc, 1.0)
    if HAS_SINKS:  # the sinks once; row m is query head m % N_HEADS
        b_o, b_lse = add_sink(b_o, b_lse, tl.load(SINKS + ((i_m + o_r) % N_HEADS) * stride_sink, mask=m_r, other=0.0))
    tl.store(O_OUT + (i_m + o_r)[:, None] * stride_oom + o_d[None, :], b_o.to(O_OUT.dtype.element_ty),
             mask=m_r[:, None] & m_d[None, :])
    tl.store(LSE_OUT + (i_m + o_r) * stride_lom, b_lse, mask=m_r)
    tl.debug_barrier()  # every warp of the program has read the epoch before it moves on
    tl.store(p_epoch, e)


def push_plan(m: int, d: int, world: int):
    """What a producer's :func:`push_rows` needs, or ``None`` when ``m`` rows take the flagged words (the
    push is for the bulk protocol): ``EXCHANGE_BLOCK_M``."""
    return symm_plan(m, d, world)[1] if m >= BULK_MIN_ROWS else None


def symm_plan(m: int, d: int, world: int):
    """``(programs, BLOCK_M)`` for ``m`` rows of head dim ``d`` over ``world`` ranks: at most
    :data:`MAX_PROGRAMS` programs, each a power-of-two number of rows."""
    block_m = next_pow2(cdiv(m, MAX_PROGRAMS))
    return cdiv(m, block_m), block_m


def buffer_words(m: int, d: int, world: int) -> int:
    """32-bit words of one rank's buffer: ``own``, ``recv``, ``epoch`` and ``flags`` (see the Note)."""
    own = -(-m * (d + 1) // 2) * 2
    return own + 4 * world * m * (d + 1) + (world + 1) * symm_plan(m, d, world)[0]


def symm_merge_into(buf_ptrs, rank, world, m, d, o_out, lse_out, sinks=None, pdl=False, pushed=False) -> None:
    """Launch the exchange-and-merge kernel of Note [Symmetric-memory merge].

    ``buf_ptrs [W]`` int64 (device): every rank's buffer address (:func:`buffer_words` words each, zeroed
    before the first call); this rank's packed states ``[M, D + 1]`` float32 are at the start of its own
    buffer. Writes ``o_out [M, D]`` (any float dtype, unit stride in D) and ``lse_out [M]`` float32 natural
    log; ``sinks [H]`` float32 join once (row ``m`` is head ``m % H``). Every rank of the group must launch
    it with the same ``m``, ``d`` and ``world``; callers validate. ``M >=`` :data:`BULK_MIN_ROWS` takes the
    bulk protocol, fewer rows the flagged words; ``pushed``: the kernel before it stored the states into
    the peers with :func:`push_rows` (bulk only; it must be the last kernel before this one). ``pdl``:
    launched with programmatic dependent launch (compute capability 9.0 or more).
    """
    has_sinks = sinks is not None
    programs, constexprs, options = symm_launch_config(m, d, world, has_sinks, pushed, pdl)
    launch(
        _symm_merge_kernel, (programs,),
        (buf_ptrs, sinks if has_sinks else lse_out, o_out, lse_out, rank, m,
         sinks.shape[0] if has_sinks else 1, o_out.stride(0), lse_out.stride(0), sinks.stride(0) if has_sinks else 0),
        constexprs, **options,
    )


def symm_launch_config(m: int, d: int, world: int, sinks: bool, pushed: bool = False, pdl: bool = False) -> tuple:
    """``(programs, constexprs, options)`` of :func:`_symm_merge_kernel` for ``m`` rows of head dim ``d`` over
    ``world`` ranks (:func:`symm_plan`)."""
    programs, block_m = symm_plan(m, d, world)
    block_s, block_d = next_pow2(world), next_pow2(d)
    options = pdl_options(pdl, num_warps=4 if block_s * block_m * block_d <= 4096 else 8)
    return programs, dict(WORLD=world, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_d,
                          BLOCK_F=next_pow2(block_m * (d + 1)), BLOCK_S=block_s, HAS_SINKS=sinks,
                          BULK=m >= BULK_MIN_ROWS, PUSHED=pushed, PDL=pdl), options
