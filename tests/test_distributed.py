"""Context-parallel decode (``cp_attention.distributed``) on gloo: W spawned CPU ranks per world size.

One pool of W ranks per world size is spawned once per module (``torch.multiprocessing.spawn``, gloo,
``file://`` rendezvous, a timeout on every collective) and runs the cases below; a case runs on every
rank and asserts there, and the parent compares what the ranks return (bitwise equality across ranks).
Cases marked ``interp`` run the Triton kernels under the interpreter; the others the torch path.
"""
import datetime
import os
import queue
import re
import traceback
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_attention import AttentionState, flash_decode, merge_states
from cp_attention.distributed import (CPKVCache, all_gather_states, cp_cascade_decode, cp_flash_decode,
                                     merge_across_ranks, set_exchange, shard_kv)
from cp_attention.distributed.agree import FIELDS
from cp_attention.reference import attention
from cp_attention.state import AttentionState

TIMEOUT_S = 60
# (atol, rtol) of CP decode against single-rank flash_decode in the same dtype (the CP path rounds the
# per-rank output once more), and of either against the float64 reference.
TOL_SINGLE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1.6e-2)}
TOL_REF = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2)}


# ----------------------------------------------------------------------------------------------------
# The worker pool


def _worker(rank, world, init_file, tasks, results):
    import cp_attention._device as dispatch

    dispatch.POISON_OUTPUTS = True  # every kernel/collective output starts as NaN
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        while (task := tasks[rank].get()) is not None:
            name, kwargs = task
            try:
                results.put((rank, True, globals()[name](rank, world, **kwargs)))
            except Exception:  # reported to the parent, which fails the test
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class _Pool:
    """``world`` spawned ranks in one gloo group, serving cases until closed. ``interpret``: the ranks run the
    Triton kernels under the interpreter, else the torch path. Triton decides interpretation when a kernel
    module is imported, so the ranks start with ``TRITON_INTERPRET`` already set (inherited at spawn)."""

    def __init__(self, world, init_file, interpret):
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1" if interpret else "0"}):
            self.procs = mp.spawn(_worker, args=(world, str(init_file), self.tasks, self.results),
                                  nprocs=world, join=False)

    def run(self, case, **kwargs):
        """Run ``case(rank, world, **kwargs)`` on every rank; return the per-rank results."""
        for q in self.tasks:
            q.put((case.__name__, kwargs))
        out, errors, waited = [None] * self.world, [], 0
        for _ in range(self.world):
            while True:
                try:
                    rank, ok, value = self.results.get(timeout=5)
                    break
                except queue.Empty:
                    waited += 5
                    dead = [p.pid for p in self.procs.processes if not p.is_alive()]
                    if dead or waited > 3 * TIMEOUT_S:
                        pytest.fail(f"{case.__name__}: no answer from the ranks (dead: {dead})")
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            pytest.fail(f"{case.__name__} failed on {len(errors)} of {self.world} ranks:\n" + "\n".join(errors))
        return out

    def close(self):
        for q in self.tasks:
            q.put(None)
        self.procs.join(timeout=30)


class _Pools:
    """The pools of one world size: ``run(case, interpret=..., **kwargs)`` on the pool of that mode."""

    def __init__(self, world, pools, tmp_path_factory):
        self.world, self.pools, self.tmp = world, pools, tmp_path_factory

    def run(self, case, *, interpret=False, **kwargs):
        key = (self.world, interpret)
        if key not in self.pools:
            init = self.tmp.mktemp(f"world{self.world}-{'interp' if interpret else 'torch'}") / "init"
            self.pools[key] = _Pool(self.world, init, interpret)
        return self.pools[key].run(case, **kwargs)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pools = {}

    def get(world):
        return _Pools(world, pools, tmp_path_factory)

    yield get
    for p in pools.values():
        p.close()


# ----------------------------------------------------------------------------------------------------
# Helpers shared by the cases (run inside the workers)


