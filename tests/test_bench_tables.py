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
