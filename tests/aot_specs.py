"""The sm_90 compiles of tests/test_aot.py: realistic launches of every Triton kernel of cp_attention/ops (and of the
model kernels of launch/model_kernels.py), each built from its launcher's own launch config, so the compiled code is the
code those launches run."""
import torch

from cp_attention.heuristics import (FOUR_PER_SM, FP8_ONE_WARP, FP8_ONE_WARP_LONG, FP8_ROWS_32, FP8_TABLE_LOOP,
                                     FP8_TWO_WARPS, ONE_WARP_CONFIGS, WIDE_FP8, WIDE_FP8_TABLE_LOOP, WIDE_HEADS, WIDE_PAGES, DecodeConfig,
                                     DecodePlan, decode_config, prefix_config)
from cp_attention.ops import append, merge, prefix, split_kv, split_kv_fp8, symm_merge

_SPLIT_SIGNATURE = {"Q": "*bf16", "SEQ_LENS": "*i32", "BLOCK_TABLE": "*i32", "ROW_LIMITS": "*i32", "K_SCALE": "*fp32",
                    "V_SCALE": "*fp32", "SINKS": "*fp32", "O": "*bf16", "LSE": "*fp32", "WORK": "*fp32",
                    "sm_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32", "cap": "fp32"}


def _split(group, q_rows, export, page_size=0, causal=False, row_limits=False, block_n=128, kv="bf16", kv_scale=0,
           window=False, softcap=False, sinks=False, head_dim=128, split_pages=0, config=None, streams=1,
           page_tiles=False):
    """A split-KV launch: a plan of ``config`` (two splits when it ``export``s its states, else one) through
    ``split_kv_launch_config``, as ``flash_decode`` launches it (bf16 queries, PDL)."""
    config = config or DecodeConfig(block_n, 4, 3)
    plan = DecodePlan(config, 2 if export else 1, 8, split_pages=split_pages, streams=streams, page_tiles=page_tiles)
    constexprs, options, _ = split_kv.split_kv_launch_config(
        torch.bfloat16, group, q_rows, head_dim, plan, has_seq_lens=True, page_size=page_size, causal=causal,
        row_limits=row_limits, kv_scale=kv_scale, window=window, softcap=softcap, sinks=sinks, pdl=True)
    kernel = split_kv._split_kv_kernel
    if config in ONE_WARP_CONFIGS:
        kernel, constexprs = split_kv_fp8._split_kv_fp8_kernel, dict(constexprs, NUM_STAGES=config.num_stages)
    return {"kernel": kernel, "signature": dict(_SPLIT_SIGNATURE, K=f"*{kv}", V=f"*{kv}"), "constexprs": constexprs,
            "options": options, "programs": config.programs}


def _fp8(group, q_rows, export, config=FP8_ONE_WARP, **kw):
    return _split(group, q_rows, export, config=config, **kw)


def _combine(*args, **kw):
    constexprs, options, _ = split_kv.combine_launch_config(*args, **kw)
    return {"kernel": split_kv._combine_kernel, "signature": {"WORK": "*fp32", "SINKS": "*fp32", "O": "*bf16",
                                                              "LSE": "*fp32"},
            "constexprs": constexprs, "options": options}


