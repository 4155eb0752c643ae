"""Rotary frequency schemes: float64 inverse frequencies and the amplitude of cos/sin.

A scheme is a frozen dataclass, so it doubles as the key of the shared cos/sin tables:
two ops (or two layers) built with equal schemes and rotary_dim share one table.

Every scheme answers two questions for a rotary dim ``d`` (pairs ``j = 0 .. d/2-1``):
``inv_freq(d)``, the angle per position of each pair in float64, and ``amplitude(d)``,
the factor ``a`` that multiplies both cos and sin (1 except for YaRN and LongRoPE).

Example::

    >>> from tileops_cupy.schemes import Llama31
    >>> Llama31().inv_freq(128).shape
    (64,)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import ml_dtypes
import numpy as np

from ._validate import check_real

__all__ = ["Standard", "Llama31", "YaRN", "LongRoPE", "Scheme", "scheme_args", "scheme_from_args"]


@dataclass(frozen=True)
class _Numbers:
    """Base of the schemes: every number field checked by its declared type (an int field
    takes ints, a float field any real; both > 0 and finite) and stored in that type."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type in ("int", "float"):
                value = check_real(
                    f.name, getattr(self, f.name), integer=f.type == "int", positive=True
                )
                if f.type == "int" and value > 2**53:  # (scheme_args carries it as a float)
                    raise ValueError(
                        f"{f.name} must be at most 2**53, got an int of {value.bit_length()} bits"
                    )
                object.__setattr__(self, f.name, value)


def _base_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    return base**-exponents


@dataclass(frozen=True)
class Standard(_Numbers):
    """``inv[j] = base ** (-2j/d)``, amplitude 1 (GPT-NeoX, RoFormer, Llama 2)."""

    base: float = 10000.0

    def inv_freq(self, rotary_dim: int) -> np.ndarray:
        return _base_inv_freq(self.base, rotary_dim)

    def amplitude(self, rotary_dim: int) -> float:
        return 1.0


@dataclass(frozen=True)
class Llama31(_Numbers):
    """Llama 3.1 piecewise scaling: long wavelengths divided by ``scale_factor``, short ones
    kept, a linear blend in between (HF ``rope_type="llama3"``). Amplitude 1."""

    base: float = 10000.0
    scale_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "high_freq_factor must be greater than low_freq_factor, got "
                f"high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}"
            )

    def inv_freq(self, rotary_dim: int) -> np.ndarray:
        inv0 = _base_inv_freq(self.base, rotary_dim)
        wavelength = 2 * math.pi / inv0
        context = float(self.original_max_position)
        blend = (context / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        medium = (1 - blend) * inv0 / self.scale_factor + blend * inv0
        inv = np.where(
            wavelength > context / self.low_freq_factor, inv0 / self.scale_factor, medium
        )
        return np.where(wavelength < context / self.high_freq_factor, inv0, inv)

    def amplitude(self, rotary_dim: int) -> float:
        return 1.0


@dataclass(frozen=True)
class YaRN(_Numbers):
    """YaRN ramp between interpolated and extrapolated frequencies, with the attention
    (mscale) amplitude, as vLLM's ``YaRNScalingRotaryEmbedding`` and HF ``rope_type="yarn"``.

    ``attn_factor`` multiplies that amplitude, ``(0.1*ln(scale) + 1) * attn_factor``, as
    vLLM's argument of that name does. HF's ``attention_factor`` replaces it instead: to
    match a config that sets one, pass ``attn_factor = attention_factor / (0.1*ln(scale) +
    1)`` (scale > 1). HF's ``mscale``/``mscale_all_dim`` and ``truncate=False`` have no
    counterpart here (SPEC section 1).

    TileOPs' own YaRN kernel drifted from this reference (``scale*base`` powers, a half-width
    correction range, no mscale; ~78% off at position 16000): we follow vLLM/HF.
    """

    base: float = 10000.0
    scale: float = 16.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0

    def _correction_dim(self, rotations: float, rotary_dim: int) -> float:
        return (rotary_dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(self.base)
        )

    def inv_freq(self, rotary_dim: int) -> np.ndarray:
        inv0 = _base_inv_freq(self.base, rotary_dim)
        low = max(math.floor(self._correction_dim(self.beta_fast, rotary_dim)), 0)
        high = min(math.ceil(self._correction_dim(self.beta_slow, rotary_dim)), rotary_dim - 1)
        if low == high:
            high += 0.001  # keeps the ramp finite, as the reference does
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation_weight = 1 - ramp
        return (inv0 / self.scale) * (1 - extrapolation_weight) + inv0 * extrapolation_weight

    def amplitude(self, rotary_dim: int) -> float:
        mscale = 0.1 * math.log(self.scale) + 1.0 if self.scale > 1 else 1.0
        return mscale * self.attn_factor


@dataclass(frozen=True)
class LongRoPE(_Numbers):
    """Per-pair rescaled frequencies ``inv0 / rescale_factors`` with the amplitude
    ``sqrt(1 + ln(s)/ln(original))``, ``s = max/original`` (HF ``rope_type="longrope"``).

    ``rescale_factors`` is anything numpy can read as ``[rotary_dim/2]`` floats (list, numpy,
    a host tensor); None means all ones. Zero, NaN or infinite factors raise ValueError.
    """

    base: float = 10000.0
    rescale_factors: tuple[float, ...] | None = field(default=None)
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            self.max_position_embeddings > self.original_max_position_embeddings
            and self.original_max_position_embeddings <= 1
        ):
            raise ValueError(
                "original_max_position_embeddings must be > 1 when max_position_embeddings "
                "exceeds it (the amplitude divides by its logarithm), got "
                f"original_max_position_embeddings={self.original_max_position_embeddings!r}"
            )
        if self.rescale_factors is not None:
            factors = _factors(self.rescale_factors)
            bad = ~np.isfinite(factors) | (factors == 0)
            if bad.any():
                raise ValueError(
                    "rescale_factors must be finite and non-zero (the frequency divides by them), "
                    f"got {factors[bad][:4].tolist()} at index {np.flatnonzero(bad)[:4].tolist()}"
                )
            object.__setattr__(self, "rescale_factors", tuple(factors.tolist()))

    def inv_freq(self, rotary_dim: int) -> np.ndarray:
        inv0 = _base_inv_freq(self.base, rotary_dim)
        if self.rescale_factors is None:
            return inv0
        if len(self.rescale_factors) != rotary_dim // 2:
            raise ValueError(
                f"rescale_factors must have rotary_dim/2 = {rotary_dim // 2} entries, "
                f"got {len(self.rescale_factors)}"
            )
        return inv0 / np.asarray(self.rescale_factors, dtype=np.float64)

    def amplitude(self, rotary_dim: int) -> float:
        ratio = self.max_position_embeddings / self.original_max_position_embeddings
        if ratio <= 1:
            return 1.0
        return math.sqrt(1 + math.log(ratio) / math.log(self.original_max_position_embeddings))


