"""cascade_decode against the float64 oracle on each request's concatenated cache, and against flash_decode.

Kernels run under the interpreter on the CPU; outputs and workspaces start as NaN (conftest), so a row
the kernels leave unwritten fails.
"""
import math

import pytest
import torch

from cp_attention import flash_decode
from cp_attention.cascade import CascadeLevel, _tile_table, cascade_decode
from cp_attention.reference import attention

from .conftest import DEVICE, TOL, assert_state_matches



def ints(*xs, dtype=torch.int32):
    return torch.tensor(xs, dtype=dtype, device=DEVICE)


def level(g, n_seg, hkv, t, d, dtype, seq_lens=None, segment_ids=None):
    k = torch.randn(n_seg, hkv, t, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(n_seg, hkv, t, d, generator=g).to(dtype).to(DEVICE)
    return CascadeLevel(k, v, seq_lens, segment_ids)


def concatenated(levels, batch):
    """Per request, its segments of every level concatenated: ``(k, v [B, Hkv, T, D], seq_lens [B])``."""
    ks, vs = [], []
    for b in range(batch):
        parts = []
        for lvl in levels:
            n_seg, t = lvl.k.shape[0], lvl.k.shape[2]
            seg = int(lvl.segment_ids[b]) if lvl.segment_ids is not None else (0 if n_seg == 1 else b)
            n = int(lvl.seq_lens[seg]) if lvl.seq_lens is not None else t
            parts.append((lvl.k[seg, :, :n], lvl.v[seg, :, :n]))
        ks.append(torch.cat([p[0] for p in parts], dim=1))
        vs.append(torch.cat([p[1] for p in parts], dim=1))
    lens = torch.tensor([k.shape[1] for k in ks], device=DEVICE)
    t_max = max(1, int(lens.max()))
    k0 = levels[0].k
    k = torch.zeros(batch, k0.shape[1], t_max, k0.shape[3], dtype=k0.dtype, device=DEVICE)
    v = torch.zeros_like(k)
    for b in range(batch):
        k[b, :, : lens[b]] = ks[b]
        v[b, :, : lens[b]] = vs[b]
    return k, v, lens


def check(q, levels, **kw):
    """cascade_decode vs the float64 reference and vs flash_decode on the concatenated cache."""
    got = cascade_decode(q, levels, return_lse=True, **kw)
    assert got.o.dtype == q.dtype and got.o.shape == q.shape
    assert got.lse.dtype == torch.float32 and got.lse.shape == q.shape[:2]
    k, v, lens = concatenated(levels, q.shape[0])
    ref = attention(q.double(), k.double(), v.double(), lens, sm_scale=kw.get("sm_scale"))
    assert_state_matches(got, ref, q.dtype)
    tol = TOL[q.dtype]
    finite = torch.isfinite(ref.lse)
    flat = flash_decode(q, k, v, lens, sm_scale=kw.get("sm_scale"), return_lse=True)
    torch.testing.assert_close(got.o.float(), flat.o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.lse[finite], flat.lse[finite], atol=tol, rtol=1e-4)
    return got


def prefix_suffix(b, hq, hkv, d, prefix, suffix_lens, dtype, seed=0, q_gain=1.0):
    """A prefix shared by every request (S = 1) and one suffix per request (S = B)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g) * q_gain).to(dtype).to(DEVICE)
    levels = [level(g, 1, hkv, prefix, d, dtype),
              level(g, b, hkv, max(suffix_lens), d, dtype, ints(*suffix_lens))]
    return q, levels


TWO_LEVELS = [
    # (B, Hq, Hkv, D, prefix, suffix lengths, dtype)
    (4, 8, 2, 64, 100, (37, 17, 1, 0), torch.bfloat16),
    (4, 8, 2, 64, 100, (37, 17, 1, 0), torch.float32),
    (3, 4, 4, 32, 77, (5, 30, 2), torch.bfloat16),     # MHA
    (3, 8, 2, 96, 90, (7, 1, 33), torch.float16),      # D not a power of two
    (2, 8, 1, 32, 50, (9, 1), torch.float32),          # group 8, one KV head
    (6, 32, 1, 32, 40, (3, 1, 4, 1, 5, 9), torch.bfloat16),  # 192 rows: BLOCK_M = 128, two row tiles
]


@pytest.mark.parametrize(
    "b,hq,hkv,d,prefix,suffix,dtype", TWO_LEVELS,
    ids=[f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-P{c[4]}-{str(c[6])[6:]}" for c in TWO_LEVELS])
def test_shared_prefix_and_suffix(b, hq, hkv, d, prefix, suffix, dtype):
    q, levels = prefix_suffix(b, hq, hkv, d, prefix, suffix, dtype, seed=b * d)
    check(q, levels)


@pytest.mark.parametrize("splits", [1, 2, 3, 1000], ids=lambda s: f"splits{s}")
def test_prefix_splits(splits):
    # 300 prefix tokens = 10 tiles of the fp32 config; uneven splits, the last one partial.
    q, levels = prefix_suffix(3, 8, 2, 32, 300, (37, 0, 1), torch.float32, seed=splits)
    check(q, levels, _num_splits=splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def test_three_levels_with_groups(dtype):
    # System prompt (S = 1, ragged length 37 of 40) -> documents shared by groups of requests (S = 3;
    # segment 1 is empty, segment 3 is read by nobody) -> each request's own tokens.
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, d = 5, 8, 2, 64
    q = torch.randn(b, hq, d, generator=g).to(dtype).to(DEVICE)
    levels = [
        level(g, 1, hkv, 40, d, dtype, ints(37)),
        level(g, 4, hkv, 60, d, dtype, ints(17, 0, 60, 5), ints(0, 2, 2, 0, 1)),
        level(g, b, hkv, 20, d, dtype, ints(1, 17, 0, 20, 3)),
    ]
    check(q, levels, _num_splits=2)


def test_segments_one_per_request_permuted():
    # S == B with explicit, non-identity segment_ids runs the shared-segment kernel with one request a
    # segment; int64 ids.
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, d = 4, 4, 2, 32
    q = torch.randn(b, hq, d, generator=g).to(DEVICE)
    levels = [level(g, b, hkv, 50, d, torch.float32, ints(50, 1, 0, 33), ints(2, 0, 3, 1, dtype=torch.int64))]
    check(q, levels)


def test_empty_suffix_level():
    q, levels = prefix_suffix(3, 8, 2, 64, 70, (1, 1, 1), torch.bfloat16, seed=11)
    empty = CascadeLevel(levels[1].k[:, :, :0], levels[1].v[:, :, :0])
    check(q, [levels[0], empty])


def test_request_without_keys():
    # Request 0 reads an empty segment and has an empty suffix: o = 0, lse = -inf; the others are exact.
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, d = 3, 8, 2, 32
    q = torch.randn(b, hq, d, generator=g).to(DEVICE)
    levels = [level(g, 2, hkv, 50, d, torch.float32, ints(0, 50), ints(0, 1, 0)),
              level(g, b, hkv, 8, d, torch.float32, ints(0, 3, 5))]
    got = check(q, levels)
    assert torch.isneginf(got.lse[0]).all() and (got.o[0] == 0).all()
    assert torch.isfinite(got.lse[1:]).all()


def test_every_level_empty():
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 32, generator=g).to(DEVICE)
    got = cascade_decode(q, [level(g, 1, 2, 0, 32, torch.float32)], return_lse=True)
    assert (got.o == 0).all() and torch.isneginf(got.lse).all()


def test_large_logits_and_sm_scale():
    q, levels = prefix_suffix(3, 8, 2, 64, 130, (29, 1, 64), torch.float32, seed=2, q_gain=40.0)
    got = check(q, levels, sm_scale=0.3, _num_splits=2)
    assert got.lse.abs().max() > 100


def test_shared_level_fp16_output_at_the_edge_of_the_range():
    """Every V of a shared level = 65504 (fp16 max): the exact output is 65504. The shared-segment kernel
    sums the rounded weights on the tensor cores (``RSUM_DOT``); normalising by the unrounded sum would
    overshoot to inf (the scores as in test_decode's edge case: every weight but one just over 0.5 + 2^-12,
    where fp16 rounds up by the most)."""
    t, d = 200, 32
    q = torch.zeros(3, 2, d, dtype=torch.float16)
    q[..., 0] = 1
    k = torch.zeros(1, 1, t, d, dtype=torch.float16)
    k[0, 0, 0, 0] = 1
    v = torch.full((1, 1, t, d), 65504.0, dtype=torch.float16)
    sm_scale = -math.log(0.5 + 2 ** -12 + 1e-6)
    for splits in (1, 3):
        got = cascade_decode(q.to(DEVICE), [CascadeLevel(k.to(DEVICE), v.to(DEVICE))], sm_scale=sm_scale,
                             return_lse=True, _num_splits=splits)
        assert torch.isfinite(got.o).all() and (got.o == 65504).all(), got.o
        ref = attention(q.double(), k.expand(3, -1, -1, -1).double(), v.expand(3, -1, -1, -1).double(),
                        sm_scale=sm_scale)
        torch.testing.assert_close(got.lse.double().cpu(), ref.lse, atol=1e-5, rtol=0)


def test_return_lse_false_gives_the_output():
    q, levels = prefix_suffix(2, 8, 2, 32, 40, (3, 5), torch.float32, seed=4)
    o = cascade_decode(q, levels)
    assert isinstance(o, torch.Tensor)
    torch.testing.assert_close(o, cascade_decode(q, levels, return_lse=True).o, atol=0, rtol=0)


def test_torch_path(monkeypatch):
    # Without the interpreter, CPU tensors take the plain-torch path; same answers.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator().manual_seed(9)
    b, d = 3, 32
    q = torch.randn(b, 8, d, generator=g)
    levels = [level(g, 1, 2, 30, d, torch.float32), level(g, 2, 2, 20, d, torch.float32, ints(20, 0), ints(1, 0, 1)),
              level(g, b, 2, 6, d, torch.float32, ints(6, 0, 2))]
    if DEVICE != "cpu":
        pytest.skip("the torch path is the CPU fallback")
    check(q, levels)


@pytest.mark.parametrize("segment_ids,n_seg,group,block_m", [
    ((0, 0, 0, 0, 0), 1, 4, 16),      # every request on one segment
    ((2, 0, 2, 2, 0, 1), 4, 8, 16),   # segment 3 unread; segment 2's 24 rows take two tiles
    ((1, 1, 1), 2, 32, 64),           # 96 rows of segment 1; segment 0 unread
])
def test_tile_table_covers_each_row_once(segment_ids, n_seg, group, block_m):
    ids = ints(*segment_ids)
    b = len(segment_ids)
    n_tiles = -(-b * group // block_m) + min(n_seg, b) - 1
    perm, tiles = _tile_table(ids, n_seg, group, block_m, n_tiles)
    seen = []
    for seg, row0, n_rows in tiles.tolist():
        assert 0 <= n_rows <= block_m
        for r in range(row0, row0 + n_rows):
            req = int(perm[r // group])
            assert segment_ids[req] == seg
            seen.append((req, r % group))
    assert sorted(seen) == [(r, h) for r in range(b) for h in range(group)]


def test_strided_index_tensors():
    """seq_lens and segment_ids as columns of [n, 2] tensors: every kernel honours their strides."""
    g = torch.Generator().manual_seed(8)
    b, hq, hkv, d = 4, 8, 2, 32
    q = torch.randn(b, hq, d, generator=g).to(DEVICE)
    grp_meta = ints(60, 1, 0, 9, 17, 5).view(3, 2)           # column 0: the group segments' lengths
    ids_meta = ints(2, 0, 0, 1, 1, 2, 2, 0).view(4, 2)       # column 0: each request's segment
    suf_meta = ints(5, 20, 0, 20, 19, 1, 1, 7).view(4, 2)    # column 0: each request's suffix length
    levels = [level(g, 1, hkv, 50, d, torch.float32),
              level(g, 3, hkv, 60, d, torch.float32, grp_meta[:, 0], ids_meta[:, 0]),
              level(g, b, hkv, 20, d, torch.float32, suf_meta[:, 0])]
    assert levels[1].seq_lens.stride(0) == 2 and levels[1].segment_ids.stride(0) == 2
    got = check(q, levels, _num_splits=2)
    contiguous = [CascadeLevel(lvl.k, lvl.v, *(x.contiguous() if x is not None else None
                                               for x in (lvl.seq_lens, lvl.segment_ids))) for lvl in levels]
    want = cascade_decode(q, contiguous, return_lse=True, _num_splits=2)
    torch.testing.assert_close(got.o, want.o, atol=0, rtol=0)


def _bad_cases():
    """(id, q, levels, exception, message pattern): the message names the argument and what was expected."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 32, generator=g).to(DEVICE)
    f32 = torch.float32
    pre = level(g, 1, 2, 10, 32, f32)
    sfx = level(g, 3, 2, 5, 32, f32)
    return [
        ("levels-empty", q, [], ValueError, "levels must hold at least one"),
        ("levels-not-list", q, pre, TypeError, "levels must be a list or tuple"),
        ("level-plain-tuple", q, [tuple(pre)], TypeError, r"levels\[0\] must be a CascadeLevel"),
        ("k-dtype", q, [pre._replace(k=pre.k.double())], TypeError, r"levels\[0\]\.k must have q's dtype"),
        ("k-strided-last-dim", q, [pre._replace(k=pre.k.transpose(2, 3))], ValueError,
         r"levels\[0\]\.k must have a contiguous last dim"),
        ("v-shape", q, [pre._replace(v=pre.v[:, :, :5])], ValueError,
         r"levels\[0\]\.v must have levels\[0\]\.k's shape"),
        ("head-dim", q, [pre, level(g, 3, 2, 5, 64, f32)], ValueError, r"levels\[1\]\.k must have head dim 32"),
        ("kv-heads-differ", q, [pre, level(g, 3, 4, 5, 32, f32)], ValueError,
         r"levels\[1\]\.k must have 2 KV heads"),
        ("kv-heads-not-divisor", q, [level(g, 1, 3, 5, 32, f32)], ValueError, "multiple of the KV heads"),
        ("segments-neither-1-nor-B", q, [level(g, 2, 2, 5, 32, f32)], ValueError,
         r"levels\[0\]\.segment_ids is None"),
        ("segment-ids-out-of-range", q, [pre._replace(segment_ids=ints(0, 1, 0))], ValueError,
         r"levels\[0\]\.segment_ids must lie in \[0, 0\]"),
        ("segment-ids-negative", q, [sfx._replace(segment_ids=ints(0, -1, 2))], ValueError, "segment_ids must lie in"),
        ("segment-ids-length", q, [pre._replace(segment_ids=ints(0, 0))], ValueError,
         r"levels\[0\]\.segment_ids must have shape \[3\]"),
        ("segment-ids-dtype", q, [pre._replace(segment_ids=torch.zeros(3, device=DEVICE))], TypeError,
         r"levels\[0\]\.segment_ids must have dtype"),
        ("seq-lens-too-long", q, [pre, sfx._replace(seq_lens=ints(1, 6, 2))], ValueError,
         r"levels\[1\]\.seq_lens must lie in \[0, 5\]"),
        ("seq-lens-length", q, [pre._replace(seq_lens=ints(1, 2))], ValueError,
         r"levels\[0\]\.seq_lens must have shape \[1\]"),
        ("q-ndim", q[0], [pre], ValueError, "q must have 3 dims"),
        ("q-head-dim", torch.randn(3, 8, 20).to(DEVICE), [pre], ValueError, "q head dim"),
    ]


BAD = _bad_cases()
HOST_VALUE_CASES = {"segment-ids-out-of-range", "segment-ids-negative", "seq-lens-too-long"}


@pytest.mark.parametrize("name,q,levels,exc,match", BAD, ids=[c[0] for c in BAD])
def test_bad_input(name, q, levels, exc, match):
    if name in HOST_VALUE_CASES:
        # Index values are checked on the host for CPU tensors only (on the GPU a check would need a
        # host sync, so the kernels clamp instead): run these cases on CPU tensors.
        q = q.cpu()
        levels = [CascadeLevel(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in lvl)) for lvl in levels]
    with pytest.raises(exc, match=match):
        cascade_decode(q, levels)


def test_bad_scalar_arguments():
    q, levels = prefix_suffix(2, 8, 2, 32, 10, (1, 2), torch.float32)
    with pytest.raises(TypeError, match="sm_scale"):
        cascade_decode(q, levels, sm_scale=float("nan"))
    with pytest.raises(TypeError, match="return_lse"):
        cascade_decode(q, levels, return_lse=1)


def test_host_tensors_are_checked_at_every_call():
    """The prepared eager path is for CUDA tensors (Note [Cascade attention], eager calls): a call on host
    tensors of a shape seen before is checked again, index values included."""
    q, levels = prefix_suffix(2, 8, 2, 32, 10, (1, 2), torch.float32)
    q, levels = q.cpu(), [CascadeLevel(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in lvl)) for lvl in levels]
    cascade_decode(q, levels)
    bad = [levels[0], levels[1]._replace(seq_lens=levels[1].seq_lens + 5)]
    with pytest.raises(ValueError, match="seq_lens"):
        cascade_decode(q, bad)
