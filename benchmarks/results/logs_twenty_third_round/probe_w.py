"""Probe W: more than 16 query rows per KV head in one program of a warp per 16 rows (one ring) against row tiles of
one warp (each reading the split), the Triton FP8 kernel and bf16; graph µs, interleaved rounds in one process."""
import json, os, sys
root, tag = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv, decode, heuristics as H

HKV, D, G = 8, 128, 4
HQ = HKV * G
orig_plan, orig_fp8 = decode.one_warp_plan, decode.one_warp_fp8
state = {"plan": None, "triton": False}
decode.one_warp_plan = lambda *a, **kw: state["plan"] or orig_plan(*a, **kw)
decode.one_warp_fp8 = lambda *a, **kw: False if state["triton"] else orig_fp8(*a, **kw)


def use(plan=None, triton=False):
    state.update(plan=plan, triton=triton)
    decode._PREPARED.clear()
    decode._LAST = (None, None)


rows_out = []
for b, t in ((1, 131072), (16, 32768), (64, 8192)):
    for q_rows in ((4, 5, 8, 12, 16) if b < 64 else (8, 16)):
        rows = q_rows * G
        g = torch.Generator("cuda").manual_seed(0)
        q = torch.randn((b, q_rows, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
        k8, v8, ks, vs = quantize_kv(k, v)
        fn = lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs)
        variants = {"policy": dict()}
        if 16 < rows <= 32:
            rt = -(-rows // 16)
            old = H.decode_plan(b, HKV * rt, t, 128, torch.bfloat16, 132, None, H.FP8_ONE_WARP_LONG, torch.float8_e4m3fn)
            variants["row_tiles"] = dict(plan=old)
        variants["triton"] = dict(triton=True)
        use(triton=True)
        ref = fn().float().clone()
        err, times, grids = {}, {n: [] for n in variants}, {}
        for r in range(2):
            for name, kw in variants.items():
                use(**kw)
                if r == 0:
                    err[name] = float((fn().float() - ref).abs().max())
                    grids[name] = [(p.launcher.kernel.__name__, p.launcher.grid, p.launcher.options.get("num_warps"))
                                   for p in decode._PREPARED.values()]
                times[name].append(round(bench_graph(fn), 2))
        use()
        bf = round(bench_graph(lambda: flash_decode(q, k, v)), 2)
        row = dict(tag=tag, B=b, T=t, Q=q_rows, rows=rows, bf16=bf, times=times, err=err, grids=grids)
        print(json.dumps(row), flush=True)
        rows_out.append(row)
        del q, k, v, k8, v8
        torch.cuda.empty_cache()
json.dump(rows_out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"probe_w_{tag}.json"), "w"), indent=1)
