"""Every ``>>>`` example in the package's docstrings runs and prints what it shows. The distributed examples
run on every rank of an initialised process group: here one gloo process (``init_method=file://``)."""
import doctest
import importlib
import pkgutil

import pytest
import torch
import torch.distributed as dist

import cp_attention

MODULES = sorted(m.name for m in pkgutil.walk_packages(cp_attention.__path__, "cp_attention."))


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-process gloo group for the examples of ``cp_attention.distributed`` (torn down after)."""
    if dist.is_initialized():
        yield
        return
    path = tmp_path_factory.mktemp("doctest_pg") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_module_is_collected():
    assert {"cp_attention.decode", "cp_attention.distributed.decode", "cp_attention.hf"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, one_rank_group):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs = {"torch": torch, "dist": dist}
    tests = [t for t in finder.find(module, name, globs=dict(vars(module), **globs)) if t.examples]
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (output above)"
