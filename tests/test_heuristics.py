"""The planning module: the FA2 rule reproduces FlashAttention-2's split table; the tuned policies give exact,
shape-only plans (the plans docs/tuning.md's figures were measured with)."""
import itertools
import math

import pytest
import torch

from cp_attention.heuristics import (FOUR_PER_SM, FP8_ONE_WARP, FP8_ONE_WARP_FEW, FP8_ONE_WARP_LONG, FP8_ROWS_32,
                                      FP8_TABLE_LOOP, FP8_TWO_WARPS, ONE_WARP_KEYS_PER_ROW, ONE_WARP_PLAN_ROWS_256,
                                      REFERENCE_SMS, WIDE_FP8, WIDE_FP8_TABLE_LOOP, WIDE_HEADS, WIDE_PAGES,
                                      DecodeConfig, DecodePlan, PrefixConfig, decode_config, decode_plan, num_sms,
                                      num_splits, prefix_config, prefix_num_splits, one_warp_fp8, one_warp_plan,
                                      prefix_plan)
from cp_attention.ops.split_kv import kernel_rows


def test_fa2_split_table():
    # Seed 002 section 6: 132 SMs, slots = 2 * SMs, BLOCK_N = 128.
    rows = [(1, 8, 128_000), (1, 32, 32_000), (4, 8, 8_000), (16, 8, 4_000), (64, 32, 2_000), (1, 8, 300)]
    got = [num_splits(b * h, 2 * 132, math.ceil(t / 128)) for b, h, t in rows]
    assert got == [29, 7, 7, 2, 1, 3]


def test_num_sms_of_a_cpu_device_is_the_reference():
    assert num_sms(torch.device("cpu")) == REFERENCE_SMS == 132


