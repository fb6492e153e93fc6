"""Test set-up: without a GPU, Triton kernels run under the interpreter (set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def poison_kernel_outputs(monkeypatch):
    """Every buffer a kernel is meant to fill starts as NaN, so an unwritten element fails its test."""
    import cp_attention._device as dispatch

    monkeypatch.setattr(dispatch, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    """After each test, the GPU memory this worker's allocator keeps cached goes back to the device, so the
    parallel workers of the GPU suite (pytest-xdist) share an 80 GB card by what they use, not what they
    once used."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_state_matches(got, ref, dtype):
    """``got`` (an AttentionState from a kernel, o in ``dtype``) equals the float64 ``ref`` within the
    dtype's tolerance; empty key sets give exactly o = 0 and lse = -inf; no NaN anywhere."""
    assert not torch.isnan(got.o).any() and not torch.isnan(got.lse).any()
    tol = TOL[dtype]
    torch.testing.assert_close(got.o.double().cpu(), ref.o.cpu(), atol=tol, rtol=tol)
    finite = torch.isfinite(ref.lse)
    assert torch.equal(torch.isfinite(got.lse).cpu(), finite.cpu())
    torch.testing.assert_close(got.lse.double()[finite].cpu(), ref.lse[finite].cpu(), atol=tol, rtol=1e-4)
    assert (got.o[~finite] == 0).all() and torch.isneginf(got.lse[~finite]).all()