def _cache(b, hq, hkv, t, d, lens, *, dtype=torch.float32, q_gain=40.0, seed=0):
    """The same (q, k, v, seq_lens) on every rank; keys past each sequence's length are NaN (never read)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g) * q_gain).to(dtype)
    k = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    past_end = torch.arange(t)[None, :] >= seq_lens[:, None].long()  # [B, T]
    k.masked_fill_(past_end[:, None, :, None], float("nan"))
    return q, k, v, seq_lens


def _assert_state_close(got, want, tol, what):
    o_want, lse_want = want.o.double(), want.lse.double()
    assert not torch.isnan(got.o).any() and not torch.isnan(got.lse).any(), f"NaN in {what}"
    atol, rtol = tol
    torch.testing.assert_close(got.o.double(), o_want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: o: {m}")
    empty = torch.isneginf(lse_want)
    assert torch.equal(torch.isneginf(got.lse), empty), f"{what}: empty sequences differ"
    assert (got.o[empty] == 0).all(), f"{what}: an empty sequence has o != 0"
    torch.testing.assert_close(got.lse.double()[~empty], lse_want[~empty], atol=1e-3, rtol=1e-5,
                               msg=lambda m: f"{what}: lse: {m}")


def _check_against_single(q, k, v, seq_lens, got):
    single = flash_decode(q, k, v, seq_lens, return_lse=True)
    ref = attention(q.double(), k.double(), v.double(), seq_lens)
    assert got.o.dtype == q.dtype and got.o.shape == q.shape and got.lse.dtype == torch.float32
    _assert_state_close(got, single, TOL_SINGLE[q.dtype], "CP vs single-rank flash_decode")
    _assert_state_close(got, ref, TOL_REF[q.dtype], "CP vs float64 reference")


# ----------------------------------------------------------------------------------------------------
# Cases (each runs on every rank)


def case_decode(rank, world, *, b, hq, hkv, t, d, lens, placement, dtype=torch.float32, layout="HND",
                strided_lens=False):
    q, k, v, seq_lens = _cache(b, hq, hkv, t, d, lens, dtype=dtype)
    kl, vl = (k, v) if layout == "HND" else (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
    ks, vs, ls = shard_kv(kl, vl, seq_lens, rank, world, placement, kv_layout=layout)
    if strided_lens:  # a column of a [B, 2] tensor
        ls = torch.stack([ls, torch.full_like(ls, 10**6)], dim=1)[:, 0]
    got = cp_flash_decode(q, ks, vs, ls, return_lse=True, kv_layout=layout)
    _check_against_single(q, k, v, seq_lens, got)
    o_only = cp_flash_decode(q, ks, vs, ls, check_metadata=False, kv_layout=layout)
    assert torch.equal(o_only, got.o)
    return got


def case_uneven_capacities(rank, world, *, b, hq, hkv, t, d, lens, cuts):
    """Rank r holds positions [cuts[r], cuts[r+1]) as its own shard: capacities differ across ranks."""
    q, k, v, seq_lens = _cache(b, hq, hkv, t, d, lens)
    lo, hi = cuts[rank], cuts[rank + 1]
    ls = (seq_lens - lo).clamp(0, hi - lo)
    got = cp_flash_decode(q, k[:, :, lo:hi], v[:, :, lo:hi], ls, return_lse=True)
    _check_against_single(q, k, v, seq_lens, got)
    return got


def case_gather_and_merge(rank, world, *, dtype):
    """Rank r's state is drawn from seed r; rank 1's second row is empty; lse values in the hundreds."""

    def state_of(r):
        g = torch.Generator().manual_seed(r)
        o = torch.randn(3, 4, 32, generator=g).to(dtype)
        lse = torch.randn(3, 4, generator=g) * 100
        if r == 1:
            o[1], lse[1] = 0, float("-inf")
        return AttentionState(o, lse)

    mine = state_of(rank)
    gathered = all_gather_states(mine)
    assert gathered.o.shape == (world, 3, 4, 32) and gathered.o.dtype == dtype
    assert gathered.lse.shape == (world, 3, 4) and gathered.lse.dtype == torch.float32
    for r in range(world):
        want = state_of(r)
        assert torch.equal(gathered.o[r], want.o) and torch.equal(gathered.lse[r], want.lse), f"rank {r}"
    merged = merge_across_ranks(mine)
    local = merge_states(gathered.o, gathered.lse)  # the same ⊕ (merge_states' own layout sums in another order)
    torch.testing.assert_close(merged.o, local.o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merged.lse, local.lse, atol=1e-6, rtol=1e-6)
    assert merged.o.dtype == dtype and not torch.isnan(merged.o).any()
    return merged


def case_cache_appends(rank, world, *, b, hq, hkv, d, prefix_t, prefix_lens, steps, check_every):
    """A prefix (sharded with from_prefix, or an empty cache) plus ``steps`` appends equals the unsharded
    cache at every checked step."""
    q, k, v, seq_lens = _cache(b, hq, hkv, prefix_t + steps, d, prefix_lens, seed=1)
    k_new = torch.randn(steps, b, hkv, d, generator=torch.Generator().manual_seed(2))
    v_new = torch.randn(steps, b, hkv, d, generator=torch.Generator().manual_seed(3))
    max_seq_len = prefix_t + steps
    if prefix_t:
        cache = CPKVCache.from_prefix(k[:, :, :prefix_t], v[:, :, :prefix_t], seq_lens, max_seq_len)
    else:
        cache = CPKVCache(b, hkv, d, max_seq_len, dtype=torch.float32)
        cache.k.fill_(float("nan"))  # unwritten slots must never be read
    rows = torch.arange(b)
    for s in range(steps):
        cache.append(k_new[s], v_new[s])
        pos = seq_lens.long() + s
        k[rows, :, pos], v[rows, :, pos] = k_new[s], v_new[s]
        if s % check_every == check_every - 1 or s == steps - 1:
            got = cache.decode(q, return_lse=True)
            _check_against_single(q, k, v, seq_lens + s + 1, got)
    # The shard is exactly the interleaved shard of the unsharded cache.
    ks, vs, ls = shard_kv(k, v, seq_lens + steps, rank, world, "interleaved")
    assert torch.equal(cache.seq_lens, ls)
    assert torch.equal(cache.global_seq_lens, (seq_lens + steps).long())
    for i in range(b):
        n = int(ls[i])
        assert torch.equal(cache.k[i, :, :n], ks[i, :, :n]) and torch.equal(cache.v[i, :, :n], vs[i, :, :n])
    return cache.decode(q)


def case_cache_drafts(rank, world, *, b, hq, hkv, d, prefix_t, prefix_lens, page_size, plan):
    """Speculative steps on a (paged) CPKVCache: each step appends Q drafts, decodes Q query rows with the
    causal rule in global positions, and rolls back the rejected ones; every step equals flash_decode with
    Q rows on the unsharded cache. ``plan``: (Q, rejected) per step; rejected is an int or a per-sequence
    list (a [B] tensor)."""
    total = prefix_t + sum(n for n, _ in plan)
    q0, k, v, seq_lens = _cache(b, hq, hkv, total, d, prefix_lens, q_gain=3.0, seed=4)
    cache = CPKVCache.from_prefix(k[:, :, :prefix_t], v[:, :, :prefix_t], seq_lens, total, page_size=page_size)
    if page_size:
        assert cache.block_table is not None and cache.k.shape[1:] == (page_size, hkv, d)
    g = torch.Generator().manual_seed(5)
    lens = seq_lens.long().clone()
    rows = torch.arange(b)
    out = None
    for n_q, rejected in plan:
        k_new = torch.randn(b, n_q, hkv, d, generator=g)
        v_new = torch.randn(b, n_q, hkv, d, generator=g)
        q = torch.randn(b, n_q, hq, d, generator=g) * 3
        cache.append(k_new if n_q > 1 else k_new[:, 0], v_new if n_q > 1 else v_new[:, 0])
        for j in range(n_q):
            k[rows, :, lens + j], v[rows, :, lens + j] = k_new[:, j], v_new[:, j]
        lens += n_q
        out = cache.decode(q, return_lse=True)
        single = flash_decode(q, k, v, lens.int(), return_lse=True)
        ref = attention(q.double(), k.double(), v.double(), lens)
        _assert_state_close(out, single, TOL_SINGLE[q.dtype], "CP drafts vs single-rank flash_decode")
        _assert_state_close(out, ref, TOL_REF[q.dtype], "CP drafts vs float64 reference")
        drop = torch.tensor(rejected) if isinstance(rejected, list) else rejected
        cache.rollback(drop)
        lens -= drop if isinstance(drop, int) else drop.long()
        assert torch.equal(cache.global_seq_lens, lens)
        _, _, ls = shard_kv(k, v, lens, rank, world, "interleaved")
        assert torch.equal(cache.seq_lens.long(), ls.long())
    return out


def case_paged_shards(rank, world, *, b, hq, hkv, t, d, lens, page_size):
    """cp_flash_decode over contiguous shards kept in page pools (each rank its own pool and block table)."""
    q, k, v, seq_lens = _cache(b, hq, hkv, t, d, lens)
    ks, vs, ls = shard_kv(k, v, seq_lens, rank, world, "contiguous")
    c = ks.shape[2]
    pages = -(-c // page_size)
    order = torch.randperm(b * pages + 2, generator=torch.Generator().manual_seed(rank))[: b * pages]
    pool_k = torch.full((b * pages + 2, page_size, hkv, d), float("nan"))
    pool_v = torch.full_like(pool_k, float("nan"))
    for i in range(b):
        for j in range(pages):
            lo, hi = j * page_size, min((j + 1) * page_size, c)
            pool_k[order[i * pages + j], : hi - lo] = ks[i, :, lo:hi].transpose(0, 1)
            pool_v[order[i * pages + j], : hi - lo] = vs[i, :, lo:hi].transpose(0, 1)
    table = order.view(b, pages).to(torch.int32)
    got = cp_flash_decode(q, pool_k, pool_v, ls, block_table=table, kv_layout="NHD", return_lse=True)
    _check_against_single(q, k, v, seq_lens, got)
    return got


def case_cache_fp8(rank, world, *, b, hq, hkv, d, prefix_t, prefix_lens, steps, page_size):
    """An FP8 CPKVCache built from a bf16 prefix (amax scales of the prefix), bf16 tokens appended and
    quantised with the cache's scales: equals single-rank flash_decode on the whole cache quantised with
    the same scales."""
    from cp_attention import quantize_kv
    from cp_attention.quant import quantize

    q, k, v, seq_lens = _cache(b, hq, hkv, prefix_t + steps, d, prefix_lens, dtype=torch.bfloat16, q_gain=3.0, seed=6)
    _, _, ks, vs = quantize_kv(k[:, :, :prefix_t], v[:, :, :prefix_t], per_head=True)
    cache = CPKVCache.from_prefix(k[:, :, :prefix_t], v[:, :, :prefix_t], seq_lens, prefix_t + steps,
                                  dtype=torch.float8_e4m3fn, k_scale=ks, v_scale=vs, page_size=page_size)
    g = torch.Generator().manual_seed(7)
    lens = seq_lens.long().clone()
    rows = torch.arange(b)
    for _ in range(steps):
        k_new = (torch.randn(b, hkv, d, generator=g) * 2).to(torch.bfloat16)  # some beyond the prefix's amax
        v_new = torch.randn(b, hkv, d, generator=g).to(torch.bfloat16)
        cache.append(k_new, v_new)
        k[rows, :, lens], v[rows, :, lens] = k_new, v_new
        lens += 1
    got = cache.decode(q, return_lse=True)
    k8, v8 = quantize(k, ks, torch.float8_e4m3fn, 1), quantize(v, vs, torch.float8_e4m3fn, 1)
    single = flash_decode(q, k8, v8, lens.int(), k_scale=ks, v_scale=vs, return_lse=True)
    _assert_state_close(got, single, TOL_SINGLE[q.dtype], "FP8 CP cache vs single-rank flash_decode")
    return got


def case_variants(rank, world, *, b, hq, hkv, t, d, lens, placement):
    """cp_flash_decode with a softcap and sinks: the sink joins once, after the merge across ranks."""
    q, k, v, seq_lens = _cache(b, hq, hkv, t, d, lens, q_gain=10.0)
    sinks = torch.linspace(-1.0, 3.0, hq)
    ks, vs, ls = shard_kv(k, v, seq_lens, rank, world, placement)
    got = cp_flash_decode(q, ks, vs, ls, logit_softcap=25.0, sinks=sinks, return_lse=True)
    ref = attention(q.double(), k.double(), v.double(), seq_lens, logit_softcap=25.0, sinks=sinks)
    _assert_state_close(got, ref, TOL_REF[q.dtype], "CP softcap + sinks vs float64 reference")
    return got


def case_cache_window(rank, world, *, b, hq, hkv, d, prefix_t, prefix_lens, window, q_rows):
    """CPKVCache.decode with a sliding window in global positions (and draft rows)."""
    total = prefix_t + q_rows
    q0, k, v, seq_lens = _cache(b, hq, hkv, total, d, prefix_lens, q_gain=3.0, seed=9)
    cache = CPKVCache.from_prefix(k[:, :, :prefix_t], v[:, :, :prefix_t], seq_lens, total)
    g = torch.Generator().manual_seed(10)
    k_new, v_new = torch.randn(b, q_rows, hkv, d, generator=g), torch.randn(b, q_rows, hkv, d, generator=g)
    q = torch.randn(b, q_rows, hq, d, generator=g) * 3
    cache.append(k_new, v_new)
    rows = torch.arange(b)
    for j in range(q_rows):
        k[rows, :, seq_lens.long() + j], v[rows, :, seq_lens.long() + j] = k_new[:, j], v_new[:, j]
    lens = seq_lens + q_rows
    sinks = torch.linspace(0.0, 1.0, hq)
    got = cache.decode(q, window_left=window, sinks=sinks, return_lse=True)
    ref = attention(q.double(), k.double(), v.double(), lens, window_left=window, sinks=sinks)
    _assert_state_close(got, ref, TOL_REF[q.dtype], "CP windowed cache vs float64 reference")
    single = flash_decode(q, k, v, lens, window_left=window, sinks=sinks, return_lse=True)
    _assert_state_close(got, single, TOL_SINGLE[q.dtype], "CP windowed cache vs single-rank flash_decode")
    return got


def case_cp_cascade(rank, world, *, b, hq, hkv, d, prefix_t, own_t, own_lens):
    """cp_cascade_decode: every rank holds its contiguous shard of the shared prefix and of each request's
    own tokens; equals cascade_decode on the unsharded levels (softcap and sinks included)."""
    from cp_attention import CascadeLevel, cascade_decode
    from cp_attention.distributed import cp_cascade_decode

    g = torch.Generator().manual_seed(12)
    q = torch.randn(b, hq, d, generator=g) * 4
    pk, pv = torch.randn(1, hkv, prefix_t, d, generator=g), torch.randn(1, hkv, prefix_t, d, generator=g)
    ok, ov = torch.randn(b, hkv, own_t, d, generator=g), torch.randn(b, hkv, own_t, d, generator=g)
    own_lens = torch.tensor(own_lens)
    sinks = torch.linspace(-2.0, 2.0, hq)
    whole = cascade_decode(q, [CascadeLevel(pk, pv), CascadeLevel(ok, ov, own_lens)], logit_softcap=12.0,
                           sinks=sinks, return_lse=True)
    pks, pvs, p_lens = shard_kv(pk, pv, None, rank, world, "contiguous")
    oks, ovs, o_lens = shard_kv(ok, ov, own_lens, rank, world, "contiguous")
    got = cp_cascade_decode(q, [CascadeLevel(pks, pvs, p_lens), CascadeLevel(oks, ovs, o_lens)],
                            logit_softcap=12.0, sinks=sinks, return_lse=True)
    _assert_state_close(got, whole, TOL_SINGLE[q.dtype], "cp_cascade_decode vs cascade_decode")
    return got


def case_deterministic(rank, world, *, b, hq, hkv, t, d, lens, split_size, dtype=torch.float32):
    """cp_flash_decode(split_size=S) over contiguous shards of whole splits is bitwise flash_decode(split_size=S)
    on the unsharded cache (sinks included)."""
    q, k, v, seq_lens = _cache(b, hq, hkv, t, d, lens, dtype=dtype, q_gain=5.0)
    sinks = torch.linspace(-1.0, 1.0, hq)
    ks, vs, ls = shard_kv(k, v, seq_lens, rank, world, "contiguous")
    got = cp_flash_decode(q, ks, vs, ls, split_size=split_size, sinks=sinks, return_lse=True)
    want = flash_decode(q, k, v, seq_lens, split_size=split_size, sinks=sinks, return_lse=True)
    assert torch.equal(got.o, want.o), (got.o - want.o).abs().max()
    assert torch.equal(got.lse, want.lse), (got.lse - want.lse).abs().max()
    return got


def case_mismatch(rank, world, *, what):
    """Rank 1 differs in ``what``: every rank raises ValueError, and the group still works afterwards."""
    from cp_attention import quantize_kv

    b, hq, d, dtype = 2, 8, 32, torch.float32
    seq_lens = torch.tensor([5, 3])
    kw = {}
    odd = rank == 1
    if what == "batch" and odd:
        b, seq_lens = 3, torch.tensor([5, 3, 1])
    elif what == "heads" and odd:
        hq = 4
    elif what == "head-dim" and odd:
        d = 64
    elif what == "dtype" and odd:
        dtype = torch.bfloat16
    elif what == "sm-scale" and odd:
        kw["sm_scale"] = 0.5
    elif what == "bad-seq-lens" and odd:
        seq_lens = torch.tensor([5, 99])  # longer than the shard
    elif what == "sinks":  # by value: rank r's sinks are r
        kw["sinks"] = torch.full((hq,), float(rank))
    elif what == "softcap":
        kw["logit_softcap"] = 1.0 + rank
    elif what == "split-size":
        kw["split_size"] = 16 if odd else 32
    q = torch.randn(b, hq, d).to(dtype)
    k = torch.randn(b, 2, 64, d).to(dtype)
    if what == "fp8-scale":  # tensor scales of another value on rank 1
        q = q.bfloat16()
        k, _, ks, vs = quantize_kv(k, k)
        kw.update(k_scale=ks * (1 + rank), v_scale=vs)
    with pytest.raises(ValueError) as info:
        cp_flash_decode(q, k, k, seq_lens, **kw)
    q, k = torch.ones(2, 8, 32), torch.ones(2, 2, 8, 32)
    o = cp_flash_decode(q, k, k, torch.tensor([5, 3]))  # the group is still in step
    torch.testing.assert_close(o, torch.ones_like(o))
    return str(info.value)


def _grouped_levels(ids):
    """A level of two group segments that requests read by ``ids``, then one segment a request."""
    from cp_attention import CascadeLevel

    g = torch.Generator().manual_seed(13)
    q = torch.randn(3, 8, 32, generator=g)
    gk, gv = torch.randn(2, 2, 24, 32, generator=g), torch.randn(2, 2, 24, 32, generator=g)
    ok, ov = torch.randn(3, 2, 10, 32, generator=g), torch.randn(3, 2, 10, 32, generator=g)
    return q, [CascadeLevel(gk, gv, segment_ids=ids), CascadeLevel(ok, ov)]


def case_cascade_mismatch(rank, world):
    """cp_cascade_decode whose segment_ids differ across ranks (by value, the same shape): every rank raises
    ValueError, and the group still works afterwards."""
    q, levels = _grouped_levels(torch.tensor([0, 1, 1] if rank == 1 else [0, 1, 0]))
    with pytest.raises(ValueError) as info:
        cp_cascade_decode(q, levels)
    o = cp_flash_decode(torch.ones(2, 8, 32), torch.ones(2, 2, 8, 32), torch.ones(2, 2, 8, 32), torch.tensor([5, 3]))
    torch.testing.assert_close(o, torch.ones_like(o))  # the group is still in step
    return str(info.value)


def case_cache_mismatch(rank, world, *, what):
    """A CPKVCache whose rank or world size is not the group's, or a window that differs, raises on every rank."""
    k = torch.randn(2, 2, 40, 32)
    with pytest.raises(ValueError) as info:
        if what == "world-size":
            CPKVCache.from_prefix(k, k, torch.tensor([40, 7]), 64, rank=rank, world_size=world + 1)
        elif what == "rank":
            CPKVCache.from_prefix(k, k, torch.tensor([40, 7]), 64, rank=0, world_size=world)
        elif what == "rollback":  # rank r drops r + 1 tokens: the shards no longer hold one cache
            cache = CPKVCache.from_prefix(k, k, torch.tensor([40, 7]), 64)
            cache.rollback(rank + 1)
            cache.decode(torch.randn(2, 8, 32))
        else:
            cache = CPKVCache.from_prefix(k, k, torch.tensor([40, 7]), 64)
            cache.decode(torch.randn(2, 8, 32), window_left=10 + rank)
    return str(info.value)


