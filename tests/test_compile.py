"""``torch.compile(fullgraph=True)`` of the public functions (the custom ops of ``cp_attention/_library.py``)
equals their eager calls; ``torch.library.opcheck`` on each op; bad input raises at trace time; the
inference ops refuse inputs that require grad, eagerly and compiled.

The ``kernel`` path runs the Triton kernels (the interpreter without a GPU), the ``torch`` path the CPU
torch code (``TRITON_INTERPRET=0``). Distributed ops run on 2 spawned gloo ranks. Compiling is slow, so
each compiled function calls several ops at once. GPU tests (marked) capture a compiled decode step in
CUDA graphs (``mode="reduce-overhead"``).
"""
import datetime
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_attention import (AttentionState, CascadeLevel, _library, cascade_decode, decode, flash_decode, merge,
                          merge_states, quantize_kv)
from cp_attention.distributed import (CPKVCache, all_gather_states, cp_cascade_decode, cp_flash_decode,
                                      merge_across_ranks, shard_kv)
from cp_attention.heuristics import decode_plan

BF = torch.bfloat16
B, HQ, HKV, D, T = 3, 4, 2, 32, 45
# test_schema compares the inputs before and after a call with torch.allclose, which float8 tensors lack
# on the CPU: FP8 cases run the other utilities, and the test compares their input bytes itself.
NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The device of the ``kernel`` path (the GPU, or the CPU under the interpreter) or of the ``torch``
    path (the CPU without the interpreter)."""
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype=BF, device="cpu"):
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _inputs(device):
    """Decode inputs of every kind: 1-row and 3-row queries, a dense cache with a zero-length row, a
    scattered page pool, FP8 caches with per-head scales, sinks, row limits, cascade levels."""
    g = _gen()
    x = dict(q=_randn(g, B, HQ, D, device=device), q3=_randn(g, B, 3, HQ, D, device=device),
             k=_randn(g, B, HKV, T, D, device=device), v=_randn(g, B, HKV, T, D, device=device),
             seq_lens=torch.tensor([45, 7, 0], device=device), sinks=_randn(g, HQ, dtype=torch.float32, device=device))
    x["pool_k"], x["pool_v"] = (_randn(g, 20, 8, HKV, D, device=device) for _ in range(2))
    x["block_table"] = torch.randperm(20, generator=g)[:18].view(B, 6).to(torch.int32).to(device)
    x["k8"], x["v8"], x["k_scale"], x["v_scale"] = quantize_kv(x["k"], x["v"], per_head=True)
    x["row_limits"] = torch.tensor([[0, 45], [3, 20], [0, 0]], device=device).expand(B, 3, 2).contiguous()
    x["levels"] = [CascadeLevel(_randn(g, 1, HKV, 33, D, device=device), _randn(g, 1, HKV, 33, D, device=device),
                                torch.tensor([30], device=device)),
                   CascadeLevel(_randn(g, 2, HKV, 20, D, device=device), _randn(g, 2, HKV, 20, D, device=device),
                                torch.tensor([20, 11], device=device), torch.tensor([1, 0, 1], device=device)),
                   CascadeLevel(x["pool_k"], x["pool_v"], torch.tensor([5, 0, 40], device=device), None,
                                x["block_table"])]
    x["o"] = _randn(g, 3, B, HQ, D, device=device)
    x["lse"] = _randn(g, 3, B, HQ, dtype=torch.float32, device=device)
    x["lse"][0, 0] = float("-inf")
    return x


def _decode_step(x):
    """Every single-device public function, as a compiled decode step would call them."""
    return dict(
        dense=flash_decode(x["q3"], x["k"], x["v"], x["seq_lens"], sinks=x["sinks"], logit_softcap=30.0, sm_scale=0.2,
                           return_lse=True),
        paged=flash_decode(x["q"], x["pool_k"], x["pool_v"], x["seq_lens"], block_table=x["block_table"],
                           kv_layout="NHD", window_left=5, return_lse=True),
        fp8=flash_decode(x["q3"], x["k8"], x["v8"], x["seq_lens"], k_scale=x["k_scale"], v_scale=x["v_scale"],
                         row_limits=x["row_limits"], return_lse=True),
        fp8_float_split=flash_decode(x["q"], x["k8"], x["v8"], x["seq_lens"], k_scale=0.5, v_scale=0.25,
                                     split_size=16),
        out=flash_decode(x["q"], x["k"], x["v"], x["seq_lens"], out=x["out"], return_lse=True),
        cascade=cascade_decode(x["q3"], x["levels"], sinks=x["sinks"], logit_softcap=20.0, return_lse=True),
        merge_states=merge_states(x["o"], x["lse"], out_dtype=torch.float32, sinks=x["sinks"]),
        merge=merge(AttentionState(x["o"][0], x["lse"][0]), AttentionState(x["o"][1], x["lse"][1])),
        quantize_kv=quantize_kv(x["k"], x["v"], kv_layout="NHD"),
    )


def _with_out(x):
    """``x`` with a fresh ``out`` (an fp32 state of q's rows, NaN before the call)."""
    q = x["q"]
    nan = float("nan")
    return dict(x, out=AttentionState(torch.full(q.shape, nan, device=q.device),
                                      torch.full(q.shape[:-1], nan, device=q.device)))


def test_compiled_decode_step_equals_eager(path, monkeypatch):
    """One fullgraph-compiled (inductor) function calling every single-device op: the ops' results are
    bitwise the eager ones (their real implementations are the eager code); ``out=`` is filled in place;
    quantize_kv is traced as torch ops (no op of its own), so inductor's arithmetic may differ from eager
    by one FP8 rounding."""
    x = _inputs(path)
    got_x, want_x = _with_out(x), _with_out(x)
    monkeypatch.setattr(decode, "_SCRATCH", {})
    got = torch.compile(_decode_step, fullgraph=True, backend="inductor")(got_x)
    assert decode._SCRATCH == {}  # the ops keep no scratch (CUDA-graph trees would find it in their pool)
    want = _decode_step(want_x)
    assert got["out"].o is got_x["out"].o and torch.equal(got_x["out"].o, want_x["out"].o)
    for name in want:
        if name == "quantize_kv":
            continue
        g, w = (got[name], want[name]) if isinstance(want[name], tuple) else ((got[name],), (want[name],))
        for a, b in zip(g, w):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), name
    k8, v8, ks, vs = got["quantize_kv"]
    k8_want, v8_want, ks_want, vs_want = want["quantize_kv"]
    torch.testing.assert_close(ks, ks_want, rtol=1e-6, atol=0)
    torch.testing.assert_close(vs, vs_want, rtol=1e-6, atol=0)
    for a, b in ((k8, k8_want), (v8, v8_want)):
        assert a.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -3, atol=2 ** -9)


