"""Paged KV caches and multi-row queries (speculative drafts) in flash_decode and cascade_decode, against the
float64 oracle on the dense cache (kernels under the interpreter on the CPU).

Page pools are built from a dense cache with shuffled pages, spare pages and the unused tail of every used
page full of NaN, K and V as views of one ``[P, 2, ...]`` tensor, and garbage in the block-table entries
that no length reaches: none of it may reach a result.
"""
import pytest
import torch

from cp_attention import AttentionState, CascadeLevel, cascade_decode, flash_decode
from cp_attention.reference import attention, paged_to_dense

from .conftest import DEVICE, assert_state_matches


def dense_cache(b, hq, hkv, t, d, lens, *, q_rows=1, dtype=torch.float32, seed=0):
    """q ``[B, Q, Hq, D]`` (``[B, Hq, D]`` for ``q_rows=None``), k/v ``[B, Hkv, T, D]`` with NaN past each length."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, hq, d) if q_rows is None else (b, q_rows, hq, d)
    q = torch.randn(shape, generator=g).to(dtype)
    k = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    past = torch.arange(t)[None, :] >= seq_lens[:, None]
    k.masked_fill_(past[:, None, :, None], float("nan"))
    v.masked_fill_(past[:, None, :, None], float("nan"))
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), seq_lens.to(DEVICE)


def page_pool(k, v, seq_lens, page_size, layout, *, spare=3, seed=0, strided_table=False):
    """Pools ``[P, page, Hkv, D]`` ("NHD") or ``[P, Hkv, page, D]`` ("HND") holding ``k``/``v``'s pages in a
    shuffled order, as views of one ``[P, 2, ...]`` tensor, and the block table ``[B, max_pages]`` int32."""
    b, hkv, t, d = k.shape
    max_pages = -(-t // page_size)
    n_pages = b * max_pages + spare
    order = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))[: b * max_pages]
    per_page = (page_size, hkv, d) if layout == "NHD" else (hkv, page_size, d)
    both = torch.full((n_pages, 2, *per_page), float("nan"), dtype=k.dtype, device=k.device)
    for i in range(b):
        for j in range(max_pages):
            lo, hi = j * page_size, min((j + 1) * page_size, t)
            for c, src in enumerate((k, v)):
                part = src[i, :, lo:hi]  # [Hkv, n, D]
                dst = both[order[i * max_pages + j], c]
                if layout == "NHD":
                    dst[: hi - lo] = part.transpose(0, 1)
                else:
                    dst[:, : hi - lo] = part
    table = order.view(b, max_pages).to(torch.int32)
    reached = -(-seq_lens.cpu().long() // page_size)
    for i in range(b):  # garbage where no length reaches: never read
        table[i, int(reached[i]):] = 10**6 + i
    if strided_table:  # a column-major copy: strides (1, B)
        table = table.t().contiguous().t()
    return both[:, 0], both[:, 1], table.to(k.device)


def check(q, k, v, seq_lens, **kw):
    got = flash_decode(q, k, v, seq_lens, return_lse=True, **kw)
    assert got.o.shape == q.shape and got.lse.shape == q.shape[:-1]
    return got


PAGED = [
    # (B, Hq, Hkv, D, T, lens, page size, layout, splits)
    (3, 8, 2, 32, 40, [40, 17, 0], 1, "NHD", 2),
    (3, 8, 2, 32, 150, [150, 64, 1], 5, "HND", 3),
    (2, 4, 4, 64, 200, [200, 129], 16, "NHD", 1),
    (3, 8, 2, 32, 300, [300, 0, 65], 64, "NHD", 3),
    (2, 6, 2, 64, 130, [128, 130], 64, "HND", 2),
]


@pytest.mark.parametrize("b,hq,hkv,d,t,lens,page,layout,splits", PAGED,
                         ids=[f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-T{c[4]}-page{c[6]}-{c[7]}-S{c[8]}" for c in PAGED])
def test_paged_equals_dense(b, hq, hkv, d, t, lens, page, layout, splits):
    q, k, v, sl = dense_cache(b, hq, hkv, t, d, lens, q_rows=None, seed=page)
    kp, vp, table = page_pool(k, v, sl, page, layout, seed=page, strided_table=page == 5)
    got = check(q, kp, vp, sl, block_table=table, kv_layout=layout, num_splits=splits)
    ref = attention(q.double(), k.double(), v.double(), sl)
    assert_state_matches(got, ref, q.dtype)
    dense = flash_decode(q, k, v, sl, num_splits=splits, return_lse=True)
    torch.testing.assert_close(got.o, dense.o, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("page, layout", [(16, "NHD"), (64, "HND"), (32, "NHD")])
def test_table_in_registers_equals_table_in_the_loop(page, layout):
    # Note [Paged tiles from registers]: the same plan with the split's entries read before the loop
    # (split_pages) and with one entry per key inside it gives the same bits; tiles of 64 keys span
    # pages of 16 and 32 and lie inside pages of 64; a ragged last split, a length ending mid-page.
    from cp_attention.heuristics import DecodeConfig, decode_plan, table_pages

    q, k, v, sl = dense_cache(3, 8, 2, 283, 32, [283, 70, 1], q_rows=None, seed=page)
    kp, vp, table = page_pool(k, v, sl, page, layout, seed=page)
    plan = decode_plan(3, 2, 283, 32, torch.float32, 132, 2, DecodeConfig(64, 4, 2))
    regs = plan._replace(split_pages=table_pages(plan, page))  # 192 keys a split: 12, 6 or 3 (+1) pages
    assert regs.split_pages == {16: 16, 32: 8, 64: 4}[page]
    want = check(q, kp, vp, sl, block_table=table, kv_layout=layout, plan=plan)
    got = check(q, kp, vp, sl, block_table=table, kv_layout=layout, plan=regs)
    assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse)
    assert_state_matches(got, attention(q.double(), k.double(), v.double(), sl), torch.float32)


def test_paged_bf16_and_the_torch_path(monkeypatch):
    q, k, v, sl = dense_cache(2, 8, 2, 100, 64, [100, 33], q_rows=None, dtype=torch.bfloat16, seed=3)
    kp, vp, table = page_pool(k, v, sl, 16, "NHD", seed=3)
    ref = attention(q.double(), k.double(), v.double(), sl)
    assert_state_matches(check(q, kp, vp, sl, block_table=table, kv_layout="NHD"), ref, q.dtype)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = [t.cpu() for t in (q, kp, vp, sl)]
    got = flash_decode(*args, block_table=table.cpu(), kv_layout="NHD", return_lse=True)
    assert_state_matches(got, AttentionState(ref.o.cpu(), ref.lse.cpu()), q.dtype)


def test_paged_to_dense_places_every_page():
    _, k, v, sl = dense_cache(2, 4, 2, 37, 32, [37, 20], q_rows=None)
    for layout in ("NHD", "HND"):
        kp, _, table = page_pool(k, v, sl, 8, layout)
        dense = paged_to_dense(kp, table, layout)
        dense = dense if layout == "HND" else dense.transpose(1, 2)
        for i, n in enumerate(sl.tolist()):
            assert torch.equal(dense[i, :, :n], k[i, :, :n])


MULTI = [
    # (B, Q, Hq, Hkv, D, T, lens, page or 0, splits)
    (3, 3, 8, 2, 32, 100, [100, 2, 0], 0, 2),       # a sequence shorter than Q, an empty one
    (2, 4, 4, 4, 64, 130, [130, 4], 16, 3),         # MHA, paged
    (2, 7, 8, 2, 32, 90, [90, 50], 0, 1),
    (2, 16, 16, 2, 32, 45, [45, 17], 5, 2),         # 16 rows x 8 heads: two row tiles, paged
]


@pytest.mark.parametrize("b,qn,hq,hkv,d,t,lens,page,splits", MULTI,
                         ids=[f"B{c[0]}-Q{c[1]}-Hq{c[2]}-Hkv{c[3]}-T{c[5]}-page{c[7]}-S{c[8]}" for c in MULTI])
def test_multi_row_causal(b, qn, hq, hkv, d, t, lens, page, splits):
    q, k, v, sl = dense_cache(b, hq, hkv, t, d, lens, q_rows=qn, seed=qn)
    if page:
        kp, vp, table = page_pool(k, v, sl, page, "NHD", seed=qn)
        got = check(q, kp, vp, sl, block_table=table, kv_layout="NHD", num_splits=splits)
    else:
        got = check(q, k, v, sl, num_splits=splits)
    ref = attention(q.double(), k.double(), v.double(), sl)
    assert_state_matches(got, ref, q.dtype)
    # Row i equals a single-row call on the cache truncated to seq_len - Q + 1 + i.
    for i in range(qn):
        lens_i = (sl - qn + 1 + i).clamp(min=0)
        one = flash_decode(q[:, i].contiguous(), k, v, lens_i, num_splits=splits, return_lse=True)
        torch.testing.assert_close(got.o[:, i], one.o, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got.lse[:, i], one.lse, atol=2e-6, rtol=1e-6)
    short = sl.cpu() < qn
    for bi in torch.nonzero(short).flatten().tolist():  # rows that see no key are empty
        n_empty = qn - int(sl[bi])
        assert torch.isneginf(got.lse[bi, :n_empty]).all() and (got.o[bi, :n_empty] == 0).all()


def test_multi_row_bf16_with_large_logits():
    q, k, v, sl = dense_cache(2, 8, 2, 200, 64, [200, 61], q_rows=4, dtype=torch.bfloat16, seed=9)
    q = (q.float() * 30).to(torch.bfloat16)
    got = check(q, k, v, sl, num_splits=3)
    assert got.lse.abs().max() > 100
    assert_state_matches(got, attention(q.double(), k.double(), v.double(), sl), q.dtype)


def test_cascade_with_a_paged_last_level_and_draft_rows():
    """A dense shared prefix, paged group segments, and each request's own paged tokens with 4 draft rows
    (the causal rule on the last level only) equal flash_decode on each request's concatenated cache."""
    g = torch.Generator().manual_seed(11)
    b, qn, hq, hkv, d = 3, 4, 8, 2, 32
    q = torch.randn(b, qn, hq, d, generator=g).to(DEVICE)
    prefix = CascadeLevel(*(torch.randn(1, hkv, 45, d, generator=g).to(DEVICE) for _ in range(2)))
    _, gk, gv, g_lens = dense_cache(2, hq, hkv, 70, d, [70, 3], seed=12)
    gkp, gvp, g_table = page_pool(gk, gv, g_lens, 16, "NHD", seed=12)
    groups = CascadeLevel(gkp, gvp, g_lens, torch.tensor([1, 0, 1], device=DEVICE), g_table)
    _, sk, sv, s_lens = dense_cache(b, hq, hkv, 30, d, [30, 2, 9], seed=13)
    skp, svp, s_table = page_pool(sk, sv, s_lens, 8, "NHD", seed=13)
    own = CascadeLevel(skp, svp, s_lens, None, s_table)
    got = cascade_decode(q, [prefix, groups, own], return_lse=True, _num_splits=2)
    assert got.o.shape == q.shape and got.lse.shape == q.shape[:-1]
    for i in range(b):
        s = [1, 0, 1][i]
        kk = torch.cat([prefix.k[0], gk[s, :, : int(g_lens[s])], sk[i, :, : int(s_lens[i])]], dim=1)[None]
        vv = torch.cat([prefix.v[0], gv[s, :, : int(g_lens[s])], sv[i, :, : int(s_lens[i])]], dim=1)[None]
        # The causal rule counts from the last level only: row j sees every earlier key and its own
        # tokens < len - Q + 1 + j (none at all for a short last level).
        shared = kk.shape[2] - int(s_lens[i])
        limits = shared + (s_lens[i] - qn + 1 + torch.arange(qn, device=DEVICE)).clamp(min=0)
        ref = attention(q[i:i + 1].double(), kk.double(), vv.double(), row_limits=limits[None])
        assert_state_matches(AttentionState(got.o[i:i + 1], got.lse[i:i + 1]), ref, q.dtype)


