"""tools/kernel_ab.py, the A/B of kernel source variants: its variant loading, its table and
its export on the host; one run of its rows on the GPU, so that the tool keeps up with the ops."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import kernels_cu

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "kernel_ab.py"


def _tool():
    spec = importlib.util.spec_from_file_location("kernel_ab", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_variant_folder_replaces_only_the_files_it_holds(tmp_path):
    (tmp_path / "rope.cu").write_text("// variant rope\n")
    script = (
        "import sys, importlib.util as u\n"
        f"spec = u.spec_from_file_location('kernel_ab', {str(TOOL)!r})\n"
        "tool = u.module_from_spec(spec); spec.loader.exec_module(tool)\n"
        f"tool.use_variant({str(tmp_path)!r})\n"
        "import kernels_cu\n"
        "print(kernels_cu.source('rope') == '// variant rope\\n')\n"
        f"print(kernels_cu.source('mhc') == open({str(ROOT / 'kernels_cu' / 'mhc.cu')!r}).read())\n"
        f"print(kernels_cu.common() == open({str(ROOT / 'kernels_cu' / 'common.cuh')!r}).read())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    assert out == ["True", "True", "True"]


def test_a_checkout_folder_brings_its_own_python_and_kernels(tmp_path):
    for package in ("tileops_cupy", "kernels_cu"):
        (tmp_path / package).mkdir()
        marker = f"WHERE = {package!r} + ' of the variant'\n"
        (tmp_path / package / "__init__.py").write_text(marker)
    script = (
        "import sys, importlib.util as u\n"
        f"spec = u.spec_from_file_location('kernel_ab', {str(TOOL)!r})\n"
        "tool = u.module_from_spec(spec); spec.loader.exec_module(tool)\n"
        f"tool.use_variant({str(tmp_path)!r})\n"
        "import tileops_cupy, kernels_cu\n"
        "print(tileops_cupy.WHERE); print(kernels_cu.WHERE)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert out == ["tileops_cupy of the variant", "kernels_cu of the variant"]


def test_tree_is_the_shipped_sources_and_a_missing_folder_is_refused():
    tool = _tool()
    tool.use_variant("tree")  # (no change to this process)
    assert kernels_cu.source("rope") == (ROOT / "kernels_cu" / "rope.cu").read_text()
    with pytest.raises(SystemExit, match="neither 'tree' nor a folder"):
        tool.use_variant(str(ROOT / "no such folder"))


def test_table_gives_each_row_its_median_and_range_beside_a_copy():
    def run(ceiling, rope, copy, decode):
        row = {"ceiling GB/s": ceiling, "rope A": rope, "rope A copy": copy}
        return row | {"decode B": decode, "decode B copy": None}  # a latency row (µs)

    runs = {
        "base": [run(4160.0, 90.0, 95.0, 12.0), run(4150.0, 92.0, 95.1, 11.0)],
        "tree": [run(4160.0, 93.5, 95.0, 9.0), run(4158.0, 94.5, 95.0, 9.5)],
    }
    runs["base"].append(run(4155.0, 91.0, 95.2, 13.5))
    runs["tree"].append(run(4157.0, 93.0, 95.0, 8.5))
    lines = _tool().table(runs).splitlines()
    assert lines[0].split() == ["row", "base", "tree", "copy"]
    assert lines[1].split() == ["rope", "A", "91.0", "(90.0-92.0)", "93.5", "(93.0-94.5)", "95.0"]
    assert lines[2].split() == ["decode", "B", "12.0", "(11.0-13.5)", "9.0", "(8.5-9.5)", "-"]
    assert lines[3].startswith("copy ceilings (GB/s): {'base': [4160.0, 4150.0, 4155.0]")


def test_table_marks_outputs_whose_bits_differ_from_the_first_variants():
    def run(figure, bits):
        return {"ceiling GB/s": 4160.0, "row (µs)": figure, "row (µs) copy": None} | (
            {"row (µs) bits": bits}
        )

    runs = {
        "base": [run(10.0, "aa"), run(11.0, "aa")],
        "same": [run(9.0, "aa"), run(9.5, "aa")],
        "other": [run(8.0, "bb"), run(8.5, "bb")],
        "drifts": [run(9.0, "aa"), run(9.0, "cc")],  # (two runs of one variant disagree)
    }
    cells = _tool().table(runs).splitlines()[1].split()
    assert cells[2:] == [
        "10.5", "(10.0-11.0)", "9.2", "(9.0-9.5)", "8.2", "(8.0-8.5)", "!bits",
        "9.0", "(9.0-9.0)", "!bits", "-",
    ]  # fmt: skip


def test_a_variant_named_again_runs_again_in_a_column_of_its_own():
    named = _tool().columns(["tree", "prof/try", "tree", "tree"])
    assert named == {"tree": "tree", "prof/try": "prof/try", "tree#2": "tree", "tree#3": "tree"}
    # a folder named like a repeat's column keeps its own column
    assert _tool().columns(["tree", "tree#2", "tree"]) == {
        "tree": "tree", "tree#2": "tree#2", "tree#3": "tree"
    }  # fmt: skip


def test_digest_covers_every_bit_of_every_output():
    torch = pytest.importorskip("torch")
    tool = _tool()
    a = torch.randn(4, 5).bfloat16()
    b = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tool.digest((a, b)) == tool.digest([a.clone(), b.t().contiguous().t()])
    flipped = a.clone()
    flipped.view(torch.int16)[3, 2] ^= 1
    assert tool.digest((flipped, b)) != tool.digest((a, b))
    assert tool.digest((b, a)) != tool.digest((a, b))
    assert tool.digest(a) == tool.digest((a,))
    assert tool.digest(None) is None


def _clean(*paths: str) -> None:
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", *paths], cwd=ROOT, capture_output=True, text=True
    )
    if status.returncode or status.stdout.strip():
        pytest.skip(f"not a git checkout, or {paths} differ from HEAD")


def test_export_writes_a_revisions_kernel_files(tmp_path):
    _clean("kernels_cu")
    names = _tool().export("HEAD", tmp_path)
    sources = ROOT / "kernels_cu"
    assert sorted(names) == sorted(p.name for p in sources.iterdir() if p.suffix in (".cu", ".cuh"))
    for name in names:
        assert (tmp_path / name).read_text() == (sources / name).read_text()


def test_export_of_a_checkout_writes_its_package_and_kernels(tmp_path):
    _clean("tileops_cupy", "kernels_cu")
    paths = _tool().export("HEAD", tmp_path, checkout=True)
    tracked = subprocess.run(
        ["git", "ls-files", "tileops_cupy", "kernels_cu"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert sorted(paths) == sorted(tracked) and "tileops_cupy/_mhc.py" in paths
    for path in paths:
        assert (tmp_path / path).read_bytes() == (ROOT / path).read_bytes()


def test_no_row_function_finds_a_name_that_its_builder_rebinds():
    """A row's function is called long after its builder's loop has moved on: a name it finds
    at call time (not bound as a default) that the builder binds more than once (a loop
    variable, a name assigned twice) would be another row's by then. (The cos_sin_cache row
    found the MRoPE interleaved row's q and k, and its timed calls rotated that row's inputs.)"""
    tree = ast.parse(TOOL.read_text())
    checked = 0
    for builder in tree.body:
        if not (isinstance(builder, ast.FunctionDef) and builder.name.endswith(("_rows", "_row"))):
            continue
        bound: dict[str, int] = {}
        for node in ast.walk(builder):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.For, ast.comprehension)):
                targets = [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        weight = 2 if isinstance(node, (ast.For, ast.comprehension)) else 1
                        bound[name.id] = bound.get(name.id, 0) + weight
        rebound = {name for name, times in bound.items() if times > 1}
        for node in ast.walk(builder):
            if isinstance(node, ast.Lambda):
                own = {a.arg for a in node.args.args + node.args.kwonlyargs}
                found = {n.id for n in ast.walk(node.body) if isinstance(n, ast.Name)} - own
                assert not found & rebound, (builder.name, node.lineno, found & rebound)
                checked += 1
    assert checked >= 10


@pytest.mark.gpu
def test_every_row_runs_on_the_device():
    """Each group's rows built and run once (compiling their kernels; nothing timed)."""
    tool = _tool()
    out = tool.measure("tree", list(tool.GROUPS), warm_only=True)
    assert out == {"ceiling GB/s": 1.0}
