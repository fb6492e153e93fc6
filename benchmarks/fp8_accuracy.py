"""Accuracy of an FP8 KV cache: how far decode attention over a quantised cache lands from the same decode
over the bf16 cache, on synthetic data shaped like LLM caches (keys with outlier channels: log-normal
per-channel magnitudes; normal values; queries scaled so the scores have a standard deviation of 2 (attention spread over many keys, so the
output is a near-cancelling average and its relative error is large) or 8 (peaked attention)).

For e4m3 and e5m2, per-tensor and per-KV-head scales (``cp_attention.quantize_kv``), and contexts of 1k
and 16k: the relative L2 error ``||o_fp8 - o_bf16|| / ||o_bf16||`` and the max |lse_fp8 - lse_bf16|; and,
for scale, the same error of the bf16 cache against float64 attention on the unrounded data. Runs on the
GPU, or on the CPU (torch path, no interpreter):

    PYTHONPATH=. python3 benchmarks/fp8_accuracy.py

Writes benchmarks/results/fp8_accuracy.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import table, write_json, write_tables  # noqa: E402
from cp_attention import flash_decode, quantize_kv  # noqa: E402
from cp_attention.reference import attention  # noqa: E402


def data(t, device, logit_std, seed=0, b=2, hq=32, hkv=8, d=128):
    g = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(d, generator=g) * 0.8)  # outlier channels
    k = torch.randn(b, hkv, t, d, generator=g) * channel
    v = torch.randn(b, hkv, t, d, generator=g)
    q = torch.randn(b, hq, d, generator=g) / channel.norm() * d ** 0.5 * logit_std  # scores: std logit_std
    return q.to(device), k.to(device), v.to(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = ap.parse_args().device
    rows = []
    for t, logit_std in ((1024, 2.0), (16384, 2.0), (1024, 8.0), (16384, 8.0)):
        q, k, v = data(t, device, logit_std)
        exact = attention(q.double(), k.double(), v.double())
        qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
        ref = flash_decode(qb, kb, vb, return_lse=True)
        bf16_err = ((ref.o.double() - exact.o).norm() / exact.o.norm()).item()
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            for per_head in (False, True):
                k8, v8, ks, vs = quantize_kv(kb, vb, dtype, per_head=per_head)
                got = flash_decode(qb, k8, v8, k_scale=ks, v_scale=vs, return_lse=True)
                rows.append({"T": t, "logit_std": logit_std, "fp8": str(dtype)[6:], "scales": "per head" if per_head else "per tensor",
                             "rel_err_vs_bf16_cache": ((got.o.double() - ref.o.double()).norm()
                                                       / ref.o.double().norm()).item(),
                             "max_lse_err_vs_bf16_cache": (got.lse - ref.lse).abs().max().item(),
                             "bf16_cache_rel_err_vs_float64": bf16_err})
    path = write_json("fp8_accuracy", {"device": device, "shape": "B=2, Hq=32, Hkv=8, D=128", "rows": rows})
    print(table(rows, list(rows[0])))
    print(f"wrote {path}")
    write_tables("fp8_accuracy")


if __name__ == "__main__":
    main()
