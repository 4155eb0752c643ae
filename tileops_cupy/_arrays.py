"""Array interop: any DLPack tensor or NumPy array in, the caller's framework out.

An argument becomes an :class:`Operand`, a flat description of where its elements live:
a device pointer with element strides for CUDA memory, or a zero-copy NumPy view for host
memory (bfloat16 through ``ml_dtypes``, since NumPy has none). Outputs are allocated in
the framework of the first tensor argument, so torch in gives torch out with its caching
allocator, CuPy gives CuPy, NumPy gives NumPy.

torch tensors are read through ``data_ptr``/``stride`` rather than DLPack: that is the
same memory without the per-call capsule round trip, which matters at decode sizes.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._cache import ForkSafeLock

try:  # ml_dtypes is a hard dependency, but keep the import error readable
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised only in broken installs
    ml_dtypes = None
    _BF16 = None

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13


class NoCudaError(RuntimeError):
    """CUDA was asked for but CuPy, a driver or a device is missing."""


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~1 µs per call at decode sizes
class Operand:
    """One tensor argument as the kernels see it.

    ``strides`` count elements, not bytes. ``ptr`` is set for CUDA memory, ``host`` (a NumPy
    view of the same memory) for host memory.
    """

    obj: Any
    framework: str
    device: int | None
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    ptr: int = 0
    host: np.ndarray | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device is not None

    @property
    def place(self) -> str:
        return "cuda" if self.is_cuda else "cpu"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def last_dim_contiguous(self) -> bool:
        # an empty array's strides are arbitrary (NumPy gives zeros): nothing to read anyway
        return self.ndim == 0 or self.shape[-1] <= 1 or self.strides[-1] == 1 or 0 in self.shape


def _numpy_dtype_name(dtype: np.dtype) -> str:
    if _BF16 is not None and dtype == _BF16:
        return "bfloat16"
    return dtype.name


def _from_numpy(obj: Any, array: np.ndarray, framework: str, name: str = "array") -> Operand:
    itemsize = array.dtype.itemsize
    if any(s % itemsize for s in array.strides):
        # e.g. a field of a packed structured array: element strides cannot describe it
        raise ValueError(
            f"{name} has byte strides {array.strides}, which are not multiples of its "
            f"itemsize {itemsize}; expected whole-element strides: pass a copy "
            f"(numpy.ascontiguousarray({name}))"
        )
    return Operand(
        obj=obj,
        framework=framework,
        device=None,
        dtype=_numpy_dtype_name(array.dtype),
        shape=tuple(array.shape),
        strides=tuple(s // itemsize for s in array.strides),
        host=array,
    )


_torch_dtype_names: dict[Any, str] = {}  # torch.dtype -> our name
_torch_dtypes: dict[str, Any] = {}  # our name -> torch.dtype


def _torch_dtype_name(dtype: Any) -> str:
    name = _torch_dtype_names.get(dtype)
    if name is None:
        name = _torch_dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def described(obj: Any) -> Operand:
    """A torch tensor's dtype, shape and strides without its memory (a fake or meta tensor
    has none): what the validation reads, for the custom ops' fake implementations."""
    device = obj.get_device() if obj.is_cuda else None  # (a fake tensor keeps its device)
    dtype = _torch_dtype_name(obj.dtype)
    return Operand(obj, "torch", device, dtype, tuple(obj.shape), obj.stride())


def _from_torch(obj: Any, name: str = "tensor") -> Operand:
    if obj.is_nested or obj.layout is not _torch().strided:  # (no one pointer and strides)
        layout = "nested" if obj.is_nested else str(obj.layout).removeprefix("torch.")
        raise TypeError(f"{name} must be a dense (strided) torch tensor, got a {layout} tensor")
    if obj.is_neg():  # (memory holding the negated values: z.conj().imag of a complex z)
        raise TypeError(
            f"{name} has torch's lazy negation bit set (its memory holds the negated "
            f"values); pass {name}.resolve_neg()"
        )
    dtype = _torch_dtype_name(obj.dtype)
    if obj.is_cuda:
        return Operand(
            obj, "torch", obj.get_device(), dtype, tuple(obj.shape), obj.stride(), obj.data_ptr()
        )
    if obj.device.type != "cpu":
        raise ValueError(f"{name} is a torch tensor on {obj.device}; expected cpu or cuda")
    tensor = obj.detach()
    if dtype == "bfloat16":  # numpy has no bfloat16: read the bits, same memory
        array = tensor.view(_torch().int16).numpy().view(_BF16)
    else:
        try:
            array = tensor.numpy()
        except (TypeError, RuntimeError) as error:  # (float8, complex32, a conjugate view)
            raise TypeError(
                f"{name} is a torch {dtype} tensor that NumPy cannot view ({error}); no op "
                "takes its dtype"
            ) from error
    return _from_numpy(obj, array, "torch", name)


