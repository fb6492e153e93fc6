"""Context-parallel decode over W GPUs against single-GPU flash_decode on the whole cache.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_cp.py
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_cp.py --batches 1 --contexts 131072 1048576 --tree
    torchrun --standalone --nproc-per-node=4 benchmarks/bench_cp.py --name bench_cp_w4
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_cp.py --device cpu --contexts 1024 4096   # smoke test
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_cp.py --batches 1 --contexts 32768 --cascade 128:32768:256

bf16, Hq=32, Hkv=8, D=128 (options change them); B in --batches, T in --contexts. Per shape, median µs:
``single``: flash_decode over the whole cache of T tokens on rank 0 alone, ``sdpa``: torch SDPA (default
backend selection) on the same cache, ``best1`` the faster of the two (both skipped when the cache would not
fit in --max-gb); ``cp_<exchange>``: cp_flash_decode over W ranks holding T/W tokens each (contiguous
placement) with each exchange of --exchanges (``symm``: NVLink symmetric memory, ``collective``: NCCL
all-gather; see cp_attention/distributed/exchange.py), split into ``local`` (flash_decode on the shard) and
``merge_<exchange>`` (merge_across_ranks alone); ``exposed_<exchange>`` = cp − local; ``tree`` (with
--tree): the merge done Tree-Attention style instead (all-reduce MAX of the lse, then one all-reduce SUM
of the rescaled numerators and denominators). Each per call (eager) and per call in a CUDA graph of 20
calls (``capture`` of benchmarks/_harness.py: warm-up on a side stream, then the calls captured in one
graph; the replay time is divided by the number of calls, --graph-calls). speedup = best1 / cp. Times
are taken on every rank after a barrier; rank 0's are reported. Single-rank timings use the harness's
``bench_call`` (triton.testing.do_bench median, L2 flushed before each call); timings with collectives
use the same method (L2 flush, CUDA events per call, median) with one iteration count agreed by all
ranks, since do_bench picks its own count per process and collectives must match. --device cpu runs the
same code over gloo (eager only, wall-clock medians) to check the script without GPUs.
Writes benchmarks/results/<name>.json and <name>.png (default name: bench_cp).
"""
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the H200 machines
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import (  # noqa: E402
    DTYPES, GRAPH_CALLS, RESULTS, bench_call, capture, max_abs_diff, table, tqdm, write_json, write_tables,
)
from cp_attention import AttentionState, CascadeLevel, cascade_decode, flash_decode  # noqa: E402
from cp_attention.state import normalize, unnormalize  # noqa: E402
from cp_attention.distributed import (cp_cascade_decode, cp_flash_decode, init_distributed,  # noqa: E402
                                      merge_across_ranks, set_exchange, shard_kv)
from cp_attention.ops import symm_merge  # noqa: E402
from benchmarks.peers import cache_form, sdpa_default  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072, 1048576, 4194304])
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--max-gb", type=float, default=120.0, help="largest K+V cache one GPU may hold")
    p.add_argument("--rep-ms", type=int, default=100, help="timed milliseconds per measurement")
    p.add_argument("--tree", action="store_true", help="also time the Tree-Attention style merge")
    p.add_argument("--page-size", type=int, default=None,
                   help="paged caches: every cache (whole and shards) as NHD page pools of this many slots")
    p.add_argument("--fp8", action="store_true",
                   help="FP8 e4m3 caches (cp_attention.quantize_kv, per-tensor scales; SDPA is then left out)")
    p.add_argument("--split-size", type=int, default=None,
                   help="also time the deterministic path: flash_decode(split_size=S) on one GPU and "
                        "cp_flash_decode(split_size=S) (needs shards of a multiple of S tokens)")
    p.add_argument("--exchanges", nargs="+", choices=("symm", "collective"), default=None,
                   help="exchanges to time (default: symm and collective on CUDA, collective on CPU)")
    p.add_argument("--no-graph", action="store_true", help="per call (eager) only")
    p.add_argument("--graph-calls", type=int, default=GRAPH_CALLS, help="calls captured in one CUDA graph")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--name", default="bench_cp", help="results file stem under benchmarks/results/")
    p.add_argument("--timeout-s", type=int, default=1800, help="process-group timeout")
    p.add_argument("--cascade", nargs="*", metavar="B:PREFIX:OWN", default=[],
                   help="also time cp_cascade_decode against one-GPU cascade_decode: B requests sharing a PREFIX "
                        "of tokens with OWN tokens each (e.g. 128:32768:256); both levels sharded contiguously")
    p.add_argument("--symm-bulk-rows", type=int, default=None,
                   help="merges of this many rows or more take the symmetric merge's bulk protocol (default: "
                        "the library's BULK_MIN_ROWS; see cp_attention/ops/symm_merge.py)")
    p.add_argument("--symm-max-programs", type=int, default=None,
                   help="programs of the symmetric merge at most (default: the library's MAX_PROGRAMS)")
    args = p.parse_args(argv)
    if args.exchanges is None:
        args.exchanges = ["symm", "collective"] if args.device == "cuda" else ["collective"]
    for name in ("batches", "contexts"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name} must be >= 1")
    if args.heads_q % args.heads_kv:
        p.error("--heads-q must be a multiple of --heads-kv")
    return args


