"""Probe C: one process of an ABAB: e4m3 (policy) and bf16 graph µs at the bar shapes and 16-row shapes, with the
library found on sys.path[0] = argv[1]."""
import json, os, sys
root, tag = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv

HKV, D, HQ = 8, 128, 32
for b, t, q_rows in ((1, 131072, 1), (1, 131072, 4), (16, 32768, 1), (64, 8192, 1), (1, 1 << 20, 1), (16, 32768, 4)):
    g = torch.Generator("cuda").manual_seed(0)
    shape = (b, HQ, D) if q_rows == 1 else (b, q_rows, HQ, D)
    q = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    ref = flash_decode(q, k, v).float()
    fn = lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs)
    err = float((fn().float() - ref).abs().max())
    row = dict(tag=tag, B=b, T=t, Q=q_rows, e4m3=round(bench_graph(fn), 2), err=err)
    if tag.endswith("0"):
        del k8, v8
        row["bf16"] = round(bench_graph(lambda: flash_decode(q, k, v)), 2)
    print(json.dumps(row), flush=True)
    del q, k, v
    torch.cuda.empty_cache()
