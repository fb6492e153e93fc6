"""Probe X: the one-warp FP8 kernel with the keys as the mma rows (s = k . q^T, acc^T += v^T . p^T, for at most 8
query rows a KV head) against the old form (CP_ATTENTION_FP8_KEYS_M=0); one process per mode, interleaved by the
caller; bf16 of the same call in the same process; outputs against the Triton FP8 kernel's; graph µs."""
import json, os, sys
root, tag = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from benchmarks.peers import page_table
from cp_attention import flash_decode, quantize_kv, decode, heuristics as H
from cp_attention.ops import split_kv_fp8

SMS = torch.cuda.get_device_properties(0).multi_processor_count
HKV = 8
MODE = os.environ.get("CP_ATTENTION_FP8_KEYS_M", "1")
assert bool(split_kv_fp8.KEYS_AS_ROWS.value) == (MODE != "0")


def use():
    decode._PREPARED.clear()
    decode._LAST = (None, None)


def forced(b, t, d):  # the one-warp kernel's 16-key tiles, eight programs an SM (test_gpu.one_warp_given_plan)
    return H.decode_plan(b, HKV, t, d, torch.bfloat16, SMS, None, config=H.FP8_ONE_WARP)


def triton_plan(b, t, d, rows):
    return H.decode_plan(b, HKV, t, d, torch.bfloat16, SMS, kv_dtype=torch.float8_e4m3fn, rows=rows)


# (name, Hq, D, B, T, Q rows, causal, page, forced plan, bf16 too)
CASES = [("128 B1 128k", 32, 128, 1, 131072, 1, False, 0, False, True),
         ("128 B16 32k", 32, 128, 16, 32768, 1, False, 0, False, True),
         ("128 B64 8k", 32, 128, 64, 8192, 1, False, 0, False, True),
         ("128 B1 1M", 32, 128, 1, 1 << 20, 1, False, 0, False, True),
         ("128 B1 128k Q2", 32, 128, 1, 131072, 2, True, 0, False, False),
         ("128 B16 32k Q2", 32, 128, 16, 32768, 2, True, 0, False, False),
         ("128 B16 32k p16", 32, 128, 16, 32768, 1, False, 16, False, False),
         ("256 B1 128k", 16, 256, 1, 131072, 1, False, 0, False, True),
         ("256 B16 32k", 16, 256, 16, 32768, 1, False, 0, False, True),
         ("256 B64 8k", 16, 256, 64, 8192, 1, False, 0, False, True),
         ("256 B16 32k p16", 16, 256, 16, 32768, 1, False, 16, False, False),
         ("256 B64 8k p64", 16, 256, 64, 8192, 1, False, 64, False, False),
         ("256 B1 128k Q2 1w", 16, 256, 1, 131072, 2, True, 0, True, False),
         ("256 B1 128k Q4 1w", 16, 256, 1, 131072, 4, True, 0, True, False),
         ("256 B1 128k Q4 triton", 16, 256, 1, 131072, 4, True, 0, "triton", False)]
only = os.environ.get("CASES")
rows = []
for name, hq, d, b, t, qr, causal, page, plan_kind, with_bf16 in CASES:
    if only and name not in only.split(","):
        continue
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, qr, hq, d) if qr > 1 else (b, hq, d), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, d, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, d, generator=g, device="cuda", dtype=torch.bfloat16)
    row = dict(case=name, mode=MODE, tag=tag)
    if with_bf16:
        use()
        row["bf16"] = bench_graph(lambda: flash_decode(q, k, v))
    k8, v8, ks, vs = quantize_kv(k, v)
    del k, v
    kw = dict(k_scale=ks, v_scale=vs)
    if page:
        sl = torch.full((b,), t, dtype=torch.int32, device="cuda")
        table = page_table(b, t // page, "cuda")

        def pool(x):  # NHD pages in sequence order
            x = x.reshape(b, HKV, t // page, page, d).permute(0, 2, 3, 1, 4)
            return x.reshape(b * (t // page), page, HKV, d).contiguous()
        kc, vc = pool(k8), pool(v8)
        kw.update(block_table=table, seq_lens=sl, kv_layout="NHD")
    else:
        kc, vc = k8, v8
    rws = qr * hq // HKV
    plan = forced(b, t, d) if plan_kind is True else triton_plan(b, t, d, rws) if plan_kind == "triton" else None
    use()
    out = flash_decode(q, kc, vc, plan=plan, **kw).float()
    use()
    ref = flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, plan=triton_plan(b, t, d, rws)).float()
    row["maxdiff_vs_triton"] = float((out - ref).abs().max()) if torch.isfinite(out).all() else "non-finite"
    use()
    row["e4m3"] = bench_graph(lambda: flash_decode(q, kc, vc, plan=plan, **kw))
    if with_bf16:
        row["ratio"] = row["e4m3"] / row["bf16"]
    rows.append(row)
    print(json.dumps(row), flush=True)
    del q, k8, v8, kc, vc, out, ref
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), f"probe_x_{tag}.json"), "w") as f:
    json.dump(rows, f, indent=1)