def case_one_rank_rejects(rank, world, *, what):
    """Only rank 1 passes a bad argument, one its call rejects before any collective would have run: every rank
    raises (the others naming rank 1), none waits for it, and the group still works afterwards."""
    from cp_attention import CascadeLevel

    odd = rank == 1
    q, k = torch.randn(2, 8, 32), torch.randn(2, 2, 40, 32)
    lens = torch.tensor([40, 7])
    with pytest.raises((ValueError, TypeError)) as info:
        if what == "window":
            cp_flash_decode(q, k, k, lens, **({"window_left": 4} if odd else {}))
        elif what == "q-4d":
            cp_flash_decode(q[:, None] if odd else q, k, k, lens)
        elif what == "check-metadata-type":
            cp_flash_decode(q, k, k, lens, check_metadata="yes" if odd else True)
        elif what == "cache-batch":
            CPKVCache(0 if odd else 2, 2, 32, 64)
        elif what == "cache-window":
            CPKVCache.from_prefix(k, k, lens, 64).decode(q, window_left=-1 if odd else 8)
        elif what == "cache-row-limits":
            limits = torch.zeros(2, 1, 2, dtype=torch.int32)
            CPKVCache.from_prefix(k, k, lens, 64).decode(q, **({"row_limits": limits} if odd else {}))
        elif what == "row-limits":
            cp_flash_decode(q, k, k, lens, **({"row_limits": torch.zeros(2, 1, 2, dtype=torch.int32)} if odd else {}))
        elif what == "cascade-rows":
            level = CascadeLevel(k, k, lens)
            cp_cascade_decode(q[:, None].expand(-1, 2, -1, -1) if odd else q, [level])
        elif what == "merge-shape":  # the same element count, another shape
            o = torch.randn(4, 2, 64) if odd else torch.randn(2, 4, 64)
            merge_across_ranks(AttentionState(o, torch.zeros(o.shape[:-1])))
    o = cp_flash_decode(torch.ones(2, 8, 32), torch.ones(2, 2, 8, 32), torch.ones(2, 2, 8, 32), torch.tensor([5, 3]))
    torch.testing.assert_close(o, torch.ones_like(o))  # the group is still in step
    return str(info.value)


