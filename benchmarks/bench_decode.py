"""Decode attention side by side on one GPU: cp_attention.flash_decode, torch SDPA (flash backend) and
FlashInfer, eager and replayed from a CUDA graph; achieved TB/s of the KV read against the ceiling.

    PYTHONPATH=. python benchmarks/bench_decode.py            # the full sweep of README's table
    PYTHONPATH=. python benchmarks/bench_decode.py --batches 1 --contexts 131072

Writes benchmarks/results/bench_decode.json and bench_decode.png.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import READ_CEILING_TBS, RESULTS, bench_eager, bench_graph, table, write_json  # noqa: E402
from cp_attention import flash_decode  # noqa: E402
from cp_attention.decode import _num_sms  # noqa: E402
from cp_attention.heuristics import decode_num_splits  # noqa: E402
from cp_attention.ops.merge import merge_states_into  # noqa: E402
from cp_attention.ops.split_kv import default_config  # noqa: E402


def sdpa_fn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4 = q.unsqueeze(2)

    def run():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    return run


def flashinfer_fn(q, k, v, page_size=16):
    """FlashInfer 0.5.0 on its own NHD copy of the cache: single decode for B = 1, else the paged wrapper."""
    import flashinfer

    b, hkv, t, d = k.shape
    hq = q.shape[1]
    if b == 1:
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        return lambda: flashinfer.single_decode_with_kv_cache(q[0], kn, vn, kv_layout="NHD")
    pages = t // page_size
    kp = k.transpose(1, 2).reshape(b * pages, page_size, hkv, d).contiguous()
    vp = v.transpose(1, 2).reshape(b * pages, page_size, hkv, d).contiguous()
    dev = q.device
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * pages
    indices = torch.arange(b * pages, dtype=torch.int32, device=dev)
    last = torch.full((b,), page_size, dtype=torch.int32, device=dev)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    w.plan(indptr, indices, last, hq, hkv, d, page_size, q_data_type=q.dtype, kv_data_type=k.dtype)
    return lambda: w.run(q, (kp, vp))


def combine_share(q, k, v, splits):
    """Time the split kernel + a separate merge kernel, and the merge kernel alone, in µs."""
    b, hq, d = q.shape
    sep = bench_eager(lambda: flash_decode(q, k, v, num_splits=splits, _fuse_combine=False))
    o_part = torch.randn(splits, b * hq, d, device=q.device)
    lse_part = torch.randn(splits, b * hq, device=q.device)
    o = torch.empty(b * hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b * hq, device=q.device)
    merge = bench_eager(lambda: merge_states_into(o_part, lse_part, o, lse))
    return sep, merge


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    ap.add_argument("--extra", default="1x1048576", help="extra BxT shapes, comma separated ('' for none)")
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--impls", nargs="+", default=["cp_attention", "sdpa", "flashinfer"])
    ap.add_argument("--name", default="bench_decode")
    args = ap.parse_args()

    shapes = list(itertools.product(args.batches, args.contexts))
    shapes += [tuple(map(int, s.split("x"))) for s in args.extra.split(",") if s]
    dt, hq, hkv, d = torch.bfloat16, args.heads_q, args.heads_kv, args.head_dim
    rows = []
    for b, t in tqdm(shapes, desc="decode shapes"):
        torch.manual_seed(0)
        q = torch.randn(b, hq, d, device="cuda", dtype=dt)
        k = torch.randn(b, hkv, t, d, device="cuda", dtype=dt)
        v = torch.randn(b, hkv, t, d, device="cuda", dtype=dt)
        nbytes = 2 * k.numel() * k.element_size()
        splits = decode_num_splits(b, hkv, t, default_config(d, dt)[0], _num_sms(q.device))
        row = {"B": b, "T": t, "MB": nbytes / 1e6, "splits": splits}
        ref = None
        for name in args.impls:
            try:
                fn = {"cp_attention": lambda: (lambda: flash_decode(q, k, v)),
                      "sdpa": lambda: sdpa_fn(q, k, v),
                      "flashinfer": lambda: flashinfer_fn(q, k, v)}[name]()
                out = fn().reshape(b, hq, d).float()
                if ref is None:
                    ref = out
                row[f"{name}_maxdiff"] = float((out - ref).abs().max())
                for mode, bench in (("eager", bench_eager), ("graph", bench_graph)):
                    us = bench(fn)
                    row[f"{name}_{mode}_us"] = us
                    row[f"{name}_{mode}_TBs"] = nbytes / us / 1e6
            except Exception as e:  # one failing peer must not lose the others' numbers
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"[B={b} T={t}] {name} failed: {row[f'{name}_error']}", file=sys.stderr)
            torch.cuda.empty_cache()
        if splits > 1 and "cp_attention" in args.impls:
            row["cp_separate_us"], row["merge_kernel_us"] = combine_share(q, k, v, splits)
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()

    cfg = {"dtype": "bf16", "Hq": hq, "Hkv": hkv, "D": d, "read_ceiling_TBs": READ_CEILING_TBS}
    path = write_json(args.name, {"config": cfg, "rows": rows})
    cols = ["B", "T", "MB", "splits"] + [f"{n}_{m}_us" for m in ("eager", "graph") for n in args.impls] + \
        ["cp_attention_graph_TBs", "cp_separate_us", "merge_kernel_us"]
    print(table(rows, cols))
    print(f"wrote {path}")
    plot(rows, args.impls, args.name)


def plot(rows, impls, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["B"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], batches):
        rs = sorted((r for r in rows if r["B"] == b), key=lambda r: r["T"])
        for impl, style in zip(impls, ("o-", "s-", "^-")):
            for mode, ls in (("graph", "-"), ("eager", ":")):
                pts = [(r["T"], r[f"{impl}_{mode}_TBs"]) for r in rs if f"{impl}_{mode}_TBs" in r]
                if pts:
                    ax.plot(*zip(*pts), style[0] + ls, label=f"{impl} ({mode})")
        ax.axhline(READ_CEILING_TBS, color="k", lw=0.8, ls="--", label="read ceiling 4.47 TB/s")
        ax.set_xscale("log", base=2)
        ax.set_title(f"B = {b}")
        ax.set_xlabel("context T (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("achieved TB/s (KV bytes / time)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("bf16 decode, Hq=32, Hkv=8, D=128, H200")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
