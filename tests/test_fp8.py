"""FP8 KV caches: quantize_kv's bounds, and flash_decode / cascade_decode on e4m3 and e5m2 caches against the
float64 oracle on the dequantised values (kernels under the interpreter on the CPU)."""
import pytest
import torch

from cp_attention import AttentionState, CascadeLevel, cascade_decode, flash_decode, quantize_kv
from cp_attention.heuristics import (FP8_ONE_WARP, FP8_ONE_WARP_FEW, FP8_ONE_WARP_LONG, FP8_TABLE_LOOP, FP8_TWO_WARPS,
                                      REFERENCE_SMS, WIDE_FP8, WIDE_FP8_TABLE_LOOP, WIDE_PAGES, DecodePlan, decode_plan)
from cp_attention.ops.split_kv import split_kv_launch_config
from cp_attention.reference import attention

from .conftest import DEVICE, assert_state_matches
from .test_paged import dense_cache, page_pool

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_SUBNORMAL_EXP = {torch.float8_e4m3fn: -9, torch.float8_e5m2: -16}


def dequantized(x8, scale, head_dim):
    if scale.dim() == 1:
        shape = [1] * x8.dim()
        shape[head_dim] = scale.shape[0]
        scale = scale.view(shape)
    return x8.double() * scale.double()


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_quantize_kv_round_trip_bound(dtype, per_head, layout):
    """Every element comes back within half a unit in the last place of the format: |x| * 2^-(m+1) for
    normal numbers, scale * 2^(min_exp - 1) in the subnormal range; the largest magnitude maps to the
    format's max; no inf or NaN out of finite input."""
    g = torch.Generator().manual_seed(1)
    shape = (3, 4, 50, 32) if layout == "HND" else (3, 50, 4, 32)
    head_dim = 1 if layout == "HND" else 2
    k = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[head_dim]).view(
        [-1 if i == head_dim else 1 for i in range(4)])  # heads 10^4 apart in magnitude
    v = torch.randn(shape, generator=g)
    k8, v8, ks, vs = quantize_kv(k, v, dtype, per_head=per_head, kv_layout=layout)
    assert k8.dtype == dtype and k8.shape == k.shape
    assert ks.dtype == torch.float32 and ks.shape == ((shape[head_dim],) if per_head else ())
    for x, x8, sc in ((k, k8, ks), (v, v8, vs)):
        assert torch.isfinite(x8.float()).all()
        back = dequantized(x8, sc, head_dim)
        bound = torch.maximum(x.double().abs() * 2.0 ** -(MANTISSA[dtype] + 1),
                              dequantized(torch.ones_like(x8, dtype=torch.float32), sc, head_dim)
                              * 2.0 ** (MIN_SUBNORMAL_EXP[dtype] - 1))
        assert ((back - x.double()).abs() <= bound * (1 + 1e-6)).all()
        fmax = torch.finfo(dtype).max
        top = x8.float().abs().amax(dim=[d for d in range(4) if d != head_dim]) if per_head else x8.float().abs().max()
        torch.testing.assert_close(top, torch.full_like(top, fmax))


def test_quantize_kv_ignores_garbage_and_zeros():
    k = torch.randn(2, 2, 10, 32)
    k[0, :, 7:] = float("nan")  # unused slots of a torch.empty cache
    k[1] = 0.0
    k8, _, ks, _ = quantize_kv(k, k, per_head=False)
    assert torch.isfinite(ks) and ks > 0
    assert torch.isfinite(k8[0, :, :7].float()).all()
    k8, _, ks, _ = quantize_kv(torch.zeros(1, 2, 4, 32), torch.zeros(1, 2, 4, 32), per_head=True)
    assert (ks == 1).all() and (k8.float() == 0).all()


FP8_CASES = [
    # (fp8 dtype, per-head, layout or "paged", Q rows, float scales, head dim)
    (torch.float8_e4m3fn, False, "HND", 1, False, 64),
    (torch.float8_e4m3fn, True, "NHD", 1, True, 64),
    (torch.float8_e5m2, True, "HND", 3, False, 64),
    (torch.float8_e4m3fn, True, "paged", 4, False, 64),
    (torch.float8_e5m2, False, "paged", 1, True, 64),
    (torch.float8_e4m3fn, True, "HND", 2, False, 128),
    (torch.float8_e5m2, True, "NHD", 1, False, 96),
    (torch.float8_e4m3fn, False, "paged", 1, False, 128),
]


