"""The CUDA launcher: templated sources from ``kernels_cu/`` compiled once per module and device.

A :class:`ModuleSpec` names one source file and the template instantiations compiled
together. NVRTC compiles it here, with exactly :data:`COMPILE_OPTIONS` (CuPy's own
``RawModule`` adds ``-ftz=true``, which flushes subnormal floats to zero: the kernels would
miss the accuracy contract on tiny data), for the device's architecture; the image is kept
on disk beside CuPy's kernel cache (``$CUPY_CACHE_DIR/tileops_cupy``), so a second process
start compiles nothing. Loaded functions are cached per (spec, device) behind a lock, so
threads and devices never share a half-built module.

Each primitive lists the specs it can launch (``module_specs()``); ``_catalogue`` joins
them, and the NVRTC test compiles that whole catalogue for sm_80 and sm_90 on machines with
no GPU. This module imports no primitive.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

import kernels_cu

from ._arrays import cupy
from ._cache import ForkSafeLock, build_once

# The CUDA type of each float dtype the kernels take (kernels_cu/common.cuh declares them).
CUDA_TYPES = {"bfloat16": "bfloat16_t", "float16": "half_t", "float32": "float"}
# No --use_fast_math: the angles and the mHC exponentials must keep full float32 accuracy;
# -ftz=false (NVRTC's default, said here): subnormal data keeps its precision. Functions
# without an execution space are device functions (as under CuPy's RawModule: some NVRTC
# versions take a generic lambda in a kernel for a host function otherwise).
COMPILE_OPTIONS = ("--std=c++17", "-ftz=false", "--device-as-default-execution-space")


@dataclass(frozen=True)
class ModuleSpec:
    """One NVRTC compilation: a source in ``kernels_cu/`` and its template instantiations.

    The program is the ``defines`` ("NAME=VALUE"), ``kernels_cu/common.cuh``, the
    ``prelude`` sources (whose helpers ``source`` uses: NVRTC here has no include path),
    then ``source``."""

    source: str
    name_expressions: tuple[str, ...]
    defines: tuple[str, ...] = ()
    prelude: tuple[str, ...] = ()

    @property
    def code(self) -> str:
        header = "".join(f"#define {define.replace('=', ' ', 1)}\n" for define in self.defines)
        sources = [kernels_cu.source(name) for name in (*self.prelude, self.source)]
        return "\n".join([header + kernels_cu.common(), *sources])

    @property
    def options(self) -> tuple[str, ...]:
        return COMPILE_OPTIONS


_functions: dict[tuple[ModuleSpec, int], dict[str, Any]] = {}
_lock = ForkSafeLock()


def _load(spec: ModuleSpec, device: int) -> dict[str, Any]:
    cp = cupy()
    with cp.cuda.Device(device):
        lowered, image = cached_image(spec, arch_of_device(device))
        module = cp.cuda.function.Module()
        module.load(image)
        # (each Function keeps its module loaded)
        return {name: module.get_function(lowered[name]) for name in spec.name_expressions}


def device_arch(compute_capability: str) -> str:
    """NVRTC's -arch for a device: its own SASS ("sm_90") where this NVRTC knows the
    architecture, else PTX of the newest one it knows below it, for the driver to compile."""
    from cupy_backends.cuda.libs import nvrtc

    capability = int(compute_capability)
    known = [arch for arch in nvrtc.getSupportedArchs() if arch <= capability]
    if capability in known or not known:
        return f"sm_{capability}"
    return f"compute_{max(known)}"


def arch_of_device(device: int) -> str:
    """device_arch of CUDA device ``device``: what its launches compile for."""
    return device_arch(cupy().cuda.Device(device).compute_capability)


# cudaDeviceAttr values the plans read
MAX_SMEM_OPTIN, MULTIPROCESSORS, COMPUTE_MAJOR = 97, 16, 75
MEMORY_CLOCK_KHZ, MEMORY_BUS_BITS = 36, 37
_attributes: dict[tuple[int, int], int] = {}


def device_attribute(device: int, attribute: int) -> int:
    """The cudaDeviceAttr ``attribute`` of CUDA device ``device`` (read once a process)."""
    value = _attributes.get((device, attribute))
    if value is None:
        value = cupy().cuda.runtime.deviceGetAttribute(attribute, device)
        _attributes[(device, attribute)] = value
    return value


def dram_bandwidth_per_multiprocessor(device: int) -> float:
    """Peak DRAM bytes a second of ``device`` (its memory clock, double data rate, times its
    bus width) over its multiprocessors: how many bytes each must keep in flight to stream at
    the peak grows with it. 0 where the driver reports no memory clock (or refuses the query)."""
    try:
        clock_khz = device_attribute(device, MEMORY_CLOCK_KHZ)
        bus_bits = device_attribute(device, MEMORY_BUS_BITS)
    except cupy().cuda.runtime.CUDARuntimeError:
        return 0.0
    return 2e3 * clock_khz * bus_bits / 8 / device_attribute(device, MULTIPROCESSORS)


_CACHE_FORMAT = 1  # bump when the file layout below changes


def _cache_path(spec: ModuleSpec, arch: str) -> str:
    """The disk cache's file for ``spec`` built for ``arch`` by this NVRTC."""
    from cupy_backends.cuda.libs import nvrtc

    key = json.dumps(
        [_CACHE_FORMAT, nvrtc.getVersion(), arch, spec.options, spec.name_expressions, spec.code]
    )
    directory = os.path.join(
        os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache")),
        "tileops_cupy",
    )
    return os.path.join(directory, hashlib.sha256(key.encode()).hexdigest() + ".bin")


