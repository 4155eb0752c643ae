"""Argument validation for every op: one home for the checks the public modules share.

Each check raises ValueError or TypeError naming the argument, what was expected and what
came, and returns the value in the form the op keeps. Checks run before anything is
written: an op validates every argument, then picks the place, then launches.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from . import _torch_ops as torch_ops
from ._arrays import (
    FLOAT_DTYPES,
    TARGETS,
    Operand,
    as_operand,
    contiguous,
    overlapping,
    self_overlapping,
)

MAX_POSITIONS = 1 << 24  # the accuracy contract is stated for positions below 2**24


# --------------------------------------------------------------------------- scalars


FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_real(
    name: str, value: Any, *, integer: bool = False, positive: bool = False, float32: bool = False
) -> float | int:
    """``value`` as a float (an int for ``integer``), refused unless it is a finite number
    (and > 0 for ``positive``; within float32's range for ``float32``: a scalar that the
    kernels and the host path take in float32 arithmetic, where a larger one would become
    inf). Strings and bools are refused by type, so a wrong type fails at construction with
    the parameter's name, not deep inside the first call."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        expected = "an int" if integer else "an int or a float"
        raise TypeError(f"{name} must be a number ({expected}), got {value!r}")
    number = int(value) if integer else float(value)
    if not (integer or math.isfinite(number)) or (positive and number <= 0):
        bound = " and > 0" if positive else ""
        raise ValueError(f"{name} must be finite{bound}, got {value!r}")
    if float32 and abs(number) > FLOAT32_MAX:
        raise ValueError(
            f"{name} must lie within float32's range (|{name}| <= {FLOAT32_MAX:.8g}: the "
            f"arithmetic is float32), got {value!r}"
        )
    return number


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int, NumPy's included; a bool is not, though Python counts it
    one."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int_type(name: str, value: Any, expected: str) -> None:
    """TypeError naming ``name`` unless ``value`` is an int (:func:`is_int`); ``expected``
    says what was wanted."""
    if not is_int(value):
        raise TypeError(f"{name} must be {expected}, got {value!r}")


