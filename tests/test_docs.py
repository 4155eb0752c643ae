"""The documentation runs: every docstring example of the public modules, and every script in
``examples/`` on each place (the host with the GPU hidden, and the GPU where there is one)."""

import doctest
import importlib

import pytest
from _cases import GPU, REPO, assert_runs_in_own_process

PUBLIC_MODULES = ("tileops_cupy.rope", "tileops_cupy.schemes", "tileops_cupy.sequence_modeling")
EXAMPLES = sorted(path.name for path in (REPO / "examples").glob("*.py"))
RUN_SCRIPT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_docstring_examples_run(name):
    results = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0, f"{name} has no docstring example"
    assert results.failed == 0, f"{results.failed} of {name}'s docstring examples failed"


@pytest.mark.parametrize("place", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("script", EXAMPLES)
def test_example_script_runs(place, script):
    # An empty CUDA_VISIBLE_DEVICES hides every GPU from torch and CuPy: the host path.
    hide_gpus = {"CUDA_VISIBLE_DEVICES": ""} if place == "cpu" else None
    assert_runs_in_own_process(RUN_SCRIPT, str(REPO / "examples" / script), env=hide_gpus)
