"""Probe N: the one-warp FP8 kernel (keys as the mma rows) at 32/8/128 on the dense cache in HND and NHD, on NHD
pools of 16 slots, and in plans of more programs an SM (12 of 16-key tiles, 6 of 32-key tiles); bf16 HND and NHD
beside it; graph µs, interleaved rounds in one process."""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from benchmarks.peers import page_table
from cp_attention import flash_decode, quantize_kv, decode, heuristics as H
from cp_attention.ops import split_kv

C = H.DecodeConfig
ONE16_12 = C(16, 1, 3, programs=12, warp_rows=16)
ONE32_6 = C(32, 1, 3, programs=6, warp_rows=16)
decode.ONE_WARP_CONFIGS = split_kv.ONE_WARP_CONFIGS = H.ONE_WARP_CONFIGS + (ONE16_12, ONE32_6)
SMS = torch.cuda.get_device_properties(0).multi_processor_count
HQ, HKV, D = 32, 8, 128


def use():
    decode._PREPARED.clear()
    decode._LAST = (None, None)


ROUNDS = int(os.environ.get("ROUNDS", "2"))
rows = []
for b, t in ((1, 131072), (16, 32768), (64, 8192), (1, 1 << 20)):
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    sc = dict(k_scale=ks, v_scale=vs)
    calls = {"bf16 HND": (k, v, {})}
    if t < (1 << 20):
        calls["bf16 NHD"] = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), {"kv_layout": "NHD"})
    del k, v
    calls["e4m3 HND"] = (k8, v8, sc)
    calls["e4m3 NHD"] = (k8.transpose(1, 2).contiguous(), v8.transpose(1, 2).contiguous(), dict(sc, kv_layout="NHD"))
    p = 16
    table = page_table(b, t // p, "cuda")
    sl = torch.full((b,), t, dtype=torch.int32, device="cuda")

    def pool(x):
        return x.reshape(b, HKV, t // p, p, D).permute(0, 2, 3, 1, 4).reshape(b * (t // p), p, HKV, D).contiguous()
    calls["e4m3 p16 NHD"] = (pool(k8), pool(v8), dict(sc, block_table=table, seq_lens=sl, kv_layout="NHD"))
    calls["e4m3 HND 16x12"] = (k8, v8, dict(sc, plan=H._fp8_splits(b, HKV, t, SMS, None, ONE16_12, D)))
    calls["e4m3 HND 32x6"] = (k8, v8, dict(sc, plan=H._fp8_splits(b, HKV, t, SMS, None, ONE32_6, D)))
    use()
    ref = flash_decode(q, k8, v8, **sc).float()
    row = {"B": b, "T": t, "policy_plan": str(H.one_warp_plan(b, HKV, t, SMS)[:3])}
    for name, (kc, vc, kw) in calls.items():
        use()
        o = flash_decode(q, kc, vc, **kw).float()
        if name.startswith("e4m3"):
            row[name + " maxdiff"] = float((o - ref).abs().max())
    for r in range(ROUNDS):
        for name, (kc, vc, kw) in calls.items():
            use()
            row.setdefault(name, []).append(round(bench_graph(lambda: flash_decode(q, kc, vc, **kw)), 2))
    rows.append(row)
    print(json.dumps(row), flush=True)
    del q, k8, v8, calls, ref, o
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), "probe_n.json"), "w") as f:
    json.dump(rows, f, indent=1)