def case_equal_values_agree(rank, world):
    """Equal values in different forms agree across ranks: a softcap 30 and 30.0, an FP8 scale tensor(0.5) and
    0.5, one scale as a 0-d tensor and as an [Hkv] tensor, sinks and sm_scale of 0.0 and -0.0, NaN sinks of
    other payloads, segment_ids in int64 and int32."""
    from cp_attention import quantize_kv

    q, k = torch.randn(2, 8, 32), torch.randn(2, 2, 40, 32)
    lens = torch.tensor([40, 7])
    out = [cp_flash_decode(q, k, k, lens, logit_softcap=30 if rank else 30.0)]
    k8, v8, _, _ = quantize_kv(k, k)
    scale = torch.tensor(0.5) if rank else 0.5
    out.append(cp_flash_decode(q.bfloat16(), k8, v8, lens, k_scale=scale, v_scale=scale))
    scale = torch.full((2,), 0.25) if rank else torch.tensor(0.25)
    out.append(cp_flash_decode(q.bfloat16(), k8, v8, lens, k_scale=scale, v_scale=torch.tensor(0.5)))
    sign = -1.0 if rank else 1.0
    out.append(cp_flash_decode(q, k, k, lens, sinks=torch.full((8,), sign * 0.0), sm_scale=sign * 0.0))
    nan = torch.tensor(float("nan")) if rank else -torch.tensor(float("nan"))  # another sign bit, still NaN
    out.append(cp_flash_decode(q, k, k, lens, sinks=nan.expand(8).clone(), return_lse=True).lse)
    ids = torch.tensor([0, 1, 0])
    out.append(cp_cascade_decode(*_grouped_levels(ids.int() if rank else ids)))
    return out


