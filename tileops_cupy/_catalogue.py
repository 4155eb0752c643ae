"""Every CUDA module the package ships: each primitive's own list, joined (a leaf: nothing
imports it but the NVRTC test, which compiles the whole catalogue with no GPU)."""

from __future__ import annotations

from . import _mhc, _rotate
from ._cuda import ModuleSpec


def shipped_modules() -> list[ModuleSpec]:
    """Every ModuleSpec the package ships, once each."""
    specs: list[ModuleSpec] = []
    for spec in (*_rotate.module_specs(), *_mhc.module_specs()):
        if spec not in specs:
            specs.append(spec)
    return specs