def cached_image(spec: ModuleSpec, arch: str) -> tuple[dict[str, str], bytes]:
    """(lowered name of each name expression, cubin or PTX) of ``spec`` for ``arch``, from
    the disk cache or compiled (and stored there). A file is one JSON line of the lowered
    names, then the image; it is written whole or not at all, and an unreadable cache
    only costs a compile."""
    path = _cache_path(spec, arch)
    directory = os.path.dirname(path)
    try:
        with open(path, "rb") as file:
            header, image = file.read().split(b"\n", 1)
        lowered = json.loads(header)
        if sorted(lowered) == sorted(spec.name_expressions) and image:
            return lowered, image
    except (OSError, ValueError):
        pass
    lowered, image, _ = nvrtc_compile(spec, arch)
    temporary = None
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, delete=False) as file:
            temporary = file.name
            file.write(json.dumps(lowered).encode() + b"\n" + image)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
    return lowered, image


def _store_image(spec: ModuleSpec, arch: str) -> None:
    cached_image(spec, arch)  # (the image stays on disk, not sent back to the caller)


def build_in_parallel(specs: list[ModuleSpec], arch: str, processes: int) -> None:
    """Compile those of ``specs`` the disk cache lacks for ``arch`` in ``processes``
    processes (``tools/prewarm.py``): a process that then launches them compiles nothing,
    where each would otherwise be compiled at its first launch, one after another. No GPU
    needed; none started where every file is there (a bad one costs a compile at launch)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    missing = [spec for spec in specs if not os.path.exists(_cache_path(spec, arch))]
    if not missing:
        return
    # spawned, not forked: the caller may hold threads (a test runner, CuPy's)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(processes, len(missing)), mp_context=context) as pool:
        list(pool.map(_store_image, missing, [arch] * len(missing)))


def _whole(cubin: bytes) -> bytes:
    """``cubin`` from CuPy's ``nvrtc.getCUBIN``, which drops its last byte (a zero: it is
    read as a C string), padded with zeros to the end of its last ELF header table."""
    section_table, program_table = struct.unpack_from("<QQ", cubin, 0x20)[::-1]
    program_entry, programs, section_entry, sections = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(section_table + section_entry * sections, program_table + program_entry * programs)
    return cubin + bytes(max(0, end - len(cubin)))


def nvrtc_compile(
    spec: ModuleSpec, arch: str, extra_options: tuple[str, ...] = ()
) -> tuple[dict[str, str], bytes, str]:
    """Compile ``spec`` with NVRTC for ``arch`` ("sm_90": a cubin; "compute_90": PTX), no
    device needed: (lowered name of each name expression, the image, NVRTC's log). Raises
    RuntimeError with the log on a compile error."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(spec.code, f"{spec.source}.cu", [], [])
    try:
        for name in spec.name_expressions:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, [*spec.options, f"-arch={arch}", *extra_options])
        except Exception as error:
            raise RuntimeError(
                f"NVRTC failed on {spec.source}.cu for {arch}:\n{nvrtc.getProgramLog(program)}"
            ) from error
        lowered = {name: nvrtc.getLoweredName(program, name) for name in spec.name_expressions}
        image = _whole(nvrtc.getCUBIN(program)) if arch.startswith("sm_") else nvrtc.getPTX(program)
        return lowered, image, nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def function(spec: ModuleSpec, name_expression: str, device: int) -> Any:
    """The compiled kernel ``name_expression`` of ``spec`` on ``device`` (compiled on first use)."""
    loaded = build_once(_functions, _lock, (spec, device), lambda: _load(spec, device))
    return loaded[name_expression]