# ----------------------------------------------------------------------------------------------------
# Tests

DECODE_CASES = [
    pytest.param(2, dict(b=2, hq=4, hkv=4, t=300, d=64, lens=[300, 257], placement="contiguous"),
                 False, id="W2-contiguous-MHA-D64-T300"),
    pytest.param(2, dict(b=3, hq=8, hkv=2, t=300, d=32, lens=[300, 1, 0], placement="interleaved"),
                 True, id="W2-interleaved-GQA-ragged-interp"),
    pytest.param(3, dict(b=4, hq=8, hkv=2, t=100, d=32, lens=[100, 37, 2, 0], placement="contiguous"),
                 False, id="W3-contiguous-GQA-ragged"),
    pytest.param(3, dict(b=4, hq=8, hkv=2, t=100, d=32, lens=[100, 37, 2, 0], placement="interleaved"),
                 True, id="W3-interleaved-GQA-ragged-interp"),
    pytest.param(3, dict(b=2, hq=8, hkv=2, t=130, d=32, lens=[130, 66], placement="contiguous"),
                 True, id="W3-contiguous-GQA-interp"),
    pytest.param(4, dict(b=2, hq=4, hkv=4, t=257, d=64, lens=[257, 3], placement="contiguous",
                         dtype=torch.bfloat16), False, id="W4-contiguous-MHA-bf16-ragged"),
    pytest.param(4, dict(b=2, hq=8, hkv=2, t=257, d=32, lens=[201, 3], placement="interleaved",
                         dtype=torch.bfloat16), False, id="W4-interleaved-GQA-bf16-ragged"),
    pytest.param(8, dict(b=3, hq=8, hkv=2, t=37, d=32, lens=[37, 5, 0], placement="interleaved"),
                 True, id="W8-interleaved-GQA-short-interp"),
    pytest.param(2, dict(b=3, hq=8, hkv=2, t=90, d=32, lens=[90, 41, 3], placement="contiguous", layout="NHD"),
                 False, id="W2-contiguous-NHD-ragged"),
    pytest.param(3, dict(b=3, hq=8, hkv=2, t=90, d=32, lens=[90, 41, 0], placement="interleaved", layout="NHD",
                         strided_lens=True), True, id="W3-interleaved-NHD-strided-lens-interp"),
    pytest.param(2, dict(b=2, hq=4, hkv=2, t=64, d=32, lens=[64, 30], placement="contiguous",
                         strided_lens=True), False, id="W2-contiguous-strided-lens"),
]


@pytest.mark.parametrize("world, case, interpret", DECODE_CASES)
def test_cp_flash_decode_equals_single_rank(pool, world, case, interpret):
    """q x40 (logits in the hundreds); empty shards and empty sequences included."""
    states = pool(world).run(case_decode, interpret=interpret, **case)
    for r, st in enumerate(states[1:], 1):
        assert torch.equal(st.o, states[0].o) and torch.equal(st.lse, states[0].lse), f"rank {r} != rank 0"


@pytest.mark.parametrize("world, cuts", [(2, [0, 10, 150]), (3, [0, 0, 149, 150])],
                         ids=["W2-capacities-10-140", "W3-capacities-0-149-1"])
def test_cp_flash_decode_uneven_capacities(pool, world, cuts):
    states = pool(world).run(case_uneven_capacities, b=2, hq=8, hkv=2, t=150, d=32, lens=[150, 12], cuts=cuts)
    assert all(torch.equal(st.o, states[0].o) for st in states)


@pytest.mark.parametrize("world, dtype", [(3, torch.bfloat16), (4, torch.float32)], ids=["W3-bf16", "W4-fp32"])
def test_all_gather_states_and_merge_bitwise(pool, world, dtype):
    states = pool(world).run(case_gather_and_merge, dtype=dtype)
    for st in states[1:]:
        assert torch.equal(st.o, states[0].o) and torch.equal(st.lse, states[0].lse)
    assert torch.isfinite(states[0].lse).all()


CACHE_CASES = [
    pytest.param(2, dict(b=2, hq=4, hkv=4, d=32, prefix_t=0, prefix_lens=[0, 0], steps=40, check_every=8),
                 False, id="W2-empty-start-40-appends"),
    pytest.param(3, dict(b=3, hq=8, hkv=2, d=32, prefix_t=50, prefix_lens=[50, 2, 0], steps=30, check_every=5),
                 False, id="W3-ragged-prefix-30-appends"),
    pytest.param(4, dict(b=2, hq=8, hkv=2, d=32, prefix_t=61, prefix_lens=[61, 9], steps=9, check_every=9),
                 True, id="W4-ragged-prefix-9-appends-interp"),
]


DRAFT_CASES = [
    pytest.param(2, dict(b=2, hq=8, hkv=2, d=32, prefix_t=30, prefix_lens=[30, 1], page_size=None,
                         plan=[(4, 1), (3, [2, 0]), (1, 0), (4, 3)]), False, id="W2-dense-drafts-rollback"),
    pytest.param(3, dict(b=3, hq=8, hkv=2, d=32, prefix_t=20, prefix_lens=[20, 0, 7], page_size=5,
                         plan=[(4, [1, 3, 0]), (7, 2), (2, 0)]), False, id="W3-page5-drafts-rollback"),
    pytest.param(2, dict(b=2, hq=4, hkv=4, d=32, prefix_t=17, prefix_lens=[17, 3], page_size=16,
                         plan=[(3, 1), (4, [0, 2])]), True, id="W2-page16-drafts-interp"),
]


