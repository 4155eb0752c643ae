"""Where a test runs: the places, the frameworks each place takes, and moving test data there.

Every family's tests are one file parametrized over the place: "cpu" (the numpy host path,
fed numpy arrays or torch CPU tensors) and "cuda" (the CUDA path, fed torch CUDA tensors or
CuPy arrays), the latter marked ``gpu`` so that it skips on a machine without a device
(``conftest.py``). :func:`per_place` builds the parameters of a test whose cases differ by
place (frameworks, dtypes, the larger sizes a device run needs); :func:`to_place` moves numpy
test data there.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _oracle import DEVICE_DTYPES, HOST_DTYPES, to_framework

GPU = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
PLACES = ("cpu", pytest.param("cuda", marks=GPU))
SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU time: work queued behind it is clearly ordered
FRAMEWORKS = {"cpu": ("numpy", "torch"), "cuda": ("torch", "cupy")}
"""The arrays each place takes: host arrays (numpy, torch CPU) or device arrays (torch CUDA,
CuPy; JAX has its own GPU test)."""
DEFAULT_FRAMEWORK = {"cpu": "numpy", "cuda": "torch"}
DTYPES = {"cpu": HOST_DTYPES, "cuda": DEVICE_DTYPES}
"""float64 runs on the host path only (a device float64 input is a TypeError)."""


def per_place(cases: Mapping[str, Iterable[Any]]) -> list:
    """``pytest.param(place, *case)`` for every case of every place, the "cuda" ones marked
    ``gpu``. A case is a tuple of further arguments, or one value; the id joins the place and
    the values ("cpu-numpy-float16")."""
    params = []
    for place, place_cases in cases.items():
        marks = (GPU,) if place == "cuda" else ()
        for case in place_cases:
            values = case if isinstance(case, tuple) else (case,)
            ident = "-".join([place, *(str(value) for value in values)])
            params.append(pytest.param(place, *values, marks=marks, id=ident))
    return params


def product(*axes: Iterable[Any]) -> list[tuple]:
    return list(itertools.product(*axes))


def frameworks_and_dtypes(
    frameworks: Mapping[str, Iterable[str]] = FRAMEWORKS,
    dtypes: Mapping[str, Iterable[str]] = DTYPES,
) -> list:
    """:func:`per_place` parameters ``(place, framework, dtype)``: every framework of a place
    with every dtype of that place."""
    return per_place({place: product(frameworks[place], dtypes[place]) for place in frameworks})


def require(place: str, framework: str) -> None:
    """Skip when this machine cannot put data of ``framework`` on ``place`` (a torch without
    CUDA, no CuPy): the ``gpu`` marker alone only knows whether CuPy sees a device."""
    if place != "cuda":
        return
    if framework == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("this torch build has no CUDA")
    elif framework == "cupy":
        pytest.importorskip("cupy")
    else:
        raise ValueError(f"{framework!r} has no CUDA arrays")


def framework_key(place: str, framework: str) -> str:
    """The :func:`_oracle.to_framework` name of ``framework`` on ``place``."""
    return "torch-cuda" if (place, framework) == ("cuda", "torch") else framework


def to_place(host: np.ndarray, place: str, framework: str | None = None) -> Any:
    """A copy of the numpy array ``host`` on ``place`` as ``framework`` (default: numpy on the
    host, torch on the device); skips where the machine cannot (:func:`require`)."""
    framework = framework or DEFAULT_FRAMEWORK[place]
    require(place, framework)
    return to_framework(host, framework_key(place, framework))


def clone(array: Any) -> Any:
    """A copy of ``array`` in its own framework and place."""
    return array.clone() if type(array).__module__.startswith("torch") else array.copy()


def synchronize(place: str) -> None:
    """Wait for every stream of the current device (nothing to wait for on the host)."""
    if place == "cuda":
        import cupy

        cupy.cuda.runtime.deviceSynchronize()


def assert_graph_replays_like_eager(
    step: Callable[..., Any],
    fresh: Callable[[], list],
    check: Callable[[list, list], None] | None = None,
    before_replay: Callable[[], None] | None = None,
    replays: int = 3,
) -> None:
    """Capture ``step(*inputs)`` (torch CUDA tensors from ``fresh()``) in a CUDA graph on a
    side stream, after a warm-up there on copies (kernels compiled, tables uploaded, flags
    mapped), then ``replays`` times: fresh inputs written into the captured ones, the graph
    replayed, and what it wrote compared bit for bit with an eager ``step`` on copies of the
    same inputs. What a step writes: what it returns (a tensor or a sequence of them), or its
    inputs when it returns None (in place). ``before_replay()`` runs before each replay's
    eager step (e.g. to change a weight the graph reads); ``check(new_inputs, written)`` after
    each comparison. Run it through :func:`assert_runs_in_own_process`."""
    import torch

    def written(inputs: list, returned: Any) -> list:
        if returned is None:
            return list(inputs)
        return [returned] if isinstance(returned, torch.Tensor) else list(returned)

    static = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*[t.clone() for t in static])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = written(static, step(*static))
    for replay in range(replays):
        new = fresh()
        if before_replay is not None:
            before_replay()
        copies = [t.clone() for t in new]
        expected = written(copies, step(*copies))  # eager, on copies
        for target, value in zip(static, new, strict=True):
            target.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, expected, strict=True):
            assert torch.equal(got, want), f"replay {replay}"
        if check is not None:
            check(new, captured)


def assert_runs_in_own_process(
    script: str, *argv: str, env: Mapping[str, str] | None = None
) -> str:
    """Run ``script`` (Python source) with ``argv`` in a fresh interpreter that imports the
    package from this checkout, assert it exits 0 (its output in the failure message), and
    return what it printed. CUDA-graph captures run this way: a failed capture poisons its
    process's CUDA context, which would hide the tests after it. ``env``: variables to set
    on top of this process's."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", script, *argv],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
