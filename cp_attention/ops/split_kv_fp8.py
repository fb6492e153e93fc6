"""The FP8 split-KV kernel of sm_90 in Gluon: one warp a program (a warp per 16 query rows), its K/V tiles
reaching the tensor cores without a layout change through shared memory.

Note [One-warp FP8 tiles]
-------------------------
The Triton split kernel (``split_kv._split_kv_kernel``) runs an FP8 tile through ``tl.dot``, which gets
its operands in the layouts the ``mma`` wants: K via ``ldmatrix`` from shared memory, V (the reduction
runs over keys, and sm_90 has no transposing 8-bit ``ldmatrix``) via single-byte shared loads; the warps
of a program share a tile, so its row max and sums cross warps through shared memory and ``p`` changes
layout through it. That loop issues ~35 warp instructions per key at head dim 128 and is bound by each
warp's chain of dependent steps, well above the half of the bf16 time that its bytes alone would take
(docs/tuning.md). This kernel is the same computation written with explicit
layouts (Gluon), one warp a program, with what Triton's ``tl.dot`` cannot express:

* **Head-dim permutations instead of layout changes.** ``q . k`` sums over the head dim, so any permutation of it
  applied to both ``q`` and ``k`` leaves the scores unchanged. With logical dim ``kk = j0 + 2 t + 8 j1 + 16 s``
  (``t`` the lane's place in its quad, ``s`` the ``mma`` step) read from byte ``j0 + 2 j1 + 4 s + D/4 t`` of a key
  (head dim ``D`` = 128 or 256), lane ``(g, t)`` of the ``m16n8k16`` operand layout owns the ``D/4`` bytes of key
  ``g`` from ``D/4 t``: two (four at 256) 16-byte shared loads, each 32-bit word one step's operand pair after two
  ``cvt`` (no byte shuffles). ``p @ v`` writes output column ``n = g + 8 i`` from value byte ``D/8 g + i``, so
  lane ``(g, t)`` reads the ``D/8`` bytes from ``D/8 g`` of keys ``2t, 2t+1, 2t+8, 2t+9`` (16-byte loads; one
  ``PRMT`` per two value pairs interleaves two keys). The ring's 16-byte chunks are swizzled by the key (by pairs
  of keys at 256, whose V reads take 32 bytes of a key a lane), so that both layouts read without bank conflicts.
  The tiles are loaded in these register layouts (``DistributedLinearLayout``) and reshaped into the operand
  layouts: the conversion is a renaming of registers, no shared memory. The output is renamed back into value
  order the same way, then goes through shared memory so that each row is stored by the whole warp in 16-byte
  pieces: stored from the accumulator's layout, each lane would write 4-byte pieces 64 bytes apart, about a
  million such stores at the end of a B=1 T=128k call with 16 rows a KV head (docs/tuning.md).
* **``p`` stays in registers.** The scores' accumulator layout is the next ``mma``'s operand layout for
  16-bit ``p`` (as in FlashAttention-2; with the keys as the rows, two shuffles away from it), and with one warp
  a program every row reduction stays inside the warp (two or three shuffles), with no barrier in the loop
  beyond the ``cp.async`` ring's.
* **Eight programs per SM** of one warp each, one wave (a ring of three K/V tiles in shared memory filled
  by ``cp.async``, 16 keys a tile, 32 for splits of more than 4096 positions; four programs per SM in 32-key
  tiles where eight would get splits of at most 2048: :func:`cp_attention.heuristics.one_warp_plan`);
  142-168 registers at up to 8 rows (Note [Keys as the mma rows]), 184-227 at 9-16, 12 or 24 KB; programs of two
  warps (17-32 rows) four per SM, 204 registers, 24 KB. At head dim 256 the 16-key tiles hold a 32-key tile's
  bytes, 24 KB: 237-242 registers and no spills at up to 8 rows; 9-16 rows fill an SM's registers (255) and spill
  72-104 bytes (Triton 3.6: a few copy addresses, reloaded from L1 eight or nine times a tile); at most 16 rows
  (two warps would spill 496 bytes).
* **The running max moves lazily** (:func:`~cp_attention.ops._state.lazy_running_max`): only when a row's max
  rises by more than 2^8 (``LAZY_RESCALE``) is the state rescaled (a branch around 80 instructions); otherwise
  the weights are taken against the old max and stay below 2^8. The state is the same; only the reference of
  the sums differs.

The loop executes ~300 instructions per 16-key tile of a warp with the keys as the rows (~380 with 16 rows), ~510
per 32-key tile (~590) (Triton 3.6, sm_90; the Triton FP8 loop ~35 a key). The state algebra is ``ops/_state.py``'s
(:func:`~cp_attention.ops._state.lazy_running_max`, :func:`~cp_attention.ops._state.finalize`; level 2 is
``split_kv._combine_kernel``); the numerics are those of the Triton kernel (Note [Attention states inside
kernels]: fp16 query scaled by a power of two per row, fp16 products, ``o`` normalised by the sum of the weights
rounded to fp16, the lse from the sum of the weights), with the additions in another order. Its arguments are
``_split_kv_kernel``'s, so the launch path is shared; it runs the part of that kernel's domain that the plan gives
it (:func:`cp_attention.heuristics.one_warp_fp8`): an FP8 cache of head dim 128 or 256, causal drafts,
``seq_lens``, scalar or per-head scales, exported or direct output, windows, softcaps, sinks and row limits (a
context-parallel rank's rows); dense caches or page pools (one block-table entry
read a tile ahead of its copy where a page holds whole tiles, else one a key). A warp holds 16 query rows
(query rows x GQA group). 17-32 rows (:data:`~cp_attention.heuristics.ONE_WARP_MAX_ROWS`) run as two warps a
program (``BLOCK_H`` 32) where the pages hold whole 32-key tiles: the ``mma`` layouts put a warp on each 16
rows, every warp reads the whole tile from the shared ring into its registers (a zero warp basis in the tile
layouts), and the warps exchange one word a tile (the lazy max's any-row test); on smaller pages they run as
row tiles of one warp, a program each, each reading the split's K/V. (Four warps for 64 rows are slower
than the Triton kernel's 64-row tiles: each warp does a whole tile's work for its rows.) With
a window or row limits the tiles start on a whole tile below the first position any row sees (a tile then
stays within a page), and the tiles that reach below a row's first position are masked like those that
reach past its last. A split of a dense cache is every ``S``-th tile, not a range of them (Note [Strided
splits]).

Note [Strided splits]
---------------------
On a dense cache split ``s`` of ``S`` takes tiles ``s, s + S, s + 2 S, ...`` of the keys a call sees, not a
range of consecutive tiles: at each moment the ``S`` programs of a KV head read neighbouring tiles of one region
of the cache. The splits are still disjoint sets of keys, each with its own state, merged by the combine in slot
order; their sizes differ by at most one tile, as the ranges' did (at most the plan's ``tiles_per_split``). The
kernel never runs ``split_size``'s deterministic splits (:func:`cp_attention.heuristics.one_warp_fp8`), whose
ranges of absolute positions are the contract of batch invariance. Why: with ranges, the programs of an HND cache
read places far apart (at B=1 T=128k 66 splits of 258 KB in each head's 16 MB), while an NHD cache's programs of
one split read the eight KV heads' bytes of the same tokens together, and NHD read faster than HND (bf16 is
level). Padding the heads off their alignment did not move HND, and rotating each program's tile order slowed
NHD: what NHD had was reads close together in time and place, which strided splits give an HND cache
(docs/tuning.md). Page pools keep the ranges: there each tile's block-table entry is read a tile ahead of its
copy, and strided splits read each entry from another cache line, likely a round trip that one tile ahead does
not hide (strided pools were slower).

Note [Keys as the mma rows]
---------------------------
Plain decode has few query rows per KV head (GQA 4: 4), and an ``m16n8k16`` row block of 16 rows leaves 12 of
them empty. With at most 8 rows (``ROWS_KM``) the one-warp kernel transposes both products: ``s^T [keys, 8] =
k . q^T`` and ``acc^T [D, 8] += v^T . p^T``, the keys (then the head dim) on the ``mma``'s 16 rows and the query
rows on its 8 columns. Half the ``mma`` (e.g. 16 instead of 32 a 16-key tile at head dim 128), half the
accumulator's registers (32 instead of 64 at 128), half the exponentials. The K and V register tiles are the same
bytes as in the rows' form (lane ``(g, t)`` holds keys ``g`` and ``g + 8`` of K, keys ``2t, 2t+1, 2t+8, 2t+9`` of
V), only read as the A operand; ``q^T`` is loaded once as the B operand. What it costs: a row's max and sums
reduce over the keys, across the 8 lanes of a column (three shuffles a value where the rows' form takes two),
and ``p^T`` goes from the accumulator's layout to the B operand's (two ``SHFL.IDX`` a tile at 16 keys, no shared
memory). The state is the same computation in another order of additions. Head dim 128 dense caches run level
with the rows' form; its pools, and head dim 256 (where the rows' form spills registers), run faster, and the
registers it frees let 32-key tiles at four programs per SM win up to splits of 4096 positions (docs/tuning.md).

Gluon kernels have no interpreter path: on the CPU the tests compile this kernel for sm_90
(``tests/test_aot.py``) and check the plan's choice; on the GPU they check it against the float64 oracle
(``tests/test_gpu.py``).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.runtime.jit import constexpr_function

from .split_kv import row_heads
from ._state import (LN2, add_sink, capped, finalize, first_position, fp16_query, kv_bases, lazy_running_max,
                     score_scales, seq_length, table_entries, take_weights)

# Triton 3.6's names of the cp.async copy and the CTA barrier; later versions call them async_load and
# barrier (same arguments)
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

ROWS_1W = gl.constexpr(16)  # query rows per tile: one m16n8k16 row block
ROWS_KM = gl.constexpr(8)  # ... with the keys as the rows (Note [Keys as the mma rows]): one n8 column block
# The running max moves (and the state is rescaled) only when a row's max rises by more than this many
# powers of two; otherwise the weights are taken against the old max, at most 2^LAZY_RESCALE (fp16 holds them)
LAZY_RESCALE = gl.constexpr(8.0)


@gluon.jit
def _tiles_below(x, t0, step, TILES_PER_SPLIT):
    """How many of a split's tiles (``t0, t0 + step, ...`` of the sequence, at most ``TILES_PER_SPLIT``: Note
    [Strided splits]) lie below its tile ``x``."""
    return gl.minimum(gl.cdiv(gl.maximum(x - t0, 0), step), TILES_PER_SPLIT)


@gluon.jit
def _gdc(op: gl.constexpr):
    """``griddepcontrol.wait`` or ``.launch_dependents`` (Note [Programmatic dependent launch])."""
    gl.inline_asm_elementwise(f"griddepcontrol.{op}; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@constexpr_function
def _tile_layout(block_n, values, warps, d):
    """The register layout of a ``[block_n, d]`` FP8 tile as read from shared memory: lane ``(g, t)`` holds
    bytes ``d/4 t .. d/4 (t + 1) - 1`` of key ``g`` (K), or bytes ``d/8 g .. d/8 (g + 1) - 1`` of keys ``2t, 2t+1,
    2t+8, 2t+9`` (V, ``values``); keys 16 .. 31 of a 32-key tile take one more register bit. Every one of the
    ``warps`` holds the whole tile (the ``mma`` B operand of its own row block)."""
    more = [[16, 0]] if block_n == 32 else []
    warp_bases = [[0, 0]] * (warps.bit_length() - 1)
    if values:  # d/8 bytes, then keys +1 and +8; lanes: keys +2, +4 and bytes d/8, d/4, d/2
        return gl.DistributedLinearLayout([[0, 1 << i] for i in range((d // 8).bit_length() - 1)] + [[1, 0], [8, 0]]
                                          + more, [[2, 0], [4, 0], [0, d // 8], [0, d // 4], [0, d // 2]], warp_bases,
                                          [], [block_n, d])
    # d/4 bytes, then key +8; lanes: bytes d/4, d/2 and keys +1, +2, +4
    return gl.DistributedLinearLayout([[0, 1 << i] for i in range((d // 4).bit_length() - 1)] + [[8, 0]] + more,
                                      [[0, d // 4], [0, d // 2], [1, 0], [2, 0], [4, 0]], warp_bases, [], [block_n, d])


@constexpr_function
def _bits(n):
    """``log2(n)`` (a power of two)."""
    return n.bit_length() - 1


@constexpr_function
def _byte_bits(block_n, d):
    """The shape ``[block_n, 2, 2, ...]`` of a ``[block_n, d]`` tile with its bytes as their bits."""
    return [block_n] + [2] * _bits(d)


@gluon.jit
def _page_of(p_bt, stride_btp, t, o_ck, t_end, num_pages, PAGE_SIZE: gl.constexpr, IS_PAGED: gl.constexpr,
             KEY_PAGES: gl.constexpr):
    """The pool pages of the tile at position ``t`` of a paged cache (block-table entries, clamped into the
    pool; 0 past ``t_end``): the tile's one page, or with ``KEY_PAGES`` (pages that do not hold whole tiles)
    each key's (``[BLOCK_N]``, in the copies' row layout); 0 for a dense cache."""
    if KEY_PAGES:
        return table_entries(p_bt, stride_btp, (t + o_ck) // PAGE_SIZE, t + o_ck < t_end, num_pages).to(gl.int64)
    elif IS_PAGED:
        return table_entries(p_bt, stride_btp, t // PAGE_SIZE, t < t_end, num_pages).to(gl.int64)
    else:
        return 0


@gluon.jit
def _issue_tile(s_k, s_v, p_k, p_v, o_ck, stride_kt, stride_vt, stride_kp, stride_vp, t, page, t_end, stage,
                BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, IS_PAGED: gl.constexpr, KEY_PAGES: gl.constexpr):
    """Start the copies of keys ``[t, t + BLOCK_N)`` (those below ``t_end``; the rest zero-filled) into ring
    ``stage`` (one commit group); a paged cache's tile lies within ``page`` (``PAGE_SIZE`` a multiple of
    ``BLOCK_N``), or with ``KEY_PAGES`` its keys in pages ``page [BLOCK_N]`` (then ``p_k``, ``p_v`` hold no
    key offsets)."""
    m = (t + o_ck < t_end)[:, None]
    if KEY_PAGES:
        slot = ((t + o_ck) % PAGE_SIZE).to(gl.int64)
        o_k = (page * stride_kp + slot * stride_kt)[:, None]
        o_v = (page * stride_vp + slot * stride_vt)[:, None]
    elif IS_PAGED:
        slot = (t % PAGE_SIZE).to(gl.int64)
        o_k = page * stride_kp + slot * stride_kt
        o_v = page * stride_vp + slot * stride_vt
    else:
        o_k = t.to(gl.int64) * stride_kt
        o_v = t.to(gl.int64) * stride_vt
    _cp_async(s_k.index(stage), p_k + o_k, mask=m)
    _cp_async(s_v.index(stage), p_v + o_v, mask=m)
    async_copy.commit_group()


@gluon.jit
def _attend_tile(q, b_k, b_v, qk_scale, cap, m_i, l_i, r_i, acc, key0, row_lo, row_hi, o_key, MASKED: gl.constexpr,
                 HAS_ROW_LO: gl.constexpr, SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr, W: gl.constexpr,
                 D: gl.constexpr, KEYS_M: gl.constexpr):
    """Fold one K/V tile (FP8, as loaded in the permuted register layouts) into the running state ``(m_i,
    l_i, r_i, acc)`` (``l`` sums the weights, ``r`` the weights rounded to fp16: ``_state.take_weights``);
    ``MASKED``: keys ``key0 + o_key >= row_hi`` of a row are left out, and with ``HAS_ROW_LO`` those ``<
    row_lo``; ``SOFTCAP``: the scores capped (``_state.capped``). ``KEYS_M`` (Note [Keys as the mma rows]):
    the products transposed, ``s [BLOCK_N, 8] = k . q^T`` and ``acc [D, 8] += v^T . p^T``."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # K [BLOCK_N, byte (t1 t0 s.. j1 j0)] -> [kk (s.. j1 t1 t0 j0), key]: the operand of q . k
    k = gl.reshape(b_k.to(gl.float16), _byte_bits(BLOCK_N, D))
    if D == 128:
        k = gl.permute(k, (3, 4, 5, 6, 1, 2, 7, 0))
    else:
        k = gl.permute(k, (3, 4, 5, 6, 7, 1, 2, 8, 0))
    k = gl.reshape(k, [D, BLOCK_N])
    if KEYS_M:
        s = mma_v2(gl.convert_layout(gl.permute(k, (1, 0)), a_l), q,
                   gl.zeros([BLOCK_N, ROWS_KM], gl.float32, layout=mma))
        key_ax: gl.constexpr = 0
    else:
        s = mma_v2(q, gl.convert_layout(k, b_l), gl.zeros([ROWS_1W * W, BLOCK_N], gl.float32, layout=mma))
        key_ax: gl.constexpr = 1
    s = capped(s * qk_scale, cap, SOFTCAP)
    if MASKED:
        key = key0 + gl.expand_dims(o_key, 1 - key_ax)
        seen = key < gl.expand_dims(row_hi, key_ax)
        if HAS_ROW_LO:
            seen = seen & (key >= gl.expand_dims(row_lo, key_ax))
        s = gl.where(seen, s, float("-inf"))
    m_i, m_ref, l_i, r_i, acc = lazy_running_max(m_i, gl.max(s, key_ax), l_i, r_i, acc, LAZY_RESCALE, key_ax)
    p, l_i, r_i = take_weights(s, m_ref, l_i, r_i, gl.float16, key_ax)
    # V [BLOCK_N, byte (g2 g1 g0 i..)] -> [key, n (i.. g2 g1 g0)]: the operand of p @ v
    v = gl.reshape(b_v.to(gl.float16), _byte_bits(BLOCK_N, D))
    if D == 128:
        v = gl.permute(v, (0, 4, 5, 6, 7, 1, 2, 3))
    else:
        v = gl.permute(v, (0, 4, 5, 6, 7, 8, 1, 2, 3))
    v = gl.reshape(v, [BLOCK_N, D])
    if KEYS_M:
        acc = mma_v2(gl.convert_layout(gl.permute(v, (1, 0)), a_l), gl.convert_layout(p, b_l), acc)
    else:
        acc = mma_v2(gl.convert_layout(p, a_l), gl.convert_layout(v, b_l), acc)
    return m_i, l_i, r_i, acc


