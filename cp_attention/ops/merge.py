"""Triton kernel for ``merge_states``: ⊕ over the leading dim of ``N`` attention states."""
import torch
import triton
import triton.language as tl

from .._dispatch import next_pow2
from .. import state
from ._launch import launch
from ._state import LN2, merge_strided


@triton.jit
def _merge_states_kernel(
    O, LSE, O_OUT, LSE_OUT,
    N,
    stride_on, stride_om, stride_ln, stride_lm, stride_oom,
    LSE_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    b_o, b_lse2 = merge_strided(LSE + i_m * stride_lm, O + i_m * stride_om, stride_ln, stride_on, N, o_d, m_d,
                                LSE_SCALE, BLOCK_S, BLOCK_D, "")
    tl.store(O_OUT + i_m * stride_oom + o_d[None, :], b_o.to(O_OUT.dtype.element_ty), mask=m_d[None, :])
    tl.store(LSE_OUT + i_m + tl.arange(0, 1), b_lse2 * LN2)


def merge_states_into(o: torch.Tensor, lse: torch.Tensor, o_out: torch.Tensor, lse_out: torch.Tensor,
                      *, lse_base2: bool = False) -> None:
    """Launch the merge kernel: ``o [N, M, D]`` (unit stride in D), ``lse [N, M]`` float32 (natural log, or
    base 2 with ``lse_base2``) into ``o_out [M, D]`` (any float dtype, unit stride in D) and ``lse_out [M]``
    float32 natural log, contiguous. One program per row; inputs are validated by
    :func:`cp_attention.state.merge_states`.
    """
    n, m, d = o.shape
    block_d = next_pow2(d)
    block_s = min(32, next_pow2(n))
    if m == 0:
        return
    launch(
        _merge_states_kernel, (m,),
        (o, lse, o_out, lse_out, n,
         o.stride(0), o.stride(1), lse.stride(0), lse.stride(1), o_out.stride(0)),
        dict(LSE_SCALE=1.0 if lse_base2 else state.LOG2E, HEAD_DIM=d, BLOCK_S=block_s, BLOCK_D=block_d),
        num_warps=4 if block_s * block_d >= 2048 else 1,
    )


# A realistic sm_90 compile of this file's kernel, checked on the CPU by tests/test_aot.py.
AOT_SPECS = [
    {
        "kernel": _merge_states_kernel,
        "signature": {"O": "*bf16", "LSE": "*fp32", "O_OUT": "*bf16", "LSE_OUT": "*fp32"},
        "constexprs": {"LSE_SCALE": state.LOG2E, "HEAD_DIM": 128, "BLOCK_S": 32, "BLOCK_D": 128},
        "options": {"num_warps": 4},
    }
]
