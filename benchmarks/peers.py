"""The implementations the benchmarks compare, each as a function that builds everything it needs (its own
copy of the cache, a workspace, a plan) and returns a zero-argument callable that only computes the
output, so that the callable can be timed per call and captured in a CUDA graph. Every tensor the
callable touches is allocated here, once: a graph replays fixed addresses.

Inputs: ``q [B, Hq, D]`` and the dense cache ``k, v [B, Hkv, T, D]`` (HND), full length (no seq_lens).

* :func:`cp_attention`: ``cp_attention.flash_decode``.
* :func:`sdpa_default`: torch SDPA with its default backend selection (cuDNN's decode kernel on the
  H200 image). :func:`sdpa_flash`: SDPA forced to ``SDPBackend.FLASH_ATTENTION``, a second line only,
  never reported as "SDPA".
* :func:`flashinfer_xqa` (bf16 or FP8 e4m3 cache), :func:`flashinfer_fa2`, :func:`flashinfer_cascade`,
  :func:`flashinfer_merge_states`: FlashInfer 0.7.2, imported when called (each kernel JIT-compiles at
  its first call, 10-15 s: build a peer once per shape, outside any timing).
* :func:`torch_merge_states`: the ⊕ of N states in plain torch ops.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cp_attention import flash_decode, heuristics, lse_to_base2, quantize_kv
from cp_attention.state import _merge_states_torch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended workspace size


def cp_attention(q, k, v):
    return lambda: flash_decode(q, k, v)


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (what the library's plans count)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def cp_splits(q, k) -> int:
    """The split count flash_decode uses for ``q``, ``k``."""
    b, hkv, t, d = k.shape
    return heuristics.decode_plan(b, hkv, t, d, q.dtype, sm_count(q.device)).num_splits


def cp_attention_fp8(q, k, v, *, dtype=torch.float8_e4m3fn, per_head: bool = False):
    """cp_attention.flash_decode on an FP8 copy of the cache (``cp_attention.quantize_kv`` amax scales,
    per tensor by default as XQA's), dequantised in the kernel."""
    k8, v8, k_scale, v_scale = quantize_kv(k, v, dtype, per_head=per_head)
    return lambda: flash_decode(q, k8, v8, k_scale=k_scale, v_scale=v_scale)


def cp_attention_paged(q, k, v, *, page_size: int = 16, fp8: bool = False):
    """cp_attention.flash_decode on a paged NHD copy of the cache (the pages of :func:`paged`), in e4m3 with
    per-tensor scales with ``fp8`` (:func:`cache_form`)."""
    kp, vp, kwargs = cache_form(k, v, fp8=fp8, page_size=page_size)
    return lambda: flash_decode(q, kp, vp, **kwargs)


def cache_form(k, v, *, fp8: bool = False, page_size: int | None = None, nhd: bool = False):
    """``(k, v, kwargs)`` for flash_decode: the dense HND cache ``[B, Hkv, T, D]`` as an FP8 e4m3 copy
    (``quantize_kv``, per-tensor scales) and/or NHD page pools of ``page_size`` slots, scattered
    (:func:`paged`; ``kwargs`` then hold the block table and ``seq_lens`` of T), or a dense NHD copy
    (``nhd``). The originals are not kept."""
    b, _, t, _ = k.shape
    kwargs = {}
    if fp8:
        k, v, k_scale, v_scale = quantize_kv(k, v)
        kwargs.update(k_scale=k_scale, v_scale=v_scale)
    if page_size:
        k, v = paged(k, page_size), paged(v, page_size)
        kwargs.update(seq_lens=torch.full((b,), t, dtype=torch.int32, device=k.device),
                      block_table=page_table(b, t // page_size, k.device), kv_layout="NHD")
    elif nhd:
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        kwargs["kv_layout"] = "NHD"
    return k, v, kwargs


def sdpa_default(q, k, v):
    """``scaled_dot_product_attention(q [B, Hq, 1, D], k, v, enable_gqa=True)``, no backend forced; the
    output is ``[B, Hq, 1, D]``."""
    q4 = q.unsqueeze(2)
    return lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def sdpa_flash(q, k, v):
    """:func:`sdpa_default` under ``sdpa_kernel([SDPBackend.FLASH_ATTENTION])``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4 = q.unsqueeze(2)

    def run():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    return run


def paged(x, page_size: int, dtype=None, scale: float = 1.0):
    """Dense HND ``x [N, Hkv, T, D]`` -> NHD pages ``[N * T / page_size, page_size, Hkv, D]`` holding
    ``x / scale`` in ``dtype`` (default ``x.dtype``), scattered over the pool as a serving cache's allocator
    leaves them: sequence ``i``'s pages are row ``i`` of :func:`page_table`. Copied one sequence at a time (the
    only temporary is one sequence in float32 when ``scale`` is given), as bytes for one-byte dtypes (CUDA has
    no FP8 ``index_copy_``)."""
    n, hkv, t, d = x.shape
    if t % page_size:
        raise ValueError(f"T = {t} is not a multiple of page_size = {page_size}")
    per_seq = t // page_size
    pages = torch.empty(n * per_seq, page_size, hkv, d, dtype=dtype or x.dtype, device=x.device)
    order = page_order(n * per_seq, x.device).view(n, per_seq)
    byte = pages.element_size() == 1
    into = pages.view(torch.uint8) if byte else pages
    for i in range(n):
        src = x[i] if scale == 1.0 else x[i].float() / scale
        src = src.reshape(hkv, per_seq, page_size, d).permute(1, 2, 0, 3).to(pages.dtype)
        into.index_copy_(0, order[i], src.view(torch.uint8) if byte else src)
    return pages


def page_order(n_pages: int, device) -> torch.Tensor:
    """Where :func:`paged` puts the pages of a pool of ``n_pages``: a random permutation (int64), seeded by
    ``n_pages`` so that the pool and its :func:`page_table` agree."""
    g = torch.Generator().manual_seed(n_pages)
    return torch.randperm(n_pages, generator=g).to(device)


def fp8_scale(x) -> float:
    """Per-tensor e4m3 scale: max |x| / 448 (``aminmax`` reads ``x`` without a temporary)."""
    lo, hi = x.aminmax()
    amax = max(-lo.item(), hi.item())
    return amax / torch.finfo(torch.float8_e4m3fn).max if amax > 0 else 1.0


PAGE_ORDER = "scattered"  # recorded in the JSON of every benchmark with paged caches (benchmarks/tables.py)


def page_table(b: int, pages_per_seq: int, device):
    """``[B, pages_per_seq]`` int32: the pages of sequence ``b`` in the pool :func:`paged` builds (a random
    permutation of the pool, as in a serving cache)."""
    return page_order(b * pages_per_seq, device).view(b, pages_per_seq).to(torch.int32)


def flashinfer_xqa(q, k, v, *, page_size: int = 64, fp8: bool = False):
    """FlashInfer's XQA decode kernel on a paged NHD copy of the cache (bf16, or e4m3 with ``fp8=True``).

    ``flashinfer.decode.trtllm_batch_decode_with_kv_cache(query, kv_cache, workspace_buffer, block_tables,
    seq_lens, max_seq_len, bmm1_scale, bmm2_scale, out=, kv_layout=, backend="xqa")`` (0.7.2):

    * ``query [B, Hq, D]`` (one token per request); output ``[B, Hq, D]`` in q's dtype (``out`` given here).
      Draft rows, ``q [B, Q, Hq, D]``: ``query [B * Q, Hq, D]`` with ``q_len_per_req=Q`` and ``mask [B, Q,
      2 * ceil(Q / 32)]`` uint16, bit ``j`` of row ``i`` set when row ``i`` sees draft ``j`` (``j <= i``: the
      causal rule; the keys before the drafts are seen by every row). XQA's speculative path requires it.
    * ``kv_cache``: a tuple ``(k_pages, v_pages)``, each ``[num_pages, page_size, Hkv, D]`` for
      ``kv_layout="NHD"`` (the function's default layout is HND); page_size in {16, 32, 64, 128}.
    * ``workspace_buffer``: uint8, zeroed before its first use: XQA takes 8 MB of semaphores from its
      front (the kernel resets them) and uses the rest as scratch for its split-sequence partials.
    * ``block_tables [B, pages_per_seq]`` int32; ``seq_lens [B]`` read as uint32 (int32 here); on the XQA
      path ``max_seq_len`` is not used (XQA takes ``pages_per_seq * page_size``).
    * ``bmm1_scale``: the whole score scale, ``k_scale / sqrt(D)``; ``bmm2_scale``: ``v_scale``. XQA
      turns them into ``q_scale = bmm1_scale * sqrt(D) / bmm2_scale`` and ``kv_scale = bmm2_scale``.
    * FP8: ``float8_e4m3fn`` pages with per-tensor scales (``x / scale`` stored, :func:`fp8_scale`); q
      stays bf16. The comparison with cp_attention's bf16 output then includes the quantization error.

    CUDA graphs: every argument is a fixed tensor built here and the call has no host sync.
    """
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    b, hkv, t, d = k.shape
    q_rows = q.shape[1] if q.dim() == 4 else 1
    shape = q.shape
    q = q.reshape(b * q_rows, *q.shape[-2:])
    k_scale = fp8_scale(k) if fp8 else 1.0
    v_scale = fp8_scale(v) if fp8 else 1.0
    dtype = torch.float8_e4m3fn if fp8 else k.dtype
    kp, vp = paged(k, page_size, dtype, k_scale), paged(v, page_size, dtype, v_scale)
    block_tables = page_table(b, t // page_size, q.device)
    seq_lens = torch.full((b,), t, dtype=torch.int32, device=q.device)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    out = torch.empty_like(q)
    bmm1, bmm2 = k_scale / math.sqrt(d), v_scale
    spec = {}
    if q_rows > 1:
        words = (q_rows + 31) // 32
        bits = torch.tril(torch.ones(q_rows, 32 * words, dtype=torch.int64)) << torch.arange(32 * words) % 16
        mask = bits.view(q_rows, 2 * words, 16).sum(-1).to(torch.int32).to(torch.uint16)
        spec = {"q_len_per_req": q_rows, "mask": mask.expand(b, -1, -1).contiguous().to(q.device)}
    return lambda: trtllm_batch_decode_with_kv_cache(
        q, (kp, vp), workspace, block_tables, seq_lens, t, bmm1_scale=bmm1, bmm2_scale=bmm2, out=out,
        kv_layout="NHD", backend="xqa", **spec).view(shape)


def flashinfer_fa2(q, k, v, *, page_size: int = 16):
    """FlashInfer's FA2 paged decode on tensor cores, on a paged NHD copy of the cache.

    ``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
    paged_kv_indptr_buffer=, paged_kv_indices_buffer=, paged_kv_last_page_len_buffer=, backend="fa2")``,
    then ``plan(indptr [B+1], indices [num_pages], last_page_len [B], Hq, Hkv, D, page_size,
    q_data_type=, kv_data_type=)`` (int32 page metadata; the score scale defaults to 1 / sqrt(D)) once,
    outside timing, and ``run(q [B, Hq, D], (k_pages, v_pages), out=)`` per call.

    CUDA graphs (FlashInfer's rules): ``use_cuda_graph=True`` needs the three page-metadata buffers at
    construction (plan copies into them), a fixed batch size for the wrapper's lifetime, and plan() called
    outside the graph. ``backend="fa2"`` is explicit (``"auto"`` would pick it here too: bf16, no block_tables).

    ``q [B, Q, Hq, D]`` (``Q`` draft rows per request): ``plan(..., q_len_per_req=Q)`` (bottom-right causal
    within each request's block) and ``run`` on the rows flattened to ``[B * Q, Hq, D]``.
    """
    import flashinfer

    b, hkv, t, d = k.shape
    hq = q.shape[-2]
    q_rows = q.shape[1] if q.dim() == 4 else 1
    shape = q.shape
    q = q.reshape(b * q_rows, hq, d)
    kp, vp = paged(k, page_size), paged(v, page_size)
    per_seq = t // page_size
    indptr = torch.arange(b + 1, dtype=torch.int32, device=q.device) * per_seq
    indices = page_table(b, per_seq, q.device).flatten()
    last = torch.full((b,), page_size, dtype=torch.int32, device=q.device)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
        paged_kv_indices_buffer=torch.empty_like(indices), paged_kv_last_page_len_buffer=torch.empty_like(last),
        backend="fa2")
    wrapper.plan(indptr, indices, last, hq, hkv, d, page_size, q_data_type=q.dtype, kv_data_type=k.dtype,
                 **({"q_len_per_req": q_rows} if q_rows > 1 else {}))
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, (kp, vp), out=out).view(shape)


def flashinfer_cascade(q, prefix_k, prefix_v, suffix_k, suffix_v, *, page_size: int = 16):
    """FlashInfer's two-level ``MultiLevelCascadeAttentionWrapper`` (0.7.2, same API as 0.5.0): level 0 is
    one shared prefix ``[1, Hkv, P, D]`` read by all B queries, level 1 each request's own suffix
    ``[B, Hkv, S, D]``; both live in one paged NHD cache.

    ``MultiLevelCascadeAttentionWrapper(2, workspace, "NHD", use_cuda_graph=True, qo_indptr_buf_arr=,
    paged_kv_indptr_buf_arr=, paged_kv_indices_buf_arr=, paged_kv_last_page_len_buf_arr=)`` (one fixed
    buffer per level for CUDA graphs), ``plan(qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
    paged_kv_last_page_len, Hq, Hkv, D, page_size, q_data_type=, kv_data_type=)`` once, ``run(q, (k, v))``
    per call: one prefill-kernel launch per level, then ``merge_state_in_place``.
    """
    import flashinfer

    b, hkv, s, d = suffix_k.shape
    hq, dev = q.shape[1], q.device
    n_pp, n_sp = prefix_k.shape[2] // page_size, s // page_size
    kc = torch.cat([paged(prefix_k, page_size), paged(suffix_k, page_size)])
    vc = torch.cat([paged(prefix_v, page_size), paged(suffix_v, page_size)])

    def i32(*values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    ar = torch.arange(b + 1, dtype=torch.int32, device=dev)
    qo = [i32(0, b), ar]
    indptr = [i32(0, n_pp), ar * n_sp]
    indices = [page_table(1, n_pp, dev).flatten(), n_pp + page_table(b, n_sp, dev).flatten()]
    last = [i32(page_size), torch.full((b,), page_size, dtype=torch.int32, device=dev)]
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(
        2, workspace, "NHD", use_cuda_graph=True, qo_indptr_buf_arr=[torch.empty_like(x) for x in qo],
        paged_kv_indptr_buf_arr=[torch.empty_like(x) for x in indptr],
        paged_kv_indices_buf_arr=[torch.empty_like(x) for x in indices],
        paged_kv_last_page_len_buf_arr=[torch.empty_like(x) for x in last])
    wrapper.plan(qo, indptr, indices, last, hq, hkv, d, page_size, q_data_type=q.dtype, kv_data_type=suffix_k.dtype)
    return lambda: wrapper.run(q, (kc, vc))


def torch_merge_states(o, lse):
    """⊕ over dim 0 of ``o [N, ..., D]``, ``lse [N, ...]`` (natural log) in plain torch (float32 math): the
    library's own torch path (:mod:`cp_attention.state`); returns ``(o, lse)``, ``o`` in ``o``'s dtype. The
    callable is its own check value."""
    return lambda: _merge_states_torch(o, lse)


def flashinfer_merge_states(o, lse):
    """``flashinfer.merge_states(v [M, N, H, D], s [M, N, H])`` on a copy of ``o [N, M, H, D]`` moved to
    FlashInfer's layout, with the LSE in base 2 (FlashInfer's convention); returns ``(o, lse2)``. Its
    kernel dispatches float16/bfloat16 ``v`` only (float32 fails to dispatch on 0.7.2)."""
    import flashinfer

    if o.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"FlashInfer's merge_states takes float16/bfloat16 o, got {o.dtype}")
    v = o.movedim(0, 1).contiguous()
    s = lse_to_base2(lse).movedim(0, 1).contiguous()
    return lambda: flashinfer.merge_states(v, s)
