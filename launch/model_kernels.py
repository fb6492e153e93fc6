"""Triton kernels of the model around attention (``launch/llama.py``), each with the plain-torch code it replaces.

A decode step of a Llama layer at batch 1 is a few large GEMMs and, in eager torch, some forty small kernels
(RMSNorm alone is seven: cast, pow, mean, add, rsqrt, mul, cast, mul). Inside a CUDA graph each small kernel
costs 1.5-4 µs plus a launch gap, over 3 ms of an 8B model's step: as much as the attention of a 100k-token
context. Three kernels take their place, one launch each:

- :func:`rmsnorm`: the residual add (``x += delta``, in place) folded into the RMSNorm that follows it;
- :func:`rope_`: rotary embeddings applied in place to the q and k heads of the fused q/k/v projection;
- :func:`gated_act`: ``act(gate) * up`` of the fused gate/up projection (SwiGLU).

Each follows ``transformers`` operation by operation: every intermediate the torch code rounds to the model
dtype is rounded here too (float32 math in registers), so 16-bit results agree with the torch path up to the
last-bit differences of ``rsqrt``/``exp`` (and of fused multiply-adds in float32). CUDA tensors run the kernels,
CPU tensors run them under ``TRITON_INTERPRET=1`` and the torch code otherwise (:func:`use_triton`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triton import next_power_of_2 as next_pow2


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors run them under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return t.is_cuda or bool(triton.knobs.runtime.interpret)


ACT_BLOCK = 1024  # gate/up columns per program of the gated activation


@triton.jit
def _rmsnorm_kernel(X, DELTA, W, H, n_cols, eps, stride_x, stride_d, stride_h,
                    HAS_DELTA: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the model dtype as torch's x + delta
        delta = tl.load(DELTA + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(X + row * stride_x + cols, x, mask=mask)
    h = x.to(tl.float32)
    y = h * tl.math.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:  # (1 + weight) in float32, one rounding at the end
        out = y * (1.0 + w)
    else:  # weight * y.to(dtype), in the dtype
        out = w * y.to(X.dtype.element_ty).to(tl.float32)
    tl.store(H + row * stride_h + cols, out.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(QKV, COS, SIN, n_cs, stride_row, stride_cs,
                 N_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)[:, None]
    o_d = tl.arange(0, BLOCK_HALF)[None, :]
    m_d = o_d < HALF
    mask = (o_h < N_HEADS) & m_d
    p1 = QKV + row * stride_row + o_h * (2 * HALF) + o_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    p_cs = (row % n_cs) * stride_cs + o_d
    c1 = tl.load(COS + p_cs, mask=m_d, other=0.0).to(tl.float32)
    c2 = tl.load(COS + p_cs + HALF, mask=m_d, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + p_cs, mask=m_d, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + p_cs + HALF, mask=m_d, other=0.0).to(tl.float32)
    dt = QKV.dtype.element_ty
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product rounded, then the sum
    out1 = ((x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)).to(dt)
    out2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(p1, out1, mask=mask)
    tl.store(p1 + HALF, out2, mask=mask)


@triton.jit
def _gated_act_kernel(GU, OUT, n_cols, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu, rounded to the dtype
    tl.store(OUT + row * stride_out + cols, (act * u).to(dt), mask=mask)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t [..., n]`` (unit stride in the last dim) as ``[rows, n]``, without a copy."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
            gemma: bool = False) -> torch.Tensor:
    """RMSNorm of ``x [..., dim]`` (after ``x += delta`` in place, when ``delta`` is given), as transformers:
    normalised in float32, then ``weight * h.to(dtype)`` (Llama) or ``(h * (1 + weight)).to(dtype)`` (Gemma 2).

    Returns a new ``[..., dim]`` tensor in x's dtype; ``x`` holds ``x + delta`` afterwards.
    """
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {tuple(x.shape)}, got {tuple(delta.shape)}")
    if not use_triton(x):
        if delta is not None:
            x.add_(delta)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (1.0 + weight.float())).to(x.dtype) if gemma else weight * h.to(x.dtype)
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    xr, outr = _rows(x, "x"), out.view(-1, x.shape[-1])
    dr = _rows(delta, "delta") if delta is not None else xr
    n = x.shape[-1]
    block = next_pow2(n)
    _rmsnorm_kernel[(xr.shape[0],)](xr, dr, weight, outr, n, eps, xr.stride(0), dr.stride(0), outr.stride(0),
                                    HAS_DELTA=delta is not None, GEMMA=gemma, BLOCK=block,
                                    num_warps=max(1, min(16, block // 512)))
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, head_dim: int) -> None:
    """Rotary embeddings, in place, on the first ``n_heads`` heads of ``qkv [..., C]`` (the q and k heads of
    a fused projection, ``C >= n_heads * head_dim``): ``x * cos + rotate_half(x) * sin`` as transformers.

    ``cos``/``sin [..., head_dim]`` in qkv's dtype, for the trailing dims of ``qkv.shape[:-1]``
    (``[n, D]`` for ``[B, n, C]``: positions shared by the batch; ``[B, D]`` for ``[B, C]``).
    """
    lead = qkv.shape[:-1]
    if cos.shape != sin.shape or cos.shape[-1] != head_dim or cos.shape[:-1] != lead[len(lead) - cos.dim() + 1:]:
        raise ValueError(f"cos/sin must have shape [..., {head_dim}] matching qkv's leading dims {tuple(lead)}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if not use_triton(qkv):
        x = qkv[..., : n_heads * head_dim].unflatten(-1, (n_heads, head_dim))
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        x.copy_(x * c + rotate_half(x) * s)
        return
    if qkv.numel() == 0:
        return
    rows = _rows(qkv, "qkv")
    cs, sn = cos.reshape(-1, head_dim), sin.reshape(-1, head_dim)
    if cs.stride(-1) != 1 or sn.stride() != cs.stride():
        cs, sn = cs.contiguous(), sn.contiguous()
    half = head_dim // 2
    block_h, block_half = next_pow2(n_heads), next_pow2(half)
    _rope_kernel[(rows.shape[0],)](rows, cs, sn, cs.shape[0], rows.stride(0), cs.stride(0), N_HEADS=n_heads,
                                   HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
                                   num_warps=max(1, min(8, block_h * block_half // 512)))


def gated_act(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``act(gate) * up`` of a fused projection ``gate_up [..., 2 I]`` (gate first) -> ``[..., I]`` in its
    dtype: ``act`` is SiLU (SwiGLU, a Triton kernel) or GELU-tanh (Gemma 2, torch ops), rounded to the dtype
    before the product as ``F.silu(gate) * up``."""
    n = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :n], gate_up[..., n:]
    if gelu or not use_triton(gate_up):
        return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    out = gate_up.new_empty(gate_up.shape[:-1] + (n,))
    if out.numel() == 0:
        return out
    rows, outr = _rows(gate_up, "gate_up"), out.view(-1, n)
    _gated_act_kernel[(rows.shape[0], triton.cdiv(n, ACT_BLOCK))](rows, outr, n, rows.stride(0), outr.stride(0),
                                                                  BLOCK=ACT_BLOCK, num_warps=4)
    return out