def _decode_args(q, k, v, seq_lens=None, **kw):
    """The positional arguments of ``cp_attention::flash_decode``."""
    return (q, k, v, seq_lens, kw.get("block_table"), kw.get("row_limits"), kw.get("sinks"), kw.get("k_scale"),
            kw.get("v_scale"), kw.get("k_scale_float"), kw.get("v_scale_float"), kw.get("sm_scale"),
            kw.get("num_splits"), kw.get("split_size"), kw.get("kv_layout", "HND"), kw.get("window_left"),
            kw.get("logit_softcap"), kw.get("out"), kw.get("out_lse"))


OPCHECK = {
    "decode-dense-Q3-sinks-softcap-splits3": lambda x: (_library.flash_decode_op, _decode_args(
        x["q3"], x["k"], x["v"], x["seq_lens"], sinks=x["sinks"], logit_softcap=30.0, sm_scale=0.2, num_splits=3)),
    "decode-paged-NHD-window5-out-fp32": lambda x: (_library.flash_decode_op, _decode_args(
        x["q"], x["pool_k"], x["pool_v"], x["seq_lens"], block_table=x["block_table"], kv_layout="NHD",
        window_left=5, out=x["q"].float())),
    "decode-fp8-tensor-scales-Q3-row_limits": lambda x: (_library.flash_decode_op, _decode_args(
        x["q3"], x["k8"], x["v8"], x["seq_lens"], k_scale=x["k_scale"], v_scale=x["v_scale"],
        row_limits=x["row_limits"])),
    "decode-fp8-float-scales-split_size16": lambda x: (_library.flash_decode_op, _decode_args(
        x["q"], x["k8"], x["v8"], x["seq_lens"], k_scale_float=0.5, v_scale_float=0.25, split_size=16)),
    "cascade-3-levels-Q3-sinks": lambda x: (_library.cascade_decode_op, (
        x["q3"], *_library._flat_levels(x["levels"]), 0.3, None, None, None, None, 20.0, x["sinks"])),
    "merge_states-N3-sinks-fp32": lambda x: (_library.merge_states_op, (x["o"], x["lse"], torch.float32, x["sinks"])),
}