@pytest.mark.parametrize("dtype8,per_head,layout,q_rows,float_scales,head_dim", FP8_CASES,
                         ids=[f"{str(c[0])[6:]}-{'head' if c[1] else 'tensor'}-{c[2]}-Q{c[3]}"
                              f"{'-float' if c[4] else ''}-D{c[5]}" for c in FP8_CASES])
def test_fp8_decode_against_the_dequantised_oracle(dtype8, per_head, layout, q_rows, float_scales, head_dim):
    q, k, v, sl = dense_cache(3, 8, 2, 150, head_dim, [150, 41, 0], q_rows=q_rows, dtype=torch.bfloat16, seed=3)
    k8, v8, ks, vs = quantize_kv(k, v, dtype8, per_head=per_head)
    if float_scales:
        ks, vs = float(ks.max()), float(vs.max())
        k8, v8 = ((x.float() / sc).clamp(-448, 448).to(dtype8) for x, sc in ((k, ks), (v, vs)))
    kd = dequantized(k8, torch.as_tensor(ks), 1)
    vd = dequantized(v8, torch.as_tensor(vs), 1)
    ref = attention(q.double(), kd, vd, sl)
    for splits in (1, 3):
        if layout == "paged":
            kp, vp, table = page_pool(k8, v8, sl, 16, "NHD", seed=4)
            got = flash_decode(q, kp, vp, sl, block_table=table, kv_layout="NHD", k_scale=ks, v_scale=vs,
                               num_splits=splits, return_lse=True)
        elif layout == "NHD":
            got = flash_decode(q, k8.transpose(1, 2), v8.transpose(1, 2), sl, kv_layout="NHD", k_scale=ks,
                               v_scale=vs, num_splits=splits, return_lse=True)
        else:
            got = flash_decode(q, k8, v8, sl, k_scale=ks, v_scale=vs, num_splits=splits, return_lse=True)
        assert got.o.dtype == torch.bfloat16
        assert_state_matches(got, ref, q.dtype)


@pytest.mark.parametrize("exp", [-40, 20, 100])
def test_fp8_bf16_query_of_any_magnitude(exp):
    """A bf16 query 2^exp times the usual size under an sm_scale 2^-exp times the usual (the same scores).
    Against an FP8 cache the kernels run the dots in fp16, whose range (2^-24 .. 65504) holds neither
    query: each row must be rescaled by a power of two, one row at a time (a zero row included)."""
    q, k, v, sl = dense_cache(2, 8, 2, 70, 32, [70, 23], q_rows=None, dtype=torch.bfloat16, seed=12)
    q[1, 3] = 0.0
    q[0, 5] *= 1000.0  # rows of different sizes in one tile
    k8, v8, ks, vs = quantize_kv(k, v, per_head=True)
    scale = 32 ** -0.5 / 8
    ref = attention(q.double(), dequantized(k8, ks, 1), dequantized(v8, vs, 1), sl, sm_scale=scale)
    q_big = (q.float() * 2.0 ** exp).bfloat16()  # exact: a power of two
    for splits in (1, 2):
        got = flash_decode(q_big, k8, v8, sl, k_scale=ks, v_scale=vs, sm_scale=scale * 2.0 ** -exp,
                           num_splits=splits, return_lse=True)
        assert_state_matches(got, ref, q.dtype)


def test_fp8_torch_path(monkeypatch):
    q, k, v, sl = dense_cache(2, 8, 2, 60, 32, [60, 9], q_rows=None, dtype=torch.bfloat16, seed=6)
    k8, v8, ks, vs = quantize_kv(k, v, per_head=True)
    ref = attention(q.double(), dequantized(k8, ks, 1), dequantized(v8, vs, 1), sl)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    got = flash_decode(q.cpu(), k8.cpu(), v8.cpu(), sl.cpu(), k_scale=ks.cpu(), v_scale=vs.cpu(), return_lse=True)
    assert_state_matches(got, AttentionState(ref.o.cpu(), ref.lse.cpu()), q.dtype)


