"""Probe P: the one-warp FP8 kernel at head dim 256 on the dense cache (HND, NHD) and on page pools of 16 and 64
(NHD, HND) in sequence order, e4m3 per tensor; head dim 128 alongside at B=64 T=8k; graph µs, interleaved rounds."""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from benchmarks.peers import page_table
from cp_attention import flash_decode, quantize_kv, decode

HKV = 8


def use():
    decode._PREPARED.clear()
    decode._LAST = (None, None)


def forms(k8, v8, b, t):
    out = {"dense HND": (k8, v8, {}),
           "dense NHD": (k8.transpose(1, 2).contiguous(), v8.transpose(1, 2).contiguous(), {"kv_layout": "NHD"})}
    sl = torch.full((b,), t, dtype=torch.int32, device="cuda")
    for p in (16, 64):
        table = page_table(b, t // p, "cuda")
        for layout in ("NHD", "HND"):
            def pool(x):
                x = x.reshape(b, HKV, t // p, p, x.shape[-1]).permute(0, 2, 1, 3, 4)  # [B, pages, Hkv, p, D]
                x = x.reshape(b * (t // p), HKV, p, x.shape[-1])
                return x.transpose(1, 2).contiguous() if layout == "NHD" else x.contiguous()
            out[f"pages {p} {layout}"] = (pool(k8), pool(v8), dict(block_table=table, seq_lens=sl, kv_layout=layout))
    return out


out_dir = os.environ.get("OUT", ".")
ROUNDS = int(os.environ.get("ROUNDS", "2"))
rows = []
for hq, d, b, t in ((16, 256, 1, 131072), (16, 256, 16, 32768), (16, 256, 64, 8192), (32, 128, 64, 8192)):
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, hq, d), generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(torch.randn(b, HKV, t, d, generator=g, device="cuda", dtype=torch.bfloat16),
                                 torch.randn(b, HKV, t, d, generator=g, device="cuda", dtype=torch.bfloat16))
    fs = forms(k8, v8, b, t)
    del k8, v8
    use()
    base = None
    err, times = {}, {n: [] for n in fs}
    for name, (kc, vc, kw) in fs.items():
        use()
        o = flash_decode(q, kc, vc, k_scale=ks, v_scale=vs, **kw).float()
        base = o if base is None else base
        err[name] = float((o - base).abs().max())
    for r in range(ROUNDS):
        for name, (kc, vc, kw) in fs.items():
            use()
            times[name].append(round(bench_graph(lambda: flash_decode(q, kc, vc, k_scale=ks, v_scale=vs, **kw)), 2))
    row = dict(Hq=hq, D=d, B=b, T=t, times=times, err=err)
    rows.append(row)
    print(json.dumps(row), flush=True)
    del q, fs
    torch.cuda.empty_cache()
json.dump(dict(rows=rows), open(os.path.join(out_dir, "probe_p.json"), "w"), indent=1)