def test_decode_configs():
    assert decode_config(128, torch.bfloat16) == DecodeConfig(128, 4, 3)
    assert decode_config(128, torch.bfloat16, 512) == DecodeConfig(64, 4, 2)
    # many short sequences (3 waves of sequences x KV heads or more): four programs per SM
    assert decode_config(128, torch.bfloat16, 2048, waves=512 / 132) == FOUR_PER_SM
    assert decode_config(128, torch.bfloat16, 2048, waves=128 / 132) == DecodeConfig(128, 4, 3)
    assert decode_config(128, torch.bfloat16, 8192, waves=512 / 132) == DecodeConfig(128, 4, 3)
    # FP8 caches: two warps a program, four programs per SM, for query tiles of up to 32 rows, dense or paged
    fp8 = torch.float8_e4m3fn
    assert decode_config(128, torch.bfloat16, 2048, waves=512 / 132, kv_dtype=fp8) == FP8_TWO_WARPS
    assert decode_config(128, torch.bfloat16, 131072, kv_dtype=fp8, rows=32) == FP8_TWO_WARPS
    assert decode_config(128, torch.bfloat16, 131072, kv_dtype=fp8, rows=64) == DecodeConfig(128, 4, 3)
    assert decode_config(128, torch.bfloat16, 131072, kv_dtype=fp8, table=True) == FP8_TWO_WARPS
    assert decode_config(128, torch.bfloat16, 131072, page_size=1, kv_dtype=fp8, rows=32) == FP8_TABLE_LOOP
    assert decode_config(128, torch.bfloat16, 131072, page_size=1, kv_dtype=fp8, rows=64) == DecodeConfig(
        64, 4, 3, programs=2)
    assert decode_config(128, torch.bfloat16, 512, kv_dtype=fp8) == DecodeConfig(64, 4, 2)
    assert decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, kv_dtype=fp8)[:3] == (FP8_TWO_WARPS, 64, 32)
    assert decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, kv_dtype=fp8, rows=64).config.num_warps == 4
    # many short sequences: four programs per SM, 128 registers each, for a dense cache and the paged one
    assert decode_plan(64, 8, 2048, 128, torch.bfloat16, 132).config == FOUR_PER_SM
    for page_size in (16, 64):
        plan = decode_plan(64, 8, 2048, 128, torch.bfloat16, 132, page_size=page_size)
        assert plan.config == FOUR_PER_SM and plan.config.maxnreg == 128
    assert decode_config(128, torch.bfloat16, 512, waves=4).maxnreg == 0  # short caches: no cap
    assert decode_config(128, torch.bfloat16, 131072, page_size=1).maxnreg == 0  # capped: 33% slower at B=64 8k
    # pages of 16 at 3 waves and more: four programs per SM at every length (capped splits at 128k)
    assert decode_plan(64, 8, 8192, 128, torch.bfloat16, 132, page_size=16)[:3] == (FOUR_PER_SM, 1, 128)
    assert decode_plan(64, 8, 131072, 128, torch.bfloat16, 132, page_size=16)[:] == (FOUR_PER_SM, 4, 512, False,
                                                                                    2048, 1, False)
    assert decode_plan(64, 8, 8192, 128, torch.bfloat16, 132, page_size=64).config == DecodeConfig(128, 4, 3)
    assert decode_plan(16, 8, 8192, 128, torch.bfloat16, 132, page_size=16).config == DecodeConfig(128, 4, 3)
    # FP8 page pools: the dense FP8 plan, one stream, the table in registers where it fits (else in the loop)
    assert decode_plan(64, 8, 8192, 128, torch.bfloat16, 132, kv_dtype=fp8, page_size=16) == (FP8_TWO_WARPS, 1, 128,
                                                                                             False, 512, 1, False)
    assert decode_plan(1, 8, 1 << 20, 128, torch.bfloat16, 132, kv_dtype=fp8, page_size=64)[1:] == (66, 249, False,
                                                                                                256, 1, False)
    assert decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, kv_dtype=fp8, page_size=1)[:] == (FP8_TABLE_LOOP, 64,
                                                                                                32, False, 0, 1, False)
    assert FP8_TABLE_LOOP == DecodeConfig(64, 2, 5, programs=4)  # two K/V tiles in flight beside the table load
    assert decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, kv_dtype=fp8, page_size=16,
                       rows=64).config == DecodeConfig(128, 4, 3)
    # head dim 256, dense, up to 32 rows a tile: two programs per SM (paged and 64 rows keep 64 x 4 x 2)
    assert decode_config(256, torch.float16) == WIDE_HEADS == DecodeConfig(64, 8, 2, programs=2)
    assert decode_config(256, torch.bfloat16, 131072, kv_dtype=fp8) == WIDE_FP8 == DecodeConfig(32, 2, 3, programs=4)
    assert decode_config(256, torch.bfloat16, 131072, page_size=16) == DecodeConfig(64, 4, 2)
    assert decode_config(256, torch.bfloat16, 131072, rows=64) == DecodeConfig(64, 4, 2)
    assert decode_plan(1, 8, 131072, 256, torch.bfloat16, 132, rows=2)[:3] == (WIDE_HEADS, 33, 63)
    # head dim 256 pools through the register table: the dense FP8 config; 16-bit, WIDE_HEADS capped at 128
    # registers below 3 waves (never the gathered FOUR_PER_SM), 64 x 4 x 2 from 3 waves on
    assert WIDE_PAGES == WIDE_HEADS._replace(maxnreg=128)
    assert decode_plan(1, 8, 131072, 256, torch.bfloat16, 132, kv_dtype=fp8, page_size=32, rows=2) == \
        DecodePlan(WIDE_FP8, 66, 63, split_pages=64)
    # FP8 pages of two tiles or more: the dense plan's splits, one table entry loaded a tile, five stages
    assert WIDE_FP8_TABLE_LOOP == WIDE_FP8._replace(num_stages=5)
    for page in (64, 256):
        assert decode_plan(1, 8, 131072, 256, torch.bfloat16, 132, kv_dtype=fp8, page_size=page, rows=2) == \
            DecodePlan(WIDE_FP8_TABLE_LOOP, 66, 63, page_tiles=True)
    for page in (128, 256, 1024):
        assert decode_plan(64, 8, 8192, 128, torch.bfloat16, 132, kv_dtype=fp8, page_size=page) == \
            DecodePlan(FP8_TABLE_LOOP, 1, 128, page_tiles=True)
    assert not decode_plan(64, 8, 8192, 128, torch.bfloat16, 132, page_size=256).page_tiles  # 16-bit: registers
    assert not decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, kv_dtype=fp8, page_size=256,
                           aligned=False).page_tiles  # a window: one entry per key
    assert decode_plan(16, 8, 32768, 256, torch.bfloat16, 132, kv_dtype=fp8, page_size=16, rows=2) == \
        DecodePlan(WIDE_FP8, 4, 256, split_pages=512)
    assert decode_plan(1, 8, 131072, 256, torch.bfloat16, 132, page_size=256, rows=2) == \
        DecodePlan(WIDE_PAGES, 33, 63, split_pages=32)
    for page in (16, 64):
        assert decode_plan(64, 8, 8192, 256, torch.bfloat16, 132, page_size=page, rows=2)[:3] == \
            (DecodeConfig(64, 4, 2), 1, 128)
    assert decode_plan(1, 8, 131072, 256, torch.bfloat16, 132, kv_dtype=fp8, page_size=1).config == \
        DecodeConfig(64, 4, 2)  # one table entry per key
    assert decode_config(64, torch.float32) == DecodeConfig(64, 4, 2)
    assert decode_config(128, torch.bfloat16, 131072, page_size=16) == DecodeConfig(64, 4, 3, programs=4)
    assert decode_config(128, torch.bfloat16, 131072, page_size=1) == DecodeConfig(64, 4, 3, programs=3)
    assert decode_config(128, torch.bfloat16, 512, page_size=16) == DecodeConfig(64, 4, 2)
    assert DecodeConfig(64, 4, 3, programs=3).programs_per_sm(128, torch.bfloat16) == 3  # measured, not estimated
    # head dim 64: 256-key tiles for a 16-bit cache from 32k positions on
    assert decode_config(64, torch.bfloat16, 131072) == DecodeConfig(256, 4, 3)
    assert decode_config(64, torch.bfloat16, 16384) == DecodeConfig(128, 4, 3)
    assert decode_config(64, torch.bfloat16, 131072, kv_dtype=torch.float8_e4m3fn) == DecodeConfig(128, 4, 3)
    assert DecodeConfig(128, 4, 3).programs_per_sm(128, torch.bfloat16) == 1  # 192 KB of K/V stages
    assert DecodeConfig(64, 4, 3).programs_per_sm(128, torch.bfloat16) == 2