# struct codes of the C types the kernels' argument structs hold by value
_C_CODES = {"long long": "q", "i64": "q", "int": "i", "float": "f"}
_DECLARATION = re.compile(r"((?:const\s+|unsigned\s+)*(?:long\s+long|\w+))\s*(\*?)\s*(.+)", re.S)


def declared_fields(source: str, c_name: str) -> tuple[tuple[str, str], ...]:
    """(name, struct code) of every field of ``struct c_name`` in ``kernels_cu/<source>.cu``,
    in order: "P" for any pointer, "q" ``long long``/``i64``, "i" ``int``, "f" ``float``,
    "3q" a ``long long[3]``."""
    text = kernels_cu.source(source)
    found = re.search(r"struct\s+" + c_name + r"\s*\{(.*?)\};", text, re.S)
    if found is None:
        raise LookupError(f"struct {c_name} is not declared in kernels_cu/{source}.cu")
    body = re.sub(r"//[^\n]*|#[^\n]*", "", found.group(1))
    fields: list[tuple[str, str]] = []
    for declaration in filter(None, (d.strip() for d in body.split(";"))):
        c_type, pointer, names = _DECLARATION.fullmatch(declaration).groups()
        c_type = " ".join(c_type.split())
        if not pointer and c_type not in _C_CODES:
            raise ValueError(
                f"struct {c_name} in {source}.cu: field type {c_type!r} is none of "
                f"{sorted(_C_CODES)} or a pointer"
            )
        code = "P" if pointer else _C_CODES[c_type]
        for name in (n.strip() for n in names.split(",")):
            array = re.fullmatch(r"(\w+)\[(\d+)\]", name)
            fields.append((array[1], array[2] + code) if array else (name, code))
    return tuple(fields)