def check_positive_int(name: str, value: Any, *, even: bool = False) -> int:
    """A positive int (numpy ints included; another type, a bool too, is a TypeError), even
    when ``even``."""
    check_int_type(name, value, "a positive int")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if even and value % 2:
        raise ValueError(f"{name} must be even, got {value}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """A bool (NumPy's included, as NumPy ints are ints), refused as TypeError otherwise: an
    int or a string would read as true."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_target(target: Any) -> str | None:
    """An op's ``target``: None/BUILTIN (where the data lives), "cuda" or "cpu"."""
    if target not in TARGETS:
        raise ValueError(f"target must be None, BUILTIN, 'cuda' or 'cpu', got {target!r}")
    return target


def check_rotary_dim(rotary_dim: int | None) -> int | None:
    if rotary_dim is None:
        return None
    expected = "a positive even int or None"
    check_int_type("rotary_dim", rotary_dim, expected)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be {expected}, got {rotary_dim!r}")
    return int(rotary_dim)


def check_max_position(max_position: int) -> int:
    check_int_type("max_position", max_position, "an int in [1, 2**24]")
    if not 0 < max_position <= MAX_POSITIONS:
        raise ValueError(
            f"max_position must be an int in [1, 2**24] (the range the accuracy contract "
            f"covers), got {max_position!r}"
        )
    return int(max_position)


def check_head_dim_rotary_dim(name: str, head_dim: int, rotary_dim: int | None) -> int:
    """The rotary_dim a call on heads of ``head_dim`` (``name``'s last dim) uses."""
    if head_dim % 2 or head_dim == 0:
        raise ValueError(f"head_dim ({name}.shape[-1]) must be even and positive, got {head_dim}")
    if rotary_dim is None:
        return head_dim
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be <= head_dim = {head_dim}, got {rotary_dim}")
    return rotary_dim


def check_host_positions(name: str, positions: np.ndarray, limit: int) -> None:
    """Every position of a host array in ``[0, limit)`` (int64 compared as int64)."""
    if positions.size == 0:
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= limit:
        bad = positions[(positions < 0) | (positions >= limit)]
        raise ValueError(
            f"{name} must lie in [0, {limit}); got {bad.size} out of range, e.g. {int(bad[0])}"
        )


def check_position_ids(name: str, ids: Operand, shape: tuple[int, ...], layout: str) -> Operand:
    """``ids``, per-token positions, checked: int32 or int64 (read natively, never
    narrowed) of ``shape`` (``layout`` names it, e.g. "[B, T]"). Values are the caller's to
    check: on the host with :func:`check_host_positions`, on a device by the kernel."""
    if ids.dtype not in ("int32", "int64"):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {ids.dtype}")
    if ids.shape != tuple(shape):
        raise ValueError(
            f"{name} must have shape {layout} = {tuple(shape)}, one position per token, "
            f"got {ids.shape}"
        )
    return ids


def is_dense(operand: Operand) -> bool:
    """True when ``operand`` is laid out C-contiguously (dims of size 1 may have any stride):
    what a kernel reading element ``i`` at ``ptr + i`` needs."""
    expected = 1
    for size, stride in zip(reversed(operand.shape), reversed(operand.strides), strict=True):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


# --------------------------------------------------------------------------- arrays


def check_mrope_section(section: Any, rotary_dim: int) -> tuple[int, int, int] | None:
    """MRoPE's (temporal, height, width) frequency counts: three non-negative ints summing to
    rotary_dim/2 (None: no MRoPE)."""
    if section is None:
        return None
    sequence = isinstance(section, (tuple, list)) or np.ndim(section) == 1
    values = tuple(section) if sequence and not isinstance(section, (str, bytes)) else None
    if (
        values is None
        or len(values) != 3
        or not all(is_int(v) for v in values)
        or any(v < 0 for v in values)
        or sum(values) != rotary_dim // 2
    ):
        raise ValueError(
            f"mrope_section must be 3 non-negative ints (temporal, height, width) summing to "
            f"rotary_dim/2 = {rotary_dim // 2}, got {section!r}"
        )
    return tuple(int(v) for v in values)


def cos_sin_cache_width(cache: Any, head_size: int) -> int:
    """The rotary_dim of a caller's cos/sin table: the width of its ``[max_position,
    rotary_dim]`` shape, even and in ``[2, head_size]``. Reads the shape alone (any array,
    or a tensor whose sizes are symbolic under ``torch.export``)."""
    shape = tuple(getattr(cache, "shape", ()))
    if len(shape) != 2 or shape[1] < 2 or shape[1] % 2 or shape[1] > head_size:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim] with rotary_dim even and in "
            f"[2, head_size = {head_size}], got shape {shape if shape else type(cache).__name__}"
        )
    return shape[1]


def check_cos_sin_cache(cache: Operand, head_dim: int) -> Operand:
    """A caller's cos/sin table: float32 ``[max_position, rotary_dim]`` with at least one
    row, C-contiguous (the kernel reads row ``p`` at ``p * rotary_dim``), rotary_dim as
    :func:`cos_sin_cache_width` takes it."""
    if cache.dtype != "float32":
        raise TypeError(f"cos_sin_cache must be float32, got {cache.dtype}")
    width = cos_sin_cache_width(cache, head_dim)
    if cache.shape[0] < 1:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim] with max_position >= 1, "
            f"got shape {cache.shape}"
        )
    if cache.strides[1] != 1 or (cache.shape[0] > 1 and cache.strides[0] != width):
        raise ValueError(
            f"cos_sin_cache must be contiguous (strides ({width}, 1)), got strides "
            f"{cache.strides}; pass cos_sin_cache.contiguous()"
        )
    return cache


def check_float_dtype(operand: Operand, name: str) -> None:
    """A float dtype the rotation takes: float16, bfloat16 or float32 anywhere, float64 on
    the host only (TypeError naming ``name``)."""
    if operand.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {operand.dtype}"
        )
    if operand.is_cuda and operand.dtype == "float64":
        raise TypeError(f"{name} is float64 on a CUDA device; float64 runs on the host path only")