# (B, Hkv, T_max, D, dtype) -> (splits, tiles per split) on 132 SMs.
DECODE_PLANS = [
    ((1, 8, 131072, 128, torch.bfloat16), (16, 64)),   # one wave: 128 programs
    ((1, 8, 1 << 20, 128, torch.bfloat16), (33, 249)),  # two full waves: 264 programs of >= 96 tiles
    ((1, 8, 1 << 19, 128, torch.bfloat16), (33, 125)),
    ((1, 8, 1 << 18, 128, torch.bfloat16), (16, 128)),  # two waves' splits would hold 63 tiles: one wave
    ((4, 8, 131072, 128, torch.bfloat16), (4, 256)),    # two waves no fuller than one (256 of 264 slots)
    ((4, 8, 32768, 128, torch.bfloat16), (4, 64)),
    ((16, 8, 32768, 128, torch.bfloat16), (1, 256)),    # 128 work items fill the machine
    ((64, 8, 4096, 128, torch.bfloat16), (1, 32)),
    ((1, 8, 2048, 128, torch.bfloat16), (16, 1)),       # splits of one tile at short contexts
    ((1, 8, 512, 128, torch.bfloat16), (8, 1)),         # 64-key tiles up to 512 positions
    ((1, 8, 64, 128, torch.bfloat16), (1, 1)),          # one tile: nothing to split
    ((0, 8, 4096, 128, torch.bfloat16), (1, 32)),       # an empty batch
]


