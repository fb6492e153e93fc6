"""Plain-torch decode attention returning an :class:`AttentionState`: the oracle of every test, and the
CPU torch path of :func:`cp_attention.flash_decode`."""
from __future__ import annotations

import math

import torch

from .state import AttentionState

__all__ = ["attention", "paged_to_dense"]


def attention(q, k, v, seq_lens=None, *, sm_scale=None, kv_layout="HND", row_limits=None, window_left=None,
              logit_softcap=None, sinks=None) -> AttentionState:
    """Exact attention of one or a few query rows per head against a dense KV cache, in one pass.

    Args:
        q: ``[B, Hq, D]``, or ``[B, Q, Hq, D]``: ``Q`` new tokens per request, the last ``Q`` keys of the
            cache, so row ``i`` sees the positions ``p < seq_len - Q + 1 + i``.
        k, v: ``[B, Hkv, T, D]`` (``kv_layout="HND"``) or ``[B, T, Hkv, D]`` (``"NHD"``); ``Hq % Hkv == 0``
            (query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        seq_lens: ``[B]`` valid lengths (``None``: all ``T``). Positions past them never enter the result,
            whatever they hold (NaN included).
        sm_scale: score scale, default ``1 / sqrt(D)``.
        row_limits: ``[B, Q]``: row ``i`` of request ``b`` sees the positions ``p < row_limits[b, i]``
            (and ``p < seq_len``) instead of the causal rule; or ``[B, Q, 2]``: the positions
            ``row_limits[b, i, 0] <= p < row_limits[b, i, 1]``.
        window_left: row ``i`` (at position ``seq_len - Q + i``) sees only positions ``>= seq_len - Q + i -
            window_left`` (with ``[B, Q]`` row limits ``L``: ``>= L - 1 - window_left``; refused with ``[B, Q, 2]``).
        logit_softcap: scores ``c * tanh(s / c)``.
        sinks: ``[Hq]``: one extra logit per query head in the softmax denominator, with no value.

    Returns:
        ``AttentionState(o, lse)`` with ``o`` of q's shape and ``lse`` of ``q.shape[:-1]``, natural log;
        ``-inf`` (and ``o = 0``) for a row that sees no key. Computed in float64 when ``q`` is float64
        (then ``o`` and ``lse`` are float64), else in float32 with ``o`` float32 and ``lse`` float32.

    >>> q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 3, 8)
    >>> round(attention(q, k, k + 1.0).o[0, 0, 0].item(), 6)
    1.0
    """
    if kv_layout == "NHD":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    elif kv_layout != "HND":
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    multi = q.dim() == 4
    q4 = q if multi else q.unsqueeze(1)  # [B, Q, Hq, D]
    b, n_q, hq, d = q4.shape
    hkv, t = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    lens = (torch.full((b,), t, device=k.device) if seq_lens is None else seq_lens.to(k.device)).long()
    pos = torch.arange(t, device=k.device)
    valid = pos[None, :] < lens[:, None]  # [B, T]: positions holding keys
    lows = None
    if row_limits is not None and row_limits.dim() == 3:
        if window_left is not None:
            raise ValueError("window_left must be None with row_limits [B, Q, 2] (the limits fix both ends)")
        lows, limits = row_limits[..., 0].to(k.device).long(), row_limits[..., 1].to(k.device).long()
    elif row_limits is not None:
        limits = row_limits.to(k.device).long()
    else:
        limits = lens[:, None] - n_q + 1 + torch.arange(n_q, device=k.device)[None, :]  # [B, Q]
    if window_left is not None:
        lows = limits - 1 - window_left
    visible = valid[:, None, :] & (pos[None, None, :] < limits[:, :, None])  # [B, Q, T]
    if lows is not None:
        visible &= pos[None, None, :] >= lows[:, :, None]
    # Garbage (NaN, inf) past a sequence's length never enters the result.
    kk = k.to(ct).masked_fill(~valid[:, None, :, None], 0.0)
    vv = v.to(ct).masked_fill(~valid[:, None, :, None], 0.0)
    # Query heads in groups of Hq // Hkv per KV head (head h reads KV head h // group), so K/V are never
    # repeated per query head: the float64 oracle of a long cache stays a few copies of the cache in size.
    group = hq // hkv
    qg = q4.to(ct).reshape(b, n_q, hkv, group, d)
    s = torch.einsum("bqhgd,bhtd->bqhgt", qg, kk).reshape(b, n_q, hq, t) * scale
    if logit_softcap is not None:
        s = logit_softcap * torch.tanh(s / logit_softcap)
    s = s.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Q, Hq]
    lse_ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_ref[..., None])
    o = torch.einsum("bqhgt,bhtd->bqhgd", p.reshape(b, n_q, hkv, group, t), vv).reshape(b, n_q, hq, d)
    if sinks is not None:  # the sink joins the denominator once, with no value
        sink = sinks.to(device=k.device, dtype=ct)[None, None, :].expand_as(lse)
        # o * e^lse / (e^lse + e^sink); a row with no key keeps o = 0 and a +inf sink gives o = 0, lse = +inf
        total = torch.logaddexp(lse, sink)
        o = o * torch.where(torch.isinf(total), torch.zeros_like(lse), torch.exp(lse - total))[..., None]
        lse = total
    if not multi:
        o, lse = o[:, 0], lse[:, 0]
    return AttentionState(o, lse if ct == torch.float64 else lse.float())


def paged_to_dense(pool, block_table, kv_layout="HND") -> torch.Tensor:
    """The dense cache of a page pool: ``[B, Hkv, max_pages * page_size, D]`` (``"HND"``) or
    ``[B, max_pages * page_size, Hkv, D]`` (``"NHD"``), request ``b``'s position ``p`` taken from page
    ``block_table[b, p // page_size]``, slot ``p % page_size``. Pool layouts as in
    :func:`cp_attention.flash_decode`; entries of ``block_table`` outside the pool are clamped into it (they
    can only be read past a sequence's length).

    >>> pool = torch.arange(4.0).view(2, 1, 2, 1)  # 2 pages of 2 slots, 1 head
    >>> paged_to_dense(pool, torch.tensor([[1, 0]]))[0, 0, :, 0].tolist()
    [2.0, 3.0, 0.0, 1.0]
    """
    if kv_layout == "NHD":
        pool = pool.transpose(1, 2)  # [P, Hkv, page, D]
    n_pages, hkv, page, d = pool.shape
    bt = block_table.long().clamp(0, n_pages - 1)
    b, max_pages = bt.shape
    dense = pool[bt]  # [B, max_pages, Hkv, page, D]
    dense = dense.permute(0, 2, 1, 3, 4).reshape(b, hkv, max_pages * page, d)
    return dense if kv_layout == "HND" else dense.transpose(1, 2)