def _from_cupy(obj: Any, framework: str = "cupy") -> Operand:
    itemsize = obj.dtype.itemsize
    return Operand(
        obj=obj,
        framework=framework,
        device=obj.device.id,
        dtype=_numpy_dtype_name(obj.dtype),
        shape=tuple(obj.shape),
        strides=tuple(s // itemsize for s in obj.strides),
        ptr=obj.data.ptr,
    )


def _framework_of(obj: Any) -> str:
    module = type(obj).__module__.split(".", 1)[0]
    if module in ("torch", "cupy", "numpy"):
        return module
    if module in ("jax", "jaxlib"):
        return "jax"
    torch = sys.modules.get("torch")  # a torch.Tensor subclass of another module (torchao's)
    if torch is not None and isinstance(obj, torch.Tensor):
        return "torch"
    return "dlpack"


def as_operand(obj: Any, name: str) -> Operand:
    """Describe ``obj`` (a DLPack tensor or NumPy array) without copying it.

    Raises TypeError naming ``name`` for anything that is not an array, and ValueError
    naming it for memory the kernels cannot address (a torch device other than cpu or
    cuda, byte strides that are not whole elements).
    """
    if type(obj).__module__ == "torch" and hasattr(obj, "data_ptr"):  # the common case first
        return _from_torch(obj, name)
    framework = _framework_of(obj)
    if framework == "torch" and hasattr(obj, "data_ptr"):
        return _from_torch(obj, name)
    if framework == "numpy" and isinstance(obj, np.ndarray):
        if type(obj) is np.ndarray:
            return _from_numpy(obj, obj, "numpy", name)
        if isinstance(obj, np.ma.MaskedArray):
            raise TypeError(
                f"{name} is a masked array, whose mask the ops would ignore; pass "
                f"{name}.filled(value) or {name}.data"
            )
        # a subclass (np.matrix, a memmap) read as a plain array of the same memory: the
        # host path's arithmetic must not take the subclass's (a matrix's * is a product)
        return _from_numpy(obj, obj.view(np.ndarray), "numpy", name)
    if framework == "cupy" and hasattr(obj, "data"):
        return _from_cupy(obj)
    if not hasattr(obj, "__dlpack_device__"):
        if framework == "jax" and "Tracer" in type(obj).__name__:
            raise TypeError(
                f"{name} is a JAX tracer ({type(obj).__name__}): the ops run on concrete "
                "arrays, outside jax.jit, jax.grad and jax.vmap (call them on the arrays "
                "those return, or through jax.pure_callback)"
            )
        raise TypeError(
            f"{name} must be an array (torch, CuPy, NumPy, JAX or any DLPack tensor), "
            f"got {type(obj).__name__}"
        )
    device_type, _ = obj.__dlpack_device__()
    if device_type in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        return _from_cupy(cupy().from_dlpack(obj), framework)
    if device_type in (_KDL_CPU, _KDL_CUDA_HOST):
        # np.asarray keeps JAX's ml_dtypes bfloat16; from_dlpack refuses it
        array = np.asarray(obj) if framework == "jax" else _host_from_dlpack(obj)
        return _from_numpy(obj, array, framework, name)
    raise ValueError(f"{name} lives on DLPack device type {device_type}; expected CPU or CUDA")


# DLPack's DLTensor: data (8 bytes), device (8), ndim (4), then dtype: code, bits, lanes; a
# versioned capsule's DLTensor follows its version, manager context, deleter and flags
_DLTENSOR_DTYPE_OFFSET = 20
_CAPSULES = {b"dltensor_versioned": 32, b"dltensor": 0}  # name: offset of the DLTensor
_KDL_UINT, _KDL_BFLOAT = 1, 4
_NUMPY_TAKES_VERSIONED_CAPSULES = np.lib.NumpyVersion(np.__version__) >= "2.1.0"


class _Exported:
    """A DLPack capsule already taken from a producer, offered to ``np.from_dlpack``."""

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self._capsule, self._device = capsule, device

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def _host_from_dlpack(obj: Any) -> np.ndarray:
    """A NumPy view of any DLPack producer's host memory, bfloat16 included: NumPy refuses
    that dtype code, so a bfloat16 capsule is relabelled 16-bit unsigned (the same bits)
    before NumPy takes it, and viewed as ml_dtypes' bfloat16 after. A versioned capsule is
    asked for first where NumPy takes one (2.1 on), as NumPy itself does: its flags say
    whether the memory may be written."""
    capsule = None
    if _NUMPY_TAKES_VERSIONED_CAPSULES:
        with contextlib.suppress(TypeError):  # (a producer older than DLPack 1.0)
            capsule = obj.__dlpack__(max_version=(1, 0))
    if capsule is None:
        capsule = obj.__dlpack__()
    name = next(name for name in _CAPSULES if _capsule_is_valid(capsule, name))
    address = _capsule_pointer(capsule, name) + _CAPSULES[name] + _DLTENSOR_DTYPE_OFFSET
    dtype = (ctypes.c_uint8 * 4).from_address(address)
    is_bfloat16 = (dtype[0], dtype[1]) == (_KDL_BFLOAT, 16)
    if is_bfloat16:
        dtype[0] = _KDL_UINT
    array = np.from_dlpack(_Exported(capsule, obj.__dlpack_device__()))
    return array.view(_BF16) if is_bfloat16 else array


# Python's capsule API with its own signatures (ctypes.pythonapi's are shared, and unset)
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


# --------------------------------------------------------------------------- memory


# Pure functions of the geometry, cached: a serving loop calls with the same few layouts
# (and the same q-to-k distance inside a fused buffer) every step.


def _itemsize(operand: Operand) -> int:
    return ITEMSIZE.get(operand.dtype) or numpy_dtype(operand.dtype).itemsize


def _address(operand: Operand) -> int:
    return operand.ptr if operand.device is not None else operand.host.ctypes.data


def _layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int):
    """``([(|byte stride|, size) of each dim of size > 1], backward)``: ``backward`` is the
    byte offset of the lowest element from the first (< 0 for views that run backwards,
    as NumPy's may)."""
    dims, backward = [], 0
    for size, stride in zip(shape, strides, strict=True):
        if size > 1:
            if stride < 0:
                backward += (size - 1) * stride * itemsize
            dims.append((abs(stride) * itemsize, size))
    return dims, backward


