"""Triton kernel for ``merge_states``: ⊕ over the leading dim of ``N`` attention states."""
import torch
import triton
import triton.language as tl

from ._state import LN2, LOG2E, add_state, finalize


@triton.jit
def _merge_states_kernel(
    O, LSE, O_OUT, LSE_OUT,
    N, M,
    stride_on, stride_om, stride_ln, stride_lm, stride_oom,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < M
    m_o = m_m[:, None] & (o_d < HEAD_DIM)[None, :]
    o_m64 = o_m.to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    p_lse = LSE + o_m64 * stride_lm
    p_o = O + o_m64[:, None] * stride_om + o_d[None, :]
    for _ in range(N):
        b_lse2 = tl.load(p_lse, mask=m_m, other=float("-inf")) * LOG2E
        b_o = tl.load(p_o, mask=m_o, other=0.0).to(tl.float32)
        m_i, l_i, acc = add_state(m_i, l_i, acc, b_lse2, b_o)
        p_lse += stride_ln
        p_o += stride_on
    b_o, b_lse2 = finalize(m_i, l_i, acc)
    tl.store(O_OUT + o_m64[:, None] * stride_oom + o_d[None, :], b_o.to(O_OUT.dtype.element_ty), mask=m_o)
    tl.store(LSE_OUT + o_m, b_lse2 * LN2, mask=m_m)


def merge_states_into(o: torch.Tensor, lse: torch.Tensor, o_out: torch.Tensor, lse_out: torch.Tensor) -> None:
    """Launch the merge kernel: ``o [N, M, D]`` (unit stride in D), ``lse [N, M]`` float32 (natural log)
    into ``o_out [M, D]`` (any float dtype, unit stride in D) and ``lse_out [M]`` float32, contiguous.

    Inputs are validated by :func:`cp_attention.state.merge_states`; this is the thin launcher.
    """
    n, m, d = o.shape
    block_d = triton.next_power_of_2(d)
    # Enough programs to cover the SMs even for a few thousand rows; 16-byte loads along D.
    block_m = 4 if m <= 4096 else 8
    grid = (triton.cdiv(m, block_m),)
    _merge_states_kernel[grid](
        o, lse, o_out, lse_out, n, m,
        o.stride(0), o.stride(1), lse.stride(0), lse.stride(1), o_out.stride(0),
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4,
    )


# A realistic sm_90 compile of this file's kernel, checked on the CPU by tests/test_aot.py.
AOT_SPECS = [
    {
        "kernel": _merge_states_kernel,
        "signature": {"O": "*bf16", "LSE": "*fp32", "O_OUT": "*bf16", "LSE_OUT": "*fp32"},
        "constexprs": {"HEAD_DIM": 128, "BLOCK_M": 4, "BLOCK_D": 128},
        "options": {"num_warps": 4},
    }
]
