"""Sliding windows, logit softcaps and attention sinks in flash_decode and cascade_decode, against a float64
oracle (kernels under the interpreter on the CPU); context-parallel cases are in test_distributed.py."""
import math

import pytest
import torch

from cp_attention import AttentionState, CascadeLevel, cascade_decode, flash_decode, merge_states
from cp_attention.reference import attention

from .conftest import DEVICE, assert_state_matches
from .test_paged import dense_cache, page_pool


def oracle(q, k, v, sl, **kw):
    return attention(q.double(), k.double(), v.double(), sl, **kw)


def poison_before_windows(k, v, sl, q_rows, window):
    """NaN in K and V below the lowest position any row's window reaches: a result that read them is NaN."""
    first = (sl.long() - q_rows - window).clamp(min=0)
    below = torch.arange(k.shape[2], device=k.device)[None, :] < first[:, None]
    k.masked_fill_(below[:, None, :, None], float("nan"))
    v.masked_fill_(below[:, None, :, None], float("nan"))


WINDOWS = [
    # (Q rows, window, lens, splits, paged)
    (1, 0, [200, 37, 0], 1, False),       # window 0: only the query's own position
    (1, 17, [200, 37, 1], 3, False),
    (1, 500, [200, 37, 5], 2, True),       # larger than the cache: no window
    (4, 9, [200, 3, 0], 2, False),         # each draft row has its own window
    (3, 40, [150, 60, 2], 1, True),
]


@pytest.mark.parametrize("q_rows,window,lens,splits,paged", WINDOWS,
                         ids=[f"Q{c[0]}-W{c[1]}-S{c[3]}{'-paged' if c[4] else ''}" for c in WINDOWS])
def test_sliding_window(q_rows, window, lens, splits, paged):
    q, k, v, sl = dense_cache(3, 8, 2, 200, 32, lens, q_rows=q_rows, seed=window)
    ref = oracle(q, k, v, sl, window_left=window)
    poison_before_windows(k, v, sl, q_rows, window)
    if paged:
        kp, vp, table = page_pool(k, v, sl, 16, "NHD", seed=window)
        got = flash_decode(q, kp, vp, sl, block_table=table, kv_layout="NHD", window_left=window, num_splits=splits,
                           return_lse=True)
    else:
        got = flash_decode(q, k, v, sl, window_left=window, num_splits=splits, return_lse=True)
    assert_state_matches(got, ref, q.dtype)


def test_window_plan_covers_the_window_only():
    """The policy plans a windowed call over the window, not the cache: the same splits as a cache of the
    window's size."""
    from cp_attention.heuristics import decode_plan

    q, k, v, sl = dense_cache(1, 8, 2, 2000, 32, [2000], q_rows=None, dtype=torch.bfloat16, seed=1)
    ref = oracle(q, k, v, sl, window_left=130)
    poison_before_windows(k, v, sl, 1, 130)
    got = flash_decode(q, k, v, sl, window_left=130, return_lse=True)
    assert_state_matches(got, ref, q.dtype)
    assert decode_plan(1, 2, 131, 32, q.dtype, 132).num_splits < decode_plan(1, 2, 2000, 32, q.dtype, 132).num_splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("q_rows", [1, 3])
def test_logit_softcap_bends_large_scores(dtype, q_rows):
    q, k, v, sl = dense_cache(2, 8, 2, 150, 64, [150, 40], q_rows=q_rows, dtype=dtype, seed=5)
    q = (q.float() * 20).to(dtype)  # scores in the hundreds: the cap of 30 bends them
    plain = oracle(q, k, v, sl)
    ref = oracle(q, k, v, sl, logit_softcap=30.0)
    assert (ref.lse - plain.lse).abs().max() > 10
    got = flash_decode(q, k, v, sl, logit_softcap=30.0, num_splits=3, return_lse=True)
    assert_state_matches(got, ref, dtype)
    assert got.lse.max() < 30 + math.log(150) + 1e-3


