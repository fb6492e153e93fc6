"""A/B of programmatic dependent launch in one process: flash_decode graphed, PDL on/off alternated."""
import json, os, statistics, sys
import torch
sys.path.insert(0, ".")
from benchmarks._harness import bench_graph
from benchmarks import peers
from cp_attention import decode, heuristics
shapes = [(1, 2048, 32, 8), (1, 8192, 32, 8), (1, 32768, 32, 8), (1, 131072, 32, 8), (4, 32768, 32, 8), (8, 131072, 32, 8),
          (16, 32768, 32, 8), (64, 8192, 32, 8), (1, 131072, 32, 4), (1, 131072, 64, 8)]
dev = torch.device("cuda", 0)
rows = []
for b, t, hq, hkv in shapes:
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, hq, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    res = {"on": [], "off": []}
    sd = bench_graph(peers.sdpa_default(q, k, v))
    for rep in range(3):
        for mode in ("on", "off"):
            heuristics._PDL[dev] = mode == "on"
            decode._PREPARED.clear(); decode._LAST = (None, None)
            res[mode].append(bench_graph(lambda: decode.flash_decode(q, k, v)))
    row = {"B": b, "T": t, "heads": f"{hq}/{hkv}", "sdpa": sd, "pdl_on": statistics.median(res["on"]),
           "pdl_off": statistics.median(res["off"]), "on_all": res["on"], "off_all": res["off"]}
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("_all")}), flush=True)
    rows.append(row)
    del q, k, v
    torch.cuda.empty_cache()
json.dump(rows, open(os.environ.get("OUT", ".") + "/p/pdl_ab.json", "w"), indent=1)
