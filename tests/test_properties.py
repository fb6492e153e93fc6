"""Property tests of the public surface: random shapes and options of ``flash_decode``, ``cascade_decode`` and
``merge_states`` against the float64 oracle (``cp_attention.reference.attention``; FP8 caches against the
oracle on the dequantised cache).

Hypothesis draws a plain description of a case (a NamedTuple: shapes, dtypes, layout, options and a tensor
seed), which a builder turns into tensors; a failing case is printed as that description, ready to be kept
as an ``@example``. Every run draws the same examples (``derandomize=True``, no example database), so CI is
reproducible. Shapes are tiny because the kernels run under the Triton interpreter on the CPU; the torch
path (``TRITON_INTERPRET=0`` with CPU tensors) gets its own tests with larger caches.

Every cache holds NaN past each sequence's length (and in the pages no length reaches), so a kernel that
reads a position it must not read fails; kernel outputs start as NaN (conftest), so an unwritten element
fails too.
"""
import math
import os
from typing import NamedTuple, Optional
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cp_attention import AttentionState, CascadeLevel, cascade_decode, flash_decode, merge, merge_states
from cp_attention.reference import attention

from .conftest import DEVICE, TOL, assert_state_matches

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
HEAD_DIMS = [32, 40, 64, 96]
PAGE_SIZES = [1, 3, 16]


def _settings(n):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


def torch_path():
    """CPU tensors take the plain-torch path while this is active (the kernels read the variable at each call)."""
    return mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"})


# ----------------------------------------------------------------------------------------------------
# Strategies: small integers biased to the edges, lengths, options


def _cache_len(max_t):
    """A cache capacity: mostly short (the interpreter runs a tile at a time), sometimes up to ``max_t``."""
    return st.one_of(st.integers(0, 40), st.integers(41, 120), st.integers(121, max_t))


def _lens(b, t):
    """``b`` valid lengths in ``[0, t]``, the edges 0, 1 and ``t`` as likely as the rest."""
    return st.lists(st.one_of(st.sampled_from(sorted({0, min(1, t), t})), st.integers(0, t)), min_size=b, max_size=b)


def _sinks(hq):
    value = st.one_of(st.floats(-8.0, 8.0, width=32), st.sampled_from([-1e4, -200.0, -30.0, 30.0, 80.0, 200.0]))
    return st.none() | st.lists(value, min_size=hq, max_size=hq).map(tuple)


SOFTCAPS = st.none() | st.floats(0.5, 50.0)
SM_SCALES = st.none() | st.floats(0.02, 0.6)
Q_GAINS = st.sampled_from([1.0, 1.0, 8.0, 40.0])  # 40: scores in the hundreds


class DecodeCase(NamedTuple):
    """A ``flash_decode`` call. ``q_rows`` 0: a 3-dim ``q`` (one row); else ``q [B, q_rows, Hq, D]``. ``page``
    0: a dense cache of capacity ``t``; else a page pool of ``t // page`` pages a request (``t`` a multiple
    of ``page``) inside a pool ``spare`` pages larger, in a random order. ``lens`` None: no ``seq_lens``.
    ``fp8``: None or the FP8 format of k/v; ``scales`` "float", "tensor" (0-d) or "head" ([Hkv]) with the
    base values ``k_scale``, ``v_scale``. ``row_limits``: per request and row, ``(lo, hi)``."""

    b: int
    q_rows: int
    hkv: int
    group: int
    d: int
    t: int
    dtype: str
    layout: str = "HND"
    page: int = 0
    spare: int = 0
    lens: Optional[tuple] = None
    lens_int64: bool = False
    views: bool = False  # k, v as views of one larger tensor (their strides honoured)
    fp8: Optional[str] = None
    scales: str = "float"
    k_scale: float = 1.0
    v_scale: float = 1.0
    q_gain: float = 1.0
    sm_scale: Optional[float] = None
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[tuple] = None
    num_splits: Optional[int] = None
    split_size: Optional[int] = None
    row_limits: Optional[tuple] = None
    seed: int = 0


