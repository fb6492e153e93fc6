"""Planning: the device facts, the kernels' tile configs and every split policy, in one place.

Note [Split count]
------------------
Decode reads every K/V byte once, so the only goal is to keep every SM's loads in flight. The grid has
``B * Hkv`` programs per split; with a small batch that is far fewer than the SMs, so the KV sequence is
split ``S`` ways. :func:`num_splits` is FlashAttention-2's wave-efficiency rule.
:func:`decode_plan` is the policy :func:`cp_attention.flash_decode` uses and :func:`prefix_plan` the one
of the shared-segment kernel of :func:`cp_attention.cascade_decode`. Both decide from shapes and the cache
capacity ``T_max`` only (never from device values), so a CUDA graph can be replayed with new ``seq_lens``.

Plans are NamedTuples, the way FlashInfer's ``plan()`` decides what its ``run()`` replays: a caller may
build one here and pass it to :func:`cp_attention.flash_decode` (``plan=``) to run another tile config
or split count (``benchmarks/tune_decode.py`` does).

Each config and policy below carries a one-line reason; the measurements behind them are in docs/tuning.md.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ._device import REFERENCE_SMS, num_sms, sm90, use_pdl

__all__ = ["num_splits", "num_sms", "use_pdl", "one_warp_fp8", "one_warp_plan", "DecodeConfig", "DecodePlan",
           "FOUR_PER_SM", "FP8_TWO_WARPS", "FP8_ONE_WARP", "FP8_ONE_WARP_LONG", "FP8_ONE_WARP_FEW", "FP8_ROWS_32",
           "ONE_WARP_CONFIGS", "ONE_WARP_MAX_ROWS", "ONE_WARP_MAX_ROWS_256", "ONE_WARP_PLAN_ROWS_256",
           "ONE_WARP_KEYS_PER_ROW", "FP8_TABLE_LOOP",
           "WIDE_HEADS", "WIDE_PAGES", "WIDE_FP8", "WIDE_FP8_TABLE_LOOP",
           "decode_config", "decode_plan", "deterministic_plan", "PrefixConfig", "PrefixPlan", "prefix_config",
           "prefix_plan", "plan_decode", "REFERENCE_SMS"]

# Shared memory one program may use on sm_90 (227 KB), for the programs-per-SM estimate.
_SMEM_PER_SM = 227 * 1024


def num_splits(work_items: int, slots: int, n_kv_blocks: int, max_splits: int = 128, *,
               efficiency: float = 0.85) -> int:
    """FlashAttention-2's split count (``num_splits_heuristic``): the smallest ``S`` whose last wave of
    ``work_items * S`` programs on ``slots`` is at least ``efficiency`` (85%) as full as the best ``S``
    achieves.

    Returns 1 when ``work_items >= 0.8 * slots`` (or there is no work). Split counts that give the same number of KV blocks
    per split as ``S - 1`` are skipped.

    >>> num_splits(8, 264, 1000)
    29
    """
    if work_items >= 0.8 * slots or work_items < 1:
        return 1
    max_splits = min(max_splits, slots, n_kv_blocks)
    eff = {}
    for s in range(1, max_splits + 1):
        if s == 1 or math.ceil(n_kv_blocks / s) != math.ceil(n_kv_blocks / (s - 1)):
            waves = work_items * s / slots
            eff[s] = waves / math.ceil(waves)
    if not eff:
        return 1
    best = max(eff.values())
    return next(s for s in sorted(eff) if eff[s] >= efficiency * best)


def one_warp_fp8(device: torch.device, kv_dtype: torch.dtype, head_dim: int, rows: int, t_max: int,
                 plain: bool, page_size: int = 0) -> bool:
    """Whether a decode runs the one-warp FP8 kernel (``ops/split_kv_fp8.py``, Note [One-warp FP8 tiles]),
    planned with :func:`one_warp_plan`: an FP8 cache of head dim 128 or 256 and more than 512 positions, dense or in
    pages of any size (``page_size``; 0: dense), at most :data:`ONE_WARP_MAX_ROWS` query rows per KV head
    (:data:`ONE_WARP_MAX_ROWS_256` at head dim 256; query rows x GQA group: a warp for each 16,
    :func:`one_warp_plan`), on a CUDA device of compute capability 9.x (the sm_90 kernel it was written and measured
    for; a Gluon kernel has no interpreter path), unless the environment sets ``CP_ATTENTION_ONE_WARP=0`` (read once
    per device). ``plain``: no deterministic splits and no given plan (which the Triton kernel keeps); windows,
    softcaps, sinks and row limits run here too. The plan may still refuse the call (:func:`one_warp_plan`: splits
    of too few keys a row).

    >>> one_warp_fp8(torch.device("cpu"), torch.float8_e4m3fn, 128, 4, 131072, True)
    False
    """
    max_rows = ONE_WARP_MAX_ROWS if head_dim == 128 else ONE_WARP_MAX_ROWS_256
    return (plain and device.type == "cuda" and kv_dtype.itemsize == 1 and head_dim in (128, 256) and rows <= max_rows
            and t_max > 512 and sm90(device))


def one_warp_plan(batch: int, num_kv_heads: int, t_max: int, num_sms: int, splits: int | None = None,
                  page_size: int = 0, rows: int = 1, head_dim: int = 128) -> DecodePlan | None:
    """The plan of the one-warp FP8 kernel (:func:`one_warp_fp8`): one wave of :data:`FP8_ONE_WARP`'s eight
    programs per SM (or ``splits``); where the pages, if any, hold whole 32-key tiles, in
    :data:`FP8_ONE_WARP_LONG`'s 32-key tiles (the same splits) where such a split holds more than
    :data:`LONG_SPLIT_KEYS` positions, and in one wave of :data:`FP8_ONE_WARP_FEW`'s four programs per SM (or
    ``splits``) where it holds at most :data:`FEW_SPLIT_KEYS` (:data:`FEW_SPLIT_KEYS_8_ROWS` for at most 8
    rows). A paged cache (``page_size`` > 0) gets the dense plan's splits, with one block-table entry read a tile
    where a page holds whole tiles (``page_tiles``: pages of a multiple of 16), else one a key. ``rows``: query rows
    per KV head (query rows x GQA group). 17-32 rows take :data:`FP8_ROWS_32`'s programs of two warps (16 rows each,
    one ring), one a split, four per SM, where the pages hold whole 32-key tiles (faster than row tiles, which
    each read the split's K/V); elsewhere row tiles of 16, a program each, counted in the wave like KV heads.
    ``None`` where the splits would hold fewer than :data:`ONE_WARP_KEYS_PER_ROW` keys a row (the Triton kernel's
    plan then: :func:`decode_plan`). Head dim 256 (``head_dim``) keeps :data:`FP8_ONE_WARP`'s 16-key tiles at
    eight programs per SM (the bytes of a 32-key tile at 128; 32-key tiles take 48 KB, eight do not fit an SM, and
    four programs per SM in 16- or 32-key tiles were slower). There it plans at most
    :data:`ONE_WARP_PLAN_ROWS_256` rows (``None`` above: the Triton kernel's plan). Measurements: docs/tuning.md.

    >>> [one_warp_plan(1, 8, t, 132)[:3] for t in (131072, 1 << 20)]  # doctest: +NORMALIZE_WHITESPACE
    [(DecodeConfig(block_n=32, num_warps=1, num_stages=3, programs=4, maxnreg=0, warp_rows=16), 66, 63),
     (DecodeConfig(block_n=32, num_warps=1, num_stages=3, programs=8, maxnreg=0, warp_rows=16), 132, 249)]
    >>> [one_warp_plan(1, 8, 1 << 20, 132, page_size=p)[::6] for p in (1, 16, 64)]  # doctest: +NORMALIZE_WHITESPACE
    [(DecodeConfig(block_n=16, num_warps=1, num_stages=3, programs=8, maxnreg=0, warp_rows=16), False),
     (DecodeConfig(block_n=16, num_warps=1, num_stages=3, programs=8, maxnreg=0, warp_rows=16), True),
     (DecodeConfig(block_n=32, num_warps=1, num_stages=3, programs=8, maxnreg=0, warp_rows=16), True)]
    >>> [one_warp_plan(1, 8, 131072, 132, page_size=p)[:3] for p in (16, 32)]  # doctest: +NORMALIZE_WHITESPACE
    [(DecodeConfig(block_n=16, num_warps=1, num_stages=3, programs=8, maxnreg=0, warp_rows=16), 131, 63),
     (DecodeConfig(block_n=32, num_warps=1, num_stages=3, programs=4, maxnreg=0, warp_rows=16), 66, 63)]
    >>> one_warp_plan(1, 8, 131072, 132, rows=20)[:3]  # doctest: +NORMALIZE_WHITESPACE
    (DecodeConfig(block_n=32, num_warps=2, num_stages=3, programs=4, maxnreg=0, warp_rows=16), 66, 63)
    >>> one_warp_plan(1, 8, 4131, 132, rows=16) is None  # 65 splits of 64 keys: 4 keys a row
    True
    """
    if head_dim > 128 and rows > ONE_WARP_PLAN_ROWS_256:
        return None
    if rows > 16 and page_size % FP8_ROWS_32.block_n == 0:  # a warp for each 16 rows, a program a split
        plan = _fp8_splits(batch, num_kv_heads, t_max, num_sms, splits, FP8_ROWS_32, head_dim)
        plan = plan._replace(page_tiles=page_size > 0)
    else:
        plan = _row_tile_plan(batch, num_kv_heads, t_max, num_sms, splits, page_size, rows, head_dim)
    return plan if plan.tiles_per_split * plan.config.block_n >= ONE_WARP_KEYS_PER_ROW * rows else None


def _fp8_splits(batch: int, heads: int, t_max: int, num_sms: int, splits: int | None, config,
                head_dim: int = 128) -> DecodePlan:
    """:func:`decode_plan`'s one wave of ``config`` for the one-warp kernel (an FP8 cache)."""
    return decode_plan(batch, heads, t_max, head_dim, torch.bfloat16, num_sms, splits, config, torch.float8_e4m3fn)


def _row_tile_plan(batch: int, num_kv_heads: int, t_max: int, num_sms: int, splits: int | None, page_size: int,
                   rows: int, head_dim: int) -> DecodePlan:
    """:func:`one_warp_plan` in programs of one warp, a row tile of 16 rows each."""
    row_tiles = -(-rows // 16)
    heads = num_kv_heads * row_tiles
    plan = _fp8_splits(batch, heads, t_max, num_sms, splits, FP8_ONE_WARP, head_dim)
    keys = plan.tiles_per_split * FP8_ONE_WARP.block_n
    # head dim 256 keeps the 16-key tiles (:func:`one_warp_plan`)
    if head_dim == 128 and page_size % FP8_ONE_WARP_LONG.block_n == 0 and keys > LONG_SPLIT_KEYS:
        plan = _fp8_splits(batch, heads, t_max, num_sms, plan.num_splits, FP8_ONE_WARP_LONG)
    elif (head_dim == 128 and page_size % FP8_ONE_WARP_FEW.block_n == 0
          and keys <= (FEW_SPLIT_KEYS_8_ROWS if rows <= 8 else FEW_SPLIT_KEYS)):
        plan = _fp8_splits(batch, heads, t_max, num_sms, splits, FP8_ONE_WARP_FEW)
    return plan._replace(page_tiles=page_size > 0 and page_size % plan.config.block_n == 0)


# ----------------------------------------------------------------------------------------------------
# Split-KV decode (ops/split_kv.py)


class DecodeConfig(NamedTuple):
    """Tile config of the split-KV kernel: ``block_n`` keys per tile, ``num_warps``, ``num_stages``
    (software-pipelined K/V tiles in flight); ``programs``: programs that share an SM where measured (0:
    estimated from the shared memory of the K/V stages); ``maxnreg``: registers per thread the compiler may
    use (0: its choice), where a config counts on ``programs`` that the registers would otherwise not let
    in (set by :data:`FOUR_PER_SM` and :data:`WIDE_PAGES` only: capping every config that sets ``programs``
    was slower; docs/tuning.md). ``warp_rows``: the query rows each warp holds in the one-warp FP8
    kernel (16, one ``m16n8k16`` row block: Note [One-warp FP8 tiles]); 0 for the Triton kernels."""

    block_n: int
    num_warps: int
    num_stages: int
    programs: int = 0
    maxnreg: int = 0
    warp_rows: int = 0

    def programs_per_sm(self, head_dim: int, dtype: torch.dtype) -> int:
        """How many programs share an SM: :attr:`programs`, or the estimate from the K/V pipeline's shared
        memory."""
        if self.programs:
            return self.programs
        block_d = 1 << (head_dim - 1).bit_length()
        smem = self.num_stages * 2 * self.block_n * block_d * dtype.itemsize
        return max(1, min(4, _SMEM_PER_SM // max(smem, 1)))


class DecodePlan(NamedTuple):
    """What one :func:`cp_attention.flash_decode` launch runs: the tile config, ``num_splits`` splits of
    ``tiles_per_split`` tiles each (the last split may be shorter; in the one-warp FP8 configs every
    ``num_splits``-th tile, at most ``tiles_per_split``: Note [Strided splits]); ``deterministic``: the splits of a
    fixed ``split_size``, merged by the separate combine (Note [Deterministic splits] in
    ``ops/split_kv.py``); ``split_pages`` > 0: a paged cache whose block-table entries of a split (at most
    that many) are read into registers before the loop (Note [Paged tiles from registers]); ``streams`` >
    1: a dense cache's tiles read as that many key streams with states of their own (Note [Key streams]
    in ``ops/_state.py``; ``config.block_n`` a multiple of ``16 * streams``, query tiles of 16 rows);
    ``page_tiles``: a paged cache whose pages hold whole tiles, each tile's block-table entry loaded in the
    loop, one a tile (pages of a multiple of ``config.block_n`` positions, ``split_pages`` 0; Note [Paged
    tiles from registers])."""

    config: DecodeConfig
    num_splits: int
    tiles_per_split: int
    deterministic: bool = False
    split_pages: int = 0
    streams: int = 1
    page_tiles: bool = False


# A split's block-table entries held in registers at most (Note [Paged tiles from registers]). A tile's
# pages are gathered through shared memory, whose cost does not grow with the entries; 2048 entries take
# 198 registers (bf16) or 247 (FP8) on sm_90 without spills (docs/tuning.md).
MAX_SPLIT_PAGES = 2048
# Where the dense plan's splits hold more entries, splits capped at MAX_SPLIT_PAGES entries are planned when
# they still hold at least this many tiles (pages of 16 or more with 128-key tiles).
MIN_CAPPED_TILES = 64


def table_pages(plan: DecodePlan, page_size: int) -> int:
    """The block-table entries one split of ``plan`` touches, rounded up to a power of two, when a paged
    cache of ``page_size`` can take them into registers (a power of two of 16 or more; at most
    :data:`MAX_SPLIT_PAGES`); else 0."""
    block_n = plan.config.block_n
    if page_size < 16 or page_size & (page_size - 1) or plan.deterministic:
        return 0
    pages = 1 << (-(-plan.tiles_per_split * block_n // page_size) + (page_size > block_n) - 1).bit_length()
    return pages if pages <= MAX_SPLIT_PAGES else 0


# "Many sequences": at least this many (sequence, KV head) pairs per SM, the waves of the rules below
MANY_WAVES = 3
# 16-bit caches: two waves of programs replace one where one leaves program slots idle and two fill more of
# them, if the two-wave splits still hold at least this many tiles (B = 1 with 8 KV heads on 132 SMs: 33
# splits from 512k positions; docs/tuning.md)
TWO_WAVE_MIN_TILES = 96
# 64-key tiles in two stages, four programs per SM (registers capped at 128): many sequences × KV heads
FOUR_PER_SM = DecodeConfig(64, 4, 2, programs=4, maxnreg=128)  # 65536 registers / (4 programs x 128 threads)
# FP8 caches outside the one-warp kernel's domain (:func:`one_warp_fp8`), dense or paged: 64-key tiles, two
# warps, three stages, four programs per SM (23-49 KB of shared memory, 241-255 registers on sm_90 without
# spills for query tiles of up to 32 rows; 64 rows spill)
FP8_TWO_WARPS = DecodeConfig(64, 2, 3, programs=4)
# The one-warp FP8 kernel of sm_90 (ops/split_kv_fp8.py, :func:`one_warp_fp8`): 16-key tiles, one warp, a ring
# of three stages, eight programs per SM (142-144 registers with the keys as the mma rows, up to 8 rows; 184-195
# with 16; 12 KB of shared memory; twelve per SM were level or slower: docs/tuning.md); at head dim 256 the same
# tiles hold twice the bytes (237-242 registers up to 8 rows, 255 above, 24 KB)
FP8_ONE_WARP = DecodeConfig(16, 1, 3, programs=8, warp_rows=16)
# ... in 32-key tiles (168 registers up to 8 rows, 225-227 above, 24 KB; still eight per SM) for splits of more
# than LONG_SPLIT_KEYS positions, where fewer, longer tiles win (at 4096 and below 16-key tiles are level or
# faster: docs/tuning.md)
FP8_ONE_WARP_LONG = DecodeConfig(32, 1, 3, programs=8, warp_rows=16)
LONG_SPLIT_KEYS = 4096
# ... in 32-key tiles at four programs per SM (the same kernel as FP8_ONE_WARP_LONG, half the splits, each
# twice as long) where FP8_ONE_WARP's splits hold at most FEW_SPLIT_KEYS positions: short splits pay their
# fixed cost (ring fill, state) less often; where the splits are longer it was no faster (docs/tuning.md)
FP8_ONE_WARP_FEW = DecodeConfig(32, 1, 3, programs=4, warp_rows=16)
FEW_SPLIT_KEYS = 2048
# ... and up to LONG_SPLIT_KEYS where the keys are the mma rows (at most 8 rows a KV head: Note [Keys as the mma
# rows]), whose tiles take fewer registers, so four programs of 32-key tiles win up to splits of 4096 positions
# (docs/tuning.md)
FEW_SPLIT_KEYS_8_ROWS = LONG_SPLIT_KEYS
# ... for 17-32 query rows per KV head: a warp for each 16 rows sharing one ring of 32-key tiles, four programs
# (eight warps) per SM (the one-warp kernel's loop in each warp; 204 registers, 24 KB)
FP8_ROWS_32 = DecodeConfig(32, 2, 3, programs=4, warp_rows=16)
ONE_WARP_CONFIGS = (FP8_ONE_WARP, FP8_ONE_WARP_LONG, FP8_ONE_WARP_FEW, FP8_ROWS_32)
# The most query rows per KV head (query rows x GQA group) that the one-warp kernel takes: in one program of a
# warp per 16 rows where the pages hold whole 32-key tiles (dense included), else in row tiles of 16, a program
# each reading the split's K/V. More rows stay on the Triton kernel's 64-row tiles, which were faster than four
# warps a program or four row tiles (each warp does a whole tile's work for its rows; docs/tuning.md)
ONE_WARP_MAX_ROWS = 32
# ... at head dim 256: one warp (the two-warp programs spill 496 bytes of registers there, Triton 3.6, sm_90; not
# measured); more rows stay on the Triton kernel (WIDE_FP8)
ONE_WARP_MAX_ROWS_256 = 16
# ... and the most it is planned for (more rows run there only with a given plan): up to 8 rows the keys are the
# mma rows (Note [Keys as the mma rows]) and the kernel is faster than the Triton kernel; 9-16 rows (the rows'
# form, 255 registers and spills) were slower (docs/tuning.md)
ONE_WARP_PLAN_ROWS_256 = 8
# Each split of the one-warp kernel writes a state of 516 bytes a query row that the combine reads back; where
# its plan's splits hold fewer than this many keys a row, the states rival the splits' K/V (256 bytes a key in
# FP8) and the Triton kernel, whose wider programs take fewer splits, is faster (docs/tuning.md)
ONE_WARP_KEYS_PER_ROW = 8
# FP8 page pools read one table entry per key: the same tiles in five stages, which Triton's pipeliner turns
# into two K/V tiles in flight beside the table load's stage (three or four stages: one; sm_90, 232-255
# registers, 40-46 KB, four programs per SM)
FP8_TABLE_LOOP = DecodeConfig(64, 2, 5, programs=4)
# Head dims over 128 (dense caches, query tiles of at most 32 rows), counted from sm_90 compiles at D = 256:
# 16-bit, two programs per SM (105-128 registers x 256 threads, 76-87 KB); FP8 (where the one-warp kernel does not
# run: more than 32 rows, deterministic splits, a given plan, no sm_90 GPU), 32-key tiles of two warps,
# four per SM (251-255 registers x 64 threads, 42-52 KB; tiles of at most 8 query rows pair their values,
# 168-248 registers and 43 KB, where five would fit: four are planned, as measured; split_kv.pairs_values).
WIDE_HEADS = DecodeConfig(64, 8, 2, programs=2)
WIDE_FP8 = DecodeConfig(32, 2, 3, programs=4)
# FP8 page pools of at least two tiles a page, one table entry loaded a tile (``DecodePlan.page_tiles``): the
# two-warp tiles in five stages, which keep two K/V tiles in flight beside the table load's stage (sm_90,
# 251-255 registers, 39-42 KB, four programs per SM); head dims of at most 128 take FP8_TABLE_LOOP
WIDE_FP8_TABLE_LOOP = DecodeConfig(32, 2, 5, programs=4)
# 16-bit page pools of head dims over 128 through the register table: WIDE_HEADS with its registers capped at
# 128 (uncapped, pages of 128 and 256 take 159-172 registers on sm_90: one program per SM, not two; capped, no
# spills for pages of 16-256 and query tiles of up to 32 rows). The dense specs keep their 105-128 uncapped.
WIDE_PAGES = DecodeConfig(64, 8, 2, programs=2, maxnreg=128)


def decode_config(head_dim: int, dtype: torch.dtype, t_max: int | None = None, page_size: int = 0,
                  kv_dtype: torch.dtype | None = None, waves: float = 0.0, rows: int = 1,
                  table: bool = False) -> DecodeConfig:
    """The split-KV kernel's tile config (measured on the H200: docs/tuning.md): 128-key tiles with three
    stages in flight, one program per SM; 64-key tiles in two stages for caches of at most 512 positions
    (more splits for a short cache), and for a 16-bit cache (dense, or paged through the register path) of at
    most 2048 with ``waves`` (sequences × KV heads per SM) of 3 or more, four programs per SM with their
    registers capped to fit (:data:`FOUR_PER_SM`: many short sequences fill the SMs with more, shorter
    programs); 256-key tiles for a 16-bit cache of head dim 64 from 32k positions on (the bytes of a 128 x 128
    tile).

    An FP8 cache of more than 512 positions, head dim 65-128, read by query tiles of at most 32 rows
    (``rows``: query rows per KV head, Q x GQA) takes :data:`FP8_TWO_WARPS`, dense or paged (through the
    register table, ``table``, or one table entry per key). (On sm_90, ``flash_decode`` gives the caches,
    dense or paged, of head dim 128 and at most :data:`ONE_WARP_MAX_ROWS` rows (256: at most
    :data:`ONE_WARP_MAX_ROWS_256`) to the one-warp kernel instead, unless the splits are deterministic or the
    plan is given: :func:`one_warp_fp8`, :func:`one_warp_plan`.) The FP8 loop is bound by the latency of each
    tile's chain (the conversions' shared-memory round trips, cross-warp reductions), not by bytes or
    issue: two warps a program halve the cross-warp work and four programs per SM overlap the chains.
    Sixteen draft rows (64 rows a tile) keep 128 x 4 x 3 (64 rows spill in two warps). One table entry per
    key takes :data:`FP8_TABLE_LOOP`, whose five stages keep two K/V tiles in flight beside the table load.

    Head dims over 128 (dense caches, query tiles of at most 32 rows): :data:`WIDE_HEADS` for 16-bit
    caches, two programs per SM (the shared-memory estimate of :meth:`DecodeConfig.programs_per_sm`
    would count one for 64 x 4 x 2 tiles, whose pipeline holds one K/V buffer, not two), and
    :data:`WIDE_FP8` for FP8 ones, the FP8 two-warp shape at half the keys a tile. Page pools through the
    register table (``table``) take :data:`WIDE_FP8` (FP8) and, below 3 waves, :data:`WIDE_PAGES` (16-bit;
    64 x 4 x 2 from 3 waves on, where it was faster). One table entry per key and 64-row tiles keep 64 x 4 x 2
    (not measured).

    ``page_size`` > 0 (a paged cache): 64-key tiles, of which four programs share an SM (126 registers
    per thread, 39 KB of shared memory: Triton's pipeliner gives the block-table load of a tile a stage of
    its own and keeps one K/V tile in flight, so the paged kernel trades the second buffer for more programs),
    three with pages of one position (159 registers). An FP8 page
    pool read this way (one table entry per key: windows, row limits, pages that are not a power of two of
    16 or more) that does not take :data:`FP8_TABLE_LOOP` (query tiles of 64 rows, head dims of at most 64)
    takes 148-185 registers on sm_90 at four warps: two programs per SM are counted.

    >>> decode_config(128, torch.bfloat16, 131072, page_size=16)
    DecodeConfig(block_n=64, num_warps=4, num_stages=3, programs=4, maxnreg=0, warp_rows=0)
    """
    if dtype == torch.float32:
        return DecodeConfig(64, 4, 2) if head_dim <= 128 else DecodeConfig(32, 4, 2)
    if head_dim > 128:
        if page_size or rows > 32:  # one table entry per key, or query tiles of 64 rows
            return DecodeConfig(64, 4, 2)
        if (kv_dtype or dtype).itemsize == 1:
            return WIDE_FP8
        if table:
            return WIDE_PAGES if waves < MANY_WAVES else DecodeConfig(64, 4, 2)
        return WIDE_HEADS
    many_short = t_max is not None and 512 < t_max <= 2048 and waves >= MANY_WAVES and not page_size
    if many_short and (kv_dtype or dtype).itemsize == 2:
        return FOUR_PER_SM
    if t_max is not None and t_max <= 512:
        return DecodeConfig(64, 4, 2)
    if (kv_dtype or dtype).itemsize == 1 and head_dim > 64 and rows <= 32:  # dense, the register table, or not
        return FP8_TABLE_LOOP if page_size else FP8_TWO_WARPS
    if page_size:
        if (kv_dtype or dtype).itemsize == 1:  # FP8, 64 rows: 148-185 registers on sm_90, two programs fit an SM
            return DecodeConfig(64, 4, 3, programs=2)
        return DecodeConfig(64, 4, 3, programs=4 if page_size > 1 else 3)
    if head_dim <= 64 and t_max is not None and t_max >= 32768 and (kv_dtype or dtype).itemsize == 2:
        return DecodeConfig(256, 4, 3)
    return DecodeConfig(128, 4, 3)


def deterministic_plan(t_max: int, head_dim: int, dtype: torch.dtype, split_size: int) -> DecodePlan:
    """The plan of ``split_size``: splits ``[j * split_size, (j + 1) * split_size)`` of the cache's
    capacity, tiles of the tuned config's size or the largest power of two that divides ``split_size``.
    Independent of the batch and the device, so a request's output is too.

    >>> deterministic_plan(100_000, 128, torch.bfloat16, 4096)
    DecodePlan(config=DecodeConfig(block_n=128, num_warps=4, num_stages=3, programs=0, maxnreg=0, warp_rows=0), num_splits=25, tiles_per_split=32, deterministic=True, split_pages=0, streams=1, page_tiles=False)
    """
    config = decode_config(head_dim, dtype)
    block_n = config.block_n
    while split_size % block_n:
        block_n //= 2
    config = config._replace(block_n=block_n)
    return DecodePlan(config, max(1, math.ceil(t_max / split_size)), split_size // block_n, True)


@functools.lru_cache(maxsize=4096)
def decode_plan(batch: int, num_kv_heads: int, t_max: int, head_dim: int, dtype: torch.dtype,
                num_sms: int, splits: int | None = None, config: DecodeConfig | None = None,
                kv_dtype: torch.dtype | None = None, page_size: int = 0, aligned: bool = True,
                rows: int = 1) -> DecodePlan:
    """The plan of a decode over ``batch * num_kv_heads`` (sequence, KV head) pairs and a cache of
    capacity ``t_max``, on a device with ``num_sms`` SMs.

    ``splits`` None: the tuned policy; it runs one wave of programs (more splits only add combine work),
    takes the fullest one (FA2 settles for 85% of it, which here would leave up to 15% of the SMs idle for
    the whole kernel), or, for a 16-bit cache, two waves where they fill more of the program slots with
    splits of at least :data:`TWO_WAVE_MIN_TILES` tiles. An int fixes the count (capped at the number of
    tiles). A split may be a single tile: at short contexts the latency of fewer, longer splits costs more than
    the extra states (docs/tuning.md). ``config`` None: :func:`decode_config`
    of the query's ``dtype``; the shared memory of its K/V stages (programs per SM) counts in
    ``kv_dtype`` (default ``dtype``; an FP8 cache takes half). ``page_size`` > 0: the cache is read
    through a block table of pages of that size: the dense cache's plan with the table in registers where a
    split's entries fit (16-bit pages of less than 64 positions at 3 waves or more of sequences × KV heads,
    head dims of at most 128: with :data:`FOUR_PER_SM`, whose other programs hide the barrier of a tile's
    gather; at head dim 256 it was slower) (:func:`table_pages`; ``aligned``: the splits start on a tile, i.e.
    no window and no row limits), with its splits capped to fit where they do not (:data:`MIN_CAPPED_TILES`), else
    :func:`decode_config`'s paged config, one table entry per key. FP8 pools whose pages hold two tiles or
    more (head dim <= 128: pages of 128 and more; 256: 64 and more) take the dense plan's splits with one
    table entry loaded a tile (``page_tiles``, in :data:`FP8_TABLE_LOOP` or :data:`WIDE_FP8_TABLE_LOOP`:
    no shared-memory round trip and no barrier, faster than the register table on those pages; Note [Paged
    tiles from registers], docs/tuning.md).
    ``rows``: query rows per KV head in a program's tile (query rows x GQA group), for
    :func:`decode_config`.

    >>> decode_plan(1, 8, 131072, 128, torch.bfloat16, 132).num_splits
    16
    >>> decode_plan(1, 8, 1 << 20, 128, torch.bfloat16, 132).num_splits  # two waves: every SM reads
    33
    >>> decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, page_size=64).split_pages
    128
    >>> decode_plan(16, 8, 131072, 128, torch.bfloat16, 132, page_size=16)[1:]  # one split of 1024 tiles, capped
    (4, 256, False, 2048, 1, False)
    """
    waves = batch * num_kv_heads / num_sms
    if page_size and aligned and config is None:
        # pages of less than 64: a tile's pages gathered, its barrier hidden by the other programs
        gathered = (page_size < 64 and waves >= MANY_WAVES and (kv_dtype or dtype).itemsize == 2
                    and head_dim <= 128)
        dense = decode_plan(batch, num_kv_heads, t_max, head_dim, dtype, num_sms, splits,
                            FOUR_PER_SM if gathered else decode_config(head_dim, dtype, t_max, 0, kv_dtype, waves,
                                                                       rows, table=True), kv_dtype)
        block_n = dense.config.block_n
        if page_size >= 2 * block_n and dense.config in (FP8_TWO_WARPS, WIDE_FP8):  # one table entry a tile
            return dense._replace(config=FP8_TABLE_LOOP if dense.config == FP8_TWO_WARPS else WIDE_FP8_TABLE_LOOP,
                                  streams=1, page_tiles=True)
        capped = (MAX_SPLIT_PAGES - (page_size > block_n)) * page_size // block_n  # a mid-page start: one more
        if not table_pages(dense, page_size) and capped >= MIN_CAPPED_TILES and splits is None:
            n_blocks = max(1, math.ceil(t_max / block_n))
            n_splits = math.ceil(n_blocks / capped)
            dense = dense._replace(num_splits=n_splits, tiles_per_split=math.ceil(n_blocks / n_splits))
        pages = table_pages(dense, page_size)
        if pages:
            return dense._replace(split_pages=pages, streams=1)
    config = config or decode_config(head_dim, dtype, t_max, page_size, kv_dtype, waves, rows)
    n_blocks = max(1, math.ceil(t_max / config.block_n))
    if splits is None:
        work = batch * num_kv_heads
        slots = num_sms * config.programs_per_sm(head_dim, kv_dtype or dtype)
        splits = num_splits(work, slots, n_blocks, max_splits=max(1, slots // max(work, 1)), efficiency=1.0)
        if (kv_dtype or dtype).itemsize == 2:  # two waves where they fill more slots than one: over twice the splits
            two = num_splits(work, 2 * slots, n_blocks, max_splits=max(1, 2 * slots // max(work, 1)), efficiency=1.0)
            if two > 2 * splits and n_blocks >= two * TWO_WAVE_MIN_TILES:
                splits = two
    tiles = math.ceil(n_blocks / min(splits, n_blocks))
    return DecodePlan(config, math.ceil(n_blocks / tiles), tiles,
                      streams=key_streams(config, tiles, rows) if not page_size else 1)


# A split of the FP8 two-warp config takes four key streams from this many tiles on (Note [Key streams])
MIN_STREAM_TILES = 48


def key_streams(config: DecodeConfig, tiles_per_split: int, rows: int) -> int:
    """Key streams of a dense cache's split (Note [Key streams] in ``ops/_state.py``): 4 (two per warp) for
    :data:`FP8_TWO_WARPS` splits of at least :data:`MIN_STREAM_TILES` tiles read by query tiles of 16 rows
    (``rows`` <= 16), else 1 (the streams' fixed cost per program, ~5 µs, against ~0.11 µs saved per tile:
    even at ~45 tiles; docs/tuning.md).

    >>> key_streams(FP8_TWO_WARPS, 128, 4), key_streams(FP8_TWO_WARPS, 32, 4), key_streams(FP8_TWO_WARPS, 128, 32)
    (4, 1, 1)
    """
    return 4 if config == FP8_TWO_WARPS and tiles_per_split >= MIN_STREAM_TILES and rows <= 16 else 1


# ----------------------------------------------------------------------------------------------------
# Shared-segment attention of cascade levels (ops/prefix.py)


class PrefixConfig(NamedTuple):
    """Tile config of the shared-segment kernel: ``block_m`` query rows, ``block_n`` keys per tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class PrefixPlan(NamedTuple):
    """One shared level's launch: ``n_tiles`` row tiles, ``num_splits`` splits of ``tiles_per_split``."""

    config: PrefixConfig
    n_tiles: int
    num_splits: int
    tiles_per_split: int


def prefix_config(head_dim: int, dtype: torch.dtype, rows_per_segment: int) -> PrefixConfig:
    """Tile config for segments read by about ``rows_per_segment`` query rows (requests × query heads per
    KV head).

    ``block_m`` is 128 (two warpgroups of ``wgmma`` on sm_90) when there are rows enough, else the next
    power of two down to 16 (the smallest ``tl.dot`` tile).

    >>> prefix_config(128, torch.bfloat16, 512)
    PrefixConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    """
    block_m = min(128 if head_dim <= 128 else 64, max(16, 1 << (max(rows_per_segment, 1) - 1).bit_length()))
    num_warps = 8 if block_m == 128 else 4
    if dtype == torch.float32:
        return PrefixConfig(block_m, 32, num_warps, 2)
    if head_dim <= 64:
        return PrefixConfig(block_m, 128, num_warps, 3)
    if head_dim <= 128:
        return PrefixConfig(block_m, 64, num_warps, 3)
    return PrefixConfig(block_m, 32, num_warps, 2)


# A shared-level split covers at least this many K/V tiles, and pays this many tile-times of prologue,
# state write and merge share.
_PREFIX_MIN_TILES_PER_SPLIT = 4
_PREFIX_SPLIT_COST = 2


def prefix_num_splits(work_items: int, n_kv_blocks: int, num_sms: int) -> int:
    """Splits of a shared level's tokens for ``work_items`` (row tiles × KV heads) programs per split.

    A 128-row program holds a whole SM (about 170 registers × 256 threads, 128 KB of shared memory), so
    ``S`` splits run in ``ceil(work_items * S / num_sms)`` waves of ``ceil(n_kv_blocks / S) + 2``
    tile-times each (the constant is a split's prologue, state write and merge share). The policy takes
    the ``S`` of least modelled time (the fewest splits on a tie), with at least 4 tiles a split.

    >>> prefix_num_splits(32, 512, 132)  # B = 128, GROUP = 4, BLOCK_M = 128, Hkv = 8, 32k tokens
    4
    """
    max_splits = max(1, min(128, n_kv_blocks // _PREFIX_MIN_TILES_PER_SPLIT))
    best, best_time = 1, None
    for target in range(1, max_splits + 1):
        tiles = math.ceil(n_kv_blocks / target)
        splits = math.ceil(n_kv_blocks / tiles)  # the count that chunks of `tiles` tiles really give
        t = math.ceil(work_items * splits / num_sms) * (tiles + _PREFIX_SPLIT_COST)
        if best_time is None or t < best_time:
            best, best_time = splits, t
    return best


@functools.lru_cache(maxsize=4096)
def prefix_plan(batch: int, group: int, num_kv_heads: int, n_read: int, t_max: int, head_dim: int,
                dtype: torch.dtype, num_sms: int, splits: int | None = None,
                config: PrefixConfig | None = None) -> PrefixPlan:
    """The plan of one shared level: ``n_read`` segments (at most ``min(S, B)``) read by ``batch``
    requests of ``group`` query heads per KV head. Row tiles never cross a segment, so there are at most
    ``ceil(batch * group / block_m) + n_read - 1`` of them. Shapes only, so cached: an eager call of
    :func:`cp_attention.cascade_decode` does not redo the split search (up to 128 split counts)."""
    config = config or prefix_config(head_dim, dtype, math.ceil(batch * group / max(n_read, 1)))
    n_tiles = math.ceil(batch * group / config.block_m) + n_read - 1
    n_blocks = max(1, math.ceil(t_max / config.block_n))
    if splits is None:
        splits = prefix_num_splits(n_tiles * num_kv_heads, n_blocks, num_sms)
    tiles = math.ceil(n_blocks / min(splits, n_blocks))
    return PrefixPlan(config, n_tiles, math.ceil(n_blocks / tiles), tiles)


def positions_read(t_max: int, q_rows: int, window_left: int | None = None, span: int | None = None) -> int:
    """The positions a call's splits must cover, from a row's first: ``T_max``, or under a window its
    ``window_left + Q`` (a context-parallel rank's share of one: ``span``)."""
    reach = t_max if window_left is None else min(t_max, window_left + q_rows)
    return reach if span is None else min(reach, span)


def plan_decode(device: torch.device, batch: int, num_kv_heads: int, t_max: int, head_dim: int, dtype: torch.dtype,
                kv_dtype: torch.dtype, q_rows: int, group: int, page_size: int, *, num_splits: int | None = None,
                window_left: int | None = None, row_limits: bool = False, span: int | None = None,
                split_size: int | None = None, plan: DecodePlan | None = None) -> DecodePlan:
    """The plan :func:`cp_attention.flash_decode` runs: ``plan`` when given (checked against the one-warp FP8
    kernel's domain), the deterministic splits of ``split_size``, else the one-warp FP8 kernel's plan where it
    applies (:func:`one_warp_fp8`) and :func:`decode_plan` otherwise. A window (or a context-parallel rank's
    share of one, ``span``) bounds the positions a call reads: the splits tile that reach from the first
    position, not the whole cache."""
    rows = q_rows * group
    plain = split_size is None  # the domain of the one-warp FP8 kernel beyond dtype and shapes
    if split_size is not None:
        plan = deterministic_plan(t_max, head_dim, dtype, split_size)
    elif plan is None:
        reach = positions_read(t_max, q_rows, window_left, span)
        if one_warp_fp8(device, kv_dtype, head_dim, rows, reach, plain, page_size):
            # splits from a whole tile below the first key
            margin = FP8_ONE_WARP_LONG.block_n - 1 if window_left is not None or row_limits else 0
            plan = one_warp_plan(batch, num_kv_heads, min(t_max, reach + margin), num_sms(device), num_splits,
                                 page_size, rows, head_dim)  # None: splits too short for the rows' states
        if plan is None:
            plan = decode_plan(batch, num_kv_heads, reach, head_dim, dtype, num_sms(device), num_splits,
                               kv_dtype=kv_dtype, page_size=page_size,
                               aligned=window_left is None and not row_limits, rows=rows)
    if plan.config in ONE_WARP_CONFIGS and not (
            one_warp_fp8(device, kv_dtype, head_dim, rows, t_max, plain, page_size)
            and plan.page_tiles == (page_size > 0 and page_size % plan.config.block_n == 0)
            and (plan.page_tiles or not page_size or plan.config == FP8_ONE_WARP)
            and not plan.split_pages and plan.streams == 1):
        raise ValueError(f"plan: the one-warp FP8 configs run an FP8 cache of head dim 128 or 256 and more than "
                         f"512 positions read by at most {ONE_WARP_MAX_ROWS} query rows per KV head, dense or paged "
                         f"(page_tiles where a page holds whole tiles, else 16-key tiles with an entry a key), "
                         f"without split_size, on an sm_90 GPU")
    return plan
