"""GPU-only checks (skipped without CUDA): CUDA-graph replay with new q and seq_lens, long bf16 caches
against the float64 oracle, and the merge kernel against the torch path on the device."""
import pytest
import torch

from cp_attention import flash_decode, merge_states
from cp_attention.reference import attention
from cp_attention.state import _merge_states_torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("b,t,splits", [(1, 65536, None), (3, 20000, 7), (64, 4096, None)],
                         ids=["B1-T64k-policy", "B3-T20000-S7", "B64-T4k-policy"])
def test_cuda_graph_replay_with_new_q_and_seq_lens(b, t, splits):
    torch.manual_seed(b)
    hq, hkv, d = 32, 8, 128
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), t, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flash_decode(q, k, v, seq_lens, num_splits=splits)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flash_decode(q, k, v, seq_lens, num_splits=splits, return_lse=True)
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


@pytest.mark.parametrize("n", [2, 8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def test_merge_kernel_on_gpu(n, dtype):
    o = torch.randn(n, 64, 32, 128, device="cuda").to(dtype)
    lse = (torch.rand(n, 64, 32, device="cuda") - 0.5) * 500
    lse[0, 0] = float("-inf")
    got = merge_states(o, lse)
    want = _merge_states_torch(o, lse)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.o.float(), want.o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-4, rtol=1e-6)