class ParamStruct:
    """A kernel's single by-value struct parameter, packed by field name in the C order of
    the struct. :meth:`declared` reads the fields from the .cu file, so the C declaration
    is the only one (``tests/test_nvrtc.py`` checks the packed size against the file's
    ``static_assert(sizeof(...))``, which NVRTC checks against the C layout).

    Field codes are ``struct``'s: P pointer, q long long, i int, f float; "3q" is a
    ``long long[3]``. Native alignment ("@") gives the device ABI's layout. Packing into one
    reused buffer costs about a microsecond, where CuPy boxes every scalar separately.
    """

    @classmethod
    def declared(cls, source: str, c_name: str) -> ParamStruct:
        """``struct c_name`` of ``kernels_cu/<source>.cu``, with the fields declared there."""
        declared = cls(c_name, declared_fields(source, c_name))
        declared.source = source
        return declared

    def __init__(self, c_name: str, fields: tuple[tuple[str, str], ...]) -> None:
        self.c_name = c_name
        self.source: str | None = None  # the .cu file, for a declared struct
        self.fields = fields
        PARAM_STRUCTS.append(self)
        self._struct = struct.Struct("@" + "".join(code for _, code in fields))
        if self._struct.size > _PARAM_BYTES:
            raise ValueError(
                f"kernel parameters of {self._struct.size} bytes exceed {_PARAM_BYTES}"
            )
        self._arrays = {name for name, code in fields if code[0].isdigit()}
        self.offsets: dict[str, int] = {}
        prefix = "@"
        for name, code in fields:  # each field's byte offset: the aligned size before it
            self.offsets[name] = struct.calcsize(prefix + "0" + code[-1])
            prefix += code

    @property
    def size(self) -> int:
        return self._struct.size

    def pack(self, **values: Any) -> bytes:
        """The struct's bytes from every field by name (arrays as tuples)."""
        missing = [name for name, _ in self.fields if name not in values]
        if missing or len(values) != len(self.fields):
            extra = sorted(set(values) - {name for name, _ in self.fields})
            raise TypeError(f"{self.c_name}: missing fields {missing}, unknown fields {extra}")
        flat: list[Any] = []
        for name, _ in self.fields:
            value = values[name]
            if name in self._arrays:
                flat.extend(value)
            else:
                flat.append(value)
        return self._struct.pack(*flat)

    def read(self, params: bytes, name: str) -> Any:
        """One scalar field of packed ``params``."""
        return struct.unpack_from("@" + dict(self.fields)[name], params, self.offsets[name])[0]

    def field_writer(self, *names: str) -> tuple[tuple[int, struct.Struct, int], ...]:
        """(offset, packer, count) runs of the scalar fields ``names``, for
        :meth:`Launch.relaunch` to patch; fields adjacent in the struct share one packer."""
        order = [name for name, _ in self.fields]
        codes = dict(self.fields)
        runs: list[list[str]] = []
        for name in names:
            if runs and order.index(name) == order.index(runs[-1][-1]) + 1:
                runs[-1].append(name)
            else:
                runs.append([name])
        return tuple(
            (self.offsets[run[0]], struct.Struct("@" + "".join(codes[n] for n in run)), len(run))
            for run in runs
        )


_PARAM_BYTES = 4096  # CUDA allows 4 KB of kernel parameters everywhere; ours are ~200 bytes
PARAM_STRUCTS: list[ParamStruct] = []  # every declaration, for the test against the .cu text


class _ThreadLaunchState(threading.local):
    """Per thread: a parameter buffer and its pointer array, reused by every launch
    (cuLaunchKernel copies the bytes at the call), and the devices whose primary context
    this thread has bound."""

    def __init__(self) -> None:
        buffer = ctypes.create_string_buffer(_PARAM_BYTES)
        # written through a memoryview (which keeps it alive): a slice copy costs a
        # fraction of a ctypes.memmove call, and every launch makes one
        self.params = memoryview(buffer).cast("B")
        self.pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
        self.pointers_address = ctypes.addressof(self.pointers)
        self.devices: set[int] = set()


_thread_state = _ThreadLaunchState()


@dataclass(frozen=True, slots=True)
class Step:
    """One kernel of a launch: its grid, block and dynamic shared memory. ``cooperative``:
    cuLaunchCooperativeKernel, for kernels whose blocks wait for each other (the driver
    refuses a grid that cannot be resident at once instead of hanging). ``programmatic``:
    cuLaunchKernelEx with programmatic stream serialization (sm_90 and newer), for kernels
    that call ``griddepcontrol.wait`` before reading what the kernel before them wrote:
    their blocks may start while that kernel still runs. ``cluster`` > 1: cuLaunchKernelEx
    with thread block clusters of that many blocks along x (sm_90 and newer; the grid's x a
    multiple of it), which run at once and share their shared memory."""

    kernel: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0
    cooperative: bool = False
    programmatic: bool = False
    cluster: int = 1

    def __post_init__(self) -> None:
        if self.cooperative and (self.programmatic or self.cluster > 1):
            raise ValueError("a cooperative launch step is neither programmatic nor clustered")
        if self.grid[0] % self.cluster:
            raise ValueError(
                f"grid {self.grid} is not a whole number of clusters of {self.cluster}"
            )

    @property
    def driver_arguments(self) -> tuple:
        """The driver call's leading arguments: function, grid, block, shared memory."""
        return (self.kernel.ptr, *self.grid, *self.block, self.shared_mem)


