"""Float64 numpy oracle for the RoPE ops, and the helpers the RoPE tests share.

Written from ``SPEC.md`` sections 1, 2 and 5 alone: nothing here imports
``tileops_cupy.schemes`` or the tables, so a wrong formula in the package cannot hide by
being copied into the oracle (``test_schemes.py`` also checks these formulas against
``transformers``).

Three parts:

- frequencies: ``inv_freq`` and the amplitude ``a`` of every scheme, in float64;
- :func:`rope_reference`: the rotation of SPEC 2 in float64 (columns past rotary_dim copied);
  :func:`rms_norm_reference`: the fused QK-RMSNorm of SPEC 9 that may precede it;
- :func:`contract_tolerance` / :func:`assert_matches_oracle`: SPEC 5 as an element-wise
  bound, and a comparison that reports the worst element when it fails; the bounds on
  ``Bwd(Fwd(x))`` derived from it (:func:`roundtrip_tolerance`, and the tighter
  :func:`working_precision_roundtrip_tolerance` for float32/float64 data).

Plus the case table (:data:`SEQUENCE_OPS`) and the array helpers (random data in a dtype,
moving it into a framework, reading any result back as float64 or as raw bytes) that the
RoPE and component tests share, in every place (``_cases.py`` says which).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
HOST_DTYPES = ("float16", "bfloat16", "float32", "float64")
DEVICE_DTYPES = ("float16", "bfloat16", "float32")

# --------------------------------------------------------------------------- frequencies


@dataclass(frozen=True)
class Frequencies:
    """``inv_freq[j]`` (float64, ``[rotary_dim/2]``) and the amplitude ``a`` on cos and sin."""

    inv_freq: np.ndarray
    amplitude: float

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


def base_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    """SPEC 1: ``inv0[j] = base ** (-2j/d)``, j = 0 .. d/2-1."""
    j = np.arange(rotary_dim // 2, dtype=np.float64)
    return np.power(np.float64(base), -2.0 * j / rotary_dim)


def standard_frequencies(rotary_dim: int, base: float = 10000.0) -> Frequencies:
    return Frequencies(base_inv_freq(base, rotary_dim), 1.0)


def llama31_frequencies(
    rotary_dim: int,
    base: float = 10000.0,
    scale_factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> Frequencies:
    """SPEC 1 Llama31, pair by pair (a loop on purpose: a different shape of code than the
    package's vectorised ``np.where``)."""
    inv0 = base_inv_freq(base, rotary_dim)
    context = float(original_max_position)
    inv = np.empty_like(inv0)
    for j, f in enumerate(inv0):
        wavelength = 2 * math.pi / f
        if wavelength < context / high_freq_factor:
            inv[j] = f
        elif wavelength > context / low_freq_factor:
            inv[j] = f / scale_factor
        else:
            s = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            inv[j] = (1 - s) * f / scale_factor + s * f
    return Frequencies(inv, 1.0)


def yarn_frequencies(
    rotary_dim: int,
    base: float = 10000.0,
    scale: float = 16.0,
    original_max_position: int = 4096,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attn_factor: float = 1.0,
) -> Frequencies:
    """SPEC 1 YaRN (vLLM ``YaRNScalingRotaryEmbedding`` / HF ``yarn``)."""
    d = rotary_dim
    inv0 = base_inv_freq(base, d)

    def correction_dim(rotations: float) -> float:
        wavelengths = original_max_position / (2 * math.pi * rotations)
        return d * math.log(wavelengths) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    w = 1.0 - ramp
    inv = (inv0 / scale) * (1.0 - w) + inv0 * w
    mscale = 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0
    return Frequencies(inv, mscale * attn_factor)


def longrope_frequencies(
    rotary_dim: int,
    base: float = 10000.0,
    rescale_factors: Any = None,
    max_position_embeddings: int = 4096,
    original_max_position_embeddings: int = 4096,
) -> Frequencies:
    """SPEC 1 LongRoPE: ``inv0 / rescale_factors``, ``a = sqrt(1 + ln(s)/ln(original))``."""
    inv0 = base_inv_freq(base, rotary_dim)
    factors = (
        np.ones_like(inv0)
        if rescale_factors is None
        else np.asarray(rescale_factors, dtype=np.float64).reshape(-1)
    )
    s = max_position_embeddings / original_max_position_embeddings
    amplitude = 1.0
    if s > 1:
        amplitude = math.sqrt(1 + math.log(s) / math.log(original_max_position_embeddings))
    return Frequencies(inv0 / factors, amplitude)


# --------------------------------------------------------------------------- rotation


def pair_columns(rotary_dim: int, neox: bool) -> tuple[np.ndarray, np.ndarray]:
    """Column indices of the two members of each pair: neox ``(j, j+d/2)``, interleaved
    ``(2j, 2j+1)``."""
    half = rotary_dim // 2
    if neox:
        first = np.arange(half)
        return first, first + half
    first = np.arange(0, rotary_dim, 2)
    return first, first + 1


def rope_reference(
    x64: np.ndarray,
    positions: Any,
    frequencies: Frequencies,
    *,
    neox: bool = True,
    inverse: bool = False,
    per_pair: bool = False,
) -> np.ndarray:
    """SPEC 2 in float64: ``y1 = x1*cos - x2*sin``, ``y2 = x2*cos + x1*sin`` with
    ``cos = a*cos(p*inv)``, ``sin = a*sin(p*inv)`` (sin negated for the inverse rotation);
    columns at or past rotary_dim copied.

    ``x64``: ``[..., head_dim]`` float64. ``positions``: integers broadcastable against
    ``x64.shape[:-1]`` (the position of each head row), or with ``per_pair`` against
    ``x64.shape[:-1] + (rotary_dim/2,)`` (a position per pair: MRoPE, see
    :func:`mrope_pair_positions`).
    """
    positions = np.asarray(positions, dtype=np.float64)
    theta = (positions if per_pair else positions[..., None]) * frequencies.inv_freq
    cos = frequencies.amplitude * np.cos(theta)
    sin = frequencies.amplitude * np.sin(theta)
    return rotate_reference(x64, cos, sin, neox=neox, inverse=inverse)


def rotate_reference(
    x64: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, neox: bool = True, inverse: bool = False
) -> np.ndarray:
    """The rotation of SPEC 2 in float64 with given ``cos``, ``sin`` (broadcastable against
    ``x64.shape[:-1] + (rotary_dim/2,)``; rotary_dim = 2 * their last dim)."""
    rotary_dim = 2 * np.shape(cos)[-1]
    assert rotary_dim <= x64.shape[-1]
    sin = -np.asarray(sin) if inverse else np.asarray(sin)
    first, second = pair_columns(rotary_dim, neox)
    x1, x2 = x64[..., first], x64[..., second]
    y = np.array(x64, dtype=np.float64, copy=True)
    y[..., first] = x1 * cos - x2 * sin
    y[..., second] = x2 * cos + x1 * sin
    return y


# MRoPE sections by pairs (rotary_dim / 2), of each kind the plan tells apart: "mrope",
# boundaries on the boundaries of the whole-row kernel's 16-byte lanes (4 pairs of 16-bit
# rows, 2 of float32: one position row a lane, as Qwen2-VL's (16, 24, 24); the sectioned
# MRoPE it takes, tileops_cupy._rotate._packs_table); "mrope-split", boundaries that split a
# lane's pairs between rows; and "mrope-interleaved", Qwen3-VL's interleaved rows (sections
# (t, h, w), pair j's row by j % 3; at D128 they group, which the whole-row kernel takes)
MROPE_SECTIONS = {
    32: {"mrope": (8, 12, 12), "mrope-split": (9, 11, 12), "mrope-interleaved": (12, 10, 10)},
    64: {"mrope": (16, 24, 24), "mrope-split": (17, 23, 24), "mrope-interleaved": (24, 20, 20)},
}


def mrope_pair_positions(
    positions: np.ndarray, section: tuple[int, int, int], interleaved: bool
) -> np.ndarray:
    """MRoPE: the position of each frequency pair, ``positions.shape[1:] + (sum(section),)``,
    from ``positions`` ``[3, ...]`` (temporal, height, width), as HF builds its frequencies:
    sectioned (``Qwen2VLRotaryEmbedding``) concatenates block i of the sections from row
    i; interleaved (``Qwen3VLTextRotaryEmbedding``) starts from row 0 and overwrites pairs
    1, 4, 7, ... below 3*h with row 1 and pairs 2, 5, 8, ... below 3*w with row 2."""
    rows = np.asarray(positions)[..., None]
    pairs = sum(section)
    per_row = np.broadcast_to(rows, (*rows.shape[:-1], pairs))
    if not interleaved:
        blocks = np.split(np.arange(pairs), np.cumsum(section)[:2])
        return np.concatenate([per_row[i][..., block] for i, block in enumerate(blocks)], -1)
    out = per_row[0].copy()
    for row in (1, 2):
        out[..., row : 3 * section[row] : 3] = per_row[row][..., row : 3 * section[row] : 3]
    return out


def rms_norm_reference(
    x64: np.ndarray, weight: Any, eps: float, weight_offset: float = 0.0
) -> np.ndarray:
    """SPEC 9 fused QK-RMSNorm in float64, each row over its whole last dim (head_dim):
    ``x / sqrt(mean(x**2) + eps) * (weight + weight_offset)``."""
    x64 = np.asarray(x64, dtype=np.float64)
    weight64 = np.asarray(weight, dtype=np.float64) + weight_offset
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * weight64


def torch_norm_rope_reference(
    x: Any, weight: Any, eps: float, weight_offset: float, head_dim: int, positions: Any,
    frequencies: Frequencies, neox: bool,
) -> Any:  # fmt: skip
    """:func:`rms_norm_reference` then :func:`rope_reference` as float64 torch ops, which
    autograd differentiates: each head row of ``x`` (``[..., heads*head_dim]``) normalised,
    then its first rotary_dim columns rotated at ``positions`` (one per token), amplitude
    included. test_qknorm holds the two forms to the same numbers."""
    import torch

    inv_freq = torch.from_numpy(frequencies.inv_freq).to(x.device)
    theta = torch.as_tensor(positions, device=x.device).double()[..., None] * inv_freq
    amplitude = frequencies.amplitude
    cos, sin = (amplitude * theta.cos())[..., None, :], (amplitude * theta.sin())[..., None, :]
    first, second = pair_columns(frequencies.rotary_dim, neox)
    rows = x.double().unflatten(-1, (-1, head_dim))
    inverse_rms = torch.rsqrt(rows.square().mean(-1, keepdim=True) + eps)
    normed = rows * inverse_rms * (weight.double() + weight_offset)
    x1, x2 = normed[..., first], normed[..., second]
    y = normed.clone()
    y[..., first] = x1 * cos - x2 * sin
    y[..., second] = x2 * cos + x1 * sin
    return y.flatten(-2)


def sequence_positions(shape: tuple[int, ...], input_layout: str) -> np.ndarray:
    """Positions of the head rows of an ``x`` of ``shape``: the seq index, shaped to
    broadcast against ``shape[:-1]`` ("1d": ``[seq]``; "2d": ``[1, seq, 1]``)."""
    if input_layout == "1d":
        return np.arange(shape[0])
    return np.arange(shape[1]).reshape(1, shape[1], 1)


# --------------------------------------------------------------------------- SPEC 5 bound

FP32_CONTRACT = 4e-6
FP32_SUBNORMAL_SPACING = 2.0**-149  # (the float32 error floor below the smallest normal)
"""SPEC 5: fp32 outputs within ``4e-6 * max|x|`` of float64, at any position < 2**24."""

FP64_PER_RADIAN = 2.0**-44
"""float64 data has no bound in SPEC 5. Both the op and the oracle form each angle
``p*inv`` in float64, so each may be off by about ``2**-53 * p*inv`` radians (and by a few
float64 ulps elsewhere). We allow ``2**-44 * (1 + max angle) * a * max|x|``: 512 times
that, yet ~2000 times tighter than anything a float32 intermediate could reach."""

_MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}
_MIN_NORMAL_EXPONENT = {"float16": -14, "bfloat16": -126, "float32": -126, "float64": -1022}


