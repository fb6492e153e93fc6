"""Paged KV caches and multi-row queries on one GPU: cp_attention.flash_decode on page pools against the same
kernel on the dense cache, against FlashInfer 0.7.2 on the same pages (XQA and the fa2 tensor-core wrapper),
and Q = 4 draft rows against one row.

bf16, Hq=32, Hkv=8, D=128 (but ``d256``), every sequence at the full context T; every pool's page table is a
random permutation of its pages, as in a serving cache (``peers.paged``), the same for the library and the
peers. Sections (``--sections``):

* ``page-vs-dense``: B=1 T=128k and B=64 T=8k, dense and pages of 1, 16 and 64 slots;
* ``peers``: B in {1, 4, 16, 64} x T in {2k, 8k, 32k, 128k} at pages of 16 and 64: cp_attention paged,
  FlashInfer XQA (page 16 or 64) and FlashInfer fa2 tensor cores on the same page size;
* ``drafts``: B=32 T=8k with Q=4 rows (the causal rule among the drafts) against Q=1 (the same bytes), and
  FlashInfer's 4-row paths: XQA and fa2 with ``q_len_per_req=4``;
* ``fp8``: e4m3 page pools (per-tensor scales) of 1, 16, 64, 128 and 256 slots at the FP8 bar's shapes (B=1
  T=128k and 1M, B=16 T=32k, B=64 T=8k) against the dense e4m3 cache, the dense bf16 cache and FlashInfer's
  XQA on e4m3 pages of 16, 64 and 128 (run it with ``--name bench_paged_fp8`` to keep the 16-bit results);
* ``d256``: head dim 256 (Hq=16, Hkv=8), bf16 and e4m3 at B=1 T=128k, B=16 T=32k and B=64 T=8k: the dense
  cache and pools of 16, 64 and 256 slots against XQA on pages of 16 and 64 (``--name bench_paged_d256``).

µs per call with 20 calls captured in one CUDA graph and per eager call (benchmarks/_harness.py), TB/s of
the K+V bytes read (one byte an element for e4m3). Needs FlashInfer for the peer lines (installed as
bench_decode.py's docstring says; without it those rows record the import error):

    PYTHONPATH="$SITE":. python3 benchmarks/bench_paged.py
    PYTHONPATH=. python3 benchmarks/bench_paged.py --sections page-vs-dense drafts
    PYTHONPATH="$SITE":. python3 benchmarks/bench_paged.py --sections fp8 --name bench_paged_fp8
    PYTHONPATH="$SITE":. python3 benchmarks/bench_paged.py --sections d256 --name bench_paged_d256

Writes benchmarks/results/bench_paged.json and bench_paged.png (``--name`` to change the file names).
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peers  # noqa: E402
from benchmarks._harness import RESULTS, TOLERANCES, measure, table, tbs, tqdm, write_json, write_tables  # noqa: E402
from cp_attention import flash_decode  # noqa: E402

HQ, HKV, D, DT = 32, 8, 128, torch.bfloat16
SECTIONS = ("page-vs-dense", "peers", "drafts", "fp8", "d256")
FP8_SHAPES = ((1, 131072), (16, 32768), (64, 8192), (1, 1 << 20))


def cases(sections):
    """``(section, B, T, Q, Hq, D, {name: build})`` of each shape in ``sections``."""
    out = []
    if "page-vs-dense" in sections:
        for b, t in ((1, 131072), (64, 8192)):
            impls = {"cp dense": peers.cp_attention}
            for p in (1, 16, 64):
                impls[f"cp page {p}"] = functools.partial(peers.cp_attention_paged, page_size=p)
            out.append(("page-vs-dense", b, t, 1, HQ, D, impls))
    if "peers" in sections:
        for b in (1, 4, 16, 64):
            for t in (2048, 8192, 32768, 131072):
                impls = {}
                for p in (16, 64):
                    impls[f"cp page {p}"] = functools.partial(peers.cp_attention_paged, page_size=p)
                    impls[f"xqa page {p}"] = functools.partial(peers.flashinfer_xqa, page_size=p)
                    impls[f"fa2 page {p}"] = functools.partial(peers.flashinfer_fa2, page_size=p)
                out.append(("peers", b, t, 1, HQ, D, impls))
    if "drafts" in sections:
        for q_rows in (1, 4):
            out.append(("drafts", 32, 8192, q_rows, HQ, D, {
                "cp dense": peers.cp_attention,
                "cp page 16": functools.partial(peers.cp_attention_paged, page_size=16),
                "xqa page 16": functools.partial(peers.flashinfer_xqa, page_size=16),
                "fa2 page 16": functools.partial(peers.flashinfer_fa2, page_size=16)}))
    if "fp8" in sections:
        for b, t in FP8_SHAPES:
            impls = {"cp dense": peers.cp_attention, "cp dense e4m3": peers.cp_attention_fp8}
            for p in (1, 16, 64, 128, 256):
                impls[f"cp page {p} e4m3"] = functools.partial(peers.cp_attention_paged, page_size=p, fp8=True)
            for p in (16, 64, 128):
                impls[f"xqa page {p} e4m3"] = functools.partial(peers.flashinfer_xqa, page_size=p, fp8=True)
            out.append(("fp8", b, t, 1, HQ, D, impls))
    if "d256" in sections:
        for b, t in ((1, 131072), (16, 32768), (64, 8192)):
            impls = {}
            for fp8, tag in ((False, ""), (True, " e4m3")):
                impls[f"cp dense{tag}"] = peers.cp_attention_fp8 if fp8 else peers.cp_attention
                for p in (16, 64, 256):
                    impls[f"cp page {p}{tag}"] = functools.partial(peers.cp_attention_paged, page_size=p, fp8=fp8)
                for p in (16, 64):
                    impls[f"xqa page {p}{tag}"] = functools.partial(peers.flashinfer_xqa, page_size=p, fp8=fp8)
            out.append(("d256", b, t, 1, 16, 256, impls))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS[:3]), choices=SECTIONS,
                    help="default: the 16-bit sections")
    ap.add_argument("--time-budget-s", type=float, default=420.0,
                    help="start no new shape after this many seconds (what was measured is still written)")
    ap.add_argument("--name", default="bench_paged", help="file name of the JSON and PNG in benchmarks/results/")
    args = ap.parse_args()
    start = time.monotonic()
    rows, not_run = [], []
    for section, b, t, q_rows, hq, d, impls in tqdm(cases(args.sections), desc="paged shapes"):
        if time.monotonic() - start > args.time_budget_s:
            not_run.append(f"{section} B={b} T={t} Q={q_rows}")
            continue
        gen = torch.Generator("cuda").manual_seed(0)
        shape = (b, hq, d) if q_rows == 1 else (b, q_rows, hq, d)
        q = torch.randn(shape, generator=gen, device="cuda", dtype=DT)
        k = torch.randn(b, HKV, t, d, generator=gen, device="cuda", dtype=DT)
        v = torch.randn(b, HKV, t, d, generator=gen, device="cuda", dtype=DT)
        kv_bytes = 2 * k.numel() * k.element_size()
        ref = flash_decode(q, k, v)
        row = {"section": section, "B": b, "T": t, "Q": q_rows, "Hq": hq, "D": d, "KV_MB": kv_bytes / 1e6}
        for name, build in impls.items():
            measure(row, name, functools.partial(build, q, k, v), ref, f"{section} B={b} T={t} Q={q_rows}")
            if f"{name}_graph_us" in row:
                tol = TOLERANCES[torch.float8_e4m3fn if "e4m3" in name else DT]  # FP8: with the quantisation
                row[f"{name}_ok"] = row[f"{name}_maxdiff"] != "non-finite" and row[f"{name}_maxdiff"] <= tol
                row[f"{name}_TBs"] = tbs(kv_bytes // (2 if "e4m3" in name else 1), row[f"{name}_graph_us"])
        rows.append(row)
        write_json(args.name, {"rows": rows, "not_run": not_run})
        del q, k, v, ref
        gc.collect()
        torch.cuda.empty_cache()
    path = write_json(args.name, {"rows": rows, "not_run": not_run})
    if rows:
        plot(rows, args.name)
    for r in rows:
        for key, val in r.items():
            if key.endswith("_error") or (key.endswith("_ok") and not val):
                print(f"{r['section']} B={r['B']} T={r['T']} Q={r['Q']}: {key} = {val}")
    if not_run:
        print("time budget reached, not run:", "; ".join(not_run))
    names = sorted({k[: -len("_graph_us")] for r in rows for k in r if k.endswith("_graph_us")})
    print(f"wrote {path}")
    write_tables(args.name)
    print(table([{**{c: r[c] for c in ("section", "B", "T", "Q")},
                  **{n: r.get(f"{n}_graph_us", "") for n in names}} for r in rows], ["section", "B", "T", "Q"] + names))


def plot(rows, stem):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(rows)), 4))
    names = sorted({k[: -len("_TBs")] for r in rows for k in r if k.endswith("_TBs")})
    labels = [f"{r['section']}\nB={r['B']} T={r['T']} Q={r['Q']}" for r in rows]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [j + i * width for j, r in enumerate(rows) if f"{name}_TBs" in r]
        ys = [r[f"{name}_TBs"] for r in rows if f"{name}_TBs" in r]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 for j in range(len(rows))], labels, fontsize=6, rotation=90)
    ax.set_ylabel("TB/s (K+V bytes / graph time)")
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
