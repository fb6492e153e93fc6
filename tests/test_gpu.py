"""GPU-only checks (skipped without CUDA): CUDA-graph capture and replay with new inputs of flash_decode,
cascade_decode and CPKVCache (append + decode, over symmetric memory and over NCCL), the symmetric-memory
merge replayed back to back and with the ranks out of step, long bf16 caches against the float64 oracle, and
the merge kernel against the float64 merge formula."""
import datetime
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_attention import AttentionState, CascadeLevel, cascade_decode, flash_decode, merge_states
from cp_attention.distributed import CPKVCache, cp_flash_decode, merge_across_ranks, set_exchange, shard_kv
from cp_attention.distributed.exchange import exchange_for
from cp_attention.heuristics import (FP8_ONE_WARP, FP8_ONE_WARP_FEW, FP8_ONE_WARP_LONG, FP8_TABLE_LOOP, FP8_TWO_WARPS,
                                      ONE_WARP_PLAN_ROWS_256, WIDE_FP8, WIDE_FP8_TABLE_LOOP, WIDE_HEADS, WIDE_PAGES,
                                      decode_plan, num_sms, one_warp_fp8, one_warp_plan, table_pages)
from cp_attention.ops import symm_merge
from cp_attention.reference import attention

from .conftest import assert_state_matches

pytestmark = pytest.mark.gpu


def _capture(fn):
    """``fn()`` warmed up on a side stream, then captured; returns (graph, its output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


@pytest.mark.parametrize("b,t,splits", [(1, 65536, None), (3, 20000, 7), (64, 4096, None)],
                         ids=["B1-T64k-policy", "B3-T20000-S7", "B64-T4k-policy"])
def test_cuda_graph_replay_with_new_q_and_seq_lens(b, t, splits):
    torch.manual_seed(b)
    hq, hkv, d = 32, 8, 128
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), t, dtype=torch.int32, device="cuda")
    g, out = _capture(lambda: flash_decode(q, k, v, seq_lens, num_splits=splits, return_lse=True))
    for step in range(4):
        q.copy_(torch.randn_like(q) * (1 + 10 * step))
        seq_lens.copy_(torch.randint(0, t + 1, (b,), device="cuda"))
        if step == 1:
            seq_lens[0] = 0
        g.replay()
        eager = flash_decode(q, k, v, seq_lens, num_splits=splits, return_lse=True)
        torch.testing.assert_close(out.o, eager.o, atol=0, rtol=0)
        torch.testing.assert_close(out.lse, eager.lse, atol=0, rtol=0)
        ref = attention(q.double(), k.double(), v.double(), seq_lens)
        torch.testing.assert_close(out.o.double(), ref.o, atol=2e-2, rtol=2e-2)


def test_cascade_overlap_changes_no_bit(monkeypatch):
    """The per-request level runs on a side stream beside the shared one (Note [Cascade attention]); run
    one after the other instead, on the caller's stream, every bit of the result is the same. The call is
    made on a stream of the caller's, which the fork and the join must follow."""
    import cp_attention.cascade as cascade

    torch.manual_seed(1)
    b, hq, hkv, d, dt = 32, 32, 8, 128, torch.bfloat16
    q = torch.randn(b, hq, d, device="cuda", dtype=dt)
    pre_k, pre_v = (torch.randn(1, hkv, 8192, d, device="cuda", dtype=dt) for _ in range(2))
    suf_k, suf_v = (torch.randn(b, hkv, 300, d, device="cuda", dtype=dt) for _ in range(2))
    lens = torch.randint(0, 301, (b,), device="cuda", dtype=torch.int32)
    levels = [CascadeLevel(pre_k, pre_v), CascadeLevel(suf_k, suf_v, lens)]
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        overlapped = cascade_decode(q, levels, return_lse=True)
        monkeypatch.setattr(cascade, "_side_stream", lambda device: None)
        sequential = cascade_decode(q, levels, return_lse=True)
    user.synchronize()
    assert torch.equal(overlapped.o, sequential.o) and torch.equal(overlapped.lse, sequential.lse)
    k = torch.cat([pre_k.expand(b, -1, -1, -1), suf_k], 2)
    v = torch.cat([pre_v.expand(b, -1, -1, -1), suf_v], 2)
    ref = attention(q.double(), k.double(), v.double(), lens + 8192)
    torch.testing.assert_close(overlapped.o.double(), ref.o, atol=2e-2, rtol=2e-2)


