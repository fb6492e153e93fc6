"""Compile every spec of tests/aot_specs.py (the kernels of cp_attention/ops and launch/model_kernels.py) for sm_90 and
print a JSON report.

Run in its own process (the interpreter must be off so ``@triton.jit`` gives compilable functions);
tests/test_aot.py drives it.
"""
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import cp_attention.ops as ops_pkg  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aot_specs import specs_by_module  # noqa: E402


def compile_spec(spec):
    kernel, constexprs = spec["kernel"], spec["constexprs"]
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = spec["signature"].get(name, "i32")
        # Mirror the JIT's specialisation of launch arguments: pointers and strides divisible by 16.
        if sig[name].startswith("*") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    src = source(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec.get("options", {}))


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread, local bytes and stack bytes (where ptxas puts register spills) of the kernel in
    ``cubin``, from ``cuobjdump``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    return {"regs": int(re.search(r"REG:(\d+)", out).group(1)), "local": int(re.search(r"LOCAL:(\d+)", out).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", out).group(1))}


def main():
    report = {"specs": [], "unregistered": []}
    # the library's kernels, and the model kernels of launch/generate.py
    by_module = specs_by_module()
    names = [f"cp_attention.ops.{info.name}" for info in pkgutil.iter_modules(ops_pkg.__path__)] + ["launch.model_kernels"]
    for name in names:
        mod = importlib.import_module(name)
        short = name.rsplit(".", 1)[1]
        specs = by_module.get(name, [])
        registered = {id(s["kernel"]) for s in specs}
        for fn_name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and fn_name.endswith("_kernel") and id(fn) not in registered:
                report["unregistered"].append(f"{short}.{fn_name}")
        for i, spec in enumerate(specs):
            entry = {"id": f"{short}-{i}", "kernel": spec["kernel"].__name__, "constexprs": spec["constexprs"],
                     "options": spec.get("options", {}), "programs": spec.get("programs", 0),
                     "signature": spec.get("signature", {})}
            try:
                k = compile_spec(spec)
                entry.update(ok=bool(k.asm.get("cubin")), ptx=k.asm["ptx"], shared=k.metadata.shared,
                             num_warps=k.metadata.num_warps, **resource_usage(k.asm["cubin"]))
            except Exception as e:  # reported, and failed, by the test
                entry.update(ok=False, error=f"{type(e).__name__}: {e}")
            report["specs"].append(entry)
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
