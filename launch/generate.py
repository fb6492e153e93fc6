"""Greedy generation with a Llama-family model whose KV cache is sharded over the ranks (context parallelism).

GPU (NCCL, one GPU per process; the decode step is captured in one CUDA graph)::

    torchrun --nproc-per-node=2 launch/generate.py --model DIR --prompts PROMPTS.json --new-tokens 64 \\
        --output OUT.json

CPU (gloo; the Triton kernels run under the interpreter with ``TRITON_INTERPRET=1``, else the torch path)::

    torchrun --nproc-per-node=2 launch/generate.py --device cpu --model DIR --prompts PROMPTS.json --new-tokens 8

``DIR`` is a Hugging Face checkpoint (``config.json`` + ``*.safetensors``) of a Llama, Mistral, Qwen2 or Gemma
2 model (``launch/llama.py``; any model cp_attention.hf supports with ``--backend transformers``, below);
``--random-config llama3-8b`` builds seeded random weights instead.
``PROMPTS.json`` is a JSON list of prompts, each a list of token ids or a string (ragged lengths); strings,
and ``--prompt TEXT`` (repeatable) instead of a file, are tokenised with the checkpoint's tokenizer
(``AutoTokenizer.from_pretrained(DIR)``) and the decoded new text is written to the output (``"text"``). All
prompts decode as one batch, ``N`` new tokens each, greedily (no stop token).

Every rank holds the weights. With ``--backend native`` (the default) the model is ``launch/llama.py``'s and
the KV cache of every layer is a :class:`cp_attention.distributed.CPKVCache` (position ``p`` on rank ``p %
W``); each decode step appends the new token's K/V and runs ``CPKVCache.decode`` (⊕ across the ranks, bitwise
identical on every rank, so every rank picks the same tokens: checked at the end). ``--backend transformers``
runs the unmodified transformers model instead (``AutoModelForCausalLM.from_pretrained(DIR,
attn_implementation="cp_attention")``: any architecture :mod:`cp_attention.hf` supports; ``--random-config``
builds the transformers Llama config of those shapes with the native backend's random weights) through its
own ``generate()`` with a :class:`cp_attention.hf.CPCache` preallocated for the run, the prompts left-padded
into one batch; ``--compile`` lets transformers compile the decode step (``torch.compile``, CUDA graphs);
``--decode-ahead`` runs it through ``custom_generate=cp_attention.hf.decode_ahead`` (the host one step ahead
of the GPU). Both backends give the same tokens on the same model. Rank 0 writes ``OUT.json``: ``{"tokens": [[new ids of
prompt 0], ...], "text": [...] (text prompts), "backend": ..., "prefill_s": ..., "decode_step_s": [...],
"decode_tokens_per_s": ..., ...}``; the transformers backend times each step between two calls of a logits
processor (the first waits for the prefill) and leaves its first steps (kernel compilation; with ``--compile``, the graph's compilation
and capture) out of the rate, as ``decode_warmup_steps`` says.

``--fill-context T`` replaces the prompts' prefill by ``T`` positions of random K/V per sequence (each rank
generates only its shard; with ``--backend transformers``, into every layer of the CPCache), then decodes
from each prompt's last token: for timing long contexts only, the tokens mean nothing (the JSON says so).
Several values (``--fill-context 32768 131072``) run one after the other with the same weights; ``OUT.json``
then holds ``{"runs": [one result per context]}``. Bad checkpoints (unsupported architecture, head dim outside
the kernels' range, missing tensor) fail with a message before any process group is formed.

Note [Context-parallel prefill]
-------------------------------
The prompt is prefilled where its KV cache will live. Prompts are right-padded to ``n * W`` tokens (``n =
ceil(max_len / W)``) and rank ``r`` takes the positions ``p = r + W * i``, ``i < n``: exactly the positions
that ``CPKVCache``'s interleaved placement keeps on rank ``r``, at local slot ``i``. Each rank runs the whole
layer stack (embeddings, projections, RoPE, MLP) for its positions only -- ``1 / W`` of the prompt's tokens
-- and writes each layer's K/V straight into its cache shard; no rank computes K/V it does not keep.

Attention needs every earlier key. Per layer, one all-gather brings every rank's K/V shard (``[W, 2, B, n,
Hkv, D]``) to every rank ("pass-KV"); rank ``r`` then computes, for each source shard ``s``, the attention
state ``(o_s, lse_s)`` (natural-log LSE) of its queries over that shard's keys, and merges the ``W`` states
with ⊕ (:func:`cp_attention.merge_states`, in rank order). The keys of the shards are disjoint and cover the
sequence, so the merge is the exact causal attention.

- The causal rule in local indices is simple: query ``i`` of rank ``r`` (position ``r + W i``) sees key
  ``j`` of shard ``s`` (position ``s + W j``) iff ``j <= i`` when ``s <= r`` and ``j < i`` when ``s > r``.
  Both are square causal attentions (the second over queries ``1..n-1`` and keys ``0..n-2``, with query 0
  empty), so a FlashAttention kernel that returns its LSE computes every state:
  ``aten._scaled_dot_product_flash_attention`` on CUDA (fp16/bf16; its ``logsumexp`` is FlashAttention-2's
  ``softmax_lse``, natural log, ``[B, H, L]`` float32) and ``aten._scaled_dot_product_flash_attention_for_cpu``
  on the CPU (natural log as well; checked against ``torch.logsumexp`` in the tests). Sliding windows,
  soft-capped scores (Gemma 2) and float32 on CUDA use a plain-torch masked attention over the keys a
  query chunk can see.
- Load balance: with interleaved positions every rank holds an equal share of early and late queries, so
  the causal work is balanced without reordering (Striped Attention, Brandon et al. 2023); the placement is
  the decode cache's, so nothing moves between prefill and decode.
- All-gather rather than a ring: one collective per layer instead of ``W - 1`` send/recv rounds, no
  overlap machinery, the same bytes per rank (each receives the ``W - 1`` other shards either way) and a
  fixed merge order. A ring overlaps the transfers with attention, but at long prompts the gather is small
  next to the attention it feeds (128k tokens of Llama-3-8B: 256 MiB per layer into each of 2 ranks, about
  a millisecond over NVLink, against about 0.1 s of attention per layer and rank), so the overlap would
  save little; the gathered K/V of one layer (``W`` times a shard) is transient.
- Pass-KV rather than pass-Q (gathering queries, returning states): with grouped-query attention a
  token's K and V (``2 * Hkv * D``) are smaller than its query plus a float32 state (``Hq * (2D + 1)``).
- Ragged prompts: right-padding keeps position = index for every sequence, so one position vector serves
  the batch. The padding positions ``p >= len_b`` get K/V too, but every real query comes before them (the
  causal rule hides them), the cache never reads past its lengths, and decode appends overwrite them.
- The last prompt position of sequence ``b`` lives on rank ``(len_b - 1) % W``; its final hidden state is
  all-gathered, and every rank computes the same logits from the same bits, hence the same first token.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

# NCCL collectives captured in a CUDA graph: no NVLink multicast (NVLS) and no multicast symmetric memory.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cp_attention import AttentionState, merge_states  # noqa: E402
from cp_attention.distributed import CPKVCache, init_distributed  # noqa: E402
from cp_attention.reference import attention  # noqa: E402
from launch.llama import CONFIGS, CheckpointError, inspect_checkpoint, load_checkpoint, random_model  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARMUP_STEPS = 2  # eager decode steps (on a side stream) before the CUDA graph is captured
QUERY_CHUNK = 512  # queries per block of the plain-torch prefill attention


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    src.add_argument("--random-config", choices=sorted(CONFIGS), help="seeded random weights of these shapes")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompts", type=Path, help="JSON list of prompts, each a list of token ids or a string")
    prompts.add_argument("--prompt", action="append", metavar="TEXT", help="a text prompt (repeatable)")
    p.add_argument("--backend", choices=("native", "transformers"), default="native",
                   help="native: launch/llama.py's model; transformers: the transformers model with CPCache")
    p.add_argument("--compile", action="store_true",
                   help="transformers backend: transformers' compiled generation (preallocated CPCache, CUDA graphs)")
    p.add_argument("--decode-ahead", action="store_true",
                   help="transformers backend: generate(custom_generate=cp_attention.hf.decode_ahead)")
    p.add_argument("--new-tokens", type=int, required=True, help="tokens generated per prompt (greedy)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--output", type=Path, help="JSON written by rank 0 (default: printed)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the decode step in one CUDA graph (default: on for cuda)")
    p.add_argument("--fill-context", type=int, nargs="+", metavar="T",
                   help="timing only: T positions of random K/V per sequence instead of the prompts' prefill "
                        "(several: one run each)")
    p.add_argument("--logits", action="store_true", help="also write the prefill's last-position logits")
    p.add_argument("--prefill-runs", type=int, default=1, metavar="R",
                   help="run the prefill R times (the same result; later runs time it without one-time set-up)")
    p.add_argument("--profile-steps", type=int, default=0, metavar="P",
                   help="profile the last P decode steps (torch.profiler); kernel times per step in the JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-config weights and --fill-context K/V")
    p.add_argument("--timeout-s", type=int, default=1800, help="process-group timeout")
    args = p.parse_args(argv)
    if args.new_tokens < 1:
        p.error("--new-tokens must be >= 1")
    if args.fill_context is not None and min(args.fill_context) < 1:
        p.error("--fill-context must be >= 1")
    if args.backend == "transformers":
        if args.cuda_graph:
            p.error("--cuda-graph is the native backend's: the transformers backend captures with --compile")
        if args.prefill_runs != 1 or args.profile_steps:
            p.error("--prefill-runs and --profile-steps are the native backend's")
        args.cuda_graph = False
    elif args.compile or args.decode_ahead:
        p.error("--compile and --decode-ahead are the transformers backend's (the native backend captures with "
                "--cuda-graph)")
    if args.compile and args.device != "cuda":
        p.error("--compile needs --device cuda (transformers compiles generation on CUDA devices)")
    if args.cuda_graph is None:
        args.cuda_graph = args.device == "cuda"
    if args.cuda_graph and args.device != "cuda":
        p.error("--cuda-graph needs --device cuda")
    steps = args.new_tokens - (args.fill_context is None)  # the prefill picks the first token
    if not 0 <= args.profile_steps <= steps:
        p.error(f"--profile-steps must lie in [0, {steps}] (the decode steps)")
    if args.prefill_runs < 1:
        p.error("--prefill-runs must be >= 1")
    args.dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    return args


def load_prompts(path: Path | None, vocab_size: int, texts=None, model_dir: Path | None = None):
    """``(prompts, tokenizer)``: the prompts of ``path`` (a non-empty JSON list of non-empty lists of token ids in
    ``[0, vocab_size)``, or of strings) or the strings ``texts``, as lists of token ids; strings are tokenised with
    ``model_dir``'s tokenizer (returned, else ``None``)."""
    where = "--prompt" if path is None else str(path)
    prompts = texts if path is None else json.loads(path.read_text())
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"{where} must hold a non-empty JSON list of prompts")
    tokenizer = None
    if all(isinstance(p, str) for p in prompts):
        if model_dir is None:
            raise ValueError(f"text prompts ({where}) need --model DIR with a tokenizer")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p or not all(isinstance(t, int) and 0 <= t < vocab_size for t in p):
            raise ValueError(f"prompt {i} of {where} must be a non-empty list of token ids in [0, {vocab_size}) "
                             f"or a non-empty string")
    return prompts, tokenizer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """``[...]`` on every rank -> ``[W, ...]``, entry ``r`` from rank ``r``."""
    out = torch.empty((dist.get_world_size(),) + tuple(t.shape), dtype=t.dtype, device=t.device)
    dist.all_gather(list(out.unbind(0)), t.contiguous())
    return out