@pytest.mark.parametrize("cap", [1e30, 1e6, 8.0, 0.25])
def test_logit_softcap_of_any_size(cap):
    """A cap far above every score leaves the scores as they are (tanh keeps its relative precision at small
    arguments); scores on both sides of |s / cap| = 1/8 bend exactly."""
    q, k, v, sl = dense_cache(2, 8, 2, 90, 32, [90, 31], q_rows=2, dtype=torch.float32, seed=9)
    got = flash_decode(q, k, v, sl, logit_softcap=cap, num_splits=2, return_lse=True)
    assert_state_matches(got, oracle(q, k, v, sl, logit_softcap=cap), torch.float32)
    if cap > 1e5:
        assert_state_matches(got, oracle(q, k, v, sl), torch.float32)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_sinks_join_once(splits):
    """One sink logit per head, counted once however many splits; an empty row gets o = 0, lse = sink. A
    sink added per split would show in the lse."""
    q, k, v, sl = dense_cache(3, 8, 2, 300, 32, [300, 41, 0], q_rows=None, seed=splits)
    sinks = torch.linspace(-2.0, 3.0, 8, device=DEVICE)
    ref = oracle(q, k, v, sl, sinks=sinks)
    got = flash_decode(q, k, v, sl, sinks=sinks, num_splits=splits, return_lse=True)
    assert not torch.isnan(got.o).any()
    torch.testing.assert_close(got.o.double(), ref.o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got.lse.double(), ref.lse, atol=2e-5, rtol=1e-6)
    assert (got.o[2] == 0).all() and torch.equal(got.lse[2], sinks)


@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("splits", [1, 3])
def test_an_infinite_sink_takes_all_the_mass(monkeypatch, path, splits):
    """A +inf sink holds all the mass and has no value: o = 0, lse = +inf on every path (the -inf and large
    sinks of the other heads as the oracle); flash_decode, merge_states and cascade_decode alike."""
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, sl = dense_cache(2, 8, 2, 200, 32, [200, 0], q_rows=None, seed=7)
    if path == "torch":
        q, k, v, sl = (t.cpu() for t in (q, k, v, sl))
    sinks = torch.tensor([float("inf"), float("-inf"), 80.0, -80.0, 0.0, 1.0, float("inf"), 2.0], device=q.device)
    inf = torch.isposinf(sinks)
    ref = oracle(q, k, v, sl, sinks=sinks)
    got = flash_decode(q, k, v, sl, sinks=sinks, num_splits=splits, return_lse=True)
    casc = cascade_decode(q, [CascadeLevel(k[:1, :, :50], v[:1, :, :50], sl[:1] * 0 + 50),
                              CascadeLevel(k, v, sl)], sinks=sinks, return_lse=True)
    parts = [flash_decode(q, k[:, :, a:b], v[:, :, a:b], (sl - a).clamp(0, b - a), return_lse=True)
             for a, b in ((0, 120), (120, 200))]
    merged = merge_states(torch.stack([p.o for p in parts]), torch.stack([p.lse for p in parts]), sinks=sinks)
    for st in (got, merged):
        assert (st.o[:, inf] == 0).all() and torch.isposinf(st.lse[:, inf]).all()
        torch.testing.assert_close(st.o[:, ~inf].double(), ref.o[:, ~inf], atol=2e-5, rtol=2e-5)
    assert (casc.o[:, inf] == 0).all() and torch.isposinf(casc.lse[:, inf]).all()
    assert not torch.isnan(casc.o).any() and not torch.isnan(casc.lse).any()


def test_all_three_together_in_bf16_with_draft_rows_and_pages():
    q, k, v, sl = dense_cache(3, 8, 2, 250, 64, [250, 90, 3], q_rows=4, dtype=torch.bfloat16, seed=8)
    q = (q.float() * 8).to(torch.bfloat16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -3.0, 4.0, 0.25], device=DEVICE)
    ref = oracle(q, k, v, sl, window_left=70, logit_softcap=20.0, sinks=sinks)
    poison_before_windows(k, v, sl, 4, 70)
    kp, vp, table = page_pool(k, v, sl, 16, "NHD", seed=8)
    got = flash_decode(q, kp, vp, sl, block_table=table, kv_layout="NHD", window_left=70, logit_softcap=20.0,
                       sinks=sinks, num_splits=2, return_lse=True)
    assert not torch.isnan(got.o).any()
    torch.testing.assert_close(got.o.double(), ref.o, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.lse.double(), ref.lse, atol=2e-3, rtol=1e-4)


