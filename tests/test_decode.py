"""flash_decode against the float64 oracle: the seed's verification matrix (kernels under the interpreter)."""
import math
import os

import pytest
import torch

from cp_attention import AttentionState, flash_decode, merge
from cp_attention.heuristics import DecodeConfig, DecodePlan, decode_config, decode_plan
from cp_attention.reference import attention

from .conftest import DEVICE, assert_state_matches


def make(b, hq, hkv, t, d, dtype=torch.bfloat16, seed=0, layout="HND", q_gain=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g) * q_gain).to(dtype)
    shape = (b, hkv, t, d) if layout == "HND" else (b, t, hkv, d)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def check(q, k, v, seq_lens=None, layout="HND", **kw):
    """Run flash_decode and compare o and lse with the float64 reference on the same (rounded) inputs."""
    got = flash_decode(q, k, v, seq_lens, kv_layout=layout, return_lse=True, **kw)
    ref = attention(q.double(), k.double(), v.double(), seq_lens, kv_layout=layout, sm_scale=kw.get("sm_scale"))
    assert got.o.dtype == q.dtype and got.o.shape == q.shape
    assert got.lse.dtype == torch.float32 and got.lse.shape == q.shape[:2]
    assert_state_matches(got, ref, q.dtype)
    return got


def lens(*xs):
    return torch.tensor(xs, dtype=torch.int32, device=DEVICE)


BN = decode_config(64, torch.bfloat16).block_n  # BLOCK_N of the bf16 kernel

# Split counts: 1 (no split), 2, 3, and the most (one tile each), over a ragged batch with empty splits.
@pytest.mark.parametrize("splits", [1, 2, 3, 1000], ids=lambda s: f"S{s}")
def test_num_splits_ragged_batch(splits):
    q, k, v = make(4, 8, 2, 1000, 64, torch.float32, seed=splits)
    check(q, k, v, lens(1000, 37, 1, 0), num_splits=splits)


