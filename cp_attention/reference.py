"""Plain-torch decode attention returning an :class:`AttentionState`: the oracle of every test."""
from __future__ import annotations

import math

import torch

from .state import AttentionState

__all__ = ["attention"]


def attention(q, k, v, seq_lens=None, *, sm_scale=None, kv_layout="HND") -> AttentionState:
    """Exact attention of one query per head against a KV cache, in one pass.

    Args:
        q: ``[B, Hq, D]``.
        k, v: ``[B, Hkv, T, D]`` (``kv_layout="HND"``) or ``[B, T, Hkv, D]`` (``"NHD"``); ``Hq % Hkv == 0``
            (query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        seq_lens: ``[B]`` valid lengths (``None``: all ``T``).
        sm_scale: score scale, default ``1 / sqrt(D)``.

    Returns:
        ``AttentionState(o [B, Hq, D], lse [B, Hq])``, natural-log LSE, ``-inf`` (and ``o = 0``) for an
        empty sequence. Computed in float64 when ``q`` is float64 (then ``o`` and ``lse`` are float64),
        else in float32 with ``o`` float32 and ``lse`` float32.

    >>> q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 3, 8)
    >>> attention(q, k, k + 1.0).o[0, 0, 0].item()
    1.0
    """
    if kv_layout == "NHD":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    elif kv_layout != "HND":
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    kk = k.to(ct).repeat_interleave(hq // hkv, dim=1)
    vv = v.to(ct).repeat_interleave(hq // hkv, dim=1)
    if seq_lens is not None:
        # Positions past a sequence's length may hold garbage (NaN, inf): they never enter the result.
        valid = torch.arange(t, device=k.device)[None, :] < seq_lens.to(k.device).long()[:, None]  # [B, T]
        kk = kk.masked_fill(~valid[:, None, :, None], 0.0)
        vv = vv.masked_fill(~valid[:, None, :, None], 0.0)
    s = torch.einsum("bhd,bhtd->bht", q.to(ct), kk) * scale
    if seq_lens is not None:
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse_ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_ref[..., None])
    o = torch.einsum("bht,bhtd->bhd", p, vv)
    return AttentionState(o, lse if ct == torch.float64 else lse.float())
