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
    import cp_attention._dispatch as dispatch

    def nan_buffer(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(dispatch, "new_buffer", nan_buffer)