def _reach(itemsize: int, dims: list[tuple[int, int]], pitch: int = 0) -> int:
    """Bytes from the lowest element to past the highest, over the dims whose stride is not
    a multiple of ``pitch`` (all dims when ``pitch`` is 0)."""
    return itemsize + sum((size - 1) * step for step, size in dims if not pitch or step % pitch)


@functools.lru_cache(maxsize=1024)
def _repeats(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    if 0 in shape:
        return False
    reach = itemsize
    for step, size in sorted(_layout(shape, strides, itemsize)[0]):
        if step < reach:
            return True
        reach += (size - 1) * step
    return False


@functools.lru_cache(maxsize=1024)
def _meet(a: tuple, b: tuple, offset: int) -> bool:
    """Whether ``a`` and ``b``, each ``(shape, strides, itemsize)``, may share a byte when
    b's first element lies ``offset`` bytes after a's."""
    if 0 in a[0] or 0 in b[0]:
        return False
    (dims_a, start_a), (dims_b, back_b) = _layout(*a), _layout(*b)
    start_b = offset + back_b
    if start_a + _reach(a[2], dims_a) <= start_b or start_b + _reach(b[2], dims_b) <= start_a:
        return False
    for pitch in {step for step, _ in dims_a + dims_b if step}:
        # within a row of `pitch` bytes, b's band starts `gap` bytes after a's
        gap = (start_b - start_a) % pitch
        if gap >= _reach(a[2], dims_a, pitch) and gap + _reach(b[2], dims_b, pitch) <= pitch:
            return False
    return True


def self_overlapping(operand: Operand) -> bool:
    """True when two index tuples of ``operand`` may address the same element: a dim of
    size > 1 with stride 0 (an ``expand``/``broadcast_to`` view), or dims that, sorted by
    stride, do not nest (a stride smaller than the reach of the dims below it).

    Conservative: a few exotic interleaved layouts that do not nest count as overlapping,
    although no element repeats (as NumPy's own quick test does)."""
    return _repeats(operand.shape, operand.strides, _itemsize(operand))


def overlapping(a: Operand, b: Operand) -> bool:
    """True when ``a`` and ``b`` may share a byte of memory.

    Disjoint byte ranges are disjoint. Ranges that interleave (q and k sliced from one fused
    QKV buffer: each row holds a band of q's columns, then a band of k's) are tried against
    each stride as a row pitch: dims whose stride is a multiple of the pitch move whole
    rows, the others span a band of columns within a row, and bands that do not meet
    modulo the pitch are disjoint. Anything else that shares a range counts as
    overlapping (conservative)."""
    if a.device != b.device:
        return False
    return _meet(
        (a.shape, a.strides, _itemsize(a)), (b.shape, b.strides, _itemsize(b)),
        _address(b) - _address(a),
    )  # fmt: skip


# --------------------------------------------------------------------------- outputs


def empty_like(template: Operand, shape: tuple[int, ...], dtype: str | None = None) -> Operand:
    """A new contiguous array in ``template``'s framework and device."""
    dtype = dtype or template.dtype
    if template.framework == "torch":
        torch_dtype = _torch_dtypes.get(dtype)
        if torch_dtype is None:
            torch_dtype = _torch_dtypes[dtype] = getattr(_torch(), dtype)
        tensor = _torch().empty(shape, dtype=torch_dtype, device=template.obj.device)
        if not template.is_cuda:
            return _from_torch(tensor)
        # a fresh CUDA tensor's layout is known: skip re-reading its metadata (a decode step
        # allocates up to three outputs, and that bookkeeping is a visible share of it)
        return Operand(
            tensor, "torch", template.device, dtype, tuple(shape), contiguous_strides(shape),
            tensor.data_ptr(),
        )  # fmt: skip
    if template.is_cuda:
        cp = cupy()
        with cp.cuda.Device(template.device):
            array = cp.empty(shape, dtype=numpy_dtype(dtype))
        return _from_cupy(array, template.framework)
    return _from_numpy(None, np.empty(shape, dtype=numpy_dtype(dtype)), template.framework)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def contiguous(operand: Operand, template: Operand | None = None) -> Operand:
    """A C-contiguous copy of ``operand`` (for inputs whose last dimension is strided: the
    kernels read rows through strides but elements densely), made on the stream of
    ``template`` (the call's data, whose stream the launch takes; ``operand`` itself by
    default): the kernel then reads it after it is written, and no other stream's
    allocations reuse its memory before the kernel is done. torch makes the copy where
    both are torch tensors (its current stream); CuPy otherwise."""
    template = template or operand
    obj = operand.obj
    if operand.framework == "torch" and template.framework == "torch":
        return _from_torch(obj.contiguous())
    if operand.is_cuda:
        cp = cupy()
        stream = cupy_stream(stream_handle(template), operand.device)
        with cp.cuda.Device(operand.device), stream:
            return _from_cupy(cp.ascontiguousarray(as_cupy(operand)), operand.framework)
    return _from_numpy(obj, np.ascontiguousarray(operand.host), operand.framework)


def upload(template: Operand, values: np.ndarray) -> Operand:
    """``values`` copied to ``template``'s device, in its framework, ordered on the caller's
    stream (for small host-side metadata such as per-sequence offsets): contiguous and in
    native byte order, which neither torch nor CuPy takes otherwise (a big-endian NumPy
    array of positions is read right on the host)."""
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("="))
    if template.framework == "torch":
        return _from_torch(_torch().from_numpy(values).to(template.obj.device))
    cp = cupy()
    stream = cupy_stream(stream_handle(template), template.device)
    with cp.cuda.Device(template.device), stream:
        return _from_cupy(cp.asarray(values), template.framework)


