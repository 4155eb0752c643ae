"""The CUDA launcher: templated sources from ``kernels_cu/`` compiled once per module and device.

A :class:`ModuleSpec` names one source file and the template instantiations compiled
together (``cupy.RawModule(..., name_expressions=...)``); CuPy keeps the cubin in its
on-disk cache, so a second process start compiles nothing. Loaded functions are cached
per (spec, device) behind a lock, so threads and devices never share a half-built module.

Every op module registers the specs it can launch with :func:`register_catalog`; the
NVRTC test compiles that whole catalogue for sm_80 and sm_90 on machines with no GPU.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import kernels_cu

from ._arrays import cupy

# No --use_fast_math: the angles and the mHC exponentials must keep full float32 accuracy.
COMPILE_OPTIONS = ("--std=c++17",)


@dataclass(frozen=True)
class ModuleSpec:
    """One NVRTC compilation: a source in ``kernels_cu/`` and its template instantiations."""

    source: str
    name_expressions: tuple[str, ...]
    defines: tuple[str, ...] = ()

    @property
    def code(self) -> str:
        header = "".join(f"#define {define}\n" for define in self.defines)
        return header + kernels_cu.source(self.source)

    @property
    def options(self) -> tuple[str, ...]:
        return COMPILE_OPTIONS


_functions: dict[tuple[ModuleSpec, int], dict[str, Any]] = {}
_lock = threading.Lock()


def _load(spec: ModuleSpec, device: int) -> dict[str, Any]:
    cp = cupy()
    with cp.cuda.Device(device):
        module = cp.RawModule(
            code=spec.code, options=spec.options, name_expressions=list(spec.name_expressions)
        )
        loaded = {}
        for name in spec.name_expressions:
            function = module.get_function(name)
            loaded[name] = getattr(function, "kernel", function)  # RawKernel -> cuda Function
        return loaded


def function(spec: ModuleSpec, name_expression: str, device: int) -> Any:
    """The compiled kernel ``name_expression`` of ``spec`` on ``device`` (compiled on first use)."""
    key = (spec, device)
    loaded = _functions.get(key)
    if loaded is None:
        with _lock:
            loaded = _functions.get(key)
            if loaded is None:
                loaded = _load(spec, device)
                _functions[key] = loaded
    return loaded[name_expression]


class ParamStruct:
    """A kernel's single by-value struct parameter, laid out as the C struct in the .cu file.

    ``fields`` uses ``struct`` codes (P pointer, q long long, i int, f float) in the C field
    order; native alignment ("@") gives the same layout as the device ABI. Packing into one
    reused buffer costs about a microsecond, where CuPy boxes every scalar separately.
    """

    def __init__(self, fields: str) -> None:
        self._struct = struct.Struct("@" + fields)
        if self._struct.size > _PARAM_BYTES:
            raise ValueError(
                f"kernel parameters of {self._struct.size} bytes exceed {_PARAM_BYTES}"
            )

    def pack_into(self, buffer, values: tuple) -> None:
        self._struct.pack_into(buffer, 0, *values)


_PARAM_BYTES = 4096  # CUDA allows 4 KB of kernel parameters everywhere; ours are ~200 bytes


class _ThreadLaunchState(threading.local):
    """Per thread: a parameter buffer and its pointer array, reused by every launch
    (cuLaunchKernel copies the bytes at the call), and the devices whose primary context
    this thread has bound."""

    def __init__(self) -> None:
        self.params = ctypes.create_string_buffer(_PARAM_BYTES)
        self.pointers = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        self.pointers_address = ctypes.addressof(self.pointers)
        self.devices: set[int] = set()


_thread_state = _ThreadLaunchState()


def launch_packed(
    kernel: Any,
    device: int,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    fields: ParamStruct,
    values: tuple,
    stream: int,
    shared_mem: int = 0,
    cooperative: bool = False,
) -> None:
    """Launch a compiled ``kernel`` whose one parameter is the struct ``fields`` holding
    ``values``, through the driver, on ``device`` and the raw ``stream`` handle.

    ``cooperative``: cuLaunchCooperativeKernel, for kernels whose blocks wait for each
    other (the driver refuses a grid that cannot be resident at once instead of hanging).
    """
    state = _thread_state
    fields.pack_into(state.params, values)
    runtime = cupy().cuda.runtime
    previous = runtime.getDevice()
    if device not in state.devices:
        runtime.setDevice(device)
        runtime.free(0)  # binds the device's primary context to this thread for the driver
        state.devices.add(device)
    elif previous != device:
        runtime.setDevice(device)
    try:
        driver = cupy().cuda.driver
        if cooperative:
            driver.launchCooperativeKernel(
                kernel.ptr, *grid, *block, shared_mem, stream, state.pointers_address
            )
        else:
            driver.launchKernel(
                kernel.ptr, *grid, *block, shared_mem, stream, state.pointers_address, 0
            )
    finally:
        if previous != device:
            runtime.setDevice(previous)


_catalogs: list[Callable[[], Iterable[ModuleSpec]]] = []


def register_catalog(catalog: Callable[[], Iterable[ModuleSpec]]) -> Callable:
    """Declare every ModuleSpec an op module may launch (used by the NVRTC test)."""
    _catalogs.append(catalog)
    return catalog


def shipped_modules() -> list[ModuleSpec]:
    """Every ModuleSpec the package ships, from all registered catalogues."""
    from . import rope, sequence_modeling  # noqa: F401  (importing registers the catalogues)

    specs: list[ModuleSpec] = []
    for catalog in _catalogs:
        for spec in catalog():
            if spec not in specs:
                specs.append(spec)
    return specs


def compile_without_device(spec: ModuleSpec, arch: str) -> dict[str, str]:
    """Compile ``spec`` with NVRTC for ``arch`` (e.g. "sm_90") with no GPU or driver needed.

    Returns each name expression's lowered (mangled) name; raises RuntimeError with the
    NVRTC log on a compile error.
    """
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(spec.code, f"{spec.source}.cu", [], [])
    try:
        for name in spec.name_expressions:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, [*spec.options, f"-arch={arch}"])
        except Exception as error:
            raise RuntimeError(
                f"NVRTC failed on {spec.source}.cu for {arch}:\n{nvrtc.getProgramLog(program)}"
            ) from error
        return {name: nvrtc.getLoweredName(program, name) for name in spec.name_expressions}
    finally:
        nvrtc.destroyProgram(program)
