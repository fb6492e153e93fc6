"""The measured tables of docs/performance.md and README.md, written from ``benchmarks/results/*.json``.

Every benchmark script calls :func:`update` with its result name after writing its JSON, which rewrites the
tables drawn from that file. Without a GPU, all tables can be rewritten from the JSON files as they are::

    python -m benchmarks.tables            # rewrite every table
    python -m benchmarks.tables --check    # exit 1 if a document differs from what its JSON gives

A table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in one of :data:`DOCS`; what is
between the two markers is replaced, the text around them is kept. Standard library only, so the tables can
be regenerated on any machine.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = (ROOT / "docs" / "performance.md", ROOT / "README.md")


# ---------------------------------------------------------------------------------------------------------
# Cells


def us(x) -> str:
    """A time in µs: two decimals below 10, one above; an empty cell for a missing value."""
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "—"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def ratio(x, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) and math.isfinite(x) else "—"


def times(x) -> str:
    """A speedup: ``1.43×``."""
    return f"{x:.2f}×" if isinstance(x, (int, float)) and math.isfinite(x) else "—"


def pct(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) and math.isfinite(x) else "—"


def tokens(t) -> str:
    """``2048`` -> ``2k``, ``1048576`` -> ``1M``; other values as they are."""
    if isinstance(t, int):
        for unit, size in (("M", 1 << 20), ("k", 1 << 10)):
            if t >= size and t % size == 0:
                return f"{t // size}{unit}"
    return str(t)


def get(row: dict, key: str):
    v = row.get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def div(a, b):
    return a / b if a is not None and b else None


def bold_min(cells: list[str], values: list) -> list[str]:
    """``cells`` with the one holding the smallest of ``values`` (None: not compared) in bold."""
    known = [v for v in values if v is not None]
    if not known:
        return cells
    best = min(known)
    return [f"**{c}**" if v == best else c for c, v in zip(cells, values)]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def environment_line(env: dict | None, paged: bool = False) -> str:
    """Where a JSON was measured, from its ``environment``; ``paged``: its table has paged caches (its own or
    the peers' copies), whose page order the line names (``page_order``; runs that record none had their
    pages in sequence order)."""
    if not env:
        return ""
    gpus = env.get("gpus", 1)
    where = env.get("gpu", "CPU")
    if where != "CPU":
        where = f"{gpus}× {where}" if gpus and gpus > 1 else f"one {where}"
    parts = [where, f"torch {env.get('torch')}", f"Triton {env.get('triton')}"]
    if env.get("flashinfer"):
        parts.append(f"FlashInfer {env['flashinfer']}")
    if paged:
        parts.append(f"page tables {env.get('page_order', 'in sequence order')}")
    date = str(env.get("date", ""))[:10]
    line = ", ".join(parts) + (f"; measured {date}" if date else "") + "."
    return line[0].upper() + line[1:]


# ---------------------------------------------------------------------------------------------------------
# Renderers: JSON payload(s) -> markdown


def _decode_rows(data: dict, rows: list[dict]) -> str:
    header = ["B", "T", "Hq/Hkv/D", "cp_attention", "SDPA (cuDNN)", "FlashInfer XQA", "FlashInfer fa2",
              "SDPA flash", "cp / SDPA", "cp TB/s", "cp / SDPA per call"]
    out = []
    for r in rows:
        cp, sdpa = get(r, "cp_attention_graph_us"), get(r, "sdpa_graph_us")
        vals = [cp, sdpa, get(r, "flashinfer_xqa_graph_us"), get(r, "flashinfer_fa2_graph_us")]
        cells = bold_min([us(v) for v in vals], vals)
        out.append([str(r["B"]), tokens(r["T"]), r["heads"], *cells, us(get(r, "sdpa_flash_graph_us")),
                    ratio(div(cp, sdpa)), ratio(get(r, "cp_attention_graph_TBs"), 2),
                    ratio(div(get(r, "cp_attention_call_us"), get(r, "sdpa_call_us")))])
    return markdown(header, out)


def decode_table(data: dict) -> str:
    """bench_decode.py: every shape, graph µs of each implementation."""
    rows = sorted(data["rows"], key=lambda r: (r["panel"] == "other heads", r["heads"], r["B"], r["T"]))
    return _decode_rows(data, rows)


README_SHAPES = [(1, 2048), (1, 8192), (1, 32768), (1, 131072), (1, 1 << 20), (4, 32768), (4, 131072),
                 (16, 8192), (16, 32768), (64, 2048), (64, 8192), (64, 131072)]


def readme_decode_table(data: dict) -> str:
    """The README's table: bench_decode.py's 32/8/128 shapes of :data:`README_SHAPES`."""
    by_shape = {(r["B"], r["T"]): r for r in data["rows"] if r["heads"] == "32/8/128"}
    header = ["B", "T", "cp_attention", "SDPA (cuDNN)", "FlashInfer XQA", "FlashInfer fa2", "cp / SDPA"]
    out = []
    for shape in README_SHAPES:
        r = by_shape.get(shape)
        if r is None:
            continue
        cp, sdpa = get(r, "cp_attention_graph_us"), get(r, "sdpa_graph_us")
        vals = [cp, sdpa, get(r, "flashinfer_xqa_graph_us"), get(r, "flashinfer_fa2_graph_us")]
        out.append([str(r["B"]), tokens(r["T"]), *bold_min([us(v) for v in vals], vals), ratio(div(cp, sdpa))])
    return markdown(header, out)


def fp8_table(data: dict) -> str:
    """bench_decode.py --impls cp_attention cp_attention_fp8 flashinfer_xqa_fp8: the FP8 cache against bf16."""
    header = ["B", "T", "bf16 cache", "e4m3 cache", "e4m3 / bf16", "FlashInfer XQA, e4m3", "e4m3 TB/s",
              "e4m3 per call", "XQA e4m3 per call"]
    out = []
    for r in data["rows"]:
        bf, e4 = get(r, "cp_attention_graph_us"), get(r, "cp_attention_fp8_graph_us")
        out.append([str(r["B"]), tokens(r["T"]), us(bf), us(e4), ratio(div(e4, bf)),
                    us(get(r, "flashinfer_xqa_fp8_graph_us")), ratio(get(r, "cp_attention_fp8_graph_TBs"), 2),
                    us(get(r, "cp_attention_fp8_call_us")), us(get(r, "flashinfer_xqa_fp8_call_us"))])
    return markdown(header, out)


def fp8_variants_table(data: dict) -> str:
    """bench_fp8_variants.py: bf16, the Triton FP8 kernel's plan and the policy's FP8 call."""
    header = ["B", "T", "call", "bf16", "e4m3, Triton kernel", "e4m3, policy", "policy's kernel", "policy / bf16"]
    out = []
    for r in data["rows"]:
        out.append([str(r["B"]), tokens(r["T"]), r["what"], us(get(r, "bf16_graph_us")),
                    us(get(r, "e4m3 triton_graph_us")), us(get(r, "e4m3_graph_us")), r.get("e4m3_kernel", "—"),
                    ratio(get(r, "e4m3 / bf16"))])
    return markdown(header, out)


def _paged_section(rows: list[dict], names: list[str], labels: list[str], extra=()) -> str:
    header = ["B", "T", *[h for h, _ in extra], *labels]
    out = []
    for r in rows:
        vals = [get(r, f"{n}_graph_us") for n in names]
        out.append([str(r["B"]), tokens(r["T"]), *[f(r) for _, f in extra], *bold_min([us(v) for v in vals], vals)])
    return markdown(header, out)


def paged_table(data: dict) -> str:
    """bench_paged.py (16-bit sections): pages against the dense cache, against FlashInfer, draft rows."""
    parts = []
    rows = [r for r in data["rows"] if r["section"] == "page-vs-dense"]
    if rows:
        parts.append("Page pools against the dense cache (NHD pools):\n\n" + _paged_section(
            rows, ["cp dense", "cp page 1", "cp page 16", "cp page 64"],
            ["dense", "pages of 1", "pages of 16", "pages of 64"]))
    rows = [r for r in data["rows"] if r["section"] == "peers"]
    if rows:
        names = [f"{impl} page {p}" for p in (16, 64) for impl in ("cp", "xqa", "fa2")]
        labels = [f"{impl}, pages of {p}" for p in (16, 64) for impl in ("cp_attention", "XQA", "fa2")]
        parts.append("Against FlashInfer on the same pages:\n\n" + _paged_section(rows, names, labels))
    rows = [r for r in data["rows"] if r["section"] == "drafts"]
    if rows:
        parts.append("Draft rows (Q query rows per request, causal among them):\n\n" + _paged_section(
            rows, ["cp dense", "cp page 16", "xqa page 16", "fa2 page 16"],
            ["cp_attention dense", "cp_attention, pages of 16", "XQA, pages of 16", "fa2, pages of 16"],
            extra=[("Q", lambda r: str(r["Q"]))]))
    return "\n\n".join(parts)


def paged_fp8_table(data: dict) -> str:
    """bench_paged.py --sections fp8: e4m3 page pools against the dense e4m3 cache and XQA on the same pages."""
    pages = (1, 16, 64, 128, 256)
    names = ["cp dense e4m3"] + [f"cp page {p} e4m3" for p in pages] + [f"xqa page {p} e4m3" for p in (16, 64, 128)]
    labels = ["e4m3 dense"] + [f"pages of {p}" for p in pages] + [f"XQA, pages of {p}" for p in (16, 64, 128)]
    bf16 = [("bf16 dense", lambda r: us(get(r, "cp dense_graph_us")))]
    return _paged_section(data["rows"], names, labels, extra=bf16)


def paged_d256_table(data: dict) -> str:
    """bench_paged.py --sections d256: head dim 256, bf16 and e4m3, dense and pools, XQA on the same pages."""
    parts = []
    for tag, title in (("", "bf16"), (" e4m3", "e4m3")):
        names = ([f"cp dense{tag}"] + [f"cp page {p}{tag}" for p in (16, 64, 256)]
                 + [f"xqa page {p}{tag}" for p in (16, 64)])
        labels = ["dense", "pages of 16", "pages of 64", "pages of 256", "XQA, pages of 16", "XQA, pages of 64"]
        parts.append(f"{title} caches, Hq/Hkv/D = 16/8/256:\n\n" + _paged_section(data["rows"], names, labels))
    return "\n\n".join(parts)


def variants_table(data: dict) -> str:
    """bench_variants.py: windows, softcaps and sinks against the plain call."""
    header = ["B", "T", "call", "graph µs", "per call µs", "against plain"]
    out = []
    for r in data["rows"]:
        rel = get(r, "vs_plain_window") or get(r, "vs_plain")
        against = "—" if r["what"] == "plain" else ratio(rel) + ("× (plain decode of 4097 keys)"
                                                                  if "vs_plain_window" in r else "×")
        out.append([str(r["B"]), tokens(r["T"]), r["what"], us(get(r, "cp_graph_us")), us(get(r, "cp_call_us")),
                    against])
    return markdown(header, out)


def merge_table(data: dict) -> str:
    """bench_merge.py: ⊕ over N states."""
    header = ["o dtype", "N", "cp_attention", "FlashInfer merge_states", "plain torch", "cp_attention per call",
              "FlashInfer per call"]
    out = []
    for r in data["rows"]:
        vals = [get(r, "cp_attention_graph_us"), get(r, "flashinfer_graph_us"), get(r, "torch_graph_us")]
        calls = [get(r, "cp_attention_call_us"), get(r, "flashinfer_call_us")]
        out.append([r["dtype"], str(r["N"]), *bold_min([us(v) for v in vals], vals),
                    *bold_min([us(v) for v in calls], calls)])
    return markdown(header, out)


def overhead_table(data: dict) -> str:
    """bench_overhead.py: the host time of an eager call."""
    header = ["call", "back-to-back µs", "single call µs", "GPU activities per call"]
    out = [[r["what"], us(get(r, "loop_us")), us(get(r, "call_us")), str(r.get("gpu_per_call", "—"))]
           for r in data["rows"]]
    text = markdown(header, out)
    if data.get("parts"):
        text += "\n\nParts of one `flash_decode(q, k, v, seq_lens)` call (median µs of single synchronized calls):\n\n"
        text += markdown(["part", "µs"], [[p["part"].strip(), us(p["us"])] for p in data["parts"]])
    return text


def cascade_table(data: dict) -> str:
    """bench_cascade.py: a shared prefix read once against flat decode of the prefix copied per request."""
    header = ["B", "shared prefix", "own tokens", "cascade_decode", "prefix level alone", "flat flash_decode",
              "SDPA (cuDNN), flat", "FlashInfer cascade", "FlashInfer fa2, flat"]
    out = []
    seen = set()
    for r in data.get("shapes", []) + data.get("sweep", []):
        key = (r["B"], r["P"], r["S"])
        if key in seen:
            continue
        seen.add(key)
        vals = [get(r, "cascade_graph_us"), None, get(r, "flat_flash_decode_graph_us"), get(r, "sdpa_graph_us"),
                get(r, "fi_cascade_graph_us"), get(r, "fi_fa2_graph_us")]
        cells = bold_min([us(v) for v in vals], vals)
        cells[1] = us(get(r, "prefix_only_graph_us"))
        out.append([str(r["B"]), tokens(r["P"]), tokens(r["S"]), *cells])
    out.sort(key=lambda c: (int(c[0]),))
    return markdown(header, out)


def cp_table(data: dict) -> str:
    """bench_cp.py: context-parallel decode over W GPUs against the best single-GPU decode."""
    exchanges = data["config"].get("exchanges", ["symm"])
    names = {"symm": "symmetric memory", "collective": "NCCL all-gather"}
    header = ["B", "T", "best 1 GPU"]
    for ex in exchanges:
        header += [f"CP, {names.get(ex, ex)}", "exposed", "speedup"]
    out = []
    for r in data["rows"]:
        cells = [str(r["batch"]), tokens(r["context"]), us(get(r, "best1_graph_us"))]
        for ex in exchanges:
            cells += [us(get(r, f"cp_{ex}_graph_us")), us(get(r, f"exposed_{ex}_graph_us")),
                      times(get(r, f"speedup_{ex}_graph"))]
        out.append(cells)
    text = markdown(header, out)
    if data.get("cascade_rows"):
        header = ["B", "shared prefix + own", "cascade_decode, 1 GPU", "local part"]
        for ex in exchanges:
            header += [f"cp_cascade_decode, {names.get(ex, ex)}", "speedup"]
        rows = []
        for r in data["cascade_rows"]:
            p, s = (int(x) for x in str(r["context"]).split("+"))
            cells = [str(r["batch"]), f"{tokens(p)} + {tokens(s)}", us(get(r, "single_graph_us")),
                     us(get(r, "local_graph_us"))]
            for ex in exchanges:
                cells += [us(get(r, f"cp_{ex}_graph_us")), times(get(r, f"speedup_{ex}_graph"))]
            rows.append(cells)
        text += "\n\n" + markdown(header, rows)
    return text


def fp8_accuracy_table(data: dict) -> str:
    """fp8_accuracy.py: relative L2 error of the FP8 cache's output against the bf16 cache's."""
    header = ["T", "score std", "e4m3 per tensor", "e4m3 per head", "e5m2 per tensor", "e5m2 per head",
              "bf16 cache vs float64"]
    cases = {}
    for r in data["rows"]:
        c = cases.setdefault((r["T"], r["logit_std"]), {"bf16": r["bf16_cache_rel_err_vs_float64"]})
        c[(r["fp8"], r["scales"])] = r["rel_err_vs_bf16_cache"]
    out = []
    for (t, std), c in sorted(cases.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        out.append([tokens(t), f"{std:g}"] + [pct(c.get((f, s))) for f in ("float8_e4m3fn", "float8_e5m2")
                                              for s in ("per tensor", "per head")] + [pct(c["bf16"])])
    return markdown(header, out)


def generate_table(w1: dict, w2: dict | None = None, p1: dict | None = None, p2: dict | None = None,
                   hf1: dict | None = None, hf2: dict | None = None, hp1: dict | None = None,
                   hp2: dict | None = None) -> str:
    """launch/generate.py --fill-context on 1 and 2 GPUs: decode tokens/s, and the prefill of a long prompt;
    then the same through transformers' generate() (``--backend transformers --compile``) where measured."""
    def by_context(payload):
        return {r["synthetic_context"]: r for r in (payload or {}).get("runs", [payload or {}])
                if "synthetic_context" in r}

    def section(a1, a2, b1, b2, intro):
        one, two = by_context(a1), by_context(a2)
        run = next(iter(one.values()), next(iter(two.values()), {}))
        header = ["context", "1 GPU tokens/s", "2 GPUs tokens/s", "speedup"]
        out = []
        for t in sorted(set(one) | set(two)):
            a, b = get(one.get(t, {}), "decode_tokens_per_s"), get(two.get(t, {}), "decode_tokens_per_s")
            out.append([tokens(t), ratio(a, 1) if a else "does not fit", ratio(b, 1), times(div(b, a))])
        text = intro(run) + markdown(header, out)
        if b1 and b2:
            a, b = get(b1, "prefill_s"), get(b2, "prefill_s")
            lens = b1.get("prompt_lens", ["?"])
            same = b1.get("tokens", [[None]])[0][:1] == b2.get("tokens", [[0]])[0][:1]
            text += (f"\n\nPrefill of a {tokens(lens[0])}-token prompt: {ratio(a, 1)} s on 1 GPU, {ratio(b, 1)} s on 2 "
                     f"GPUs ({times(div(a, b))}); the next token {'the same' if same else 'differs'} on both.")
        return text

    text = section(w1, w2, p1, p2, lambda run: (
        f"Decode tokens/s of `launch/generate.py` with {run.get('model', '?')} shapes and random weights "
        f"({run.get('dtype', '?')}, B = {run.get('batch', '?')}, each decode step one CUDA graph), the context "
        "filled with random K/V:\n\n"))
    if hf1 or hf2:
        text += "\n\n" + section(hf1, hf2, hp1, hp2, lambda run: (
            f"The same through transformers' own `generate()` (`--backend transformers --compile"
            f"{' --decode-ahead' if run.get('decode_ahead') else ''}`: the unmodified transformers model, "
            f"`attn_implementation=\"cp_attention\"`, a preallocated `CPCache`, transformers' compiled generation"
            f"{', `custom_generate=cp_attention.hf.decode_ahead`' if run.get('decode_ahead') else ''}), "
            f"{run.get('model', '?')} shapes, B = {run.get('batch', '?')}; every rank's tokens are checked to be "
            "identical:\n\n"))
    return text