@gluon.jit
def _next_tile(q, qk_scale, cap, s_k, s_v, p_k, p_v, o_ck, stride_kt, stride_vt, stride_kp, stride_vp, p_bt,
               stride_btp, num_pages, page, t_first, t_step, t_end, it, row_lo, row_hi, o_key, m_i, l_i, r_i, acc,
               MASKED: gl.constexpr, HAS_ROW_LO: gl.constexpr, SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr, IS_PAGED: gl.constexpr, KEY_PAGES: gl.constexpr,
               k_l: gl.constexpr, v_l: gl.constexpr, W: gl.constexpr, D: gl.constexpr, KEYS_M: gl.constexpr):
    """Tile ``it`` of the split (at position ``t_first + it * t_step``: Note [Strided splits]): start the copy of
    tile ``it + NUM_STAGES - 1`` (in pool pages ``page`` of a paged cache) into the ring stage that tile ``it - 1``
    held, read the block-table entries of the tile after it (returned: their latency hides behind this tile), wait
    for tile ``it``'s copy and fold it in (:func:`_attend_tile`)."""
    t_next = t_first + (it + NUM_STAGES - 1) * t_step
    _barrier()  # every lane is done with the stage the next copy overwrites
    _issue_tile(s_k, s_v, p_k, p_v, o_ck, stride_kt, stride_vt, stride_kp, stride_vp, t_next, page, t_end,
                (it + NUM_STAGES - 1) % NUM_STAGES, BLOCK_N, PAGE_SIZE, IS_PAGED, KEY_PAGES)
    page = _page_of(p_bt, stride_btp, t_next + t_step, o_ck, t_end, num_pages, PAGE_SIZE, IS_PAGED, KEY_PAGES)
    async_copy.wait_group(NUM_STAGES - 1)
    _barrier()
    m_i, l_i, r_i, acc = _attend_tile(q, s_k.index(it % NUM_STAGES).load(k_l), s_v.index(it % NUM_STAGES).load(v_l),
                                      qk_scale, cap, m_i, l_i, r_i, acc, t_first + it * t_step, row_lo, row_hi, o_key,
                                      MASKED, HAS_ROW_LO, SOFTCAP, BLOCK_N, W, D, KEYS_M)
    return m_i, l_i, r_i, acc, page