def test_fp8_against_the_bf16_cache_on_realistic_data():
    """Keys with outlier channels (log-normal channel scales, as in LLM keys), normal values: the FP8
    result stays close to the bf16-cache result (the quantisation error, not only the kernel's)."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, t, d = 2, 8, 2, 400, 64
    q = torch.randn(b, hq, d, generator=g).bfloat16().to(DEVICE)
    channel = torch.exp(torch.randn(d, generator=g) * 0.8)
    k = (torch.randn(b, hkv, t, d, generator=g) * channel).bfloat16().to(DEVICE)
    v = torch.randn(b, hkv, t, d, generator=g).bfloat16().to(DEVICE)
    ref = flash_decode(q, k, v).double()
    for dtype8, rel_bound in ((torch.float8_e4m3fn, 0.1), (torch.float8_e5m2, 0.2)):
        k8, v8, ks, vs = quantize_kv(k, v, dtype8, per_head=True)
        got = flash_decode(q, k8, v8, k_scale=ks, v_scale=vs).double()
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < rel_bound, (dtype8, rel)


def test_fp8_cascade_levels():
    """An FP8 shared prefix (paged) and FP8 per-request suffixes with one set of scales, against the
    oracle on the dequantised concatenation."""
    g = torch.Generator().manual_seed(8)
    b, hq, hkv, d = 3, 8, 2, 32
    q = torch.randn(b, hq, d, generator=g).bfloat16().to(DEVICE)
    _, pk, pv, p_lens = dense_cache(1, hq, hkv, 70, d, [66], dtype=torch.bfloat16, seed=9)
    _, sk, sv, s_lens = dense_cache(b, hq, hkv, 20, d, [20, 0, 5], dtype=torch.bfloat16, seed=10)
    both_k = torch.cat([pk.flatten(), sk.flatten()])
    scale = float(both_k[torch.isfinite(both_k)].abs().max()) / 448
    q8 = [(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn) for x in (pk, pv, sk, sv)]
    pkp, pvp, table = page_pool(q8[0], q8[1], p_lens, 16, "NHD", seed=11)
    levels = [CascadeLevel(pkp, pvp, p_lens, None, table), CascadeLevel(q8[2], q8[3], s_lens)]
    got = cascade_decode(q, levels, k_scale=scale, v_scale=scale, return_lse=True, _num_splits=2)
    n = int(p_lens[0])
    for i in range(b):
        m = int(s_lens[i])
        kk = torch.cat([q8[0][0, :, :n], q8[2][i, :, :m]], dim=1).double()[None] * scale
        vv = torch.cat([q8[1][0, :, :n], q8[3][i, :, :m]], dim=1).double()[None] * scale
        ref = attention(q[i:i + 1].double(), kk, vv)
        assert_state_matches(AttentionState(got.o[i:i + 1], got.lse[i:i + 1]), ref, q.dtype)


# Key streams (Note [Key streams]): dtype, per-head scales, new rows per request, variant
STREAM_CASES = [(torch.float8_e4m3fn, False, None, {}), (torch.float8_e5m2, True, 4, {}),
                (torch.float8_e4m3fn, True, 2, {"window_left": 61}), (torch.float8_e4m3fn, False, None,
                                                                       {"logit_softcap": 4.0})]


@pytest.mark.parametrize("dtype8,per_head,q_rows,kw", STREAM_CASES,
                         ids=[f"{str(c[0])[6:]}-Q{c[2]}-{'-'.join(c[3]) or 'plain'}" for c in STREAM_CASES])
def test_fp8_key_streams_against_the_dequantised_oracle(dtype8, per_head, q_rows, kw):
    """Four key streams of 16 keys per 64-key tile, merged after the loop: ragged and empty sequences (NaN
    past each length), one split of every tile or three splits, against the float64 oracle."""
    q, k, v, sl = dense_cache(3, 8, 2, 333, 128, [333, 77, 0], q_rows=q_rows, dtype=torch.bfloat16, seed=21)
    k8, v8, ks, vs = quantize_kv(k, v, dtype8, per_head=per_head)
    ref = attention(q.double(), dequantized(k8, ks, 1), dequantized(v8, vs, 1), sl, **kw)
    for splits, tiles in ((1, 6), (3, 2)):
        plan = DecodePlan(FP8_TWO_WARPS, splits, tiles, streams=4)
        got = flash_decode(q, k8, v8, sl, k_scale=ks, v_scale=vs, plan=plan, return_lse=True, **kw)
        assert_state_matches(got, ref, q.dtype)


@pytest.mark.parametrize("q_rows,kw", [(None, {}), (4, {"window_left": 50}), (8, {})], ids=["Q1", "Q4-window", "Q8"])
def test_fp8_head_dim_256_tiles_against_the_dequantised_oracle(q_rows, kw):
    """The head-dim-256 FP8 tiles (32 keys, two warps): GQA 2, ragged and empty sequences, one split of every
    tile or three splits; 2 and 8 query rows per KV head with the values paired, 16 without (Note [FP8 values
    in pairs])."""
    q, k, v, sl = dense_cache(3, 4, 2, 150, 256, [150, 41, 0], q_rows=q_rows, dtype=torch.bfloat16, seed=23)
    k8, v8, ks, vs = quantize_kv(k, v, torch.float8_e4m3fn, per_head=True)
    ref = attention(q.double(), dequantized(k8, ks, 1), dequantized(v8, vs, 1), sl, **kw)
    for splits, tiles in ((1, 5), (3, 2)):
        got = flash_decode(q, k8, v8, sl, k_scale=ks, v_scale=vs, plan=DecodePlan(WIDE_FP8, splits, tiles),
                           return_lse=True, **kw)
        assert_state_matches(got, ref, q.dtype)


def test_values_pair_in_the_wide_fp8_tiles_of_at_most_8_rows():
    """``PAIR_V`` (Note [FP8 values in pairs]): FP8 caches in WIDE_FP8's tiles read by at most 8 query rows per
    KV head, in row tiles of 8 that the kernel doubles; the exported states keep their rows (the combine's
    layout)."""
    def launch(config, kv_scale, q_rows, page_size=0):
        c, _, tiling = split_kv_launch_config(torch.bfloat16, 2, q_rows, 256, DecodePlan(config, 3, 2),
                                              has_seq_lens=True, page_size=page_size, causal=q_rows > 1,
                                              row_limits=False, kv_scale=kv_scale)
        return c["PAIR_V"], c["BLOCK_H"], tiling.n_rt, tiling.rows_t

    assert launch(WIDE_FP8, 1, 1) == (2, 8, 1, 2)
    assert launch(WIDE_FP8, 2, 4, page_size=16) == (2, 8, 1, 8)
    assert launch(WIDE_FP8, 1, 8) == (0, 16, 1, 16)  # 16 rows
    assert launch(WIDE_FP8_TABLE_LOOP, 1, 1, page_size=64) == (0, 16, 1, 2)  # one entry loaded a tile
    assert launch(WIDE_FP8, 0, 1) == (0, 16, 1, 2)  # a 16-bit cache
    assert launch(FP8_TWO_WARPS, 1, 1) == (0, 16, 1, 2)  # head dim 128's tiles


@pytest.mark.parametrize("kv_dtype,page_size,layout,q_rows",
                         [(torch.float8_e4m3fn, 16, "NHD", None), (torch.float8_e5m2, 64, "HND", 4),
                          (torch.float8_e4m3fn, 32, "NHD", 2), (torch.bfloat16, 16, "HND", 4),
                          (torch.bfloat16, 256, "NHD", None)],
                         ids=["e4m3-page16-NHD", "e5m2-page64-HND-Q4", "e4m3-page32-NHD-Q2", "bf16-page16-HND-Q4",
                              "bf16-page256-NHD"])
def test_head_dim_256_page_pools_in_the_dense_configs(kv_dtype, page_size, layout, q_rows):
    """Head dim 256 pools in the policy's configs: FP8 in WIDE_FP8's 32-key tiles through the register table
    (two pages a tile, a page whose entry is gathered) or, on pages of two tiles, with one table entry loaded a
    tile, 16-bit in WIDE_PAGES's 64-key tiles (four pages, a quarter page); GQA 2,
    ragged and empty sequences, shuffled pages; the policy's splits and two."""
    q, k, v, sl = dense_cache(3, 4, 2, 150, 256, [150, 41, 0], q_rows=q_rows, dtype=torch.bfloat16, seed=27)
    if kv_dtype.itemsize == 1:
        k, v, ks, vs = quantize_kv(k, v, kv_dtype, per_head=True)
        ref = attention(q.double(), dequantized(k, ks, 1), dequantized(v, vs, 1), sl)
        scales = dict(k_scale=ks, v_scale=vs)
    else:
        ref, scales = attention(q.double(), k.double(), v.double(), sl), {}
    plan = decode_plan(3, 2, 150, 256, torch.bfloat16, REFERENCE_SMS, kv_dtype=kv_dtype, page_size=page_size,
                       rows=(q_rows or 1) * 2)
    if kv_dtype.itemsize == 1 and page_size >= 64:  # two tiles a page or more: one table entry loaded a tile
        assert plan.config == WIDE_FP8_TABLE_LOOP and plan.page_tiles and not plan.split_pages, plan
    else:
        assert plan.config == (WIDE_FP8 if kv_dtype.itemsize == 1 else WIDE_PAGES) and plan.split_pages > 0, plan
    kp, vp, table = page_pool(k, v, sl, page_size, layout, seed=7)
    for splits in (None, 2):
        got = flash_decode(q, kp, vp, sl, block_table=table, kv_layout=layout, num_splits=splits, return_lse=True,
                           **scales)
        assert_state_matches(got, ref, q.dtype)