@pytest.mark.parametrize("args,want", DECODE_PLANS, ids=[f"B{a[0]}-Hkv{a[1]}-T{a[2]}" for a, _ in DECODE_PLANS])
def test_decode_plan(args, want):
    plan = decode_plan(*args, 132)
    assert not plan.config.programs  # dense: estimated from shared memory
    assert (plan.num_splits, plan.tiles_per_split) == want
    n_tiles = math.ceil(args[2] / plan.config.block_n) if args[2] else 1
    assert plan.num_splits * plan.tiles_per_split >= n_tiles > (plan.num_splits - 1) * plan.tiles_per_split


def test_paged_decode_plan_fills_four_programs_per_sm():
    """A paged cache with the table in the loop (pages of 24, or a window): 64-key tiles, one wave of 4
    programs on each of 132 SMs (528 slots); 3 with pages of one position."""
    plan = decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, page_size=24)
    assert (plan.config.block_n, plan.num_splits, plan.tiles_per_split) == (64, 64, 32)  # 512 programs
    plan = decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, page_size=16, aligned=False)
    assert (plan.config.block_n, plan.num_splits, plan.tiles_per_split) == (64, 64, 32)
    plan = decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, page_size=1)
    assert (plan.config.block_n, plan.num_splits, plan.tiles_per_split) == (64, 49, 42)  # 392 programs
    assert decode_plan(64, 8, 8192, 128, torch.bfloat16, 132, page_size=16, aligned=False).num_splits == 1


def test_fp8_plan_takes_key_streams_for_long_splits_only():
    """Four key streams for dense FP8 splits of 48 tiles or more read by 16-row query tiles (Note [Key
    streams]): the FP8 bar's shapes but B=1 T=128k (32 tiles a split), never paged or 16-bit caches."""
    e4m3 = dict(kv_dtype=torch.float8_e4m3fn, rows=4)
    want = {(1, 1 << 20): 4, (1, 1 << 18): 4, (16, 32768): 4, (64, 8192): 4, (1, 131072): 1, (1, 16384): 1}
    for (b, t), streams in want.items():
        plan = decode_plan(b, 8, t, 128, torch.bfloat16, 132, **e4m3)
        assert plan.config == FP8_TWO_WARPS and plan.streams == streams, (b, t, plan)
    assert decode_plan(1, 8, 1 << 20, 128, torch.bfloat16, 132, kv_dtype=torch.float8_e4m3fn, rows=32).streams == 1
    assert decode_plan(1, 8, 1 << 20, 128, torch.bfloat16, 132, page_size=16, **e4m3).streams == 1
    assert decode_plan(1, 8, 1 << 20, 128, torch.bfloat16, 132, rows=4).streams == 1


