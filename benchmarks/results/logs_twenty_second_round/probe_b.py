"""Probe B: plans of the one-warp kernel for 16 and 32 rows (four programs per SM in 32-key tiles, eight in 32-key
tiles, eight in 16-key tiles, one wave each) against the Triton FP8 kernel's plan and bf16. Graph µs."""
import json, os, sys, math
sys.path.insert(0, os.getcwd())
import torch
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv, decode
from cp_attention.heuristics import (decode_plan, num_sms, FP8_ONE_WARP, FP8_ONE_WARP_LONG, FP8_ONE_WARP_FEW,
                                     DecodePlan)

HKV, D, HQ = 8, 128, 32
sms = num_sms(torch.device("cuda"))
out = []
def wave_plan(config, b, t, n_rt):
    splits = max(1, config.programs * sms // (b * HKV * n_rt))
    tiles = math.ceil(t / config.block_n)
    tps = math.ceil(tiles / splits)
    return DecodePlan(config, math.ceil(tiles / tps), tps)

for b, t, qs in ((1, 131072, (1, 4, 5, 8)), (4, 32768, (4, 8)), (16, 32768, (4, 8)), (64, 8192, (8,))):
    for q_rows in qs:
        g = torch.Generator("cuda").manual_seed(0)
        q = torch.randn(b, q_rows, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
        k8, v8, ks, vs = quantize_kv(k, v)
        rows = q_rows * HQ // HKV
        n_rt = -(-rows // 16)
        row = dict(B=b, T=t, Q=q_rows, rows=rows)
        ref = flash_decode(q, k, v).float()
        impls = [("bf16", None, (q, k, v, {})), ("e4m3_policy", None, (q, k8, v8, dict(k_scale=ks, v_scale=vs))),
                 ("e4m3_triton", decode_plan(b, HKV, t, D, torch.bfloat16, sms, kv_dtype=torch.float8_e4m3fn, rows=rows),
                  (q, k8, v8, dict(k_scale=ks, v_scale=vs)))]
        for cname, cfg in (("few4x32", FP8_ONE_WARP_FEW), ("eight32", FP8_ONE_WARP_LONG), ("eight16", FP8_ONE_WARP)):
            impls.append((cname, wave_plan(cfg, b, t, n_rt), (q, k8, v8, dict(k_scale=ks, v_scale=vs))))
        for name, plan, (qq, kk, vv, kw) in impls:
            decode._PREPARED.clear(); decode._LAST = (None, None)
            fn = (lambda: flash_decode(qq, kk, vv, plan=plan, **kw))
            try:
                o = fn()
                row[name + "_err"] = float((o.float() - ref).abs().max())
                row[name] = round(bench_graph(fn), 2)
                if plan is not None:
                    row[name + "_plan"] = [plan.num_splits, plan.tiles_per_split]
            except Exception as e:
                row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        out.append(row)
        del q, k, v, k8, v8
        torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_b.json"), "w"), indent=1)