def test_cascade_paged_shared_level_equals_dense():
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, d = 4, 8, 2, 32
    q = torch.randn(b, hq, d, generator=g).to(DEVICE)
    _, k, v, lens = dense_cache(3, hq, hkv, 60, d, [60, 0, 33], seed=5)
    kp, vp, table = page_pool(k, v, lens, 16, "NHD", seed=5)
    ids = torch.tensor([2, 0, 0, 1], device=DEVICE)
    own = CascadeLevel(*(torch.randn(b, hkv, 9, d, generator=g).to(DEVICE) for _ in range(2)))
    paged = cascade_decode(q, [CascadeLevel(kp, vp, lens, ids, table), own], return_lse=True, _num_splits=2)
    dense = cascade_decode(q, [CascadeLevel(k, v, lens, ids), own], return_lse=True, _num_splits=2)
    torch.testing.assert_close(paged.o, dense.o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(paged.lse, dense.lse, atol=1e-6, rtol=1e-6)


def _bad():
    q, k, v, sl = dense_cache(2, 8, 2, 40, 32, [40, 3], q_rows=None)
    kp, vp, table = page_pool(k, v, sl, 8, "NHD")
    cpu = [t.cpu() for t in (q, kp, vp, sl, table)]
    return [
        ("block-table-float", lambda: flash_decode(q, kp, vp, sl, block_table=table.float(), kv_layout="NHD"),
         TypeError, "block_table"),
        ("block-table-batch", lambda: flash_decode(q, kp, vp, sl, block_table=table[:1], kv_layout="NHD"),
         ValueError, "block_table"),
        ("block-table-1d", lambda: flash_decode(q, kp, vp, sl, block_table=table[0], kv_layout="NHD"),
         ValueError, "block_table"),
        ("no-seq-lens", lambda: flash_decode(q, kp, vp, None, block_table=table, kv_layout="NHD"),
         ValueError, "seq_lens"),
        ("seq-lens-beyond-pages", lambda: flash_decode(cpu[0], cpu[1], cpu[2], torch.tensor([41, 3]),
                                                       block_table=cpu[4], kv_layout="NHD"), ValueError, "seq_lens"),
        ("page-outside-the-pool", lambda: flash_decode(cpu[0], cpu[1], cpu[2], cpu[3],
                                                       block_table=cpu[4] * 0 + 99, kv_layout="NHD"),
         ValueError, "block_table"),
        ("pool-head-dim", lambda: flash_decode(q, kp[..., :16], vp[..., :16], sl, block_table=table, kv_layout="NHD"),
         ValueError, "k"),
    ]


BAD = _bad()


@pytest.mark.parametrize("fn,exc,name", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(fn, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        fn()
