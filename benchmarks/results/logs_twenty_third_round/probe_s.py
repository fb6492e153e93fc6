"""Probe S: short reach at B=1 (a window, 4-32 query rows per KV head): the one-warp kernel's plan against the
Triton FP8 kernel; keys per split and rows recorded; graph µs, two interleaved rounds."""
import json, os, sys
root, tag = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv, decode

HKV, D, G, T = 8, 128, 4, 65536
orig_fp8 = decode.one_warp_fp8
state = {"triton": False}
decode.one_warp_fp8 = lambda *a, **kw: False if state["triton"] else orig_fp8(*a, **kw)
g = torch.Generator("cuda").manual_seed(0)
k = torch.randn(1, HKV, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
v = torch.randn(1, HKV, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
k8, v8, ks, vs = quantize_kv(k, v)
out = []
for b in (1, 4):
    kb, vb = (k8.expand(b, -1, -1, -1).contiguous(), v8.expand(b, -1, -1, -1).contiguous()) if b > 1 else (k8, v8)
    for q_rows in (1, 4, 5, 8):
        q = torch.randn((b, q_rows, HKV * G, D), generator=g, device="cuda", dtype=torch.bfloat16)
        for window in (1024, 2048, 4096, 8192, 16384):
            fn = lambda: flash_decode(q, kb, vb, k_scale=ks, v_scale=vs, window_left=window)
            times, info = {"one_warp": [], "triton": []}, {}
            for r in range(2):
                for name in times:
                    state["triton"] = name == "triton"
                    decode._PREPARED.clear()
                    decode._LAST = (None, None)
                    if r == 0:
                        fn()
                        p = list(decode._PREPARED.values())[-1].launcher
                        info[name] = (p.kernel.__name__, p.grid, p.static[1] * p.constexprs["BLOCK_N"])
                    times[name].append(round(bench_graph(fn), 2))
            row = dict(tag=tag, B=b, Q=q_rows, rows=q_rows * G, window=window, times=times, plans=info)
            print(json.dumps(row), flush=True)
            out.append(row)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"probe_s_{tag}.json"), "w"), indent=1)
