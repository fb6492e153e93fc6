"""transformers' own ``generate()`` with ``attn_implementation="cp_attention"`` and a :class:`cp_attention.hf.CPCache`,
against the library's hand-written model (``launch/generate.py``'s native backend) and against transformers' own
attention (sdpa) on the same model, on one GPU.

Llama-3-8B shapes with random weights, bf16, B = 1. Decode: every layer's cache holds ``T`` random positions
(``--fill-context`` for the native backend; the same fill of the CPCache shard or of transformers' StaticCache /
DynamicCache here), then ``--new-tokens`` greedy steps; tokens/s over the steps after the warm-up ones (compiled
runs: the first steps compile and record CUDA graphs). Rows:

* ``native``: ``launch/generate.py --fill-context`` (its decode step captured in one CUDA graph), in a subprocess;
* ``cp_compiled``: ``generate()`` with ``"cp_attention"`` and a preallocated CPCache: transformers compiles the
  forward itself ("reduce-overhead": CUDA graphs);
* ``cp_compiled_ahead``: the same through ``custom_generate=cp_attention.hf.decode_ahead`` (the host prepares
  step t + 1 while the GPU runs step t);
* ``sdpa_static_compiled``: ``generate()`` with ``"sdpa"`` and a StaticCache, compiled the same way;
* ``cp_eager`` / ``sdpa_eager``: ``generate()`` without compilation, CPCache / DynamicCache.

Steps are timed on the host, by a logits processor (called once per step, adding no sync): in a steady
stream of steps the interval between two calls is a step's time. For the compiled rows, a second
``generate()`` on the same cache (its length set back) runs under ``torch.profiler``: ``*_device_ms`` is the
GPU's busy time per step (the union of the kernel and copy intervals over ``--profile-steps`` steps), so a
step's time splits into the device's work and the host time it waits for (``generate()`` reads whether every
row has finished on the host before it prepares the next step; ``decode_ahead`` reads it a step later).

Prefill: a ``--prefill`` token prompt (random ids) through ``generate(max_new_tokens=1)`` with each attention: its
time and its next token (the same model and weights, so the tokens must agree).

    PYTHONPATH=. python3 benchmarks/bench_hf.py --contexts 32768 131072 --new-tokens 40 --prefill 32768

Writes benchmarks/results/bench_hf.json and .png and the table of docs/performance.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._harness import write_json, write_tables  # noqa: E402

CONFIG = "llama3-8b"
DEVICE = "cuda"
# row -> (cache kind, attention, compiled, through decode_ahead); "native" runs launch/generate.py
ROWS = {"native": None, "cp_compiled_ahead": ("cp", "cp_attention", True, True),
        "cp_compiled": ("cp", "cp_attention", True, False),
        "sdpa_static_compiled": ("static", "sdpa", True, False), "cp_eager": ("cp", "cp_attention", False, False),
        "sdpa_eager": ("dynamic", "sdpa", False, False)}


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class StepTimer:
    """A logits processor that timestamps every step on the host (``generate()`` calls it once per forward,
    after queuing it)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def llama(attn: str):
    """The Llama-3-8B-shaped transformers model with random weights (launch/generate.py's config)."""
    import transformers

    import cp_attention.hf  # noqa: F401  (registers "cp_attention")
    from launch.generate import hf_config
    from launch.llama import CONFIGS

    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(CONFIGS[CONFIG]), attn_implementation=attn,
                                                              dtype=torch.bfloat16)
    gen = torch.Generator(DEVICE).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    model.generation_config.eos_token_id = None
    return model.eval()


def filled_cache(model, kind: str, context: int, new_tokens: int):
    """A cache of ``context`` random positions: ``"cp"`` (CPCache, preallocated), ``"static"`` (StaticCache) or
    ``"dynamic"`` (DynamicCache)."""
    import transformers

    from cp_attention.hf import CPCache

    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.head_dim

    def layer_kv(i):  # the same random K/V in every kind of cache
        gen = torch.Generator(DEVICE).manual_seed(1000 + i)
        return torch.randn(2, 1, hkv, context, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)

    if kind == "dynamic":
        cache = transformers.DynamicCache(config=cfg)
        for i in range(cfg.num_hidden_layers):
            kv = layer_kv(i)
            cache.update(kv[0], kv[1], i)
        return cache
    if kind == "cp":
        cache = CPCache(cfg, max_cache_len=context + new_tokens)
    else:
        cache = transformers.StaticCache(config=cfg, max_cache_len=context + new_tokens)
    cache.early_initialization(1, hkv, d, torch.bfloat16, torch.device(DEVICE))
    for i, layer in enumerate(cache.layers):
        kv = layer_kv(i)
        layer.keys[:, :, :context].copy_(kv[0])
        layer.values[:, :, :context].copy_(kv[1])
        if kind == "static":
            layer.cumulative_length.fill_(context)
    if kind == "cp":
        cache.set_seq_length(context)
    return cache