def ulp(magnitude: Any, dtype: str) -> np.ndarray:
    """Spacing of ``dtype`` values at ``|magnitude|`` (float64): ``2**(e - mantissa_bits)``
    with ``2**e <= |m| < 2**(e+1)``; the subnormal spacing below the smallest normal."""
    m = np.abs(np.asarray(magnitude, dtype=np.float64))
    _, e = np.frexp(m)  # m = f * 2**e with f in [0.5, 1), so floor(log2 m) = e - 1
    exponent = np.maximum(e - 1, _MIN_NORMAL_EXPONENT[dtype])
    exponent = np.where(m > 0, exponent, _MIN_NORMAL_EXPONENT[dtype])
    return np.ldexp(1.0, exponent - _MANTISSA_BITS[dtype])


def contract_tolerance(
    y64: np.ndarray, x64: np.ndarray, dtype: str, amplitude: float = 1.0, max_angle: float = 0.0
) -> np.ndarray:
    """Element-wise bound on ``|y - y64|`` for an op output ``y`` in ``dtype`` (SPEC 5).

    - float32: ``4e-6 * max|x|`` (the contract, taken literally: max over the whole input),
      but never below float32's own spacing at the bottom of its range, 2**-149: a float32
      computation on data below 2**-126 errs by up to that much (two roundings of half of it:
      a product, then a sum), however exact its method.
    - float16 / bfloat16, "within one unit of the output dtype at the data's scale": the op
      computes in float32 (within ``e = 4e-6 * max|x|`` of float64, the float32 contract;
      this term also covers cancellation in ``x1*cos - x2*sin``, where the float32 error
      scales with ``|x|``, not ``|y|``) and rounds once to nearest, adding at most half a
      unit of the dtype at the magnitude of that float32 value, ``<= |y64| + e``. So
      ``|y - y64| <= ulp(|y64| + e)/2 + e``, which is at most one unit at ``|y64|`` (plus
      the float32 slack). Exact for subnormals too (``ulp`` floors at the subnormal spacing).
    - float64 (host only): see :data:`FP64_PER_RADIAN`.
    """
    scale = float(np.max(np.abs(x64), initial=0.0))
    if dtype == "float64":
        bound = FP64_PER_RADIAN * (1.0 + max_angle) * max(amplitude, 1.0) * scale
        return np.full(np.shape(y64), bound)
    e32 = max(FP32_CONTRACT * scale, FP32_SUBNORMAL_SPACING)
    if dtype == "float32":
        return np.full(np.shape(y64), e32)
    return 0.5 * ulp(np.abs(y64) + e32, dtype) + e32