# dense single-row (GQA 4 split, GQA 5, GQA 8 split), paged (page 16 and page 64), 4 causal rows, 16 rows x GQA 8
# with row limits (two row tiles), FP8 caches (e4m3 with scalar scales; e5m2 paged in two warps with per-head
# scales, one table entry per key; e4m3 pages of one in 64-row tiles), and the variants: a window with sinks (split
# and not), a softcap on 4 causal rows, 64-key tiles split, head dim 64 in 256-key tiles; paged tables in registers
# (2048 entries of 16, pages of 256, 2048 FP8 pages of 64 in two warps with 8 causal rows; four programs per SM,
# registers capped at 128: 32 pages of 64, 2048 of 16 split; FP8 in two warps: e4m3 split, e5m2 with per-head
# scales on 8 causal rows; and in four key streams: e4m3 split, e5m2 with per-head scales on 4 causal rows in a
# window with a softcap); head dim 256 (GQA 2: 16-bit split, e4m3 with per-head scales on 4 causal rows, values
# paired; e5m2 on 8 causal rows, unpaired; page pools in registers, values paired: 512 e4m3 pages of 16 split, 64
# of 32 gathered on 2 causal rows; 128 16-bit pages of 256 on 4 causal rows with registers capped at 128); FP8
# pools with one table entry loaded a tile (e4m3 pages of 256 split; head dim 256, e5m2 pages of 64 with per-head
# scales on 4 causal rows)
SPLIT_KV = [
    _split(4, 1, True), _split(5, 1, False), _split(8, 1, True),
    _split(4, 1, True, page_size=16, block_n=64), _split(4, 1, False, page_size=64, block_n=64),
    _split(4, 4, True, causal=True), _split(8, 16, True, page_size=16, row_limits=True, block_n=64),
    _split(4, 1, True, kv="fp8e4nv", kv_scale=1),
    _split(4, 4, False, page_size=64, causal=True, kv="fp8e5", kv_scale=2,
           config=decode_config(128, torch.bfloat16, page_size=64, kv_dtype=torch.float8_e5m2)),
    _split(4, 1, True, window=True, sinks=True), _split(4, 1, False, window=True, sinks=True),
    _split(4, 4, True, causal=True, softcap=True), _split(4, 1, True, block_n=64),
    _split(4, 1, True, block_n=256, head_dim=64),
    _split(4, 1, True, page_size=16, split_pages=2048), _split(4, 1, False, page_size=256, split_pages=16),
    _split(4, 8, True, page_size=64, causal=True, kv="fp8e4nv", kv_scale=2, split_pages=2048, config=FP8_TWO_WARPS),
    _split(4, 16, True, page_size=1, causal=True, kv="fp8e4nv", kv_scale=1,
           config=decode_config(128, torch.bfloat16, page_size=1, kv_dtype=torch.float8_e4m3fn, rows=64)),
    _split(4, 1, False, page_size=64, split_pages=32, config=FOUR_PER_SM),
    _split(4, 1, True, page_size=16, split_pages=2048, config=FOUR_PER_SM),
    _split(4, 1, True, kv="fp8e4nv", kv_scale=1, config=FP8_TWO_WARPS),
    _split(4, 8, False, causal=True, kv="fp8e5", kv_scale=2, config=FP8_TWO_WARPS),
    _split(4, 1, True, kv="fp8e4nv", kv_scale=1, config=FP8_TWO_WARPS, streams=4),
    _split(4, 4, False, causal=True, kv="fp8e5", kv_scale=2, window=True, softcap=True, config=FP8_TWO_WARPS,
           streams=4),
    _split(2, 1, True, head_dim=256, config=WIDE_HEADS),
    _split(2, 4, True, causal=True, kv="fp8e4nv", kv_scale=2, head_dim=256, config=WIDE_FP8),
    _split(2, 8, False, causal=True, kv="fp8e5", kv_scale=1, head_dim=256, config=WIDE_FP8),
    _split(2, 1, True, page_size=16, kv="fp8e4nv", kv_scale=1, head_dim=256, split_pages=512, config=WIDE_FP8),
    _split(2, 2, True, page_size=32, causal=True, kv="fp8e4nv", kv_scale=1, head_dim=256, split_pages=64,
           config=WIDE_FP8),
    _split(2, 4, False, page_size=256, causal=True, head_dim=256, split_pages=128, config=WIDE_PAGES),
    _split(4, 1, True, page_size=256, kv="fp8e4nv", kv_scale=1, config=FP8_TABLE_LOOP, page_tiles=True),
    _split(2, 4, False, page_size=64, causal=True, kv="fp8e5", kv_scale=2, head_dim=256, config=WIDE_FP8_TABLE_LOOP,
           page_tiles=True),
] + [  # the combine, with the policy's split count and with the deterministic splits
    _combine(4, 1, 128, True, 16, pdl=True), _combine(8, 1, 128, False, pdl=True, packed=True),
    _combine(4, 1, 128, False, 131, pdl=True, packed=True),
]

