"""Deterministic splits (split_size): a request's output is bitwise the same whatever batch it runs in and
whatever the cache's capacity (kernels under the interpreter on the CPU; on the GPU in test_gpu.py).
Context-parallel bitwise equality is in test_distributed.py."""
import pytest
import torch

from cp_attention import flash_decode
from cp_attention.heuristics import deterministic_plan
from cp_attention.reference import attention

from .conftest import DEVICE, assert_state_matches
from .test_paged import dense_cache, page_pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("q_rows", [None, 3], ids=["Q1", "Q3"])
def test_batch_invariance(dtype, q_rows):
    """Request 2 alone, with a smaller cache capacity, gives the bits it gets in a batch of 5."""
    q, k, v, sl = dense_cache(5, 8, 2, 300, 32, [300, 17, 250, 0, 129], q_rows=q_rows, dtype=dtype, seed=1)
    batch = flash_decode(q, k, v, sl, split_size=64, return_lse=True)
    assert_state_matches(batch, attention(q.double(), k.double(), v.double(), sl), dtype)
    alone = flash_decode(q[2:3].contiguous(), k[2:3, :, :256].contiguous(), v[2:3, :, :256].contiguous(), sl[2:3],
                         split_size=64, return_lse=True)
    assert torch.equal(alone.o, batch.o[2:3]) and torch.equal(alone.lse, batch.lse[2:3])


@pytest.mark.parametrize("q_rows", [None, 3], ids=["Q1", "Q3"])
def test_batch_invariance_on_the_torch_path(monkeypatch, q_rows):
    """The torch path runs the same fixed splits (each the reference over its positions), merged in order."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, sl = dense_cache(5, 8, 2, 300, 32, [300, 17, 250, 0, 129], q_rows=q_rows, seed=3)
    q, k, v, sl = (t.cpu() for t in (q, k, v, sl))
    sinks = torch.linspace(-1.0, 1.0, 8)
    batch = flash_decode(q, k, v, sl, split_size=64, sinks=sinks, return_lse=True)
    assert_state_matches(batch, attention(q.double(), k.double(), v.double(), sl, sinks=sinks.double()), torch.float32)
    alone = flash_decode(q[2:3].contiguous(), k[2:3, :, :256].contiguous(), v[2:3, :, :256].contiguous(), sl[2:3],
                         split_size=64, sinks=sinks, return_lse=True)
    assert torch.equal(alone.o, batch.o[2:3]) and torch.equal(alone.lse, batch.lse[2:3])


def test_batch_invariance_paged_with_sinks():
    q, k, v, sl = dense_cache(4, 8, 2, 200, 32, [200, 33, 150, 1], q_rows=None, seed=2)
    sinks = torch.linspace(-1.0, 1.0, 8, device=DEVICE)
    kp, vp, table = page_pool(k, v, sl, 16, "NHD", seed=2)
    batch = flash_decode(q, kp, vp, sl, block_table=table, kv_layout="NHD", split_size=32, sinks=sinks, return_lse=True)
    one = flash_decode(q[2:3], kp, vp, sl[2:3], block_table=table[2:3, :10], kv_layout="NHD", split_size=32,
                       sinks=sinks, return_lse=True)
    assert torch.equal(one.o, batch.o[2:3]) and torch.equal(one.lse, batch.lse[2:3])


def test_deterministic_plan():
    plan = deterministic_plan(100_000, 128, torch.bfloat16, 4096)
    assert (plan.config.block_n, plan.num_splits, plan.tiles_per_split, plan.deterministic) == (128, 25, 32, True)
    plan = deterministic_plan(100, 64, torch.float32, 48)  # the largest tile that divides 48
    assert (plan.config.block_n, plan.num_splits, plan.tiles_per_split) == (16, 3, 3)


@pytest.mark.parametrize("kw, exc, name", [
    (dict(split_size=24), ValueError, "split_size"),
    (dict(split_size=8), ValueError, "split_size"),
    (dict(split_size=64.0), TypeError, "split_size"),
    (dict(split_size=64, num_splits=2), ValueError, "split_size"),
    (dict(split_size=64, window_left=10), ValueError, "split_size"),
], ids=["not-multiple-of-16", "too-small", "float", "with-num_splits", "with-window"])
def test_bad_split_size(kw, exc, name):
    q, k, v, sl = dense_cache(2, 8, 2, 40, 32, [40, 3], q_rows=None)
    with pytest.raises(exc, match=rf"^{name}\b"):
        flash_decode(q, k, v, sl, **kw)