# Paged FP8 caches past 512 positions in two-warp tiles: page size, layout, dtype, new rows per request,
# window, and how the plan finds a key's page: the split's entries in registers, one entry loaded a tile
# (pages of two tiles or more), or one entry per key
PAGED_CASES = [(16, "NHD", torch.float8_e4m3fn, 1, None, "registers"),
               (64, "HND", torch.float8_e4m3fn, 4, None, "registers"), (1, "NHD", torch.float8_e4m3fn, 3, None, "keys"),
               (24, "HND", torch.float8_e5m2, 2, None, "keys"), (256, "NHD", torch.float8_e4m3fn, 2, None, "tiles"),
               (128, "HND", torch.float8_e5m2, 1, None, "tiles"), (16, "NHD", torch.float8_e4m3fn, 1, 200, "keys"),
               (256, "NHD", torch.float8_e4m3fn, 1, 300, "keys")]


@pytest.mark.parametrize("page_size,layout,dtype8,q_rows,window,form", PAGED_CASES,
                         ids=[f"page{c[0]}-{c[1]}-{str(c[2])[6:]}-Q{c[3]}{'-window' if c[4] else ''}"
                              for c in PAGED_CASES])
def test_fp8_paged_two_warp_plans_against_the_dequantised_oracle(page_size, layout, dtype8, q_rows, window, form):
    """The policy's plan of an FP8 page pool of 700 positions (shuffled pages, NaN in the spare ones): the
    two-warp tiles with the split's table entries in registers, each key's page gathered (tiles over four
    pages, a page), one entry loaded a tile (pages of two and four tiles), or one entry per key (pages of one,
    of 24, a window); ragged and empty sequences; the policy's splits (one tile each) and two splits."""
    q, k, v, sl = dense_cache(3, 8, 2, 700, 128, [700, 333, 0], q_rows=q_rows, dtype=torch.bfloat16, seed=31)
    k8, v8, ks, vs = quantize_kv(k, v, dtype8, per_head=True)
    ref = attention(q.double(), dequantized(k8, ks, 1), dequantized(v8, vs, 1), sl, window_left=window)
    plan = decode_plan(3, 2, 700, 128, torch.bfloat16, REFERENCE_SMS, kv_dtype=dtype8, page_size=page_size,
                       aligned=window is None, rows=q_rows * 4)
    assert plan.config == (FP8_TWO_WARPS if form == "registers" else FP8_TABLE_LOOP) and plan.streams == 1, plan
    assert ((plan.split_pages > 0) == (form == "registers")) and (plan.page_tiles == (form == "tiles")), plan
    kp, vp, table = page_pool(k8, v8, sl, page_size, layout, seed=5)
    for splits in (None, 2):
        got = flash_decode(q, kp, vp, sl, block_table=table, kv_layout=layout, k_scale=ks, v_scale=vs,
                           window_left=window, num_splits=splits, return_lse=True)
        assert_state_matches(got, ref, q.dtype)