# The one-warp FP8 kernel: GQA 4 split (e4m3, scalar scales; dense and on pages of 16), four causal rows of GQA 4
# split on pages of 64 in 32-key tiles (e5m2, per-head scales), four causal rows of GQA 4 written directly (e5m2,
# per-head scales), GQA 16 split (e4m3, per-head), three causal rows of GQA 5 split; in 32-key tiles, GQA 4 split
# (e4m3) and four causal rows of GQA 4 (e5m2, per-head scales); a window with sinks written directly (GQA 8); four
# causal rows of GQA 4 in a window with a softcap on pages of 16 (per-head scales); row limits on 32 rows (two row
# tiles) on pages of 1 (e4m3); in two warps of 16 rows: row limits on 32 rows on pages of 64 (e5m2, per-head
# scales), four causal rows of GQA 8 with a softcap and sinks written directly, five causal rows of GQA 4 split
# (e4m3) and four of GQA 8 in a window on pages of 32 (e5m2, per-head scales); head dim 256: GQA 2 split (e4m3),
# four causal rows of GQA 2 on pages of 16 (e5m2, per-head scales), a window with sinks written directly (GQA 8)
SPLIT_KV_FP8 = [
    _fp8(4, 1, True, kv="fp8e4nv", kv_scale=1),
    _fp8(4, 1, True, kv="fp8e4nv", kv_scale=1, page_size=16, page_tiles=True),
    _fp8(4, 1, True, kv="fp8e4nv", kv_scale=1, page_size=1),
    _fp8(5, 3, True, causal=True, kv="fp8e5", kv_scale=2, page_size=8),
    _fp8(4, 4, True, causal=True, kv="fp8e5", kv_scale=2, config=FP8_ONE_WARP_LONG, page_size=64, page_tiles=True),
    _fp8(4, 4, False, causal=True, kv="fp8e5", kv_scale=2),
    _fp8(16, 1, True, kv="fp8e4nv", kv_scale=2),
    _fp8(5, 3, True, causal=True, kv="fp8e4nv", kv_scale=1),
    _fp8(4, 1, True, kv="fp8e4nv", kv_scale=1, config=FP8_ONE_WARP_LONG),
    _fp8(4, 4, True, causal=True, kv="fp8e5", kv_scale=2, config=FP8_ONE_WARP_LONG),
    _fp8(8, 1, False, kv="fp8e4nv", kv_scale=1, window=True, sinks=True),
    _fp8(4, 4, True, causal=True, kv="fp8e4nv", kv_scale=2, window=True, softcap=True, page_size=16, page_tiles=True),
    _fp8(4, 8, True, kv="fp8e4nv", kv_scale=1, row_limits=True, page_size=1),
    _fp8(8, 4, True, kv="fp8e5", kv_scale=2, row_limits=True, config=FP8_ROWS_32, page_size=64, page_tiles=True),
    _fp8(8, 4, False, causal=True, kv="fp8e4nv", kv_scale=1, softcap=True, sinks=True, config=FP8_ROWS_32),
    _fp8(4, 5, True, causal=True, kv="fp8e4nv", kv_scale=1, config=FP8_ROWS_32),
    _fp8(8, 4, True, causal=True, kv="fp8e5", kv_scale=2, window=True, config=FP8_ROWS_32, page_size=32,
         page_tiles=True),
    _fp8(2, 1, True, kv="fp8e4nv", kv_scale=1, head_dim=256),
    _fp8(2, 4, True, causal=True, kv="fp8e5", kv_scale=2, page_size=16, page_tiles=True, head_dim=256),
    _fp8(8, 1, False, kv="fp8e4nv", kv_scale=1, window=True, sinks=True, head_dim=256),
]


def _merge(n, sinks, one_warp, world=1, exchange_block_m=0):
    constexprs, options = merge.merge_launch_config(n, 128, sinks, one_warp, world, exchange_block_m)
    return {"kernel": merge._merge_states_kernel,
            "signature": {"O": "*bf16", "LSE": "*fp32", "SINKS": "*fp32", "O_OUT": "*bf16", "LSE_OUT": "*fp32",
                          "BUF_PTRS": "*i64"}, "constexprs": constexprs, "options": options}


# 16 states (the exchanges' layout), 2 and 8 in one warp (merge_states, a cascade), pushed to the peers of
# exchanges of 2 and 4 ranks
MERGE = [_merge(n, sinks, one_warp, world, ex) for sinks in (False, True)
         for n, one_warp, world, ex in ((16, False, 1, 0), (2, True, 1, 0), (8, True, 1, 0), (8, True, 2, 16),
                                        (16, True, 4, 8))]


def _symm(m, world, sinks, pushed=False):
    _, constexprs, options = symm_merge.symm_launch_config(m, 128, world, sinks, pushed, pdl=True)
    return {"kernel": symm_merge._symm_merge_kernel,
            "signature": {"BUF_PTRS": "*i64", "SINKS": "*fp32", "O_OUT": "*bf16", "LSE_OUT": "*fp32"},
            "constexprs": constexprs, "options": options}