def as_cupy(operand: Operand) -> Any:
    """A CuPy view of a CUDA operand (zero-copy)."""
    cp = cupy()
    obj = operand.obj
    if operand.framework == "cupy":
        return obj
    return cp.from_dlpack(obj)


def to_caller(result: Operand) -> Any:
    """The framework object the caller gets back for an output made by :func:`empty_like`."""
    if result.obj is not None and result.framework in ("torch", "cupy"):
        return result.obj
    if result.is_cuda:
        if result.framework == "jax":
            import jax.numpy as jnp

            return jnp.from_dlpack(result.obj)
        return result.obj
    array = result.host
    if result.framework == "torch":
        torch = _torch()
        if result.dtype == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    if result.framework == "jax":
        import jax.numpy as jnp

        return jnp.asarray(array)
    return array


def in_framework_of(operand: Operand, template: Operand) -> Any:
    """``operand``'s own memory as an object of ``template``'s framework (zero-copy): an
    input an op hands back as one of its results (MHCPostBwdOp's ``grad_x_res``), which
    must come back in the framework of the first argument, as its other results do; the
    object itself where that framework has no zero-copy view of it."""
    if operand.framework == template.framework:
        return operand.obj
    host = operand.host
    if host is not None and template.framework == "torch" and not _torch_can_view(host):
        return operand.obj  # (no zero-copy torch tensor of it: the caller's own object)
    if operand.is_cuda:
        if template.framework == "torch":
            return _torch().from_dlpack(as_cupy(operand))
        return to_caller(_from_cupy(as_cupy(operand), template.framework))
    return to_caller(dataclasses.replace(operand, obj=None, framework=template.framework))


