"""Probe R: how fast can 528-1056 programs read an FP8 K/V cache's bytes, by tile size, warps a program and
programs an SM?  Pure reads (xor of the words, no conversion), Triton-pipelined (cp.async ring), graph µs."""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
import torch, triton, triton.language as tl
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv


@triton.jit
def _read(K, V, OUT, TPS, stride_h, BN: tl.constexpr, STAGES: tl.constexpr):
    h = tl.program_id(0)
    s = tl.program_id(1)
    o = (s * TPS * BN + tl.arange(0, BN))[:, None].to(tl.int64) * 32 + tl.arange(0, 32)[None, :]
    pk = K + h.to(tl.int64) * stride_h + o
    pv = V + h.to(tl.int64) * stride_h + o
    acc = tl.zeros([BN, 32], tl.int32)
    for it in tl.range(0, TPS, num_stages=STAGES):
        acc ^= tl.load(pk + it * BN * 32)
        acc ^= tl.load(pv + it * BN * 32)
    tl.store(OUT + h * tl.num_programs(1) + s, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def reader(k32, v32, splits, bn, warps, stages):
    heads, t = k32.shape[0], k32.shape[1]
    tps = t // (splits * bn)
    assert tps * splits * bn == t, (t, splits, bn)
    out = torch.empty(heads * splits, dtype=torch.int32, device="cuda")
    return lambda: _read[(heads, splits)](k32, v32, out, tps, k32.stride(0), BN=bn, STAGES=stages,
                                          num_warps=warps)


HKV, D, HQ = 8, 128, 32
# (label, splits, BLOCK keys, warps, stages)
VARIANTS = {
    (1, 131072): [("32k1w x528 s3", 64, 32, 1, 3), ("16k1w x1056 s3", 128, 16, 1, 3), ("32k1w x264 s3", 32, 32, 1, 3),
                  ("64k2w x264 s3", 32, 64, 2, 3), ("128k4w x264 s3", 32, 128, 4, 3), ("64k4w x528 s3", 64, 64, 4, 3),
                  ("128k4w x128 s4", 16, 128, 4, 4), ("256k8w x128 s3", 16, 256, 8, 3), ("32k1w x528 s4", 64, 32, 1, 4),
                  ("32k1w x528 s2", 64, 32, 1, 2)],
    (64, 8192): [("16k1w x1024 s3", 2, 16, 1, 3), ("32k1w x512 s3", 1, 32, 1, 3), ("64k2w x512 s3", 1, 64, 2, 3),
                 ("128k4w x512 s3", 1, 128, 4, 3), ("32k1w x1024 s3", 2, 32, 1, 3), ("64k4w x1024 s3", 2, 64, 4, 3)],
}
ROUNDS = 2
rows = []
for (b, t), variants in VARIANTS.items():
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    k32 = k8.view(torch.int32).reshape(b * HKV, t, 32)
    v32 = v8.view(torch.int32).reshape(b * HKV, t, 32)
    fns = {"flash_decode e4m3": lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs),
           "flash_decode bf16": lambda: flash_decode(q, k, v)}
    for label, splits, bn, w, st in variants:
        fns["read " + label] = reader(k32, v32, splits, bn, w, st)
    times = {n: [] for n in fns}
    for r in range(ROUNDS):
        for n, fn in fns.items():
            times[n].append(round(bench_graph(fn), 2))
    nbytes = 2 * k8.numel()
    row = dict(B=b, T=t, fp8_bytes=nbytes, times=times,
               tbs={n: round(nbytes * (2 if "bf16" in n else 1) / min(v) / 1e6, 3) for n, v in times.items()})
    rows.append(row)
    print(json.dumps(row, indent=1), flush=True)
    del k, v, k8, v8, k32, v32
    torch.cuda.empty_cache()
out = os.environ.get("OUT", ".")
json.dump(rows, open(os.path.join(out, "probe_r.json"), "w"), indent=1)
