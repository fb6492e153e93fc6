"""Inputs at the edges of the contract, one process: each either gives the exact answer or raises a
ValueError/TypeError naming the argument (never a crash, a NaN or a silent wrong answer)."""
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_attention import AttentionState, flash_decode, lse_from_base2, lse_to_base2, quantize_kv
from cp_attention.distributed import CPKVCache
from cp_attention.distributed.agree import real_word, scale_word, value_word
from cp_attention.reference import attention

ROOT = Path(__file__).resolve().parents[1]
INTERP = pytest.mark.parametrize("path", ["interp", "torch"])


def _path(monkeypatch, path):
    if path == "torch":  # CPU tensors take the torch path when the interpreter is off (read at each call)
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@INTERP
def test_a_pool_read_through_no_pages_is_the_empty_cache(monkeypatch, path):
    _path(monkeypatch, path)
    q, pool = torch.randn(2, 4, 64), torch.randn(12, 16, 2, 64)
    st = flash_decode(q, pool, pool, torch.tensor([0, 0]), block_table=torch.zeros(2, 0, dtype=torch.int32),
                      kv_layout="NHD", return_lse=True)
    assert torch.equal(st.o, torch.zeros_like(q)) and torch.isneginf(st.lse).all()


@INTERP
def test_an_overlapping_out_is_refused(monkeypatch, path):
    _path(monkeypatch, path)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 50, 64)
    with pytest.raises(ValueError, match="out must not overlap itself"):
        flash_decode(q, k, k, out=torch.empty(1, 4, 64).expand(2, 4, 64))


@pytest.mark.parametrize("sm_scale", [1e39, -1e39, 10**400])
def test_an_sm_scale_beyond_float32_is_refused(sm_scale):
    q, k = torch.randn(1, 4, 64), torch.randn(1, 2, 50, 64)
    with pytest.raises(TypeError, match="sm_scale must be a real number finite in float32"):
        flash_decode(q, k, k, sm_scale=sm_scale)


@pytest.mark.parametrize("window_left", [2**31, 2**64])
def test_a_window_beyond_int32_is_refused(window_left):
    q, k = torch.randn(1, 4, 64), torch.randn(1, 2, 50, 64)
    with pytest.raises(ValueError, match="window_left must be in"):
        flash_decode(q, k, k, window_left=window_left)


@INTERP
def test_numpy_integers_are_ints(monkeypatch, path):
    _path(monkeypatch, path)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 96, 64)
    lens = torch.tensor([96, 40])
    for kw, py in (({"window_left": np.int64(5)}, {"window_left": 5}), ({"split_size": np.int64(32)},
                                                                         {"split_size": 32})):
        assert torch.equal(flash_decode(q, k, k, lens, **kw), flash_decode(q, k, k, lens, **py))


def test_a_tiny_cache_quantises_with_a_positive_scale():
    k = torch.full((1, 2, 16, 32), 1e-44)
    k8, v8, ks, vs = quantize_kv(k, k)
    assert ks.item() > 0 and vs.item() > 0
    o = flash_decode(torch.randn(1, 2, 32).bfloat16(), k8, v8, k_scale=ks, v_scale=vs)
    assert torch.isfinite(o.float()).all()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"head_dim": 36}, ValueError, "head dim must be a multiple of 8"),
    ({"head_dim": 1000}, ValueError, "head dim must be a multiple of 8"),
    ({"device": "meta"}, ValueError, "device must be the CPU or a CUDA device"),
    ({"device": object()}, TypeError, "device must be a torch.device"),
])
def test_cache_arguments_the_kernels_cannot_take_are_refused(kwargs, error, match):
    args = dict(batch=1, heads_kv=1, head_dim=32, max_seq_len=8, rank=0, world_size=1)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        CPKVCache(args.pop("batch"), args.pop("heads_kv"), args.pop("head_dim"), args.pop("max_seq_len"), **args)