def hf_table(data: dict) -> str:
    """benchmarks/bench_hf.py: transformers' generate() with cp_attention against the native model and sdpa."""
    intro = (f"Decode tokens/s of transformers' own `generate()` on {data.get('config', '?')} shapes with random weights "
             f"(bf16, B = {data.get('batch', '?')}, {data.get('new_tokens', '?')} new tokens, the first "
             f"{data.get('warmup_steps', '?')} left out), the context filled with random K/V; `native` is "
             "`launch/generate.py`'s own model, compiled runs are transformers' compiled generation (CUDA graphs):\n\n")
    header = ["context", "native", "cp_attention + CPCache, compiled", "sdpa + StaticCache, compiled",
              "cp_attention eager", "sdpa + DynamicCache eager", "compiled / native", "compiled cp / sdpa",
              "compiled cp: GPU ms / step ms"]
    names = ["native", "cp_compiled", "sdpa_static_compiled", "cp_eager", "sdpa_eager"]
    # decode_ahead's columns where it was measured
    ahead = any(f"cp_compiled_ahead_{k}" in r for r in data.get("rows", []) for k in ("tokens_per_s", "error"))
    if ahead:
        header[2:2] = ["cp_attention + CPCache, compiled, `decode_ahead`"]
        header[7:7] = ["`decode_ahead` / native", "`decode_ahead` / sdpa"]
        names[1:1] = ["cp_compiled_ahead"]

    def cell(r, n):  # a configuration that raised shows its exception's class (the message is in the JSON)
        err = r.get(f"{n}_error")
        return f"failed ({err.split(':')[0]})" if err else ratio(get(r, f"{n}_tokens_per_s"), 1)

    out = []
    for r in data.get("rows", []):
        ratios = [ratio(get(r, "cp_compiled_over_native")), times(get(r, "cp_compiled_over_sdpa_best"))]
        if ahead:
            ratios[:0] = [ratio(get(r, "cp_compiled_ahead_over_native")),
                          times(get(r, "cp_compiled_ahead_over_sdpa_best"))]
        out.append([tokens(r["context"])] + [cell(r, n) for n in names] + ratios
                   + [f"{ratio(get(r, 'cp_compiled_device_ms'), 2)} / {ratio(get(r, 'cp_compiled_step_ms'), 2)}"])
    text = intro + markdown(header, out)
    pre = data.get("prefill") or {}
    cp, sd = pre.get("cp_attention", {}), pre.get("sdpa", {})
    if cp.get("s") and sd.get("s"):
        same = "the same next token" if cp.get("next_token") == sd.get("next_token") else "DIFFERENT next tokens"
        text += (f"\n\nPrefill of a {tokens(data.get('prefill_tokens'))}-token prompt through `generate()`: "
                 f"{ratio(cp['s'], 2)} s with cp_attention, {ratio(sd['s'], 2)} s with sdpa ({same}).")
    return text