@pytest.mark.parametrize("case", OPCHECK.values(), ids=OPCHECK.keys())
def test_opcheck(case, path):
    """The schema (no input mutated or aliased), the fake implementation against the real one (shapes,
    strides, dtypes) and an AOT trace with dynamic shapes, for representative inputs of each op."""
    op, args = case(_inputs(path))
    fp8 = any(isinstance(a, torch.Tensor) and a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for a in args)
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    torch.library.opcheck(op, args, test_utils=NO_SCHEMA if fp8 else torch.library._OPCHECK_DEFAULT_UTILS)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))


BAD_AT_TRACE = {
    "seq_lens-shape": (lambda x: flash_decode(x["q"], x["k"], x["v"], x["seq_lens"][:2]),
                       r"seq_lens must have shape \[3\]"),
    "block_table-dtype": (lambda x: flash_decode(x["q"], x["pool_k"], x["pool_v"], x["seq_lens"],
                                                 block_table=x["block_table"].float(), kv_layout="NHD"),
                          "block_table must have dtype"),
    "k_scale-missing": (lambda x: flash_decode(x["q"], x["k8"], x["v8"], x["seq_lens"], v_scale=x["v_scale"]),
                        "k_scale must be given for an FP8 cache"),
    "split_size-with-window": (lambda x: flash_decode(x["q"], x["k"], x["v"], split_size=16, window_left=3),
                               "split_size fixes the splits: window_left must be None"),
    "plan": (lambda x: flash_decode(x["q"], x["k"], x["v"], plan=x["plan"]),
             "plan is not supported under torch.compile"),
    "segment_ids-shape": (lambda x: cascade_decode(x["q"], [x["levels"][0], x["levels"][1]._replace(
        segment_ids=x["seq_lens"][:2])]), r"levels\[1\].segment_ids must have shape \[3\]"),
    "merge_states-lse-shape": (lambda x: merge_states(x["o"], x["lse"][:, :2]), r"lse must have shape"),
}


@pytest.mark.parametrize("call,message", BAD_AT_TRACE.values(), ids=BAD_AT_TRACE.keys())
def test_bad_input_raises_at_trace_time(call, message):
    """The eager checks that read no tensor values run while tracing (in the fake implementations, or
    traced before the op), so bad input fails the compile with the eager message."""
    x = dict(_inputs("cpu"), plan=decode_plan(B, HKV, T, D, BF, 132))
    with pytest.raises(Exception, match=message):
        torch.compile(call, fullgraph=True, backend="eager")(x)


def _cache():
    return CPKVCache(B, HKV, D, 40, dtype=torch.float32, rank=0, world_size=1)


