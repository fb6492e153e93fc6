"""The plot of the generation runs (benchmarks/run_all.sh, part "two"): decode tokens/s against the context
on 1 and 2 GPUs, for launch/generate.py's native model and, where measured, transformers' generate()
(``--backend transformers --compile``). Reads benchmarks/results/generate[_hf]_w{1,2}.json, writes
benchmarks/results/generate.png. Runs without a GPU.

    python3 benchmarks/plot_generate.py
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SERIES = [("generate_w1", "native, 1 GPU", "C0", "o:"), ("generate_w2", "native, 2 GPUs", "C0", "o-"),
          ("generate_hf_w1", "transformers generate(), 1 GPU", "C1", "s:"),
          ("generate_hf_w2", "transformers generate(), 2 GPUs", "C1", "s-")]


def points(payload: dict) -> list[tuple[int, float]]:
    """(context, decode tokens/s) of a launch/generate.py JSON's --fill-context runs."""
    runs = payload.get("runs", [payload])
    return sorted((r["synthetic_context"], r["decode_tokens_per_s"]) for r in runs
                  if "synthetic_context" in r and r.get("decode_tokens_per_s"))


def plot(results: Path = RESULTS, path: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = path or results / "generate.png"
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    model = "?"
    for stem, label, color, style in SERIES:
        f = results / f"{stem}.json"
        if not f.exists():
            continue
        data = json.loads(f.read_text())
        pts = points(data)
        model = next((r.get("model") for r in data.get("runs", [data])), model)
        if pts:
            ax.plot(*zip(*pts), style, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context (positions of random K/V)", ylabel="decode tokens/s (B = 1)",
           title=f"Generation, {model} shapes, random weights")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    print(f"wrote {plot()}")


if __name__ == "__main__":
    main()
