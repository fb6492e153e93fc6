"""Probe K: key streams, a warp each, in the one-warp FP8 kernel (64- or 128-key tiles shared by 2 or 4 warps, each
folding its own 16 or 32 keys of a tile into its own state, merged once at the end), against the plan; graph µs,
interleaved rounds in one process; outputs against the plan's and, on ragged causal calls, the Triton kernel's."""
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
CF = {"S2_64": C(64, 2, 3, programs=2, warp_rows=16), "S4_64": C(64, 4, 3, programs=2, warp_rows=16),
      "S2_32": C(32, 2, 3, programs=4, warp_rows=16), "S4_128": C(128, 4, 3, programs=1, warp_rows=16)}
decode.ONE_WARP_CONFIGS = split_kv.ONE_WARP_CONFIGS = H.ONE_WARP_CONFIGS + tuple(CF.values())
HKV, D, HQ = 8, 128, 32
orig_plan = decode.one_warp_plan
current = {"plan": None}
decode.one_warp_plan = lambda *a, **kw: current["plan"] or orig_plan(*a, **kw)


orig_cfg = split_kv.split_kv_launch_config
MODE = {"v": 0}


def patched_cfg(*a, **kw):
    c, o, t = orig_cfg(*a, **kw)
    if c["STREAMS"] > 1:
        c = dict(c, STREAM_MODE=MODE["v"])
    return c, o, t





def use(plan, mode=0):
    decode._STREAM_MODE = mode
    current["plan"] = plan
    decode._PREPARED.clear()
    decode._LAST = (None, None)


def sp(name, splits, t):
    cfg = CF[name]
    tps = -(-t // (splits * cfg.block_n))
    return H.DecodePlan(cfg, splits, tps, streams=cfg.num_warps)


out_dir = os.environ.get("OUT", ".")
# correctness: ragged causal drafts (4 rows x GQA 4), sinks, softcap; the Triton kernel as reference
checks = []
g = torch.Generator("cuda").manual_seed(1)
b, t = 3, 5003
q = torch.randn((b, 4, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
k8, v8, ks, vs = quantize_kv(k, v)
sl = torch.tensor([5003, 1777, 4096], device="cuda", dtype=torch.int32)
sinks = torch.randn(HQ, generator=g, device="cuda")
for kw in ({}, {"sinks": sinks, "logit_softcap": 30.0}, {"window_left": 1000}):
    use(None)
    ref = flash_decode(q[:, :1], k8, v8, k_scale=ks, v_scale=vs, seq_lens=sl, **kw).float()
    refq = flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, seq_lens=sl, **kw).float()
    for name, splits, mode in (("S2_64", 5, 1), ("S2_32", 7, 1), ("S4_128", 2, 1), ("S2_64", 1, 1), ("S2_64", 1, 3)):
        use(sp(name, splits, t), mode)
        o1 = flash_decode(q[:, :1], k8, v8, k_scale=ks, v_scale=vs, seq_lens=sl, **kw).float()
        o4 = flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, seq_lens=sl, **kw).float()
        checks.append(dict(kw=sorted(kw), cfg=name, splits=splits, mode=mode, err_q1=float((o1 - ref).abs().max()),
                           err_q4=float((o4 - refq).abs().max()), nan=bool(o1.isnan().any() or o4.isnan().any())))
print(json.dumps(checks, indent=0), flush=True)
del q, k, v, k8, v8

CASES = {
    (1, 131072): [("S2_64", 33, 0), ("S2_64", 33, 1), ("S2_64", 66, 1), ("S2_32", 66, 0), ("S2_32", 66, 1), ("S4_128", 33, 1)],
    (64, 8192): [("S2_64", 1, 0), ("S2_64", 1, 1), ("S2_32", 1, 1)],
    (16, 32768): [("S2_64", 4, 0), ("S2_64", 4, 1), ("S2_32", 8, 1)],
}
ROUNDS = int(os.environ.get("ROUNDS", "2"))
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
    plans = {"plan": (None, 0), **{f"{n} x{s} m{m}": (sp(n, s, t), m) for n, s, m in variants}}
    err = {}
    for name, plan in plans.items():
        use(*plan)
        err[name] = float((fn().float() - base).abs().max())
    times = {name: [] for name in plans}
    bf = []
    for r in range(ROUNDS):
        for name, plan in plans.items():
            use(*plan)
            times[name].append(round(bench_graph(fn), 2))
        if r == 0:
            use(None)
            bf.append(round(bench_graph(lambda: flash_decode(q, k, v)), 2))
    row = dict(B=b, T=t, bf16=bf, times=times, err=err)
    rows.append(row)
    print(json.dumps(row), flush=True)
    del q, k, v, k8, v8
    torch.cuda.empty_cache()
json.dump(dict(checks=checks, rows=rows), open(os.path.join(out_dir, "probe_k.json"), "w"), indent=1)