def test_many_splits_merge_in_head_dim_chunks():
    """More than 64 splits of head dim 128 (one tile each): the combine reads every split's state at once in
    chunks of the head dim, a program a chunk, the lse from the first (Note [Level 2 in its own kernel]);
    the shorter sequence's splits past its length hold empty states. Against the float64 oracle."""
    from cp_attention.heuristics import num_sms
    from cp_attention.ops.split_kv import combine_launch_config

    t = 8200
    q, k, v = make(2, 4, 2, t, 128, seed=5)
    plan = decode_plan(2, 2, t, 128, torch.bfloat16, num_sms(q.device), 1000)
    assert plan.num_splits > 64 and combine_launch_config(2, 1, 128, False, plan.num_splits)[2][1] > 1, plan
    check(q, k, v, lens(t, 1000), num_splits=1000)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_combine_config_reads_the_splits_at_once_and_covers_the_head_dim(head_dim):
    """The combine's programs cover the head dim in whole chunks, at most 8192 values a load; deterministic
    splits keep the whole head dim and a BLOCK_S fixed by it (Note [Deterministic splits]: the bits a
    context-parallel merge reproduces); policy splits that fit the old config keep it, the others are read
    up to 256 at once."""
    from cp_attention._device import next_pow2
    from cp_attention.ops.split_kv import combine_launch_config

    full = next_pow2(head_dim)
    for n in (None, 1, 2, 16, 33, 64, 65, 131, 256, 1000):
        constexprs, _, (rows, chunks) = combine_launch_config(4, 1, head_dim, False, n)
        block_s, block_d = constexprs["BLOCK_S"], constexprs["BLOCK_D"]
        assert rows == 4 and block_s * block_d <= 8192 and (chunks - 1) * block_d < head_dim <= chunks * block_d
        if n is None:
            assert (block_d, block_s) == (full, 8192 // full)
        elif next_pow2(n) * full <= 8192:
            assert (block_d, block_s, chunks) == (full, next_pow2(n), 1)
        else:
            assert block_s >= min(n, 256) and block_d >= 32, (n, constexprs)


EDGE_LENS = [1, BN - 1, BN, BN + 1, 2 * BN - 1, 2 * BN + 1, 4 * BN - 1, 4 * BN + 1, 5 * BN]


@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"S{s}")
def test_seq_len_edges(splits):
    # T_max = 5 tiles; with 3 splits a split is 2 tiles (chunk = 2 * BLOCK_N): lengths straddle tile and
    # split edges.
    q, k, v = make(len(EDGE_LENS), 4, 1, 5 * BN, 32, torch.bfloat16, seed=splits)
    check(q, k, v, lens(*EDGE_LENS), num_splits=splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def test_large_logits(dtype):
    q, k, v = make(3, 8, 2, 300, 64, dtype, seed=3, q_gain=40.0)
    got = check(q, k, v, lens(300, 129, 1), num_splits=3)
    assert got.lse.abs().max() > 100  # logits really are in the hundreds


CASES = [
    # (B, Hq, Hkv, D, T, dtype)
    (3, 8, 8, 32, 100, torch.float32),    # MHA
    (2, 8, 2, 40, 150, torch.float16),    # group 4
    (2, 10, 2, 64, 200, torch.bfloat16),  # group 5
    (1, 16, 2, 80, 130, torch.float16),   # group 8
    (2, 12, 2, 96, 77, torch.bfloat16),   # group 6
    (2, 7, 1, 128, 90, torch.float32),    # group 7
    (1, 4, 2, 256, 70, torch.bfloat16),   # D 256
    (2, 3, 3, 192, 40, torch.float16),    # D 192
]


@pytest.mark.parametrize("b,hq,hkv,d,t,dtype", CASES,
                         ids=[f"B{b}-Hq{hq}-Hkv{hkv}-D{d}-T{t}-{str(dt)[6:]}" for b, hq, hkv, d, t, dt in CASES])
def test_shapes_and_dtypes(b, hq, hkv, d, t, dtype):
    q, k, v = make(b, hq, hkv, t, d, dtype, seed=d)
    sl = lens(*[t - 1 - 17 * i for i in range(b)])
    check(q, k, v, sl, num_splits=2)
    check(q, k, v, None)  # default policy, no seq_lens


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_layouts(layout):
    q, k, v = make(2, 8, 2, 200, 64, torch.bfloat16, seed=7, layout=layout)
    check(q, k, v, lens(200, 61), layout=layout, num_splits=2)


def test_layouts_agree():
    q, k, v = make(2, 8, 2, 200, 64, torch.float32, seed=8)
    a = flash_decode(q, k, v, lens(200, 61), num_splits=3)
    b = flash_decode(q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), lens(200, 61),
                     kv_layout="NHD", num_splits=3)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_sliced_cache():
    # A view into a larger cache: every stride differs from the packed one.
    _, big_k, big_v = make(3, 8, 4, 400, 128, torch.float16, seed=9)
    q, _, _ = make(2, 4, 2, 1, 64, torch.float16, seed=10)
    k = big_k[1:, 1:3, 50:350, 32:96]
    v = big_v[1:, 1:3, 50:350, 32:96]
    assert not k.is_contiguous()
    check(q, k, v, lens(300, 45), num_splits=3)
    # NHD slice: [B, T, Hkv, D] view of a larger NHD cache
    nk, nv = big_k.transpose(1, 2)[1:, 10:250, 1:3, :64], big_v.transpose(1, 2)[1:, 10:250, 1:3, :64]
    check(q, nk, nv, lens(240, 3), layout="NHD", num_splits=2)


def test_halves_merge_to_whole():
    """lse is natural-log and scaled: two halves merged with ⊕ equal the whole cache."""
    q, k, v = make(2, 8, 2, 300, 64, torch.float32, seed=11, q_gain=4.0)
    scale = 0.3
    whole = flash_decode(q, k, v, sm_scale=scale, return_lse=True)
    a = flash_decode(q, k[:, :, :113], v[:, :, :113], sm_scale=scale, return_lse=True)
    b = flash_decode(q, k[:, :, 113:], v[:, :, 113:], sm_scale=scale, return_lse=True, num_splits=2)
    both = merge(a, b)
    ref = attention(q.double(), k.double(), v.double(), sm_scale=scale)
    for st in (whole, both):  # fp32 rounding only: |o| <= ~4, |lse| ~ 50
        torch.testing.assert_close(st.o.double(), ref.o, atol=1e-5, rtol=0)
        torch.testing.assert_close(st.lse.double(), ref.lse, atol=2e-5, rtol=0)