def test_paged_plan_takes_the_dense_plan_with_the_table_in_registers():
    """Note [Paged tiles from registers]: where a split of the dense plan touches at most 2048 block-table
    entries (a power-of-two page of 16 or more, splits that start on a tile), the paged cache gets the dense
    plan and reads the entries into registers; where it touches more, splits capped at 2048 entries (if
    they keep 64 tiles or more); else the paged plan, with the table in the loop."""
    dense = decode_plan(1, 8, 131072, 128, torch.bfloat16, 132)
    plan = decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, page_size=64)  # 8192 keys a split: 128 pages
    assert plan == dense._replace(split_pages=128)
    assert decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, page_size=16) == dense._replace(split_pages=512)
    assert decode_plan(16, 8, 2048, 128, torch.bfloat16, 132, page_size=16).split_pages == 128
    assert decode_plan(16, 8, 2048, 128, torch.bfloat16, 132, page_size=256).split_pages == 16  # 8, + 1 mid-page
    for page in (1, 5, 24):  # not a power of two of 16 or more
        assert decode_plan(16, 8, 2048, 128, torch.bfloat16, 132, page_size=page).split_pages == 0
    assert decode_plan(1, 8, 131072, 128, torch.bfloat16, 132, page_size=64, aligned=False).split_pages == 0
    # capped: one split of 1024 tiles (8192 entries of 16) -> 4 splits of 256 tiles
    assert decode_plan(16, 8, 131072, 128, torch.bfloat16, 132, page_size=16)[1:] == (4, 256, False, 2048, 1, False)
    assert decode_plan(16, 8, 131072, 128, torch.bfloat16, 132, page_size=64).split_pages == 2048  # fits
    # pages of 512 (four tiles a page): a split that starts mid-page needs one entry more than its keys
    big = decode_plan(1, 8, 1 << 24, 128, torch.bfloat16, 132, page_size=512)
    assert big.num_splits == 33 and big.split_pages == 1024  # 993.25 pages of keys: up to 995 entries
    assert big.tiles_per_split * 128 <= (big.split_pages - 1) * 512
    assert decode_plan(1, 8, 1 << 24, 128, torch.bfloat16, 132, page_size=16, splits=2).split_pages == 0


def test_head_dim_64_plan():
    """Head dim 64 at B=1 T=128k: 256-key tiles, one program per SM, 16 splits (the sweep's best)."""
    plan = decode_plan(1, 8, 131072, 64, torch.bfloat16, 132)
    assert (plan.config.block_n, plan.num_splits) == (256, 16)
    assert decode_plan(16, 8, 32768, 64, torch.bfloat16, 132).num_splits == 1


def test_decode_plan_fixed_splits_are_capped_and_exact():
    plan = decode_plan(2, 2, 1000, 64, torch.float32, 132, 1000)  # more splits than the 16 tiles of 64
    assert (plan.num_splits, plan.tiles_per_split) == (16, 1)
    plan = decode_plan(2, 2, 1000, 64, torch.float32, 132, 3)      # 16 tiles in splits of 6: 6 + 6 + 4
    assert (plan.num_splits, plan.tiles_per_split) == (3, 6)


def test_prefix_policy():
    assert prefix_num_splits(32, 512, 132) == 4    # B = 128, GROUP = 4, BLOCK_M = 128, Hkv = 8, 32k tokens
    assert prefix_num_splits(8, 256, 132) == 16    # B = 32, 16k tokens: 8 programs a split
    assert prefix_num_splits(1, 3, 132) == 1       # fewer than 4 tiles per split would be needed
    assert prefix_config(128, torch.bfloat16, 512) == PrefixConfig(128, 64, 8, 3)
    assert prefix_config(64, torch.bfloat16, 4).block_m == 16
    assert prefix_config(256, torch.bfloat16, 512).block_m == 64
    plan = prefix_plan(128, 4, 8, 1, 32768, 128, torch.bfloat16, 132)
    assert (plan.n_tiles, plan.num_splits, plan.tiles_per_split) == (4, 4, 128)