def max_angle(positions: Any, frequencies: Frequencies) -> float:
    positions = np.asarray(positions)
    if positions.size == 0:
        return 0.0
    return float(np.max(np.abs(positions))) * float(np.max(np.abs(frequencies.inv_freq)))


def assert_matches_oracle(
    y: Any,
    x64: np.ndarray,
    positions: Any,
    frequencies: Frequencies,
    dtype: str,
    *,
    neox: bool = True,
    inverse: bool = False,
    per_pair: bool = False,
    what: str = "output",
    copied_tail: bool = True,
) -> np.ndarray:
    """Every element of ``y`` (any framework) within :func:`contract_tolerance` of the
    float64 oracle, no NaN/inf, and the columns past rotary_dim copied exactly (unless
    ``copied_tail`` is False: then they are held to the same bound). Returns ``y`` as
    float64. ``per_pair``: as in :func:`rope_reference`."""
    y64 = rope_reference(x64, positions, frequencies, neox=neox, inverse=inverse, per_pair=per_pair)
    angle = max_angle(positions, frequencies)
    return assert_matches_reference(
        y, y64, x64, frequencies.rotary_dim, dtype, frequencies.amplitude, angle, what,
        copied_tail,
    )  # fmt: skip


def assert_matches_reference(
    y: Any,
    y64: np.ndarray,
    x64: np.ndarray,
    rotary_dim: int,
    dtype: str,
    amplitude: float = 1.0,
    angle: float = 0.0,
    what: str = "output",
    copied_tail: bool = True,
) -> np.ndarray:
    """``y`` against a float64 rotation ``y64`` of ``x64`` (from :func:`rope_reference` or
    :func:`rotate_reference`): finite, columns past rotary_dim exact (or, without
    ``copied_tail``, held to the same bound as the rest), the rest within
    :func:`contract_tolerance`. Returns ``y`` as float64."""
    y = to_float64(y)
    assert y.shape == y64.shape, f"{what}: shape {y.shape}, expected {y64.shape}"
    assert np.isfinite(y).all(), f"{what}: {int((~np.isfinite(y)).sum())} non-finite elements"
    if copied_tail:
        np.testing.assert_array_equal(
            y[..., rotary_dim:], x64[..., rotary_dim:], err_msg=f"{what}: columns past rotary_dim"
        )
    tolerance = contract_tolerance(y64, x64, dtype, amplitude, angle)
    assert_within(y, y64, tolerance, what=f"{what} ({dtype}) vs the float64 oracle")
    return y


