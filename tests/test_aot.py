"""AOT compile gate: every Triton kernel in cp_attention/ops lowers to an sm_90 cubin on this CPU machine.

tests/aot_specs.py lists realistic compiles of each module; a kernel (``_*_kernel``) without an entry fails
``test_every_kernel_is_registered``, so a kernel that only runs in the interpreter cannot land.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cp_attention.heuristics import DecodeConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_compile.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_every_kernel_is_registered(report):
    assert not report["unregistered"], f"kernels without a spec in tests/aot_specs.py: {report['unregistered']}"
    ids = {s["id"].rsplit("-", 1)[0] for s in report["specs"]}
    assert {"merge", "split_kv", "model_kernels"} <= ids


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


def test_paired_fp8_values_reach_the_tensor_cores_without_byte_loads(report):
    """Note [FP8 values in pairs]: an FP8 V tile read in pairs leaves shared memory in wide loads; the same
    tiles unpaired (16 rows, or one table entry loaded a tile) take single-byte loads."""
    fp8 = [s for s in report["specs"] if s["kernel"] == "_split_kv_kernel" and s["constexprs"]["HEAD_DIM"] == 256
           and s["constexprs"]["KV_SCALE"]]
    paired = [s for s in fp8 if s["constexprs"]["PAIR_V"]]
    assert len(paired) >= 3 and len(fp8) > len(paired)
    for s in fp8:
        byte_loads = re.findall(r"ld\.shared\.[usb]8", s["ptx"])
        assert (not byte_loads) == bool(s["constexprs"]["PAIR_V"]), (s["id"], len(byte_loads))


def test_split_plans_count_no_more_programs_per_sm_than_fit(report):
    """The split plan fills one wave of ``DecodeConfig.programs_per_sm`` programs on every SM (the
    config's ``programs``, else the estimate from its K/V stages). Counting more than the compiled kernel's
    registers or shared memory let in leaves programs over for a second wave (the FP8 tiles of head dim
    256 once counted three where their 255 registers fit two: 215 µs against 167 on the H200); and a config that names its programs spills little: no local arrays and at most 512
    bytes of stack, where ptxas puts spilled registers (Triton 3.9: at most 344, the FP8 two-warp tiles in four
    key streams; Triton 3.6 at most 184)."""
    dtypes = {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp8e4nv": torch.float8_e4m3fn,
              "*fp8e5": torch.float8_e5m2}
    named = 0
    for s in report["specs"]:
        if s["kernel"] not in ("_split_kv_kernel", "_split_kv_fp8_kernel"):
            continue
        c, o = s["constexprs"], s["options"]
        config = DecodeConfig(c["BLOCK_N"], o["num_warps"], o["num_stages"], s["programs"])
        planned = config.programs_per_sm(c["HEAD_DIM"], dtypes[s["signature"]["K"]])
        regs = -(-s["regs"] // 8) * 8  # sm_90 allocates registers to a warp in units of 256
        assert planned * regs * 32 * o["num_warps"] <= 65536, (s["id"], planned, s["regs"])
        assert planned * (s["shared"] + 1024) <= 233472, (s["id"], planned, s["shared"])  # 228 KB, 1 KB a block
        if s["programs"]:
            named += 1
            assert s["local"] == 0 and s["stack"] <= 512, (s["id"], s["stack"])
    assert named >= 8


def test_combine_releases_the_next_launch_after_its_stores_behind_packed_splits(report):
    """Note [Programmatic dependent launch]: behind a split kernel of several programs per SM the combine
    lets the next kernel launch only once its output is stored; behind the others, on entry."""
    seen = set()
    for s in report["specs"]:
        if s["kernel"] != "_combine_kernel" or not s["constexprs"]["PDL"]:
            continue
        ptx = s["ptx"]
        release, last_store = ptx.index("griddepcontrol.launch_dependents"), ptx.rindex("st.global")
        assert ptx.index("griddepcontrol.wait") < release, s["id"]
        assert (release < last_store) == s["constexprs"]["TRIGGER_EARLY"], s["id"]
        seen.add(s["constexprs"]["TRIGGER_EARLY"])
    assert seen == {True, False}


def test_paged_tables_in_registers_keep_the_dense_pipeline(report):
    """Note [Paged tiles from registers]: with a split's block-table entries in registers the paged loop
    holds the dense loop's K/V stages in shared memory (same tile and stages); with the table read inside
    the loop the pipeliner keeps fewer (the reason for the registers)."""
    def shared(**match):
        found = [s["shared"] for s in report["specs"] if s["kernel"] == "_split_kv_kernel"
                 and all(s["constexprs"][k] == v for k, v in match.items())]
        assert found, match
        return found[0]

    dense = shared(IS_PAGED=False, BLOCK_N=128, KV_SCALE=0, Q_ROWS=1, HAS_WINDOW=False, HEAD_DIM=128)
    gathered = shared(IS_PAGED=True, PAGE_SIZE=16, BLOCK_N=128, SPLIT_PAGES=2048)  # + the gather's entries
    assert dense <= gathered <= dense + 2048 * 4
    assert shared(IS_PAGED=True, PAGE_SIZE=256, BLOCK_N=128, SPLIT_PAGES=16) == dense
    dense64 = shared(IS_PAGED=False, BLOCK_N=64, KV_SCALE=0, Q_ROWS=1, HEAD_DIM=128)
    assert shared(IS_PAGED=True, PAGE_SIZE=16, BLOCK_N=64, SPLIT_PAGES=0, Q_ROWS=1) < dense64


def test_register_cap_reaches_the_ptx(report):
    """``DecodeConfig.maxnreg``: the config that counts on four programs per SM (``FOUR_PER_SM``) compiles
    with ``maxnreg`` 128, and the others without a cap."""
    specs = [s for s in report["specs"] if s["kernel"] == "_split_kv_kernel"]
    capped = [s for s in specs if s["options"].get("maxnreg")]
    assert capped
    for s in specs:
        assert (".maxnreg 128" in s["ptx"]) == (s in capped), s["id"]


def test_symm_merge_protocols(report):
    """Note [Symmetric-memory merge]. Flagged words: one relaxed system-scope 8-byte store per value, volatile
    polls, and no fence or system-scope atomic on the path. Bulk: float32 stores (none when the producer
    pushed), a barrier, then one system-scope fence and the flag's relaxed system-scope store by thread 0,
    acquire polls before the first load of the peers' rows, which bypass L1. The producer (the merge kernel
    with a push): plain stores, no fence and nothing at system scope."""
    specs = [s for s in report["specs"] if s["kernel"] == "_symm_merge_kernel"]
    assert {(s["constexprs"]["BULK"], s["constexprs"]["PUSHED"]) for s in specs} == {(False, False), (True, False),
                                                                                    (True, True)}
    for s in specs:
        ptx = s["ptx"]
        assert "griddepcontrol.wait" in ptx, s["id"]
        assert "atom" not in ptx and "st.release" not in ptx, s["id"]
        if not s["constexprs"]["BULK"]:
            assert "st.relaxed.sys.global.b64" in ptx and "ld.volatile.global" in ptx, s["id"]
            assert "fence" not in ptx and "membar" not in ptx, s["id"]
            continue
        assert "ld.volatile.global.b64" not in ptx and ptx.count("fence.acq_rel.sys") == 1, s["id"]
        fence, flag = ptx.index("fence.acq_rel.sys"), ptx.index("st.relaxed.sys.global.b32")
        assert ptx.rindex("bar.sync", 0, fence) < fence < flag, s["id"]
        stores_before = ptx.count("st.global", 0, fence)
        assert (stores_before == 0) if s["constexprs"]["PUSHED"] else stores_before > 0, s["id"]
        # one flag store per rank (the rank's own is skipped at run time); the compiler may copy a poll
        assert ptx.count("st.relaxed.sys") == s["constexprs"]["WORLD"] <= ptx.count("ld.acquire.sys"), s["id"]
        assert ptx.rindex("ld.acquire.sys") < ptx.index("ld.global.cg"), s["id"]
    producers = [s for s in report["specs"] if s["kernel"] == "_merge_states_kernel"]
    assert {s["constexprs"]["EXCHANGE_BLOCK_M"] > 0 for s in producers} == {False, True}
    plain = min(s["ptx"].count("st.global") for s in producers)
    for s in producers:
        assert "fence" not in s["ptx"] and ".sys" not in s["ptx"], s["id"]
        if s["constexprs"]["EXCHANGE_BLOCK_M"]:  # the rows again, to each peer
            assert s["ptx"].count("st.global") > plain, s["id"]


def test_one_warp_fp8_tiles_reach_the_tensor_cores_without_a_layout_change(report):
    """Note [One-warp FP8 tiles]: the K/V tiles enter shared memory by 16-byte ``cp.async`` only and leave it
    by 16-byte loads straight into the ``mma`` operands: no other shared store, no narrower shared load (a
    layout change through shared memory would add both), no cross-warp barrier beyond the ring's; PDL's wait
    comes first and the release after the loop; after it, the output goes through shared memory in 16-byte
    pieces and out in 16-byte stores; eight warps fit an SM, spilling at most 16 bytes (Triton 3.9: 0-16 at 9-16
    rows, none at up to 8; 3.6: none). Programs of several warps (16 rows each) exchange single words across warps
    (the lazy max's any-row test, the rows' reach) and nothing else. Up to 8 rows the keys are the ``mma`` rows
    (Note [Keys as the mma rows]): a tile of ``N`` keys takes ``2 (N / 16) (D / 16)`` of them in each copy of the
    loop (Triton emits one to three copies), half the rows' form."""
    specs = [s for s in report["specs"] if s["kernel"] == "_split_kv_fp8_kernel"]
    assert len(specs) >= 4 and any(s["num_warps"] == 2 for s in specs)
    assert any(s["constexprs"]["HEAD_DIM"] == 256 and s["constexprs"]["Q_ROWS"] > 1 for s in specs)
    for s in specs:
        assert s["local"] == 0 and s["stack"] <= 16 and s["num_warps"] * s["programs"] == 8, (s["id"], s["stack"])
        assert s["ptx"].index("griddepcontrol.wait") < s["ptx"].index("griddepcontrol.launch_dependents"), s["id"]
        ptx, out = s["ptx"].split("griddepcontrol.launch_dependents")
        assert "cp.async.cg.shared.global" in ptx and "mma.sync.aligned.m16n8k16" in ptx, s["id"]
        c = s["constexprs"]
        if c["Q_ROWS"] * c["GROUP_SIZE"] <= 8:  # a tile's wait for its copy in each copy of the loop, one after
            loops = len(re.findall(r"cp\.async\.wait_group", ptx)) - 1
            per_tile = 2 * (c["BLOCK_N"] // 16) * (c["HEAD_DIM"] // 16)
            assert loops and len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == loops * per_tile, s["id"]
        words = {"b32"} if s["num_warps"] > 1 else set()  # the cross-warp words
        assert set(re.findall(r"st\.shared\.(\S+)", ptx)) == words, s["id"]
        loads = set(re.findall(r"ld\.shared\.(\S+)", ptx)) - words
        assert loads and all(w.startswith("v4.b32") or w.startswith("v4.u32") for w in loads), (s["id"], loads)
        assert set(re.findall(r"st\.shared\.(\S+)", out)) - words == {"v4.b32"}, s["id"]
        if c["Q_ROWS"] * c["GROUP_SIZE"] % 4 == 0:  # 16-byte aligned rows (odd row counts misalign the slots)
            scalar, vector = (len(re.findall(rf"st\.global\.{w}", out)) for w in ("b32", r"v[24]\.b32"))
            assert vector and scalar <= 2, (s["id"], scalar, vector)  # the scalars: the lse