# ---------------------------------------------------------------------------------------------------------
# The tables


class Table(NamedTuple):
    name: str  # the marker's NAME
    sources: tuple  # JSON stems under benchmarks/results/, the renderer's arguments in order
    render: Callable
    command: str  # what reproduces the JSON (from the checkout, on the GPU machine); "bench_cp": from its config


BENCH = "PYTHONPATH=. python3 benchmarks/"
# tables with page pools: the library's (bench_paged*) or the peers' copies (FlashInfer's XQA, fa2, cascade)
PAGED = {"bench_decode", "readme_decode", "bench_d256", "bench_fp8", "bench_paged", "bench_paged_fp8",
         "bench_paged_d256", "bench_cascade"}
TORCHRUN = "PYTHONPATH=. torchrun --standalone --nproc-per-node=2 "


def _cp_command(data: dict) -> str:
    """The bench_cp.py command line that reproduces a bench_cp JSON, from its recorded arguments."""
    c = data.get("config", {})
    args = [f"--batches {' '.join(map(str, c.get('batches', [])))}",
            f"--contexts {' '.join(map(str, c.get('contexts', [])))}"]
    if c.get("page_size"):
        args.append(f"--page-size {c['page_size']}")
    if c.get("fp8"):
        args.append("--fp8")
    if c.get("split_size"):
        args.append(f"--split-size {c['split_size']}")
    if c.get("exchanges") and c["exchanges"] != ["symm", "collective"]:
        args.append(f"--exchanges {' '.join(c['exchanges'])}")
    if c.get("cascade"):
        args.append(f"--cascade {' '.join(c['cascade'])}")
    if c.get("name", "bench_cp") != "bench_cp":
        args.append(f"--name {c['name']}")
    return f"{TORCHRUN}benchmarks/bench_cp.py " + " ".join(args)