def _torch_can_view(array: np.ndarray) -> bool:
    """Whether ``torch.from_numpy`` takes ``array`` as it is: writable, in native byte
    order, with no negative stride."""
    return array.flags.writeable and array.dtype.isnative and min(array.strides, default=0) >= 0


def numpy_dtype(name: str) -> np.dtype:
    return _BF16 if name == "bfloat16" else np.dtype(name)


# --------------------------------------------------------------------------- CUDA runtime

_cupy_state: dict[str, Any] = {}
_cupy_lock = ForkSafeLock()


def cupy():
    """The cupy module, imported on first use; NoCudaError when it cannot run here."""
    module = _cupy_state.get("module")
    if module is not None:
        return module
    with _cupy_lock:
        if "module" not in _cupy_state:
            try:
                import cupy as module

                module.cuda.runtime.getDeviceCount()
            except Exception as error:  # ImportError, no driver, no device
                raise NoCudaError(
                    "CUDA kernels need CuPy with a working driver and device "
                    "(pip install 'tileops-cupy[cuda13]'); "
                    f"here: {type(error).__name__}: {error}"
                ) from error
            _cupy_state["module"] = module
    return _cupy_state["module"]


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one device."""
    try:
        return cupy().cuda.runtime.getDeviceCount() > 0
    except NoCudaError:
        return False


def stream_handle(template: Operand) -> int:
    """Raw handle of the stream the caller's framework would run on now, on the
    template's device: ``torch.cuda.current_stream(device)`` for torch, CuPy's current
    stream for everything else."""
    if template.framework == "torch":
        torch = _torch()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return raw(template.device)
        return torch.cuda.current_stream(template.device).cuda_stream
    cp = cupy()
    with cp.cuda.Device(template.device):
        return cp.cuda.get_current_stream().ptr


def cupy_stream(handle: int, device: int) -> Any:
    """A CuPy stream object for a raw stream ``handle`` (for CuPy allocations and copies
    that must be ordered on the caller's stream; launches take the raw handle)."""
    # Stream.from_external wants an object with __cuda_stream__; from torch we hold a raw
    # handle, which is what ExternalStream (deprecated in CuPy 14, still supported) takes.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy().cuda.ExternalStream(handle, device)


def _torch():
    import torch

    return torch


# --------------------------------------------------------------------------- place selection

BUILTIN = "builtin"
"""``target=BUILTIN``: this package's own kernels, placed where the data lives (as None)."""

TARGETS = (None, BUILTIN, "cuda", "cpu")


def select_place(target: str | None, operands: dict[str, Operand]) -> str:
    """'cuda' or 'cpu' for a call: where all ``operands`` live, checked against ``target``.

    Raises ValueError when the operands live in different places or devices, or when
    ``target`` names another place than the data (never a silent copy).
    """
    items = list(operands.items())
    first_name, first = items[0]
    for name, operand in items[1:]:
        if operand.device != first.device:
            raise ValueError(
                f"{name} is on {_where(operand)} but {first_name} is on {_where(first)}; "
                "all inputs must be on the same device"
            )
    place = first.place
    if target in ("cuda", "cpu") and target != place:
        raise ValueError(
            f"target={target!r} but {first_name} is on {_where(first)}; move the data "
            f"or use target=None (no implicit copies between host and device)"
        )
    if place == "cuda":
        cupy()  # NoCudaError with the reason when CuPy cannot run here
    return place


def _where(operand: Operand) -> str:
    return "the host" if operand.device is None else f"cuda:{operand.device}"