@dataclass(frozen=True, slots=True)
class Launch:
    """Kernels run in order on one stream with one packed parameter struct, fully
    described: what :func:`launch` ran, kept so that a later call of the same layout can
    run it again changing only some fields (addresses, an offset) with :meth:`relaunch`,
    skipping every step that derives the geometry."""

    device: int
    params: bytes
    steps: tuple[Step, ...]
    # per step: (cooperative, its driver call with the leading arguments bound), made once
    calls: tuple[tuple[bool, Any], ...] = field(init=False)

    def __post_init__(self) -> None:
        driver = _Driver
        if driver.get_device is None:
            driver.bind()
        calls = tuple(
            (
                step.cooperative,
                _ExtendedLaunch(step)
                if step.programmatic or step.cluster > 1
                else functools.partial(
                    driver.launch_cooperative if step.cooperative else driver.launch,
                    *step.driver_arguments,
                ),
            )
            for step in self.steps
        )
        object.__setattr__(self, "calls", calls)

    def relaunch(
        self, stream: int, writers: tuple[tuple[int, struct.Struct, int], ...] = (), *values: Any
    ) -> None:
        """Launch (again) on ``stream`` with ``values`` (in order) written at ``writers``
        (from :meth:`ParamStruct.field_writer`), the other fields as before."""
        state = _thread_state
        buffer = state.params
        params = self.params
        buffer[: len(params)] = params
        if len(writers) == 1:  # the usual case: the fields that change form one run
            offset, packer, _ = writers[0]
            packer.pack_into(buffer, offset, *values)
        else:
            start = 0
            for offset, packer, count in writers:
                packer.pack_into(buffer, offset, *values[start : start + count])
                start += count
        # the launch itself, inline: a decode step's host time is mostly calls like this one
        driver = _Driver
        device = self.device
        previous = driver.get_device()
        if device not in state.devices:
            driver.set_device(device)
            driver.free(0)  # binds the device's primary context to this thread for the driver
            state.devices.add(device)
        elif previous != device:
            driver.set_device(device)
        try:
            pointers = state.pointers_address
            for cooperative, call in self.calls:
                if cooperative:
                    call(stream, pointers)
                else:
                    call(stream, pointers, 0)  # (no extra launch options)
        finally:
            if previous != device:
                driver.set_device(previous)


def launch(device: int, params: bytes, steps: tuple[Step, ...], stream: int) -> Launch:
    """Launch ``steps`` in order, each kernel's one parameter being the packed struct
    ``params`` (:meth:`ParamStruct.pack`), through the driver, on ``device`` and the raw
    ``stream``. Returns the :class:`Launch`, for :meth:`Launch.relaunch`."""
    done = Launch(device, params, steps)
    done.relaunch(stream)
    return done


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        *((name, ctypes.c_uint) for name in ("gx", "gy", "gz", "bx", "by", "bz", "shared_mem")),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_CLUSTER_DIMENSION, _PROGRAMMATIC_STREAM_SERIALIZATION = 4, 6  # CUlaunchAttributeID


def launch_config(step: Step) -> _LaunchConfig:
    """The CUlaunchConfig of ``step`` (its stream null): its geometry and its attributes,
    programmatic stream serialization and the cluster dimension, as it asks. The config
    keeps its attribute array alive."""
    attributes = []
    if step.programmatic:
        attributes.append(_LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION))
        attributes[-1].value[0] = 1
    if step.cluster > 1:
        attributes.append(_LaunchAttribute(id=_CLUSTER_DIMENSION))
        attributes[-1].value[:3] = (step.cluster, 1, 1)
    array = (_LaunchAttribute * max(1, len(attributes)))(*attributes)
    config = _LaunchConfig(*step.grid, *step.block, step.shared_mem, None, array, len(attributes))
    config.keep = array
    return config