def generate(model, cache, context: int, new_tokens: int, compile_: bool, ahead: bool = False, timer=None):
    """Greedy ``generate()`` of ``new_tokens`` after ``context`` cached positions (``ahead``: through
    ``decode_ahead``); ``(tokens, step seconds)``."""
    import transformers

    from cp_attention.hf import decode_ahead

    ids = torch.zeros(1, context + 1, dtype=torch.int64, device=DEVICE)
    ids[:, -1] = 7
    timer = timer or StepTimer()
    takes_cache = "cache" in __import__("inspect").signature(model.forward).parameters
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, logits_processor=transformers.LogitsProcessorList([timer]),
                         disable_compile=not compile_, custom_generate=decode_ahead if ahead else None,
                         **{"cache" if takes_cache else "past_key_values": cache})
    steps = [b - a for a, b in zip(timer.times, timer.times[1:])]
    return out[0, ids.shape[1]:].tolist(), steps


class ProfiledSteps(StepTimer):
    """A step timer that advances a ``torch.profiler`` schedule at every step."""

    def __init__(self, prof):
        super().__init__()
        self.prof = prof

    def __call__(self, input_ids, scores):
        self.prof.step()
        return super().__call__(input_ids, scores)


def device_ms_per_step(model, cache, kind: str, context: int, new_tokens: int, warmup: int, steps: int,
                       ahead: bool = False):
    """The GPU's busy time per compiled decode step: ``generate()`` again on ``cache`` (its length set back to
    ``context``) under ``torch.profiler``; the union of the kernel and copy intervals of ``steps`` steps after
    ``warmup``, divided by the steps."""
    if kind == "cp":
        cache.reset()
        cache.set_seq_length(context)
    else:
        for layer in cache.layers:
            layer.cumulative_length.fill_(context)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    schedule = torch.profiler.schedule(wait=warmup, warmup=1, active=steps)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        generate(model, cache, context, min(new_tokens, warmup + steps + 2), True, ahead, timer=ProfiledSteps(prof))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    n = sum(1 for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep"))
    if not spans:
        return None
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo, hi = busy + hi - lo, a, b
        else:
            hi = max(hi, b)
    return (busy + hi - lo) / 1e3 / max(n, 1)


def tokens_per_s(steps, warmup: int):
    timed = steps[warmup:]
    return (len(timed) / sum(timed), statistics.median(timed)) if timed else (None, None)


def native(contexts, new_tokens):
    """launch/generate.py's own model on one rank (its JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts, out = os.path.join(tmp, "p.json"), os.path.join(tmp, "out.json")
        json.dump([[7]], open(prompts, "w"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               os.path.join(ROOT, "launch", "generate.py"), "--random-config", CONFIG, "--device", DEVICE, "--prompts", prompts,
               "--new-tokens", str(new_tokens), "--fill-context", *map(str, contexts), "--output", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if proc.returncode:
            return {"error": proc.stderr[-2000:]}
        data = json.load(open(out))
    runs = data.get("runs", [data])
    return {r["synthetic_context"]: r.get("decode_tokens_per_s") for r in runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8, help="steps left out of the timing (compile, CUDA graphs)")
    ap.add_argument("--profile-steps", type=int, default=8, help="compiled rows: steps profiled for the device time (0: none)")
    ap.add_argument("--prefill", type=int, default=32768, help="prompt tokens of the prefill comparison (0: none)")
    ap.add_argument("--rows", nargs="+", default=list(ROWS))
    ap.add_argument("--name", default="bench_hf")
    ap.add_argument("--config", default=CONFIG, help="launch/llama.py CONFIGS entry (tiny: a smoke test)")
    ap.add_argument("--device", default=DEVICE)
    args = ap.parse_args()
    globals().update(CONFIG=args.config, DEVICE=args.device)
    rows = {c: {"context": c} for c in args.contexts}
    if "native" in args.rows:
        result = native(args.contexts, args.new_tokens)
        for c in rows:
            if "error" in result:
                rows[c]["native_error"] = result["error"]
            else:
                rows[c]["native_tokens_per_s"] = result.get(c)
    model = llama("cp_attention")
    runs = [(r, *ROWS[r]) for r in ROWS if r != "native" and r in args.rows]
    for c in args.contexts:
        for row, kind, attn, comp, ahead in runs:
            try:
                model.set_attn_implementation(attn)
                cache = filled_cache(model, kind, c, args.new_tokens)
                if comp:  # each compiled row compiles afresh for its shapes (see docs/performance.md)
                    torch._dynamo.reset()
                with torch.no_grad():
                    toks, steps = generate(model, cache, c, args.new_tokens, comp, ahead)
                tps, med = tokens_per_s(steps, args.warmup)
                rows[c].update({f"{row}_tokens_per_s": tps, f"{row}_step_ms": med * 1e3 if med else None,
                                f"{row}_tokens": toks[:8]})
                if comp and args.profile_steps and DEVICE == "cuda":
                    with torch.no_grad():
                        rows[c][f"{row}_device_ms"] = device_ms_per_step(model, cache, kind, c, args.new_tokens,
                                                                         args.warmup, args.profile_steps, ahead)
            except Exception as e:  # a failing configuration must not lose the others
                rows[c][f"{row}_error"] = f"{type(e).__name__}: {e}"[:600]
            finally:
                cache = None
                gc.collect()
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            print(c, row, {k: v for k, v in rows[c].items() if k.startswith(row)}, flush=True)
        save(args, rows, {})
    prefill = {}
    if args.prefill:
        ids = torch.randint(0, model.config.vocab_size, (1, args.prefill), device=DEVICE,
                            generator=torch.Generator(DEVICE).manual_seed(2))
        for attn in ("cp_attention", "sdpa"):
            try:
                model.set_attn_implementation(attn)
                with torch.no_grad():
                    model.generate(ids[:, :128], max_new_tokens=1, do_sample=False, pad_token_id=0)  # warm-up
                    sync()
                    t0 = time.perf_counter()
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                         pad_token_id=0, disable_compile=True)
                    sync()
                prefill[attn] = {"s": time.perf_counter() - t0, "next_token": int(out[0, -1])}
            except Exception as e:
                prefill[attn] = {"error": f"{type(e).__name__}: {e}"[:600]}
            gc.collect()
        print("prefill", prefill, flush=True)
    save(args, rows, prefill)
    for r in rows.values():
        print(json.dumps(r))


def save(args, rows, prefill):
    """Write the JSON, the PNG and the table of what has been measured so far (a run cut short keeps its rows)."""
    table_rows = list(rows.values())
    for r in table_rows:
        base = r.get("native_tokens_per_s")
        cp, ahead = r.get("cp_compiled_tokens_per_s"), r.get("cp_compiled_ahead_tokens_per_s")
        sd = r.get("sdpa_static_compiled_tokens_per_s") or r.get("sdpa_eager_tokens_per_s")
        r["cp_compiled_over_native"] = cp / base if cp and base else None
        r["cp_compiled_ahead_over_native"] = ahead / base if ahead and base else None
        r["cp_compiled_ahead_over_sdpa_best"] = ahead / sd if ahead and sd else None
        r["cp_compiled_over_sdpa_best"] = cp / sd if cp and sd else None
        ce, se = r.get("cp_eager_tokens_per_s"), r.get("sdpa_eager_tokens_per_s")
        r["cp_eager_over_sdpa_eager"] = ce / se if ce and se else None
    write_json(args.name, {"config": CONFIG, "batch": 1, "new_tokens": args.new_tokens, "warmup_steps": args.warmup,
                           "rows": table_rows, "prefill_tokens": args.prefill, "prefill": prefill})
    plot(table_rows, os.path.join(ROOT, "benchmarks", "results", f"{args.name}.png"))
    write_tables(args.name)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(ROWS)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [r.get(f"{name}_tokens_per_s") or 0 for r in rows], width,
               label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"T = {r['context'] // 1024}k" for r in rows])
    ax.set_ylabel("decode tokens/s (B = 1)")
    ax.set_title(f"{CONFIG} shapes, random weights, one H200: transformers generate()")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