def test_a_one_rank_cache_decodes_without_a_process_group():
    cache = CPKVCache(2, 2, 32, 16, dtype=torch.float32, rank=0, world_size=1)
    ks, vs = torch.randn(2, 5, 2, 32), torch.randn(2, 5, 2, 32)
    for i in range(5):
        cache.append(ks[:, i], vs[:, i])
    q = torch.randn(2, 8, 32)
    ref = attention(q.double(), ks.transpose(1, 2).double(), vs.transpose(1, 2).double())
    torch.testing.assert_close(cache.decode(q).double(), ref.o, atol=1e-5, rtol=1e-5)


def test_agreement_words_compare_values_not_forms():
    """Note [Agreement across ranks]: equal values give one word whatever their form."""
    assert real_word(30) == real_word(30.0) == real_word(np.float64(30.0))
    assert real_word(torch.tensor(0.5)) == real_word(0.5) == real_word(torch.tensor([0.5]))
    assert real_word(torch.tensor([0.5, 0.25])) == real_word(torch.tensor([0.5, 0.25], dtype=torch.float64))
    assert real_word(None) == 0 != real_word(0.0)
    assert value_word(np.int64(32)) == value_word(32) != value_word(None)
    # sm_scale as the kernels take it (float32): the default and its spellings one float64 ulp apart agree
    assert 32 ** -0.5 != 1 / math.sqrt(32)
    assert scale_word(None, 32) == scale_word(32 ** -0.5, 32) == scale_word(1 / math.sqrt(32), 32)
    assert scale_word(None, 32) != scale_word(np.nextafter(np.float32(32 ** -0.5), np.float32(1)).item(), 32)


@INTERP
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("shape", [(2, 2, 0, 32), (0, 2, 16, 32)], ids=["T0", "B0"])
def test_an_empty_cache_quantises_with_scale_one(monkeypatch, path, per_head, shape):
    _path(monkeypatch, path)
    k = torch.randn(shape)
    k8, v8, ks, vs = quantize_kv(k, k, per_head=per_head)
    assert k8.shape == shape and ks.shape == ((2,) if per_head else ()) and (ks == 1).all() and (vs == 1).all()
    st = flash_decode(torch.randn(shape[0], 4, 32).bfloat16(), k8, v8, k_scale=ks, v_scale=vs, return_lse=True)
    assert (st.o == 0).all() and torch.isneginf(st.lse).all()
    if shape[0]:  # a cache holds one request or more
        cache = CPKVCache.from_prefix(k, k, torch.zeros(shape[0], dtype=torch.int32), 16,
                                      dtype=torch.float8_e4m3fn, rank=0, world_size=1)
        assert int(cache.seq_lens.sum()) == 0


def test_the_interpreter_flag_set_after_triton_was_imported_is_refused():
    """Triton makes its functions interpreted or compiled when it defines them: the flag turned on later
    raises a RuntimeError that says so (not an error from inside Triton)."""
    code = ("import os, torch, triton\n"
            "from cp_attention import flash_decode\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "try:\n"
            "    flash_decode(torch.randn(1, 4, 32), torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32))\n"
            "except RuntimeError as exc:\n"
            "    print(exc)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "TRITON_INTERPRET=1 was set after triton was imported" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("call, error, match", [
    (lambda: AttentionState.empty((2, 4), -1), ValueError, "head_dim"),
    (lambda: AttentionState.empty((2, -4), 64), ValueError, r"shape\[1\]"),
    (lambda: AttentionState.empty((2, 4), 64.5), TypeError, "head_dim"),
    (lambda: AttentionState.empty("ab", 64), TypeError, "shape"),
    (lambda: AttentionState.empty((2, 4), 64, dtype=torch.int32), TypeError, "dtype"),
    (lambda: lse_to_base2(torch.tensor([1, 2])), TypeError, "lse must be a floating-point tensor"),
    (lambda: lse_from_base2([1.0]), TypeError, "lse2 must be a floating-point tensor"),
], ids=["head-dim-negative", "shape-negative", "head-dim-float", "shape-str", "dtype-int", "lse-int", "lse2-list"])
def test_state_helpers_check_their_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
