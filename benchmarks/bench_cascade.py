"""Shared-prefix cascade decode on one GPU: cp_attention.cascade_decode against flat decode of the dense
cache (cp_attention.flash_decode, torch SDPA, FlashInfer batch decode) and FlashInfer's MultiLevelCascade.

    PYTHONPATH=. python3 benchmarks/bench_cascade.py
    PYTHONPATH=. python3 benchmarks/bench_cascade.py --no-flashinfer --batches 8 32 128 --no-tune

bf16, Hq=32, Hkv=8, D=128. Shape A: B=128 requests sharing a 32k-token prefix, 256 own tokens each;
shape B: B=32, 16k prefix, 1k own tokens; a sweep over B with the 32k prefix and 256-token suffixes; a
tuning table of the prefix kernel (tile config x split count) on shapes A and B. Reports median µs
(triton.testing.do_bench, eager and replayed from a CUDA graph), the prefix part's achieved TFLOP/s
(4 * B * Hq * P * D flops, timed alone) and the speedup over flat flash_decode on the dense cache
(the prefix copied per request). Every section and every implementation runs in its own try/except.
Writes benchmarks/results/bench_cascade.json and bench_cascade.png.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import RESULTS, bench_eager, bench_graph, table, write_json  # noqa: E402
from cp_attention import flash_decode  # noqa: E402
from cp_attention.cascade import CascadeLevel, _prefix_num_splits, cascade_decode  # noqa: E402
from cp_attention.decode import _num_sms  # noqa: E402
from cp_attention.ops.prefix import default_config  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # the bar is a nicety
    def tqdm(it, **_):
        return it

DEVICE, DT, HQ, HKV, D = "cuda", torch.bfloat16, 32, 8, 128
PAGE = 16
TUNE_CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)]
TUNE_SPLITS = [None, 2, 4, 8, 16, 32]


def log_error(where, e):
    msg = f"{type(e).__name__}: {e}"[:400]
    print(f"[{where}] failed: {msg}", file=sys.stderr)
    traceback.print_exc(limit=3, file=sys.stderr)
    return msg


class Shape:
    """Inputs of one shape: queries, the shared prefix (S = 1) and the per-request suffixes (S = B)."""

    def __init__(self, b, prefix, suffix, seed=0):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=g, device=DEVICE, dtype=DT)  # noqa: E731
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
        """The flat cache ``[B, Hkv, P + S, D]`` with the prefix copied per request (built once)."""
        if self._dense is None:
            self._dense = tuple(torch.cat([x.expand(self.b, -1, -1, -1), y], dim=2)
                                for x, y in ((self.pk, self.sk), (self.pv, self.sv)))
        return self._dense

    def plan(self):
        """The prefix level's launch: tile config and split count (as cascade_decode picks them)."""
        cfg = default_config(D, DT, self.b * (HQ // HKV))
        n_tiles = -(-self.b * (HQ // HKV) // cfg[0])
        return {"config": list(cfg), "row_tiles": n_tiles,
                "splits": _prefix_num_splits(n_tiles * HKV, -(-self.p // cfg[1]), _num_sms(self.q.device))}


# ---- implementations: each returns a zero-argument callable giving o [B, Hq, D] ----------------------

def impl_cascade(sh):
    return lambda: cascade_decode(sh.q, sh.levels)


def impl_prefix_only(sh, config=None, splits=None):
    lv = sh.levels[:1]
    return lambda: cascade_decode(sh.q, lv, _config=config, _num_splits=splits)


def impl_flat(sh):
    k, v = sh.dense()
    return lambda: flash_decode(sh.q, k, v)


def impl_sdpa(sh):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k, v = sh.dense()
    q4 = sh.q.unsqueeze(2)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, None):
        def run(backend=backend):
            if backend is None:
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).squeeze(2)
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).squeeze(2)
        try:
            run()
            torch.cuda.synchronize()
            impl_sdpa.backend = str(backend)
            return run
        except Exception as e:  # try the next backend
            log_error(f"sdpa {backend}", e)
    raise RuntimeError("no SDPA backend ran")


def _paged(k, v):
    """HND ``[N, Hkv, T, D]`` (T % PAGE == 0) -> FlashInfer HND pages ``[N * T / PAGE, Hkv, PAGE, D]``."""
    n, h, t, d = k.shape
    page = lambda x: x.view(n, h, t // PAGE, PAGE, d).permute(0, 2, 1, 3, 4).reshape(-1, h, PAGE, d)  # noqa: E731
    return page(k).contiguous(), page(v).contiguous()


def _i32(x):
    return x.to(device=DEVICE, dtype=torch.int32)


def impl_flashinfer_cascade(sh, use_cuda_graph):
    """MultiLevelCascadeAttentionWrapper, 2 levels: the prefix pages (read by all B queries), then each
    request's suffix pages; one paged HND cache holds both."""
    import flashinfer

    n_pp, n_sp = sh.p // PAGE, sh.s // PAGE
    pk, pv = _paged(sh.pk, sh.pv)
    sk, sv = _paged(sh.sk, sh.sv)
    kc, vc = torch.cat([pk, sk]), torch.cat([pv, sv])
    b = sh.b
    qo = [_i32(torch.tensor([0, b])), _i32(torch.arange(b + 1))]
    indptr = [_i32(torch.tensor([0, n_pp])), _i32(torch.arange(b + 1) * n_sp)]
    indices = [_i32(torch.arange(n_pp)), _i32(n_pp + torch.arange(b * n_sp))]
    last = [_i32(torch.tensor([PAGE])), _i32(torch.full((b,), PAGE))]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEVICE)
    if use_cuda_graph:
        w = flashinfer.MultiLevelCascadeAttentionWrapper(
            2, ws, "HND", use_cuda_graph=True, qo_indptr_buf_arr=qo, paged_kv_indptr_buf_arr=indptr,
            paged_kv_indices_buf_arr=indices, paged_kv_last_page_len_buf_arr=last)
    else:
        w = flashinfer.MultiLevelCascadeAttentionWrapper(2, ws, "HND")
    w.plan(qo, indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
    return lambda: w.run(sh.q, (kc, vc))


def impl_flashinfer_flat(sh, use_tensor_cores):
    """BatchDecodeWithPagedKVCacheWrapper on the dense cache (the prefix pages copied per request)."""
    import flashinfer

    k, v = sh.dense()
    kc, vc = _paged(k, v)
    b, n = sh.b, (sh.p + sh.s) // PAGE
    indptr, indices = _i32(torch.arange(b + 1) * n), _i32(torch.arange(b * n))
    last = _i32(torch.full((b,), PAGE))
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEVICE)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "HND", use_cuda_graph=True, use_tensor_cores=use_tensor_cores, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
    return lambda: w.run(sh.q, (kc, vc))


def impls(use_flashinfer, sdpa=True):
    out = {"cascade": impl_cascade, "prefix_only": impl_prefix_only, "flat_flash_decode": impl_flat}
    if sdpa:
        out["sdpa"] = impl_sdpa
    if use_flashinfer:
        out["fi_cascade"] = lambda sh: impl_flashinfer_cascade(sh, use_cuda_graph=False)
        out["fi_cascade_graph"] = lambda sh: impl_flashinfer_cascade(sh, use_cuda_graph=True)
        out["fi_flat"] = lambda sh: impl_flashinfer_flat(sh, use_tensor_cores=False)
        out["fi_flat_tc"] = lambda sh: impl_flashinfer_flat(sh, use_tensor_cores=True)
    return out


def measure(sh, name, make, row, ref, modes=("eager", "graph")):
    """Time one implementation on one shape into ``row``; errors are recorded, never raised."""
    try:
        fn = make(sh)
        out = fn()
        if ref is not None and name != "prefix_only":
            row[f"{name}_maxdiff"] = float((out.reshape(ref.shape).float() - ref).abs().max())
        for mode in modes:
            try:
                row[f"{name}_{mode}_us"] = (bench_eager if mode == "eager" else bench_graph)(fn)
            except Exception as e:
                row[f"{name}_{mode}_error"] = log_error(f"B={sh.b} P={sh.p} {name} {mode}", e)
        return out
    except Exception as e:
        row[f"{name}_error"] = log_error(f"B={sh.b} P={sh.p} {name}", e)
        return None
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def derive(row, sh):
    """Achieved prefix TFLOP/s and speedups over flat flash_decode."""
    row["prefix_GFLOP"] = sh.prefix_flops / 1e9
    for mode in ("eager", "graph"):
        if f"prefix_only_{mode}_us" in row:
            row[f"prefix_{mode}_TFLOPs"] = sh.prefix_flops / row[f"prefix_only_{mode}_us"] / 1e6
        flat = row.get(f"flat_flash_decode_{mode}_us")
        if flat:
            for name in ("cascade", "fi_cascade", "fi_cascade_graph"):
                if f"{name}_{mode}_us" in row:
                    row[f"{name}_{mode}_speedup"] = flat / row[f"{name}_{mode}_us"]


def run_shape(label, b, prefix, suffix, makers, rows, bar):
    row = {"shape": label, "B": b, "P": prefix, "S": suffix}
    rows.append(row)
    sh = None
    try:
        sh = Shape(b, prefix, suffix)
        row.update(plan=sh.plan())
        ref = measure(sh, "cascade", makers["cascade"], row, None)
        ref = ref.float() if ref is not None else None
        for name, make in makers.items():
            if name == "cascade":
                continue
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(f"{label} {name}")
            measure(sh, name, make, row, ref)
            if name == "sdpa" and hasattr(impl_sdpa, "backend"):
                row["sdpa_backend"] = impl_sdpa.backend
        derive(row, sh)
    except Exception as e:
        row["error"] = log_error(label, e)
    finally:
        del sh
        torch.cuda.empty_cache()


def tune(label, b, prefix, suffix, rows):
    """Prefix-only graph time for each tile config x split count (None = the policy)."""
    try:
        sh = Shape(b, prefix, suffix)
        for cfg in tqdm(TUNE_CONFIGS, desc=f"tune {label}", leave=False):
            for splits in TUNE_SPLITS:
                row = {"shape": label, "config": str(cfg), "splits": "policy" if splits is None else splits}
                try:
                    fn = impl_prefix_only(sh, config=cfg, splits=splits)
                    fn()
                    us = bench_graph(fn)
                    row.update(graph_us=us, TFLOPs=sh.prefix_flops / us / 1e6)
                except Exception as e:
                    row["error"] = log_error(f"tune {label} {cfg} {splits}", e)
                rows.append(row)
        del sh
    except Exception as e:
        rows.append({"shape": label, "error": log_error(f"tune {label}", e)})
    torch.cuda.empty_cache()


def plot(sweep, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    series = [("cascade", "cp_attention cascade_decode", "o-"),
              ("flat_flash_decode", "cp_attention flash_decode (flat)", "s-"),
              ("sdpa", "torch SDPA (flat)", "^-"), ("fi_cascade", "FlashInfer MultiLevelCascade", "v-"),
              ("fi_flat", "FlashInfer batch decode (flat)", "d-")]
    for i, (key, label, style) in enumerate(series):
        for mode, ls in (("graph", "-"), ("eager", ":")):
            pts = [(r["B"], r[f"{key}_{mode}_us"]) for r in sweep if f"{key}_{mode}_us" in r]
            if pts:
                ax.plot(*zip(*pts), style[:-1] + ls, color=f"C{i}", label=f"{label} ({mode})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B (requests sharing the prefix)")
    ax.set_ylabel("µs per decode step (median)")
    ax.set_title("32k shared prefix + 256 own tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    pts = [(r["B"], r["prefix_graph_TFLOPs"]) for r in sweep if "prefix_graph_TFLOPs" in r]
    if pts:
        ax2.plot(*zip(*pts), "o-", label="prefix kernel (graph)")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch size B")
    ax2.set_ylabel("prefix part: achieved TFLOP/s")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle("bf16 cascade decode, Hq=32, Hkv=8, D=128, H200")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--name", default="bench_cascade")
    args = ap.parse_args()

    use_fi = not args.no_flashinfer
    if use_fi:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:
            print(f"FlashInfer unavailable: {log_error('import flashinfer', e)}", file=sys.stderr)
            use_fi = False
    makers = impls(use_fi)
    sweep_makers = {k: v for k, v in makers.items() if k in ("cascade", "prefix_only", "flat_flash_decode", "sdpa",
                                                               "fi_cascade", "fi_flat")}
    shapes, sweep, tuning = [], [], []
    jobs = [("shape", "A", 128, 32768, 256), ("shape", "B", 32, 16384, 1024)]
    jobs += [("sweep", f"sweep-B{b}", b, 32768, 256) for b in args.batches]
    if not args.no_tune:
        jobs += [("tune", "A", 128, 32768, 256), ("tune", "B", 32, 16384, 1024)]
    bar = tqdm(jobs, desc="cascade bench")
    try:
        for kind, label, b, p, s in bar:
            try:
                if kind == "shape":
                    run_shape(label, b, p, s, makers, shapes, bar)
                elif kind == "sweep":
                    run_shape(label, b, p, s, sweep_makers, sweep, bar)
                else:
                    tune(label, b, p, s, tuning)
            except Exception as e:
                log_error(label, e)
    finally:
        cfg = {"dtype": "bf16", "Hq": HQ, "Hkv": HKV, "D": D, "page_size": PAGE, "flashinfer": use_fi,
               "prefix_flops": "4 * B * Hq * P * D", "timing": "triton.testing.do_bench median, L2 flushed"}
        path = write_json(args.name, {"config": cfg, "shapes": shapes, "sweep": sweep, "tuning": tuning})
        print(f"wrote {path}")
        try:
            plot(sweep, args.name)
        except Exception as e:
            log_error("plot", e)

    names = [n for n in makers if n != "prefix_only"]
    cols = ["shape", "B", "P", "S"] + [f"{n}_graph_us" for n in names] + \
        ["prefix_only_graph_us", "prefix_graph_TFLOPs", "cascade_graph_speedup", "cascade_eager_us",
         "flat_flash_decode_eager_us", "cascade_eager_speedup"]
    print(table(shapes + sweep, cols))
    for r in shapes:
        print(f"shape {r['shape']}: plan {r.get('plan')}, sdpa backend {r.get('sdpa_backend')}")
        diffs = {k[:-8]: f"{v:.2e}" for k, v in r.items() if k.endswith("_maxdiff")}
        print(f"  max |o - cascade o|: {diffs}")
        for k, v in r.items():
            if k.endswith("error"):
                print(f"  {k}: {v}")
    if tuning:
        print(table(tuning, ["shape", "config", "splits", "graph_us", "TFLOPs", "error"]))


if __name__ == "__main__":
    main()
