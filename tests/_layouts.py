"""The CUDA rotation's launch layouts (``tileops_cupy._rotate``), for the tests that force one
of them and compare it with the chunk layout (``rope_rotate``), which takes every launch the
others leave."""

from __future__ import annotations

from collections.abc import Callable

from tileops_cupy import _cuda, _rotate

# the head-row bounds from which the layouts other than the chunks' take launches
LAYOUT_BOUNDS = ("_PACK_MIN_HEAD_ROWS", "_SHARED_MIN_HEAD_ROWS")


def chunks_only(monkeypatch) -> None:
    """Every other layout's bound out of reach: each launch planned from here takes
    rope_rotate (until a test lowers one bound again; then on any device: the shared
    layout's bound on the device's memory bandwidth is lifted)."""
    for bound in LAYOUT_BOUNDS:
        monkeypatch.setattr(_rotate, bound, 1 << 62)
    monkeypatch.setattr(_rotate, "_SHARED_MAX_SM_BANDWIDTH", float("inf"))


def takes_packs(plan) -> bool:
    """Whether ``plan`` launches rope_rotate_packs (blocks of _PACK_THREADS along x)."""
    return plan.steps[0].block == (_rotate._PACK_THREADS, 1, 1)


def takes_shared(dtype: str, rotary_dim: int, neox: bool | None = None) -> Callable[[object], bool]:
    """Whether a plan launches rope_rotate_shared of ``dtype`` and ``rotary_dim`` in the
    ``neox`` rotation layout (None: either); compiles the kernels on device 0."""
    spec = _rotate.module_spec(dtype, rotary_dim)
    kernels = [
        _cuda.function(spec, _rotate._shared_name(dtype, layout, rotary_dim), 0)
        for layout in ((True, False) if neox is None else (neox,))
    ]
    return lambda plan: any(plan.steps[0].kernel is kernel for kernel in kernels)
