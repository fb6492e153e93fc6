"""Probe D: the one-warp FP8 kernel at head dim 256 (16/8/256, e4m3 per tensor) against the Triton kernel's plan
(WIDE_FP8) and bf16; plans of 16-key tiles at eight or four programs per SM and 32-key tiles at four; graph µs,
interleaved rounds in one process; outputs against the Triton kernel's on the same call."""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv, decode, heuristics as H
from cp_attention.ops import split_kv

C = H.DecodeConfig
ONE16_4 = C(16, 1, 3, programs=4, warp_rows=16)
decode.ONE_WARP_CONFIGS = split_kv.ONE_WARP_CONFIGS = H.ONE_WARP_CONFIGS + (ONE16_4,)
HQ, HKV, D = 16, 8, 256
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def use():
    decode._PREPARED.clear()
    decode._LAST = (None, None)


def plans(b, t, rows=2):
    return {"triton": H.decode_plan(b, HKV, t, D, torch.bfloat16, SMS, kv_dtype=torch.float8_e4m3fn, rows=rows),
            "1w 16x8": H._fp8_splits(b, HKV, t, SMS, None, H.FP8_ONE_WARP, D),
            "1w 16x4": H._fp8_splits(b, HKV, t, SMS, None, ONE16_4, D),
            "1w 32x4": H._fp8_splits(b, HKV, t, SMS, None, H.FP8_ONE_WARP_FEW, D)}


out_dir = os.environ.get("OUT", ".")
# correctness on ragged causal drafts (4 rows x GQA 2), sinks + softcap, a window: each plan against the Triton one
checks = []
g = torch.Generator("cuda").manual_seed(1)
b, t = 3, 5003
q = torch.randn((b, 4, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
k8, v8, ks, vs = quantize_kv(torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16),
                             torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16))
sl = torch.tensor([5003, 1777, 4096], device="cuda", dtype=torch.int32)
sinks = torch.randn(HQ, generator=g, device="cuda")
for kw in ({}, {"sinks": sinks, "logit_softcap": 30.0}, {"window_left": 1000}):
    for qq in (q[:, :1], q):
        ps = plans(b, t, qq.shape[1] * 2)
        use()
        ref = flash_decode(qq, k8, v8, sl, k_scale=ks, v_scale=vs, plan=ps["triton"], **kw).float()
        use()
        pol = flash_decode(qq, k8, v8, sl, k_scale=ks, v_scale=vs, **kw).float()
        row = dict(kw=sorted(kw), q_rows=qq.shape[1], policy=float((pol - ref).abs().max()))
        for name in ("1w 16x8", "1w 16x4", "1w 32x4"):
            use()
            o = flash_decode(qq, k8, v8, sl, k_scale=ks, v_scale=vs, plan=ps[name], **kw).float()
            row[name] = float((o - ref).abs().max()) if torch.isfinite(o).all() else "non-finite"
        checks.append(row)
print(json.dumps(checks, indent=0), flush=True)
del q, k8, v8

SHAPES = [(1, 131072), (16, 32768), (64, 8192), (4, 32768), (1, 1 << 20)]
ROUNDS = int(os.environ.get("ROUNDS", "2"))
rows = []
for b, t in SHAPES:
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    ps = plans(b, t)
    use()
    pol = H.one_warp_plan(b, HKV, t, SMS, head_dim=D)
    base = flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, plan=ps["triton"]).float()
    err = {}
    for name, plan in ps.items():
        use()
        err[name] = float((flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, plan=plan).float() - base).abs().max())
    times = {name: [] for name in ps}
    bf = []
    for r in range(ROUNDS):
        for name, plan in ps.items():
            use()
            times[name].append(round(bench_graph(lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, plan=plan)), 2))
        if r == 0:
            use()
            bf.append(round(bench_graph(lambda: flash_decode(q, k, v)), 2))
    row = dict(B=b, T=t, bf16=bf, policy=str(pol[:3]), plans={n: str(p[:3]) for n, p in ps.items()}, times=times,
               err=err)
    rows.append(row)
    print(json.dumps(row), flush=True)
    del q, k, v, k8, v8
    torch.cuda.empty_cache()
json.dump(dict(checks=checks, rows=rows), open(os.path.join(out_dir, "probe_d.json"), "w"), indent=1)
