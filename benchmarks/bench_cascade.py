"""Shared-prefix cascade decode on one GPU: cp_attention.cascade_decode against FlashInfer 0.7.2's
MultiLevelCascadeAttentionWrapper and against flat decode of the dense cache (the prefix copied per
request): cp_attention.flash_decode, torch SDPA (default backend selection), FlashInfer's FA2 tensor-core
decode (page 16) and its XQA kernel (page 64).

bf16, Hq=32, Hkv=8, D=128. Shape A: B=128 requests sharing a 32k-token prefix, 256 own tokens each;
shape B: B=32, 16k prefix, 1k own tokens; a sweep over B (--batches) with the 32k prefix and 256-token
suffixes. Per implementation: median µs per call and per call in a CUDA graph of 20 calls
(benchmarks/_harness.py), max |o - o_cascade_decode|; ``prefix_only`` is cascade_decode over the prefix
level alone, whose TFLOP/s (4 * B * Hq * P * D flops) is reported; speedups are over flat flash_decode.
FlashInfer's cascade wrapper is built with use_cuda_graph=True (fixed page-metadata buffers) and timed
per call and in graphs like the others. Every implementation runs in its own try/except. After the
timings, the kernels SDPA's default backend selection ran on shapes A and B are recorded
(``sdpa_kernels``) and printed.

    PYTHONPATH=. python3 benchmarks/bench_cascade.py
    PYTHONPATH=. python3 benchmarks/bench_cascade.py --no-flashinfer --batches 8 32 128

For the FlashInfer rows, run bench_decode.py's install line first, then ``python3 benchmarks/bench_cascade.py``
(the line sets PYTHONPATH); without it they record the import error. Writes
benchmarks/results/<name>.json and <name>.png (default name: bench_cascade).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peers  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    RESULTS, kernel_names, measure, table, tqdm, write_json, write_tables,
)
from cp_attention import CascadeLevel, cascade_decode  # noqa: E402

DT, HQ, HKV, D = torch.bfloat16, 32, 8, 128


class Shape:
    """Inputs of one shape: queries, the shared prefix (one segment) and the per-request suffixes."""

    def __init__(self, b, prefix, suffix):
        gen = torch.Generator("cuda").manual_seed(0)
        rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=DT)  # noqa: E731
        self.b, self.p, self.s = b, prefix, suffix
        self.q = rnd(b, HQ, D)
        self.pk, self.pv = rnd(1, HKV, prefix, D), rnd(1, HKV, prefix, D)
        self.sk, self.sv = rnd(b, HKV, suffix, D), rnd(b, HKV, suffix, D)
        self.levels = [CascadeLevel(self.pk, self.pv), CascadeLevel(self.sk, self.sv)]
        self._dense = None

    @property
    def prefix_flops(self):
        return 4 * self.b * HQ * self.p * D

    def dense(self):
        """The flat cache ``[B, Hkv, P + S, D]``, the prefix copied per request (built once)."""
        if self._dense is None:
            self._dense = tuple(torch.cat([x.expand(self.b, -1, -1, -1), y], dim=2)
                                for x, y in ((self.pk, self.sk), (self.pv, self.sv)))
        return self._dense


# name -> builder(shape) -> zero-argument callable giving o
IMPLS = {
    "cascade": lambda sh: lambda: cascade_decode(sh.q, sh.levels),
    "prefix_only": lambda sh: lambda: cascade_decode(sh.q, sh.levels[:1]),
    "flat_flash_decode": lambda sh: peers.cp_attention(sh.q, *sh.dense()),
    "sdpa": lambda sh: peers.sdpa_default(sh.q, *sh.dense()),
    "fi_cascade": lambda sh: peers.flashinfer_cascade(sh.q, sh.pk, sh.pv, sh.sk, sh.sv),
    "fi_fa2": lambda sh: peers.flashinfer_fa2(sh.q, *sh.dense()),
    "fi_xqa": lambda sh: peers.flashinfer_xqa(sh.q, *sh.dense()),
}
FLASHINFER = {"fi_cascade", "fi_fa2", "fi_xqa"}
SWEEP = ["cascade", "prefix_only", "flat_flash_decode", "sdpa", "fi_cascade", "fi_fa2"]


def measure_impl(sh, name, row, ref):
    """Check and time one implementation on one shape into ``row``; never raises."""
    measure(row, name, lambda: IMPLS[name](sh), None if name == "prefix_only" else ref, row["shape"])


def measure_kernels(row, name):
    """The kernel names one eager call of ``name`` launches on ``row``'s shape into ``row[name + "_kernels"]``
    (a failure into ``row[name + "_kernels_error"]``); profiles, so only after every timing."""
    sh = None
    try:
        sh = Shape(row["B"], row["P"], row["S"])
        row[f"{name}_kernels"] = kernel_names(IMPLS[name](sh))
    except Exception as e:  # noqa: BLE001 - recorded, as measure() does
        row[f"{name}_kernels_error"] = f"{type(e).__name__}: {e}"[:400]
    finally:
        del sh
        gc.collect()
        torch.cuda.empty_cache()


def run_shape(label, b, prefix, suffix, names):
    row = {"shape": label, "B": b, "P": prefix, "S": suffix}
    sh = Shape(b, prefix, suffix)
    ref = cascade_decode(sh.q, sh.levels).float()
    for name in names:
        measure_impl(sh, name, row, ref)
    row["prefix_GFLOP"] = sh.prefix_flops / 1e9
    for mode in ("call", "graph"):
        if f"prefix_only_{mode}_us" in row:
            row[f"prefix_{mode}_TFLOPs"] = sh.prefix_flops / row[f"prefix_only_{mode}_us"] / 1e6
        flat = row.get(f"flat_flash_decode_{mode}_us")
        for name in ("cascade", "fi_cascade"):
            if flat and f"{name}_{mode}_us" in row:
                row[f"{name}_{mode}_speedup"] = flat / row[f"{name}_{mode}_us"]
    del sh, ref
    gc.collect()
    torch.cuda.empty_cache()
    return row


def plot(sweep, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = {"cascade": "cp_attention cascade_decode", "flat_flash_decode": "cp_attention flash_decode (flat)",
              "sdpa": "torch SDPA (flat)", "fi_cascade": "FlashInfer MultiLevelCascade",
              "fi_fa2": "FlashInfer FA2 decode (flat)"}
    for i, (key, label) in enumerate(labels.items()):
        for mode, ls in (("graph", "o-"), ("call", "o:")):
            pts = [(r["B"], r[f"{key}_{mode}_us"]) for r in sweep if f"{key}_{mode}_us" in r]
            if pts:
                ax.plot(*zip(*pts), ls, color=f"C{i}", label=f"{label} ({'graph' if mode == 'graph' else 'per call'})")
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="batch size B (requests sharing the prefix)", ylabel="µs per decode step (median)",
           title="32k shared prefix + 256 own tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    pts = [(r["B"], r["prefix_graph_TFLOPs"]) for r in sweep if "prefix_graph_TFLOPs" in r]
    if pts:
        ax2.plot(*zip(*pts), "o-", label="prefix level alone (graph)")
    ax2.set_xscale("log", base=2)
    ax2.set(xlabel="batch size B", ylabel="prefix level: TFLOP/s")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(f"bf16 cascade decode, Hq={HQ}, Hkv={HKV}, D={D}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--name", default="bench_cascade", help="results file stem under benchmarks/results/")
    args = ap.parse_args()

    names = [n for n in IMPLS if not (args.no_flashinfer and n in FLASHINFER)]
    jobs = [("shape", "A", 128, 32768, 256, names), ("shape", "B", 32, 16384, 1024, names)]
    jobs += [("sweep", f"sweep-B{b}", b, 32768, 256, [n for n in SWEEP if n in names]) for b in args.batches]
    shapes, sweep = [], []
    for kind, label, b, p, s, impls in tqdm(jobs, desc="cascade shapes"):
        (shapes if kind == "shape" else sweep).append(run_shape(label, b, p, s, impls))
    if "sdpa" in names:  # the kernels SDPA's default backend selection ran, after every timing (harness docs)
        for r in shapes:
            measure_kernels(r, "sdpa")
    config = {"dtype": "bf16", "Hq": HQ, "Hkv": HKV, "D": D, "fi_cascade_page_size": 16, "fi_fa2_page_size": 16,
              "fi_xqa_page_size": 64, "prefix_flops": "4 * B * Hq * P * D"}
    path = write_json(args.name, {"config": config, "shapes": shapes, "sweep": sweep})
    png = RESULTS / f"{args.name}.png"
    plot(sweep, png)
    for r in shapes + sweep:
        for key, val in r.items():
            if key.endswith("_error"):
                print(f"{r['shape']}: {key} = {val}")
        diffs = {k.removesuffix("_maxdiff"): v for k, v in r.items() if k.endswith("_maxdiff")}
        print(f"{r['shape']}: max |o - o_cascade_decode| {diffs}")
    for r in shapes:
        if "sdpa_kernels" in r:
            print(f"{r['shape']}: sdpa kernels {', '.join(r['sdpa_kernels'])}")
    print(f"wrote {path} and {png}")
    write_tables(args.name)
    print(table(shapes + sweep, ["shape", "B", "P", "S"] + [f"{n}_graph_us" for n in names] +
                ["prefix_graph_TFLOPs", "cascade_graph_speedup", "fi_cascade_graph_speedup", "cascade_call_us",
                 "flat_flash_decode_call_us", "cascade_call_speedup"]))


if __name__ == "__main__":
    main()