def assert_norm_rope_matches_oracle(
    y: Any,
    x64: np.ndarray,
    weight: Any,
    eps: float,
    weight_offset: float,
    positions: Any,
    frequencies: Frequencies,
    dtype: str,
    *,
    neox: bool = True,
    per_pair: bool = False,
    what: str = "output",
) -> np.ndarray:
    """Fused QK-RMSNorm + RoPE (SPEC 9): every element of ``y`` within
    :func:`contract_tolerance` of the float64 rotation of the float64 norm of ``x64``
    (``[..., head_dim]``): one rounding of a float32 result, so within one output unit at
    the normalised data's scale; the columns past rotary_dim normalised, not rotated.
    ``per_pair``: ``positions`` hold one position per pair (MRoPE), as
    :func:`assert_matches_oracle` takes them."""
    normed64 = rms_norm_reference(x64, weight, eps, weight_offset)
    return assert_matches_oracle(
        y, normed64, positions, frequencies, dtype, neox=neox, per_pair=per_pair, what=what,
        copied_tail=False,
    )  # fmt: skip


def assert_within(y: np.ndarray, expected: np.ndarray, tolerance: np.ndarray, what: str) -> None:
    """``|y - expected| <= tolerance`` element-wise; on failure, say how many elements and
    show the worst one (by error / tolerance)."""
    error = np.abs(y - expected)
    bad = ~(error <= tolerance)
    if bad.any():
        ratio = np.where(tolerance > 0, error / np.where(tolerance > 0, tolerance, 1), np.inf)
        worst = np.unravel_index(int(np.argmax(np.where(bad, ratio, -1))), y.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {y.size} elements beyond tolerance; worst at "
            f"{tuple(int(i) for i in worst)}: got {y[worst]!r}, expected {expected[worst]!r}, "
            f"error {error[worst]:.3g} > tolerance {tolerance[worst]:.3g}"
        )


