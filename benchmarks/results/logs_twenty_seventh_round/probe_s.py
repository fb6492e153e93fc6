"""Probe S: why dense NHD e4m3 caches read faster than HND. One process per build: `main` (the library) times the
HND cache, the NHD cache and HND caches whose heads are padded by 8 or 264 positions (1 KB, 33 KB: the heads'
starts off their 16 MB alignment), and 12-row causal calls in the policy's plan and in FP8_ONE_WARP_FEW's;
`rot<N>` (the probe build of `probe_s_rotate.patch`, CP_ATTENTION_FP8_ROTATE=N) times HND and NHD with each
program's unmasked tiles rotated (1: by the KV head, h / Hkv of the split; 2: by head and split). bf16 HND
beside each (the machine). 32/8/128, graph µs. Usage: probe_s.py ROOT TAG."""
import json, os, sys
root, tag = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv, decode, heuristics as H
from cp_attention.ops import split_kv

SMS = torch.cuda.get_device_properties(0).multi_processor_count
HQ, HKV, D = 32, 8, 128
MAIN = tag.startswith("main") and "_s2" not in tag  # probe S2: HND and NHD only


def use():
    decode._PREPARED.clear()
    decode._LAST = (None, None)


def triton_plan(b, t, rows):
    return H.decode_plan(b, HKV, t, D, torch.bfloat16, SMS, kv_dtype=torch.float8_e4m3fn, rows=rows)


def padded(x, pad):  # [B, Hkv, T, D] in storage of [B, Hkv, T + pad, D]
    b, h, t, d = x.shape
    y = torch.empty(b, h, t + pad, d, dtype=x.dtype, device=x.device)[:, :, :t]
    y.copy_(x)
    return y


rows = []
for b, t in ((1, 131072), (16, 32768), (64, 8192), (1, 1 << 20)):
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    row = {"tag": tag, "B": b, "T": t}
    use()
    row["bf16"] = [round(bench_graph(lambda: flash_decode(q, k, v)), 2)]
    k8, v8, ks, vs = quantize_kv(k, v)
    del k, v
    sc = dict(k_scale=ks, v_scale=vs)
    calls = {"HND": (k8, v8, sc),
             "NHD": (k8.transpose(1, 2).contiguous(), v8.transpose(1, 2).contiguous(), dict(sc, kv_layout="NHD"))}
    if MAIN:
        for pad in (8, 264):
            calls[f"HND pad {pad}"] = (padded(k8, pad), padded(v8, pad), sc)
    use()
    ref = flash_decode(q, k8, v8, plan=triton_plan(b, t, 4), **sc).float()
    for name, (kc, vc, kw) in calls.items():
        use()
        o = flash_decode(q, kc, vc, **kw).float()
        row[name + " maxdiff"] = float((o - ref).abs().max()) if torch.isfinite(o).all() else "non-finite"
    for r in range(2):
        for name, (kc, vc, kw) in calls.items():
            use()
            row.setdefault(name, []).append(round(bench_graph(lambda: flash_decode(q, kc, vc, **kw)), 2))
    use()
    row["bf16"].append(None)
    rows.append(row)
    print(json.dumps(row), flush=True)
    del q, k8, v8, calls, ref, o
    torch.cuda.empty_cache()

if MAIN:  # 12 rows a KV head (3 causal rows at GQA 4): the rows' form, FEW's 32-key tiles beyond 2048 positions
    for b, t in ((64, 8192), (16, 32768)):
        g = torch.Generator("cuda").manual_seed(1)
        q = torch.randn((b, 3, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
        k8, v8, ks, vs = quantize_kv(torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16),
                                     torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16))
        sc = dict(k_scale=ks, v_scale=vs)
        few = H._fp8_splits(b, HKV, t, SMS, None, H.FP8_ONE_WARP_FEW, D)
        row = {"tag": tag, "B": b, "T": t, "rows": 12, "policy": str(H.one_warp_plan(b, HKV, t, SMS, rows=12)),
               "few": str(few)}
        use()
        ref = flash_decode(q, k8, v8, plan=triton_plan(b, t, 12), **sc).float()
        for name, plan in (("12 rows policy", None), ("12 rows FEW", few)):
            use()
            o = flash_decode(q, k8, v8, plan=plan, **sc).float()
            row[name + " maxdiff"] = float((o - ref).abs().max())
            for r in range(2):
                use()
                row.setdefault(name, []).append(round(bench_graph(lambda: flash_decode(q, k8, v8, plan=plan, **sc)),
                                                      2))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k8, v8, ref, o
        torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), f"probe_s_{tag}.json"), "w") as f:
    json.dump(rows, f, indent=1)