def test_cascade_graph_replay_with_new_inputs():
    """A shared prefix, group segments and per-request suffixes: captured once, replayed with new queries,
    new lengths, new segment assignments and new suffix tokens; each replay equals the float64 oracle on
    every request's concatenated cache."""
    torch.manual_seed(0)
    b, hq, hkv, d, dt = 6, 16, 4, 128, torch.bfloat16
    q = torch.randn(b, hq, d, device="cuda", dtype=dt)
    pre_k, pre_v = (torch.randn(1, hkv, 3000, d, device="cuda", dtype=dt) for _ in range(2))
    grp_k, grp_v = (torch.randn(3, hkv, 700, d, device="cuda", dtype=dt) for _ in range(2))
    grp_lens = torch.tensor([700, 5, 300], device="cuda")
    seg_ids = torch.tensor([0, 1, 2, 0, 1, 2], device="cuda")
    suf_k, suf_v = (torch.randn(b, hkv, 256, d, device="cuda", dtype=dt) for _ in range(2))
    suf_lens = torch.full((b,), 256, device="cuda", dtype=torch.int32)
    levels = [CascadeLevel(pre_k, pre_v), CascadeLevel(grp_k, grp_v, grp_lens, seg_ids),
              CascadeLevel(suf_k, suf_v, suf_lens)]
    g, out = _capture(lambda: cascade_decode(q, levels, return_lse=True))
    for step in range(3):
        q.copy_(torch.randn_like(q) * (1 + 5 * step))
        suf_lens.copy_(torch.randint(0, 257, (b,), device="cuda"))
        seg_ids.copy_(torch.randint(0, 3, (b,), device="cuda"))
        grp_lens.copy_(torch.randint(0, 701, (3,), device="cuda"))
        suf_k.normal_()
        g.replay()
        eager = cascade_decode(q, levels, return_lse=True)
        torch.testing.assert_close(out.o, eager.o, atol=0, rtol=0)
        for i in range(b):
            s = int(seg_ids[i])
            k = torch.cat([pre_k[0], grp_k[s, :, : int(grp_lens[s])], suf_k[i, :, : int(suf_lens[i])]], 1)
            v = torch.cat([pre_v[0], grp_v[s, :, : int(grp_lens[s])], suf_v[i, :, : int(suf_lens[i])]], 1)
            ref = attention(q[i:i + 1].double(), k[None].double(), v[None].double())
            torch.testing.assert_close(out.o[i:i + 1].double(), ref.o, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(out.lse[i:i + 1].double(), ref.lse, atol=1e-3, rtol=1e-4)


def _cascade_inputs(b, hq, hkv, d, dt):
    """A shared prefix, two group segments (random lengths and assignments) and per-request suffixes."""
    q = torch.randn(b, hq, d, device="cuda", dtype=dt)
    pre = [torch.randn(1, hkv, 2000, d, device="cuda", dtype=dt) for _ in range(2)]
    grp = [torch.randn(2, hkv, 500, d, device="cuda", dtype=dt) for _ in range(2)]
    grp_lens, seg = torch.randint(0, 501, (2,), device="cuda"), torch.randint(0, 2, (b,), device="cuda")
    suf = [torch.randn(b, hkv, 300, d, device="cuda", dtype=dt) for _ in range(2)]
    suf_lens = torch.randint(0, 301, (b,), device="cuda", dtype=torch.int32)
    return q, [CascadeLevel(*pre), CascadeLevel(*grp, grp_lens, seg), CascadeLevel(*suf, suf_lens)]


def _counting_checks(monkeypatch):
    """cascade_decode's full checks counted (the list grows by one per checked call), no key prepared yet."""
    import cp_attention.cascade as cascade

    calls, checked = [], cascade.check_cascade_args
    monkeypatch.setattr(cascade, "check_cascade_args", lambda *a, **kw: calls.append(1) or checked(*a, **kw))
    monkeypatch.setattr(cascade, "_PREPARED", {})
    return cascade, calls


def test_cascade_hot_path_equals_a_checked_call(monkeypatch):
    """Eager calls after the first replay what it prepared (Note [Cascade attention], eager calls): with new
    tensors of the same shapes (new pointers, lengths, segment assignments) and new scalar values, every bit
    equals a call checked and prepared anew, which equals the float64 oracle; the checks of what the key does
    not fix still run."""
    torch.manual_seed(3)
    b, hq, hkv, d = 5, 16, 4, 128
    cascade, calls = _counting_checks(monkeypatch)
    sinks = torch.randn(hq, device="cuda")
    cascade_decode(*_cascade_inputs(b, hq, hkv, d, torch.bfloat16), sm_scale=0.1, logit_softcap=30.0, sinks=sinks)
    assert len(calls) == 1 and len(cascade._PREPARED) == 1
    for step in range(3):
        q, levels = _cascade_inputs(b, hq, hkv, d, torch.bfloat16)
        kw = dict(sm_scale=0.05 * (step + 1), logit_softcap=10.0 * (step + 1), sinks=sinks, return_lse=True)
        hot = cascade_decode(q, levels, **kw)
        assert len(calls) == 1 + step  # replayed, not checked
        cascade._PREPARED.clear()
        fresh = cascade_decode(q, levels, **kw)
        assert len(calls) == 2 + step
        assert torch.equal(hot.o, fresh.o) and torch.equal(hot.lse, fresh.lse)
    seg, grp_lens, suf_lens = levels[1].segment_ids, levels[1].seq_lens, levels[2].seq_lens
    for i in range(b):
        s = int(seg[i])
        k, v = (torch.cat([levels[0][j][0], levels[1][j][s, :, : int(grp_lens[s])],
                           levels[2][j][i, :, : int(suf_lens[i])]], 1)[None].double() for j in (0, 1))
        ref = attention(q[i:i + 1].double(), k, v, sm_scale=kw["sm_scale"], logit_softcap=kw["logit_softcap"],
                        sinks=sinks.double())
        torch.testing.assert_close(hot.o[i:i + 1].double(), ref.o, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(hot.lse[i:i + 1].double(), ref.lse, atol=1e-3, rtol=1e-4)
    n = len(calls)
    with pytest.raises(TypeError, match="sm_scale"):
        cascade_decode(q, levels, sm_scale=float("nan"), logit_softcap=1.0, sinks=sinks)
    with pytest.raises(ValueError, match="logit_softcap"):
        cascade_decode(q, levels, sm_scale=0.1, logit_softcap=-1.0, sinks=sinks)
    with pytest.raises(TypeError, match="return_lse"):
        cascade_decode(q, levels, sm_scale=0.1, logit_softcap=1.0, sinks=sinks, return_lse=1)
    assert len(calls) == n  # all three refused on the prepared path


def test_cascade_hot_path_fp8_scales(monkeypatch):
    """FP8 levels with per-head tensor scales on the prepared path: new scale values are read by the kernels
    (every bit as a checked call), and a scale updated in place to inf is refused before any launch."""
    from cp_attention import quantize_kv

    torch.manual_seed(4)
    b, hq, hkv, d = 4, 16, 4, 128
    cascade, calls = _counting_checks(monkeypatch)

    def fp8_inputs():
        q, levels = _cascade_inputs(b, hq, hkv, d, torch.bfloat16)
        k8, v8, ks, vs = quantize_kv(levels[0].k, levels[0].v, per_head=True)
        return q, [CascadeLevel(k8, v8)] + levels[1:], ks, vs

    q, levels, ks, vs = fp8_inputs()
    cascade_decode(q, levels, k_scale=ks, v_scale=vs)
    q, levels, ks, vs = fp8_inputs()
    hot = cascade_decode(q, levels, k_scale=ks, v_scale=vs, return_lse=True)
    assert len(calls) == 1
    cascade._PREPARED.clear()
    fresh = cascade_decode(q, levels, k_scale=ks, v_scale=vs, return_lse=True)
    assert torch.equal(hot.o, fresh.o) and torch.equal(hot.lse, fresh.lse)
    ks[1] = float("inf")
    with pytest.raises(ValueError, match="k_scale"):
        cascade_decode(q, levels, k_scale=ks, v_scale=vs)
    assert len(calls) == 2


def _init_nccl(rank, world, init_file, exchange):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", rank))
    set_exchange(exchange)
    return torch.device("cuda", rank)


def _cp_cache_graph_worker(rank, world, init_file, exchange):
    # An exception ends this process with an error, and torch.multiprocessing then ends the other ranks.
    dev = _init_nccl(rank, world, init_file, exchange)
    b, hq, hkv, d, prefix, steps, dt = 2, 32, 8, 128, 5000, 6, torch.bfloat16
    g = torch.Generator(dev).manual_seed(0)  # the same inputs on every rank
    k = torch.randn(b, hkv, prefix, d, generator=g, device=dev, dtype=dt)
    v = torch.randn(b, hkv, prefix, d, generator=g, device=dev, dtype=dt)
    lens = torch.tensor([prefix, 1234], device=dev)
    q_steps = torch.randn(steps, b, hq, d, generator=g, device=dev, dtype=dt)
    kv_steps = torch.randn(2, steps, b, hkv, d, generator=g, device=dev, dtype=dt)
    cache = CPKVCache.from_prefix(k, v, lens, prefix + steps)
    cache.decode(q_steps[0], check_metadata=True)
    assert exchange_for(None).name == exchange
    q_in, k_in, v_in = q_steps[0].clone(), kv_steps[0, 0].clone(), kv_steps[1, 0].clone()
    if exchange == "symm":
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                cache.decode(q_in, check_metadata=False)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread's event queries must not invalidate the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            cache.append(k_in, v_in)
            o_out = cache.decode(q_in, check_metadata=False)
        step = graph.replay
    else:  # see the test's docstring
        def step():
            cache.append(k_in, v_in)
            o_out.copy_(cache.decode(q_in, check_metadata=False))

        o_out = torch.empty_like(q_in)
    full_k = torch.nn.functional.pad(k, (0, 0, 0, steps))
    full_v = torch.nn.functional.pad(v, (0, 0, 0, steps))
    rows = torch.arange(b, device=dev)
    outs = []
    for s in range(steps):
        q_in.copy_(q_steps[s])
        k_in.copy_(kv_steps[0, s])
        v_in.copy_(kv_steps[1, s])
        step()
        full_k[rows, :, lens + s] = kv_steps[0, s]
        full_v[rows, :, lens + s] = kv_steps[1, s]
        ref = attention(q_steps[s].double(), full_k.double(), full_v.double(), lens + s + 1)
        torch.testing.assert_close(o_out.double(), ref.o, atol=2e-2, rtol=2e-2)
        outs.append(o_out.clone())
    gathered = [torch.empty_like(outs[-1]) for _ in range(world)]
    dist.all_gather(gathered, outs[-1])
    assert all(torch.equal(x, gathered[0]) for x in gathered), "ranks differ"
    dist.destroy_process_group()


def _spawn(worker, *args):
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    world = min(2, torch.cuda.device_count())
    mp.start_processes(worker, args=(world, *args), nprocs=world, start_method="spawn", join=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("exchange", ["symm", "collective"])
def test_cp_cache_steps_with_new_tokens(tmp_path, exchange):
    """CPKVCache append + decode step after step with new tokens and queries (all GPUs, at most 2 ranks);
    every step equals the float64 oracle on the unsharded cache and the ranks agree bitwise. With the
    symmetric-memory exchange the step is captured in one CUDA graph and replayed. With the NCCL exchange
    it runs eagerly: capturing the NCCL all-gather in a CUDA graph stalled this test on the 2×H200 image
    (torch 2.11, NCCL in the process group's own stream), not root-caused."""
    if exchange == "symm" and torch.cuda.device_count() < 2:
        pytest.skip("the symmetric-memory exchange needs 2 GPUs")
    _spawn(_cp_cache_graph_worker, str(tmp_path / "init"), exchange)


def _symm_replay_worker(rank, world, init_file, exchange):
    dev = _init_nccl(rank, world, init_file, exchange)
    b, hq, hkv, d, t, dt = 3, 32, 8, 128, 3001, torch.bfloat16
    g = torch.Generator(dev).manual_seed(1)
    q_a, q_b = (torch.randn(b, hq, d, generator=g, device=dev, dtype=dt) for _ in range(2))
    k = torch.randn(b, hkv, t, d, generator=g, device=dev, dtype=dt)
    v = torch.randn(b, hkv, t, d, generator=g, device=dev, dtype=dt)
    lens = torch.tensor([t, 17, 0], device=dev)
    sinks = torch.randn(hq, generator=g, device=dev)
    ks, vs, ls = shard_kv(k, v, lens, rank, world)

    def step(q):
        return cp_flash_decode(q, ks, vs, ls, check_metadata=False, sinks=sinks, return_lse=True)

    want = {}
    for name, q in (("a", q_a), ("b", q_b)):
        want[name] = step(q)
        ref = attention(q.double(), k.double(), v.double(), lens, sinks=sinks.double())
        torch.testing.assert_close(want[name].o.double(), ref.o, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(want[name].lse.double(), ref.lse, atol=1e-3, rtol=1e-4)
    set_exchange("collective")
    other = step(q_a)  # the all-gather path merges in the same order with the same arithmetic
    assert torch.equal(other.o, want["a"].o) and torch.equal(other.lse, want["a"].lse), "exchanges differ"
    set_exchange(exchange)
    q_in = q_a.clone()
    step(q_in)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step(q_in)
    for i in range(300):  # the flags protocol holds replay after replay, back to back
        name = "ab"[i % 2]
        q_in.copy_(q_a if name == "a" else q_b)
        graph.replay()
        if i % 50 < 2:
            assert torch.equal(out.o, want[name].o) and torch.equal(out.lse, want[name].lse), f"replay {i}"
    for _ in range(100):  # eager calls back to back, no sync between them
        last = step(q_b)
    assert torch.equal(last.o, want["b"].o)
    gathered = [torch.empty_like(last.o) for _ in range(world)]
    dist.all_gather(gathered, last.o)
    assert all(torch.equal(x, gathered[0]) for x in gathered), "ranks differ"
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_symm_exchange_replays_bitwise(tmp_path):
    """The symmetric-memory merge (sinks included) equals the float64 oracle, equals the all-gather path
    bitwise, and gives the same bits over 300 back-to-back CUDA-graph replays and 100 eager calls."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _spawn(_symm_replay_worker, str(tmp_path / "init"), "symm")


def _symm_skew_worker(rank, world, init_file, exchange):
    dev = _init_nccl(rank, world, init_file, exchange)
    g = torch.Generator(dev).manual_seed(10 + rank)
    delays = random.Random(rank)
    # Flagged words: 16 rows of head dim 32 (one row per program, as in a tiny model's decode), 96 rows of 128,
    # and 1536 rows (6 per program, 8 warps) with the bulk protocol's threshold raised; bulk: 2048 rows (8 per
    # program) and 4096 rows (16 per program, the cascade of 128 requests).
    for b, h, d, bulk_min in ((4, 4, 32, None), (3, 32, 128, None), (48, 32, 128, 1 << 30), (64, 32, 128, None),
                              (128, 32, 128, None)):
        o = torch.randn(b, h, d, generator=g, device=dev, dtype=torch.bfloat16)
        lse = torch.randn(b, h, generator=g, device=dev) * 4
        set_exchange("collective")
        want = merge_across_ranks(AttentionState(o, lse))
        set_exchange(exchange)
        default, symm_merge.BULK_MIN_ROWS = symm_merge.BULK_MIN_ROWS, bulk_min or symm_merge.BULK_MIN_ROWS
        try:
            for i in range(300):
                torch.cuda._sleep(delays.randrange(0, 40000))  # up to ~20 µs on this rank's GPU before the merge
                got = merge_across_ranks(AttentionState(o, lse))
                assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse), f"{(b, h, d)}, call {i}"
        finally:
            symm_merge.BULK_MIN_ROWS = default
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_symm_exchange_with_ranks_out_of_step(tmp_path):
    """Ranks that reach the symmetric-memory merge at random times apart (a GPU-side sleep of 0-20 µs
    before each of 300 calls, per shape; both protocols) get the all-gather path's bits every time. The
    former poll loop, which ended on a reduction over the program (Note [Symmetric-memory merge]), gave
    other bits at the fifth call on the 2×H200 machine."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _spawn(_symm_skew_worker, str(tmp_path / "init"), "symm")


def _symm_push_worker(rank, world, init_file, exchange):
    dev = _init_nccl(rank, world, init_file, exchange)
    from cp_attention.distributed import cp_cascade_decode

    g = torch.Generator(dev).manual_seed(3)  # the same levels on every rank, then each rank's shard
    delays = random.Random(rank)
    hq, hkv, d, prefix, own, dt = 32, 8, 128, 1001, 37, torch.bfloat16
    # 4096 and 2048 rows take the bulk protocol with the push in the cascade's level merge; 64 rows do not
    for b in (128, 64, 2):
        q = torch.randn(b, hq, d, generator=g, device=dev, dtype=dt)
        pk, pv = (torch.randn(1, hkv, prefix, d, generator=g, device=dev, dtype=dt) for _ in range(2))
        ok, ov = (torch.randn(b, hkv, own, d, generator=g, device=dev, dtype=dt) for _ in range(2))
        lens = torch.randint(0, own + 1, (b,), generator=g, device=dev)
        sinks = torch.randn(hq, generator=g, device=dev)
        pks, pvs, p_lens = shard_kv(pk, pv, None, rank, world)
        oks, ovs, o_lens = shard_kv(ok, ov, lens, rank, world)
        shards = [CascadeLevel(pks, pvs, p_lens), CascadeLevel(oks, ovs, o_lens)]

        def step():
            return cp_cascade_decode(q, shards, check_metadata=False, sinks=sinks, return_lse=True)

        set_exchange("collective")
        want = step()
        whole = cascade_decode(q, [CascadeLevel(pk, pv), CascadeLevel(ok, ov, lens)], sinks=sinks, return_lse=True)
        torch.testing.assert_close(want.o.float(), whole.o.float(), atol=2e-2, rtol=2e-2)
        set_exchange(exchange)
        state = AttentionState(torch.randn(b, hq, d, generator=g, device=dev), torch.randn(b, hq, generator=g, device=dev))
        set_exchange("collective")
        want_merge = merge_across_ranks(state)  # the exchange pushes these itself, into the same buffer
        set_exchange(exchange)
        for i in range(200):
            torch.cuda._sleep(delays.randrange(0, 40000))  # up to ~20 µs on this rank's GPU
            got = step() if i % 3 else merge_across_ranks(state)
            ref = want if i % 3 else want_merge
            assert torch.equal(got.o, ref.o) and torch.equal(got.lse, ref.lse), f"B={b}, call {i}"
        step()
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = step()
        for _ in range(100):
            graph.replay()
        assert torch.equal(out.o, want.o) and torch.equal(out.lse, want.lse), f"B={b}, graph"
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_symm_push_in_the_cascade_merge(tmp_path):
    """cp_cascade_decode of 128 and 64 requests (4096 and 2048 rows: the level merge pushes its states to the
    peer), interleaved with merge_across_ranks on the same buffer (the exchange pushes) and with the ranks
    out of step by up to 20 µs, 200 calls, then 100 graph replays: the all-gather path's bits every time."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _spawn(_symm_push_worker, str(tmp_path / "init"), "symm")


def _deterministic_worker(rank, world, init_file, exchange):
    dev = _init_nccl(rank, world, init_file, exchange)
    split = 1024
    b, hq, hkv, d, t, dt = 3, 32, 8, 128, world * 6 * split, torch.bfloat16
    g = torch.Generator(dev).manual_seed(2)
    q = torch.randn(b, hq, d, generator=g, device=dev, dtype=dt)
    k = torch.randn(b, hkv, t, d, generator=g, device=dev, dtype=dt)
    v = torch.randn(b, hkv, t, d, generator=g, device=dev, dtype=dt)
    lens = torch.tensor([t, 5000, 1], device=dev)
    want = flash_decode(q, k, v, lens, split_size=split, return_lse=True)  # one GPU, the whole cache
    ks, vs, ls = shard_kv(k, v, lens, rank, world)
    got = cp_flash_decode(q, ks, vs, ls, split_size=split, return_lse=True)
    assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse), (got.o.float() - want.o.float()).abs().max()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_cp_deterministic_splits_bitwise_single_gpu(tmp_path):
    """cp_flash_decode(split_size=S) over the GPUs (at most 2 ranks) is bitwise flash_decode(split_size=S) on
    the unsharded cache on one GPU."""
    _spawn(_deterministic_worker, str(tmp_path / "init"), "auto")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (28, 4, 96), (16, 16, 64), (8, 1, 256)],
                         ids=lambda x: str(x))
def test_long_cache_against_float64(dtype, hq, hkv, d):
    torch.manual_seed(d)
    b, t = 2, 50_001
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype) * 3
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=dtype)
    sl = torch.tensor([t, 4097], device="cuda")
    got = flash_decode(q, k, v, sl, return_lse=True)
    ref = attention(q.double(), k.double(), v.double(), sl)
    rel = (got.o.double() - ref.o).norm() / ref.o.norm()
    assert rel < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.lse.double(), ref.lse, atol=1e-3, rtol=1e-5)


def test_merge_prepared_launch_still_refuses_grad():
    """A key prepared by a valid call does not let an input that requires grad through (nor one under
    no_grad be refused)."""
    o, lse = torch.randn(2, 3, 5, 64, device="cuda"), torch.randn(2, 3, 5, device="cuda")
    ref = merge_states(o, lse)
    with pytest.raises(ValueError, match=r"^merge_states is an inference op: o requires grad"):
        merge_states(o.clone().requires_grad_(), lse)
    with pytest.raises(ValueError, match=r"^merge_states is an inference op: lse requires grad"):
        merge_states(o, lse.clone().requires_grad_())
    with torch.no_grad():
        got = merge_states(o.clone().requires_grad_(), lse)
    assert torch.equal(got.o, ref.o) and torch.equal(got.lse, ref.lse)


@pytest.mark.parametrize("lse_dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_merge_prepared_launch_keys_the_lse_dtype(lse_dtype):
    """A key prepared by a float32 lse does not let an lse of another dtype (same shape and strides) through
    to the kernel, which reads float32."""
    o, lse = torch.randn(2, 3, 5, 64, device="cuda"), torch.randn(2, 3, 5, device="cuda")
    merge_states(o, lse)
    merge_states(o, lse)
    with pytest.raises(TypeError, match=r"^lse must have dtype"):
        merge_states(o, lse.to(lse_dtype))


@pytest.mark.parametrize("n", [2, 8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def test_merge_kernel_on_gpu_against_float64(n, dtype):
    o = torch.randn(n, 64, 32, 128, device="cuda").to(dtype)
    lse = (torch.rand(n, 64, 32, device="cuda") - 0.5) * 500
    lse[0, 0] = float("-inf")
    lse[:, 1, 1] = float("-inf")
    got = merge_states(o, lse)
    lse64 = lse.double()
    m = lse64.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse64 - m)
    o64 = (w[..., None] * o.double()).sum(0) / w.sum(0).clamp_min(1e-300)[..., None]
    lse_ref = m + torch.log(w.sum(0))
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.o.double(), o64.to(dtype).double(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.lse.double(), lse_ref, atol=1e-4, rtol=1e-6)
    assert (got.o[1, 1] == 0).all() and torch.isneginf(got.lse[1, 1])


@pytest.mark.parametrize("page", [1, 16, 64], ids=lambda p: f"page{p}")
def test_paged_long_cache_equals_dense(page):
    """A shuffled page pool (NHD, K and V views of one tensor) gives the dense kernel's answer and the
    float64 oracle's, at a long ragged context."""
    torch.manual_seed(page)
    b, hq, hkv, d, t = 2, 32, 8, 128, 20_000
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    sl = torch.tensor([t, 7_777], device="cuda", dtype=torch.int32)
    max_pages = -(-t // page)
    order = torch.randperm(b * max_pages + 5, device="cuda")[: b * max_pages]
    both = torch.full((b * max_pages + 5, 2, page, hkv, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    pad = max_pages * page - t
    for i in range(b):
        for c, src in enumerate((k, v)):
            pages = torch.nn.functional.pad(src[i], (0, 0, 0, pad)).view(hkv, max_pages, page, d)
            both[order[i * max_pages:(i + 1) * max_pages], c] = pages.permute(1, 2, 0, 3)
    table = order.view(b, max_pages).to(torch.int32)
    got = flash_decode(q, both[:, 0], both[:, 1], sl, block_table=table, kv_layout="NHD", return_lse=True)
    dense = flash_decode(q, k, v, sl, return_lse=True)
    torch.testing.assert_close(got.o, dense.o, atol=1e-2, rtol=1e-2)
    ref = attention(q.double(), k.double(), v.double(), sl)
    torch.testing.assert_close(got.o.double(), ref.o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.lse.double(), ref.lse, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("q_rows", [4, 16])
def test_multi_row_queries_against_float64(q_rows):
    torch.manual_seed(q_rows)
    b, hq, hkv, d, t = 3, 32, 8, 128, 9_000
    q = torch.randn(b, q_rows, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    sl = torch.tensor([t, 4_097, 2], device="cuda", dtype=torch.int32)
    got = flash_decode(q, k, v, sl, return_lse=True)
    ref = attention(q.double(), k.double(), v.double(), sl)
    finite = torch.isfinite(ref.lse)
    torch.testing.assert_close(got.o.double(), ref.o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.lse.double()[finite], ref.lse[finite], atol=1e-3, rtol=1e-5)
    assert torch.isneginf(got.lse[~finite]).all()


def shuffled_nhd_pools(k, v, page, layout="NHD"):
    """Dense ``k``, ``v [B, Hkv, T, D]`` (``T`` a multiple of ``page``) as NHD page pools ``[B * T / page,
    page, Hkv, D]`` (or HND pools ``[B * T / page, Hkv, page, D]``) in a random page order, and the block
    table ``[B, T / page]`` int32."""
    b, hkv, t, d = k.shape
    perm = torch.randperm(b * t // page, device=k.device)
    pools = []
    for x in (k, v):
        pages = x.reshape(b, hkv, t // page, page, d).transpose(1, 2)  # [B, T / page, Hkv, page, D]
        pool = torch.empty(b * t // page, *((page, hkv) if layout == "NHD" else (hkv, page)), d, device=x.device,
                           dtype=x.dtype)
        pool[perm] = (pages.transpose(2, 3) if layout == "NHD" else pages).reshape(-1, *pool.shape[1:])
        pools.append(pool)
    return *pools, perm.view(b, -1).int()


# FP8 cache forms of the configs: dense (two warps, key streams), head dim 256 (WIDE_FP8, dense and in
# pages of 16 through the register table; pages of 64, one table entry loaded a tile), NHD pools of shuffled
# pages of one position (one table entry per key: FP8_TABLE_LOOP), of 64 (the table in registers, each tile's
# page gathered) and of 256 (one entry loaded a tile); the one-warp kernel's (the policy's on sm_90 at head dims
# 128 and 256) dense and on pages of 1 (an entry a key), 16 and 256 (an entry a tile); dense and on pages of 256 in
# the four-program plan's 32-key tiles (its splits are short at B=2 T=40k); at head dim 256 dense and on pages of 16
FP8_FORMS = {"dense": (32, 128, 0, FP8_TWO_WARPS), "dense1w": (32, 128, 0, FP8_ONE_WARP_FEW),
             "page1_1w": (32, 128, 1, FP8_ONE_WARP), "page16_1w": (32, 128, 16, FP8_ONE_WARP),
             "page256_1w": (32, 128, 256, FP8_ONE_WARP_FEW),
             "d256": (16, 256, 0, WIDE_FP8), "d256_1w": (16, 256, 0, FP8_ONE_WARP),
             "d256page16_1w": (16, 256, 16, FP8_ONE_WARP),
             "d256page16": (16, 256, 16, WIDE_FP8), "d256page64": (16, 256, 64, WIDE_FP8_TABLE_LOOP),
             "page1": (32, 128, 1, FP8_TABLE_LOOP), "page64": (32, 128, 64, FP8_TWO_WARPS),
             "page256": (32, 128, 256, FP8_TABLE_LOOP)}


@pytest.mark.parametrize("form", list(FP8_FORMS))
@pytest.mark.parametrize("dtype8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=lambda d: str(d)[6:])
def test_fp8_long_cache_against_the_dequantised_oracle(dtype8, form):
    from cp_attention import quantize_kv

    torch.manual_seed(3)
    hq, d, page, config = FP8_FORMS[form]
    b, hkv, t = 2, 8, 40_960
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    sl = torch.tensor([t, 9_999], device="cuda", dtype=torch.int32)
    k8, v8, ks, vs = quantize_kv(k, v, dtype8, per_head=True)
    if config in (FP8_ONE_WARP, FP8_ONE_WARP_FEW):
        plan = one_warp_plan(b, hkv, t, num_sms(q.device), page_size=page, head_dim=d)
        assert plan.config == config and plan.page_tiles == (page >= config.block_n), plan
    else:
        plan = decode_plan(b, hkv, t, d, q.dtype, num_sms(q.device), kv_dtype=dtype8, page_size=page,
                           rows=hq // hkv)
        assert plan.config == config and plan.page_tiles == (page >= 2 * config.block_n), plan
    # the policy runs the one-warp kernel on this GPU at head dims 128 and 256, dense or paged
    assert one_warp_fp8(q.device, dtype8, d, hq // hkv, t, True, page)
    kc, vc, kw = k8, v8, {}
    if page:
        kc, vc, table = shuffled_nhd_pools(k8, v8, page)
        kw = dict(block_table=table, kv_layout="NHD")
    got = flash_decode(q, kc, vc, sl, k_scale=ks, v_scale=vs, return_lse=True, plan=plan, **kw)
    kd = k8.double() * ks.double().view(1, -1, 1, 1)
    vd = v8.double() * vs.double().view(1, -1, 1, 1)
    ref = attention(q.double(), kd, vd, sl)
    torch.testing.assert_close(got.o.double(), ref.o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.lse.double(), ref.lse, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("page", [16, 256])
def test_head_dim_256_pages_equal_the_dense_cache(page):
    """16-bit head dim 256 pools through the register table (WIDE_PAGES: WIDE_HEADS with registers capped)
    run the dense cache's splits and tiles: the same bits as the dense cache (WIDE_HEADS), a ragged batch."""
    torch.manual_seed(5)
    b, hq, hkv, d, t = 2, 16, 8, 256, 40_960
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sl = torch.tensor([t, 9_999], device="cuda", dtype=torch.int32)
    dense = decode_plan(b, hkv, t, d, q.dtype, num_sms(q.device), rows=hq // hkv)
    paged = decode_plan(b, hkv, t, d, q.dtype, num_sms(q.device), page_size=page, rows=hq // hkv)
    assert (dense.config, paged.config) == (WIDE_HEADS, WIDE_PAGES) and paged.split_pages > 0, (dense, paged)
    assert paged[1:3] == dense[1:3], (dense, paged)
    kp, vp, table = shuffled_nhd_pools(k, v, page)
    want = flash_decode(q, k, v, sl, return_lse=True)
    got = flash_decode(q, kp, vp, sl, block_table=table, kv_layout="NHD", return_lse=True)
    assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse)
    ref = attention(q.double(), k.double(), v.double(), sl)
    torch.testing.assert_close(got.o.double(), ref.o, atol=2e-2, rtol=2e-2)


def test_paged_register_table_splits_full_of_entries():
    """Splits whose block-table entries fill the register table (512 of 512: e4m3 16/8/256, pages of 16,
    32-key tiles, B=16 T=32k): the pipeliner's addresses of the tiles past a split's end must not gather past
    the entries (an unclamped index faulted with an illegal address in 3 of 4 processes on the H200)."""
    from cp_attention import quantize_kv

    torch.manual_seed(7)
    b, hq, hkv, d, t, page = 16, 16, 8, 256, 32768, 16
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(*(torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)))
    plan = decode_plan(b, hkv, t, d, q.dtype, num_sms(q.device), config=WIDE_FP8, kv_dtype=k8.dtype, rows=hq // hkv)
    plan = plan._replace(split_pages=table_pages(plan, page))
    assert plan.split_pages * page == plan.tiles_per_split * WIDE_FP8.block_n, plan  # entries fill the table
    kp, vp, table = shuffled_nhd_pools(k8, v8, page)
    ref = flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, plan=plan._replace(split_pages=0))
    for _ in range(20):
        got = flash_decode(q, kp, vp, torch.full((b,), t, device="cuda", dtype=torch.int32), block_table=table,
                           kv_layout="NHD", k_scale=ks, v_scale=vs, plan=plan)
    torch.cuda.synchronize()
    assert torch.equal(got, ref)


def test_deterministic_splits_are_batch_invariant_on_gpu():
    """split_size: a request's bits do not depend on its batch or its cache's capacity (the policy's splits
    do, by design)."""
    torch.manual_seed(5)
    b, hq, hkv, d, t = 6, 32, 8, 128, 40_960
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    sl = torch.tensor([t, 100, 30_000, 0, 4_097, 12_345], device="cuda", dtype=torch.int32)
    batch = flash_decode(q, k, v, sl, split_size=2048, return_lse=True)
    alone = flash_decode(q[2:3].contiguous(), k[2:3, :, :32_768].contiguous(), v[2:3, :, :32_768].contiguous(),
                         sl[2:3], split_size=2048, return_lse=True)
    assert torch.equal(alone.o, batch.o[2:3]) and torch.equal(alone.lse, batch.lse[2:3])
    ref = attention(q.double(), k.double(), v.double(), sl)
    torch.testing.assert_close(batch.o.double(), ref.o, atol=2e-2, rtol=2e-2)


ONE_WARP_CASES = [
    # (fp8 dtype, per-head scale tensors (else python floats), layout, Q rows, Hq, Hkv, num_splits, page size)
    (torch.float8_e4m3fn, False, "HND", 1, 32, 8, None, 0),
    (torch.float8_e5m2, True, "NHD", 1, 40, 8, 3, 0),  # GQA 5
    (torch.float8_e4m3fn, True, "HND", 4, 16, 4, None, 0),  # 16 causal rows
    (torch.float8_e5m2, False, "HND", 2, 8, 1, 1, 0),  # one split: the output written by the split kernel
    (torch.float8_e4m3fn, True, "NHD", 1, 16, 1, None, 0),  # GQA 16
    (torch.float8_e4m3fn, False, "NHD", 3, 20, 4, 7, 0),  # 15 causal rows of GQA 5
    (torch.float8_e5m2, True, "HND", 4, 16, 4, "long", 0),  # 32-key tiles (FP8_ONE_WARP_LONG), two splits
    (torch.float8_e4m3fn, False, "NHD", 1, 32, 8, "long", 0),
    # page pools in a random page order, one table entry read a tile (entries past each length out of the pool)
    (torch.float8_e4m3fn, True, "NHD", 1, 32, 8, None, 16),
    (torch.float8_e5m2, False, "HND", 4, 16, 4, 5, 32),  # 16 causal rows
    (torch.float8_e4m3fn, False, "NHD", 2, 16, 2, "long", 64),  # 32-key tiles on pages of 64
    (torch.float8_e5m2, True, "HND", 1, 40, 8, 1, 256),  # one split, GQA 5
    # pages that do not hold whole tiles: a table entry a key
    (torch.float8_e4m3fn, False, "NHD", 1, 32, 8, None, 1),
    (torch.float8_e5m2, True, "HND", 3, 20, 4, 7, 8),  # 15 causal rows of GQA 5
    (torch.float8_e4m3fn, True, "NHD", 2, 16, 4, 2, 24),
]


def _case_ids(cases):
    return [f"{str(c[0])[6:]}-{'head' if c[1] else 'float'}-{c[2]}-Q{c[3]}-{c[4]}x{c[5]}-S{c[6]}-P{c[7]}"
            for c in cases]


@pytest.mark.parametrize("dtype8,per_head,layout,q_rows,hq,hkv,splits,page", ONE_WARP_CASES,
                         ids=_case_ids(ONE_WARP_CASES))
def test_one_warp_fp8_kernel_against_the_dequantised_oracle(dtype8, per_head, layout, q_rows, hq, hkv, splits, page):
    """Note [One-warp FP8 tiles]: the Gluon kernel (no interpreter path: this is its numerical test) against
    the float64 oracle on the dequantised cache, dense or in shuffled page pools, ragged lengths (empty,
    shorter than the drafts, mid-tile, one tile past a split), NaN past each length and in the output buffers
    before the call; and against the Triton two-warp kernel on the same call."""
    _check_one_warp(dtype8, per_head, layout, q_rows, hq, hkv, splits, page, 128)


ONE_WARP_D256_CASES = [
    # as ONE_WARP_CASES, head dim 256 (its 16-key tiles hold the bytes of 32 keys at 128)
    (torch.float8_e4m3fn, False, "HND", 1, 16, 8, None, 0),  # GQA 2
    (torch.float8_e5m2, True, "NHD", 4, 16, 8, 3, 0),  # 8 causal rows
    (torch.float8_e4m3fn, True, "HND", 1, 32, 4, 2, 16),  # GQA 8 on pages of 16, an entry a tile
    (torch.float8_e5m2, False, "NHD", 2, 16, 2, None, 1),  # 16 causal rows of GQA 8 on pages of 1, an entry a key
    (torch.float8_e4m3fn, True, "HND", 4, 16, 4, None, 64),  # 16 causal rows on pages of 64
    (torch.float8_e4m3fn, False, "NHD", 3, 20, 4, "long", 0),  # 15 causal rows of GQA 5 in 32-key tiles
]


@pytest.mark.parametrize("dtype8,per_head,layout,q_rows,hq,hkv,splits,page", ONE_WARP_D256_CASES,
                         ids=_case_ids(ONE_WARP_D256_CASES))
def test_one_warp_fp8_head_dim_256_against_the_dequantised_oracle(dtype8, per_head, layout, q_rows, hq, hkv, splits,
                                                                  page):
    """The one-warp kernel at head dim 256 (the permutations of Note [One-warp FP8 tiles] over 256 dims), as
    at 128: the float64 oracle and the Triton kernel (WIDE_FP8, dense) on the same values."""
    _check_one_warp(dtype8, per_head, layout, q_rows, hq, hkv, splits, page, 256)


def one_warp_given_plan(b, hkv, t, d, splits, page):
    """The one-warp kernel's 16-key tiles as a given plan (``splits`` None: one wave of eight programs an SM), an
    entry a tile on pages of whole tiles: the calls its policy leaves to the Triton kernel (more than
    ONE_WARP_PLAN_ROWS_256 rows at head dim 256) still run it so."""
    plan = decode_plan(b, hkv, t, d, torch.bfloat16, num_sms(torch.device("cuda")), splits, config=FP8_ONE_WARP)
    return plan._replace(page_tiles=page > 0 and page % FP8_ONE_WARP.block_n == 0)


def _check_one_warp(dtype8, per_head, layout, q_rows, hq, hkv, splits, page, d):
    from cp_attention import quantize_kv

    torch.manual_seed(q_rows * 100 + hq + page + d)
    b, t = 4, -(-5003 // max(page, 1)) * max(page, 1)
    q = torch.randn(b, q_rows, hq, d, device="cuda", dtype=torch.bfloat16) * 2
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    sl = torch.tensor([t, 2, 0, 2065], device="cuda", dtype=torch.int32)
    k8, v8, ks, vs = quantize_kv(k, v, dtype8, per_head=per_head)
    past = torch.arange(t, device="cuda")[None, :] >= sl[:, None].long()
    for x8 in (k8, v8):  # garbage past each length: FP8 NaN
        x8.view(torch.uint8).masked_fill_(past[:, None, :, None], 0x7F)
    kd = k8.double() * ks.double().view(1, -1, 1, 1) if per_head else k8.double() * float(ks)
    vd = v8.double() * vs.double().view(1, -1, 1, 1) if per_head else v8.double() * float(vs)
    ref = attention(q.double(), kd.nan_to_num(), vd.nan_to_num(), sl)
    scales = (ks, vs) if per_head else (float(ks), float(vs))
    kw = {}
    if page:
        kc, vc, table = shuffled_nhd_pools(k8, v8, page, layout)
        pages_used = (sl.long() + page - 1) // page
        table[torch.arange(t // page, device="cuda")[None, :] >= pages_used[:, None]] = 1 << 30
        kw["block_table"] = table
    else:
        kc, vc = (k8, v8) if layout == "HND" else (k8.transpose(1, 2).contiguous(), v8.transpose(1, 2).contiguous())
    assert one_warp_fp8(q.device, dtype8, d, q_rows * hq // hkv, t, True, page)
    out = (torch.full_like(q, float("nan")), torch.full(q.shape[:-1], float("nan"), device="cuda"))
    if splits == "long":
        splits = 2
        plan = decode_plan(b, hkv, t, d, q.dtype, num_sms(q.device), splits, config=FP8_ONE_WARP_LONG)
        kw["plan"] = plan._replace(page_tiles=page > 0)
    elif q_rows * hq // hkv > (16 if d == 128 else ONE_WARP_PLAN_ROWS_256):  # more rows than the policy plans here
        kw["plan"] = one_warp_given_plan(b, hkv, t, d, splits, page)
    else:
        kw["num_splits"] = splits
    got = flash_decode(q, kc, vc, sl, kv_layout=layout, k_scale=scales[0], v_scale=scales[1], out=out,
                       return_lse=True, **kw)
    assert got.o.data_ptr() == out[0].data_ptr()
    assert_state_matches(got, ref, torch.bfloat16)
    seen = torch.isfinite(ref.lse)  # the lse sums the unrounded weights: fp32-accurate (2 keys to 5003)
    torch.testing.assert_close(got.lse.double()[seen], ref.lse[seen], atol=2e-5, rtol=0)
    kw.pop("num_splits", None)
    if d == 128:
        two = decode_plan(b, hkv, t, d, q.dtype, num_sms(q.device), splits, config=FP8_TWO_WARPS)
        two = two._replace(streams=1) if page else two  # key streams read dense caches only
        other = flash_decode(q, kc, vc, sl, kv_layout=layout, k_scale=scales[0], v_scale=scales[1],
                             return_lse=True, **dict(kw, plan=two))
    else:  # the Triton kernel's head-dim-256 tiles on the dense cache
        wide = decode_plan(b, hkv, t, d, q.dtype, num_sms(q.device), splits, config=WIDE_FP8)
        other = flash_decode(q, k8, v8, sl, k_scale=scales[0], v_scale=scales[1], return_lse=True, plan=wide)
    torch.testing.assert_close(got.o, other.o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.lse, other.lse, atol=1e-4, rtol=1e-5)


ONE_WARP_VARIANTS = [
    # (name, fp8 dtype, layout, Q rows, Hq, Hkv, num_splits, page size, window, softcap, sinks, row limits)
    ("window", torch.float8_e4m3fn, "HND", 1, 32, 8, None, 0, 700, None, False, False),
    ("window-causal-pages16", torch.float8_e5m2, "NHD", 4, 16, 4, 4, 16, 1000, None, False, False),
    ("window-pages1", torch.float8_e4m3fn, "NHD", 2, 16, 4, 3, 1, 600, None, True, False),
    ("softcap-sinks-direct", torch.float8_e4m3fn, "HND", 2, 16, 4, 1, 0, None, 30.0, True, False),
    ("softcap-sinks-split", torch.float8_e5m2, "HND", 1, 32, 8, None, 64, None, 20.0, True, False),
    ("row-limits-pages1", torch.float8_e4m3fn, "NHD", 3, 24, 8, None, 1, None, None, False, True),
    ("row-limits-32rows-pages64", torch.float8_e5m2, "HND", 4, 32, 4, 4, 64, None, None, False, True),
    ("20-rows", torch.float8_e4m3fn, "HND", 5, 16, 4, None, 0, None, None, False, False),
    ("32-rows-window", torch.float8_e4m3fn, "NHD", 2, 64, 4, 2, 0, 900, 25.0, True, False),
    ("24-rows-direct-pages32", torch.float8_e5m2, "HND", 3, 16, 2, 1, 32, None, None, False, False),
    ("20-rows-pages16", torch.float8_e4m3fn, "NHD", 5, 16, 4, None, 16, None, None, False, False),
    ("32-rows-window-sinks-pages64", torch.float8_e5m2, "HND", 4, 32, 4, 2, 64, 800, None, True, False),
    ("20-rows-softcap-sinks-direct", torch.float8_e4m3fn, "HND", 5, 16, 4, 1, 0, None, 30.0, True, False),
    # head dim 256 (the Triton kernel's WIDE_FP8 on the dense cache as the second reference)
    ("d256-row-limits", torch.float8_e4m3fn, "HND", 4, 16, 8, None, 0, None, None, False, True),
    ("d256-window-softcap-sinks-pages16", torch.float8_e5m2, "NHD", 2, 32, 8, 3, 16, 900, 30.0, True, False),
]


@pytest.mark.parametrize("name,dtype8,layout,q_rows,hq,hkv,splits,page,window,softcap,sinks,limits", ONE_WARP_VARIANTS,
                         ids=[c[0] for c in ONE_WARP_VARIANTS])
def test_one_warp_fp8_variants_against_the_dequantised_oracle(monkeypatch, name, dtype8, layout, q_rows, hq, hkv,
                                                              splits, page, window, softcap, sinks, limits):
    """The one-warp kernel's windows (splits from a whole tile below the first position), softcaps, sinks
    (written directly, or added by the combine), row limits (a context-parallel rank's rows: nondecreasing
    first positions, some rows empty) and row tiles (more than 16 query rows per KV head, a program per 16),
    dense and in shuffled page pools, against the float64 oracle on the dequantised cache and against the
    Triton kernel on the same call; the one-warp kernel is checked to have run."""
    from cp_attention import decode, quantize_kv
    from cp_attention.ops import _launch

    torch.manual_seed(hash(name) % 1000)
    b, t, d = 4, -(-5003 // max(page, 1)) * max(page, 1), 256 if name.startswith("d256") else 128
    q = torch.randn(b, q_rows, hq, d, device="cuda", dtype=torch.bfloat16) * 2
    k8, v8, ks, vs = quantize_kv(torch.randn(b, hkv, t, d, device="cuda"), torch.randn(b, hkv, t, d, device="cuda"),
                                 dtype8, per_head=True)
    sl = torch.tensor([t, 2, 0, 2065], device="cuda", dtype=torch.int32)
    past = torch.arange(t, device="cuda")[None, :] >= sl[:, None].long()
    for x8 in (k8, v8):  # garbage past each length: FP8 NaN
        x8.view(torch.uint8).masked_fill_(past[:, None, :, None], 0x7F)
    kd, vd = (x.double().nan_to_num() * sc.double().view(1, -1, 1, 1) for x, sc in ((k8, ks), (v8, vs)))
    kw = dict(window_left=window, logit_softcap=softcap)
    if sinks:
        kw["sinks"] = torch.linspace(-2.0, 3.0, hq, device="cuda")
    ref_kw = dict(kw)
    if limits:  # each row's (first, end): firsts nondecreasing over the rows, as a CP rank's; some rows empty
        first = torch.sort(torch.randint(0, 2100, (b, q_rows), device="cuda"), dim=1).values
        end = first + torch.randint(-50, 3000, (b, q_rows), device="cuda")
        rl = torch.stack([first, end], -1).int()
        kw["row_limits"], ref_kw["row_limits"] = rl, rl
    ref = attention(q.double(), kd, vd, sl, **ref_kw)
    if page:
        kc, vc, table = shuffled_nhd_pools(k8, v8, page, layout)
        kw["block_table"] = table
    else:
        kc, vc = (k8, v8) if layout == "HND" else (k8.transpose(1, 2).contiguous(), v8.transpose(1, 2).contiguous())
    kernels = []
    init = _launch.Launcher.__init__
    monkeypatch.setattr(_launch.Launcher, "__init__",
                        lambda self, kernel, *a, **o: (kernels.append(kernel.__name__), init(self, kernel, *a, **o))[1])
    monkeypatch.setattr(decode, "_PREPARED", {})
    monkeypatch.setattr(decode, "_LAST", (None, None))
    out = (torch.full_like(q, float("nan")), torch.full(q.shape[:-1], float("nan"), device="cuda"))
    if d == 128:
        kw["num_splits"] = splits
    else:  # more rows than the policy plans at head dim 256: the one-warp kernel by a given plan
        kw["plan"] = one_warp_given_plan(b, hkv, t, d, splits, page)
    got = flash_decode(q, kc, vc, sl, kv_layout=layout, k_scale=ks, v_scale=vs, out=out, return_lse=True, **kw)
    kw.pop("num_splits", None)
    kw.pop("plan", None)
    assert kernels[0] == "_split_kv_fp8_kernel", kernels
    assert_state_matches(got, ref, torch.bfloat16)
    seen = torch.isfinite(ref.lse)
    assert seen.any()
    torch.testing.assert_close(got.lse.double()[seen], ref.lse[seen], atol=5e-5, rtol=0)
    if d == 128:
        two = decode_plan(b, hkv, t, d, q.dtype, num_sms(q.device), splits, config=FP8_TWO_WARPS)._replace(streams=1)
        other = flash_decode(q, kc, vc, sl, kv_layout=layout, k_scale=ks, v_scale=vs, return_lse=True, plan=two, **kw)
    else:
        wide = decode_plan(b, hkv, t, d, q.dtype, num_sms(q.device), splits, config=WIDE_FP8)
        kw.pop("block_table", None)
        other = flash_decode(q, k8, v8, sl, k_scale=ks, v_scale=vs, return_lse=True, plan=wide, **kw)
    assert "_split_kv_kernel" in kernels, kernels
    torch.testing.assert_close(got.o, other.o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.lse, other.lse, atol=1e-4, rtol=1e-5)


def test_one_warp_fp8_graph_replay_with_new_q_and_seq_lens():
    from cp_attention import quantize_kv

    torch.manual_seed(7)
    b, hq, hkv, d, t = 3, 32, 8, 128, 40_000
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(torch.randn(b, hkv, t, d, device="cuda"), torch.randn(b, hkv, t, d, device="cuda"))
    seq_lens = torch.full((b,), t, dtype=torch.int32, device="cuda")
    call = lambda: flash_decode(q, k8, v8, seq_lens, k_scale=ks, v_scale=vs, return_lse=True)  # noqa: E731
    g, out = _capture(call)
    kd, vd = k8.double() * float(ks), v8.double() * float(vs)
    for step in range(3):
        q.copy_(torch.randn_like(q) * (1 + 10 * step))
        seq_lens.copy_(torch.randint(0, t + 1, (b,), device="cuda"))
        seq_lens[step] = 0
        g.replay()
        eager = call()
        torch.testing.assert_close(out.o, eager.o, atol=0, rtol=0)
        torch.testing.assert_close(out.lse, eager.lse, atol=0, rtol=0)
        ref = attention(q.double(), kd, vd, seq_lens)
        assert_state_matches(out, ref, torch.bfloat16)