GRAD = {  # (call, the input made to require grad, how the message names the function and the argument)
    "flash_decode": (lambda x: flash_decode(x["q"], x["k"], x["v"]), "q", "flash_decode", "q"),
    "flash_decode-sinks": (lambda x: flash_decode(x["q"], x["k"], x["v"], sinks=x["sinks"]), "sinks", "flash_decode",
                           "sinks"),
    "flash_decode-k_scale": (lambda x: flash_decode(x["q"], x["k8"], x["v8"], k_scale=x["k_scale"],
                                                    v_scale=x["v_scale"]), "k_scale", "flash_decode", "k_scale"),
    "merge": (lambda x: merge(AttentionState(x["o"][0], x["lse"][0]), AttentionState(x["o"][1], x["lse"][1])), "o",
              "merge", r"a\.o"),
    "merge_states": (lambda x: merge_states(x["o"], x["lse"]), "lse", "merge_states", "lse"),
    "cascade_decode": (lambda x: cascade_decode(x["q"], x["levels"]), "pool_k", "cascade_decode", r"levels\[2\]\.k"),
    "quantize_kv": (lambda x: quantize_kv(x["k"], x["v"]), "v", "quantize_kv", "v"),
    "all_gather_states": (lambda x: all_gather_states(AttentionState(x["o"], x["lse"])), "o", "all_gather_states",
                          r"state\.o"),
    "merge_across_ranks": (lambda x: merge_across_ranks(AttentionState(x["o"], x["lse"])), "lse",
                           "merge_across_ranks", r"state\.lse"),
    "cp_flash_decode": (lambda x: cp_flash_decode(x["q"], x["k"], x["v"], x["seq_lens"], sinks=x["sinks"]), "sinks",
                        "cp_flash_decode", "sinks"),
    "cp_cascade_decode": (lambda x: cp_cascade_decode(x["q"], x["levels"]), "q", "cp_cascade_decode", "q"),
    "CPKVCache.append": (lambda x: _cache().append(x["k"][:, :, 0], x["v"][:, :, 0]), "v", "CPKVCache.append",
                         "v_new"),
    "CPKVCache.decode": (lambda x: _cache().decode(x["q"]), "q", r"CPKVCache\.decode", "q"),
}


def _requiring_grad(name):
    """The inputs with ``name`` (and the cascade level holding it) requiring grad."""
    x = _inputs("cpu")
    x[name] = x[name].clone().requires_grad_()
    x["levels"][2] = x["levels"][2]._replace(k=x["pool_k"])
    return x


@pytest.mark.parametrize("call,arg,fn,shown", GRAD.values(), ids=GRAD.keys())
def test_inputs_that_require_grad_are_refused(call, arg, fn, shown):
    """Each public entry point raises before any work (no process group is needed to get the error),
    naming itself and the argument."""
    with pytest.raises(ValueError, match=rf"^{fn} is an inference op: {shown} requires grad; call it under "
                                         r"torch\.no_grad\(\) or torch\.inference_mode\(\), or detach the input"):
        call(_requiring_grad(arg))


@pytest.mark.parametrize("name", ["flash_decode", "merge", "cascade_decode", "quantize_kv"])
def test_inputs_that_require_grad_pass_under_no_grad(name):
    """The refusal is about grad mode: under no_grad or inference_mode the same inputs run."""
    call, arg = GRAD[name][:2]
    x = _requiring_grad(arg)
    with torch.no_grad():
        call(x)
    with torch.inference_mode():
        call(x)


@pytest.mark.parametrize("name", ["flash_decode", "cascade_decode"])
def test_compiled_calls_refuse_grad_too(name):
    """The refusal holds while tracing: the compile fails with the eager message."""
    call, arg, fn, shown = GRAD[name]
    x = _requiring_grad(arg)
    with pytest.raises(Exception, match=rf"{fn} is an inference op: {shown} requires grad"):
        torch.compile(call, fullgraph=True, backend="eager")(x)
    with torch.no_grad():
        torch.compile(call, fullgraph=True, backend="eager")(x)


# ----------------------------------------------------------------------------------------------------
# Distributed: 2 gloo ranks


def _cp_worker(rank, world, init_file):
    """Both paths in one process: the kernel path (interpreted kernels), then the torch path (the same
    compiled graphs: the ops' real implementations choose the path when they run)."""
    import cp_attention._device as dispatch

    dispatch.POISON_OUTPUTS = True  # every output starts as NaN
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        _cp_cases(rank, world, opcheck=False)
        os.environ["TRITON_INTERPRET"] = "0"
        _cp_cases(rank, world, opcheck=True)
    finally:
        dist.destroy_process_group()


def _same(got, want, what):
    assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse), what


