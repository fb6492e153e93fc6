"""How many KV splits a decode launch uses.

Note [Split count]
------------------
Decode reads every K/V byte once, so the only goal is to keep every SM's loads in flight. The grid has
``B * Hkv`` programs per split; with a small batch that is far fewer than the SMs, so the KV sequence is
split ``S`` ways. :func:`num_splits` is FlashAttention-2's wave-efficiency rule. :func:`decode_num_splits`
is the policy :func:`cp_attention.flash_decode` uses, decided from shapes and the cache capacity
``T_max`` only (never from device values, so a CUDA graph can be replayed with new ``seq_lens``).
"""
from __future__ import annotations

import functools
import math

__all__ = ["num_splits", "decode_num_splits"]


def num_splits(work_items: int, slots: int, n_kv_blocks: int, max_splits: int = 128, *,
               efficiency: float = 0.85) -> int:
    """FlashAttention-2's split count (``num_splits_heuristic``): the smallest ``S`` whose last wave of
    ``work_items * S`` programs on ``slots`` is at least ``efficiency`` (85%) as full as the best ``S``
    achieves.

    Returns 1 when ``work_items >= 0.8 * slots``. Split counts that give the same number of KV blocks
    per split as ``S - 1`` are skipped.

    >>> num_splits(8, 264, 1000)
    29
    """
    if work_items >= 0.8 * slots:
        return 1
    max_splits = min(max_splits, slots, n_kv_blocks)
    eff = {}
    for s in range(1, max_splits + 1):
        if s == 1 or math.ceil(n_kv_blocks / s) != math.ceil(n_kv_blocks / (s - 1)):
            waves = work_items * s / slots
            eff[s] = waves / math.ceil(waves)
    if not eff:
        return 1
    best = max(eff.values())
    return next(s for s in sorted(eff) if eff[s] >= efficiency * best)


# Tuned on the H200 (132 SMs, bf16, D = 128): see benchmarks/NOTES.md.
_MIN_TILES_PER_SPLIT = 2


@functools.lru_cache(maxsize=4096)
def decode_num_splits(batch: int, num_kv_heads: int, t_max: int, block_n: int, num_sms: int) -> int:
    """The split count :func:`cp_attention.flash_decode` uses for ``B * Hkv`` work items over a cache of
    capacity ``t_max`` read in tiles of ``block_n`` tokens on a device with ``num_sms`` SMs.

    The tuned decode tile keeps three K/V stages in flight and fills one SM's shared memory, so the slots
    of :func:`num_splits` are the SMs. It runs one wave (more splits only add combine work) and takes the
    fullest one (FA2 settles for 85% of it, which here would leave up to 15% of the SMs idle for the whole
    kernel); no split gets fewer than two tiles (each split pays a prologue and a state write).

    >>> decode_num_splits(1, 8, 131072, 128, 132), decode_num_splits(4, 8, 32768, 128, 132)
    (16, 4)
    """
    n_blocks = max(1, math.ceil(t_max / block_n))
    work = batch * num_kv_heads
    splits = num_splits(work, num_sms, n_blocks, max_splits=max(1, num_sms // work), efficiency=1.0)
    return max(1, min(splits, n_blocks // _MIN_TILES_PER_SPLIT))