@gluon.jit
def _split_kv_fp8_kernel(
    Q, K, V, SEQ_LENS, BLOCK_TABLE, ROW_LIMITS, K_SCALE, V_SCALE, SINKS, O, LSE, WORK,
    sm_scale, k_scale, v_scale, cap, T_MAX, TILES_PER_SPLIT, HKV, NUM_PAGES, WINDOW,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oq, stride_oh,
    stride_lb, stride_lq, stride_lh,
    stride_sl, stride_btb, stride_btp, stride_rlb, stride_rlq, stride_rlx, stride_ksh, stride_vsh, stride_sink,
    GROUP_SIZE: gl.constexpr, Q_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    HAS_SEQ_LENS: gl.constexpr, IS_PAGED: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_ROW_LIMITS: gl.constexpr,
    HAS_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, HAS_SINKS: gl.constexpr, KV_SCALE: gl.constexpr,
    EXPORT: gl.constexpr, INPUT_PRECISION: gl.constexpr, UPCAST: gl.constexpr, SPLIT_PAGES: gl.constexpr,
    PDL: gl.constexpr, STREAMS: gl.constexpr, PAGE_GATHER: gl.constexpr, PAGE_TILES: gl.constexpr,
    PAIR_V: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """Split-KV decode over an FP8 cache (dense or paged), one warp a program (Note [One-warp FP8 tiles]); arguments
    and outputs as ``split_kv._split_kv_kernel`` (Note [Split-KV decode]), plus ``NUM_STAGES`` K/V tiles in
    the ``cp.async`` ring; a dense cache's splits are strided over the tiles (Note [Strided splits])."""
    gl.static_assert((HEAD_DIM == 128 or HEAD_DIM == 256) and BLOCK_D == HEAD_DIM and BLOCK_H % ROWS_1W == 0)
    W: gl.constexpr = BLOCK_H // ROWS_1W  # warps: 16 rows each, one ring
    gl.static_assert(gl.num_warps() == W)
    gl.static_assert((BLOCK_N == 16 or BLOCK_N == 32) and KV_SCALE != 0)
    gl.static_assert(not (HAS_ROW_LIMITS and (IS_CAUSAL or HAS_WINDOW)))  # row limits replace both
    gl.static_assert(STREAMS == 1 and not PAIR_V and SPLIT_PAGES == 0 and not PAGE_GATHER)
    gl.static_assert(PAGE_TILES == (IS_PAGED and PAGE_SIZE % BLOCK_N == 0))
    KEY_PAGES: gl.constexpr = IS_PAGED and not PAGE_TILES  # pages that do not hold whole tiles: an entry a key
    HAS_ROW_LO: gl.constexpr = HAS_WINDOW or HAS_ROW_LIMITS  # rows with a first position
    if PDL:  # Note [Programmatic dependent launch]
        _gdc("wait")
    D: gl.constexpr = HEAD_DIM
    ROWS: gl.constexpr = Q_ROWS * GROUP_SIZE
    KEYS_M: gl.constexpr = W == 1 and ROWS <= ROWS_KM  # Note [Keys as the mma rows]
    M: gl.constexpr = ROWS_KM if KEYS_M else BLOCK_H  # query rows a program holds
    N_RT: gl.constexpr = (ROWS + M - 1) // M  # row tiles, one program each (Note [One-warp FP8 tiles])
    ROWS_T: gl.constexpr = M if ROWS > M else ROWS  # rows of a full tile
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    RAX: gl.constexpr = 0 if KEYS_M else 1  # the head dim's (and keys') axis of the accumulators; rows on the other
    row_l: gl.constexpr = gl.SliceLayout(RAX, mma)
    col_l: gl.constexpr = gl.SliceLayout(1 - RAX, mma)
    k_l: gl.constexpr = _tile_layout(BLOCK_N, False, W, D)
    v_l: gl.constexpr = _tile_layout(BLOCK_N, True, W, D)
    cp_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[512 // D, D // 16],
                                          warps_per_cta=[W, 1], order=[1, 0])
    # 16-byte chunks swizzled by the key (by pairs of keys at head dim 256, whose V reads take 32 bytes of a key
    # a lane): both register layouts read without bank conflicts
    sh_l: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=D // 128, max_phase=8, order=[1, 0])

    i_p = gl.program_id(0)
    i_s = gl.program_id(1)
    i_bh = i_p // N_RT
    i_rt = i_p % N_RT
    i_b64 = (i_bh // HKV).to(gl.int64)
    i_h64 = (i_bh % HKV).to(gl.int64)
    # The tiles cover the keys any row may see from the lowest one (as split_kv._split_kv_kernel), here rounded
    # down to a whole tile so that a tile stays within a page; the keys below a row's first are masked. Split
    # i_s takes tiles t0, t0 + step, ... of them: of a dense cache every n_sp-th from i_s, of a paged one the
    # range from i_s TILES_PER_SPLIT (Note [Strided splits]), whose end (t_end) bounds its copies
    base = first_position(ROW_LIMITS, stride_rlb, stride_rlq, SEQ_LENS, stride_sl, i_b64, T_MAX, WINDOW, Q_ROWS,
                          HAS_SEQ_LENS, HAS_ROW_LIMITS, HAS_WINDOW) // BLOCK_N * BLOCK_N
    seq_len = seq_length(SEQ_LENS, stride_sl, i_b64, T_MAX, HAS_SEQ_LENS)
    if IS_PAGED:
        t0 = i_s * TILES_PER_SPLIT
        step = 1
        t_end = gl.minimum(base + (t0 + TILES_PER_SPLIT) * BLOCK_N, seq_len)
    else:
        t0 = i_s
        step = gl.num_programs(1)
        t_end = seq_len
    t_first = base + t0 * BLOCK_N
    t_step = step * BLOCK_N

    o_ck = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cp_l))
    o_cd = gl.arange(0, D, layout=gl.SliceLayout(0, cp_l))
    p_k, p_v = kv_bases(K, V, i_b64, i_h64, stride_kb, stride_kh, stride_vb, stride_vh, IS_PAGED)
    if KEY_PAGES:  # the keys' offsets come with their pages (_issue_tile)
        p_k = p_k + o_cd[None, :]
        p_v = p_v + o_cd[None, :]
    else:
        p_k = p_k + o_ck[:, None].to(gl.int64) * stride_kt + o_cd[None, :]
        p_v = p_v + o_ck[:, None].to(gl.int64) * stride_vt + o_cd[None, :]
    if IS_PAGED:  # the tile's page (or its keys'): block-table entries read a tile ahead of the copy
        p_bt = BLOCK_TABLE + i_b64 * stride_btb
    else:
        p_bt = BLOCK_TABLE
    s_k = gl.allocate_shared_memory(K.dtype.element_ty, [NUM_STAGES, BLOCK_N, D], sh_l)
    s_v = gl.allocate_shared_memory(V.dtype.element_ty, [NUM_STAGES, BLOCK_N, D], sh_l)
    o_key = gl.arange(0, BLOCK_N, layout=col_l)

    # the first tiles' copies go out before the query's load (independent)
    for i in gl.static_range(NUM_STAGES - 1):
        t_i = t_first + i * t_step
        _issue_tile(s_k, s_v, p_k, p_v, o_ck, stride_kt, stride_vt, stride_kb, stride_vb, t_i,
                    _page_of(p_bt, stride_btp, t_i, o_ck, t_end, NUM_PAGES, PAGE_SIZE, IS_PAGED, KEY_PAGES), t_end, i,
                    BLOCK_N, PAGE_SIZE, IS_PAGED, KEY_PAGES)
    page = _page_of(p_bt, stride_btp, t_first + (NUM_STAGES - 1) * t_step, o_ck, t_end, NUM_PAGES, PAGE_SIZE,
                    IS_PAGED, KEY_PAGES)

    # the query rows of row tile i_rt (row r: token r // G, head h G + r % G, as split_kv.row_heads), head dim in
    # the keys' byte order, scaled into fp16 (_state.fp16_query; Note [Attention states inside kernels], FP8).
    # Written out here and for the state's rows below: through row_heads the compiler schedules the loop
    # differently (Triton 3.6, sm_90: 180 registers instead of 168 for a GQA 4 split)
    q_l: gl.constexpr = b_l if KEYS_M else a_l  # q^T [D, M] is the B operand of k . q^T
    o_qr = i_rt * M + gl.arange(0, M, layout=gl.SliceLayout(RAX, q_l))
    o_qk = gl.arange(0, D, layout=gl.SliceLayout(1 - RAX, q_l))
    q_byte = (o_qk & 1) + 2 * ((o_qk >> 3) & 1) + 4 * (o_qk >> 4) + D // 4 * ((o_qk >> 1) & 3)
    q_tok = (o_qr // GROUP_SIZE).to(gl.int64)
    q_head = i_h64 * GROUP_SIZE + o_qr % GROUP_SIZE
    q = gl.load(Q + i_b64 * stride_qb + gl.expand_dims(q_tok * stride_qq + q_head * stride_qh, RAX)
                + gl.expand_dims(q_byte, 1 - RAX), mask=gl.expand_dims(o_qr < ROWS, RAX), other=0.0)
    qk_scale, vs = score_scales(sm_scale, cap, K_SCALE, V_SCALE, k_scale, v_scale, i_h64, stride_ksh, stride_vsh,
                                SOFTCAP, KV_SCALE)
    q, qk_scale = fp16_query(q, qk_scale, KV_SCALE, RAX)
    if Q.dtype.element_ty == gl.bfloat16:  # a scale per row, beside the scores'
        qk_scale = gl.convert_layout(qk_scale, mma)

    # Each row's keys: [row_lo, row_hi) (split_kv._split_kv_kernel's rule)
    o_r = gl.arange(0, M, layout=row_l)
    o_rg = i_rt * M + o_r  # the rows among the KV head's
    m_row = o_rg < ROWS
    o_tok = o_rg // GROUP_SIZE
    o_tok64 = o_tok.to(gl.int64)
    o_head = i_h64 * GROUP_SIZE + o_rg % GROUP_SIZE
    if HAS_ROW_LIMITS:  # [B, Q, 2]: (first, end) of the positions each row sees, on this shard
        p_rl = ROW_LIMITS + i_b64 * stride_rlb + o_tok64 * stride_rlq
        row_lo = gl.load(p_rl, mask=m_row, other=0)
        row_hi = gl.minimum(gl.load(p_rl + stride_rlx, mask=m_row, other=0), t_end)
    elif IS_CAUSAL:  # row i sees the positions < seq_len - Q_ROWS + 1 + i // G
        row_hi = gl.minimum(seq_len - Q_ROWS + 1 + o_tok, t_end)
    else:
        row_hi = gl.zeros([M], gl.int32, layout=row_l) + t_end
    if HAS_WINDOW:  # and >= seq_len - Q_ROWS + i // G - WINDOW
        row_lo = seq_len - Q_ROWS + o_tok - WINDOW
    elif not HAS_ROW_LIMITS:
        row_lo = row_hi  # unused
    # the split's tiles [0, n_lo) reach below a row's first key, [n_full, n_tiles) past a row's end (none past
    # every row's); the rest are unmasked (each count: the split's tiles below a tile of the sequence)
    n_tiles = _tiles_below(gl.cdiv(gl.maximum(gl.max(gl.where(m_row, row_hi, base), 0) - base, 0), BLOCK_N), t0,
                           step, TILES_PER_SPLIT)
    n_full = _tiles_below(gl.maximum(gl.min(gl.where(m_row, row_hi, t_end), 0) - base, 0) // BLOCK_N, t0, step,
                          TILES_PER_SPLIT)
    if HAS_ROW_LO:
        n_lo = gl.minimum(_tiles_below(gl.cdiv(gl.maximum(gl.max(gl.where(m_row, row_lo, base), 0) - base, 0),
                                               BLOCK_N), t0, step, TILES_PER_SPLIT), n_tiles)
        n_full = gl.maximum(n_full, n_lo)
    else:
        n_lo = 0

    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([M], gl.float32, layout=row_l)
    r_i = gl.zeros([M], gl.float32, layout=row_l)
    if KEYS_M:
        acc = gl.zeros([D, M], gl.float32, layout=mma)
    else:
        acc = gl.zeros([M, D], gl.float32, layout=mma)
    if HAS_ROW_LO:
        for it in range(0, n_lo):
            m_i, l_i, r_i, acc, page = _next_tile(q, qk_scale, cap, s_k, s_v, p_k, p_v, o_ck, stride_kt, stride_vt,
                                                  stride_kb, stride_vb, p_bt, stride_btp, NUM_PAGES, page, t_first,
                                                  t_step, t_end, it, row_lo, row_hi, o_key, m_i, l_i, r_i, acc, True,
                                                  HAS_ROW_LO, SOFTCAP, BLOCK_N, NUM_STAGES, PAGE_SIZE, IS_PAGED,
                                                  KEY_PAGES, k_l, v_l, W, D, KEYS_M)
    for it in range(n_lo, n_full):
        m_i, l_i, r_i, acc, page = _next_tile(q, qk_scale, cap, s_k, s_v, p_k, p_v, o_ck, stride_kt, stride_vt,
                                              stride_kb, stride_vb, p_bt, stride_btp, NUM_PAGES, page, t_first, t_step,
                                              t_end, it, row_lo, row_hi, o_key, m_i, l_i, r_i, acc, False, HAS_ROW_LO,
                                              SOFTCAP, BLOCK_N, NUM_STAGES, PAGE_SIZE, IS_PAGED, KEY_PAGES, k_l, v_l, W,
                                              D, KEYS_M)
    for it in range(n_full, n_tiles):  # the tiles that reach a row's last key
        m_i, l_i, r_i, acc, page = _next_tile(q, qk_scale, cap, s_k, s_v, p_k, p_v, o_ck, stride_kt, stride_vt,
                                              stride_kb, stride_vb, p_bt, stride_btp, NUM_PAGES, page, t_first, t_step,
                                              t_end, it, row_lo, row_hi, o_key, m_i, l_i, r_i, acc, True, HAS_ROW_LO,
                                              SOFTCAP, BLOCK_N, NUM_STAGES, PAGE_SIZE, IS_PAGED, KEY_PAGES, k_l, v_l, W,
                                              D, KEYS_M)
    async_copy.wait_group(0)
    if PDL:  # the K/V reads are done
        _gdc("launch_dependents")

    # the state (o normalised by the rounded weights, lse from the weights; (0, -inf) where no key was seen)
    o, _ = finalize(m_i, r_i, acc, LN2, RAX)
    _, lse = finalize(m_i, l_i, acc, LN2, RAX)
    o = o * vs
    if not EXPORT and HAS_SINKS:
        o, lse = add_sink(o, lse, gl.load(SINKS + o_head * stride_sink, mask=m_row, other=0.0), RAX)
    if KEYS_M:
        o = gl.permute(o, (1, 0))
    # Output column n holds value dim D/8 (n % 8) + n // 8: renamed into value order, then each row stored by the
    # whole warp in 16-byte pieces (through shared memory); from the accumulator's layout every lane would
    # write 4-byte pieces D/2 bytes apart
    o = gl.reshape(gl.permute(gl.reshape(o, [M, D // 8, 8]), (0, 2, 1)), [M, D])
    st_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32], warps_per_cta=[W, 1],
                                          order=[1, 0])
    o = gl.convert_layout(o, st_l)
    o_sr = gl.arange(0, M, layout=gl.SliceLayout(1, st_l))
    o_sd = gl.arange(0, D, layout=gl.SliceLayout(0, st_l))
    m_srow = (i_rt * M + o_sr < ROWS)[:, None]
    if EXPORT:  # slot i_s: o [P * ROWS_T, D] then lse [P * ROWS_T] (Note [Split-KV decode])
        n_rows = gl.num_programs(0).to(gl.int64) * ROWS_T
        p_slot = WORK + i_s.to(gl.int64) * n_rows * (D + 1)
        row0 = i_p.to(gl.int64) * ROWS_T
        gl.store(p_slot + (row0 + o_sr)[:, None] * D + o_sd[None, :], o, mask=m_srow)
        gl.store(p_slot + n_rows * D + row0 + o_r, lse, mask=m_row)
    else:
        o_stok, o_shead = row_heads(i_rt * M + o_sr, i_h64, GROUP_SIZE, Q_ROWS)
        p_o = O + i_b64 * stride_ob + (o_stok * stride_oq + o_shead * stride_oh)[:, None] + o_sd[None, :]
        gl.store(p_o, o.to(O.dtype.element_ty), mask=m_srow)
        gl.store(LSE + i_b64 * stride_lb + o_tok64 * stride_lq + o_head * stride_lh, lse, mask=m_row)