def _host_values(values):
    """Factors given as a torch/CuPy tensor are read through DLPack-free host conversion."""
    if hasattr(values, "detach"):  # torch, possibly on a GPU
        return values.detach().double().cpu().numpy()
    if hasattr(values, "get"):  # cupy
        return values.get()
    return values


def _factors(values) -> np.ndarray:
    """LongRoPE's ``rescale_factors`` as float64 of shape ``[rotary_dim/2]``: real numbers
    only (no strings, no bools), one dimension (a [2, 4] array is not 8 factors)."""
    try:
        array = np.asarray(_host_values(values))
    except (TypeError, ValueError):  # ragged nesting
        array = np.asarray(None)
    if array.dtype == np.dtype(ml_dtypes.bfloat16):  # (NumPy counts it no float)
        array = array.astype(np.float64)
    if isinstance(values, (str, bytes)) or array.dtype.kind not in "iuf":
        raise TypeError(
            "rescale_factors must be real numbers (a list, a NumPy array or a tensor of "
            f"shape [rotary_dim/2]), got {values!r:.80}"
        )
    if array.ndim != 1:
        raise ValueError(
            f"rescale_factors must have one dimension, shape [rotary_dim/2], got shape "
            f"{array.shape}"
        )
    return array.astype(np.float64)


Scheme = Standard | Llama31 | YaRN | LongRoPE

_SCHEMES = {cls.__name__: cls for cls in (Standard, Llama31, YaRN, LongRoPE)}


def scheme_args(scheme: Scheme) -> tuple[str, tuple[float, ...]]:
    """``(name, numbers)`` that rebuild ``scheme`` through :func:`scheme_from_args`: the
    form a torch custom op can carry in its schema (``str``, ``float[]``), so a traced or
    exported graph names its scheme by value. LongRoPE's factors follow its scalars."""
    scalars = [f.name for f in fields(scheme) if f.name != "rescale_factors"]
    numbers = tuple(float(getattr(scheme, name)) for name in scalars)
    if isinstance(scheme, LongRoPE) and scheme.rescale_factors is not None:
        numbers += scheme.rescale_factors
    return type(scheme).__name__, numbers


def scheme_from_args(name: str, numbers: tuple[float, ...]) -> Scheme:
    """The scheme :func:`scheme_args` described (equal to the original, so the same table)."""
    cls = _SCHEMES[name]
    scalars = [f for f in fields(cls) if f.name != "rescale_factors"]
    values = dict(zip((f.name for f in scalars), numbers, strict=False))
    for f in scalars:  # integer fields travel as floats
        if f.type == "int":
            values[f.name] = int(values[f.name])
    if cls is LongRoPE and len(numbers) > len(scalars):
        values["rescale_factors"] = tuple(numbers[len(scalars) :])
    return cls(**values)