TABLES = [
    Table("readme_decode", ("bench_decode",), readme_decode_table, f"{BENCH}bench_decode.py"),
    Table("bench_decode", ("bench_decode",), decode_table, f"{BENCH}bench_decode.py"),
    Table("bench_d256", ("bench_d256",), decode_table,
          f"{BENCH}bench_decode.py --shapes 1x128k --heads 16,8,256 --head-shapes 1x8k 1x128k 16x32k 64x2k "
          "--name bench_d256"),
    Table("bench_fp8", ("bench_fp8",), fp8_table,
          f"{BENCH}bench_decode.py --impls cp_attention cp_attention_fp8 flashinfer_xqa_fp8 --shapes 1x128k 1x1M "
          "16x32k 64x8k --heads --name bench_fp8"),
    Table("bench_fp8_variants", ("bench_fp8_variants",), fp8_variants_table, f"{BENCH}bench_fp8_variants.py"),
    Table("bench_paged", ("bench_paged",), paged_table, f"{BENCH}bench_paged.py"),
    Table("bench_paged_fp8", ("bench_paged_fp8",), paged_fp8_table,
          f"{BENCH}bench_paged.py --sections fp8 --name bench_paged_fp8"),
    Table("bench_paged_d256", ("bench_paged_d256",), paged_d256_table,
          f"{BENCH}bench_paged.py --sections d256 --name bench_paged_d256"),
    Table("bench_variants", ("bench_variants",), variants_table, f"{BENCH}bench_variants.py"),
    Table("bench_merge", ("bench_merge",), merge_table, f"{BENCH}bench_merge.py"),
    Table("bench_overhead", ("bench_overhead",), overhead_table, f"{BENCH}bench_overhead.py"),
    Table("bench_cascade", ("bench_cascade",), cascade_table, f"{BENCH}bench_cascade.py"),
    Table("bench_cp", ("bench_cp",), cp_table, "bench_cp"),
    Table("bench_cp_paged", ("bench_cp_paged",), cp_table, "bench_cp"),
    Table("bench_cp_fp8", ("bench_cp_fp8",), cp_table, "bench_cp"),
    Table("bench_cp_cascade", ("bench_cp_cascade",), cp_table, "bench_cp"),
    Table("fp8_accuracy", ("fp8_accuracy",), fp8_accuracy_table, f"{BENCH}fp8_accuracy.py"),
    Table("bench_hf", ("bench_hf",), hf_table,
          f"{BENCH}bench_hf.py --contexts 32768 131072 --new-tokens 40 --prefill 32768"),
    Table("generate", ("generate_w1", "generate_w2", "generate_prefill_w1", "generate_prefill_w2", "generate_hf_w1",
                       "generate_hf_w2", "generate_hf_prefill_w1", "generate_hf_prefill_w2"), generate_table,
          "`benchmarks/run_all.sh OUT_DIR two` (launch/generate.py --random-config llama3-8b --fill-context on 1 "
          "and 2 GPUs, its native backend and `--backend transformers`, whose rows this table shows once their "
          "`generate_hf_*.json` exist; then `python3 benchmarks/plot_generate.py` and `python3 -m benchmarks.tables`)"),
]