def check_float_layout(operand: Operand, name: str, *, in_place: bool = False) -> None:
    """The checks of :func:`check_float_operand` that need no memory: a float dtype (float64
    on the host only); written in place, a contiguous last dimension and not a JAX array
    (which cannot change)."""
    if in_place and operand.framework == "jax":
        raise TypeError(
            f"{name} is a JAX array, which cannot change in place; use an out-of-place call "
            "(apply_rope, apply_rope_with_cos_sin_cache, the seed ops), which returns copies"
        )
    check_float_dtype(operand, name)
    if in_place and not operand.last_dim_contiguous:
        raise ValueError(
            f"{name} must have a contiguous last dimension to be rotated in place, "
            f"got strides {operand.strides}"
        )


def with_contiguous_last_dim(operand: Operand, template: Operand | None = None) -> Operand:
    """``operand``, or where its last dimension is strided a copy made once (on
    ``template``'s stream: see contiguous), for a read-only input."""
    return operand if operand.last_dim_contiguous else contiguous(operand, template)


def check_float_operand(
    obj: Any, name: str, *, in_place: bool = False, template: Operand | None = None
) -> Operand:
    """``obj`` as a float Operand (float64 on the host only) whose last dimension is
    contiguous: a read-only input with a strided last dimension is copied once; an operand
    written in place must already be so (and not a JAX array, which cannot change)."""
    operand = as_operand(obj, name)
    check_float_layout(operand, name, in_place=in_place)
    return with_contiguous_last_dim(operand, template)


def check_ndim(operand: Operand, name: str, ndim: int, layout: str) -> None:
    if operand.ndim != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D {layout}, got {operand.ndim}-D shape {operand.shape}"
        )


def check_dtype(operand: Operand, name: str, allowed: tuple[str, ...]) -> None:
    """TypeError naming ``name`` unless ``operand`` has one of the ``allowed`` dtypes (a
    dtype error is a TypeError throughout the package, as for the RoPE ops)."""
    if operand.dtype not in allowed:
        raise TypeError(f"{name} must be {' or '.join(allowed)}, got {operand.dtype}")


def check_in_place(operands: dict[str, Operand], read: dict[str, Operand] | None = None) -> None:
    """Refuse, before anything is written, operands that an in-place call cannot write
    each element of exactly once, or may not write: read-only memory, a torch inference
    tensor outside inference mode (torch forbids writing it), an operand that addresses an
    element twice (:func:`self_overlapping`), or two operands that share memory
    (:func:`overlapping`); and any of the call's ``read`` operands (positions, tables,
    weights) that shares memory with one it writes: the call would read it after writing
    it (the host rotates q before k; on a device the two race). Raises ValueError naming
    the argument(s)."""
    items = list(operands.items())
    for name, operand in items:
        if operand.framework == "torch" and torch_ops.inference_writes_refused(operand.obj):
            raise ValueError(torch_ops.inference_write_message(name))
        if operand.host is not None and not operand.host.flags.writeable:
            raise ValueError(
                f"{name} is read-only (a {operand.framework} array with writeable=False); "
                "expected writable memory, since this call writes into it"
            )
        if self_overlapping(operand):
            raise ValueError(
                f"{name} addresses some elements more than once (shape {operand.shape}, "
                f"element strides {operand.strides}: e.g. an expanded dim of stride 0); "
                "expected each element stored once, since this call writes into it: pass "
                "a copy (.contiguous(), numpy.ascontiguousarray)"
            )
    for i, (name_a, a) in enumerate(items):
        for name_b, b in items[i + 1 :]:
            if overlapping(a, b):
                raise ValueError(
                    f"{name_a} and {name_b} overlap in memory ({name_a}: shape {a.shape}, "
                    f"strides {a.strides}; {name_b}: shape {b.shape}, strides {b.strides}); "
                    "expected disjoint memory, since this call writes into both (e.g. "
                    "disjoint slices of one fused QKV buffer)"
                )
    for read_name, operand in (read or {}).items():
        for name, written in items:
            if overlapping(operand, written):
                raise ValueError(
                    f"{read_name} overlaps {name} in memory, which this call writes; expected "
                    f"{read_name} apart from the data this call writes"
                )
