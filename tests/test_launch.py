"""The launch cache's key is at least as fine as Triton's specialisation (tested without a GPU)."""
import torch

from cp_attention.ops import _launch
from cp_attention.ops.merge import _merge_states_kernel


def key(monkeypatch, *args, **constexprs):
    monkeypatch.setattr(_launch.torch.cuda, "current_device", lambda: 0)
    return _launch._key(_merge_states_kernel, args, constexprs, {"num_warps": 4})


def test_key_tracks_specialisation(monkeypatch):
    buf = torch.zeros(64, dtype=torch.float32)
    base = key(monkeypatch, buf, 32, 128, BLOCK=16)
    assert key(monkeypatch, buf, 48, 256, BLOCK=16) == base          # same divisibility by 16
    assert key(monkeypatch, buf, 33, 128, BLOCK=16) != base          # no longer divisible by 16
    assert key(monkeypatch, buf, 1, 128, BLOCK=16) != base           # the value 1 is specialised
    assert key(monkeypatch, buf, 2**33, 128, BLOCK=16) != base       # needs 64 bits
    assert key(monkeypatch, buf[1:], 32, 128, BLOCK=16) != base      # pointer not 16-byte aligned
    assert key(monkeypatch, buf.half(), 32, 128, BLOCK=16) != base   # dtype
    assert key(monkeypatch, buf, 32, 128, BLOCK=32) != base          # constexpr value
    assert key(monkeypatch, buf, 32.0, 128, BLOCK=16) != base        # float vs int