def load(stem: str, results: Path = RESULTS) -> dict | None:
    path = results / f"{stem}.json"
    return json.loads(path.read_text()) if path.exists() else None


def render(table: Table, results: Path = RESULTS) -> str | None:
    """The text between ``table``'s markers: the table, where it was measured and the command; None when its
    first JSON is missing."""
    payloads = [load(s, results) for s in table.sources]
    if payloads[0] is None:
        return None
    body = table.render(*payloads)
    command = _cp_command(payloads[0]) if table.command == "bench_cp" else table.command
    env = environment_line(payloads[0].get("environment"), paged=table.name in PAGED)
    graph = "" if table.name in ("bench_overhead", "fp8_accuracy", "generate", "bench_hf") else (
        "µs per call, 20 calls captured in one CUDA graph (median of replays, L2 flushed before each). ")
    command = command if "`" in command else f"`{command}`"  # a command, or markdown naming several
    return f"{body}\n\n{graph}{env + ' ' if env else ''}Reproduce: {command}"


def _marker(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- table:{re.escape(name)} -->\n)(.*?)(<!-- /table:{re.escape(name)} -->)", re.S)


def rewrite(text: str, tables=TABLES, results: Path = RESULTS) -> str:
    """``text`` with every table of ``tables`` that has markers in it rewritten."""
    for table in tables:
        pattern = _marker(table.name)
        if not pattern.search(text):
            continue
        body = render(table, results)
        if body is not None:
            text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(3), text)
    return text


def update(stem: str | None = None, docs=DOCS, results: Path = RESULTS) -> list[Path]:
    """Rewrite the tables drawn from ``benchmarks/results/<stem>.json`` (every table when ``stem`` is None) in
    ``docs``; returns the documents that changed."""
    tables = [t for t in TABLES if stem is None or stem in t.sources]
    changed = []
    with open(results / ".tables.lock", "w") as lock:  # benchmarks/run_all.sh runs two scripts at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        for doc in docs:
            if not doc.exists():
                continue
            old = doc.read_text()
            new = rewrite(old, tables, results)
            if new != old:
                doc.write_text(new)
                changed.append(doc)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a document is out of date")
    args = ap.parse_args(argv)
    if args.check:
        stale = [doc for doc in DOCS if doc.exists() and rewrite(doc.read_text()) != doc.read_text()]
        for doc in stale:
            print(f"{doc.relative_to(ROOT)}: tables differ from benchmarks/results (run python -m benchmarks.tables)")
        return 1 if stale else 0
    for doc in update():
        print(f"rewrote the tables of {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
