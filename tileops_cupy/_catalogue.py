"""Every CUDA module the package ships: each primitive's own list, joined (a leaf: nothing
of the package imports it; the NVRTC test compiles the whole catalogue with no GPU, and
``tools/prewarm.py`` and the tests' conftest build it into the kernel cache)."""

from __future__ import annotations

from . import _mhc, _rotate
from ._cuda import ModuleSpec, arch_of_device, build_in_parallel


def shipped_modules() -> list[ModuleSpec]:
    """Every ModuleSpec the package ships, once each."""
    specs: list[ModuleSpec] = []
    for spec in (*_rotate.module_specs(), *_mhc.module_specs()):
        if spec not in specs:
            specs.append(spec)
    return specs


def prewarm(arch: str | None = None, processes: int | None = None) -> tuple[int, str]:
    """Compile every shipped module into the disk cache in ``processes`` processes (default:
    one a CPU) for ``arch`` (default: GPU 0's, as a launch there picks it), so that no
    launch compiles; returns (modules, arch)."""
    import os

    arch = arch or arch_of_device(0)
    specs = shipped_modules()
    build_in_parallel(specs, arch, processes or os.cpu_count() or 1)
    return len(specs), arch
