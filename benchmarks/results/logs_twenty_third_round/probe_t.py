"""Probe T: tail splits handed out by a ticket counter (one-warp FP8 kernel), graph µs against the plan's splits,
interleaved rounds in one process; correctness against the plan's output and bitwise repeatability."""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
import torch
import cp_attention
assert cp_attention.__file__.startswith(os.path.abspath(root)), cp_attention.__file__
from benchmarks._harness import bench_graph
from cp_attention import flash_decode, quantize_kv, decode, heuristics as H

HKV, D, HQ = 8, 128, 32
# (B, T): {name: (config, long splits, tiles a long split, tail splits, tiles a tail split)}
CASES = {
    (64, 8192): {"t248x2+2x8": (H.FP8_ONE_WARP, 2, 248, 2, 8), "t240x2+4x8": (H.FP8_ONE_WARP, 2, 240, 4, 8),
                 "t240x2+2x16": (H.FP8_ONE_WARP, 2, 240, 2, 16), "t232x2+6x8": (H.FP8_ONE_WARP, 2, 232, 6, 8)},
    (16, 32768): {"t248x8+8x8": (H.FP8_ONE_WARP, 8, 248, 8, 8), "t240x8+16x8": (H.FP8_ONE_WARP, 8, 240, 16, 8),
                  "t240x8+8x16": (H.FP8_ONE_WARP, 8, 240, 8, 16), "t232x8+24x8": (H.FP8_ONE_WARP, 8, 232, 24, 8)},
    (1, 131072): {"t61x66+9x8": (H.FP8_ONE_WARP_FEW, 66, 61, 9, 8), "t59x66+26x8": (H.FP8_ONE_WARP_FEW, 66, 59, 26, 8),
                  "t59x66+13x16": (H.FP8_ONE_WARP_FEW, 66, 59, 13, 16), "t57x66+42x8": (H.FP8_ONE_WARP_FEW, 66, 57, 42, 8)},
    (1, 1 << 20): {"t242x132+103x8": (H.FP8_ONE_WARP_LONG, 132, 242, 103, 8),
                   "t236x132+101x16": (H.FP8_ONE_WARP_LONG, 132, 236, 101, 16)},
}
ROUNDS = int(os.environ.get("ROUNDS", "2"))
TAILS = "tail_splits" in H.DecodePlan._fields
TAG = sys.argv[2]
orig_plan = decode.one_warp_plan
current = {"plan": None}


def patched(*a, **kw):
    return current["plan"] or orig_plan(*a, **kw)


decode.one_warp_plan = patched


def use(plan):
    current["plan"] = plan
    decode._PREPARED.clear()
    decode._LAST = (None, None)


rows = []
for (b, t), variants in CASES.items():
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((b, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, t, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(k, v)
    fn = lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs, return_lse=True)
    use(None)
    base = fn()
    base_o, base_lse = base.o.float().clone(), base.lse.clone()
    plans = {"plan": None}
    for name, (cfg, n_long, tps, n_tail, tail_tiles) in (variants.items() if TAILS else ()):
        total = n_long * tps + n_tail * tail_tiles
        assert total * cfg.block_n >= t > (total - tail_tiles) * cfg.block_n, (name, total * cfg.block_n, t)
        plans[name] = H.DecodePlan(cfg, n_long + n_tail, tps, tail_splits=n_tail, tail_tiles=tail_tiles)
    check = {}
    for name, plan in plans.items():
        use(plan)
        a = fn(); a_o, a_lse = a.o.float().clone(), a.lse.clone()
        c = fn()
        check[name] = dict(err_o=float((a_o - base_o).abs().max()), err_lse=float((a_lse - base_lse).abs().max()),
                           repeat_bitwise=bool(torch.equal(a_o, c.o.float()) and torch.equal(a_lse, c.lse)))
    times = {name: [] for name in plans}
    bf = []
    for r in range(ROUNDS):
        for name, plan in plans.items():
            use(plan)
            times[name].append(round(bench_graph(lambda: flash_decode(q, k8, v8, k_scale=ks, v_scale=vs)), 2))
        if r == 0:
            use(None)
            bf.append(round(bench_graph(lambda: flash_decode(q, k, v)), 2))
    # after the graphs: still right (the counters reset by every launch)
    for name, plan in plans.items():
        use(plan)
        a = fn()
        check[name]["after_graphs_err_o"] = float((a.o.float() - base_o).abs().max())
    row = dict(tag=TAG, B=b, T=t, bf16=bf, times=times, check=check)
    print(json.dumps(row), flush=True)
    rows.append(row)
    del q, k, v, k8, v8
    torch.cuda.empty_cache()
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(os.path.join(out, f"probe_t_{TAG}.json"), "w"), indent=1)
