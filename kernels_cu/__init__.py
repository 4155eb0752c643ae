"""CUDA sources of tileops_cupy, compiled at run time by NVRTC (``tileops_cupy._cuda``).

This package holds no Python logic beyond reading a source by name, so that a wheel
install and a source checkout find the ``.cu`` files the same way.
"""

from functools import cache
from pathlib import Path

_HERE = Path(__file__).resolve().parent


@cache
def source(name: str) -> str:
    """Text of ``kernels_cu/<name>.cu``."""
    return (_HERE / f"{name}.cu").read_text()


@cache
def common() -> str:
    """Text of ``kernels_cu/common.cuh``, which the loader puts before every source."""
    return (_HERE / "common.cuh").read_text()