def cache_gb(batch, tokens, args) -> float:
    """GB of K and V for ``batch`` sequences of ``tokens`` tokens."""
    return 2 * batch * args.heads_kv * tokens * args.head_dim * DTYPES[args.dtype].itemsize / 1e9


def tree_merge(state, group=None) -> AttentionState:
    """Tree Attention's cross-rank merge, for comparison only: all-reduce MAX of the lse, then one all-reduce
    SUM of ``[exp(lse - m) * o, exp(lse - m)]``. Two collectives; the sum order is the backend's."""
    o, lse = state
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    num, den = unnormalize(o, lse, m)
    buf = torch.cat([num, den.unsqueeze(-1)], dim=-1)
    dist.all_reduce(buf, group=group)
    return normalize(buf[..., :-1], buf[..., -1], m, o.dtype)


class Timer:
    """Median µs of ``fn()`` on this rank (see the module docstring for the method)."""

    def __init__(self, device, rep_ms):
        self.device, self.rep_ms = device, rep_ms
        self._flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn, collective: bool) -> float:
        if self.device.type == "cpu":
            return self._wall_clock(fn, collective)
        if not collective:
            return bench_call(fn, rep=self.rep_ms)
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = torch.tensor([start.elapsed_time(end) / 5], device=self.device)
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX)  # one iteration count on every rank
        est_ms = max(estimate.item(), 1e-3)
        n_warmup, n_rep = max(1, int(25 / est_ms)), min(5000, max(1, int(self.rep_ms / est_ms)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        for _ in range(n_warmup):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        for i in range(n_rep):
            self._flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3

    @staticmethod
    def _wall_clock(fn, collective, n=5) -> float:
        fn()
        if collective:
            dist.barrier()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6


def timings(row, prefix, fn, timer, collective, graph_calls):
    """``row[prefix_call_us]`` and, with ``graph_calls`` > 0, ``row[prefix_graph_us]``: per call in a graph of
    ``graph_calls`` calls (the graph is freed after)."""
    row[f"{prefix}_call_us"] = timer(fn, collective)
    if graph_calls:
        graph = capture(fn, graph_calls)
        row[f"{prefix}_graph_us"] = timer(graph.replay, collective) / graph_calls
        del graph
        torch.cuda.empty_cache()


def measure(args, batch, context, timer, device):
    """One shape: the single-GPU baseline on rank 0, then the CP parts on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, hq, hkv, d = DTYPES[args.dtype], args.heads_q, args.heads_kv, args.head_dim
    graph_calls = args.graph_calls if device.type == "cuda" and not args.no_graph else 0
    row = {"batch": batch, "context": context, "world": world, "single_gb": round(cache_gb(batch, context, args), 2)}
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, hq, d, generator=gen, device=device, dtype=dtype)

    if row["single_gb"] <= args.max_gb:
        if rank == 0:
            k = torch.empty(batch, hkv, context, d, device=device, dtype=dtype).normal_(generator=gen)
            v = torch.empty_like(k).normal_(generator=gen)
            if device.type == "cuda" and not args.fp8:
                timings(row, "sdpa", sdpa_default(q, k, v), timer, False, graph_calls)
            k, v, kw = cache_form(k, v, fp8=args.fp8, page_size=args.page_size)
            seq = kw.pop("seq_lens", torch.full((batch,), context, dtype=torch.int32, device=device))
            timings(row, "single", lambda: flash_decode(q, k, v, seq, **kw), timer, False, graph_calls)
            if args.split_size and context % args.split_size == 0:
                timings(row, "single_det", lambda: flash_decode(q, k, v, seq, split_size=args.split_size, **kw), timer,
                        False, graph_calls)
            for mode in ("call", "graph"):
                best = [row[f"{w}_{mode}_us"] for w in ("single", "sdpa") if f"{w}_{mode}_us" in row]
                if best:
                    row[f"best1_{mode}_us"] = min(best)
            del k, v
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
    else:
        row["single_skipped"] = f"{row['single_gb']:.0f} GB of KV > --max-gb {args.max_gb:g} on one GPU"

    shard = math.ceil(context / world)
    if cache_gb(batch, shard, args) > args.max_gb:
        row["cp_skipped"] = f"a {shard}-token shard needs more than --max-gb {args.max_gb:g}"
        return row
    own = torch.Generator(device).manual_seed(1 + rank)
    ks = torch.empty(batch, hkv, shard, d, device=device, dtype=dtype).normal_(generator=own)
    vs = torch.empty_like(ks).normal_(generator=own)
    lens = torch.full((batch,), max(0, min(shard, context - rank * shard)), dtype=torch.int32, device=device)
    ks, vs, kw = cache_form(ks, vs, fp8=args.fp8, page_size=args.page_size)
    kw.pop("seq_lens", None)  # each shard's own lengths
    state = flash_decode(q, ks, vs, lens, return_lse=True, **kw)
    timings(row, "local", lambda: flash_decode(q, ks, vs, lens, return_lse=True, **kw), timer, False, graph_calls)
    outs = {}
    for exchange in args.exchanges:
        set_exchange(exchange)
        outs[exchange] = cp_flash_decode(q, ks, vs, lens, **kw)  # checks once that every rank agrees on shapes
        assert torch.isfinite(outs[exchange]).all(), f"non-finite CP output ({exchange})"
        timings(row, f"merge_{exchange}", lambda: merge_across_ranks(state, check_metadata=False), timer, True, graph_calls)
        timings(row, f"cp_{exchange}", lambda: cp_flash_decode(q, ks, vs, lens, check_metadata=False, **kw), timer,
                True, graph_calls)
        for mode in ("call", "graph"):
            if f"cp_{exchange}_{mode}_us" in row:
                row[f"exposed_{exchange}_{mode}_us"] = row[f"cp_{exchange}_{mode}_us"] - row[f"local_{mode}_us"]
            if f"best1_{mode}_us" in row and f"cp_{exchange}_{mode}_us" in row:
                row[f"speedup_{exchange}_{mode}"] = row[f"best1_{mode}_us"] / row[f"cp_{exchange}_{mode}_us"]
    set_exchange("auto")
    if args.split_size and shard % args.split_size == 0:
        cp_flash_decode(q, ks, vs, lens, split_size=args.split_size, **kw)
        timings(row, "cp_det", lambda: cp_flash_decode(q, ks, vs, lens, split_size=args.split_size,
                                                       check_metadata=False, **kw), timer, True, graph_calls)
    first = outs[args.exchanges[0]]
    row["exchanges_bitwise_equal"] = all(torch.equal(o, first) for o in outs.values())
    if args.tree:
        timings(row, "tree", lambda: tree_merge(state), timer, True, graph_calls)
        row["tree_maxdiff"] = max_abs_diff(tree_merge(state).o, merge_across_ranks(state, check_metadata=False).o)
    del ks, vs, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def measure_cascade(args, spec, timer, device):
    """cascade_decode of the whole levels on rank 0 against cp_cascade_decode of every rank's contiguous
    shard of the shared prefix and of each request's own tokens; ``local``: cascade_decode of a rank's
    shards alone (the CP step without the exchange); ``merge``: merge_across_ranks of its state alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, prefix, own = map(int, spec.split(":"))
    dtype, hq, hkv, d = DTYPES[args.dtype], args.heads_q, args.heads_kv, args.head_dim
    graph_calls = args.graph_calls if device.type == "cuda" and not args.no_graph else 0
    row = {"batch": batch, "context": f"{prefix}+{own}", "world": world}
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, hq, d, generator=gen, device=device, dtype=dtype)
    pk, pv = (torch.empty(1, hkv, prefix, d, device=device, dtype=dtype).normal_(generator=gen) for _ in range(2))
    ok, ov = (torch.empty(batch, hkv, own, d, device=device, dtype=dtype).normal_(generator=gen) for _ in range(2))
    if rank == 0:
        whole = [CascadeLevel(pk, pv), CascadeLevel(ok, ov)]
        timings(row, "single", lambda: cascade_decode(q, whole), timer, False, graph_calls)
    dist.barrier()
    pks, pvs, p_lens = shard_kv(pk, pv, None, rank, world)
    oks, ovs, o_lens = shard_kv(ok, ov, None, rank, world)
    shards = [CascadeLevel(pks, pvs, p_lens), CascadeLevel(oks, ovs, o_lens)]
    assert torch.isfinite(cp_cascade_decode(q, shards)).all(), "non-finite CP cascade output"
    timings(row, "local", lambda: cascade_decode(q, shards), timer, False, graph_calls)  # this rank's shards alone
    for exchange in args.exchanges:
        set_exchange(exchange)
        cp_cascade_decode(q, shards)
        timings(row, f"cp_{exchange}", lambda: cp_cascade_decode(q, shards, check_metadata=False), timer, True,
                graph_calls)
        state = AttentionState(*(x.contiguous() for x in cascade_decode(q, shards, return_lse=True)))
        timings(row, f"merge_{exchange}", lambda: merge_across_ranks(state, check_metadata=False), timer, True, graph_calls)
        for mode in ("call", "graph"):
            if f"single_{mode}_us" in row and f"cp_{exchange}_{mode}_us" in row:
                row[f"speedup_{exchange}_{mode}"] = row[f"single_{mode}_us"] / row[f"cp_{exchange}_{mode}_us"]
    set_exchange("auto")
    del pk, pv, ok, ov, pks, pvs, oks, ovs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def plot(rows, args, world, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(13, 4.8))
    mode = "call" if args.no_graph or all("local_graph_us" not in r for r in rows) else "graph"
    for b in args.batches:
        mine = [r for r in rows if r["batch"] == b]
        for exchange, style in zip(args.exchanges, ("-", "--")):
            pts = [(r["context"], r[f"speedup_{exchange}_{mode}"]) for r in mine if f"speedup_{exchange}_{mode}" in r]
            if pts:
                ax_s.plot(*zip(*pts), style, marker="o", label=f"B={b} {exchange}")
            pts = [(r["context"], r[f"exposed_{exchange}_{mode}_us"]) for r in mine
                   if f"exposed_{exchange}_{mode}_us" in r]
            if pts:
                ax_t.plot(*zip(*pts), style, marker="o", label=f"B={b} {exchange}")
    ax_s.axhline(world, color="grey", lw=0.8, ls=":", label=f"ideal ({world}x)")
    ax_s.axhline(1.0, color="black", lw=0.8)
    ax_s.set(xscale="log", xlabel="context T (tokens)", ylabel=f"best single-GPU time / CP time ({mode})",
             title=f"CP decode speedup, {world} ranks, {args.dtype} Hq={args.heads_q} Hkv={args.heads_kv} "
                   f"D={args.head_dim}")
    ax_t.axhline(5.0, color="grey", lw=0.8, ls=":", label="5 µs")
    ax_t.set(xscale="log", xlabel="context T (tokens)", ylabel=f"µs (median, {mode})",
             title="exposed merge: CP step − local attention")
    for ax in (ax_s, ax_t):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    if args.symm_bulk_rows is not None:
        symm_merge.BULK_MIN_ROWS = args.symm_bulk_rows
    args.symm_bulk_rows = symm_merge.BULK_MIN_ROWS
    if args.symm_max_programs is not None:
        symm_merge.MAX_PROGRAMS = args.symm_max_programs
    args.symm_max_programs = symm_merge.MAX_PROGRAMS
    device = init_distributed(args.device, args.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    timer = Timer(device, args.rep_ms)
    shapes = [(b, t) for b in args.batches for t in args.contexts]
    rows = []
    try:
        for b, t in tqdm(shapes, desc=f"bench_cp W={world}", disable=rank != 0):
            rows.append(measure(args, b, t, timer, device))
        cascade_rows = [measure_cascade(args, spec, timer, device) for spec in args.cascade]
        if rank == 0:
            parts = ["single", "sdpa", "best1", "local"] + [f"{w}_{x}" for x in args.exchanges
                                                            for w in ("merge", "cp", "exposed")]
            cols = ["batch", "context"] + [f"{p}_{m}_us" for m in ("graph", "call") for p in parts]
            cols += [f"speedup_{x}_{m}" for m in ("graph", "call") for x in args.exchanges]
            cols += ["single_det_graph_us", "cp_det_graph_us", "exchanges_bitwise_equal", "tree_graph_us"]
            for r in rows:
                if "tree_maxdiff" in r:
                    print(f"B={r['batch']} T={r['context']}: tree merge max |o - o_merge_across_ranks| "
                          f"{r['tree_maxdiff']}")
                for what in ("single", "cp"):
                    if f"{what}_skipped" in r:
                        print(f"B={r['batch']} T={r['context']}: {what} skipped: {r[f'{what}_skipped']}")
            path = write_json(args.name, {"config": vars(args), "world_size": world, "rows": rows,
                                          "cascade_rows": cascade_rows})
            png = RESULTS / f"{args.name}.png"
            plot(rows, args, world, png)
            print(f"wrote {path} and {png}")
            write_tables(args.name)
            print(table(rows, cols))
            if cascade_rows:
                print(table(cascade_rows, ["batch", "context", "single_graph_us", "single_call_us", "local_graph_us"]
                            + [f"{c}_{x}_{m}" for x in args.exchanges for c, m in
                               (("merge", "graph_us"), ("cp", "graph_us"), ("cp", "call_us"), ("speedup", "graph"),
                                ("speedup", "call"))]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