def roundtrip_tolerance(
    z64: np.ndarray, x64: np.ndarray, dtype: str, amplitude: float, max_angle: float = 0.0
) -> np.ndarray:
    """Bound on ``|Bwd(Fwd(x)) - a*a*x|``. The forward output ``y`` errs by at most
    ``t_fwd = max(contract_tolerance)`` per element at its scale ``a*sqrt(2)*max|x|``; the
    exact backward maps a pair's error ``(e1, e2)`` to one of norm ``a*|(e1, e2)|
    <= a*sqrt(2)*t_fwd``; the backward op then adds its own contract error at ``z``'s
    scale (taken against ``y``'s scale, ``<= a*sqrt(2)*max|x|``)."""
    scale = float(np.max(np.abs(x64), initial=0.0))
    y_scale = np.full((1,), amplitude * math.sqrt(2) * scale)
    t_fwd = contract_tolerance(y_scale, x64, dtype, amplitude, max_angle).max()
    t_bwd = contract_tolerance(z64, y_scale, dtype, amplitude, max_angle)
    return amplitude * math.sqrt(2) * t_fwd + t_bwd


WORKING_PRECISION_ROUNDTRIP = {"float32": 2e-6, "float64": 2e-11}
"""Relative bound on ``|Bwd(Fwd(x)) - a*a*x|`` when ``x`` is float32 or float64 and both
rotations keep it in that dtype (the in-place component): two roundings of a rotation by at
most ``a*sqrt(2)*max|x|``, a few dozen units of the dtype at ``a*a*max|x|``."""


