"""Microbenchmark of the level-2 merge formulations: one program per head merges S states of G rows."""
import json, os, sys
import torch, triton, triton.language as tl
sys.path.insert(0, ".")
from benchmarks._harness import bench_graph
from cp_attention.ops._state import merge_tile, finalize, LOG2E


@triton.jit
def v0(WL, WO, OUT, S, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BG: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    o_g = tl.arange(0, BG); m_g = o_g < G
    o_d = tl.arange(0, D); m_d = o_d < D
    b_o, b_lse = merge_tile(WL + p * S * G, WO + p * S * G * D, S, G, 1, G * D, D, o_g, m_g, o_d, m_d, BS, BG, D, ".cg")
    tl.store(OUT + (p * G + o_g)[:, None] * D + o_d[None, :], b_o, mask=m_g[:, None])


@triton.jit
def v1(WL, WO, OUT, S, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BG: tl.constexpr, BSS: tl.constexpr):
    """two passes: the max of every lse first, then independent weighted sums"""
    p = tl.program_id(0).to(tl.int64)
    o_g = tl.arange(0, BG); m_g = o_g < G
    o_d = tl.arange(0, D)
    pl = WL + p * S * G
    po = WO + p * S * G * D
    o_ss = tl.arange(0, BSS)
    all_l = tl.load(pl + o_ss[:, None] * G + o_g[None, :], mask=(o_ss[:, None] < S) & m_g[None, :], other=float("-inf"), cache_modifier=".cg")
    m = tl.max(all_l, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, D], tl.float32)
    for j0 in range(0, S, BS):
        o_s = j0 + tl.arange(0, BS)
        m_sg = (o_s[:, None] < S) & m_g[None, :]
        b_l = tl.load(pl + o_s[:, None] * G + o_g[None, :], mask=m_sg, other=float("-inf"), cache_modifier=".cg")
        b_o = tl.load(po + (o_s[:, None, None] * G + o_g[None, :, None]) * D + o_d[None, None, :], mask=m_sg[:, :, None], other=0.0, cache_modifier=".cg")
        w = tl.where(b_l == m_ref[None, :], 1.0, tl.exp2((b_l - m_ref[None, :]) * LOG2E))
        l_i += tl.sum(w, 0)
        acc += tl.sum(w[:, :, None] * b_o, 0)
    o, lse = finalize(m, l_i, acc, 1.0)
    tl.store(OUT + (p * G + o_g)[:, None] * D + o_d[None, :], o, mask=m_g[:, None])


@triton.jit
def _merge_row(pl, po, OUT, p, g, o_s, m_s, o_d, G: tl.constexpr, D: tl.constexpr):
    """one row: a [S, D] tile, the lse loaded broadcast in the same layout, one pass"""
    b_l = tl.load(pl + o_s[:, None] * G + g + o_d[None, :] * 0, mask=m_s[:, None], other=float("-inf"), cache_modifier=".cg")
    b_o = tl.load(po + (o_s[:, None] * G + g) * D + o_d[None, :], mask=m_s[:, None], other=0.0, cache_modifier=".cg")
    m = tl.max(b_l, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(b_l == m_ref[None, :], 1.0, tl.exp2((b_l - m_ref[None, :]) * LOG2E))
    tl.store(OUT + (p * G + g) * D + o_d, tl.sum(w * b_o, 0) / tl.sum(w, 0))


@triton.jit
def v3(WL, WO, OUT, S, G: tl.constexpr, D: tl.constexpr, BSS: tl.constexpr):
    """row by row, unrolled"""
    p = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BSS)
    for g in tl.static_range(G):
        _merge_row(WL + p * S * G, WO + p * S * G * D, OUT, p, g, o_s, o_s < S, tl.arange(0, D), G, D)


@triton.jit
def v4(WL, WO, OUT, S, G: tl.constexpr, D: tl.constexpr, BSS: tl.constexpr):
    """row by row in a runtime loop (the pipeliner may prefetch the next row)"""
    p = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BSS)
    for g in range(G):
        _merge_row(WL + p * S * G, WO + p * S * G * D, OUT, p, g, o_s, o_s < S, tl.arange(0, D), G, D)


def np2(n): return 1 << (n - 1).bit_length()


rows = []
for P, S, G in ((4, 32, 8), (8, 16, 4), (8, 16, 8), (4, 32, 4), (8, 16, 7), (1024, 32, 2)):
    D = 128
    wl = torch.randn(P * S * G, device="cuda")
    wo = torch.randn(P * S * G * D, device="cuda")
    ref = None
    out = torch.empty(P * G * D, device="cuda")
    BG = min(16, np2(G)); BS = max(1, min(np2(S), 8192 // (BG * D)))
    res = {"P": P, "S": S, "G": G}
    cands = {
        "v0_w4": lambda: v0[(P,)](wl, wo, out, S, G, D, BS, BG, num_warps=4),
        "v0_w4_s1": lambda: v0[(P,)](wl, wo, out, S, G, D, BS, BG, num_warps=4, num_stages=1),
        "v1_w4": lambda: v1[(P,)](wl, wo, out, S, G, D, BS, BG, np2(S), num_warps=4),
        "v1_w4_s3": lambda: v1[(P,)](wl, wo, out, S, G, D, BS, BG, np2(S), num_warps=4, num_stages=3),
        "v3_w4": lambda: v3[(P,)](wl, wo, out, S, G, D, np2(S), num_warps=4),
        "v4_w4_s3": lambda: v4[(P,)](wl, wo, out, S, G, D, np2(S), num_warps=4, num_stages=3),
        "v4_w4_s1": lambda: v4[(P,)](wl, wo, out, S, G, D, np2(S), num_warps=4, num_stages=1),
    }
    for name, fn in cands.items():
        try:
            fn(); torch.cuda.synchronize()
            got = out.clone()
            if ref is None:
                ref = got
            res[name] = round(bench_graph(fn), 2)
            res[name + "_err"] = float((got - ref).abs().max())
        except Exception as e:
            res[name] = f"{type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(res), flush=True)
    rows.append(res)
json.dump(rows, open(os.environ.get("OUT", ".") + "/p/merge_probe.json", "w"), indent=1)
