"""The merge kernel (⊕ over N states) on the GPU: achieved GB/s against the 4.47 TB/s read ceiling, and its
agreement with the torch path.

    PYTHONPATH=. python benchmarks/bench_merge.py

Writes benchmarks/results/bench_merge.json and bench_merge.png.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import READ_CEILING_TBS, RESULTS, bench_eager, bench_graph, table, write_json  # noqa: E402
from cp_attention import merge_states  # noqa: E402
from cp_attention.state import _merge_states_torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--states", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--shape", type=int, nargs=3, default=[64, 32, 128], metavar=("B", "H", "D"))
    args = ap.parse_args()
    b, h, d = args.shape
    rows = []
    for dtype in tqdm([torch.bfloat16, torch.float32], desc="dtypes"):
        for n in args.states:
            o = torch.randn(n, b, h, d, device="cuda").to(dtype)
            lse = (torch.rand(n, b, h, device="cuda") - 0.5) * 200
            got = merge_states(o, lse)
            want = _merge_states_torch(o, lse)
            nbytes = o.numel() * o.element_size() + lse.numel() * 4 + got.o.numel() * got.o.element_size() + got.lse.numel() * 4
            r = {"dtype": str(dtype)[6:], "N": n, "MB": nbytes / 1e6,
                 "max_abs_diff_vs_torch": float((got.o.float() - want.o.float()).abs().max()),
                 "lse_max_abs_diff": float((got.lse - want.lse).abs().max())}
            for mode, bench in (("eager", bench_eager), ("graph", bench_graph)):
                us = bench(lambda: merge_states(o, lse))
                r[f"{mode}_us"] = us
                r[f"{mode}_TBs"] = nbytes / us / 1e6
            r["torch_path_us"] = bench_eager(lambda: _merge_states_torch(o, lse))
            rows.append(r)
    path = write_json("bench_merge", {"config": {"B": b, "H": h, "D": d, "read_ceiling_TBs": READ_CEILING_TBS},
                                      "rows": rows})
    print(table(rows, ["dtype", "N", "MB", "eager_us", "eager_TBs", "graph_us", "graph_TBs", "torch_path_us",
                       "max_abs_diff_vs_torch"]))
    print(f"wrote {path}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for dt in ("bfloat16", "float32"):
        rs = [r for r in rows if r["dtype"] == dt]
        ax.plot([r["N"] for r in rs], [r["graph_TBs"] for r in rs], "o-", label=f"o {dt} (graph)")
        ax.plot([r["N"] for r in rs], [r["eager_TBs"] for r in rs], "o:", label=f"o {dt} (eager)")
    ax.axhline(READ_CEILING_TBS, color="k", ls="--", lw=0.8, label="read ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("states merged N")
    ax.set_ylabel("TB/s (bytes read + written / time)")
    ax.set_title(f"merge_states, B={b} H={h} D={d}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_merge.png", dpi=120)


if __name__ == "__main__":
    main()