def _cp_cases(rank, world, opcheck):
    g = _gen(1)  # the same inputs on every rank
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, HQ, D), (B, HKV, T, D), (B, HKV, T, D)))
    lens, sinks = torch.tensor([45, 7, 0]), torch.randn(HQ, generator=g)
    ks, vs, ls = shard_kv(k, v, lens, rank, world)
    pks, pvs, pls = shard_kv(k[:1, :, :30], v[:1, :, :30], torch.tensor([29]), rank, world)
    levels = [CascadeLevel(pks, pvs, pls), CascadeLevel(ks, vs, ls)]

    def step(q, ks, vs, ls, levels, sinks):
        a = cp_flash_decode(q, ks, vs, ls, sinks=sinks, logit_softcap=20.0, return_lse=True)
        c = cp_cascade_decode(q, levels, sm_scale=0.3, return_lse=True, check_metadata=False)
        return a, c, merge_across_ranks(a), all_gather_states(c)

    got = torch.compile(step, fullgraph=True, backend="inductor")(q, ks, vs, ls, levels, sinks)
    for name, a, b in zip(("cp_flash_decode", "cp_cascade_decode", "merge_across_ranks", "all_gather_states"), got,
                          step(q, ks, vs, ls, levels, sinks)):
        _same(a, b, name)

    # CPKVCache append + decode steps, compiled and eager on twin caches: dense 1-row steps, paged 2-row
    # steps with a window (the causal rule and the window in global positions)
    for page_size, n_q, window in ((None, 1, None), (4, 2, 5)):
        twins = [CPKVCache.from_prefix(k[:, :, :20], v[:, :, :20], lens.clamp(max=20), 40, page_size=page_size)
                 for _ in range(2)]

        def cache_step(cache, k_new, v_new, q):
            cache.append(k_new, v_new)
            return cache.decode(q, check_metadata=False, return_lse=True, window_left=window)

        compiled = torch.compile(cache_step, fullgraph=True, backend="inductor")
        for s in range(2):
            k_new, v_new = (torch.randn(B, n_q, HKV, D, generator=g).squeeze(1) for _ in range(2))
            q_new = torch.randn(B, n_q, HQ, D, generator=g).squeeze(1)
            _same(compiled(twins[0], k_new, v_new, q_new), cache_step(twins[1], k_new, v_new, q_new),
                  f"CPKVCache page_size={page_size} step {s}")
        for name in ("k", "v", "seq_lens", "global_seq_lens"):
            a, b = getattr(twins[0], name), getattr(twins[1], name)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), name  # NaN: never-written slots
        assert twins[0].free_slots == twins[1].free_slots + 2 * n_q  # compiled steps leave the host count
        twins[0].set_lengths(twins[0].global_seq_lens)  # which this brings up to date
        assert twins[0].free_slots == twins[1].free_slots

    if not opcheck:
        return
    # opcheck of each distributed op (every rank makes the same calls, so the collectives match)
    cache = CPKVCache(B, HKV, D, 40, dtype=torch.float32, page_size=4)
    opchecks = [
        (_library.cp_flash_decode_op, (q, ks, vs, ls, None, True, None, None, None, sinks, None, None, None, None,
                                       0.3, None, None, "HND", 20.0, None)),
        (_library.cp_cascade_decode_op, (q, *_library._flat_levels(levels), None, True, None, None, None, None, None,
                                         None, sinks)),
        (_library.all_gather_states_op, (q, torch.randn(B, HQ, generator=g), None, True)),
        (_library.merge_across_ranks_op, (q, torch.randn(B, HQ, generator=g), None, True)),
        (_library.cp_kv_append_op, (torch.randn(B, 2, HKV, D, generator=g), torch.randn(B, 2, HKV, D, generator=g),
                                    cache.k, cache.v, cache.block_table, cache.seq_lens, cache.global_seq_lens,
                                    rank, world, cache.capacity, None, None, None, None)),
    ]
    for op, args in opchecks:
        torch.library.opcheck(op, args)


@pytest.mark.timeout(300)
def test_distributed_ops_compile_on_gloo(tmp_path):
    """cp_flash_decode, cp_cascade_decode, merge_across_ranks, all_gather_states and CPKVCache append +
    decode, compiled with fullgraph on 2 gloo ranks, are bitwise their eager calls on the kernel path and
    on the torch path (CPU tensors: the kernels run under the interpreter, which a rank must have set
    before it imports them); opcheck on each op."""
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        mp.start_processes(_cp_worker, args=(2, str(tmp_path / "init")), nprocs=2, start_method="spawn", join=True)


# ----------------------------------------------------------------------------------------------------
# GPU: compiled steps in CUDA graphs