def driver_function(name: str) -> Any:
    """A CUDA driver entry point CuPy does not bind (cuLaunchKernelEx, the cluster
    occupancy), from libcuda itself."""
    return getattr(ctypes.CDLL("libcuda.so.1"), name)


class _ExtendedLaunch:
    """A Step's cuLaunchKernelEx, with the attributes it asks for (CuPy binds no
    cuLaunchKernelEx): called as the driver's launchKernel is, (stream, params, extra).
    Keeps one config per stream, made on its first launch there: the driver reads it after
    ctypes has released the GIL, so threads launching on their own streams at once never
    share one being written, and a decode step does not build one per call. (H200 host, per
    call: a plain kernel launched through it 6.3-6.5 µs, as through CuPy's launchKernel;
    with the cluster attribute the driver takes about 1.3 µs more.)"""

    def __init__(self, step: Step) -> None:
        self.config = launch_config(step)
        self.function = step.kernel.ptr
        self.configs: dict[int, tuple[_LaunchConfig, int]] = {}
        if _ExtendedLaunch.driver_call is None:
            call = driver_function("cuLaunchKernelEx")
            call.argtypes = (ctypes.c_void_p,) * 4
            call.restype = ctypes.c_int
            _ExtendedLaunch.driver_call = call

    driver_call: Any = None

    def __call__(self, stream: int, params: int, extra: int) -> None:
        config = self.configs.get(stream)
        if config is None:
            made = _LaunchConfig.from_buffer_copy(self.config)  # (its attrs: self.config's)
            made.stream = stream
            if len(self.configs) >= 64:  # streams come and go: start over
                self.configs.clear()
            config = self.configs[stream] = (made, ctypes.addressof(made))
        result = self.driver_call(config[1], self.function, params, None)
        if result:
            from cupy_backends.cuda.api.driver import CUDADriverError

            raise CUDADriverError(result)


class _Driver:
    """The CUDA calls a launch makes, bound once (attribute chains through CuPy cost a
    visible share of a decode-sized call)."""

    get_device: Any = None

    @classmethod
    def bind(cls) -> None:
        cp = cupy()
        cls.get_device, cls.set_device = cp.cuda.runtime.getDevice, cp.cuda.runtime.setDevice
        cls.free = cp.cuda.runtime.free
        cls.launch, cls.launch_cooperative = (
            cp.cuda.driver.launchKernel,
            cp.cuda.driver.launchCooperativeKernel,
        )


@dataclass(frozen=True, slots=True)
class DevicelessBuild:
    """What :func:`compile_without_device` learned: each name expression's lowered (mangled)
    name, and ptxas's report of each kernel (by mangled name): registers, spilled bytes, and
    the stack frame (spills, and any array the compiler keeps in local memory)."""

    lowered: dict[str, str]
    registers: dict[str, int]
    spill_stores: dict[str, int]
    stack_frames: dict[str, int]


_PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)")
_PTXAS_FRAME_AND_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")


def compile_without_device(spec: ModuleSpec, arch: str) -> DevicelessBuild:
    """Compile ``spec`` with NVRTC for ``arch`` (e.g. "sm_90") with no GPU or driver needed,
    ptxas reporting each kernel's resources. Raises RuntimeError with the NVRTC log on a
    compile error."""
    lowered, _, log = nvrtc_compile(spec, arch, ("-Xptxas=-v",))
    registers, spill_stores, stack_frames, function = {}, {}, {}, None
    for line in log.splitlines():
        if match := _PTXAS_FUNCTION.search(line):
            function = match.group(1)
        elif (match := _PTXAS_FRAME_AND_SPILLS.search(line)) and function is not None:
            stack_frames[function], spill_stores[function] = map(int, match.groups())
        elif (match := _PTXAS_REGISTERS.search(line)) and function is not None:
            registers[function] = int(match.group(1))
    return DevicelessBuild(lowered, registers, spill_stores, stack_frames)
