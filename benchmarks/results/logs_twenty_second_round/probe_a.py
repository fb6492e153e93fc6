"""Probe A: the one-warp kernel beyond 16 rows and with windows / softcap+sinks / row limits, against the
Triton FP8 kernel (the plan the policy gave it before) and bf16 on the same call. Graph µs."""
import json, os, sys, functools
sys.path.insert(0, os.getcwd())
import torch
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv, decode
from cp_attention.heuristics import decode_plan, num_sms

HKV, D = 8, 128
out = []
def run(tag, b, t, q_rows, hq, window=None, softcap=None, sinks=False, limits=False):
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, q_rows, hq, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    kw = dict(window_left=window, logit_softcap=softcap)
    if sinks:
        kw["sinks"] = torch.linspace(-1, 1, hq, device="cuda")
    if limits:
        end = t - q_rows + 1 + torch.arange(q_rows, device="cuda")
        kw["_row_limits"] = torch.stack([torch.zeros_like(end), end], -1)[None].expand(b, q_rows, 2).int().contiguous()
    rows = q_rows * hq // HKV
    reach = t if window is None else min(t, window + q_rows)
    tplan = decode_plan(b, HKV, reach, D, torch.bfloat16, num_sms(q.device), kv_dtype=torch.float8_e4m3fn,
                        aligned=window is None and not limits, rows=rows)
    row = dict(tag=tag, B=b, T=t, Q=q_rows, Hq=hq, rows=rows, window=window, softcap=softcap, sinks=sinks, limits=limits)
    ref = flash_decode(q, k, v, **kw).float()
    for name, fn in [("bf16", lambda: flash_decode(q, k, v, **kw)),
                     ("e4m3_1w", lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, **kw)),
                     ("e4m3_triton", lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, plan=tplan, **kw))]:
        decode._PREPARED.clear(); decode._LAST = (None, None)
        try:
            o = fn()
            row[name + "_err"] = float((o.float() - ref).abs().max())
            row[name] = bench_graph(fn)
        except Exception as e:
            row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["1w/bf16"] = row.get("e4m3_1w", 0) / row.get("bf16", 1)
    row["triton/bf16"] = row.get("e4m3_triton", 0) / row.get("bf16", 1)
    print(json.dumps(row), flush=True)
    out.append(row)
    del q, k, v, k8, v8
    torch.cuda.empty_cache()

for b, t in ((1, 131072), (16, 32768)):
    for q_rows in (4, 5, 8, 12, 16):
        run("rows", b, t, q_rows, 32)
for b, t in ((1, 131072), (64, 8192)):
    run("window4096", b, t, 1, 32, window=4096)
    run("softcap+sinks", b, t, 1, 32, softcap=30.0, sinks=True)
    run("row-limits Q4", b, t, 4, 32, limits=True)
    run("window4096 Q4", b, t, 4, 32, window=4096)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_a.json"), "w"), indent=1)
