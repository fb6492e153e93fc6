"""Sliding windows, logit softcaps and attention sinks on one GPU: what each costs over the plain kernel.

bf16, Hq=32, Hkv=8, D=128, every sequence at the full context T; µs per call with 20 calls in one CUDA graph
(benchmarks/_harness.py). Sections:

* ``window``: B=1 with a 4k window at T = 128k and 1M, against a plain decode over 4k + 1 tokens (the bar:
  within 10%, since a windowed call should read only the window);
* ``softcap-sinks``: B=1 T=128k and B=64 T=8k, plain against a softcap of 30, sinks, and both (the bar:
  at most 5% over plain).

    PYTHONPATH=. python3 benchmarks/bench_variants.py

Writes benchmarks/results/bench_variants.json and bench_variants.png (graph µs per variant, each section
against its plain call; ``--plot-only`` redraws the PNG from the JSON, no GPU needed).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import RESULTS, measure, table, write_json, write_tables  # noqa: E402
from cp_attention import flash_decode  # noqa: E402

HQ, HKV, D, DT = 32, 8, 128, torch.bfloat16
WINDOW = 4096


def inputs(b, t):
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, HQ, D, generator=gen, device="cuda", dtype=DT)
    k = torch.randn(b, HKV, t, D, generator=gen, device="cuda", dtype=DT)
    v = torch.randn(b, HKV, t, D, generator=gen, device="cuda", dtype=DT)
    return q, k, v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", default=["window", "softcap-sinks"], choices=["window", "softcap-sinks"])
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON and exit")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads((RESULTS / "bench_variants.json").read_text())["rows"])
        return
    rows = []
    sinks = torch.linspace(-1.0, 1.0, HQ, device="cuda")
    if "window" in args.sections:
        q, k, v = inputs(1, WINDOW + 1)
        plain = {"section": "window", "B": 1, "T": WINDOW + 1, "what": "plain"}
        measure(plain, "cp", lambda: (lambda: flash_decode(q, k, v)), where="plain 4k")
        rows.append(plain)
        for t in (131072, 1048576):
            q, k, v = inputs(1, t)
            row = {"section": "window", "B": 1, "T": t, "what": f"window {WINDOW}"}
            ref = flash_decode(q[:, :, :], k[:, :, -WINDOW - 1:], v[:, :, -WINDOW - 1:])
            measure(row, "cp", lambda: functools.partial(flash_decode, q, k, v, window_left=WINDOW), ref, f"T={t}")
            row["vs_plain_window"] = row.get("cp_graph_us", float("nan")) / plain["cp_graph_us"]
            rows.append(row)
            del q, k, v
            torch.cuda.empty_cache()
    if "softcap-sinks" in args.sections:
        for b, t in ((1, 131072), (64, 8192)):
            q, k, v = inputs(b, t)
            base = None
            for what, kw in (("plain", {}), ("softcap 30", {"logit_softcap": 30.0}), ("sinks", {"sinks": sinks}),
                             ("softcap + sinks", {"logit_softcap": 30.0, "sinks": sinks})):
                row = {"section": "softcap-sinks", "B": b, "T": t, "what": what}
                measure(row, "cp", lambda kw=kw: functools.partial(flash_decode, q, k, v, **kw), where=f"{b}x{t} {what}")
                base = base or row.get("cp_graph_us")
                row["vs_plain"] = row.get("cp_graph_us", float("nan")) / base
                rows.append(row)
            del q, k, v
            torch.cuda.empty_cache()
    path = write_json("bench_variants", {"rows": rows})
    plot(rows)
    print(f"wrote {path} and {RESULTS / 'bench_variants.png'}")
    write_tables("bench_variants")
    print(table(rows, ["section", "B", "T", "what", "cp_graph_us", "cp_call_us", "vs_plain_window", "vs_plain"]))


def plot(rows):
    """Graph µs of every row, one bar per variant, grouped by (section, B, T); the plain call of a group (for
    the window section: the plain 4k + 1 decode) drawn first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "cp_graph_us" in r]
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(rows)), 4))
    labels = [f"{r['what']}\nB={r['B']} T={r['T']}" for r in rows]
    colors = ["grey" if r["what"] == "plain" else "tab:blue" for r in rows]
    ax.bar(range(len(rows)), [r["cp_graph_us"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        ratio = r.get("vs_plain_window", r.get("vs_plain"))
        if ratio is not None and r["what"] != "plain":
            ax.annotate(f"{ratio:.3f}x", (i, r["cp_graph_us"]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (CUDA graph of 20)")
    ax.set_title("flash_decode variants against the plain call (bf16, 32/8/128)")
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_variants.png", dpi=120)


if __name__ == "__main__":
    main()