# flagged words (B=1 x 32 heads over 2 ranks, B=16 over 8 with sinks), the bulk protocol (B=64 x 32 heads over 2 and
# 8 ranks; B=128 over 2 and 4 with the producer's push)
SYMM_MERGE = [_symm(32, 2, False), _symm(512, 8, True), _symm(2048, 2, False), _symm(2048, 8, True),
              _symm(4096, 2, False, pushed=True), _symm(4096, 4, True, pushed=True)]


def _prefix(has_seq_lens, has_segments, page, q_rows, kv, softcap, pdl=False):
    group = 4
    constexprs, options = prefix.prefix_launch_config(
        torch.bfloat16, group, q_rows, 128, page, prefix_config(128, torch.bfloat16, 512), has_seq_lens=has_seq_lens,
        has_segments=has_segments, paged=page > 1, causal=True, softcap=softcap, kv_scale=0 if kv == "bf16" else 2,
        pdl=pdl)
    return {"kernel": prefix._prefix_kernel,
            "signature": {"Q": "*bf16", "K": f"*{kv}", "V": f"*{kv}", "SEQ_LENS": "*i32", "BLOCK_TABLE": "*i32",
                          "PERM": "*i64", "TILES": "*i32", "K_SCALE": "*fp32", "V_SCALE": "*fp32", "O_PART": "*fp32",
                          "LSE_PART": "*fp32", "sm_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32",
                          "cap": "fp32"},
            "constexprs": constexprs, "options": options}


# one segment read by all, dense; segments with ids and lengths; paged segments with 4 causal rows; paged FP8
# segments with per-head scales and a logit softcap (bf16 queries, D = 128, Hq/Hkv = 4, 128-row tiles); the first
# as cascade_decode launches it on sm_90 (programmatic dependent launch)
PREFIX = [_prefix(False, False, 1, 1, "bf16", False), _prefix(True, True, 1, 1, "bf16", False),
          _prefix(True, True, 16, 4, "bf16", False), _prefix(True, True, 16, 1, "fp8e4nv", True),
          _prefix(False, False, 1, 1, "bf16", False, pdl=True)]


def _append(paged):
    constexprs, options = append.append_launch_config(8, 128, paged)
    return {"kernel": append._append_kernel,
            "signature": {"K_NEW": "*bf16", "V_NEW": "*bf16", "K": "*bf16", "V": "*bf16", "BLOCK_TABLE": "*i32",
                          "SEQ_LENS": "*i32", "GLOBAL_SEQ_LENS": "*i64"},
            "constexprs": constexprs, "options": options}


APPEND = [_append(False), _append(True)]  # Llama-3-8B's 8 KV heads, dense and paged


def _launch_kernels():
    from launch import model_kernels as kernels

    return [  # the model kernels of launch/generate.py at Llama-3-8B shapes, as launch/model_kernels.py launches them
        {"kernel": kernels._rmsnorm_kernel,
         "signature": {"X": "*bf16", "DELTA": "*bf16", "W": "*bf16", "H": "*bf16", "eps": "fp32"},
         "constexprs": {"HAS_DELTA": delta, "GEMMA": gemma, "BLOCK": 4096}, "options": {"num_warps": 8}}
        for delta, gemma in ((True, False), (False, True))
    ] + [
        {"kernel": kernels._rope_kernel, "signature": {"QKV": "*bf16", "COS": "*bf16", "SIN": "*bf16"},
         "constexprs": {"N_HEADS": 40, "HALF": 64, "BLOCK_H": 64, "BLOCK_HALF": 64}, "options": {"num_warps": 8}},
        {"kernel": kernels._gated_act_kernel, "signature": {"GU": "*bf16", "OUT": "*bf16"},
         "constexprs": {"BLOCK": kernels.ACT_BLOCK}, "options": {"num_warps": 4}},
    ]


def specs_by_module() -> dict:
    """``{module: [spec]}`` for every module with Triton kernels: ``cp_attention.ops.<name>`` and ``launch.model_kernels``."""
    return {"cp_attention.ops.split_kv": SPLIT_KV, "cp_attention.ops.split_kv_fp8": SPLIT_KV_FP8,
            "cp_attention.ops.merge": MERGE, "cp_attention.ops.symm_merge": SYMM_MERGE,
            "cp_attention.ops.prefix": PREFIX, "cp_attention.ops.append": APPEND, "launch.model_kernels": _launch_kernels()}


def all_specs() -> list:
    return [s for specs in specs_by_module().values() for s in specs]
