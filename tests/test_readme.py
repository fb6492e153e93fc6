"""Every Python block of README.md runs as printed, so the README cannot drift from the code.

Each ```python block runs in a fresh interpreter: on a CPU with the Triton kernels under the interpreter
(``TRITON_INTERPRET=1``), the first one also on the plain torch path; on a GPU machine on the GPU. A
```python torchrun block runs as a script under ``torch.distributed.run`` with two processes (one GPU each
where two are visible, else CPU processes over gloo). The test ids name the blocks (the README label above
each), so a failure says which one.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TIMEOUT_S = 240
FENCE = re.compile(r"^```(python[^\n]*)\n(.*?)^```", re.S | re.M)


def _label(text_before: str) -> str:
    """A short id from the last heading or bold label before a block."""
    labels = re.findall(r"^#+ (.+)$|\*\*([^*]+)\*\*", text_before, re.M)
    label = next((a or b for a, b in reversed(labels)), "block")
    return re.sub(r"[^0-9a-z]+", "-", label.lower().replace("⊕", "merge")).strip("-")[:40]


def blocks():
    """``(id, info string, code)`` of every Python block of README.md, in order."""
    text = README.read_text()
    out, seen = [], {}
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        name = _label(text[: m.start()])
        seen[name] = seen.get(name, 0) + 1
        out.append((f"L{line}-{name}" + (f"-{seen[name]}" if seen[name] > 1 else ""), m.group(1).split(), m.group(2)))
    return out


BLOCKS = blocks()
CASES = [pytest.param(code, info, True, id=name) for name, info, code in BLOCKS]
CASES.insert(1, pytest.param(BLOCKS[0][2], BLOCKS[0][1], False, id=f"{BLOCKS[0][0]}-torch-path"))


def _env(interpret: bool, cpu_only: bool = False) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("TRITON_INTERPRET", None)
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if interpret and (cpu_only or not torch.cuda.is_available()):
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_readme_has_the_blocks():
    kinds = [tuple(info) for _, info, _ in BLOCKS]
    assert ("python", "torchrun") in kinds and kinds.count(("python",)) >= 8, kinds


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("code, info, interpret", CASES)
def test_readme_block(code, info, interpret, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    cpu_only = False
    if "torchrun" in info:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
        cpu_only = torch.cuda.device_count() < 2  # one process per GPU, or two CPU processes over gloo
    else:
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(interpret, cpu_only), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n" \
                                 f"{proc.stderr[-6000:]}"


# Names of work history that the product (documents, docstrings, comments) must not carry: rounds, commit
# hashes, the deleted notes and logs; nor the absolute paths of one machine.
HISTORY = re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                     r"\w+teenth|twentieth|twenty-\w+) round\b(?! trip)|\bround \d+\b|NOTES\.md|logs_\w+|"
                     r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b|(?<![\w.$])/(?:tmp|work|root|home)/", re.I)
PRODUCT = ["README.md", "CHANGELOG.md", "Makefile", "benchmarks/README.md", "benchmarks/run_all.sh",
           *sorted(p.relative_to(ROOT).as_posix() for pattern in ("docs/*.md", "cp_attention/**/*.py", "launch/*.py",
                                                                 "benchmarks/*.py") for p in ROOT.glob(pattern))]


@pytest.mark.parametrize("doc", PRODUCT)
def test_product_names_no_round_commit_or_machine_path(doc):
    text = (ROOT / doc).read_text()
    if doc == "CHANGELOG.md":  # history belongs there; only a machine's paths do not
        text = re.sub(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", "", text)
    hits = [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in HISTORY.finditer(text)]
    assert not hits, f"{doc}: history or a machine's path in the product at (line, text) {hits}"
