"""The measured tables of docs/performance.md and README.md are what benchmarks/results/*.json give
(``benchmarks/tables.py``), and they can be regenerated without a GPU."""
import json
import shutil

import pytest

from benchmarks import tables


def test_documents_match_the_results():
    """``python -m benchmarks.tables --check``: every table between markers is its JSON's rendering."""
    assert tables.main(["--check"]) == 0


@pytest.mark.parametrize("table", tables.TABLES, ids=lambda t: t.name)
def test_every_table_renders_from_its_json(table):
    body = tables.render(table)
    assert body is not None, f"benchmarks/results/{table.sources[0]}.json is missing"
    assert "| --- |" in body
    assert "Reproduce: `" in body


@pytest.mark.parametrize("table", tables.TABLES, ids=lambda t: t.name)
def test_every_table_has_its_markers(table):
    text = "".join(doc.read_text() for doc in tables.DOCS)
    assert f"<!-- table:{table.name} -->" in text and f"<!-- /table:{table.name} -->" in text


def test_update_rewrites_between_markers_only(tmp_path):
    """A changed JSON rewrites its table, keeps the text around the markers and leaves other tables alone."""
    results = tmp_path / "results"
    shutil.copytree(tables.RESULTS, results)
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- table:bench_merge -->\nstale\n<!-- /table:bench_merge -->\nbetween\n"
                   "<!-- table:bench_variants -->\nkept\n<!-- /table:bench_variants -->\nafter\n")
    data = json.loads((results / "bench_merge.json").read_text())
    data["rows"][0]["cp_attention_graph_us"] = 1234.5
    (results / "bench_merge.json").write_text(json.dumps(data))
    assert tables.update("bench_merge", docs=(doc,), results=results) == [doc]
    text = doc.read_text()
    assert text.startswith("before\n<!-- table:bench_merge -->\n| o dtype |") and "1234.5" in text
    assert "\nbetween\n<!-- table:bench_variants -->\nkept\n<!-- /table:bench_variants -->\nafter\n" in text
    assert tables.update("bench_merge", docs=(doc,), results=results) == []  # idempotent


def test_generation_table_adds_the_transformers_runs(tmp_path):
    """With generate_hf_* JSONs beside the native ones (run_all.sh part two), the generation table gains the
    transformers section: tokens/s per context on 1 and 2 GPUs and the prefill's next token on both."""
    results = tmp_path / "results"
    shutil.copytree(tables.RESULTS, results)
    run = {"model": "llama3-8b", "batch": 1, "backend": "transformers"}
    hf = {1: [(131072, 80.0), (524288, 30.0)], 2: [(131072, 95.0), (524288, 48.0), (1048576, 30.5)]}
    for w, rows in hf.items():
        payload = {"runs": [{**run, "world_size": w, "synthetic_context": t, "decode_tokens_per_s": tps}
                            for t, tps in rows]}
        (results / f"generate_hf_w{w}.json").write_text(json.dumps(payload))
        prefill = {**run, "world_size": w, "prompt_lens": [32768], "prefill_s": 3.0 / w, "tokens": [[7, w]]}
        (results / f"generate_hf_prefill_w{w}.json").write_text(json.dumps(prefill))
    table = next(t for t in tables.TABLES if t.name == "generate")
    body = tables.render(table, results)
    hf_part = body.split("through transformers' own `generate()`")[1]
    assert "| 512k | 30.0 | 48.0 | 1.60× |" in hf_part and "| 1M | does not fit | 30.5 | — |" in hf_part
    assert "32k-token prompt: 3.0 s on 1 GPU, 1.5 s on 2 GPUs (2.00×); the next token the same on both" in hf_part
    assert "through transformers" not in tables.render(table)  # not measured: the native table alone


def test_generation_plot(tmp_path):
    """benchmarks/plot_generate.py draws the generation JSONs without a GPU."""
    from benchmarks import plot_generate

    path = plot_generate.plot(tables.RESULTS, tmp_path / "generate.png")
    assert path.stat().st_size > 10_000
    assert plot_generate.points(json.loads((tables.RESULTS / "generate_w2.json").read_text()))[-1][0] == 1 << 20


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_benchmark_page_pools_are_scattered(page_size):
    """benchmarks/peers.py's page pools (the library's and the peers' paged copies) hold each sequence's pages
    at a random permutation of the pool, and the table it gives reads back the dense cache exactly."""
    import torch

    from benchmarks import peers
    from cp_attention import flash_decode

    g = torch.Generator().manual_seed(page_size)
    q, k, v = (torch.randn(*s, generator=g) for s in ((3, 8, 64), (3, 2, 128, 64), (3, 2, 128, 64)))
    kp, vp, kwargs = peers.cache_form(k, v, page_size=page_size)
    table = kwargs["block_table"]
    assert sorted(table.flatten().tolist()) == list(range(kp.shape[0]))
    assert not torch.equal(table.flatten(), torch.arange(kp.shape[0], dtype=table.dtype)) or kp.shape[0] < 3
    assert torch.equal(flash_decode(q, kp, vp, **kwargs), flash_decode(q, k, v))


def test_benchmark_fp8_page_pools_hold_the_quantised_cache():
    """An FP8 pool (copied as bytes: CUDA has no FP8 ``index_copy_``) holds ``x / scale`` in e4m3 at the pages
    of its table."""
    import torch

    from benchmarks import peers

    x = torch.randn(2, 3, 64, 16, generator=torch.Generator().manual_seed(0))
    pages = peers.paged(x, 16, torch.float8_e4m3fn, scale=0.5)
    table = peers.page_table(2, 4, "cpu").long()
    dense = pages[table].reshape(2, 64, 3, 16).permute(0, 2, 1, 3)
    assert torch.equal(dense.view(torch.uint8), (x / 0.5).to(torch.float8_e4m3fn).view(torch.uint8))


def test_hf_table_shows_decode_ahead_where_measured():
    """bench_hf's decode_ahead columns appear once a row has them, beside the other rows' columns."""
    row = {"context": 32768, "native_tokens_per_s": 174.0, "cp_compiled_tokens_per_s": 120.8,
           "sdpa_static_compiled_tokens_per_s": 53.5, "cp_eager_tokens_per_s": 22.6, "sdpa_eager_tokens_per_s": 11.4,
           "cp_compiled_over_native": 0.694, "cp_compiled_over_sdpa_best": 2.26}
    data = {"config": "llama3-8b", "batch": 1, "new_tokens": 40, "warmup_steps": 8, "rows": [dict(row)]}
    assert "`decode_ahead`" not in tables.hf_table(data)
    data["rows"] = [dict(row, cp_compiled_ahead_tokens_per_s=165.4, cp_compiled_ahead_over_native=0.951,
                         cp_compiled_ahead_over_sdpa_best=3.09),
                    dict(row, context=131072, cp_compiled_ahead_error="RuntimeError: out of memory")]
    lines = tables.hf_table(data).splitlines()
    header = next(line for line in lines if line.startswith("| context"))
    first, second = (line for line in lines if line.startswith(("| 32k", "| 128k")))
    assert "| native | cp_attention + CPCache, compiled, `decode_ahead` | cp_attention + CPCache, compiled |" in header
    assert "`decode_ahead` / native | `decode_ahead` / sdpa | compiled / native |" in header
    assert first.count("|") == header.count("|") == second.count("|")
    assert "| 174.0 | 165.4 | 120.8 |" in first and "| 0.951 | 3.09× | 0.694 | 2.26× |" in first
    assert "| failed (RuntimeError) |" in second
