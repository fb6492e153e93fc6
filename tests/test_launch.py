"""The launch cache's key is at least as fine as Triton's specialisation (tested without a GPU)."""
import torch

from cp_attention.ops._launch import specialization


def key(*args):
    return specialization(args)


def test_key_tracks_specialisation():
    buf = torch.zeros(64, dtype=torch.float32)
    base = key(buf, 32, 128)
    assert key(buf, 48, 256) == base            # same divisibility by 16
    assert key(buf, 33, 128) != base            # no longer divisible by 16
    assert key(buf, 1, 128) != base             # the value 1 is specialised
    assert key(buf, 2**33, 128) != base         # needs 64 bits
    assert key(buf[1:], 32, 128) != base        # pointer not 16-byte aligned
    assert key(buf.half(), 32, 128) != base     # dtype
    assert key(buf, 32.0, 128) != base          # float vs int


def test_no_launch_hook_registered_by_default():
    """Launches bypass Triton's launch-metadata path only while no profiler hook is registered."""
    from triton import knobs

    from cp_attention.ops._launch import _hooks_registered

    assert not _hooks_registered()
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert _hooks_registered()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not _hooks_registered()
