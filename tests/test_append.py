"""``CPKVCache.append`` through its Triton kernel (``ops/append.py``) against the torch path, bitwise.

Two caches start from the same poisoned buffers (random bytes, NaN included) and the same ragged lengths and
take the same appends, one through the kernel, one with the Triton dispatch switched off. Everything but the
torch path's scratch slot/page must then match bit for bit (the owned slots, and the untouched ones), the
kernel must leave the scratch region as it was (it writes only owned slots), and ``seq_lens`` /
``global_seq_lens`` must be equal. The appends run past the capacity, as graph replays beyond
:attr:`CPKVCache.free_slots` do: those tokens are dropped on both paths.
"""
import pytest
import torch

import cp_attention._device as dispatch
from cp_attention.distributed import CPKVCache

B, HKV, D, MAX_LEN = 3, 3, 40, 23
START = torch.tensor([0, 5, 11])

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALES = {None: {}, "tensor": dict(k_scale=0.02, v_scale=0.01),
          "head": dict(k_scale=torch.tensor([0.01, 0.02, 0.03]), v_scale=torch.tensor([0.03, 0.02, 0.01]))}

# (page_size, world_size, rank, cache dtype, token dtype, FP8 scales, draft lengths cycled through the appends)
CASES = {
    "dense-W1-r0-f32-Q1": (None, 1, 0, torch.float32, torch.float32, None, (1,)),
    "dense-W3-r0-bf16-Q3": (None, 3, 0, torch.bfloat16, torch.bfloat16, None, (3, 1)),
    "dense-W3-r2-f32-Q7": (None, 3, 2, torch.float32, torch.float32, None, (7, 1)),
    "page1-W3-r2-bf16-Q1": (1, 3, 2, torch.bfloat16, torch.bfloat16, None, (1,)),
    "page5-W1-r0-f32-Q7": (5, 1, 0, torch.float32, torch.float32, None, (7, 3)),
    "page5-W3-r0-bf16-Q3": (5, 3, 0, torch.bfloat16, torch.bfloat16, None, (3,)),
    "page16-W3-r2-f32-Q3": (16, 3, 2, torch.float32, torch.float32, None, (3, 7)),
    "fp8e4-dense-W3-r2-bf16-tokens-Q3": (None, 3, 2, torch.float8_e4m3fn, torch.bfloat16, "tensor", (3, 1)),
    "fp8e4-page5-W3-r0-f32-tokens-head-scales-Q7": (5, 3, 0, torch.float8_e4m3fn, torch.float32, "head", (7,)),
    "fp8e5-page16-W1-r0-fp8-tokens-Q1": (16, 1, 0, torch.float8_e5m2, torch.float8_e5m2, "tensor", (1, 3)),
}


def _buffers(cache):
    """The cache's whole K/V storage, scratch slot/page included."""
    return (cache._k, cache._v) if cache.block_table is None else (cache.k, cache.v)


def _scratch(buf, paged):
    """The scratch slot (dense) or page (paged) of a whole storage ``buf``, as raw bytes."""
    return buf.view(torch.uint8)[-1] if paged else buf.view(torch.uint8)[:, :, -1]


def _without_scratch(buf, paged):
    return buf.view(torch.uint8)[:-1] if paged else buf.view(torch.uint8)[:, :, :-1]