@pytest.mark.parametrize("world, case, interpret", DRAFT_CASES)
def test_cache_draft_steps_equal_unsharded(pool, world, case, interpret):
    states = pool(world).run(case_cache_drafts, interpret=interpret, **case)
    for st in states[1:]:
        assert torch.equal(st.o, states[0].o) and torch.equal(st.lse, states[0].lse)


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_cp_deterministic_splits_are_bitwise_single_gpu(pool, world):
    """T_max = 384 = 12 splits of 32: whole splits per shard for W in {1, 2, 3, 4}; one empty sequence."""
    states = pool(world).run(case_deterministic, interpret=True, b=3, hq=8, hkv=2, t=384, d=32, lens=[384, 100, 0],
                             split_size=32)
    assert all(torch.equal(st.o, states[0].o) and torch.equal(st.lse, states[0].lse) for st in states)


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_cp_deterministic_splits_on_the_torch_path(pool, world):
    """The torch path runs the same fixed splits merged in the same order: bitwise equal to its own
    flash_decode(split_size=S), and equal to the oracle."""
    states = pool(world).run(case_deterministic, interpret=False, b=3, hq=8, hkv=2, t=384, d=32, lens=[384, 100, 0],
                             split_size=32)
    assert all(torch.equal(st.o, states[0].o) and torch.equal(st.lse, states[0].lse) for st in states)


def test_cp_deterministic_bf16(pool):
    pool(2).run(case_deterministic, interpret=True, b=2, hq=4, hkv=4, t=256, d=64, lens=[256, 61], split_size=64,
                dtype=torch.bfloat16)


@pytest.mark.parametrize("world, placement, interpret", [(2, "contiguous", False), (3, "interleaved", True)],
                         ids=["W2-contiguous", "W3-interleaved-interp"])
def test_cp_softcap_and_sinks(pool, world, placement, interpret):
    states = pool(world).run(case_variants, interpret=interpret, b=3, hq=8, hkv=2, t=120, d=32, lens=[120, 40, 0],
                             placement=placement)
    assert all(torch.equal(st.o, states[0].o) and torch.equal(st.lse, states[0].lse) for st in states)
    assert torch.equal(states[0].lse[2], torch.linspace(-1.0, 3.0, 8))  # an empty sequence: lse = sink


@pytest.mark.parametrize("world, window, q_rows, interpret", [(2, 5, 1, False), (3, 11, 4, True), (3, 200, 3, False)],
                         ids=["W2-window5", "W3-window11-Q4-interp", "W3-window200-Q3"])
def test_cp_cache_window(pool, world, window, q_rows, interpret):
    states = pool(world).run(case_cache_window, interpret=interpret, b=3, hq=8, hkv=2, d=32, prefix_t=60,
                             prefix_lens=[60, 17, 0], window=window, q_rows=q_rows)
    assert all(torch.equal(st.o, states[0].o) for st in states)


@pytest.mark.parametrize("world, interpret", [(2, True), (3, False)], ids=["W2-interp", "W3"])
def test_cp_cascade_decode(pool, world, interpret):
    states = pool(world).run(case_cp_cascade, interpret=interpret, b=4, hq=8, hkv=2, d=32, prefix_t=70, own_t=12,
                             own_lens=[12, 0, 5, 1])
    assert all(torch.equal(st.o, states[0].o) and torch.equal(st.lse, states[0].lse) for st in states)


@pytest.mark.parametrize("world, page", [(2, None), (3, 8)], ids=["W2-dense", "W3-page8"])
def test_fp8_cache_equals_unsharded(pool, world, page):
    states = pool(world).run(case_cache_fp8, interpret=world == 3, b=2, hq=8, hkv=2, d=32, prefix_t=40,
                             prefix_lens=[40, 13], steps=5, page_size=page)
    assert all(torch.equal(st.o, states[0].o) for st in states)


@pytest.mark.parametrize("world, page", [(2, 16), (3, 5)], ids=["W2-page16", "W3-page5"])
def test_cp_flash_decode_paged_shards(pool, world, page):
    states = pool(world).run(case_paged_shards, interpret=world == 3, b=3, hq=8, hkv=2, t=100, d=32,
                             lens=[100, 41, 0], page_size=page)
    assert all(torch.equal(st.o, states[0].o) for st in states)


@pytest.mark.parametrize("world, case, interpret", CACHE_CASES)
def test_cache_appends_equal_unsharded(pool, world, case, interpret):
    outs = pool(world).run(case_cache_appends, interpret=interpret, **case)
    assert all(torch.equal(o, outs[0]) for o in outs)


def case_exchange_choice(rank, world):
    """On gloo the exchange is the collective one whatever is asked, "symm" raises on every rank, and a bad
    name raises before anything is exchanged."""
    from cp_attention.distributed.exchange import CollectiveExchange, exchange_for

    with pytest.raises(ValueError, match="kind must be one of"):
        set_exchange("nvshmem")
    set_exchange("symm")
    with pytest.raises(ValueError, match="set_exchange\\('symm'\\)"):
        exchange_for(None)
    set_exchange("auto")
    assert type(exchange_for(None)) is CollectiveExchange
    q, k = torch.ones(2, 8, 32), torch.ones(2, 2, 8, 32)
    torch.testing.assert_close(cp_flash_decode(q, k, k, torch.tensor([5, 3])), torch.ones_like(q))
    return exchange_for(None).name


def case_symm_exchange_falls_back(rank, world):
    """A symmetric-memory exchange given a buffer it did not allocate (a CPU one here, or one made during a
    CUDA-graph capture) merges through the collective path, bitwise as the collective exchange does."""
    from cp_attention.distributed.exchange import CollectiveExchange, SymmMemExchange

    symm, coll = SymmMemExchange(None), CollectiveExchange(None)
    g = torch.Generator().manual_seed(rank)
    packed = symm.packed_buffer((2, 4, 9), torch.device("cpu"))
    packed.copy_(torch.randn(2, 4, 9, generator=g))
    assert not symm._buffers
    got, want = symm.merge(packed, torch.float32), coll.merge(packed.clone(), torch.float32)
    assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse)
    return got.o


def test_symm_exchange_falls_back_to_the_collective(pool):
    outs = pool(2).run(case_symm_exchange_falls_back)
    assert torch.equal(outs[0], outs[1])


def test_exchange_choice_on_gloo(pool):
    assert pool(2).run(case_exchange_choice) == ["collective", "collective"]


MISMATCHES = {"heads": "q heads", "batch": "q.shape[0]", "head-dim": "head dim", "dtype": "q.dtype",
              "sm-scale": "sm_scale", "sinks": "sinks", "softcap": "logit_softcap", "split-size": "split_size",
              "fp8-scale": "k_scale"}