def _bad():
    q, k, v, sl = dense_cache(2, 8, 2, 40, 32, [40, 3], q_rows=None, dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v, per_head=True)
    kp, vp, table = page_pool(k8, v8, sl, 16, "HND")
    return [
        ("no-k-scale", lambda: flash_decode(q, k8, v8, sl, v_scale=vs), ValueError, "k_scale"),
        ("no-scales", lambda: flash_decode(q, k8, v8, sl), ValueError, "k_scale"),
        ("scale-shape", lambda: flash_decode(q, k8, v8, sl, k_scale=torch.ones(3), v_scale=vs), ValueError, "k_scale"),
        ("scale-dtype", lambda: flash_decode(q, k8, v8, sl, k_scale=ks.double(), v_scale=vs), TypeError, "k_scale"),
        ("scale-negative", lambda: flash_decode(q, k8, v8, sl, k_scale=-1.0, v_scale=1.0), ValueError, "k_scale"),
        ("scale-beyond-float32", lambda: flash_decode(q, k8, v8, sl, k_scale=1e39, v_scale=1.0), ValueError,
         "k_scale"),
        ("v-scale-beyond-float32", lambda: flash_decode(q, k8, v8, sl, k_scale=1.0, v_scale=1e39), ValueError,
         "v_scale"),
        ("cascade-scale-beyond-float32", lambda: cascade_decode(q, [CascadeLevel(k8, v8, sl)], k_scale=1e39,
                                                                v_scale=1.0), ValueError, "k_scale"),
        ("scales-mixed", lambda: flash_decode(q, k8, v8, sl, k_scale=1.0, v_scale=vs), TypeError, "k_scale"),
        ("scale-tensor-inf", lambda: flash_decode(q, k8, v8, sl, k_scale=torch.tensor(float("inf"), device=DEVICE),
                                                  v_scale=vs), ValueError, "k_scale"),
        ("scale-tensor-nan", lambda: flash_decode(q, k8, v8, sl, k_scale=ks, v_scale=vs * float("nan")), ValueError,
         "v_scale"),
        ("scale-tensor-zero", lambda: flash_decode(q, k8, v8, sl, k_scale=ks * 0, v_scale=vs), ValueError, "k_scale"),
        ("scale-tensor-negative", lambda: flash_decode(q, k8, v8, sl, k_scale=-ks, v_scale=vs), ValueError, "k_scale"),
        ("scale-per-head-one-bad", lambda: flash_decode(q, k8, v8, sl, k_scale=torch.tensor([1.0, -1.0], device=DEVICE),
                                                        v_scale=vs), ValueError, "k_scale"),
        ("fp8-q", lambda: flash_decode(q.to(torch.float8_e4m3fn), k8, v8, sl, k_scale=ks, v_scale=vs), TypeError, "q"),
        ("fp32-q", lambda: flash_decode(q.float(), k8, v8, sl, k_scale=ks, v_scale=vs), TypeError, "q"),
        ("scale-for-bf16", lambda: flash_decode(q, k, v, sl, k_scale=1.0, v_scale=1.0), ValueError, "k_scale"),
        ("kv-dtypes-differ", lambda: flash_decode(q, k8, v8.to(torch.float8_e5m2), sl, k_scale=ks, v_scale=vs),
         TypeError, "v"),
        ("quantize-dtype", lambda: quantize_kv(k, v, torch.bfloat16), TypeError, "dtype"),
        ("quantize-per-head", lambda: quantize_kv(k, v, per_head=1), TypeError, "per_head"),
        ("streams-paged", lambda: flash_decode(q, kp, vp, sl, block_table=table, k_scale=ks, v_scale=vs,
                                               plan=DecodePlan(FP8_TWO_WARPS, 1, 1, streams=4)), ValueError, "plan"),
        ("one-warp-off-sm90", lambda: flash_decode(q, k8, v8, sl, k_scale=ks, v_scale=vs,
                                                   plan=DecodePlan(FP8_ONE_WARP, 1, 3)), ValueError, "plan"),
        ("page-tiles-small-pages", lambda: flash_decode(q, kp, vp, sl, block_table=table, k_scale=ks, v_scale=vs,
                                                        plan=DecodePlan(FP8_TABLE_LOOP, 1, 1, page_tiles=True)),
         ValueError, "plan"),
    ]


