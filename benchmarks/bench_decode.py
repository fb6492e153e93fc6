"""Decode attention on one GPU, side by side: cp_attention.flash_decode, torch SDPA (default backend
selection, and forced to the flash backend as a second line), FlashInfer 0.7.2's XQA kernel (page 64)
and its FA2 tensor-core paged decode (page 16); optionally XQA and cp_attention on FP8 e4m3 copies of the
cache (``--impls ... flashinfer_xqa_fp8 cp_attention_fp8``; the FP8 bars: ``--impls cp_attention
cp_attention_fp8 flashinfer_xqa_fp8 --shapes 1x128k 1x1M 16x32k 64x8k --heads``).

bf16, Hq=32, Hkv=8, D=128 (``--dtype`` changes the dtype). Shapes: B in {1, 4, 16, 64} x T in {2k, 8k,
32k, 128k}; B=1 at T in {512, 1k, 4k, 16k, 64k, 256k, 1M}; other head shapes (Hq, Hkv, D) in
{(64, 8, 128), (28, 4, 128), (32, 8, 64), (16, 8, 256)} at B=1 T=128k and B=16 T=32k. ``--quick``: B=1
T=8k, B=1 T=128k, B=16 T=32k, B=64 T=8k only.

Per implementation and shape: median µs per call (``triton.testing.do_bench``, L2 flushed before each
call) and per call in a CUDA graph of 20 calls (L2 flushed before each replay: see benchmarks/_harness.py;
a cache smaller than the L2 is then partly read from the L2); TB/s = K+V bytes of the implementation's
cache / time; the graph TB/s as a fraction of a Triton streaming read's 4.47 TB/s; max |o - o_cp_attention|; for
the SDPA lines, the GPU kernels one call launches (which kernel torch picked); per shape, flash_decode's
split count (cp_attention.heuristics.decode_plan). Peers that copy the cache into pages do so before
timing and free it after; one that would not fit in free memory is skipped with the reason, one that
fails records its error, and the other numbers stay.

    PYTHONPATH=. python3 benchmarks/bench_decode.py        # all shapes; none started after --time-budget-s
    PYTHONPATH=. python3 benchmarks/bench_decode.py --quick
    PYTHONPATH=. python3 benchmarks/bench_decode.py --shapes 1x128k 64x8k --heads --impls cp_attention sdpa

The FlashInfer rows need flashinfer-python 0.7.2.post1 (with apache-tvm-ffi) importable, e.g. installed from a
directory of wheels into a site directory ``$SITE`` (each FlashInfer kernel JIT-compiles on first use, which
needs ``CUDA_HOME``); without it those rows record the import error and the others still run:

    python3 -m pip install -q --no-index --no-deps --target "$SITE" WHEELS/*.whl
    PYTHONPATH="$SITE":. CUDA_HOME=/usr/local/cuda FLASHINFER_WORKSPACE_BASE="$SITE" python3 benchmarks/bench_decode.py --quick

Writes benchmarks/results/<name>.json (after every shape) and <name>.png (TB/s against context, a panel
per batch size and one for the other head shapes); the output ends with a compact table.
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peers  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    DTYPES, GRAPH_CALLS, RESULTS, TOLERANCES, bench_call, bench_graph, draw_references, kernel_names,
    max_abs_diff, read_references, table, tbs, tqdm, write_json, write_tables,
)


class Impl(NamedTuple):
    build: Callable  # (q, k, v) -> zero-argument callable computing o
    copy: float = 0.0  # bytes of the implementation's own copy of the cache / K+V bytes of the dense cache
    fp8: bool = False  # it reads an FP8 copy: half the bytes, the FP8 tolerance
    kernels: bool = False  # record the kernels one call launches (which kernel SDPA picked), after the timings


IMPLS = {
    "cp_attention": Impl(peers.cp_attention),
    "sdpa": Impl(peers.sdpa_default, kernels=True),
    "sdpa_flash": Impl(peers.sdpa_flash, kernels=True),
    "flashinfer_xqa": Impl(peers.flashinfer_xqa, copy=1.0),
    "flashinfer_fa2": Impl(peers.flashinfer_fa2, copy=1.0),
    "flashinfer_xqa_fp8": Impl(functools.partial(peers.flashinfer_xqa, fp8=True), copy=0.5, fp8=True),
    "cp_attention_fp8": Impl(peers.cp_attention_fp8, copy=0.5, fp8=True),
}
DEFAULT_IMPLS = ["cp_attention", "sdpa", "sdpa_flash", "flashinfer_xqa", "flashinfer_fa2"]
HEADS = (32, 8, 128)
SHAPES = [f"{b}x{t}" for b in (1, 4, 16, 64) for t in ("2k", "8k", "32k", "128k")] + \
    [f"1x{t}" for t in ("512", "1k", "4k", "16k", "64k", "256k", "1M")]
QUICK_SHAPES = ["1x8k", "1x128k", "16x32k", "64x8k"]
OTHER_HEADS = ["64,8,128", "28,4,128", "32,8,64", "16,8,256"]
HEAD_SHAPES = ["1x128k", "16x32k"]
MEMORY_MARGIN = 4 << 30  # free bytes left over after a peer's copy of the cache


def tokens(s: str) -> int:
    """'512' -> 512, '8k' -> 8192, '1M' -> 1048576."""
    mult = {"k": 1 << 10, "K": 1 << 10, "m": 1 << 20, "M": 1 << 20}.get(s[-1])
    return int(s[:-1]) * mult if mult else int(s)


def tokens_str(t: int) -> str:
    for unit, size in (("M", 1 << 20), ("k", 1 << 10)):
        if t >= size and t % size == 0:
            return f"{t // size}{unit}"
    return str(t)


def cases(args) -> list[dict]:
    """Every shape to run: ``{"panel", "B", "T", "Hq", "Hkv", "D"}``."""
    out = []
    for s in args.shapes:
        b, t = s.split("x")
        out.append({"panel": f"B={int(b)}", "B": int(b), "T": tokens(t), "Hq": HEADS[0], "Hkv": HEADS[1],
                    "D": HEADS[2]})
    for h in args.heads:
        hq, hkv, d = map(int, h.split(","))
        for s in args.head_shapes:
            b, t = s.split("x")
            out.append({"panel": "other heads", "B": int(b), "T": tokens(t), "Hq": hq, "Hkv": hkv, "D": d})
    return out


def release():
    gc.collect()
    torch.cuda.empty_cache()


def measure(name, q, k, v, ref, row, kv_bytes, dtype):
    """Build, check and time one implementation on one shape into ``row``; never raises."""
    impl = IMPLS[name]
    fn = None
    try:
        release()
        need = impl.copy * kv_bytes + MEMORY_MARGIN
        free = torch.cuda.mem_get_info(q.device)[0]
        if impl.copy and need > free:
            row[f"{name}_skipped"] = f"its copy of the cache needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
            return
        fn = impl.build(q, k, v)
        out = fn()
        if ref is not None:
            diff = row[f"{name}_maxdiff"] = max_abs_diff(out, ref)
            row[f"{name}_ok"] = diff != "non-finite" and diff <= TOLERANCES[torch.float8_e4m3fn if impl.fp8 else dtype]
        nbytes = kv_bytes / 2 if impl.fp8 else kv_bytes
        for mode, bench in (("call", bench_call), ("graph", bench_graph)):
            us = bench(fn)
            row[f"{name}_{mode}_us"] = us
            row[f"{name}_{mode}_TBs"] = tbs(nbytes, us)
        stream = read_references()["stream_read_TBs"]
        if stream:
            row[f"{name}_graph_vs_stream"] = row[f"{name}_graph_TBs"] / stream
    except Exception as e:  # a failing peer must not lose the other numbers
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:400]
        tqdm.write(f"[B={row['B']} T={row['T']} {row['heads']}] {name}: {row[f'{name}_error']}", file=sys.stderr)
    finally:
        del fn
        release()


def record_kernels(rows, impls, dtype):
    """The kernels one call launches, for the implementations that ask (``Impl.kernels``), on every row's
    shape (zero inputs: the choice depends on shapes only). Profiled after all the timings: a profiler
    session slows every later launch of the process (benchmarks/_harness.py)."""
    for r in rows:
        for name in impls:
            if not IMPLS[name].kernels:
                continue
            try:
                q = torch.zeros(r["B"], r["Hq"], r["D"], device="cuda", dtype=dtype)
                k = torch.zeros(r["B"], r["Hkv"], r["T"], r["D"], device="cuda", dtype=dtype)
                r[f"{name}_kernels"] = kernel_names(IMPLS[name].build(q, k, k))
            except Exception as e:
                r[f"{name}_kernels_error"] = f"{type(e).__name__}: {e}"[:400]
            finally:
                q = k = None
                release()


def run_case(case, args, dtype):
    b, t, hq, hkv, d = case["B"], case["T"], case["Hq"], case["Hkv"], case["D"]
    row = dict(case, heads=f"{hq}/{hkv}/{d}")
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, hq, d, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dtype)
    kv_bytes = 2 * k.numel() * k.element_size()
    row.update(KV_MB=kv_bytes / 1e6, splits=peers.cp_splits(q, k))
    try:
        ref = peers.cp_attention(q, k, v)().float()
    except Exception as e:  # the peers still run, unchecked
        ref, row["reference_error"] = None, f"{type(e).__name__}: {e}"[:400]
    for name in args.impls:
        measure(name, q, k, v, ref, row, kv_bytes, dtype)
    del q, k, v, ref
    release()
    return row


def plot(rows, impls, path, refs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(r["panel"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        rs = [r for r in rows if r["panel"] == panel]
        other = panel == "other heads"
        if other:  # categorical x: one position per (heads, B, T)
            labels = [f"{r['heads']}\nB={r['B']} T={tokens_str(r['T'])}" for r in rs]
            xs = list(range(len(rs)))
        else:
            rs.sort(key=lambda r: r["T"])
            xs = [r["T"] for r in rs]
        for i, name in enumerate(impls):
            for mode, style in (("graph", "-"), ("call", ":")):
                pts = [(x, r[f"{name}_{mode}_TBs"]) for x, r in zip(xs, rs) if f"{name}_{mode}_TBs" in r]
                if pts:
                    label = f"{name} ({'graph' if mode == 'graph' else 'per call'})"
                    ax.plot(*zip(*pts), "o" + ("" if other else style), color=f"C{i}",
                            mfc="none" if mode == "call" else None, label=label)
        draw_references(ax, refs)
        if other:
            ax.set_xticks(xs, labels, fontsize=6, rotation=60)
        else:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context T (tokens)")
        ax.set_title(panel if other else f"{panel}, Hq/Hkv/D = {'/'.join(map(str, HEADS))}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TB/s (K+V bytes / time)")
    legend = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=6, fontsize=7)
    fig.suptitle(f"decode attention, one GPU: graph = {GRAPH_CALLS} calls per CUDA graph, L2 flushed per replay")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(rows) -> list[dict]:
    """The compact table: graph and per-call µs of the main implementations, and cp_attention / SDPA."""
    out = []
    for r in rows:
        s = {"B": r["B"], "T": tokens_str(r["T"]), "heads": r["heads"]}
        for key, name, mode in (("cp graph", "cp_attention", "graph"), ("sdpa graph", "sdpa", "graph"),
                                ("xqa graph", "flashinfer_xqa", "graph"), ("fa2 graph", "flashinfer_fa2", "graph"),
                                ("xqa8 graph", "flashinfer_xqa_fp8", "graph"), ("cp8 graph", "cp_attention_fp8", "graph"),
                                ("cp call", "cp_attention", "call"), ("sdpa call", "sdpa", "call")):
            if f"{name}_{mode}_us" in r:
                s[key] = r[f"{name}_{mode}_us"]
        for mode in ("graph", "call"):
            if f"cp {mode}" in s and f"sdpa {mode}" in s:
                s[f"cp/sdpa {mode}"] = s[f"cp {mode}"] / s[f"sdpa {mode}"]
        if "cp8 graph" in s and "cp graph" in s:
            s["cp8/cp graph"] = s["cp8 graph"] / s["cp graph"]
        out.append(s)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", metavar="BxT", help="shapes at Hq/Hkv/D = 32/8/128, e.g. 1x128k 64x2048 "
                    "(default: the full list, or the --quick one)")
    ap.add_argument("--heads", nargs="*", metavar="HQ,HKV,D",
                    help=f"other head shapes (default: {' '.join(OTHER_HEADS)}; none with --quick; no value: none)")
    ap.add_argument("--head-shapes", nargs="+", default=HEAD_SHAPES, metavar="BxT", help="shapes of the --heads")
    ap.add_argument("--quick", action="store_true", help="four shapes only: B=1 T=8k, B=1 T=128k, B=16 T=32k, B=64 T=8k")
    ap.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, choices=list(IMPLS))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--time-budget-s", type=float, default=420.0,
                    help="start no new shape after this many seconds (what was measured is still written)")
    ap.add_argument("--name", default="bench_decode", help="results file stem under benchmarks/results/")
    args = ap.parse_args()
    if args.shapes is None:
        args.shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.heads is None:
        args.heads = [] if args.quick else OTHER_HEADS

    start = time.monotonic()
    dtype = DTYPES[args.dtype]
    todo = cases(args)
    rows, not_run = [], []
    refs = read_references()
    config = {"dtype": args.dtype, "impls": args.impls, "graph_calls": GRAPH_CALLS,
              **refs, "xqa_page_size": 64,
              "fa2_page_size": 16,
              "timing": "triton.testing.do_bench median (L2 flushed before each call / each graph replay)"}
    for case in tqdm(todo, desc="decode shapes"):
        if time.monotonic() - start > args.time_budget_s:
            not_run.append(case)
            continue
        rows.append(run_case(case, args, dtype))
        write_json(args.name, {"config": config, "rows": rows, "not_run": not_run})
    record_kernels(rows, args.impls, dtype)
    json_path = write_json(args.name, {"config": config, "rows": rows, "not_run": not_run})
    png = RESULTS / f"{args.name}.png"
    if rows:
        plot(rows, args.impls, png, refs)

    for r in rows:
        where = f"B={r['B']} T={tokens_str(r['T'])} {r['heads']}"
        for key, val in r.items():
            if key.endswith(("error", "_skipped")):
                print(f"{where}: {key} = {val}")
            elif key.endswith("_ok") and not val:
                print(f"{where}: {key[:-3]} max |o - o_cp_attention| = {r[key[:-3] + '_maxdiff']}")
    kernels = {}  # (impl, kernel names without template arguments) -> shapes (full names in the JSON)
    for r in rows:
        for name in ("sdpa", "sdpa_flash"):
            if f"{name}_kernels" in r:
                short = tuple(k.removeprefix("void ").split("<")[0].split("(")[0] for k in r[f"{name}_kernels"])
                kernels.setdefault((name, short), []).append(f"{r['B']}x{tokens_str(r['T'])}({r['heads']})")
    for (name, short), where in kernels.items():
        print(f"{name} kernels {', '.join(short)} at {' '.join(where)}")
    if not_run:
        skipped = " ".join(f"{c['B']}x{tokens_str(c['T'])}({c['Hq']}/{c['Hkv']}/{c['D']})" for c in not_run)
        print(f"time budget of {args.time_budget_s:g} s reached, not run: {skipped}")
    print(f"wrote {json_path}" + (f" and {png}" if rows else ""))
    write_tables(args.name)
    print(table(summary(rows), ["B", "T", "heads", "cp graph", "sdpa graph", "xqa graph", "fa2 graph", "xqa8 graph",
                                "cp8 graph", "cp call", "sdpa call", "cp/sdpa graph", "cp/sdpa call", "cp8/cp graph"]))


if __name__ == "__main__":
    main()