def working_precision_roundtrip_tolerance(x64: np.ndarray, dtype: str, amplitude: float) -> float:
    """:data:`WORKING_PRECISION_ROUNDTRIP` of ``a*a*max|x|``: tighter than
    :func:`roundtrip_tolerance`, which grants each op its whole SPEC 5 allowance (so holds for
    fp16/bf16 too)."""
    scale = amplitude**2 * float(np.max(np.abs(x64), initial=0.0))
    return WORKING_PRECISION_ROUNDTRIP[dtype] * scale


# --------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class SequenceOpCase:
    """One seed op whose positions are the seq index, with the oracle's frequencies.

    ``make(direction, input_layout, head_dim, rng, **extra)`` returns ``(op, frequencies,
    neox)``; LongRoPE draws its rescale factors from ``rng`` (they depend on head_dim).
    """

    name: str
    make: Callable[..., tuple[Any, Frequencies, bool]]


def _op_class(prefix: str, direction: str):
    from tileops_cupy import rope

    return getattr(rope, f"{prefix}{direction}Op")


def _standard(layout: str, base: float):
    def make(direction, input_layout, head_dim, rng, **extra):
        op = _op_class("RoPE", direction)(layout, input_layout, base, **extra)
        return op, standard_frequencies(head_dim, base), layout == "neox"

    return make


# The scheme parameters the seed-op cases (and the serving tests) use.
LLAMA31_PARAMS = dict(
    base=500000.0,
    scale_factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position=8192,
)
YARN_PARAMS = dict(
    base=10000.0,
    scale=16.0,
    original_max_position=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    attn_factor=0.9,
)
LONGROPE_PARAMS = dict(
    base=10000.0, max_position_embeddings=16384, original_max_position_embeddings=4096
)


def _llama31(direction, input_layout, head_dim, rng, **extra):
    op = _op_class("RoPELlama31", direction)(input_layout, **LLAMA31_PARAMS, **extra)
    return op, llama31_frequencies(head_dim, **LLAMA31_PARAMS), True


def _yarn(direction, input_layout, head_dim, rng, **extra):
    op = _op_class("YaRN", direction)(input_layout, **YARN_PARAMS, **extra)
    return op, yarn_frequencies(head_dim, **YARN_PARAMS), True