@pytest.mark.parametrize("world, what", [(2, "heads"), (3, "batch"), (2, "head-dim"), (2, "dtype"),
                                         (3, "sm-scale"), (2, "bad-seq-lens"), (2, "sinks"), (3, "softcap"),
                                         (2, "split-size"), (2, "fp8-scale")],
                         ids=lambda x: f"W{x}" if isinstance(x, int) else x)
def test_mismatch_raises_on_every_rank(pool, world, what):
    """Note [Agreement across ranks]: an argument that differs across ranks raises on every rank, naming it."""
    messages = pool(world).run(case_mismatch, what=what)
    if what == "bad-seq-lens":
        assert "seq_lens" in messages[1] and "rank(s) [1]" in messages[0]
    else:
        assert all(m.startswith(MISMATCHES[what]) and "must be equal on every rank" in m for m in messages), messages
        assert len(set(messages)) == 1


@pytest.mark.parametrize("what, name", [("window", "window_left"), ("q-4d", "q must have 3 dims"),
                                        ("check-metadata-type", "check_metadata"), ("cache-batch", "batch"),
                                        ("cache-window", "window_left"), ("cache-row-limits", "takes no row_limits"),
                                        ("row-limits", "takes no row_limits"), ("cascade-rows", "one row per request"),
                                        ("merge-shape", "state.o.shape")])
def test_one_rank_rejecting_raises_on_every_rank(pool, what, name):
    messages = pool(2).run(case_one_rank_rejects, what=what)
    assert name in messages[1], messages
    assert "rank(s) [1]" in messages[0] or name in messages[0], messages


def test_equal_values_in_other_forms_agree(pool):
    first, second = pool(2).run(case_equal_values_agree)
    assert len(first) == len(second) == 6
    assert all(torch.equal(a, b) or (torch.isnan(a).all() and torch.isnan(b).all()) for a, b in zip(first, second))


@pytest.mark.parametrize("world", [2, 3])
def test_cascade_segment_ids_mismatch_raises_on_every_rank(pool, world):
    """Note [Agreement across ranks]: segment_ids that differ on one rank would merge the states of other
    segments there (every rank returning the same wrong answer); they raise on every rank, naming them."""
    messages = pool(world).run(case_cascade_mismatch)
    assert all(m.startswith("segment_ids must be equal on every rank") for m in messages), messages
    assert len(set(messages)) == 1 and "rank(s) [1]" in messages[0], messages


@pytest.mark.parametrize("what, name", [("world-size", "world_size"), ("rank", "rank"), ("window", "window_left"),
                                        ("rollback", "cache lengths")])
def test_cache_mismatch_raises_on_every_rank(pool, what, name):
    messages = pool(2).run(case_cache_mismatch, what=what)
    assert all(m.startswith(name) for m in messages), messages


DISTRIBUTED_DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"
AGREED_ARGUMENTS = [name for name in FIELDS if re.fullmatch(r"[a-z]+_[a-z_]+|sinks", name)]


def test_distributed_doc_says_what_the_agreement_checks():
    """docs/distributed.md names every argument the agreement check compares (Note [Agreement across ranks])
    in its list of what is checked, and says of none of them (nor of the FP8 scales) that it may differ across
    ranks."""
    text = " ".join(DISTRIBUTED_DOC.read_text().split())
    checked = text[text.index("## What is checked across ranks"):text.index("Not compared:")]
    assert set(AGREED_ARGUMENTS) >= {"sm_scale", "logit_softcap", "k_scale", "v_scale", "sinks", "segment_ids"}
    assert [name for name in AGREED_ARGUMENTS if f"`{name}`" not in checked] == []
    for clause in re.findall(r"[^.;()]*\bmay differ\b[^.;()]*", text):
        assert not re.search(r"scale|sinks|softcap|segment|window|split", clause), clause


# ----------------------------------------------------------------------------------------------------
# shard_kv and CPKVCache in one process


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("placement", ["contiguous", "interleaved"])
def test_shard_kv_partitions_the_valid_tokens(world, placement):
    t = 37
    k = torch.randn(4, 2, t, 8)
    v = torch.randn(4, 2, t, 8)
    seq_lens = torch.tensor([37, 5, 1, 0], dtype=torch.int64)
    cap = -(-t // world)
    seen = torch.zeros(4, t, dtype=torch.int64)
    for r in range(world):
        ks, vs, ls = shard_kv(k, v, seq_lens, r, world, placement)
        assert ks.shape == vs.shape == (4, 2, cap, 8) and ls.dtype == seq_lens.dtype
        for b in range(4):
            owned = [p for p in range(t) if (p // cap == r if placement == "contiguous" else p % world == r)]
            valid = [p for p in owned if p < seq_lens[b]]
            assert int(ls[b]) == len(valid)
            assert torch.equal(ks[b, :, : len(valid)], k[b, :, valid]) and torch.equal(vs[b, :, : len(valid)],
                                                                                      v[b, :, valid])
            seen[b, valid] += 1
    assert torch.equal(seen, (torch.arange(t)[None, :] < seq_lens[:, None]).long())


@pytest.mark.parametrize("placement", ["contiguous", "interleaved"])
def test_shard_kv_nhd_is_the_transposed_hnd_shard(placement):
    k, v = torch.randn(3, 2, 29, 8), torch.randn(3, 2, 29, 8)
    seq_lens = torch.tensor([29, 11, 0, 5, 6, 7])[::2]  # strided
    for r in range(3):
        hnd = shard_kv(k, v, seq_lens, r, 3, placement)
        nhd = shard_kv(k.transpose(1, 2), v.transpose(1, 2), seq_lens, r, 3, placement, kv_layout="NHD")
        assert nhd[0].shape == (3, 10, 2, 8) and nhd[0].is_contiguous()
        assert torch.equal(nhd[0], hnd[0].transpose(1, 2)) and torch.equal(nhd[1], hnd[1].transpose(1, 2))
        assert torch.equal(nhd[2], hnd[2])


def test_shard_kv_short_cache_and_defaults():
    k = torch.randn(1, 1, 3, 8, dtype=torch.bfloat16)
    lens = [shard_kv(k, k, None, r, 8, "contiguous")[2].item() for r in range(8)]
    assert lens == [1, 1, 1, 0, 0, 0, 0, 0]
    ks, _, ls = shard_kv(k, k, torch.tensor([2], dtype=torch.int32), 1, 2, "interleaved")
    assert ks.dtype == torch.bfloat16 and ls.dtype == torch.int32 and ls.tolist() == [1]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(rank=2, world_size=2), ValueError, "rank"),
    (dict(rank=-1, world_size=2), ValueError, "rank"),
    (dict(rank=0, world_size=0), ValueError, "world_size"),
    (dict(rank=0.0, world_size=2), TypeError, "rank"),
    (dict(rank=0, world_size=True), TypeError, "world_size"),
    (dict(placement="striped"), ValueError, "placement"),
    (dict(k=torch.randn(2, 10, 8)), ValueError, "k must have 4 dims"),
    (dict(v=torch.randn(2, 1, 9, 8)), ValueError, "v must have k's shape"),
    (dict(v=torch.randn(2, 1, 10, 8, dtype=torch.float16)), TypeError, "v must have dtype"),
    (dict(seq_lens=torch.tensor([1.0, 2.0])), TypeError, "seq_lens"),
    (dict(seq_lens=torch.tensor([1, 2, 3])), ValueError, "seq_lens must have shape"),
    (dict(seq_lens=torch.tensor([1, 11])), ValueError, "seq_lens must lie in"),
    (dict(seq_lens=torch.tensor([-1, 1])), ValueError, "seq_lens must lie in"),
    (dict(kv_layout="BTHD"), ValueError, "kv_layout"),
    (dict(kv_layout="NHD", seq_lens=torch.tensor([1, 2])), ValueError, r"seq_lens must lie in \[0, 1\]"),
], ids=["rank-too-big", "rank-negative", "world-0", "rank-float", "world-bool", "placement", "k-3d",
        "v-shape", "v-dtype", "seq-lens-float", "seq-lens-shape", "seq-lens-too-long", "seq-lens-negative",
        "kv-layout", "nhd-positions-in-dim-1"])
