"""FP8 caches beyond the plain one-row call: draft rows, windows, softcaps with sinks, and row limits.

e4m3 caches (per-tensor scales), Hq=32, Hkv=8, D=128, every sequence at the full context T. Each case runs the
same call three ways: on the bf16 cache, on the e4m3 cache with the policy's plan (the one-warp kernel on sm_90
where ``heuristics.one_warp_fp8`` and ``one_warp_plan`` take the call), and on the e4m3 cache with the Triton
kernel's plan (``decode_plan``: the Triton FP8 kernel on the same call). µs per call with 20 calls captured in
one CUDA graph and per eager call (benchmarks/_harness.py). Sections:

* ``rows``: B=1 T=128k and B=16 T=32k with Q = 1, 4, 5 and 8 query rows (the causal rule among the drafts),
  i.e. 4, 16, 20 and 32 rows per KV head;
* ``variants``: B=1 T=128k and B=64 T=8k: a window of 4096 (Q=1 and Q=4), a softcap of 30 with sinks, and
  the row limits a context-parallel rank passes (Q=4, each row's first and end position; here the whole cache);
  and the plain call over the 4097 positions a window reads (B=1).

    PYTHONPATH=. python3 benchmarks/bench_fp8_variants.py

Writes benchmarks/results/bench_fp8_variants.json and bench_fp8_variants.png (``--plot-only`` redraws the PNG
from the JSON, no GPU needed).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import RESULTS, TOLERANCES, measure, table, tqdm, write_json, write_tables  # noqa: E402
from cp_attention import flash_decode, quantize_kv  # noqa: E402
from benchmarks.peers import sm_count  # noqa: E402
from cp_attention.heuristics import FP8_ONE_WARP_LONG, decode_plan, one_warp_fp8, one_warp_plan  # noqa: E402

HQ, HKV, D, DT = 32, 8, 128, torch.bfloat16
WINDOW = 4096
IMPLS = ("bf16", "e4m3 triton", "e4m3")


def cases(sections):
    """``(section, B, T, Q, what, kwargs)``; ``kwargs`` may name ``row_limits`` (built per case)."""
    out = []
    if "rows" in sections:
        for b, t in ((1, 131072), (16, 32768)):
            for q_rows in (1, 4, 5, 8):
                out.append(("rows", b, t, q_rows, f"Q={q_rows} ({q_rows * HQ // HKV} rows)", {}))
    if "variants" in sections:
        out.append(("variants", 1, WINDOW + 1, 1, f"plain, T={WINDOW + 1}", {}))  # what a window reads
        for b, t in ((1, 131072), (64, 8192)):
            out += [("variants", b, t, 1, f"window {WINDOW}", {"window_left": WINDOW}),
                    ("variants", b, t, 4, f"window {WINDOW}, Q=4", {"window_left": WINDOW}),
                    ("variants", b, t, 1, "softcap 30 + sinks", {"logit_softcap": 30.0, "sinks": True}),
                    ("variants", b, t, 4, "row limits, Q=4", {"row_limits": True})]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", default=["rows", "variants"], choices=["rows", "variants"])
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON and exit")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads((RESULTS / "bench_fp8_variants.json").read_text())["rows"])
        return
    rows = []
    for section, b, t, q_rows, what, kw in tqdm(cases(args.sections), desc="fp8 variants"):
        gen = torch.Generator("cuda").manual_seed(0)
        q = torch.randn(b, q_rows, HQ, D, generator=gen, device="cuda", dtype=DT)
        k = torch.randn(b, HKV, t, D, generator=gen, device="cuda", dtype=DT)
        v = torch.randn(b, HKV, t, D, generator=gen, device="cuda", dtype=DT)
        k8, v8, k_scale, v_scale = quantize_kv(k, v)
        kw = dict(kw)
        if kw.pop("sinks", False):
            kw["sinks"] = torch.linspace(-1.0, 1.0, HQ, device="cuda")
        if kw.pop("row_limits", False):  # each row's [first, end): the causal rule, as a rank holding every position
            end = t - q_rows + 1 + torch.arange(q_rows, device="cuda")
            kw["row_limits"] = torch.stack([torch.zeros_like(end), end], -1).expand(b, q_rows, 2).int().contiguous()
        rows_kv = q_rows * HQ // HKV
        reach = t if "window_left" not in kw else min(t, WINDOW + q_rows)
        plan = decode_plan(b, HKV, reach, D, DT, sm_count(q.device), kv_dtype=torch.float8_e4m3fn,
                           aligned="window_left" not in kw and "row_limits" not in kw, rows=rows_kv)
        # the policy's kernel: a window's (or row limits') splits start a tile below the first key
        one_warp = (one_warp_fp8(q.device, torch.float8_e4m3fn, D, rows_kv, reach, True)
                    and one_warp_plan(b, HKV, min(t, reach + FP8_ONE_WARP_LONG.block_n - 1), sm_count(q.device),
                                      rows=rows_kv) is not None)
        row = {"section": section, "B": b, "T": t, "Q": q_rows, "what": what,
               "e4m3_kernel": "one-warp" if one_warp else "triton"}
        ref = flash_decode(q, k, v, **kw)
        where = f"{section} B={b} T={t} {what}"
        measure(row, "bf16", lambda: functools.partial(flash_decode, q, k, v, **kw), where=where)
        fp8 = functools.partial(flash_decode, q, k8, v8, k_scale=k_scale, v_scale=v_scale, **kw)
        measure(row, "e4m3 triton", lambda: functools.partial(fp8, plan=plan), ref, where)
        measure(row, "e4m3", lambda: fp8, ref, where)
        for name in IMPLS[1:]:
            if f"{name}_graph_us" in row:
                row[f"{name}_ok"] = row[f"{name}_maxdiff"] != "non-finite" and \
                    row[f"{name}_maxdiff"] <= TOLERANCES[torch.float8_e4m3fn]
                row[f"{name} / bf16"] = row[f"{name}_graph_us"] / row["bf16_graph_us"]
        rows.append(row)
        write_json("bench_fp8_variants", {"rows": rows})
        del q, k, v, k8, v8, ref
        torch.cuda.empty_cache()
    path = write_json("bench_fp8_variants", {"rows": rows})
    plot(rows)
    for r in rows:
        for key, val in r.items():
            if key.endswith("_error") or (key.endswith("_ok") and not val):
                print(f"{r['section']} B={r['B']} T={r['T']} {r['what']}: {key} = {val}")
    print(f"wrote {path} and {RESULTS / 'bench_fp8_variants.png'}")
    write_tables("bench_fp8_variants")
    print(table(rows, ["section", "B", "T", "what", "e4m3_kernel", "bf16_graph_us", "e4m3 triton_graph_us",
                       "e4m3_graph_us", "e4m3 triton / bf16", "e4m3 / bf16"]))


def plot(rows):
    """Graph µs of each case: bf16, the Triton FP8 kernel and the policy's FP8 call side by side, with the FP8
    call's ratio to bf16 above its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 4.5))
    width = 0.27
    for j, (name, color) in enumerate(zip(IMPLS, ("grey", "tab:orange", "tab:blue"))):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ax.bar(xs, [r.get(f"{name}_graph_us", 0) for r in rows], width, label=name, color=color)
    for i, r in enumerate(rows):
        if "e4m3 / bf16" in r:
            ax.annotate(f"{r['e4m3 / bf16']:.2f}x", (i + width, r["e4m3_graph_us"]), ha="center", va="bottom",
                        fontsize=6)
    ax.set_xticks(range(len(rows)), [f"{r['what']}\nB={r['B']} T={r['T']}" for r in rows], fontsize=6, rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (CUDA graph of 20)")
    ax.set_title("FP8 (e4m3) caches: draft rows and variants, 32/8/128, H200")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_fp8_variants.png", dpi=120)


if __name__ == "__main__":
    main()
