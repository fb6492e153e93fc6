"""flash_decode's and cascade_decode's prepared hot paths (Note [The decode hot path], Note [Cascade
attention]) without a GPU: CPU tensors made to take the CUDA code path (``is_cuda`` true, the two CUDA
runtime queries answered in Python, a recording stand-in for the compiled kernel), so the direct launch's
arguments and the checks a repeated call still runs are tested on the CPU. The kernels' results on that path are tested on the GPU (test_gpu.py) and, through the
same prepared launches, under the interpreter (the other test files)."""
import collections
import contextlib

import pytest
import torch

from cp_attention import AttentionState, CascadeLevel, cascade, cascade_decode, decode, flash_decode
from cp_attention.heuristics import decode_plan
from cp_attention.ops.merge import _merge_states_kernel
from cp_attention.ops.prefix import _prefix_kernel
from cp_attention.ops.split_kv import _combine_kernel, _split_kv_kernel

ARG_NAMES = _split_kv_kernel.arg_names


class _Log(list):
    """The split kernel's launches (kind, arguments); ``combine``: the combine kernel's."""

    def __init__(self):
        super().__init__()
        self.combine = []


class _Compiled:
    """Stands in for a compiled kernel: ``run`` (the direct launch) and ``[grid](...)`` (Triton's own path)
    record their arguments."""

    function = 0
    packed_metadata = None

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("run", args[9:]))  # after grid (3), stream, function, metadata, 3 hook slots

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("triton", args))


@contextlib.contextmanager
def _on_the_cuda_path(monkeypatch, log_of):
    """CPU tensors take the CUDA code path: ``is_cuda`` true, the two CUDA runtime queries answered in Python,
    and every ``@triton.jit`` kernel's first launch recorded as ``("jit", arguments)`` into ``log_of(kernel)``
    (later launches by the :class:`_Compiled` stand-in it returns)."""
    def getitem(kernel, grid):
        mine = log_of(kernel)

        def first_launch(*args, **kwargs):  # the JIT: compiles, launches, returns the compiled kernel
            mine.append(("jit", args + tuple(x for name, x in kwargs.items() if name in kernel.arg_names)))
            return _Compiled(mine)
        return first_launch

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(type(_split_kv_kernel), "__getitem__", getitem)
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        del torch.Tensor.is_cuda


@pytest.fixture
def cuda_path(monkeypatch):
    """CPU tensors take flash_decode's CUDA path; returns the split kernel's launches (kind, arguments), and
    the combine kernel's in ``.combine``."""
    log = _Log()
    for name, empty in (("_PREPARED", {}), ("_SCRATCH", {}), ("_LAST", (None, None))):
        monkeypatch.setattr(decode, name, empty)
    with _on_the_cuda_path(monkeypatch, lambda kernel: log if kernel is _split_kv_kernel else log.combine):
        yield log


