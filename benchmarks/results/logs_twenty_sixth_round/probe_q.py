"""Probe Q: plans of the one-warp FP8 kernel (keys as the mma rows) at 32/8/128, dense HND e4m3: 16-key tiles at
eight programs an SM (FP8_ONE_WARP), 32-key tiles at four (FP8_ONE_WARP_FEW), six and eight (FP8_ONE_WARP_LONG);
bf16 beside; graph µs, three interleaved rounds in one process; outputs against the policy's."""
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
ONE32_6 = C(32, 1, 3, programs=6, warp_rows=16)
decode.ONE_WARP_CONFIGS = split_kv.ONE_WARP_CONFIGS = H.ONE_WARP_CONFIGS + (ONE32_6,)
SMS = torch.cuda.get_device_properties(0).multi_processor_count
HQ, HKV, D = 32, 8, 128
CONFIGS = {"16x8": H.FP8_ONE_WARP, "32x4": H.FP8_ONE_WARP_FEW, "32x6": ONE32_6, "32x8": H.FP8_ONE_WARP_LONG}


def use():
    decode._PREPARED.clear()
    decode._LAST = (None, None)


ROUNDS = int(os.environ.get("ROUNDS", "3"))
rows = []
for b, t in ((64, 8192), (16, 32768), (1, 131072), (32, 8192), (8, 32768), (4, 32768), (128, 4096), (2, 131072),
             (1, 1 << 20)):
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    plans = {name: H._fp8_splits(b, HKV, t, SMS, None, cfg, D) for name, cfg in CONFIGS.items()}
    use()
    ref = flash_decode(q, k8, v8, k_scale=ks, v_scale=vs).float()
    row = {"B": b, "T": t, "policy": str(H.one_warp_plan(b, HKV, t, SMS)[:3]),
           "splits": {n: p.num_splits for n, p in plans.items()}, "bf16": []}
    for name, plan in plans.items():
        use()
        row[name + " maxdiff"] = float((flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, plan=plan).float() - ref).abs().max())
    for r in range(ROUNDS):
        use()
        row["bf16"].append(round(bench_graph(lambda: flash_decode(q, k, v)), 2))
        for name, plan in plans.items():
            use()
            row.setdefault(name, []).append(round(bench_graph(lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs,
                                                                                     plan=plan)), 2))
    rows.append(row)
    print(json.dumps(row), flush=True)
    del q, k, v, k8, v8, ref
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), "probe_q.json"), "w") as f:
    json.dump(rows, f, indent=1)