def _longrope(direction, input_layout, head_dim, rng, **extra):
    factors = rng.uniform(1.0, 8.0, head_dim // 2)
    op_class = _op_class("LongRoPE", direction)
    op = op_class(input_layout, rescale_factors=factors, **LONGROPE_PARAMS, **extra)
    return op, longrope_frequencies(head_dim, rescale_factors=factors, **LONGROPE_PARAMS), True


SEQUENCE_OPS = (
    SequenceOpCase("RoPE-neox", _standard("neox", 10000.0)),
    SequenceOpCase("RoPE-interleaved", _standard("interleaved", 10000.0)),
    SequenceOpCase("Llama31", _llama31),
    SequenceOpCase("YaRN", _yarn),
    SequenceOpCase("LongRoPE", _longrope),
)
SEQUENCE_OP_IDS = tuple(case.name for case in SEQUENCE_OPS)

# Shapes that cross the 1024-row boundary of the two-level tables, and head_dims the
# CUDA path compiles as constants (64, 128) or passes at run time (others).
SEQUENCE_SHAPES = {"1d": (1100, 64), "2d": (2, 1030, 3, 128)}

# --------------------------------------------------------------------------- arrays


def random_data(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Fresh standard-normal data at a random power-of-two scale (2**-4 .. 2**4), rounded to
    ``dtype`` (bfloat16 as ``ml_dtypes.bfloat16``)."""
    scale = 2.0 ** int(rng.integers(-4, 5))
    data = rng.standard_normal(shape) * scale
    return data.astype(numpy_dtype(dtype))


def random_position_ids(
    rng: np.random.Generator, tokens: int, max_position: int, dtype: Any
) -> np.ndarray:
    """Random ids in random order over ``[0, max_position)``, always including both ends."""
    ids = rng.integers(0, max_position, tokens)
    ids[rng.integers(tokens)] = max_position - 1
    ids[rng.integers(tokens)] = 0
    return ids.astype(dtype)


def numpy_dtype(dtype: str) -> np.dtype:
    return BF16 if dtype == "bfloat16" else np.dtype(dtype)


def to_framework(host: np.ndarray, framework: str) -> Any:
    """``host`` (numpy, any of our dtypes) as "numpy", "torch" (CPU), "torch-cuda" or
    "cupy"; bfloat16 moves as its bits."""
    if framework == "numpy":
        return host.copy()
    if framework.startswith("torch"):
        import torch

        if host.dtype == BF16:
            tensor = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(host.copy())
        return tensor.cuda() if framework == "torch-cuda" else tensor
    if framework == "cupy":
        import cupy as cp

        if host.dtype != BF16:
            return cp.asarray(host)
        try:
            return cp.asarray(host.view(np.uint16)).view(BF16)
        except (TypeError, ValueError):  # a CuPy without its own bfloat16: through torch
            return cp.from_dlpack(to_framework(host, "torch-cuda"))
    raise ValueError(f"unknown framework {framework!r}")


def to_host(array: Any) -> np.ndarray:
    """Any result (numpy, torch CPU/CUDA, CuPy, JAX) as a numpy array of its own dtype."""
    module = type(array).__module__.split(".", 1)[0]
    if module == "torch":
        import torch

        tensor = array.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(BF16)
        return tensor.numpy()
    if module == "cupy":
        import cupy as cp

        if array.dtype == BF16:
            return cp.asnumpy(array.view(cp.uint16)).view(BF16)
        return cp.asnumpy(array)
    return np.asarray(array)


def to_float64(array: Any) -> np.ndarray:
    return to_host(array).astype(np.float64)


def raw_bytes(array: Any) -> np.ndarray:
    """A copy of the bytes of ``array`` (any framework, strided views too), as uint8 with the
    last axis ``itemsize`` times longer: bit-exact comparisons, bf16 and NaN included."""
    return np.ascontiguousarray(to_host(array)).view(np.uint8).copy()


def assert_unchanged(array: Any, before: Any, what: str = "input") -> None:
    """``array`` holds exactly the bytes of ``before`` (an earlier :func:`raw_bytes`, or the
    numpy data it was made from)."""
    if not (isinstance(before, np.ndarray) and before.dtype == np.uint8):
        before = raw_bytes(before)
    np.testing.assert_array_equal(raw_bytes(array), before, err_msg=f"{what} changed")


def dtype_name(array: Any) -> str:
    """ "float16", "bfloat16", "float32", ... for numpy, ml_dtypes, torch, CuPy or JAX."""
    dtype = array.dtype
    if type(array).__module__.startswith("torch"):
        return str(dtype).removeprefix("torch.")
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == BF16 else dtype.name


def framework_name(array: Any) -> str:
    module = type(array).__module__.split(".", 1)[0]
    return "jax" if module in ("jax", "jaxlib") else module


def assert_like(y: Any, x: Any, shape: tuple[int, ...] | None = None) -> None:
    """``y`` is a new array in ``x``'s framework, dtype and device, of ``x``'s shape."""
    assert framework_name(y) == framework_name(x), (type(y), type(x))
    assert dtype_name(y) == dtype_name(x), (dtype_name(y), dtype_name(x))
    assert tuple(y.shape) == tuple(shape or x.shape), (tuple(y.shape), tuple(x.shape))
    if framework_name(x) == "torch":
        assert y.device == x.device, (y.device, x.device)
        assert y.data_ptr() != x.data_ptr()
    elif framework_name(x) == "cupy":
        assert y.device.id == x.device.id
        assert y.data.ptr != x.data.ptr
    elif framework_name(x) == "numpy":
        assert not np.shares_memory(y, x)


def random_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], place: str, requires_grad=False
):
    """Standard-normal torch data on ``place``: float64 on the host (for gradcheck), float32
    on the device."""
    import torch

    dtype = torch.float64 if place == "cpu" else torch.float32
    data = torch.from_numpy(rng.standard_normal(shape)).to(place, dtype)
    return data.requires_grad_(requires_grad)


def assert_gradcheck(function: Any, inputs: tuple) -> None:
    """``torch.autograd.gradcheck`` of ``function`` at the float64 ``inputs`` in both modes of
    autograd, each also batched: reverse (backward, and vmap over it) and forward (dual
    tensors, through the ops' forward-mode derivatives, and vmap over them), every Jacobian
    entry against finite differences. Forward mode once dropped tangents silently."""
    import torch

    assert torch.autograd.gradcheck(
        function, inputs, check_forward_ad=True, check_batched_grad=True,
        check_batched_forward_grad=True,
    )  # fmt: skip


def assert_positions_gradients(
    rng: np.random.Generator, rope: Any, q: Any, k: Any, positions: Any, place: str
) -> None:
    """``apply_rope`` at per-token ``positions`` under autograd: q and k (leaves that
    require grad) get exactly ``rope.backward`` of the upstream gradients at the same
    positions; on the host, ``torch.autograd.gradcheck`` in float64 as well."""
    import torch

    from tileops_cupy.rope import apply_rope

    q_rot, k_rot = apply_rope(q, k, rope, positions=positions)
    assert q_rot.grad_fn is not None and k_rot.grad_fn is not None
    gq, gk = random_tensor(rng, q.shape, place), random_tensor(rng, k.shape, place)
    torch.autograd.backward((q_rot, k_rot), (gq, gk))
    expected = rope.backward(gq.clone(), gk.clone(), positions=positions)
    torch.testing.assert_close(q.grad, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(k.grad, expected[1], rtol=0, atol=0)
    if place == "cpu":
        inputs = (q.detach().requires_grad_(), k.detach().requires_grad_())
        assert_gradcheck(lambda a, b: apply_rope(a, b, rope, positions=positions), inputs)
