"""The ⊕ algebra: torch path and the Triton merge kernel (interpreter) against float64 maths."""
import math
import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_attention import AttentionState, lse_from_base2, lse_to_base2, merge, merge_states
from cp_attention.reference import attention
from cp_attention.state import _merge_states_torch


def rand_state(*shape, d=8, spread=300.0, dtype=torch.float32, gen=None):
    o = torch.randn(*shape, d, generator=gen).to(dtype)
    lse = (torch.rand(*shape, generator=gen) - 0.5) * spread
    return AttentionState(o, lse)


def close(a, b, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(a.o.float(), b.o.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(a.lse, b.lse, atol=atol, rtol=rtol)


def merge64(os_, lses):
    """The defining formula, in float64 with max subtraction."""
    o = torch.stack([x.double() for x in os_])
    lse = torch.stack([x.double() for x in lses])
    m = lse.amax(0)
    w = torch.exp(lse - m)
    return (w[..., None] * o).sum(0) / w.sum(0)[..., None], m + torch.log(w.sum(0))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([1.0, 300.0, 3000.0]))
def test_associative_and_commutative(seed, spread):
    g = torch.Generator().manual_seed(seed)
    a, b, c = (rand_state(3, 5, spread=spread, gen=g) for _ in range(3))
    left, right = (a | b) | c, a | (b | c)
    close(left, right, atol=1e-5, rtol=1e-5)
    close(a | b, b | a, atol=1e-6, rtol=1e-6)
    o64, lse64 = merge64([a.o, b.o, c.o], [a.lse, b.lse, c.lse])
    torch.testing.assert_close(left.o.double(), o64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(left.lse.double(), lse64, atol=1e-4, rtol=1e-6)


def test_identity_and_empty():
    a = rand_state(4, 3, d=16)
    e = AttentionState.empty((4, 3), 16)
    # o exactly; lse up to the rounding of the kernels' base-2 round trip (lse * log2(e) * ln(2)).
    for merged in (a | e, e | a):
        assert torch.equal(merged.o, a.o)
        torch.testing.assert_close(merged.lse, a.lse, atol=0, rtol=2e-7)
    ee = e | e
    assert torch.equal(ee.o, torch.zeros(4, 3, 16))
    assert torch.isneginf(ee.lse).all()
    assert AttentionState.empty(5, 8, dtype=torch.bfloat16).o.dtype == torch.bfloat16


def test_state_of_one_key():
    v = torch.randn(2, 8)
    s = torch.tensor([3.0, -700.0])
    one = AttentionState(v, s)
    assert torch.equal((one | AttentionState.empty(2, 8)).o, v)
    # Two keys with equal scores: mean of the values, lse + log 2.
    two = one | AttentionState(-v, s)
    torch.testing.assert_close(two.o, torch.zeros(2, 8), atol=1e-7, rtol=0)
    torch.testing.assert_close(two.lse, s + math.log(2.0))


def test_seed_overflow_case():
    o = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    lse = torch.tensor([95.0, 97.5, 91.2])
    out = merge_states(o, lse)
    torch.testing.assert_close(out.lse, torch.tensor(97.58058), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.o, torch.tensor([0.07657673, 0.92342323]), atol=1e-6, rtol=0)
    assert torch.isfinite(out.o).all()


def test_split_and_merge_equals_one_pass():
    g = torch.Generator().manual_seed(0)
    d, t = 128, 10_000
    q = torch.randn(1, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, t, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, t, d, generator=g, dtype=torch.float64)
    full = attention(q, k, v)
    bounds = torch.linspace(0, t, 8).long().tolist()  # 7 uneven splits
    parts = [attention(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    out = merge_states(torch.stack([p.o.float() for p in parts]), torch.stack([p.lse.float() for p in parts]))
    torch.testing.assert_close(out.o.double(), full.o, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.lse.double(), full.lse, atol=1e-5, rtol=1e-6)


MERGE_CASES = [
    # (N, leading shape, D, dtype)
    (1, (3,), 8, torch.float32),
    (2, (5, 3), 32, torch.float32),
    (7, (37,), 128, torch.float16),
    (3, (2, 3, 5), 256, torch.bfloat16),
    (32, (9,), 96, torch.float32),
]


@pytest.mark.parametrize("n,lead,d,dtype", MERGE_CASES,
                         ids=[f"N{n}-M{'x'.join(map(str, l))}-D{d}-{str(dt)[6:]}" for n, l, d, dt in MERGE_CASES])
def test_merge_kernel_matches_torch_path(n, lead, d, dtype):
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    g = torch.Generator().manual_seed(n * 1000 + d)
    o, lse = rand_state(n, *lead, d=d, spread=600.0, dtype=dtype, gen=g)
    lse[0, ...].view(-1)[0] = float("-inf")  # an empty state among them
    if n > 1:
        lse[:, ...].view(n, -1)[:, -1] = float("-inf")  # a row that is empty in every state
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = merge_states(o.to(dev), lse.to(dev))
    want = _merge_states_torch(o, lse)
    assert got.o.dtype == dtype and got.lse.dtype == torch.float32
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.o.cpu().float(), want.o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.lse.cpu(), want.lse, atol=1e-4, rtol=1e-6)
    if n > 1:
        assert torch.isneginf(got.lse.view(-1)[-1]) and (got.o.reshape(-1, d)[-1] == 0).all()
    o64, lse64 = merge64(list(o), list(lse))
    finite = torch.isfinite(lse64)
    torch.testing.assert_close(got.o.cpu().double()[finite], o64[finite], atol=tol, rtol=tol)


def test_merge_kernel_non_contiguous_input():
    o, lse = rand_state(4, 6, d=64)
    o_t = o.transpose(0, 1).contiguous().transpose(0, 1)  # [4, 6, 64] with permuted strides
    close(merge_states(o_t, lse), _merge_states_torch(o, lse))


def test_merge_mixed_dtypes_keeps_a_dtype():
    a = rand_state(3, dtype=torch.bfloat16)
    b = rand_state(3)
    out = merge(a, b)
    assert out.o.dtype == torch.bfloat16
    ref = merge(AttentionState(a.o.float(), a.lse), b)
    torch.testing.assert_close(out.o.float(), ref.o, atol=1e-2, rtol=1e-2)


def test_base2_roundtrip():
    lse = torch.tensor([0.0, 1.0, -3.5, float("-inf")])
    torch.testing.assert_close(lse_to_base2(lse), lse / math.log(2.0))
    torch.testing.assert_close(lse_from_base2(lse_to_base2(lse)), lse)


BAD = [
    ("o-not-tensor", lambda: merge_states([1.0], torch.zeros(1)), TypeError, "o"),
    ("lse-float64", lambda: merge_states(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.float64)), TypeError, "lse"),
    ("o-int", lambda: merge_states(torch.zeros(2, 3, 4, dtype=torch.int32), torch.zeros(2, 3)), TypeError, "o"),
    ("lse-shape", lambda: merge_states(torch.zeros(2, 3, 4), torch.zeros(2, 4)), ValueError, "lse"),
    ("o-1d", lambda: merge_states(torch.zeros(4), torch.zeros(())), ValueError, "o"),
    ("merge-shapes", lambda: merge(rand_state(3), rand_state(4)), ValueError, "b.o"),
    ("merge-lse-dtype", lambda: merge(rand_state(3), AttentionState(torch.zeros(3, 8), torch.zeros(3, dtype=torch.float16))),
     TypeError, "b.lse"),
    ("merge-not-state", lambda: merge(rand_state(3), 5), TypeError, "b"),
    ("lse-device", lambda: merge_states(torch.zeros(2, 3, 4), torch.zeros(2, 3, device="meta")), ValueError, "lse"),
]


@pytest.mark.parametrize("fn,exc,name", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(fn, exc, name):
    # The message starts with the argument's name (a bare search for "b" would match "must be").
    with pytest.raises(exc, match=rf"^{re.escape(name)}\b"):
        fn()


@pytest.fixture(params=["kernel", "torch"])
def merge_path(request, monkeypatch):
    """Run merge_states through the Triton kernel (GPU, or the interpreter) or the torch path (CPU)."""
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("level", [1e4, 1e5, -3e4])
def test_merge_precision_at_large_lse(level, merge_path):
    """States at |lse| ~ 1e4..1e5: the max is subtracted before any change of base, so the weights are
    exact to fp32 (converting lse to base 2 first costs ~1e-4 of o at 1e4)."""
    g = torch.Generator().manual_seed(1)
    o = torch.randn(2, 64, 32, generator=g)
    lse = torch.full((2, 64), level)
    lse[1, 32:] -= 1.0  # half the rows tied, half one nat apart
    got = merge_states(o.to(merge_path), lse.to(merge_path))
    o64, lse64 = merge64(list(o), list(lse))
    torch.testing.assert_close(got.o.cpu().double(), o64, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.lse.cpu().double(), lse64, atol=abs(level) * 2 ** -23, rtol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
def test_merge_of_non_finite_lse(merge_path):
    """lse = +inf: infinite mass, the +inf states share the result and the lse stays +inf. lse = NaN: the
    row is NaN. All empty: o = 0, lse = -inf."""
    g = torch.Generator().manual_seed(2)
    o = torch.randn(3, 4, 8, generator=g)
    lse = torch.randn(3, 4, generator=g)
    lse[0, 0] = float("inf")                       # row 0: one infinite state
    lse[0, 1] = lse[2, 1] = float("inf")           # row 1: two of them
    lse[1, 2] = float("nan")                       # row 2: a NaN
    lse[:, 3] = float("-inf")                      # row 3: every state empty
    o[:, 3] = 0
    got = merge_states(o.to(merge_path), lse.to(merge_path))
    go, gl = got.o.cpu(), got.lse.cpu()
    assert torch.equal(go[0], o[0, 0]) and gl[0] == float("inf")
    torch.testing.assert_close(go[1], (o[0, 1] + o[2, 1]) / 2, atol=1e-6, rtol=0)
    assert gl[1] == float("inf")
    assert torch.isnan(go[2]).all() and torch.isnan(gl[2])
    assert (go[3] == 0).all() and gl[3] == float("-inf")