def make(b=2, hq=8, hkv=2, t=300, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    return q, k, v, torch.full((b,), t, dtype=torch.int32)


def arg(args, name):
    return args[ARG_NAMES.index(name)]


def test_repeated_call_launches_directly_with_the_new_pointers(cuda_path):
    """The second call with new tensors of the same key launches through ``run`` with their pointers and
    the first call's integers, and allocates a new output."""
    q, k, v, sl = make(seed=1)
    out = torch.empty_like(q)
    for kwargs in ({}, {"out": out}, {"return_lse": True}):
        cuda_path.clear()
        decode._PREPARED.clear()
        decode._LAST = (None, None)
        o1 = flash_decode(q, k, v, sl, **kwargs)
        q2, k2, v2, sl2 = make(seed=2)
        o2 = flash_decode(q2, k2, v2, sl2, **kwargs)
        (kind1, first), (kind2, second) = cuda_path
        assert (kind1, kind2) == ("jit", "run") and len(first) == len(second) == len(ARG_NAMES)
        o1, o2 = (o1.o, o2.o) if isinstance(o1, AttentionState) else (o1, o2)
        assert (o2 is out) == ("out" in kwargs) and (o2 is not o1) == ("out" not in kwargs)
        new = {id(q): q2, id(k): k2, id(v): v2, id(sl): sl2, id(o1): o2}
        want = [new.get(id(a), a).data_ptr() if isinstance(a, torch.Tensor) else a for a in first]
        if kwargs.get("return_lse"):  # a new lse buffer too
            want[ARG_NAMES.index("LSE")] = arg(second, "LSE")
            assert arg(second, "LSE") != arg(first, "LSE").data_ptr()
        assert list(second) == want
        # several splits: the combine kernel writes the output, with the same new pointers
        names = _combine_kernel.arg_names
        (ckind1, cfirst), (ckind2, csecond) = cuda_path.combine
        assert (ckind1, ckind2) == ("jit", "run") and len(cfirst) == len(csecond) == len(names)
        assert csecond[names.index("O")] == o2.data_ptr() and cfirst[names.index("O")] is o1
        assert csecond[names.index("WORK")] == arg(second, "WORK") == arg(first, "WORK").data_ptr()
        assert csecond[names.index("LSE")] == arg(second, "LSE")
        cuda_path.combine.clear()


def test_a_prepared_key_does_not_skip_the_checks(cuda_path):
    """After a good call, each bad variant of it raises the argument's error before any launch."""
    q, k, v, sl = make()
    plan = decode_plan(2, 2, 300, 64, torch.bfloat16, 132)
    good = dict(num_splits=2, window_left=4, logit_softcap=30.0, out=torch.empty_like(q), sm_scale=0.1)
    bad = [
        ({"k": k.float()}, TypeError, "k"),
        ({"v": v[:, :, :100]}, ValueError, "v"),
        ({"q": q[:, :3]}, ValueError, "q heads"),
        ({"seq_lens": sl.float()}, TypeError, "seq_lens"),
        ({"seq_lens": sl.to("meta")}, ValueError, "seq_lens"),
        ({"num_splits": 2.0}, TypeError, "num_splits"),
        ({"window_left": True}, TypeError, "window_left"),
        ({"logit_softcap": -1.0}, ValueError, "logit_softcap"),
        ({"logit_softcap": True}, TypeError, "logit_softcap"),
        ({"logit_softcap": 1e300}, ValueError, "logit_softcap"),  # finite as a float, not in float32
        ({"logit_softcap": 3e38}, ValueError, "logit_softcap"),  # times log2(e), beyond float32
        ({"sm_scale": float("nan")}, TypeError, "sm_scale"),
        ({"sm_scale": 1e39}, TypeError, "sm_scale"),
        ({"sm_scale": "0.1"}, TypeError, "sm_scale"),
        ({"return_lse": 1}, TypeError, "return_lse"),
        ({"out": torch.empty_like(q)[:1]}, ValueError, "out"),
        ({"out": torch.empty_like(q).double()}, TypeError, "out"),
        ({"out": [torch.empty_like(q), torch.empty(2, 8)]}, TypeError, "out"),
        ({"num_splits": None, "plan": tuple(plan)}, TypeError, "plan"),
    ]
    args = dict(q=q, k=k, v=v, seq_lens=sl, **good)
    flash_decode(**args)
    flash_decode(**args)
    assert [kind for kind, _ in cuda_path] == ["jit", "run"]
    for change, exc, name in bad:
        with pytest.raises(exc, match=rf"^{name}\b"):
            flash_decode(**{**args, **change})
    assert len(cuda_path) == 2  # nothing launched


def test_an_out_pair_sharing_bytes_is_refused_after_a_good_one(cuda_path):
    """``out=(o, lse)`` as views of one fp32 buffer: ``[o | lse]`` rows (as the context-parallel exchange packs
    them) are prepared and replayed; then views of the same shapes and strides whose bytes meet raise before
    any launch (where lse starts in the buffer is part of the key)."""
    q, k, v, sl = make()
    packed = torch.empty(2, 8, 65)
    args = dict(q=q, k=k, v=v, seq_lens=sl, return_lse=True)
    for _ in range(2):
        flash_decode(**args, out=AttentionState(packed[..., :64], packed[..., 64]))
    assert [kind for kind, _ in cuda_path] == ["jit", "run"]
    for lse in (packed[..., 63], packed[..., 0]):
        with pytest.raises(ValueError, match="^out and out.lse must not share memory"):
            flash_decode(**args, out=AttentionState(packed[..., :64], lse))
    assert len(cuda_path) == 2
    flash_decode(**args, out=AttentionState(packed[..., 1:], packed[..., 0]))  # the other way round: disjoint
    assert [kind for kind, _ in cuda_path] == ["jit", "run", "jit"]


def test_fp8_float_scales_are_checked_at_every_call(cuda_path):
    q, k, v, sl = make()
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    flash_decode(q, k8, v8, sl, k_scale=0.5, v_scale=2.0)
    flash_decode(q, k8, v8, sl, k_scale=0.25, v_scale=4.0)
    assert (arg(cuda_path[-1][1], "k_scale"), arg(cuda_path[-1][1], "v_scale")) == (0.25, 4.0)
    for ks, exc in ((-1.0, ValueError), (float("inf"), ValueError), (1e39, ValueError), (True, TypeError)):
        with pytest.raises(exc, match=r"^k_scale\b"):
            flash_decode(q, k8, v8, sl, k_scale=ks, v_scale=4.0)
    with pytest.raises(ValueError, match=r"^k_scale\b"):
        flash_decode(q, k8, v8, sl, k_scale=torch.ones(3), v_scale=torch.ones(3))
    assert len(cuda_path) == 2


def test_new_shapes_and_strides_prepare_a_new_launch(cuda_path):
    """A longer cache, a strided seq_lens column or a misaligned q get their own launch (its integers and
    specialisation), not the earlier one's."""
    q, k, v, sl = make()
    flash_decode(q, k, v, sl)
    _, k2, v2, _ = make(t=500)
    flash_decode(q, k2, v2, sl)
    meta = torch.stack([sl, sl], dim=1)
    flash_decode(q, k, v, meta[:, 0])
    buf = torch.empty(q.numel() + 1, dtype=q.dtype)
    q_odd = buf[1:].view(q.shape).copy_(q)  # 2-byte aligned
    flash_decode(q_odd, k, v, sl)
    assert [kind for kind, _ in cuda_path] == ["jit"] * 4
    launches = [args for _, args in cuda_path]
    assert [arg(a, "T_MAX") for a in launches] == [300, 500, 300, 300]
    assert [arg(a, "stride_sl") for a in launches] == [1, 1, 2, 1]
    assert arg(launches[3], "Q") is q_odd


def test_device_index_values_are_not_read(cuda_path):
    """On the GPU path seq_lens and block_table values stay on the device (no host sync): out-of-range
    values reach the kernel, which clamps them, where the CPU path refuses them."""
    q, k, v, _ = make()
    flash_decode(q, k, v, torch.tensor([301, -5], dtype=torch.int32))
    assert len(cuda_path) == 1


def test_launch_hooks_see_the_launch(cuda_path):
    """With a launch hook registered (a profiler), a prepared call goes through Triton's own launch path."""
    from triton import knobs

    q, k, v, sl = make()
    out = torch.empty_like(q)
    flash_decode(q, k, v, sl, out=out)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        flash_decode(q, k, v, sl, out=out)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    flash_decode(q, k, v, sl, out=out)
    assert [kind for kind, _ in cuda_path] == ["jit", "triton", "run"]
    assert cuda_path[1][1] == cuda_path[2][1]


def test_host_tensors_are_checked_at_every_call():
    """Under the interpreter a prepared key is reused, but host index values are still checked each call."""
    q, k, v, sl = make(t=64, d=32)
    flash_decode(q, k, v, sl)
    with pytest.raises(ValueError, match=r"^seq_lens\b"):
        flash_decode(q, k, v, torch.tensor([65, 3], dtype=torch.int32))


# ----------------------------------------------------------------------------------------------------
# cascade_decode's prepared eager path (Note [Cascade attention] in cascade.py), the same way: shared levels
# only (the per-request ones run through flash_decode's path above, on a CUDA side stream).

PREFIX_NAMES = _prefix_kernel.arg_names
MERGE_NAMES = _merge_states_kernel.arg_names


@pytest.fixture
def kernel_log(monkeypatch):
    """CPU tensors take cascade_decode's CUDA path; returns every kernel's launches, ``{name: [(kind, args)]}``."""
    log = collections.defaultdict(list)
    monkeypatch.setattr(cascade, "_PREPARED", {})
    with _on_the_cuda_path(monkeypatch, lambda kernel: log[kernel.__name__]):
        yield log


def two_shared_levels(seed, b=3, hq=8, hkv=2, d=64, dtype=torch.bfloat16):
    """A prefix every request reads and two group segments (``segment_ids``)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q = rnd(b, hq, d)
    return q, [CascadeLevel(rnd(1, hkv, 300, d), rnd(1, hkv, 300, d)),
               CascadeLevel(rnd(2, hkv, 40, d), rnd(2, hkv, 40, d), torch.tensor([40, 7]), torch.tensor([1, 0, 1]))]


def test_cascade_repeated_call_launches_directly_with_the_new_pointers(kernel_log):
    """The second call with new tensors of the same key launches every kernel through ``run``: the new
    tensors' pointers, each level's workspace slots at the first call's offsets, the new scalars, the first
    call's integers; a new output."""
    q, levels = two_shared_levels(1)
    o1 = cascade_decode(q, levels, sm_scale=0.1)
    q2, levels2 = two_shared_levels(2)
    o2 = cascade_decode(q2, levels2, sm_scale=0.2, logit_softcap=None)
    prefix, merge = kernel_log["_prefix_kernel"], kernel_log["_merge_states_kernel"]
    assert [kind for kind, _ in prefix] == ["jit", "jit", "run", "run"] and [k for k, _ in merge] == ["jit", "run"]
    (_, jit0), (_, jit1), (_, run0), (_, run1) = prefix
    for jit, run, lvl in ((jit0, run0, levels2[0]), (jit1, run1, levels2[1])):
        assert len(jit) == len(run) == len(PREFIX_NAMES)
        p = {name: run[i] for i, name in enumerate(PREFIX_NAMES)}
        assert (p["Q"], p["K"], p["V"]) == (q2.data_ptr(), lvl.k.data_ptr(), lvl.v.data_ptr())
        assert p["sm_scale"] == 0.2 and p["cap"] == 1.0
        first = PREFIX_NAMES.index("T_MAX")
        assert run[first:] == jit[first:]  # sizes, strides and constexprs bound once
    assert run1[PREFIX_NAMES.index("SEQ_LENS")] == levels2[1].seq_lens.data_ptr()
    rows, d = q.numel() // q.shape[-1], q.shape[-1]
    slots = jit0[PREFIX_NAMES.index("O_PART")].shape[0]  # the first level's splits
    o_jit = [a[PREFIX_NAMES.index("O_PART")].data_ptr() for a in (jit0, jit1)]
    lse_jit = [a[PREFIX_NAMES.index("LSE_PART")].data_ptr() for a in (jit0, jit1)]
    o_run = [a[PREFIX_NAMES.index("O_PART")] for a in (run0, run1)]
    lse_run = [a[PREFIX_NAMES.index("LSE_PART")] for a in (run0, run1)]
    assert o_jit[1] - o_jit[0] == o_run[1] - o_run[0] == slots * rows * d * 4
    assert lse_jit[1] - lse_jit[0] == lse_run[1] - lse_run[0] == slots * rows * 4
    (_, mjit), (_, mrun) = merge
    m = {name: mrun[i] for i, name in enumerate(MERGE_NAMES)}
    assert (m["O"], m["LSE"], m["O_OUT"]) == (o_run[0], lse_run[0], o2.data_ptr()) and o2.data_ptr() != o1.data_ptr()
    first = MERGE_NAMES.index("N")
    assert mrun[first:] == mjit[first:]


def test_cascade_prepared_key_does_not_skip_the_checks(kernel_log):
    """After a good call, a bad scalar raises before any launch; another dtype of an index tensor is a new
    key, checked and prepared anew."""
    q, levels = two_shared_levels(1)
    cascade_decode(q, levels, sm_scale=0.1, logit_softcap=5.0)
    n = len(kernel_log["_prefix_kernel"])
    for kwargs, exc, name in (({"sm_scale": float("nan")}, TypeError, "sm_scale"),
                              ({"sm_scale": 1e39}, TypeError, "sm_scale"),
                              ({"logit_softcap": -1.0}, ValueError, "logit_softcap"),
                              ({"logit_softcap": 1e300}, ValueError, "logit_softcap"),
                              ({"return_lse": 1}, TypeError, "return_lse")):
        with pytest.raises(exc, match=rf"^{name}\b"):
            cascade_decode(q, levels, **{"sm_scale": 0.1, "logit_softcap": 5.0, **kwargs})
    assert len(kernel_log["_prefix_kernel"]) == n
    cascade_decode(q, levels, sm_scale=0.1, logit_softcap=5.0)
    args = kernel_log["_prefix_kernel"][-1][1]
    assert args[PREFIX_NAMES.index("cap")] == pytest.approx(5.0 * 1.4426950408889634)
    with pytest.raises(ValueError, match=r"^levels\[1\]\.segment_ids\b"):
        cascade_decode(q, [levels[0], levels[1]._replace(segment_ids=torch.tensor([1, 0]))], sm_scale=0.1,
                       logit_softcap=5.0)
    cascade_decode(q, [levels[0], levels[1]._replace(seq_lens=levels[1].seq_lens.int())], sm_scale=0.1,
                   logit_softcap=5.0)
    assert [kind for kind, _ in kernel_log["_prefix_kernel"]][-2:] == ["jit", "jit"]
    assert len(cascade._PREPARED) == 2
