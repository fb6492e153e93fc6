"""AOT compile gate: every Triton kernel in cp_attention/ops lowers to an sm_90 cubin on this CPU machine.

Each ops module lists realistic compiles in ``AOT_SPECS``; a kernel (``_*_kernel``) without an entry fails
``test_every_kernel_is_registered``, so a kernel that only runs in the interpreter cannot land.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_compile.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_every_kernel_is_registered(report):
    assert not report["unregistered"], f"kernels without an AOT_SPECS entry: {report['unregistered']}"
    ids = {s["id"].rsplit("-", 1)[0] for s in report["specs"]}
    assert {"merge", "split_kv", "kernels"} <= ids


def test_every_kernel_compiles_for_sm90(report):
    failed = {s["id"]: s.get("error") for s in report["specs"] if not s["ok"]}
    assert not failed, failed
    for s in report["specs"]:
        assert ".target sm_90" in s["ptx"], s["id"]


def test_split_kv_streams_16_byte_copies_into_tensor_cores(report):
    for s in report["specs"]:
        if s["kernel"] != "_split_kv_kernel":
            continue
        ptx = s["ptx"]
        # K/V tiles go through 16-byte asynchronous copies into a multi-stage pipeline ...
        assert "cp.async.cg.shared.global" in ptx and ", 16;" in ptx, s["id"]
        # ... and meet the packed query heads on the tensor cores.
        assert "mma.sync" in ptx or "wgmma" in ptx, s["id"]
        assert "atom" not in ptx, s["id"]  # level 2 is the combine kernel's: no ticket, no atomic
        if s["constexprs"]["PDL"]:  # Note [Programmatic dependent launch]: wait first, release after the loop
            assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents"), s["id"]


def test_symm_merge_protocols(report):
    """Note [Symmetric-memory merge]. Flagged words: one relaxed system-scope 8-byte store per value, volatile
    polls, and no fence or system-scope atomic on the path. Bulk: float32 stores, a barrier, then one
    system-scope fence and the flag's relaxed system-scope store by thread 0, acquire polls before the first
    load of the peers' rows, which bypass L1. Pushed by the producer: no store to a peer, no fence, acquire
    polls of the row flags, a barrier, then the loads. The producer (the merge kernel with a push): its
    stores, a barrier, a system-scope fence, then the row flags' relaxed system-scope stores."""
    specs = [s for s in report["specs"] if s["kernel"] == "_symm_merge_kernel"]
    assert {(s["constexprs"]["BULK"], s["constexprs"]["PUSHED"]) for s in specs} == {(False, False), (True, False),
                                                                                    (False, True)}
    for s in specs:
        ptx = s["ptx"]
        assert "griddepcontrol.wait" in ptx, s["id"]
        assert "atom" not in ptx and "st.release" not in ptx, s["id"]
        if s["constexprs"]["PUSHED"]:
            assert "st.relaxed" not in ptx and "fence" not in ptx and "ld.volatile.global.b64" not in ptx, s["id"]
            polls = ptx.rindex("ld.acquire.sys")
            assert polls < ptx.index("bar.sync", polls) < ptx.index("ld.global.cg"), s["id"]
            continue
        if not s["constexprs"]["BULK"]:
            assert "st.relaxed.sys.global.b64" in ptx and "ld.volatile.global" in ptx, s["id"]
            assert "fence" not in ptx and "membar" not in ptx, s["id"]
            continue
        assert "ld.volatile.global.b64" not in ptx and ptx.count("fence.acq_rel.sys") == 1, s["id"]
        fence, flag = ptx.index("fence.acq_rel.sys"), ptx.index("st.relaxed.sys.global.b32")
        assert ptx.rindex("st.global", 0, fence) < ptx.rindex("bar.sync", 0, fence) < fence < flag, s["id"]
        assert ptx.count("st.relaxed.sys") == ptx.count("ld.acquire.sys") == s["constexprs"]["WORLD"], s["id"]
        assert ptx.rindex("ld.acquire.sys") < ptx.index("ld.global.cg"), s["id"]
    producers = [s for s in report["specs"] if s["kernel"] == "_merge_states_kernel"]
    assert {s["constexprs"]["EXCHANGE_BLOCK_M"] > 0 for s in producers} == {False, True}
    for s in producers:
        ptx = s["ptx"]
        if not s["constexprs"]["EXCHANGE_BLOCK_M"]:
            assert "fence" not in ptx and ".sys" not in ptx, s["id"]
            continue
        fence = ptx.index("fence.acq_rel.sys")
        assert ptx.count("fence.acq_rel.sys") == 1 and "st.release" not in ptx, s["id"]
        assert ptx.rindex("st.global", 0, fence) < ptx.rindex("bar.sync", 0, fence) < fence, s["id"]
        assert fence < ptx.index("st.relaxed.sys.global.b32"), s["id"]