@pytest.mark.gpu
def test_reduce_overhead_decode_step_replays():
    """``torch.compile(mode="reduce-overhead")`` of a decode step (a dense bf16 cache and a paged FP8 one)
    runs in CUDA graphs (no skip), and its replays with new queries and lengths are bitwise the eager
    calls."""
    from torch._dynamo.utils import counters

    counters.clear()
    g = torch.Generator("cuda").manual_seed(0)
    b, hq, hkv, d, t = 4, 32, 8, 128, 3000
    k, v = (torch.randn(b, hkv, t, d, generator=g, device="cuda", dtype=BF) for _ in range(2))
    k8, v8, ks, vs = quantize_kv(k.transpose(1, 2), v.transpose(1, 2), kv_layout="NHD", per_head=True)
    pool_k, pool_v = (x.reshape(b * t // 8, 8, hkv, d) for x in (k8, v8))
    table = torch.arange(b * t // 8, device="cuda", dtype=torch.int32).view(b, t // 8)

    def step(q, seq_lens):
        dense = flash_decode(q, k, v, seq_lens, return_lse=True)
        paged = flash_decode(q, pool_k, pool_v, seq_lens, block_table=table, kv_layout="NHD", k_scale=ks,
                             v_scale=vs)
        return dense.o, dense.lse, paged

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for i in range(5):
        q_i = torch.randn(b, hq, d, generator=g, device="cuda", dtype=BF) * (1 + i)
        lens = torch.randint(0, t + 1, (b,), generator=g, device="cuda")
        got = [x.clone() for x in compiled(q_i, lens)]
        for a, w in zip(got, step(q_i, lens)):
            assert torch.equal(a, w), i
    assert counters["inductor"]["cudagraph_skips"] == 0


def _graph_cache_worker(rank, world, init_file):
    from torch._dynamo.utils import counters

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", rank))
    try:
        dev = torch.device("cuda", rank)
        g = torch.Generator(dev).manual_seed(0)  # the same inputs on every rank
        b, hq, hkv, d, prefix, steps = 2, 32, 8, 128, 1000, 6
        k, v = (torch.randn(b, hkv, prefix, d, generator=g, device=dev, dtype=BF) for _ in range(2))
        lens = torch.tensor([prefix, 333], device=dev)

        def cache_step(cache, k_new, v_new, q):
            cache.append(k_new, v_new)
            return cache.decode(q, check_metadata=False, return_lse=True)

        compiled = torch.compile(cache_step, fullgraph=True, mode="reduce-overhead")
        for page_size in (None, 16):
            counters.clear()
            twins = [CPKVCache.from_prefix(k, v, lens, prefix + steps, page_size=page_size) for _ in range(2)]
            twins[1].decode(torch.zeros(b, hq, d, device=dev, dtype=BF))  # the exchange's buffers of this shape
            for t in (twins[0].k, twins[0].v, twins[0].seq_lens, twins[0].global_seq_lens):
                for x in (t, t._base):  # a dense cache's k, v are views of the buffers with the scratch slot
                    if x is not None:
                        torch._dynamo.mark_static_address(x)
            for s in range(steps):
                k_new, v_new = (torch.randn(b, hkv, d, generator=g, device=dev, dtype=BF) for _ in range(2))
                q = torch.randn(b, hq, d, generator=g, device=dev, dtype=BF)
                got = compiled(twins[0], k_new, v_new, q)
                want = cache_step(twins[1], k_new, v_new, q)
                assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse), (page_size, s)
            for name in ("k", "v", "seq_lens", "global_seq_lens"):
                assert torch.equal(getattr(twins[0], name), getattr(twins[1], name)), (page_size, name)
            assert counters["inductor"]["cudagraph_skips"] == 0, page_size
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_reduce_overhead_cache_append_and_decode(tmp_path):
    """CPKVCache append + decode compiled with ``mode="reduce-overhead"`` (its tensors marked static), dense
    and paged, step after step on one GPU rank: in CUDA graphs (no skip), bitwise the eager steps on a twin
    cache."""
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    mp.start_processes(_graph_cache_worker, args=(1, str(tmp_path / "init")), nprocs=1, start_method="spawn",
                       join=True)