@st.composite
def decode_cases(draw, kind="any", max_t=300):
    """``kind``: "dense", "paged", "fp8" (a dense or paged FP8 cache) or "any"."""
    kind = draw(st.sampled_from(["dense", "paged", "fp8"])) if kind == "any" else kind
    b = draw(st.integers(1, 3))
    q_rows = draw(st.sampled_from([0, 1, 2, 3, 4]))
    hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    hq, rows = hkv * group, max(q_rows, 1)
    d = draw(st.sampled_from(HEAD_DIMS))
    fp8 = draw(st.sampled_from(sorted(FP8))) if kind == "fp8" else None
    dtype = draw(st.sampled_from(["float16", "bfloat16"] if fp8 else sorted(DTYPES)))
    paged = kind == "paged" or (kind == "fp8" and draw(st.booleans()))
    layout = draw(st.sampled_from(["HND", "NHD"]))
    page = spare = 0
    t = draw(_cache_len(max_t))
    if paged:
        page = draw(st.sampled_from(PAGE_SIZES))
        t = -(-t // page) * page
        spare = draw(st.integers(0 if t else 1, 4))  # a pool has at least one page
    lens = draw(st.none() | _lens(b, t)) if not paged else draw(_lens(b, t))
    c = dict(b=b, q_rows=q_rows, hkv=hkv, group=group, d=d, t=t, dtype=dtype, layout=layout, page=page,
             spare=spare, lens=None if lens is None else tuple(lens), lens_int64=draw(st.booleans()),
             views=draw(st.booleans()), fp8=fp8, q_gain=draw(Q_GAINS), sm_scale=draw(SM_SCALES),
             softcap=draw(SOFTCAPS), sinks=draw(_sinks(hq)), seed=draw(st.integers(0, 2**31 - 1)))
    if fp8:
        c.update(scales=draw(st.sampled_from(["float", "tensor", "head"])), k_scale=draw(st.floats(0.01, 3.0)),
                 v_scale=draw(st.floats(0.01, 3.0)))
    # At most one of the window and the row limits; split_size fixes the splits (no num_splits, no window).
    mode = draw(st.sampled_from(["plain", "window", "row_limits"]))
    if mode == "window":
        c["window"] = draw(st.one_of(st.integers(0, 20), st.integers(0, t + 5)))
    elif mode == "row_limits":
        def pair():
            lo = st.one_of(st.integers(0, t), st.integers(-3, t + 3))
            return lo.flatmap(lambda x: st.tuples(st.just(x), st.one_of(st.integers(x, t + 3), st.integers(-3, t))))
        c["row_limits"] = tuple(tuple(draw(pair()) for _ in range(rows)) for _ in range(b))
    splits = draw(st.sampled_from(["policy", "num_splits", "split_size"] if mode != "window" else ["policy", "num_splits"]))
    if splits == "num_splits":
        c["num_splits"] = draw(st.sampled_from([1, 2, 3, 5, 64]))
    elif splits == "split_size":
        c["split_size"] = draw(st.sampled_from([16, 32, 48, 128]))
    return DecodeCase(**c)


# ----------------------------------------------------------------------------------------------------
# Builders and the oracle


def _randn(g, shape, scale=1.0):
    return torch.randn(shape, generator=g) * scale


def _poison_past(x, lens):
    """NaN at the positions ``>= lens[b]`` of ``x [B, Hkv, T, D]`` (float), which no result may read."""
    if lens is None:
        return x
    past = torch.arange(x.shape[2])[None, :] >= torch.tensor(lens, dtype=torch.long)[:, None]
    return x.masked_fill(past[:, None, :, None], float("nan"))


def _scale_arg(kind, base, hkv):
    """A dequantisation scale as the call takes it, and as an ``[Hkv]`` float64 tensor for the oracle."""
    per_head = torch.tensor([base * (1.0 + 0.5 * h) for h in range(hkv)], dtype=torch.float32)
    if kind == "head":
        return per_head.to(DEVICE), per_head.double()
    arg = float(torch.tensor(base, dtype=torch.float32)) if kind == "float" else torch.tensor(base).float().to(DEVICE)
    return arg, torch.full((hkv,), float(torch.tensor(base, dtype=torch.float32)), dtype=torch.float64)


def _dense_kv(g, c_b, hkv, t, d, dtype, lens, fp8, gain=1.0):
    """A dense HND cache (k, v) in ``dtype`` or an FP8 format, NaN past ``lens``."""
    out = []
    for _ in range(2):
        x = _poison_past(_randn(g, (c_b, hkv, t, d), 2.0 if fp8 else gain), lens)
        out.append(x.to(FP8[fp8]) if fp8 else x.to(dtype))
    return out


def _pool(x, page, layout, table, n_pages):
    """Page pool of the dense ``x [B, Hkv, T, D]`` (``T`` a multiple of ``page``): ``[P, page, Hkv, D]``
    ("NHD") or ``[P, Hkv, page, D]`` ("HND"), page ``j`` of request ``b`` at ``table[b, j]``, the pages no
    request uses full of NaN."""
    b, hkv, t, d = x.shape
    n = t // page
    per_page = (page, hkv, d) if layout == "NHD" else (hkv, page, d)
    pool = torch.full((n_pages, *per_page), float("nan")).to(x.dtype)
    pages = x.view(b, hkv, n, page, d).permute(0, 2, 1, 3, 4)  # [B, n, Hkv, page, D]
    if layout == "NHD":
        pages = pages.transpose(2, 3)
    pool[table.long().flatten()] = pages.reshape(b * n, *per_page)
    return pool


def _garbage_table(table, lens, page, n_pages, g):
    """Entries that no length reaches get values outside the pool (never read)."""
    table = table.clone()
    junk = torch.tensor([-1, n_pages, 10**6, -(2**31)], dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // page)
        for j in range(used, table.shape[1]):
            table[i, j] = junk[int(torch.randint(0, 4, (1,), generator=g))]
    return table


def build_decode(c: DecodeCase):
    """The tensors and keyword arguments of a :class:`DecodeCase`, and the float64 oracle's state."""
    g = torch.Generator().manual_seed(c.seed)
    dtype = DTYPES[c.dtype]
    hq = c.hkv * c.group
    q_shape = (c.b, hq, c.d) if c.q_rows == 0 else (c.b, c.q_rows, hq, c.d)
    q = _randn(g, q_shape, c.q_gain).to(dtype)
    k, v = _dense_kv(g, c.b, c.hkv, c.t, c.d, dtype, c.lens, c.fp8)
    kw = dict(sm_scale=c.sm_scale, window_left=c.window, logit_softcap=c.softcap, num_splits=c.num_splits,
              split_size=c.split_size)
    kd, vd = k.double(), v.double()
    if c.fp8:
        (kw["k_scale"], ks64), (kw["v_scale"], vs64) = (_scale_arg(c.scales, s, c.hkv) for s in (c.k_scale, c.v_scale))
        kd, vd = kd * ks64.view(1, -1, 1, 1), vd * vs64.view(1, -1, 1, 1)
    seq_lens = None
    if c.lens is not None:
        seq_lens = torch.tensor(c.lens, dtype=torch.int64 if c.lens_int64 else torch.int32)
        if c.views:  # a column of a [B, 2] tensor
            seq_lens = torch.stack([seq_lens, seq_lens * 0 - 7], dim=1)[:, 0]
    if c.sinks is not None:
        kw["sinks"] = torch.tensor(c.sinks, dtype=torch.float32).to(DEVICE)
    limits = None
    if c.row_limits is not None:
        limits = torch.tensor(c.row_limits, dtype=torch.int64 if c.lens_int64 else torch.int32)
        kw["row_limits"] = limits.to(DEVICE)
    ref = attention(q.double(), kd, vd, seq_lens, sm_scale=c.sm_scale, row_limits=limits, window_left=c.window,
                    logit_softcap=c.softcap, sinks=None if c.sinks is None else torch.tensor(c.sinks).double())
    score = max_score(q, kd, c.sm_scale, c.softcap)
    if c.page:
        n_pages = c.b * (c.t // c.page) + c.spare  # a random permutation of a pool larger than needed
        table = torch.randperm(n_pages, generator=g)[: c.b * (c.t // c.page)].view(c.b, c.t // c.page)
        kp, vp = (_pool(x, c.page, c.layout, table, n_pages) for x in (k, v))
        if c.views:  # k and v as views of one [P, 2, ...] tensor (FlashInfer's combined layout)
            both = torch.stack([kp, vp], dim=1)
            kp, vp = both[:, 0], both[:, 1]
        table = _garbage_table(table.to(torch.int64 if c.lens_int64 else torch.int32), c.lens, c.page, n_pages, g)
        k, v = kp, vp
        kw.update(block_table=table.to(DEVICE), kv_layout=c.layout)
    else:
        if c.views:  # slices of one tensor with room for more positions: no stride is the packed one
            both = torch.full((c.b, 2, c.hkv, c.t + 5, c.d), float("nan")).to(k.dtype)
            both[:, 0, :, : c.t], both[:, 1, :, : c.t] = k, v
            k, v = both[:, 0, :, : c.t], both[:, 1, :, : c.t]
        if c.layout == "NHD":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if not c.views:
                k, v = k.contiguous(), v.contiguous()
        kw["kv_layout"] = c.layout
    sl = None if seq_lens is None else seq_lens.to(DEVICE)
    return (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), sl), kw, ref, score


def max_score(q, k, sm_scale, softcap):
    """The largest |score| of ``q`` against the dense HND cache ``k`` (float64, garbage read as 0)."""
    q4 = q.double() if q.dim() == 4 else q.double()[:, None]
    b, _, hq, d = q4.shape
    kk = k.double().nan_to_num(0.0, 0.0, 0.0).repeat_interleave(hq // k.shape[1], dim=1)
    if kk.shape[2] == 0:
        return 0.0
    s = torch.einsum("bqhd,bhtd->bqht", q4, kk).abs().max().item() * (d ** -0.5 if sm_scale is None else sm_scale)
    return s if softcap is None else min(s, softcap)


def assert_matches(got, ref, dtype, score):
    """:func:`assert_state_matches`, its tolerance widened by 8 float32 ulps of the largest |score|: every
    score is rounded in float32 (relative 2^-24), which moves each weight by a few ulps of |s| (only the
    float32 tolerance notices, at scores in the hundreds)."""
    extra = 8 * torch.finfo(torch.float32).eps * score
    if extra <= 0.1 * TOL[dtype]:
        return assert_state_matches(got, ref, dtype)
    assert not torch.isnan(got.o).any() and not torch.isnan(got.lse).any()
    tol = TOL[dtype] + extra
    torch.testing.assert_close(got.o.double().cpu(), ref.o.cpu(), atol=tol, rtol=tol)
    finite = torch.isfinite(ref.lse)
    assert torch.equal(torch.isfinite(got.lse).cpu(), finite.cpu())
    torch.testing.assert_close(got.lse.double()[finite].cpu(), ref.lse[finite].cpu(), atol=tol, rtol=1e-4)
    assert (got.o[~finite] == 0).all() and torch.isneginf(got.lse[~finite]).all()


def run_decode(c: DecodeCase):
    args, kw, ref, score = build_decode(c)
    q = args[0]
    got = flash_decode(*args, return_lse=True, **kw)
    assert got.o.shape == q.shape and got.o.dtype == q.dtype
    assert got.lse.shape == q.shape[:-1] and got.lse.dtype == torch.float32
    assert_matches(got, ref, q.dtype, score)
    return got


# ----------------------------------------------------------------------------------------------------
# flash_decode under the interpreter


@_settings(40)
@given(c=decode_cases("dense"))
@example(c=DecodeCase(b=1, q_rows=2, hkv=1, group=1, d=32, t=41, dtype="bfloat16", row_limits=(((1, 1), (0, 1)),)))
def test_flash_decode_dense(c):
    run_decode(c)


@_settings(30)
@given(c=decode_cases("paged"))
def test_flash_decode_paged(c):
    run_decode(c)


@_settings(20)
@given(c=decode_cases("fp8"))
def test_flash_decode_fp8(c):
    run_decode(c)


@_settings(40)
@given(c=decode_cases("any", max_t=300))
def test_flash_decode_torch_path(c):
    if DEVICE != "cpu":
        pytest.skip("the torch path is the CPU fallback")
    with torch_path():
        run_decode(c)


# ----------------------------------------------------------------------------------------------------
# cascade_decode


class LevelCase(NamedTuple):
    """One cascade level: ``kind`` "shared" (one segment for all), "per_request" (``S == B``) or "segments"
    (``segment_ids``); ``t`` its capacity (paged: ``page`` > 0, pools ``[P, page, Hkv, D]`` with ``spare``
    pages more than needed); ``fp8``: stored in the case's FP8 format."""

    kind: str
    n_seg: int
    t: int
    page: int = 0
    spare: int = 0
    lens: Optional[tuple] = None
    ids: Optional[tuple] = None
    fp8: bool = False


class CascadeCase(NamedTuple):
    b: int
    q_rows: int  # 0: a 3-dim q
    hkv: int
    group: int
    d: int
    dtype: str
    levels: tuple
    fp8: Optional[str] = None
    scales: str = "float"
    k_scale: float = 1.0
    v_scale: float = 1.0
    q_gain: float = 1.0
    sm_scale: Optional[float] = None
    softcap: Optional[float] = None
    sinks: Optional[tuple] = None
    splits: Optional[int] = None  # the shared-segment kernel's split count (a private knob of the tests)
    seed: int = 0


@st.composite
def level_cases(draw, b, fp8):
    kind = draw(st.sampled_from(["shared", "per_request", "segments"]))
    n_seg = {"shared": 1, "per_request": b}.get(kind) or draw(st.integers(1, 3))
    t = draw(st.one_of(st.integers(0, 40), st.integers(0, 130)))
    page = spare = 0
    if draw(st.booleans()):
        page = draw(st.sampled_from(PAGE_SIZES))
        t = -(-t // page) * page
        spare = draw(st.integers(0 if t else 1, 3))  # a pool has at least one page
    lens = draw(_lens(n_seg, t)) if page else draw(st.none() | _lens(n_seg, t))
    ids = tuple(draw(st.lists(st.integers(0, n_seg - 1), min_size=b, max_size=b))) if kind == "segments" else None
    return LevelCase(kind, n_seg, t, page, spare, None if lens is None else tuple(lens), ids,
                     fp8 is not None and draw(st.booleans()))


@st.composite
def cascade_cases(draw):
    b = draw(st.integers(1, 3))
    hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    fp8 = draw(st.none() | st.sampled_from(sorted(FP8)))
    c = dict(b=b, q_rows=draw(st.sampled_from([0, 1, 2, 3, 4])), hkv=hkv, group=group,
             d=draw(st.sampled_from(HEAD_DIMS)),
             dtype=draw(st.sampled_from(["float16", "bfloat16"] if fp8 else sorted(DTYPES))),
             levels=tuple(draw(st.lists(level_cases(b, fp8), min_size=1, max_size=3))), q_gain=draw(Q_GAINS),
             sm_scale=draw(SM_SCALES), softcap=draw(SOFTCAPS), sinks=draw(_sinks(hkv * group)),
             splits=draw(st.none() | st.sampled_from([1, 2, 3])), seed=draw(st.integers(0, 2**31 - 1)))
    if fp8 and any(lv.fp8 for lv in c["levels"]):
        c.update(fp8=fp8, scales=draw(st.sampled_from(["float", "tensor", "head"])),
                 k_scale=draw(st.floats(0.01, 3.0)), v_scale=draw(st.floats(0.01, 3.0)))
    else:
        c["levels"] = tuple(lv._replace(fp8=False) for lv in c["levels"])
    return CascadeCase(**c)


def build_cascade(c: CascadeCase):
    """The call's ``q``, levels and keywords, and the float64 oracle: per request, its segments of every
    level concatenated, row ``i`` seeing every key of the earlier levels and the keys of the last level
    below ``len - Q + 1 + i``."""
    g = torch.Generator().manual_seed(c.seed)
    dtype = DTYPES[c.dtype]
    hq = c.hkv * c.group
    rows = max(c.q_rows, 1)
    q = _randn(g, (c.b, hq, c.d) if c.q_rows == 0 else (c.b, c.q_rows, hq, c.d), c.q_gain).to(dtype)
    kw = dict(sm_scale=c.sm_scale, logit_softcap=c.softcap)
    ks64 = vs64 = None
    if c.fp8:
        (kw["k_scale"], ks64), (kw["v_scale"], vs64) = (_scale_arg(c.scales, s, c.hkv) for s in (c.k_scale, c.v_scale))
    if c.sinks is not None:
        kw["sinks"] = torch.tensor(c.sinks, dtype=torch.float32).to(DEVICE)
    levels, parts = [], []  # parts[l]: per request, (k, v) float64 [Hkv, n, D]
    for lv in c.levels:
        k, v = _dense_kv(g, lv.n_seg, c.hkv, lv.t, c.d, dtype, lv.lens, c.fp8 if lv.fp8 else None)
        kd, vd = k.double(), v.double()
        if lv.fp8:
            kd, vd = kd * ks64.view(1, -1, 1, 1), vd * vs64.view(1, -1, 1, 1)
        seg = {"shared": [0] * c.b, "per_request": list(range(c.b))}.get(lv.kind) or list(lv.ids)
        n = [lv.t if lv.lens is None else lv.lens[s] for s in seg]
        parts.append([(kd[s, :, : n[i]], vd[s, :, : n[i]]) for i, s in enumerate(seg)])
        lens = None if lv.lens is None else torch.tensor(lv.lens, dtype=torch.int32).to(DEVICE)
        ids = None if lv.ids is None else torch.tensor(lv.ids, dtype=torch.int64).to(DEVICE)
        if lv.page:
            n_pages = lv.n_seg * (lv.t // lv.page) + lv.spare
            table = torch.randperm(n_pages, generator=g)[: lv.n_seg * (lv.t // lv.page)].view(lv.n_seg, -1)
            kp, vp = (_pool(x, lv.page, "NHD", table, n_pages) for x in (k, v))
            table = _garbage_table(table.to(torch.int32), lv.lens, lv.page, n_pages, g)
            levels.append(CascadeLevel(kp.to(DEVICE), vp.to(DEVICE), lens, ids, table.to(DEVICE)))
        else:
            levels.append(CascadeLevel(k.to(DEVICE), v.to(DEVICE), lens, ids))
    total = [sum(p[i][0].shape[1] for p in parts) for i in range(c.b)]
    last = [parts[-1][i][0].shape[1] for i in range(c.b)]
    t_all = max(total + [1])
    kk = torch.zeros(c.b, c.hkv, t_all, c.d, dtype=torch.float64)
    vv = torch.zeros_like(kk)
    for i in range(c.b):
        kk[i, :, : total[i]] = torch.cat([p[i][0] for p in parts], dim=1)
        vv[i, :, : total[i]] = torch.cat([p[i][1] for p in parts], dim=1)
    limits = torch.zeros(c.b, rows, 2, dtype=torch.long)
    for i in range(c.b):
        for r in range(rows):
            limits[i, r, 1] = total[i] - last[i] + max(0, last[i] - rows + 1 + r)
    ref = attention(q.double(), kk, vv, torch.tensor(total), sm_scale=c.sm_scale, row_limits=limits,
                    logit_softcap=c.softcap, sinks=None if c.sinks is None else torch.tensor(c.sinks).double())
    return q.to(DEVICE), levels, kw, ref, max_score(q, kk, c.sm_scale, c.softcap)


def run_cascade(c: CascadeCase):
    q, levels, kw, ref, score = build_cascade(c)
    got = cascade_decode(q, levels, return_lse=True, _num_splits=c.splits, **kw)
    assert got.o.shape == q.shape and got.o.dtype == q.dtype
    assert got.lse.shape == q.shape[:-1] and got.lse.dtype == torch.float32
    assert_matches(got, ref, q.dtype, score)


@_settings(15)
@given(c=cascade_cases())
def test_cascade_decode(c):
    run_cascade(c)


@_settings(20)
@given(c=cascade_cases())
def test_cascade_decode_torch_path(c):
    if DEVICE != "cpu":
        pytest.skip("the torch path is the CPU fallback")
    with torch_path():
        run_cascade(c)


# ----------------------------------------------------------------------------------------------------
# merge_states, merge and |; and a cache cut into pieces whose states merge to the whole


class MergeCase(NamedTuple):
    n: int
    lead: tuple  # the dims between N and D (the last one is the heads' dim for sinks)
    d: int
    dtype: str
    out_dtype: Optional[str] = None
    spread: float = 1.0  # lse values ~ spread * N(0, 1), plus an offset
    offset: float = 0.0
    empty: float = 0.0  # the fraction of empty states (o = 0, lse = -inf)
    sinks: Optional[tuple] = None
    seed: int = 0


@st.composite
def merge_cases(draw):
    lead = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    return MergeCase(n=draw(st.integers(1, 5)), lead=lead, d=draw(st.sampled_from([8, 32, 40, 64, 96])),
                     dtype=draw(st.sampled_from(sorted(DTYPES))), out_dtype=draw(st.none() | st.sampled_from(sorted(DTYPES))),
                     spread=draw(st.sampled_from([0.0, 1.0, 30.0, 1000.0])),
                     offset=draw(st.sampled_from([0.0, -500.0, 700.0])),
                     empty=draw(st.sampled_from([0.0, 0.3, 0.8, 1.0])), sinks=draw(_sinks(lead[-1])),
                     seed=draw(st.integers(0, 2**31 - 1)))


def merge64(o, lse, sinks=None):
    """⊕ over dim 0 by its definition, in float64: ``lse = log sum_j exp(lse_j)`` (+ the sink), ``o`` the
    weighted mean; the empty state (o = 0, lse = -inf) when every input is empty (and no sink)."""
    lse = lse.double()
    m = lse.amax(0)
    m0 = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m0)
    den = w.sum(0)
    o = (w[..., None] * o.double()).sum(0) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    out = torch.where(den > 0, m0 + torch.log(den), torch.full_like(den, float("-inf")))
    if sinks is not None:
        total = torch.logaddexp(out, torch.tensor(sinks, dtype=torch.float64).expand_as(out))
        o, out = o * torch.exp(out - total)[..., None], total
    return AttentionState(o, out)


def run_merge(c: MergeCase):
    g = torch.Generator().manual_seed(c.seed)
    dtype = DTYPES[c.dtype]
    o = _randn(g, (c.n, *c.lead, c.d)).to(dtype)
    lse = (_randn(g, (c.n, *c.lead), c.spread) + c.offset).float()
    empty = torch.rand((c.n, *c.lead), generator=g) < c.empty
    lse = lse.masked_fill(empty, float("-inf"))
    o = o.masked_fill(empty[..., None], 0.0)
    out_dtype = None if c.out_dtype is None else DTYPES[c.out_dtype]
    sinks = None if c.sinks is None else torch.tensor(c.sinks, dtype=torch.float32).to(DEVICE)
    got = merge_states(o.to(DEVICE), lse.to(DEVICE), out_dtype=out_dtype, sinks=sinks)
    want_dtype = dtype if out_dtype is None else out_dtype
    assert got.o.dtype == want_dtype and got.o.shape == o.shape[1:] and got.lse.shape == lse.shape[1:]
    assert got.lse.dtype == torch.float32
    # the inputs' rounding to dtype is in o; the output's rounding to want_dtype is the tolerance
    ref = merge64(o, lse, c.sinks)
    assert_state_matches(got, ref, want_dtype if TOL[want_dtype] > TOL[dtype] else dtype)
    if c.n == 2 and sinks is None:  # merge and | are merge_states of two states, with a.o's dtype
        a, b = AttentionState(o[0].to(DEVICE), lse[0].to(DEVICE)), AttentionState(o[1].to(DEVICE), lse[1].to(DEVICE))
        for st2 in (merge(a, b), a | b):
            assert st2.o.dtype == dtype
            assert_state_matches(st2, ref, dtype)


class PartitionCase(NamedTuple):
    """A dense cache cut at ``cuts`` into pieces; ``flash_decode`` of each piece, merged."""

    b: int
    hkv: int
    group: int
    d: int
    t: int
    dtype: str
    lens: Optional[tuple]
    cuts: tuple
    q_gain: float = 1.0
    sm_scale: Optional[float] = None
    sinks: Optional[tuple] = None
    seed: int = 0


@st.composite
def partition_cases(draw):
    b, hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    t = draw(st.integers(0, 150))
    cuts = tuple(sorted(draw(st.lists(st.integers(0, t), min_size=0, max_size=3))))
    return PartitionCase(b=b, hkv=hkv, group=group, d=draw(st.sampled_from(HEAD_DIMS)), t=t,
                         dtype=draw(st.sampled_from(sorted(DTYPES))), lens=draw(st.none() | _lens(b, t).map(tuple)),
                         cuts=cuts, q_gain=draw(Q_GAINS), sm_scale=draw(SM_SCALES), sinks=draw(_sinks(hkv * group)),
                         seed=draw(st.integers(0, 2**31 - 1)))


def run_partition(c: PartitionCase):
    """The states of the pieces, merged (merge_states with the sinks once; and a left fold of |, the sinks
    joined at the end) equal attention over the whole cache."""
    g = torch.Generator().manual_seed(c.seed)
    dtype = DTYPES[c.dtype]
    hq = c.hkv * c.group
    q = _randn(g, (c.b, hq, c.d), c.q_gain).to(dtype)
    k, v = _dense_kv(g, c.b, c.hkv, c.t, c.d, dtype, c.lens, None)
    lens = torch.full((c.b,), c.t) if c.lens is None else torch.tensor(c.lens)
    sinks = None if c.sinks is None else torch.tensor(c.sinks, dtype=torch.float32)
    ref = attention(q.double(), k.double(), v.double(), lens, sm_scale=c.sm_scale,
                    sinks=None if sinks is None else sinks.double())
    edges = (0, *c.cuts, c.t)
    states = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        piece_lens = (lens - lo).clamp(0, hi - lo).to(torch.int32)
        states.append(flash_decode(q.to(DEVICE), k[:, :, lo:hi].to(DEVICE), v[:, :, lo:hi].to(DEVICE),
                                   piece_lens.to(DEVICE), sm_scale=c.sm_scale, return_lse=True))
    got = merge_states(torch.stack([s.o for s in states]), torch.stack([s.lse for s in states]),
                       sinks=None if sinks is None else sinks.to(DEVICE))
    score = max_score(q, k, c.sm_scale, None)
    assert_matches(got, ref, dtype, score)
    folded = states[0]
    for s in states[1:]:
        folded = folded | s
    if sinks is not None:
        folded = merge_states(folded.o[None], folded.lse[None], sinks=sinks.to(DEVICE))
    assert_matches(folded, ref, dtype, score)


@_settings(25)
@given(c=merge_cases())
def test_merge_states(c):
    run_merge(c)


@_settings(20)
@given(c=merge_cases())
def test_merge_states_torch_path(c):
    if DEVICE != "cpu":
        pytest.skip("the torch path is the CPU fallback")
    with torch_path():
        run_merge(c)


@_settings(10)
@given(c=partition_cases())
def test_pieces_of_a_cache_merge_to_the_whole(c):
    run_partition(c)