def test_sinks_and_softcap_in_a_three_level_cascade():
    """Three levels (shared prefix, group segments, own tokens): the softcap on every level, the sink joined
    once in the final merge (three levels would add it three times if each level took it)."""
    g = torch.Generator().manual_seed(4)
    b, hq, hkv, d = 4, 8, 2, 32
    q = (torch.randn(b, hq, d, generator=g) * 6).to(DEVICE)
    mk = lambda n, t: [torch.randn(n, hkv, t, d, generator=g).to(DEVICE) for _ in range(2)]  # noqa: E731
    pk, pv = mk(1, 60)
    gk, gv = mk(2, 40)
    sk, sv = mk(b, 10)
    ids = torch.tensor([1, 0, 1, 1], device=DEVICE)
    g_lens = torch.tensor([40, 7], device=DEVICE)
    s_lens = torch.tensor([10, 0, 3, 1], device=DEVICE)
    levels = [CascadeLevel(pk, pv), CascadeLevel(gk, gv, g_lens, ids), CascadeLevel(sk, sv, s_lens)]
    sinks = torch.linspace(-1.0, 2.0, hq, device=DEVICE)
    got = cascade_decode(q, levels, logit_softcap=15.0, sinks=sinks, return_lse=True, _num_splits=2)
    for i in range(b):
        s = int(ids[i])
        kk = torch.cat([pk[0], gk[s, :, : int(g_lens[s])], sk[i, :, : int(s_lens[i])]], 1)[None]
        vv = torch.cat([pv[0], gv[s, :, : int(g_lens[s])], sv[i, :, : int(s_lens[i])]], 1)[None]
        ref = oracle(q[i:i + 1], kk, vv, None, logit_softcap=15.0, sinks=sinks)
        assert_state_matches(AttentionState(got.o[i:i + 1], got.lse[i:i + 1]), ref, q.dtype)


def test_merge_states_with_sinks():
    o = torch.randn(3, 2, 4, 16)
    lse = torch.randn(3, 2, 4)
    lse[:, 1, 2] = float("-inf")  # an empty row
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0])
    got = merge_states(o.to(DEVICE), lse.to(DEVICE), sinks=sinks.to(DEVICE))
    plain = merge_states(o, lse)
    total = torch.logaddexp(plain.lse, sinks.expand(2, 4))
    torch.testing.assert_close(got.lse.cpu(), total, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got.o.cpu(), plain.o * torch.exp(plain.lse - total)[..., None], atol=1e-5, rtol=1e-5)
    assert got.lse[1, 2] == sinks[2] and (got.o[1, 2] == 0).all()


def _bad():
    q, k, v, sl = dense_cache(2, 8, 2, 40, 32, [40, 3], q_rows=None)
    return [
        ("window-negative", lambda: flash_decode(q, k, v, sl, window_left=-1), ValueError, "window_left"),
        ("window-float", lambda: flash_decode(q, k, v, sl, window_left=2.5), TypeError, "window_left"),
        ("window-bool", lambda: flash_decode(q, k, v, sl, window_left=True), TypeError, "window_left"),
        ("softcap-zero", lambda: flash_decode(q, k, v, sl, logit_softcap=0.0), ValueError, "logit_softcap"),
        ("softcap-str", lambda: flash_decode(q, k, v, sl, logit_softcap="30"), TypeError, "logit_softcap"),
        ("softcap-beyond-float32", lambda: flash_decode(q, k, v, sl, logit_softcap=1e300), ValueError,
         "logit_softcap"),
        ("softcap-log2e-beyond-float32", lambda: flash_decode(q, k, v, sl, logit_softcap=3e38), ValueError,
         "logit_softcap"),
        ("softcap-int-beyond-float", lambda: flash_decode(q, k, v, sl, logit_softcap=10**400), ValueError,
         "logit_softcap"),
        ("sinks-length", lambda: flash_decode(q, k, v, sl, sinks=torch.zeros(7, device=DEVICE)), ValueError, "sinks"),
        ("sinks-dtype", lambda: flash_decode(q, k, v, sl, sinks=torch.zeros(8, dtype=torch.float64, device=DEVICE)),
         TypeError, "sinks"),
        ("cascade-softcap", lambda: cascade_decode(q, [CascadeLevel(k, v, sl)], logit_softcap=-2.0), ValueError,
         "logit_softcap"),
        ("cascade-softcap-beyond-float32", lambda: cascade_decode(q, [CascadeLevel(k, v, sl)], logit_softcap=1e300),
         ValueError, "logit_softcap"),
    ]


BAD = _bad()


@pytest.mark.parametrize("fn,exc,name", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(fn, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        fn()
