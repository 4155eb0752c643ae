"""The documentation runs: every docstring example of the public modules, every script in
``examples/`` and the README's Python blocks, on each place (the host with the GPU hidden,
and the GPU where there is one)."""

import doctest
import importlib
import re

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


README_BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


@pytest.mark.parametrize("place", ["cpu", pytest.param("cuda", marks=GPU)])
def test_readme_python_blocks_run(place):
    """The README's Python blocks, in order in one process (a block may use what an earlier
    one made), as written on the GPU; on the host with ``device="cpu"`` for
    ``device="cuda"``, and without the lines that name CuPy (device arrays only)."""
    assert len(README_BLOCKS) >= 10
    source = "\n\n".join(README_BLOCKS)
    if place == "cpu":
        lines = source.replace('device="cuda"', 'device="cpu"').splitlines()
        source = "\n".join(line for line in lines if not re.search(r"\bcupy\b", line))
    hide_gpus = {"CUDA_VISIBLE_DEVICES": ""} if place == "cpu" else None
    assert_runs_in_own_process(source, env=hide_gpus)