# ------------------------------------------------------------------------------------------------------
# Prefill (Note [Context-parallel prefill])


def causal_state(q, k, v, scale: float, strict: bool) -> AttentionState:
    """State of each query over the keys up to its index, or before it when ``strict``.

    ``q [B, Hq, n, D]``, ``k``/``v [B, Hkv, n, D]`` (one dtype) -> ``AttentionState(o [B, Hq, n, D] in q's
    dtype, lse [B, Hq, n] float32, natural log)``; a query that sees no key gets ``o = 0``, ``lse = -inf``.
    Runs FlashAttention (CUDA fp16/bf16, or the CPU kernel).
    """
    b, hq, n, d = q.shape
    if strict:  # query i sees keys j < i: query 0 none, query i >= 1 the causal keys 0..i-1
        empty = AttentionState.empty((b, hq, 1), d, dtype=q.dtype, device=q.device)
        if n == 1:
            return empty
        st = causal_state(q[:, :, 1:], k[:, :, :-1], v[:, :, :-1], scale, strict=False)
        return AttentionState(torch.cat([empty.o, st.o], 2), torch.cat([empty.lse, st.lse], 2))
    group = hq // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))  # one KV head per query head
    if q.is_cuda:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return AttentionState(o, lse)


def masked_state(q, k, v, q_first: int, k_first: int, stride: int, scale: float, window_left,
                 softcap=None) -> AttentionState:
    """State of queries at positions ``q_first + stride * i`` over keys at ``k_first + stride * j``: a query at
    ``p`` sees the keys at ``[p - window_left, p]`` (``window_left=None``: ``[0, p]``); scores soft-capped
    by ``softcap`` (``c * tanh(s / c)``) when given. The plain-torch
    attention of :func:`cp_attention.reference.attention` (float32 scores) with per-row key ranges,
    ``QUERY_CHUNK`` queries at a time against only the keys their positions can reach.

    ``q [B, Hq, n, D]``, ``k``/``v [B, Hkv, m, D]`` -> ``AttentionState(o [B, Hq, n, D] in q's dtype,
    lse [B, Hq, n] float32, natural log)``; ``o = 0``, ``lse = -inf`` for a query that sees no key.
    """
    b, hq, n, d = q.shape
    m = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
    for i0 in range(0, n, QUERY_CHUNK):
        i1 = min(n, i0 + QUERY_CHUNK)
        p_lo, p_hi = q_first + stride * i0, q_first + stride * (i1 - 1)
        j1 = max(0, min(m, (p_hi - k_first) // stride + 1))  # keys at positions <= p_hi
        j0 = 0 if window_left is None else min(j1, max(0, -(-(p_lo - window_left - k_first) // stride)))
        # Row i sees the keys j with lo <= j < hi, i.e. at positions in [p - window_left, p].
        q_pos = q_first + stride * torch.arange(i0, i1, device=q.device)
        hi = torch.div(q_pos - k_first, stride, rounding_mode="floor") + 1
        lo = torch.zeros_like(hi) if window_left is None else \
            -torch.div(k_first + window_left - q_pos, stride, rounding_mode="floor")
        limits = (torch.stack([lo, hi], dim=-1) - j0).expand(b, -1, 2)  # [B, c, 2], relative to key j0
        st = attention(q[:, :, i0:i1].transpose(1, 2), k[:, :, j0:j1], v[:, :, j0:j1], sm_scale=scale,
                       row_limits=limits, logit_softcap=softcap)
        o[:, :, i0:i1] = st.o.transpose(1, 2)
        lse[:, :, i0:i1] = st.lse.transpose(1, 2)
    return AttentionState(o, lse)


def prefill_attention(q, k, v, cache: CPKVCache, scale: float, window_left, softcap=None) -> torch.Tensor:
    """One layer's attention for this rank's prompt positions ``rank + W * i`` (Note [Context-parallel prefill]).

    ``q [B, n, Hq, D]``, ``k``/``v [B, n, Hkv, D]`` (RoPE applied). Stores ``k``/``v`` in ``cache``'s local
    slots ``[0, n)``, gathers every rank's shard and returns ``o [B, n, Hq, D]`` in q's dtype: the ⊕ of the
    per-shard attention states.
    """
    rank, world = cache.rank, cache.world_size
    n = q.shape[1]
    cache.k[:, :, :n] = k.transpose(1, 2)
    cache.v[:, :, :n] = v.transpose(1, 2)
    kv = all_gather(torch.stack([k, v]))  # [W, 2, B, n, Hkv, D]
    qh = q.transpose(1, 2)
    flash = window_left is None and softcap is None and (not q.is_cuda or q.dtype != torch.float32)
    states = []
    for s in range(world):
        ks, vs = kv[s, 0].transpose(1, 2), kv[s, 1].transpose(1, 2)
        if flash:
            states.append(causal_state(qh, ks, vs, scale, strict=s > rank))
        else:
            states.append(masked_state(qh, ks, vs, rank, s, world, scale, window_left, softcap))
    merged = merge_states(torch.stack([st.o for st in states]), torch.stack([st.lse for st in states]))
    return merged.o.transpose(1, 2)


def prefill(model, caches, prompts, device):
    """Context-parallel prefill of the right-padded prompts; sets the caches' lengths.

    Returns ``logits [B, vocab]`` of every prompt's last position, the same bits on every rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    lens = torch.tensor([len(p) for p in prompts], device=device)
    n = -(-int(lens.max()) // world)
    padded = torch.zeros(len(prompts), n * world, dtype=torch.int64)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = torch.tensor(p)
    tokens = padded[:, rank::world].to(device)  # [B, n]: this rank's positions rank + W * i
    positions = rank + world * torch.arange(n, device=device)
    a = model.args
    h = model(tokens, positions, lambda i, q, k, v: prefill_attention(q, k, v, caches[i], a.sm_scale,
                                                                       a.window_left(i), a.attn_softcap))
    rows = torch.arange(len(prompts), device=device)
    mine = h[rows, (lens - 1) // world]  # [B, dim]: valid where this rank owns the last position
    last = all_gather(mine)[(lens - 1) % world, rows]
    for cache in caches:
        cache.set_lengths(lens)
    return model.logits(last)


def fill_synthetic(caches, context: int, seed: int) -> None:
    """``context`` positions of random K/V per sequence: each rank generates only the positions it owns."""
    for i, cache in enumerate(caches):
        gen = torch.Generator(cache.k.device).manual_seed(seed + 1000 * (i + 1) + cache.rank)
        owned = -(-(context - cache.rank) // cache.world_size)
        cache.k[:, :, :owned].normal_(generator=gen)
        cache.v[:, :, :owned].normal_(generator=gen)
        cache.set_lengths(torch.full_like(cache.global_seq_lens, context))


# ------------------------------------------------------------------------------------------------------
# Decode


def decode_step(model, caches, tokens, check_metadata: bool = False) -> torch.Tensor:
    """One greedy step: ``tokens [B]`` int64 at the positions ``caches[i].global_seq_lens`` -> the next
    tokens ``[B]`` int64. Appends the step's K/V to every layer's cache. No host sync without
    ``check_metadata`` (capturable in a CUDA graph)."""
    a = model.args

    def attend(i, q, k, v):
        caches[i].append(k, v)
        return caches[i].decode(q, sm_scale=a.sm_scale, window_left=a.window_left(i), logit_softcap=a.attn_softcap,
                                check_metadata=check_metadata)

    h = model(tokens, caches[0].global_seq_lens.clone(), attend)
    return model.logits(h).argmax(-1)


def decode(model, caches, first, steps: int, args, device):
    """``steps`` greedy steps from ``first [B]``. Returns ``(tokens [B, steps] int64, seconds per step, the
    number of leading eager warm-up steps, the profiler or None)``. With ``args.cuda_graph`` the first
    ``WARMUP_STEPS`` steps run eagerly on a side stream, then one step is captured and replayed."""
    tokens, times = [], []
    tok = first
    graph = static_in = static_out = prof = None
    warmup = min(steps, WARMUP_STEPS) if args.cuda_graph else 0
    if args.cuda_graph:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
    for s in range(steps):
        if s == steps - args.profile_steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=activities)
            prof.start()
        if s == warmup and args.cuda_graph:
            torch.cuda.current_stream(device).wait_stream(side)
            static_in, graph = tok.clone(), torch.cuda.CUDAGraph()
            # recorded, not run: the caches are not touched by the capture; thread_local: the NCCL watchdog
            # thread's event queries must not invalidate it
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_out = decode_step(model, caches, static_in)
        sync(device)
        t0 = time.perf_counter()
        if graph is not None:
            static_in.copy_(tok)
            graph.replay()
            tok = static_out.clone()
        elif args.cuda_graph:
            with torch.cuda.stream(side):
                tok = decode_step(model, caches, tok, check_metadata=s == 0)
            torch.cuda.current_stream(device).wait_stream(side)
        else:
            tok = decode_step(model, caches, tok, check_metadata=s == 0)
        sync(device)
        times.append(time.perf_counter() - t0)
        tokens.append(tok)
    if prof is not None:
        prof.stop()
    out = torch.stack(tokens, 1) if tokens else first.new_empty(first.shape[0], 0)
    return out, times, warmup, prof


def profile_table(prof, steps: int, cuda: bool, top: int = 30) -> dict:
    """Where a profiled decode step's time goes: self time per op or kernel (GPU kernel time on CUDA, CPU
    time on the CPU), in µs per step, largest first; ``entries_per_step``: kernels (ops on the CPU) per step."""
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = sorted(((getattr(e, attr), e.count, e.key) for e in prof.key_averages() if getattr(e, attr) > 0),
                  reverse=True)
    total = sum(t for t, _, _ in rows)
    return {"clock": "GPU kernel time" if cuda else "CPU self time", "steps": steps,
            "total_us_per_step": total / steps, "entries_per_step": sum(c for _, c, _ in rows) / steps,
            "top": [{"name": k, "us_per_step": t / steps, "share": t / total, "calls_per_step": c / steps}
                    for t, c, k in rows[:top]]}


# ------------------------------------------------------------------------------------------------------


def run(args, model, prompts, device, fill_context=None) -> dict:
    """Prefill the prompts (or fill ``fill_context`` random positions), then decode; the result dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    margs = model.args
    b = len(prompts)
    context = fill_context or max(len(p) for p in prompts)
    caches = [CPKVCache(b, margs.n_kv_heads, margs.head_dim, context + args.new_tokens, dtype=args.dtype,
                        device=device, rank=rank, world_size=world) for _ in range(margs.n_layers)]
    result = {"world_size": world, "device": device.type, "dtype": str(args.dtype).replace("torch.", ""),
              "model": args.random_config or str(args.model), "batch": b,
              "prompt_lens": [len(p) for p in prompts], "new_tokens": args.new_tokens,
              "backend": "native", "cuda_graph": args.cuda_graph}
    if fill_context is None:
        runs = []
        for _ in range(args.prefill_runs):
            dist.barrier()
            t0 = time.perf_counter()
            logits = prefill(model, caches, prompts, device)
            sync(device)
            runs.append(time.perf_counter() - t0)
        first = logits.argmax(-1)
        result.update(prefill_s=runs[-1], prefill_runs_s=runs,
                      prefill_tokens_per_s=sum(result["prompt_lens"]) / runs[-1])
        if args.logits:
            result["prefill_logits"] = logits.float().cpu().tolist()
        steps, generated = args.new_tokens - 1, [first[:, None]]
    else:
        fill_synthetic(caches, fill_context, args.seed)
        result["synthetic_context"] = fill_context
        result["note"] = ("--fill-context: each sequence's context is random K/V, not the prompt; for timing only, "
                          "the tokens are not meaningful")
        first = torch.tensor([p[-1] for p in prompts], device=device)
        steps, generated = args.new_tokens, []
    new, times, warmup, prof = decode(model, caches, first, steps, args, device)
    tokens = torch.cat(generated + [new], 1)  # [B, N]
    check_ranks_agree(tokens)
    timed = times[warmup: steps - args.profile_steps]
    result.update(tokens=tokens.cpu().tolist(), decode_step_s=times, decode_warmup_steps=warmup,
                  decode_profiled_steps=args.profile_steps,
                  decode_step_median_s=statistics.median(timed) if timed else None,
                  decode_tokens_per_s=b * len(timed) / sum(timed) if timed else None)
    if prof is not None:
        result["profile"] = profile_table(prof, args.profile_steps, device.type == "cuda")
    return result


def check_ranks_agree(tokens: torch.Tensor) -> None:
    """Every rank chose the same tokens ``[B, N]`` (else ``RuntimeError`` naming the first difference)."""
    everyone = all_gather(tokens)
    for r in range(everyone.shape[0]):
        if not torch.equal(everyone[r], everyone[0]):
            b_bad, s_bad = (everyone[r] != everyone[0]).nonzero()[0].tolist()
            raise RuntimeError(f"rank {r} chose token {int(everyone[r][b_bad, s_bad])} for sequence {b_bad} step "
                               f"{s_bad}, rank 0 chose {int(everyone[0][b_bad, s_bad])}: the ranks disagree")


# ------------------------------------------------------------------------------------------------------
# The transformers backend: the unmodified transformers model, generate() and a CPCache

HF_WARMUP_STEPS = 2  # eager decode steps left out of the timing (kernel compilation), 4 with --compile


def hf_config(margs):
    """The transformers ``LlamaConfig`` of ``launch/llama.py``'s Llama shapes (``--random-config``)."""
    import transformers

    if margs.windows or margs.gemma_norms or margs.qkv_bias:
        raise ValueError("--random-config with --backend transformers builds Llama configs only")
    rope = {"rope_type": "llama3" if margs.rope_scaling else "default", "rope_theta": margs.rope_theta,
            **(margs.rope_scaling or {})}
    return transformers.LlamaConfig(
        vocab_size=margs.vocab_size, hidden_size=margs.dim, num_hidden_layers=margs.n_layers,
        num_attention_heads=margs.n_heads, num_key_value_heads=margs.n_kv_heads, head_dim=margs.head_dim,
        intermediate_size=margs.intermediate_size, rms_norm_eps=margs.norm_eps, rope_parameters=rope,
        tie_word_embeddings=margs.tie_embeddings, max_position_embeddings=1 << 21, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)


def hf_model(args, margs, device):
    """The transformers model with ``attn_implementation="cp_attention"``: the checkpoint, or the Llama config of
    ``margs`` with the native backend's random weights (the same generator draws in the same parameter order)."""
    import transformers

    import cp_attention.hf  # noqa: F401  (registers "cp_attention")

    if margs is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="cp_attention",
                                                                  dtype=args.dtype)
        return model.to(device).eval()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(margs), attn_implementation="cp_attention",
                                                              dtype=args.dtype)
    gen = torch.Generator(device).manual_seed(args.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


class _StepTimer:
    """A logits processor that timestamps every step (``generate()`` calls it once per forward, after queuing
    it; the first call waits for the prefill). ``start()`` stamps the time before ``generate()``."""

    def __init__(self, device):
        self.device, self.times = device, []

    def start(self):
        sync(self.device)
        self.times.append(time.perf_counter())

    def __call__(self, input_ids, scores):
        if len(self.times) == 1:
            sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def run_transformers(args, model, prompts, device, fill_context=None) -> dict:
    """``generate()`` of the left-padded prompts (or of ``fill_context`` random positions) with a CPCache; the
    result dict of :func:`run`."""
    import transformers

    from cp_attention.hf import CPCache, decode_ahead

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model.config.get_text_config()
    b, pad = len(prompts), cfg.pad_token_id if isinstance(cfg.pad_token_id, int) else 0
    context = fill_context or max(len(p) for p in prompts)
    cache = CPCache(model.config, max_cache_len=context + args.new_tokens)
    if args.compile:  # each context compiles its own static shapes (docs/performance.md, "Generation through transformers")
        torch._dynamo.reset()
    result = {"world_size": world, "device": device.type, "dtype": str(args.dtype).replace("torch.", ""),
              "model": args.random_config or str(args.model), "batch": b,
              "prompt_lens": [len(p) for p in prompts], "new_tokens": args.new_tokens,
              "backend": "transformers", "compile": args.compile, "cuda_graph": args.compile,
              "decode_ahead": args.decode_ahead}
    if fill_context is None:
        ids = torch.full((b, context), pad, dtype=torch.int64)
        mask = torch.zeros(b, context, dtype=torch.int64)
        for i, p in enumerate(prompts):  # left padding
            ids[i, context - len(p):] = torch.tensor(p)
            mask[i, context - len(p):] = 1
    else:
        hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cache.early_initialization(b, hkv, head_dim, args.dtype, device)
        for i, layer in enumerate(cache.layers):  # as fill_synthetic: each rank generates only its shard
            gen = torch.Generator(device).manual_seed(args.seed + 1000 * (i + 1) + rank)
            owned = -(-(fill_context - rank) // world)
            layer.keys[:, :, :owned].normal_(generator=gen)
            layer.values[:, :, :owned].normal_(generator=gen)
        cache.set_seq_length(fill_context)
        # The cached positions' ids are never read: generate() feeds only the ids past the cache's length.
        ids = torch.zeros(b, fill_context + 1, dtype=torch.int64)
        ids[:, -1] = torch.tensor([p[-1] for p in prompts])
        mask = torch.ones_like(ids)
        result["synthetic_context"] = fill_context
        result["note"] = ("--fill-context: each sequence's context is random K/V, not the prompt; for timing only, "
                          "the tokens are not meaningful")
    timer = _StepTimer(device)
    model.generation_config.eos_token_id = None  # no stop token: N new tokens each
    dist.barrier()
    timer.start()
    # newer transformers name the argument cache (past_key_values is deprecated there)
    takes_cache = "cache" in inspect.signature(model.forward).parameters
    out = model.generate(ids.to(device), attention_mask=mask.to(device), **{"cache" if takes_cache else
                                                                            "past_key_values": cache},
                         max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad,
                         logits_processor=transformers.LogitsProcessorList([timer]),
                         custom_generate=decode_ahead if args.decode_ahead else None,
                         return_dict_in_generate=True, output_logits=args.logits, disable_compile=not args.compile)
    tokens = out.sequences[:, ids.shape[1]:]
    check_ranks_agree(tokens)
    steps = [t1 - t0 for t0, t1 in zip(timer.times, timer.times[1:])]  # forward by forward
    if fill_context is None:
        result.update(prefill_s=steps[0], prefill_tokens_per_s=sum(result["prompt_lens"]) / steps[0])
        if args.logits:
            result["prefill_logits"] = out.logits[0].float().cpu().tolist()
        steps = steps[1:]
    warmup = min(len(steps), 2 * HF_WARMUP_STEPS if args.compile else HF_WARMUP_STEPS)
    timed = steps[warmup:]
    result.update(tokens=tokens.cpu().tolist(), decode_step_s=steps, decode_warmup_steps=warmup,
                  decode_step_median_s=statistics.median(timed) if timed else None,
                  decode_tokens_per_s=b * len(timed) / sum(timed) if timed else None)
    return result


# ------------------------------------------------------------------------------------------------------


def environment() -> dict:
    """Where the run happened, recorded in the output JSON (as the benchmarks record it)."""
    import datetime
    import platform

    import triton

    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
           "torch": torch.__version__, "triton": triton.__version__}
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count())
    return env


def main(argv=None):
    args = parse_args(argv)
    try:  # every rank checks the same inputs: a bad one stops them all before any collective
        if args.random_config:
            margs, files = CONFIGS[args.random_config], None
            vocab = margs.vocab_size
            if args.backend == "transformers":
                hf_config(margs)
        elif args.backend == "transformers":  # any architecture cp_attention.hf takes
            import transformers

            from cp_attention.hf import CPCache

            config = transformers.AutoConfig.from_pretrained(args.model)
            CPCache(config)  # an unsupported one fails here, naming what it lacks
            margs, files, vocab = None, None, config.get_text_config().vocab_size
        else:
            margs, files = inspect_checkpoint(args.model)
            vocab = margs.vocab_size
        prompts, tokenizer = load_prompts(args.prompts, vocab, args.prompt, args.model)
    except (CheckpointError, ValueError, OSError) as exc:
        raise SystemExit(f"generate.py: error: {exc}") from None
    device = init_distributed(args.device, args.timeout_s)
    try:
        # transformers' compiled generation needs autograd's bookkeeping off, not inference tensors
        with torch.inference_mode() if args.backend == "native" else torch.no_grad():
            if args.backend == "transformers":
                model, runner = hf_model(args, margs, device), run_transformers
            elif files is None:
                model, runner = random_model(margs, device, args.dtype, args.seed), run
            else:
                model, runner = load_checkpoint(margs, files, device, args.dtype), run
            results = []
            for fill in args.fill_context or [None]:
                results.append(runner(args, model, prompts, device, fill))
                if tokenizer is not None:
                    results[-1]["text"] = [tokenizer.decode(t) for t in results[-1]["tokens"]]
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the last run's caches and graph
        if dist.get_rank() == 0:
            result = {"environment": environment(), **(results[0] if len(results) == 1 else {"runs": results})}
            text = json.dumps(result, indent=1)
            if args.output is None:
                print(text)
            else:
                args.output.write_text(text + "\n")
                for res in results:
                    prefill_s, rate = res.get("prefill_s"), res["decode_tokens_per_s"]
                    print(f"[generate] W={res['world_size']} {res['device']} {res['dtype']} B={res['batch']} "
                          f"context={res.get('synthetic_context') or max(res['prompt_lens'])} "
                          f"new={args.new_tokens}: prefill {'skipped' if prefill_s is None else f'{prefill_s:.3f} s'}, "
                          f"decode {'n/a' if rate is None else f'{rate:.1f} tokens/s'} -> {args.output}", flush=True)
        # Every rank tears gloo down together: a rank that destroyed its group while rank 0 was still writing
        # aborted ("terminate called without an active exception") about once in ten CPU runs.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The run is done and every rank has left the group. gloo's objects, destroyed at interpreter exit, abort
    # now and then on a loaded CPU ("terminate called without an active exception", after the output was
    # written), so the process ends here instead of in those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