def test_result_does_not_depend_on_split_count():
    q, k, v = make(2, 8, 2, 700, 64, torch.float32, seed=12)
    sl = lens(700, 333)
    outs = [flash_decode(q, k, v, sl, num_splits=s, return_lse=True) for s in (1, 2, 5, 11)]
    for o in outs[1:]:
        torch.testing.assert_close(o.o, outs[0].o, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(o.lse, outs[0].lse, atol=1e-6, rtol=1e-6)


def test_all_empty_and_repeated_split_calls():
    """Empty sequences among split ones, and a call after an all-empty one, reusing the workspace: every
    split state is rewritten at every call (an empty one exactly), so nothing of a previous call leaks."""
    q, k, v = make(3, 4, 2, 150, 32, torch.float32, seed=13)
    for sl in (lens(0, 0, 0), lens(150, 0, 7), lens(0, 0, 0)):
        got = check(q, k, v, sl, num_splits=3)
        assert torch.isneginf(got.lse[1]).all() and (got.o[1] == 0).all()


def test_empty_batch_and_empty_cache():
    q, k, v = make(2, 8, 2, 0, 64, torch.float32)
    got = flash_decode(q, k, v, return_lse=True)  # T_max = 0: every sequence is empty
    assert (got.o == 0).all() and torch.isneginf(got.lse).all()
    q, k, v = make(0, 8, 2, 10, 64, torch.float32)
    assert flash_decode(q, k, v, return_lse=True).o.shape == (0, 8, 64)


def test_plan_with_another_tile_config():
    """A caller's plan (tile config and split count) runs and gives the policy's answer."""
    q, k, v = make(2, 8, 2, 500, 64, torch.float32, seed=14)
    sl = lens(500, 99)
    want = flash_decode(q, k, v, sl, return_lse=True)
    plan = decode_plan(2, 2, 500, 64, torch.float32, 132, 4, DecodeConfig(32, 4, 2))
    assert plan.num_splits == 4 and plan.tiles_per_split == 4
    got = flash_decode(q, k, v, sl, plan=plan, return_lse=True)
    torch.testing.assert_close(got.o, want.o, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-6, rtol=1e-6)


def _garbage_cache(dtype):
    """A cache whose positions past each length hold NaN and inf (as after ``torch.empty``), and its clean
    copy with zeros there."""
    q, k, v = make(3, 8, 2, 100, 64, dtype, seed=15)
    sl = lens(100, 5, 0)
    clean_k, clean_v = k.clone(), v.clone()
    for b, n in enumerate(sl.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("inf") if b == 1 else float("nan")
        clean_k[b, :, n:] = 0
        clean_v[b, :, n:] = 0
    return q, k, v, sl, clean_k, clean_v


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_garbage_past_seq_len_is_never_read(path, monkeypatch):
    """NaN/inf in K and V past seq_len (and a seq_len = 0 row) never reach the result, on the CPU torch
    path (no interpreter) as in the kernels."""
    q, k, v, sl, clean_k, clean_v = _garbage_cache(torch.float32)
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        q, k, v, sl = q.cpu(), k.cpu(), v.cpu(), sl.cpu()
    elif DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
    got = flash_decode(q, k, v, sl, return_lse=True)
    ref = attention(q.double().cpu(), clean_k.double().cpu(), clean_v.double().cpu(), sl.cpu())
    assert_state_matches(got, ref, q.dtype)
    assert (got.o[2] == 0).all() and torch.isneginf(got.lse[2]).all()


def test_strided_seq_lens():
    """seq_lens as a column of a [B, 2] tensor: the kernel honours its stride."""
    q, k, v = make(3, 8, 2, 300, 64, torch.float32, seed=16)
    meta = torch.tensor([[300, 7], [37, 300], [1, 0]], dtype=torch.int32, device=DEVICE)
    sl = meta[:, 0]
    assert sl.stride(0) == 2
    for splits in (1, 3):
        got = check(q, k, v, sl, num_splits=splits)
        want = flash_decode(q, k, v, sl.contiguous(), num_splits=splits)
        torch.testing.assert_close(got.o, want, atol=0, rtol=0)


def test_fp16_output_at_the_edge_of_the_range():
    """Every V = 65504 (fp16 max): the exact output is 65504. The weights are rounded to fp16 for P @ V;
    normalising by the unrounded sum would overshoot by up to 2^-12 relative, to inf. The scores put
    every weight but one just over 0.5 + 2^-12, where fp16 rounds up by the most."""
    t, d = 200, 32
    q = torch.zeros(1, 1, d, dtype=torch.float16)
    q[0, 0, 0] = 1
    k = torch.zeros(1, 1, t, d, dtype=torch.float16)
    k[0, 0, 0, 0] = 1  # the max score; the others are sm_scale lower
    v = torch.full((1, 1, t, d), 65504.0, dtype=torch.float16)
    sm_scale = -math.log(0.5 + 2 ** -12 + 1e-6)
    got = flash_decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), sm_scale=sm_scale, num_splits=1, return_lse=True)
    assert torch.isfinite(got.o).all(), got.o
    assert (got.o == 65504).all()
    ref = attention(q.double(), k.double(), v.double(), sm_scale=sm_scale)
    torch.testing.assert_close(got.lse.double().cpu(), ref.lse, atol=1e-5, rtol=0)


