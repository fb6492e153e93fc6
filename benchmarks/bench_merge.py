"""⊕ over N attention states on the GPU: cp_attention.merge_states against the same merge in plain torch
ops and FlashInfer 0.7.2's ``merge_states`` (on its own copy in its layout, base-2 LSE).

o ``[N, B, H, D]`` in bf16 and fp32 with lse ``[N, B, H]`` float32 spread over [-100, 100]; B=64, H=32,
D=128, N in {2, 8, 32}. Per implementation: median µs per call and per call in a CUDA graph of 20 calls
(benchmarks/_harness.py), TB/s = (bytes read + bytes written) / time (a Triton streaming read reaches 4.47 TB/s),
and max |o - o_torch|, max |lse - lse_torch|.

    PYTHONPATH=. python3 benchmarks/bench_merge.py

For the FlashInfer rows, run bench_decode.py's install line first, then ``python3 benchmarks/bench_merge.py``
(the line sets PYTHONPATH); without it they record the import error. Writes
benchmarks/results/bench_merge.json and bench_merge.png.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peers  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    RESULTS, bench_call, bench_graph, draw_references, max_abs_diff, read_references, table, tbs, tqdm, write_json,
    write_tables,
)
from cp_attention import lse_from_base2, merge_states  # noqa: E402

IMPLS = {
    "cp_attention": lambda o, lse: (lambda: merge_states(o, lse)),
    "torch": peers.torch_merge_states,
    "flashinfer": peers.flashinfer_merge_states,
}
LSE_BASE2 = {"flashinfer"}


def measure(name, o, lse, ref, row, nbytes):
    """Check and time one implementation into ``row``; never raises."""
    try:
        fn = IMPLS[name](o, lse)
        out_o, out_lse = fn()
        if name in LSE_BASE2:
            out_lse = lse_from_base2(out_lse)
        row[f"{name}_maxdiff"] = max_abs_diff(out_o, ref[0])
        row[f"{name}_lse_maxdiff"] = max_abs_diff(out_lse, ref[1])
        for mode, bench in (("call", bench_call), ("graph", bench_graph)):
            us = bench(fn)
            row[f"{name}_{mode}_us"] = us
            row[f"{name}_{mode}_TBs"] = tbs(nbytes, us)
    except Exception as e:  # a failing peer must not lose the other numbers
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:400]
        tqdm.write(f"[{row['dtype']} N={row['N']}] {name}: {row[f'{name}_error']}", file=sys.stderr)


def plot(rows, path, refs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 3.8), sharey=True, squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        rs = [r for r in rows if r["dtype"] == dt]
        for i, name in enumerate(IMPLS):
            for mode, style in (("graph", "o-"), ("call", "o:")):
                pts = [(r["N"], r[f"{name}_{mode}_TBs"]) for r in rs if f"{name}_{mode}_TBs" in r]
                if pts:
                    label = f"{name} ({'graph' if mode == 'graph' else 'per call'})"
                    ax.plot(*zip(*pts), style, color=f"C{i}", label=label)
        draw_references(ax, refs)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="states merged N", title=f"o in {dt}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TB/s (bytes read + written / time)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"merge_states, B={rows[0]['B']} H={rows[0]['H']} D={rows[0]['D']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--shape", type=int, nargs=3, default=[64, 32, 128], metavar=("B", "H", "D"))
    args = ap.parse_args()
    b, h, d = args.shape
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for dtype, n in tqdm([(dt, n) for dt in (torch.bfloat16, torch.float32) for n in args.states], desc="merge"):
        o = torch.randn(n, b, h, d, generator=gen, device="cuda").to(dtype)
        lse = (torch.rand(n, b, h, generator=gen, device="cuda") - 0.5) * 200
        ref = peers.torch_merge_states(o, lse)()
        nbytes = (o.numel() * o.element_size() + lse.numel() * 4) * (1 + 1 / n)  # read N states, write one
        row = {"dtype": str(dtype).removeprefix("torch."), "N": n, "B": b, "H": h, "D": d, "MB": nbytes / 1e6}
        for name in IMPLS:
            measure(name, o, lse, ref, row, nbytes)
        rows.append(row)
        del o, lse, ref
        torch.cuda.empty_cache()
    refs = read_references()
    path = write_json("bench_merge", {"config": {"B": b, "H": h, "D": d, **refs}, "rows": rows})
    png = RESULTS / "bench_merge.png"
    plot(rows, png, refs)
    for r in rows:
        for key, val in r.items():
            if key.endswith("_error"):
                print(f"{r['dtype']} N={r['N']}: {key} = {val}")
    print(f"wrote {path} and {png}")
    write_tables("bench_merge")
    print(table(rows, ["dtype", "N", "MB"] + [f"{name}_{m}" for m in ("call_us", "graph_us", "graph_TBs")
                                             for name in IMPLS] + [f"{name}_maxdiff" for name in IMPLS]))


if __name__ == "__main__":
    main()
