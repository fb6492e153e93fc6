"""Probe V: calls beyond plain decode at head dim 256 (16/8/256, e4m3 per tensor): causal draft rows (8 and 16
rows a KV head), a window of 4096 (short reach), softcap + sinks, a short cache; the policy (the one-warp kernel
where it takes the call) against the Triton kernel's policy (the one-warp kernel turned off); graph µs,
interleaved rounds; outputs against each other."""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv, decode, heuristics as H
from cp_attention.ops import _launch

HQ, HKV, D = 16, 8, 256
DEV = torch.device("cuda", 0)
kernels = []
init = _launch.Launcher.__init__
_launch.Launcher.__init__ = lambda self, kernel, *a, **o: (kernels.append(kernel.__name__), init(self, kernel, *a, **o))[1]


def use(one_warp):
    H._SM90[DEV] = one_warp
    decode._PREPARED.clear()
    decode._LAST = (None, None)
    kernels.clear()


CASES = [("Q=4 (8 rows)", 1, 131072, 4, {}), ("Q=8 (16 rows)", 1, 131072, 8, {}), ("B=16 Q=4", 16, 32768, 4, {}),
         ("window 4096", 1, 131072, 1, {"window_left": 4096}), ("window 4096 Q=4", 1, 131072, 4, {"window_left": 4096}),
         ("window 4096 B=64", 64, 8192, 1, {"window_left": 4096}), ("T=4097", 1, 4097, 1, {}),
         ("softcap 30 + sinks", 1, 131072, 1, {"logit_softcap": 30.0, "sinks": True})]
out_dir = os.environ.get("OUT", ".")
ROUNDS = int(os.environ.get("ROUNDS", "2"))
rows = []
for name, b, t, qr, kw in CASES:
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, qr, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    kw = dict(kw)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.linspace(-2.0, 3.0, HQ, device="cuda")
    fn8 = lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, **kw)
    res, ran, times = {}, {}, {"bf16": [], "policy": [], "triton": []}
    for arm, one in (("policy", True), ("triton", False)):
        use(one)
        res[arm] = fn8().float()
        ran[arm] = list(kernels)
    for r in range(ROUNDS):
        for arm, one in (("policy", True), ("triton", False)):
            use(one)
            times[arm].append(round(bench_graph(fn8), 2))
        if r == 0:
            use(True)
            times["bf16"].append(round(bench_graph(lambda: flash_decode(q, k, v, **kw)), 2))
    row = dict(case=name, B=b, T=t, Q=qr, times=times, kernels=ran,
               err=float((res["policy"] - res["triton"]).abs().max()))
    rows.append(row)
    print(json.dumps(row), flush=True)
    del q, k, v, k8, v8
    torch.cuda.empty_cache()
json.dump(dict(rows=rows), open(os.path.join(out_dir, "probe_v.json"), "w"), indent=1)