def test_out_argument():
    """A caller-owned output (q's dtype, or an fp32 AttentionState with any strides) is written in place;
    the fp32 state is unrounded."""
    q, k, v = make(2, 8, 2, 200, 64, torch.bfloat16, seed=17)
    sl = lens(200, 33)
    want = flash_decode(q, k, v, sl, return_lse=True)
    out = torch.full_like(q, float("nan"))
    assert flash_decode(q, k, v, sl, out=out) is out
    torch.testing.assert_close(out, want.o, atol=0, rtol=0)
    packed = torch.full((2, 8, 65), float("nan"), device=DEVICE)  # [o | lse] rows, as the CP exchange
    st = flash_decode(q, k, v, sl, out=AttentionState(packed[..., :64], packed[..., 64]), return_lse=True)
    assert st.o.data_ptr() == packed.data_ptr()
    torch.testing.assert_close(packed[..., :64].to(torch.bfloat16), want.o, atol=0, rtol=2 ** -7)  # 1 ulp
    torch.testing.assert_close(packed[..., 64], want.lse, atol=0, rtol=0)
    assert not torch.equal(packed[..., :64], want.o.float())  # not rounded through bf16


def test_return_types():
    q, k, v = make(1, 2, 1, 40, 32, torch.float16)
    assert isinstance(flash_decode(q, k, v), torch.Tensor)
    assert isinstance(flash_decode(q, k, v, return_lse=True), AttentionState)
    assert flash_decode(q, k, v, lens(40).long()).dtype == torch.float16  # int64 seq_lens


q0, k0, v0 = make(2, 8, 2, 64, 64, torch.float16)
BAD = [
    ("q-list", lambda: flash_decode([1], k0, v0), TypeError, "q"),
    ("q-int", lambda: flash_decode(q0.int(), k0, v0), TypeError, "q"),
    ("q-5d", lambda: flash_decode(q0[None, None], k0, v0), ValueError, "q"),
    ("q-17-rows", lambda: flash_decode(q0[:, None].expand(2, 17, 8, 64), k0, v0), ValueError, "q"),
    ("k-dtype", lambda: flash_decode(q0, k0.float(), v0), TypeError, "k"),
    ("v-dtype", lambda: flash_decode(q0, k0, v0.bfloat16()), TypeError, "v"),
    ("k-3d", lambda: flash_decode(q0, k0[0], v0), ValueError, "k"),
    ("v-shape", lambda: flash_decode(q0, k0, v0[:, :, :10]), ValueError, "v"),
    ("k-batch", lambda: flash_decode(q0, k0[:1], v0[:1]), ValueError, "k"),
    ("k-head-dim", lambda: flash_decode(q0, k0[..., :32], v0[..., :32]), ValueError, "k"),
    ("k-last-dim-stride", lambda: flash_decode(q0, k0.transpose(2, 3), v0.transpose(2, 3)), ValueError, "k"),
    ("q-last-dim-stride", lambda: flash_decode(q0.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :8].transpose(1, 2).contiguous().transpose(1, 2),
                                               k0, v0), ValueError, "q"),
    ("heads", lambda: flash_decode(q0[:, :7], k0, v0), ValueError, "q heads"),
    ("head-dim-range", lambda: flash_decode(q0[..., :24], k0[..., :24], v0[..., :24]), ValueError, "q head dim"),
    ("head-dim-multiple", lambda: flash_decode(q0[..., :36], k0[..., :36], v0[..., :36]), ValueError, "q head dim"),
    ("out-shape", lambda: flash_decode(q0, k0, v0, out=q0[:1]), ValueError, "out"),
    ("out-dtype", lambda: flash_decode(q0, k0, v0, out=q0.double()), TypeError, "out"),
    ("out-lse-shape", lambda: flash_decode(q0, k0, v0, out=(q0.clone(), torch.zeros(2, device=DEVICE))), ValueError,
     "out.lse"),
    ("plan-type", lambda: flash_decode(q0, k0, v0, plan=(128, 4, 3)), TypeError, "plan"),
    ("plan-and-num_splits", lambda: flash_decode(q0, k0, v0, plan=decode_plan(2, 2, 64, 64, torch.float16, 132),
                                                 num_splits=2), ValueError, "num_splits"),
    ("plan-short", lambda: flash_decode(q0, k0, v0, plan=DecodePlan(DecodeConfig(16, 4, 1), 2, 1)), ValueError,
     "plan covers"),
    ("plan-short-window", lambda: flash_decode(q0, k0, v0, window_left=16,
                                               plan=DecodePlan(DecodeConfig(16, 4, 1), 1, 1)), ValueError, "plan covers"),
    ("plan-no-splits", lambda: flash_decode(q0, k0, v0, plan=DecodePlan(DecodeConfig(16, 4, 1), 0, 4)), ValueError,
     "plan.num_splits"),
    ("plan-tile", lambda: flash_decode(q0, k0, v0, plan=DecodePlan(DecodeConfig(24, 4, 1), 1, 3)), ValueError,
     "plan.config.block_n"),
    ("out-lse-inside-o", lambda: (lambda o: flash_decode(q0, k0, v0, out=(o, o.view(-1)[16:32].view(2, 8))))(
        torch.empty(2, 8, 64, device=DEVICE)), ValueError, "out and out.lse must not share memory"),
    ("out-lse-overlaps-o", lambda: (lambda buf: flash_decode(q0, k0, v0, out=(buf[:, :, :64], buf[:, :, 63])))(
        torch.empty(2, 8, 65, device=DEVICE)), ValueError, "out and out.lse must not share memory"),
    ("layout", lambda: flash_decode(q0, k0, v0, kv_layout="BHTD"), ValueError, "kv_layout"),
    ("seq_lens-dtype", lambda: flash_decode(q0, k0, v0, torch.ones(2)), TypeError, "seq_lens"),
    ("seq_lens-shape", lambda: flash_decode(q0, k0, v0, lens(1, 2, 3)), ValueError, "seq_lens"),
    ("seq_lens-range", lambda: flash_decode(q0.cpu(), k0.cpu(), v0.cpu(), torch.tensor([65, 3])), ValueError, "seq_lens"),
    ("seq_lens-negative", lambda: flash_decode(q0.cpu(), k0.cpu(), v0.cpu(), torch.tensor([-1, 3])), ValueError, "seq_lens"),
    ("seq_lens-device", lambda: flash_decode(q0, k0, v0, torch.ones(2, dtype=torch.int32, device="meta")), ValueError, "seq_lens"),
    ("sm_scale", lambda: flash_decode(q0, k0, v0, sm_scale="0.1"), TypeError, "sm_scale"),
    ("sm_scale-nan", lambda: flash_decode(q0, k0, v0, sm_scale=float("nan")), TypeError, "sm_scale"),
    ("num_splits-type", lambda: flash_decode(q0, k0, v0, num_splits=2.0), TypeError, "num_splits"),
    ("num_splits-zero", lambda: flash_decode(q0, k0, v0, num_splits=0), ValueError, "num_splits"),
    ("return_lse", lambda: flash_decode(q0, k0, v0, return_lse=1), TypeError, "return_lse"),
    ("k-device", lambda: flash_decode(q0, k0.to("meta"), v0), ValueError, "k"),
    ("all-meta", lambda: flash_decode(q0.to("meta"), k0.to("meta"), v0.to("meta"), lens(64, 3).to("meta")), ValueError,
     "q"),
    ("sinks-device", lambda: flash_decode(q0, k0, v0, sinks=torch.zeros(8, device="meta")), ValueError, "sinks"),
    ("out-meta", lambda: flash_decode(q0, k0, v0, out=q0.to("meta")), ValueError, "out"),
]


