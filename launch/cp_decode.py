"""Context-parallel decode across processes: a KV cache sharded over the ranks (``CPKVCache``), one new
token appended per step, every step's output checked against single-rank ``flash_decode`` on rank 0.

GPU (NCCL, one GPU per process)::

    torchrun --nproc-per-node=2 launch/cp_decode.py --context 1048576 --batch 1 --steps 32
    torchrun --nproc-per-node=2 launch/cp_decode.py --context 131072 --cuda-graph --exchange symm collective

CPU (gloo, Triton kernels under the interpreter)::

    TRITON_INTERPRET=1 torchrun --nproc-per-node=2 launch/cp_decode.py --device cpu --context 4096 --batch 2 --steps 4

Contexts up to ``--check-context`` are generated whole on every rank (same seed) and sharded, so rank 0
can check every step against the unsharded cache. Longer contexts generate only each rank's shard
(seeded per rank) and are timed; a check run at ``--check-context`` tokens comes first. Sequences of a
batch are ragged: sequence ``b`` starts with ``context - b * (context // (4 * batch))`` tokens.
``--exchange`` runs the whole thing once per exchange named (how the ranks' states meet: ``symm``,
NVLink symmetric memory; ``collective``, NCCL all-gather; ``auto``, the library's choice; see
cp_attention/distributed/exchange.py) and reports each one's step time. Exits non-zero when a check fails.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cp_attention import flash_decode  # noqa: E402
from cp_attention.distributed import CPKVCache, init_distributed, set_exchange  # noqa: E402
from cp_attention.distributed.exchange import EXCHANGES, exchange_for  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (atol, rtol) of the CP output against single-rank flash_decode: both round float32 states to the working
# dtype once, but their splits differ, so the roundings may fall on either side.
TOLERANCES = {torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (1e-3, 1e-3), torch.float32: (1e-5, 1e-5)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4096, help="prefix tokens per sequence (the longest one)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32, help="decode steps, one appended token each")
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check-context", type=int, default=65536,
                   help="largest context generated whole and checked (longer ones are checked at this size)")
    p.add_argument("--cuda-graph", action="store_true", help="capture append + decode once, replay every step")
    p.add_argument("--exchange", nargs="+", choices=EXCHANGES, default=["auto"],
                   help="exchanges to run with, one after the other")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=int, default=600, help="process-group timeout")
    args = p.parse_args(argv)
    for name in ("context", "batch", "steps", "heads_q", "heads_kv", "head_dim", "check_context"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.cuda_graph and args.device != "cuda":
        p.error("--cuda-graph needs --device cuda")
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefix_lens(context, batch, device):
    drop = context // (4 * batch)
    return torch.tensor([context - b * drop for b in range(batch)], dtype=torch.int64, device=device)


def _graphed_step(cache, q_steps, kv_steps, device):
    """Capture ``append`` + ``decode`` in one CUDA graph; the returned ``step(s)`` copies step ``s``'s
    token and query into the graph's static inputs and replays it (see ``CPKVCache``)."""
    q_in, k_in, v_in = q_steps[0].clone(), kv_steps[0, 0].clone(), kv_steps[1, 0].clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up on a side stream, decode only (append would add a token)
        for _ in range(2):
            cache.decode(q_in, check_metadata=False)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # recorded, not run: the cache is not touched by the capture; thread_local: the NCCL watchdog thread's
    # event queries must not invalidate it
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        cache.append(k_in, v_in)
        o_out = cache.decode(q_in, check_metadata=False)

    def step(s):
        q_in.copy_(q_steps[s])
        k_in.copy_(kv_steps[0, s])
        v_in.copy_(kv_steps[1, s])
        graph.replay()
        return o_out

    return step


def run(args, device, context, steps, check):
    """Decode ``steps`` steps after a prefix of ``context`` tokens; returns (median step seconds, max error,
    passed) on rank 0 (error and passed are None without ``check``)."""
    rank = dist.get_rank()
    dtype = DTYPES[args.dtype]
    b, hq, hkv, d = args.batch, args.heads_q, args.heads_kv, args.head_dim
    lens = _prefix_lens(context, b, device)
    max_seq_len = context + steps
    shared = torch.Generator(device).manual_seed(args.seed)  # the same stream on every rank
    q_steps = torch.randn(steps, b, hq, d, generator=shared, device=device, dtype=dtype)
    kv_steps = torch.randn(2, steps, b, hkv, d, generator=shared, device=device, dtype=dtype)
    full = None
    if check:
        k = torch.randn(b, hkv, context, d, generator=shared, device=device, dtype=dtype)
        v = torch.randn(b, hkv, context, d, generator=shared, device=device, dtype=dtype)
        cache = CPKVCache.from_prefix(k, v, lens, max_seq_len)
        if rank == 0:  # the unsharded cache, with room for the appended tokens
            full = [torch.nn.functional.pad(t, (0, 0, 0, steps)) for t in (k, v)]
        del k, v
    else:
        cache = CPKVCache(b, hkv, d, max_seq_len, dtype=dtype, device=device)
        own = torch.Generator(device).manual_seed(args.seed + 1 + rank)  # this rank's shard only
        cache.k.normal_(generator=own)
        cache.v.normal_(generator=own)
        cache.set_lengths(lens)
    # The first decode checks that every rank agrees on shapes (one host sync), and warms up.
    cache.decode(q_steps[0], check_metadata=True)

    if args.cuda_graph:
        step = _graphed_step(cache, q_steps, kv_steps, device)
    else:
        def step(s):
            cache.append(kv_steps[0, s], kv_steps[1, s])
            return cache.decode(q_steps[s], check_metadata=False)

    times, outs = [], []
    dist.barrier()
    for s in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        o = step(s)
        _sync(device)
        times.append(time.perf_counter() - t0)
        if check:
            outs.append(o.clone())
    median = statistics.median(times)
    if not check or rank != 0:
        return median, None, None
    k, v = full
    atol, rtol = TOLERANCES[dtype]
    max_err, passed = 0.0, True
    rows = torch.arange(b, device=device)
    for s in range(steps):
        k[rows, :, lens + s] = kv_steps[0, s]
        v[rows, :, lens + s] = kv_steps[1, s]
        ref = flash_decode(q_steps[s], k, v, lens + s + 1).float()
        err = (outs[s].float() - ref).abs()
        max_err = max(max_err, err.max().item())
        passed &= bool((err <= atol + rtol * ref.abs()).all()) and bool(torch.isfinite(outs[s]).all())
    return median, max_err, passed


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed(args.device, args.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    passed = True
    try:
        runs = [(args.context, args.steps, True)] if args.context <= args.check_context else \
            [(args.check_context, min(args.steps, 4), True), (args.context, args.steps, False)]
        for exchange in args.exchange:
            set_exchange(exchange)
            for context, steps, check in runs:
                median, max_err, ok = run(args, device, context, steps, check)
                if rank != 0:
                    continue
                mode = "cuda-graph" if args.cuda_graph else "eager"
                line = (f"[cp_decode] W={world} {args.device} {args.dtype} B={args.batch} Hq={args.heads_q} "
                        f"Hkv={args.heads_kv} D={args.head_dim} context={context} steps={steps} {mode} "
                        f"exchange={exchange_for(None).name}: median step (append + decode) {median * 1e3:.3f} ms")
                if check:
                    line += f"; max |err| vs single-rank flash_decode {max_err:.3e} -> {'PASS' if ok else 'FAIL'}"
                    passed &= ok
                print(line, flush=True)
        flag = torch.tensor([int(passed)], device=device)
        dist.broadcast(flag, src=0)
        passed = bool(flag.item())
    finally:
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