def _tokens(gen, n, dtype, device):
    """K and V tokens ``[B, n, Hkv, D]`` (``[B, Hkv, D]`` for n == 1), as strided views of one tensor."""
    kv = torch.randn(B, n, 2, HKV, D, generator=gen)
    if dtype in FP8:
        kv = kv * 50
    kv = kv.to(dtype).to(device)
    if n == 1:
        return kv[:, 0, 0], kv[:, 0, 1]
    return kv[:, :, 0], kv[:, :, 1]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_append_kernel_matches_torch_path(case, monkeypatch, device):
    page_size, world, rank, dtype, tok_dtype, scales, drafts = case
    gen = torch.Generator().manual_seed(0)
    scales = {name: sc.to(device) if isinstance(sc, torch.Tensor) else sc for name, sc in SCALES[scales].items()}
    kw = dict(dtype=dtype, rank=rank, world_size=world, page_size=page_size, device=device, **scales)
    kernel, ref = CPKVCache(B, HKV, D, MAX_LEN, **kw), CPKVCache(B, HKV, D, MAX_LEN, **kw)
    paged = page_size is not None
    for buf, ref_buf in zip(_buffers(kernel), _buffers(ref)):  # the same poison in both
        bits = torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8, generator=gen)
        buf.view(torch.uint8).copy_(bits)
        ref_buf.view(torch.uint8).copy_(bits)
    scratch = [_scratch(buf, paged).clone() for buf in _buffers(kernel)]
    kernel.set_lengths(START.to(device))
    ref.set_lengths(START.to(device))

    step = 0
    while int(kernel.global_seq_lens.min()) < MAX_LEN + 8:  # past max_seq_len for every sequence
        n = drafts[step % len(drafts)]
        step += 1
        if kernel.free_slots < n:  # as graph replays do: the host-side count stays behind
            kernel._host_max_len = ref._host_max_len = MAX_LEN - n
        k_new, v_new = _tokens(gen, n, tok_dtype, device)
        kernel.append(k_new, v_new)
        with monkeypatch.context() as m:
            m.setattr(dispatch, "use_triton", lambda t: False)
            ref.append(k_new, v_new)
        assert torch.equal(kernel.global_seq_lens, ref.global_seq_lens), step
        assert torch.equal(kernel.seq_lens, ref.seq_lens), step
    assert kernel.seq_lens.dtype == torch.int32 and kernel.global_seq_lens.dtype == torch.int64
    assert int(kernel.seq_lens.max()) == kernel.capacity  # the shards filled up; later tokens were dropped

    for got, want, before in zip(_buffers(kernel), _buffers(ref), scratch):
        assert torch.equal(_without_scratch(got, paged), _without_scratch(want, paged))
        assert torch.equal(_scratch(got, paged), before)


def test_append_kernel_with_drafts_and_rollback(monkeypatch, device):
    """Ragged lengths from rejected drafts (a tensor rollback) between multi-token appends."""
    gen = torch.Generator().manual_seed(1)
    kw = dict(dtype=torch.bfloat16, rank=1, world_size=3, page_size=5, device=device)
    kernel, ref = CPKVCache(B, HKV, D, MAX_LEN, **kw), CPKVCache(B, HKV, D, MAX_LEN, **kw)
    for n, rejected in ((4, [0, 3, 1]), (4, [4, 0, 2]), (2, [1, 1, 0]), (5, [0, 0, 0])):
        k_new, v_new = _tokens(gen, n, torch.bfloat16, device)
        kernel.append(k_new, v_new)
        with monkeypatch.context() as m:
            m.setattr(dispatch, "use_triton", lambda t: False)
            ref.append(k_new, v_new)
        for cache in (kernel, ref):
            cache.rollback(torch.tensor(rejected, device=device))
    assert torch.equal(kernel.seq_lens, ref.seq_lens) and torch.equal(kernel.global_seq_lens, ref.global_seq_lens)
    for b in range(B):
        slots = torch.arange(int(kernel.seq_lens[b]), device=device)
        pages = kernel.block_table[b, slots // 5]
        for got, want in ((kernel.k, ref.k), (kernel.v, ref.v)):
            assert torch.equal(got[pages, slots % 5], want[pages, slots % 5])


def test_append_rejects_a_strided_head_dim():
    cache = CPKVCache(1, 1, 32, 10, dtype=torch.float32, rank=0, world_size=1)
    tok = torch.randn(1, 1, 64)[..., ::2]
    with pytest.raises(ValueError, match="k_new must have a contiguous last dim"):
        cache.append(tok, tok)


def test_rollback_beyond_a_sequence():
    """An int n beyond the shortest sequence raises; a tensor n drops min(max(n, 0), length) on the device."""
    cache = CPKVCache(2, 1, 32, 10, dtype=torch.float32, rank=0, world_size=1)
    cache.set_lengths(torch.tensor([3, 5]))
    with pytest.raises(ValueError, match=r"^n must be at most the shortest sequence's length 3"):
        cache.rollback(4)
    assert cache.global_seq_lens.tolist() == [3, 5]
    cache.rollback(torch.tensor([10, -2]))
    assert cache.global_seq_lens.tolist() == [0, 5] and cache.seq_lens.tolist() == [0, 5]
    cache.rollback(0)
    with pytest.raises(ValueError, match=r"^n\b"):
        cache.rollback(1)
