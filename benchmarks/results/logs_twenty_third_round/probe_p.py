"""Probe P: one-split and four-split plans of 32-key tiles with rings deep enough that at most four (or five)
programs fit an SM, so that the hardware must spread them; graph µs, interleaved rounds in one process."""
import json, os, sys
root, tag = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv, decode, heuristics as H
from cp_attention.ops import split_kv

HKV, D, HQ = 8, 128, 32
C = H.DecodeConfig
EXTRA = (C(32, 1, 6, programs=4), C(32, 1, 5, programs=4), C(32, 1, 4, programs=4))
decode.ONE_WARP_CONFIGS = split_kv.ONE_WARP_CONFIGS = H.ONE_WARP_CONFIGS + EXTRA
CASES = {
    (64, 8192): {"few3": (C(32, 1, 3, programs=4), 1, 256), "few6": (C(32, 1, 6, programs=4), 1, 256),
                 "few5": (C(32, 1, 5, programs=4), 1, 256), "long2": (C(32, 1, 3, programs=8), 2, 128)},
    (16, 32768): {"few3": (C(32, 1, 3, programs=4), 4, 256), "few6": (C(32, 1, 6, programs=4), 4, 256)},
    (1, 131072): {"few6": (C(32, 1, 6, programs=4), 66, 63), "few4": (C(32, 1, 4, programs=4), 66, 63)},
    (1, 1 << 20): {},
}
ROUNDS = int(os.environ.get("ROUNDS", "4"))
orig_plan = decode.one_warp_plan
current = {"plan": None}
decode.one_warp_plan = lambda *a, **kw: current["plan"] or orig_plan(*a, **kw)


def use(plan):
    current["plan"] = plan
    decode._PREPARED.clear()
    decode._LAST = (None, None)


rows = []
for (b, t), variants in CASES.items():
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    fn = lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs)
    use(None)
    base = fn().float().clone()
    plans = {"plan": None, **{n: H.DecodePlan(cfg, s, tps) for n, (cfg, s, tps) in variants.items()}}
    err = {}
    for name, plan in plans.items():
        use(plan)
        err[name] = float((fn().float() - base).abs().max())
    times = {name: [] for name in plans}
    bf = []
    for r in range(ROUNDS):
        for name, plan in plans.items():
            use(plan)
            times[name].append(round(bench_graph(fn), 2))
        if r in (0, ROUNDS - 1):
            use(None)
            bf.append(round(bench_graph(lambda: flash_decode(q, k, v)), 2))
    row = dict(tag=tag, B=b, T=t, bf16=bf, times=times, err=err)
    print(json.dumps(row), flush=True)
    rows.append(row)
    del q, k, v, k8, v8
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), f"probe_p_{tag}.json"), "w"), indent=1)

# Short reach: B=1, a window of 4096 read by 4 draft rows (16 rows per KV head), and the plain T=4097 call of 4 rows;
# the plan's splits against fewer, longer ones and against the Triton kernel
orig_fp8 = decode.one_warp_fp8
FEW = H.FP8_ONE_WARP_FEW
for name_case, q_rows, t, window in (("window4096_q4", 4, 131072, 4096), ("plain4097_q1", 1, 4097, None),
                                     ("window4096_q1", 1, 131072, 4096)):
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((1, q_rows, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    fn = lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, window_left=window)
    use(None)
    base = fn().float().clone()
    print("plan of", name_case, [(p.launcher.kernel.__name__, p.launcher.grid) for p in decode._PREPARED.values()], flush=True)
    plans = {"plan": None, "s33": H.DecodePlan(FEW, 33, 4), "s17": H.DecodePlan(FEW, 17, 8),
             "s9": H.DecodePlan(FEW, 9, 15), "triton": "triton"}
    err, times = {}, {n: [] for n in plans}
    for r in range(3):
        for name, plan in plans.items():
            decode.one_warp_fp8 = (lambda *a, **kw: False) if plan == "triton" else orig_fp8
            use(None if plan == "triton" else plan)
            if r == 0:
                err[name] = float((fn().float() - base).abs().max())
            times[name].append(round(bench_graph(fn), 2))
    decode.one_warp_fp8 = orig_fp8
    use(None)
    row = dict(tag=tag, case=name_case, times=times, err=err)
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), f"probe_p_{tag}.json"), "w"), indent=1)