def test_one_warp_fp8_domain_and_plan(monkeypatch):
    """Note [One-warp FP8 tiles]: only CUDA devices of compute capability 9 run the Gluon kernel (never the
    CPU or the interpreter), for FP8 caches of head dim 128 or 256 and more than 512 positions, dense or paged,
    read by at most 32 query rows (16 at head dim 256); its plan is one wave of eight one-warp programs per SM (of
    four in 32-key tiles where the eight's splits hold at most 4096 positions, 2048 above 8 rows; at head dim 256
    always eight in 16-key tiles), the dense cache's splits for a paged one (one table entry a tile where pages
    hold whole tiles), in 32-key tiles only where pages hold them."""
    e4m3 = torch.float8_e4m3fn
    assert not one_warp_fp8(torch.device("cpu"), e4m3, 128, 4, 131072, True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr("cp_attention._device._SM90", {cuda: True})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert one_warp_fp8(cuda, e4m3, 128, 4, 131072, True)
    assert one_warp_fp8(cuda, torch.float8_e5m2, 128, 16, 513, True)
    assert one_warp_fp8(cuda, e4m3, 128, 32, 131072, True)  # two warps, or two row tiles
    assert one_warp_fp8(cuda, e4m3, 256, 2, 131072, True) and one_warp_fp8(cuda, e4m3, 256, 16, 8192, True, 64)
    for args in [(torch.bfloat16, 128, 4, 131072, True), (e4m3, 192, 4, 131072, True), (e4m3, 64, 4, 131072, True),
                 (e4m3, 128, 33, 131072, True), (e4m3, 128, 4, 512, True), (e4m3, 128, 4, 131072, False),
                 (e4m3, 256, 17, 131072, True)]:
        assert not one_warp_fp8(cuda, *args), args
    for page in (1, 8, 16, 24, 32, 48, 64, 256, 1024):
        assert one_warp_fp8(cuda, e4m3, 128, 4, 131072, True, page)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("cp_attention._device._INTERPRETED", [True])  # as if triton were imported under it
    assert not one_warp_fp8(cuda, e4m3, 128, 4, 131072, True)
    long_tiles = {(1, 131072): (66, FP8_ONE_WARP_FEW), (1, 1 << 20): (132, FP8_ONE_WARP_LONG),
                  (16, 32768): (4, FP8_ONE_WARP_FEW), (64, 8192): (1, FP8_ONE_WARP_FEW),
                  (4, 1 << 20): (33, FP8_ONE_WARP_LONG), (1, 8192): (64, FP8_ONE_WARP_FEW),
                  (4, 32768): (16, FP8_ONE_WARP_FEW), (2, 262144): (33, FP8_ONE_WARP_FEW)}
    for (b, t), (splits, config) in long_tiles.items():
        plan = one_warp_plan(b, 8, t, 132)
        assert (plan.config, plan.num_splits, plan.streams) == (config, splits, 1), plan
        assert plan.num_splits * plan.tiles_per_split * config.block_n >= t
        eight = decode_plan(b, 8, t, 128, torch.bfloat16, 132, None, FP8_ONE_WARP, e4m3)
        assert (eight.tiles_per_split * 16 > 4096) == (config == FP8_ONE_WARP_LONG)
        assert (eight.tiles_per_split * 16 <= 4096) == (config == FP8_ONE_WARP_FEW)  # at most 8 rows
        if 2048 < eight.tiles_per_split * 16 <= 4096:  # more rows: FP8_ONE_WARP's plan there
            assert one_warp_plan(b, 8, t, 132, rows=16)[:3] == eight[:3]
    for (b, t), page in itertools.product(long_tiles, (0, 1, 16, 64)):  # head dim 256: eight programs, 16-key tiles
        for rows in (2, ONE_WARP_PLAN_ROWS_256):
            plan = one_warp_plan(b, 8, t, 132, page_size=page, rows=rows, head_dim=256)
            assert plan[:3] == decode_plan(b, 8, t, 256, torch.bfloat16, 132, None, FP8_ONE_WARP, e4m3)[:3], plan
            assert plan.page_tiles == (page % 16 == 0 and page > 0), plan
        assert one_warp_plan(b, 8, t, 132, page_size=page, rows=ONE_WARP_PLAN_ROWS_256 + 1, head_dim=256) is None
    assert one_warp_plan(1, 8, 1 << 20, 132, splits=7)[:3] == (FP8_ONE_WARP_LONG, 7, 4682)
    assert one_warp_plan(1, 8, 131072, 132, splits=7)[:3] == (FP8_ONE_WARP_LONG, 7, 586)
    assert one_warp_plan(1, 8, 131072, 132, splits=200)[:3] == (FP8_ONE_WARP_FEW, 196, 21)
    refused = 0
    for (b, t), page, rows in itertools.product(long_tiles, (0, 1, 16, 64), (17, 32)):
        plan = one_warp_plan(b, 8, t, 132, page_size=page, rows=rows)
        if page % 32 == 0:  # two warps a program, one a split: four programs (eight warps) an SM, 32-key tiles
            want = decode_plan(b, 8, t, 128, torch.bfloat16, 132, None, FP8_ROWS_32, e4m3)
        else:  # row tiles of one warp in the wave like KV heads, eight programs an SM
            want = decode_plan(b, 16, t, 128, torch.bfloat16, 132, None, FP8_ONE_WARP, e4m3)
        if want.tiles_per_split * want.config.block_n < ONE_WARP_KEYS_PER_ROW * rows:  # the states would outweigh
            assert plan is None, (b, t, page, rows, want)
            refused += 1
        elif page % 32 == 0:
            assert plan[:3] == want[:3] and plan.page_tiles == (page > 0), (b, t, page, plan)
            assert plan.num_splits * b * 8 <= 4 * 132 and kernel_rows(plan.config) == 32
        else:
            assert plan.num_splits == want.num_splits and plan.config == FP8_ONE_WARP, (b, t, page, plan)
            assert kernel_rows(plan.config) == 16
    assert 0 < refused < 32
    assert one_warp_plan(1, 8, 4131, 132, rows=4) is not None and one_warp_plan(1, 8, 4131, 132, rows=16) is None
    for (b, t), page in itertools.product(long_tiles, (1, 8, 16, 24, 48, 64)):
        dense, paged = one_warp_plan(b, 8, t, 132), one_warp_plan(b, 8, t, 132, page_size=page)
        eight = decode_plan(b, 8, t, 128, torch.bfloat16, 132, None, FP8_ONE_WARP, e4m3)
        assert paged.page_tiles == (page % 16 == 0) and not dense.page_tiles, (page, paged)
        if page % 32 == 0 or dense.config == FP8_ONE_WARP:
            assert paged[:3] == dense[:3], (dense, paged)
        else:  # 16-key tiles in the eight programs' splits where the pages do not hold 32-key ones
            assert paged[:3] == eight[:3], (eight, paged)


@pytest.mark.parametrize("one_warp", [False, True], ids=["triton", "one-warp"])
def test_the_policys_plans_pass_the_given_plan_check(monkeypatch, one_warp):
    """Every plan flash_decode makes itself (dense and paged, windows, row limits, draft rows, FP8, fixed
    splits, the one-warp kernel's) passes the check of a caller's plan: the check refuses only plans that
    read fewer positions or that the kernels cannot run."""
    from cp_attention._validate import check_plan
    from cp_attention.heuristics import plan_decode

    monkeypatch.setattr("cp_attention.heuristics.one_warp_fp8", lambda *args: one_warp)
    cpu, bf, e4m3 = torch.device("cpu"), torch.bfloat16, torch.float8_e4m3fn
    seen = set()
    for b, t, d, kv, q_rows, page, window, limits, splits, size in itertools.product(
            (1, 16), (37, 4096, 131072), (64, 128, 256), (bf, e4m3), (1, 4), (0, 1, 16, 64, 256), (None, 0, 700),
            (False, True), (None, 3), (None, 64)):
        if (limits and window is not None) or (size is not None and (splits or window is not None)):
            continue
        t_max = -(-t // max(page, 1)) * max(page, 1)
        plan = plan_decode(cpu, b, 8, t_max, d, bf, kv, q_rows, 4, page, num_splits=splits, window_left=window,
                           row_limits=limits, split_size=size)
        check_plan(plan, t_max=t_max, q_rows=q_rows, page_size=page, window_left=window, row_limits=limits)
        seen.add((plan.config, plan.split_pages > 0, plan.page_tiles, plan.streams > 1, plan.deterministic))
    assert len(seen) >= (6 if one_warp else 10), seen


def test_a_given_plan_covers_the_positions_it_reads():
    """A caller's plan reads at least T_max positions (a window's window_left + Q), a tile more for the
    one-warp kernel's splits under a window; the smallest that does passes, one position less is refused."""
    from cp_attention._validate import check_plan

    cfg = DecodeConfig(16, 4, 1)
    check_plan(DecodePlan(cfg, 3, 7), t_max=336, q_rows=1, page_size=0)
    with pytest.raises(ValueError, match=r"^plan covers 3 splits x 7 tiles x 16 keys = 336 positions, fewer than "
                                         r"the 337"):
        check_plan(DecodePlan(cfg, 3, 7), t_max=337, q_rows=1, page_size=0)
    check_plan(DecodePlan(cfg, 1, 1), t_max=5000, q_rows=4, page_size=0, window_left=12)
    with pytest.raises(ValueError, match="fewer than the 17"):
        check_plan(DecodePlan(cfg, 1, 1), t_max=5000, q_rows=4, page_size=0, window_left=13)
    with pytest.raises(ValueError, match="fewer than the 31"):  # 16 + 15: a tile below the first key
        check_plan(DecodePlan(FP8_ONE_WARP, 1, 1), t_max=5000, q_rows=1, page_size=0, window_left=15)
    check_plan(DecodePlan(FP8_ONE_WARP, 2, 1), t_max=5000, q_rows=1, page_size=0, window_left=15)
    bad = [(DecodePlan(DecodeConfig(24, 4, 1), 1, 20), ValueError, "plan.config.block_n must be a power of two"),
           (DecodePlan(DecodeConfig(8, 4, 1), 1, 60), ValueError, r"plan.config.block_n must be in \[16"),
           (DecodePlan(DecodeConfig(16, 3, 1), 1, 30), ValueError, "plan.config.num_warps must be a power of two"),
           (DecodePlan(DecodeConfig(16, 4, 0), 1, 30), ValueError, "plan.config.num_stages"),
           (DecodePlan(cfg, 0, 30), ValueError, "plan.num_splits"),
           (DecodePlan(cfg, 1.5, 30), TypeError, "plan.num_splits"),
           (DecodePlan(cfg, 1, 0), ValueError, "plan.tiles_per_split"),
           (DecodePlan(DecodeConfig(32, 4, 1), 1, 15, streams=3), ValueError, "plan.streams"),
           (DecodePlan(cfg, 1, 30, page_tiles=1), TypeError, "plan.page_tiles"),
           ((cfg, 1, 30), TypeError, "plan must be a heuristics.DecodePlan"),
           (DecodePlan((16, 4, 1), 1, 30), TypeError, "plan.config must be a heuristics.DecodeConfig")]
    for plan, exc, match in bad:
        with pytest.raises(exc, match=match):
            check_plan(plan, t_max=300, q_rows=1, page_size=0)
    # the register table: a power of two of at least the entries a split touches (+1 from a mid-page start)
    check_plan(DecodePlan(cfg, 10, 4, split_pages=4), t_max=640, q_rows=1, page_size=16)
    check_plan(DecodePlan(DecodeConfig(64, 4, 2), 5, 2, split_pages=2), t_max=640, q_rows=1, page_size=128)
    for pages, page in ((2, 16), (3, 16), (4, 8), (1, 128)):
        with pytest.raises(ValueError, match="plan.split_pages"):
            check_plan(DecodePlan(cfg if page != 128 else DecodeConfig(64, 4, 2), 10, 4, split_pages=pages), t_max=640,
                       q_rows=1, page_size=page)
    check_plan(DecodePlan(cfg, 10, 4, split_pages=1), t_max=640, q_rows=1, page_size=16, window_left=100)  # unused