BAD = _bad()


def test_given_one_warp_plans_match_the_cache(monkeypatch):
    """A given one-warp plan (Note [One-warp FP8 tiles]) past the device check: one table entry a tile
    (``page_tiles``) exactly where the pages hold whole tiles, else an entry a key in 16-key tiles, none on a
    dense cache; each mismatch is a ValueError before any launch."""
    monkeypatch.setattr("cp_attention.heuristics.one_warp_fp8", lambda *args: True)
    q, k, v, sl = dense_cache(2, 8, 2, 64, 128, [64, 3], q_rows=None, dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    mismatches = [(0, FP8_ONE_WARP, True), (16, FP8_ONE_WARP, False), (32, FP8_ONE_WARP_LONG, False),
                  (8, FP8_ONE_WARP, True), (16, FP8_ONE_WARP_LONG, False), (16, FP8_ONE_WARP_LONG, True),
                  (16, FP8_ONE_WARP_FEW, False), (32, FP8_ONE_WARP_FEW, False)]
    for page, config, tiles in mismatches:
        kw = {}
        kc, vc = k8, v8
        if page:
            kc, vc, table = page_pool(k8, v8, sl, page, "HND")
            kw["block_table"] = table
        plan = DecodePlan(config, 1, 64 // config.block_n, page_tiles=tiles)
        with pytest.raises(ValueError, match=r"^plan\b"):
            flash_decode(q, kc, vc, sl, k_scale=ks, v_scale=vs, plan=plan, **kw)


def test_one_warp_kernel_takes_windows_row_limits_and_row_tiles(monkeypatch):
    """Past the device check, the one-warp kernel (Note [One-warp FP8 tiles]) is planned for windows, softcaps,
    sinks, row limits and more than 16 query rows per KV head: a warp per 16 rows in one program where the
    pages hold whole 32-key tiles (dense included), else a program per 16 rows (the combine's row tiles the
    same); one wave, splits that cover a window or a rank's span from a whole tile below its first position;
    deterministic splits, more than ONE_WARP_MAX_ROWS rows and splits of fewer than ONE_WARP_KEYS_PER_ROW keys a
    row (the states would rival the K/V) keep the Triton kernel. The launches are recorded, not run (a Gluon
    kernel has no interpreter path; tests/test_gpu.py runs them)."""
    from cp_attention import _device, decode, heuristics
    from cp_attention.ops import _launch

    one_warp_fp8 = heuristics.one_warp_fp8

    def sm90(device, *args):  # the domain of an sm_90 device, outside the interpreter
        with monkeypatch.context() as m:
            m.delenv("TRITON_INTERPRET", raising=False)
            return one_warp_fp8(torch.device("cuda", 0), *args)

    monkeypatch.setattr(heuristics, "one_warp_fp8", sm90)
    monkeypatch.setattr(_device, "_SM90", {torch.device("cuda", 0): True})
    monkeypatch.setattr(decode, "_PREPARED", {})
    monkeypatch.setattr(decode, "_LAST", (None, None))
    launches = []
    monkeypatch.setattr(_launch.Launcher, "__call__", lambda self, *args: launches.append(self))
    b, t, d, hkv = 16, 6016, 128, 2
    cases = [  # (Q rows, GQA group, window, row limits, split_size, sinks, softcap, page size): (warps, row tiles)
        ((1, 4, 700, False, None, False, None, 0), (1, 1)), ((5, 4, None, False, None, True, 30.0, 0), (2, 1)),
        ((4, 8, 5000, False, None, True, None, 64), (2, 1)), ((2, 16, None, True, None, False, None, 0), (2, 1)),
        ((3, 8, 4000, False, None, False, 10.0, 16), (1, 2)), ((4, 4, None, True, None, False, None, 1), (1, 1)),
        ((2, 16, None, True, None, False, None, 32), (2, 1)), ((3, 16, 900, False, None, True, None, 0), (0, 0)),
        ((1, 4, None, False, 512, False, None, 0), (0, 0)), ((3, 8, 333, False, None, False, None, 0), (0, 0)),
        ((4, 4, 700, False, None, False, None, 0), (0, 0)), ((4, 8, 1000, False, None, False, None, 64), (0, 0))]
    # (the last four: 48 rows, given splits, 512 keys, and splits of fewer than ONE_WARP_KEYS_PER_ROW keys a row)
    for (q_rows, group, window, limits, split_size, sinks, softcap, page), (warps, row_tiles) in cases:
        q = torch.randn(b, q_rows, hkv * group, d, dtype=torch.bfloat16, device=DEVICE)
        k8, v8, ks, vs = quantize_kv(torch.randn(b, hkv, t, d, device=DEVICE), torch.randn(b, hkv, t, d, device=DEVICE))
        kw = dict(window_left=window, split_size=split_size, logit_softcap=softcap,
                  sinks=torch.zeros(hkv * group, device=DEVICE) if sinks else None)
        if limits:
            kw["row_limits"] = torch.tensor([[[5, 1200], [41, 5999]] + [[41, 6000]] * (q_rows - 2)] * b,
                                             dtype=torch.int32, device=DEVICE)
        if page:  # pools of the cache's pages in order: [pages, Hkv, page, D]
            k8, v8 = (x.view(b, hkv, t // page, page, d).transpose(1, 2).reshape(-1, hkv, page, d) for x in (k8, v8))
            kw["block_table"] = torch.arange(b * t // page, dtype=torch.int32, device=DEVICE).view(b, -1)
        launches.clear()
        flash_decode(q, k8, v8, torch.full((b,), t - 8, dtype=torch.int32, device=DEVICE), k_scale=ks, v_scale=vs,
                     **kw)
        split, *combine = launches
        case = (q_rows, group, window, limits, split_size, page)
        if not warps:
            assert split.kernel.__name__ == "_split_kv_kernel", case
            continue
        assert split.kernel.__name__ == "_split_kv_fp8_kernel", case
        assert split.options["num_warps"] == warps and split.constexprs["BLOCK_H"] == 16 * warps, case
        assert split.grid[0] == b * hkv * row_tiles and split.grid[0] * split.grid[1] * warps <= 8 * REFERENCE_SMS, case
        if combine:
            assert combine[0].grid[0] == split.grid[0] and combine[0].constexprs["BLOCK_H"] == 16 * warps, case
        reach = t if window is None else min(t, window + q_rows + 31)  # a window's keys from a tile below
        assert split.grid[1] * split.static[1] * split.constexprs["BLOCK_N"] >= reach, case


@pytest.mark.parametrize("fn,exc,name", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(fn, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        fn()


@pytest.mark.gpu
def test_cuda_scales_checked_per_tensor_and_version():
    """A CUDA scale tensor's values are checked once per tensor and in-place version: a new tensor that the
    allocator puts where a checked one lived is checked anew, and so is a checked tensor updated in place."""
    q, k, v, sl = dense_cache(1, 4, 2, 33, 32, [33], q_rows=None, dtype=torch.bfloat16)
    k8, v8, _, vs = quantize_kv(k, v, per_head=True)
    good = torch.full((2,), 0.5, device=DEVICE)
    flash_decode(q, k8, v8, sl, k_scale=good, v_scale=vs)
    address = good.data_ptr()
    del good
    bad = torch.full((2,), -0.5, device=DEVICE)
    assert bad.data_ptr() == address  # the caching allocator's reuse, which a check keyed by address would miss
    with pytest.raises(ValueError, match="^k_scale"):
        flash_decode(q, k8, v8, sl, k_scale=bad, v_scale=vs)
    bad.fill_(0.5)
    flash_decode(q, k8, v8, sl, k_scale=bad, v_scale=vs)
    bad[1] = float("inf")
    with pytest.raises(ValueError, match="^k_scale"):
        flash_decode(q, k8, v8, sl, k_scale=bad, v_scale=vs)