def test_shard_kv_rejects_bad_input(kwargs, exc, match):
    args = dict(k=torch.randn(2, 1, 10, 8), v=torch.randn(2, 1, 10, 8), seq_lens=torch.tensor([10, 3]),
                rank=0, world_size=2, placement="contiguous")
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        shard_kv(**args)


def test_cache_append_owner_and_scratch_slot():
    """Rank 1 of 3: tokens 1, 4, 7 land in slots 0, 1, 2; the others go to the scratch slot."""
    cache = CPKVCache(2, 1, 32, 9, dtype=torch.float32, rank=1, world_size=3)
    assert cache.capacity == 3 and cache.k.shape == (2, 1, 3, 32)
    for t in range(9):
        tok = torch.full((2, 1, 32), float(t))
        cache.append(tok, -tok)
    assert cache.seq_lens.tolist() == [3, 3] and cache.global_seq_lens.tolist() == [9, 9]
    assert cache.k[:, 0, :, 0].tolist() == [[1.0, 4.0, 7.0]] * 2
    assert cache.v[:, 0, :, 0].tolist() == [[-1.0, -4.0, -7.0]] * 2
    assert cache.free_slots == 0
    with pytest.raises(ValueError, match="full"):
        cache.append(tok, tok)


def test_cache_from_prefix_matches_shard_kv():
    k, v = torch.randn(3, 2, 20, 32), torch.randn(3, 2, 20, 32)
    seq_lens = torch.tensor([20, 4, 0])
    cache = CPKVCache.from_prefix(k, v, seq_lens, 30, rank=2, world_size=4)
    ks, vs, ls = shard_kv(k, v, seq_lens, 2, 4, "interleaved")
    assert torch.equal(cache.seq_lens, ls.int()) and torch.equal(cache.k[:, :, :5], ks)
    assert cache.free_slots == 10
    tok = torch.ones(3, 2, 32)
    for _ in range(3):  # positions 20..22, 4..6 and 0..2: rank 2 owns 22, 6 and 2
        cache.append(tok, tok)
    assert cache.seq_lens.tolist() == [6, 2, 1]


def _cache1():
    return CPKVCache(1, 1, 32, 10, dtype=torch.float32, rank=0, world_size=1)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: CPKVCache(0, 1, 32, 10, rank=0, world_size=1), ValueError, "batch"),
    (lambda: CPKVCache(1, 1, 32, 10, rank=3, world_size=2), ValueError, "rank"),
    (lambda: CPKVCache(1, 1, 32, 10, dtype=torch.int32, rank=0, world_size=1), TypeError, "dtype"),
    (lambda: _cache1().append(torch.ones(1, 2, 32), torch.ones(1, 2, 32)), ValueError, "k_new must have shape"),
    (lambda: _cache1().append(torch.ones(1, 1, 32, dtype=torch.float64), torch.ones(1, 1, 32)), TypeError, "k_new"),
    (lambda: _cache1().append(torch.ones(1, 1, 32), torch.ones(1, 1, 33)), ValueError, "v_new must have shape"),
    (lambda: _cache1().set_lengths(torch.tensor([11])), ValueError, "seq_lens must lie in"),
    (lambda: CPKVCache.from_prefix(torch.ones(1, 1, 10, 32), torch.ones(1, 1, 10, 32), None, 5, rank=0,
                                   world_size=1), ValueError, "max_seq_len"),
    (lambda: cp_flash_decode(torch.ones(1, 8, 32), torch.ones(1, 2, 4, 32), torch.ones(1, 2, 4, 32), None,
                             return_lse=1), TypeError, "return_lse"),
    (lambda: CPKVCache(1, 1, 32, 10), ValueError, "pass rank and world_size, or initialise a process group"),
    (lambda: _cache1().decode(torch.ones(1, 8, 32), row_limits=torch.zeros(1, 1, 2, dtype=torch.int32)), TypeError,
     "CPKVCache.decode takes no row_limits .the cache derives"),
    (lambda: cp_flash_decode(torch.ones(1, 8, 32), torch.ones(1, 2, 4, 32), torch.ones(1, 2, 4, 32), None,
                             row_limits=torch.zeros(1, 1, 2, dtype=torch.int32)), TypeError,
     "cp_flash_decode takes no row_limits .a rank's limits would be positions in its shard"),
    (lambda: cp_flash_decode(torch.ones(1, 8, 32), torch.ones(1, 2, 4, 32), torch.ones(1, 2, 4, 32), None,
                             check_metadata=False), ValueError, "group: exchanging attention states across ranks "
                                                               "needs an initialised process group"),
    (lambda: merge_across_ranks(AttentionState(torch.ones(2, 8, 32), torch.zeros(2, 8))), ValueError,
     "group: exchanging attention states"),
    (lambda: all_gather_states(AttentionState(torch.ones(2, 8, 32), torch.zeros(2, 8)), check_metadata=False),
     ValueError, "group: exchanging attention states"),
    (lambda: set_exchange("collective"), ValueError, "group: exchanging attention states"),
    (lambda: _cache1().decode(torch.ones(1, 8, 32), out=torch.empty(1, 8, 32)), TypeError,
     "CPKVCache.decode takes no out"),
    (lambda: _cache1().append(torch.ones(1, 3, 32), torch.ones(1, 3, 32)), ValueError,
     r"got \(1, 3, 32\)$"),
], ids=["batch-0", "rank", "dtype", "append-shape", "append-dtype", "append-v-shape", "set-lengths-range",
        "prefix-too-long", "return-lse", "no-group", "cache-row-limits", "cp-row-limits", "cp-no-group-unchecked",
        "merge-no-group", "gather-no-group-unchecked", "set-exchange-no-group", "cache-out-one-process",
        "append-shape-as-given"])
def test_cache_and_cp_decode_reject_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