@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("fn,exc,name", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(fn, exc, name, path, monkeypatch):
    # The message starts with the argument's name (a bare search for "v" would match "have"); the CPU torch
    # path refuses the same inputs.
    if path == "torch":
        if DEVICE != "cpu":
            pytest.skip("the torch path is the CPU fallback")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(exc, match=rf"^{name}\b"):
        fn()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_row_limits_in_any_order(dtype, num_splits):
    """Each query row sees exactly its ``[lo, hi)``, whatever the order of the rows' limits: a row whose lower
    limit is above another's (or empty, or past the cache) does not hide the other's first keys."""
    b, rows, hq, hkv, t, d = 2, 4, 4, 2, 75, 32
    g = torch.Generator().manual_seed(11)
    q = torch.randn(b, rows, hq, d, generator=g).to(dtype).to(DEVICE)
    k, v = (torch.randn(b, hkv, t, d, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    sl = lens(75, 61)
    limits = torch.tensor([[[1, 1], [0, 1], [40, 75], [0, 70]],
                           [[60, 61], [-3, 9], [5, 5], [17, 90]]], dtype=torch.int32, device=DEVICE)
    got = flash_decode(q, k, v, sl, row_limits=limits, return_lse=True, num_splits=num_splits)
    ref = attention(q.double(), k.double(), v.double(), sl, row_limits=limits)
    assert_state_matches(got, ref, dtype)
    assert torch.isneginf(got.lse[0, 0]).all() and torch.isneginf(got.lse[1, 2]).all()  # the empty rows
