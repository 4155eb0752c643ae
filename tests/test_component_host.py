"""The in-place Q/K RoPE component (issue 4) on the host path, against a float64 oracle.

Covers ``RoPE.forward / prefill / decode / backward`` (GQA, fused-QKV views, chunked
prefill, per-sequence positions, partial rotary_dim, both layouts), ``apply_rope`` under
torch autograd, the shared table registry (sharing, growth, threads, memory accounting)
and the argument errors. The oracle below is written from SPEC sections 1, 2 and 5 alone
(it imports nothing from ``tileops_cupy.schemes`` or the tables); the GPU twin of this file,
``test_component_gpu.py``, imports it.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from tileops_cupy.rope import RoPE, RoPEFwdOp, apply_rope, table_cache_info
from tileops_cupy.schemes import Llama31, LongRoPE, Standard, YaRN

# --------------------------------------------------------------------------- float64 oracle

NUMPY_DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
MANTISSA_BITS = {"float16": 10, "bfloat16": 7}


def standard_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    """SPEC 1: ``inv0[j] = base ** (-2j/d)``."""
    return np.float64(base) ** (-2.0 * np.arange(rotary_dim // 2, dtype=np.float64) / rotary_dim)


def llama31_frequencies(d, base, scale_factor, low, high, original):
    inv0 = standard_inv_freq(base, d)
    wavelength = 2 * math.pi / inv0
    s = (original / wavelength - low) / (high - low)
    blended = (1 - s) * inv0 / scale_factor + s * inv0
    inv = np.where(
        wavelength < original / high,
        inv0,
        np.where(wavelength > original / low, inv0 / scale_factor, blended),
    )
    return inv, 1.0


def yarn_frequencies(d, base, scale, original, beta_fast, beta_slow, attn_factor):
    inv0 = standard_inv_freq(base, d)

    def correction(rotations):
        return d * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(base))

    low = max(math.floor(correction(beta_fast)), 0)
    high = min(math.ceil(correction(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    w = 1 - ramp
    inv = (inv0 / scale) * (1 - w) + inv0 * w
    amplitude = (0.1 * math.log(scale) + 1 if scale > 1 else 1.0) * attn_factor
    return inv, amplitude


def longrope_frequencies(d, base, factors, max_positions, original):
    inv = standard_inv_freq(base, d) / np.asarray(factors, dtype=np.float64)
    s = max_positions / original
    amplitude = math.sqrt(1 + math.log(s) / math.log(original)) if s > 1 else 1.0
    return inv, amplitude


def _longrope_factors(d: int) -> list[float]:
    return list(np.linspace(1.0, 6.0, d // 2))


@dataclass(frozen=True)
class SchemeCase:
    """A library scheme for rotary_dim ``d`` and its oracle ``(inv_freq, amplitude)``."""

    name: str
    scheme: Callable[[int], object]
    frequencies: Callable[[int], tuple[np.ndarray, float]]

    def __repr__(self) -> str:
        return self.name


SCHEMES = {
    "standard": SchemeCase(
        "standard", lambda d: Standard(10000.0), lambda d: (standard_inv_freq(10000.0, d), 1.0)
    ),
    "yarn": SchemeCase(
        "yarn",
        lambda d: YaRN(10000.0, 8.0, 4096, 32.0, 1.0, 1.0),
        lambda d: yarn_frequencies(d, 10000.0, 8.0, 4096, 32.0, 1.0, 1.0),
    ),
    "llama31": SchemeCase(
        "llama31",
        lambda d: Llama31(500000.0, 8.0, 1.0, 4.0, 8192),
        lambda d: llama31_frequencies(d, 500000.0, 8.0, 1.0, 4.0, 8192),
    ),
    "longrope": SchemeCase(
        "longrope",
        lambda d: LongRoPE(10000.0, _longrope_factors(d), 131072, 4096),
        lambda d: longrope_frequencies(d, 10000.0, _longrope_factors(d), 131072, 4096),
    ),
}


def rotate64(x, positions, frequencies, layout="neox", inverse=False) -> np.ndarray:
    """SPEC 2 in float64: ``x`` ``[B, T, H, D]``, ``positions`` ``[B, T]`` int; columns at or
    past the rotary dim are copied. ``inverse`` negates sin (the backward rotation)."""
    inv, amplitude = frequencies
    x = np.asarray(x, dtype=np.float64)
    d = 2 * len(inv)
    angles = np.asarray(positions, dtype=np.int64)[..., None].astype(np.float64) * inv
    cos = (amplitude * np.cos(angles))[:, :, None, :]
    sin = (amplitude * np.sin(angles))[:, :, None, :]
    if inverse:
        sin = -sin
    first = np.arange(d // 2) if layout == "neox" else np.arange(0, d, 2)
    second = first + d // 2 if layout == "neox" else first + 1
    y = x.copy()
    x1, x2 = x[..., first], x[..., second]
    y[..., first] = x1 * cos - x2 * sin
    y[..., second] = x2 * cos + x1 * sin
    return y


def as_heads(x, heads: int, head_dim: int) -> np.ndarray:
    """A float64 ``[B, T, heads, head_dim]`` copy of ``x`` (3-d or 4-d, any framework)."""
    x64 = to64(x)
    return x64.reshape(*x64.shape[:2], heads, head_dim)


def to64(x) -> np.ndarray:
    """Any numpy / torch / CuPy array as a float64 numpy copy (bf16 and fp16 exactly)."""
    module = type(x).__module__.split(".", 1)[0]
    if module == "torch":
        import torch

        return x.detach().to("cpu", torch.float64).numpy()
    if module == "cupy":
        import cupy

        return cupy.asnumpy(x).astype(np.float64)
    return np.asarray(x).astype(np.float64)


def raw_bytes(x) -> np.ndarray:
    """The bytes of ``x`` (bit-exact comparisons, including bf16 and strided views)."""
    module = type(x).__module__.split(".", 1)[0]
    if module == "torch":
        import torch

        return x.detach().cpu().contiguous().view(torch.uint8).numpy().copy()
    if module == "cupy":
        import cupy

        return cupy.asnumpy(cupy.ascontiguousarray(x)).view(np.uint8)
    return np.ascontiguousarray(x).view(np.uint8).copy()


def assert_matches(actual, expected64, x64, dtype: str, what: str = "result") -> None:
    """SPEC 5 on every element: fp32 ``|y - y64| <= 4e-6 * max|x|``; fp16/bf16 within one
    unit of the dtype at the data's scale; fp64 (host only) within 1e-12 * max|x|."""
    got = to64(actual).reshape(expected64.shape)
    scale = float(np.abs(x64).max(initial=0.0))
    if dtype == "float32":
        tolerance = 4e-6 * scale
    elif dtype == "float64":
        tolerance = 1e-12 * scale
    else:
        scale = max(scale, float(np.abs(expected64).max(initial=0.0)))
        tolerance = 2.0 ** (math.floor(math.log2(scale)) - MANTISSA_BITS[dtype]) if scale else 0
    error = np.abs(got - expected64)
    if error.size and not error.max() <= tolerance:
        worst = np.unravel_index(np.argmax(error), error.shape)
        raise AssertionError(
            f"{what} ({dtype}): max error {error.max():.3g} > tolerance {tolerance:.3g} at "
            f"{tuple(int(i) for i in worst)}: got {got[worst]!r}, oracle {expected64[worst]!r}; "
            f"{int((error > tolerance).sum())} of {error.size} elements out of tolerance"
        )


def assert_same(result, *expected) -> None:
    """The component returns the very objects it was given (rotated in place)."""
    assert len(result) == len(expected)
    for got, want in zip(result, expected, strict=True):
        assert got is want, f"returned {type(got).__name__} is not the argument"


def random_data(rng, shape, dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(NUMPY_DTYPES[dtype])


def sequence_positions(batch: int, seq: int, offsets) -> np.ndarray:
    """``[B, T]`` positions ``offsets[b] + t`` (offsets an int or one per sequence)."""
    offsets = np.broadcast_to(np.asarray(offsets, dtype=np.int64), (batch,))
    return offsets[:, None] + np.arange(seq, dtype=np.int64)[None, :]


_fresh_bases = itertools.count()


def fresh_standard(first: float = 20011.0) -> Standard:
    """A Standard scheme no other test uses: its shared table starts empty."""
    return Standard(first + next(_fresh_bases))


def table_entries(scheme, rotary_dim: int) -> list[dict]:
    return [
        entry
        for entry in table_cache_info()["entries"]
        if entry["scheme"] == scheme and entry["rotary_dim"] == rotary_dim
    ]


# --------------------------------------------------------------------------- forward

HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 64, 8, 2


def _qk(rng, batch, seq, dtype, q_rank=3, k_rank=4, heads=NUM_HEADS, kv_heads=NUM_KV_HEADS):
    def shape(rank, h):
        return (batch, seq, h * HEAD_DIM) if rank == 3 else (batch, seq, h, HEAD_DIM)

    return random_data(rng, shape(q_rank, heads), dtype), random_data(
        rng, shape(k_rank, kv_heads), dtype
    )


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("ranks", [(3, 3), (4, 4), (3, 4)], ids=["flat", "heads", "mixed"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("case", list(SCHEMES.values()), ids=list(SCHEMES))
def test_forward_matches_oracle_gqa(rng, case, dtype, ranks, layout):
    batch, seq = 2, 13
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM), rope_layout=layout)
    q, k = _qk(rng, batch, seq, dtype, *ranks)
    q64, k64 = as_heads(q, NUM_HEADS, HEAD_DIM), as_heads(k, NUM_KV_HEADS, HEAD_DIM)
    positions = sequence_positions(batch, seq, 0)
    frequencies = case.frequencies(HEAD_DIM)

    q_out, k_out = rope.forward(q, k)

    assert q_out is q and k_out is k
    assert q.shape == q_out.shape and q.dtype == NUMPY_DTYPES[dtype]
    assert_matches(q, rotate64(q64, positions, frequencies, layout), q64, dtype, "q")
    assert_matches(k, rotate64(k64, positions, frequencies, layout), k64, dtype, "k")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_without_k_and_call_is_forward(rng, dtype):
    rope = RoPE(HEAD_DIM, 4)
    q = random_data(rng, (3, 9, 4, HEAD_DIM), dtype)
    q64 = to64(q)
    frequencies = SCHEMES["standard"].frequencies(HEAD_DIM)

    q_out, k_out = rope.forward(q, None)
    assert q_out is q and k_out is None
    assert_matches(q, rotate64(q64, sequence_positions(3, 9, 0), frequencies), q64, dtype)

    again = random_data(rng, (3, 9, 4 * HEAD_DIM), dtype)
    expected = rope.forward(again.copy(), None)[0]
    assert np.array_equal(rope(again)[0].view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("case", [SCHEMES["standard"], SCHEMES["yarn"]], ids=["standard", "yarn"])
@pytest.mark.parametrize("offset", [1000, 2**20 + 3, 2**24 - 5])
def test_prefill_at_high_offsets_fp32(rng, case, offset):
    """The accuracy contract holds at every position below 2**24."""
    batch, seq = 2, 5
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM))
    q, k = _qk(rng, batch, seq, "float32")
    q64, k64 = as_heads(q, NUM_HEADS, HEAD_DIM), as_heads(k, NUM_KV_HEADS, HEAD_DIM)
    positions = sequence_positions(batch, seq, offset)
    frequencies = case.frequencies(HEAD_DIM)

    assert_same(rope.prefill(q, k, offset), q, k)
    assert_matches(q, rotate64(q64, positions, frequencies), q64, "float32", "q")
    assert_matches(k, rotate64(k64, positions, frequencies), k64, "float32", "k")


# --------------------------------------------------------------------------- fused QKV


def _torch_or_skip():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("view_rank", [3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_fused_qkv_views_rotate_in_place(rng, framework, dtype, view_rank):
    batch, seq, hq, hkv = 2, 7, NUM_HEADS, NUM_KV_HEADS
    width = (hq + 2 * hkv) * HEAD_DIM
    host = random_data(rng, (batch, seq, width), dtype)
    if framework == "torch":
        torch = _torch_or_skip()
        if dtype == "bfloat16":
            qkv = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
        else:
            qkv = torch.from_numpy(host.copy())
    else:
        qkv = host.copy()
    if view_rank == 3:
        q, k, v = (
            qkv[..., : hq * HEAD_DIM],
            qkv[..., hq * HEAD_DIM : (hq + hkv) * HEAD_DIM],
            qkv[..., (hq + hkv) * HEAD_DIM :],
        )
    else:
        heads = qkv.reshape(batch, seq, hq + 2 * hkv, HEAD_DIM)
        q, k, v = heads[:, :, :hq], heads[:, :, hq : hq + hkv], heads[:, :, hq + hkv :]
    v_before = raw_bytes(v)
    qkv64 = to64(host).reshape(batch, seq, hq + 2 * hkv, HEAD_DIM)
    offset = 40
    positions = sequence_positions(batch, seq, offset)
    frequencies = SCHEMES["yarn"].frequencies(HEAD_DIM)
    rope = RoPE(HEAD_DIM, hq, hkv, scheme=SCHEMES["yarn"].scheme(HEAD_DIM))

    q_out, k_out = rope.prefill(q, k, offset)

    assert q_out is q and k_out is k
    assert np.array_equal(raw_bytes(v), v_before), "v changed"
    result = to64(qkv).reshape(batch, seq, hq + 2 * hkv, HEAD_DIM)
    q64, k64 = qkv64[:, :, :hq], qkv64[:, :, hq : hq + hkv]
    assert_matches(result[:, :, :hq], rotate64(q64, positions, frequencies), q64, dtype, "q")
    k_expected = rotate64(k64, positions, frequencies)
    assert_matches(result[:, :, hq : hq + hkv], k_expected, k64, dtype, "k")


# --------------------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [SCHEMES["standard"], SCHEMES["yarn"]], ids=["standard", "yarn"])
def test_chunked_prefill_equals_full_forward(rng, case, dtype, layout):
    batch, seq = 2, 29
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM), rope_layout=layout)
    q, k = _qk(rng, batch, seq, dtype)
    q_full, k_full = rope.forward(q.copy(), k.copy())

    q_chunked, k_chunked = q.copy(), k.copy()
    for start, stop in ((0, 5), (5, 12), (12, 13), (13, 29)):
        q_chunk, k_chunk = q_chunked[:, start:stop], k_chunked[:, start:stop]
        assert_same(rope.prefill(q_chunk, k_chunk, start), q_chunk, k_chunk)

    assert np.array_equal(raw_bytes(q_chunked), raw_bytes(q_full))
    assert np.array_equal(raw_bytes(k_chunked), raw_bytes(k_full))
    q64 = as_heads(q, NUM_HEADS, HEAD_DIM)
    positions = sequence_positions(batch, seq, 0)
    expected = rotate64(q64, positions, case.frequencies(HEAD_DIM), layout)
    assert_matches(q_chunked, expected, q64, dtype)


@pytest.mark.parametrize("offsets_dtype", ["int32", "int64"])
def test_prefill_with_per_sequence_offsets(rng, offsets_dtype):
    """Sequences at different lengths prefill their next chunk in one call."""
    batch, seq = 4, 6
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=SCHEMES["yarn"].scheme(HEAD_DIM))
    offsets = np.array([0, 17, 5000, 2**20], dtype=offsets_dtype)
    q, k = _qk(rng, batch, seq, "float32")
    q64, k64 = as_heads(q, NUM_HEADS, HEAD_DIM), as_heads(k, NUM_KV_HEADS, HEAD_DIM)
    positions = sequence_positions(batch, seq, offsets)
    frequencies = SCHEMES["yarn"].frequencies(HEAD_DIM)

    rope.prefill(q, k, offsets)

    assert_matches(q, rotate64(q64, positions, frequencies), q64, "float32", "q")
    assert_matches(k, rotate64(k64, positions, frequencies), k64, "float32", "k")


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("position", [0, 4097, 2**24 - 1])
def test_decode_at_int_position(rng, position, dtype):
    batch = 3
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    q, k = _qk(rng, batch, 1, dtype)
    q64, k64 = as_heads(q, NUM_HEADS, HEAD_DIM), as_heads(k, NUM_KV_HEADS, HEAD_DIM)
    positions = np.full((batch, 1), position)
    frequencies = SCHEMES["standard"].frequencies(HEAD_DIM)

    assert_same(rope.decode(q, k, position), q, k)

    assert_matches(q, rotate64(q64, positions, frequencies), q64, dtype, "q")
    assert_matches(k, rotate64(k64, positions, frequencies), k64, dtype, "k")


@pytest.mark.parametrize("max_position", [None, 2**21])
@pytest.mark.parametrize("container", ["numpy", "torch"])
@pytest.mark.parametrize("positions_dtype", ["int32", "int64"])
def test_decode_with_per_sequence_positions(rng, positions_dtype, container, max_position):
    batch = 6
    case = SCHEMES["llama31"]
    rope = RoPE(
        HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM), max_position=max_position
    )
    values = np.array([0, 1, 1023, 1024, 65537, 2**21 - 1], dtype=positions_dtype)
    positions = values
    if container == "torch":
        torch = _torch_or_skip()
        positions = torch.from_numpy(values.copy())
    q, k = _qk(rng, batch, 1, "float32", 4, 3)
    q64, k64 = as_heads(q, NUM_HEADS, HEAD_DIM), as_heads(k, NUM_KV_HEADS, HEAD_DIM)
    frequencies = case.frequencies(HEAD_DIM)

    assert_same(rope.decode(q, k, positions), q, k)

    expected_positions = values.astype(np.int64)[:, None]
    assert_matches(q, rotate64(q64, expected_positions, frequencies), q64, "float32", "q")
    assert_matches(k, rotate64(k64, expected_positions, frequencies), k64, "float32", "k")


def test_serving_loop_prefill_chunks_then_decode(rng):
    """Prefill in chunks, then decode token by token: every row as at its absolute position."""
    batch, prompt, steps = 2, 10, 4
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=SCHEMES["yarn"].scheme(HEAD_DIM))
    frequencies = SCHEMES["yarn"].frequencies(HEAD_DIM)
    q, k = _qk(rng, batch, prompt + steps, "float32")
    q64, k64 = as_heads(q, NUM_HEADS, HEAD_DIM), as_heads(k, NUM_KV_HEADS, HEAD_DIM)
    rope.prefill(q[:, :6], k[:, :6], 0)
    rope.prefill(q[:, 6:prompt], k[:, 6:prompt], 6)
    for step in range(steps):
        t = prompt + step
        rope.decode(q[:, t : t + 1], k[:, t : t + 1], t)
    positions = sequence_positions(batch, prompt + steps, 0)
    assert_matches(q, rotate64(q64, positions, frequencies), q64, "float32", "q")
    assert_matches(k, rotate64(k64, positions, frequencies), k64, "float32", "k")


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _zeros((2, 5, 512))[:, :0], id="sliced-T0"),
        pytest.param(lambda: _zeros((3, 5, 512))[:0], id="sliced-B0"),
        # freshly allocated empty arrays have all-zero strides (numpy; torch CPU tensors
        # reach the host path through .numpy()): not a non-contiguous last dimension
        pytest.param(lambda: _zeros((2, 0, 512)), id="fresh-T0"),
        pytest.param(lambda: _zeros((0, 4, 8, 64)), id="fresh-B0"),
        pytest.param(lambda: _torch_or_skip().zeros(2, 0, 512), id="torch-T0"),
    ],
)
def test_empty_chunk_is_a_no_op(make):
    """An empty chunk (a sequence with nothing left to prefill) rotates nothing."""
    q = make()
    rope = RoPE(HEAD_DIM, NUM_HEADS)
    assert rope.prefill(q, None, 5)[0] is q
    assert rope.backward(q, None, 5)[0] is q


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("offset", [0, 1234])
@pytest.mark.parametrize("case", list(SCHEMES.values()), ids=list(SCHEMES))
def test_backward_of_forward_is_amplitude_squared(rng, case, offset, dtype):
    batch, seq = 2, 11
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM))
    _, amplitude = case.frequencies(HEAD_DIM)
    q, k = _qk(rng, batch, seq, dtype)
    q64, k64 = to64(q), to64(k)

    rope.prefill(q, k, offset)
    assert_same(rope.backward(q, k, offset), q, k)

    if case.name in ("yarn", "longrope"):
        assert amplitude > 1.05  # the case must exercise a != 1
    # two roundings of a rotation by at most a*sqrt(2)*max|x|
    scale = amplitude**2 * float(np.abs(q64).max())
    tolerance = (2e-11 if dtype == "float64" else 2e-6) * scale
    assert np.abs(to64(q) - amplitude**2 * q64).max() <= tolerance
    assert np.abs(to64(k) - amplitude**2 * k64).max() <= tolerance


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("offset", [0, 777, "per-sequence"])
def test_backward_matches_transpose_oracle(rng, offset, layout):
    batch, seq = 3, 8
    case = SCHEMES["yarn"]
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM), rope_layout=layout)
    offsets = np.array([3, 900, 70000]) if offset == "per-sequence" else offset
    grad_q, grad_k = _qk(rng, batch, seq, "float32")
    gq64, gk64 = as_heads(grad_q, NUM_HEADS, HEAD_DIM), as_heads(grad_k, NUM_KV_HEADS, HEAD_DIM)
    positions = sequence_positions(batch, seq, offsets)
    frequencies = case.frequencies(HEAD_DIM)

    rope.backward(grad_q, grad_k, offsets)

    expected_q = rotate64(gq64, positions, frequencies, layout, inverse=True)
    assert_matches(grad_q, expected_q, gq64, "float32", "grad_q")
    expected_k = rotate64(gk64, positions, frequencies, layout, inverse=True)
    assert_matches(grad_k, expected_k, gk64, "float32", "grad_k")


def test_backward_default_offset_is_zero(rng):
    rope = RoPE(HEAD_DIM, 2)
    grad = random_data(rng, (1, 5, 2 * HEAD_DIM), "float32")
    expected = rope.backward(grad.copy(), None, 0)[0]
    assert np.array_equal(rope.backward(grad, None)[0], expected)


# --------------------------------------------------------------------------- partial rotary


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [32, 24, 2])
def test_partial_rotary_dim_leaves_the_tail(rng, rotary_dim, layout, dtype):
    batch, seq = 2, 9
    case = SCHEMES["longrope"]
    rope = RoPE(
        HEAD_DIM,
        NUM_HEADS,
        NUM_KV_HEADS,
        scheme=case.scheme(rotary_dim),
        rotary_dim=rotary_dim,
        rope_layout=layout,
    )
    q, k = _qk(rng, batch, seq, dtype, 4, 4)
    q_tail, k_tail = raw_bytes(q[..., rotary_dim:]), raw_bytes(k[..., rotary_dim:])
    q64, k64 = to64(q), to64(k)
    positions = sequence_positions(batch, seq, 300)
    frequencies = case.frequencies(rotary_dim)  # d is the rotary dim (SPEC 1)

    rope.prefill(q, k, 300)

    assert np.array_equal(raw_bytes(q[..., rotary_dim:]), q_tail)
    assert np.array_equal(raw_bytes(k[..., rotary_dim:]), k_tail)
    assert_matches(q, rotate64(q64, positions, frequencies, layout), q64, dtype, "q")
    assert_matches(k, rotate64(k64, positions, frequencies, layout), k64, dtype, "k")


# --------------------------------------------------------------------------- apply_rope


@pytest.mark.parametrize("position_offset", [0, 5, "tensor"])
@pytest.mark.parametrize("case", [SCHEMES["standard"], SCHEMES["yarn"]], ids=["standard", "yarn"])
def test_apply_rope_gradcheck(case, position_offset):
    torch = _torch_or_skip()
    generator = torch.Generator().manual_seed(4)
    head_dim = 8
    rope = RoPE(head_dim, 4, 2, scheme=case.scheme(head_dim))
    q = torch.randn(2, 3, 4 * head_dim, dtype=torch.float64, generator=generator)
    k = torch.randn(2, 3, 2, head_dim, dtype=torch.float64, generator=generator)
    q.requires_grad_(True)
    k.requires_grad_(True)
    offset = torch.tensor([7, 2000]) if position_offset == "tensor" else position_offset

    assert torch.autograd.gradcheck(lambda a, b: apply_rope(a, b, rope, offset), (q, k))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_apply_rope_is_out_of_place_and_equals_in_place(rng, dtype):
    torch = _torch_or_skip()
    case = SCHEMES["yarn"]
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM))
    q_host, k_host = _qk(rng, 2, 6, dtype)
    q = torch.from_numpy(q_host.copy()).requires_grad_(True)
    k = torch.from_numpy(k_host.copy()).requires_grad_(True)

    q_rot, k_rot = apply_rope(q, k, rope, 321)

    assert isinstance(q_rot, torch.Tensor) and q_rot is not q and k_rot is not k
    assert q_rot.shape == q.shape and k_rot.shape == k.shape and q_rot.dtype == q.dtype
    assert np.array_equal(q.detach().numpy(), q_host), "apply_rope modified q"
    assert np.array_equal(k.detach().numpy(), k_host), "apply_rope modified k"
    q_in_place, k_in_place = rope.prefill(q_host.copy(), k_host.copy(), 321)
    assert np.array_equal(q_rot.detach().numpy(), q_in_place)
    assert np.array_equal(k_rot.detach().numpy(), k_in_place)

    # the gradient is the transpose rotation of the upstream gradient
    grad_q, grad_k = _qk(rng, 2, 6, dtype)
    torch.autograd.backward((q_rot, k_rot), (torch.from_numpy(grad_q), torch.from_numpy(grad_k)))
    expected_q, expected_k = rope.backward(grad_q.copy(), grad_k.copy(), 321)
    assert np.array_equal(q.grad.numpy(), expected_q)
    assert np.array_equal(k.grad.numpy(), expected_k)


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_apply_rope_partial_rotary_gradcheck_and_tail(rng, layout):
    """Out of place, columns past rotary_dim are copied, and their gradient passes through."""
    torch = _torch_or_skip()
    rope = RoPE(8, 2, 1, rotary_dim=4, rope_layout=layout, scheme=SCHEMES["yarn"].scheme(4))
    q = torch.from_numpy(random_data(rng, (1, 3, 2, 8), "float64")).requires_grad_(True)
    k = torch.from_numpy(random_data(rng, (1, 3, 8), "float64")).requires_grad_(True)

    assert torch.autograd.gradcheck(lambda a, b: apply_rope(a, b, rope, 9), (q, k))
    q_rot, k_rot = apply_rope(q, k, rope, 9)
    assert torch.equal(q_rot[..., 4:], q[..., 4:])
    q64 = q.detach().numpy()
    expected = rotate64(q64, sequence_positions(1, 3, 9), SCHEMES["yarn"].frequencies(4), layout)
    assert_matches(q_rot, expected, q64, "float64")


def test_apply_rope_without_k_and_on_fused_views(rng):
    torch = _torch_or_skip()
    rope = RoPE(HEAD_DIM, 2, 1)
    qkv = torch.from_numpy(random_data(rng, (1, 4, 4 * HEAD_DIM), "float64")).requires_grad_(True)
    before = qkv.detach().clone()
    q, k = qkv[..., : 2 * HEAD_DIM], qkv[..., 2 * HEAD_DIM : 3 * HEAD_DIM]

    q_rot, none = apply_rope(q, None, rope, 2)
    assert none is None
    q_rot2, k_rot = apply_rope(q, k, rope, 2)
    assert torch.equal(q_rot, q_rot2)
    assert torch.equal(qkv.detach(), before)
    (q_rot.sum() + k_rot.sum()).backward()
    assert torch.equal(qkv.grad[..., 3 * HEAD_DIM :], torch.zeros_like(qkv.grad[..., :HEAD_DIM]))
    q64 = before.numpy()[..., : 2 * HEAD_DIM].reshape(1, 4, 2, HEAD_DIM)
    expected = rotate64(q64, sequence_positions(1, 4, 2), SCHEMES["standard"].frequencies(64))
    assert_matches(q_rot, expected, q64, "float64")


# --------------------------------------------------------------------------- shared tables


def test_components_and_ops_share_one_table(rng):
    scheme = fresh_standard()
    first = RoPE(HEAD_DIM, 8, 2, scheme=scheme)
    second = RoPE(HEAD_DIM, 4, scheme=scheme, rope_layout="interleaved", max_position=4096)
    wider = RoPE(2 * HEAD_DIM, 4, scheme=scheme, rotary_dim=HEAD_DIM)  # same rotary_dim
    other = RoPE(HEAD_DIM, 4, scheme=scheme, rotary_dim=32)

    assert first.table is second.table is wider.table
    assert other.table is not first.table
    assert len(table_entries(scheme, HEAD_DIM)) == 1
    assert len(table_entries(scheme, 32)) == 1

    # the seed op with the same (scheme, rotary_dim) uses the same table: its growth shows
    op = RoPEFwdOp(input_layout="1d", base=scheme.base)
    seq = 3 * 8192 + 5
    capacity = first.table.capacity
    assert capacity < seq
    x = random_data(rng, (seq, HEAD_DIM), "float32")
    y = op(x)
    assert first.table.capacity >= seq and second.table is first.table
    [entry] = table_entries(scheme, HEAD_DIM)
    assert entry["positions"] == first.table.capacity
    assert entry["host_bytes"] == first.table.bytes()["host"] > 0
    info = table_cache_info()
    assert info["host_bytes"] == sum(e["host_bytes"] for e in info["entries"])
    keys = [(e["scheme"], e["rotary_dim"]) for e in info["entries"]]
    assert len(keys) == len(set(keys)), "an entry is listed twice"
    x64 = to64(x)[None, :, None, :]
    expected = rotate64(x64, sequence_positions(1, seq, 0), (standard_inv_freq(scheme.base, 64), 1))
    assert_matches(y, expected, x64, "float32")


def test_table_grows_for_a_longer_position(rng):
    scheme = fresh_standard()
    rope = RoPE(HEAD_DIM, 2, 1, scheme=scheme)
    other = RoPE(HEAD_DIM, 4, 4, scheme=scheme)
    table = rope.table
    q, k = _qk(rng, 1, 4, "float32", heads=2, kv_heads=1)
    rope.forward(q, k)
    small = table.capacity
    small_bytes = table.bytes()["host"]
    assert small >= 4

    offset = small + 100_000
    q, k = _qk(rng, 1, 3, "float32", heads=2, kv_heads=1)
    q64, k64 = as_heads(q, 2, HEAD_DIM), as_heads(k, 1, HEAD_DIM)
    rope.prefill(q, k, offset)

    assert rope.table is table and other.table is table
    assert table.capacity >= offset + 3 > small
    assert table.bytes()["host"] > small_bytes
    assert rope.memory_stats()["positions"] == table.capacity
    [entry] = table_entries(scheme, HEAD_DIM)
    assert entry["positions"] == table.capacity
    frequencies = (standard_inv_freq(scheme.base, HEAD_DIM), 1.0)
    positions = sequence_positions(1, 3, offset)
    assert_matches(q, rotate64(q64, positions, frequencies), q64, "float32", "q")
    assert_matches(k, rotate64(k64, positions, frequencies), k64, "float32", "k")


def test_threads_prefill_with_the_same_key(rng):
    """Threads build components of one fresh key at once and prefill concurrently, some
    asking for positions that grow the shared table while others read it."""
    scheme = fresh_standard()
    frequencies = (standard_inv_freq(scheme.base, HEAD_DIM), 1.0)
    threads_count, rounds = 6, 4
    offsets = [[(t * 7919 + r * 300_000) % 2_000_000 for r in range(rounds)] for t in range(6)]
    offsets[0][1] = 2**24 - 8  # one thread grows the table to the end mid-run
    inputs = [
        [_qk(rng, 2, 8, "float32", heads=4, kv_heads=2) for _ in range(rounds)] for _ in offsets
    ]
    data = [[(q.copy(), k.copy()) for q, k in thread] for thread in inputs]
    components: list[RoPE | None] = [None] * threads_count
    failures: list[BaseException] = []
    start = threading.Barrier(threads_count)

    def work(index: int) -> None:
        try:
            start.wait()
            rope = RoPE(HEAD_DIM, 4, 2, scheme=scheme)
            components[index] = rope
            for (q, k), offset in zip(data[index], offsets[index], strict=True):
                rope.prefill(q, k, offset)
        except BaseException as error:  # reported below, with the thread's traceback
            failures.append(error)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not failures, failures
    assert all(rope is not None and rope.table is components[0].table for rope in components)
    assert len(table_entries(scheme, HEAD_DIM)) == 1
    for index in range(threads_count):
        for (q, k), (q0, k0), offset in zip(
            data[index], inputs[index], offsets[index], strict=True
        ):
            positions = sequence_positions(2, 8, offset)
            q64, k64 = as_heads(q0, 4, HEAD_DIM), as_heads(k0, 2, HEAD_DIM)
            assert_matches(q, rotate64(q64, positions, frequencies), q64, "float32", "q")
            assert_matches(k, rotate64(k64, positions, frequencies), k64, "float32", "k")


# --------------------------------------------------------------------------- memory accounting


def test_memory_stats_report_the_shared_table():
    scheme = fresh_standard()
    first = RoPE(HEAD_DIM, 8, 2, scheme=scheme)
    second = RoPE(HEAD_DIM, 16, 4, scheme=scheme)
    first.prefill(np.zeros((1, 1, 8 * HEAD_DIM), np.float32), None, 20_000)

    stats = first.memory_stats()
    assert stats == second.memory_stats(), "one shared table, the same report"
    assert stats["owned"] == 0
    assert stats["shared_key"] == (scheme, HEAD_DIM)
    assert stats["positions"] == first.table.capacity >= 20_001
    [entry] = table_entries(scheme, HEAD_DIM)
    assert stats["shared"]["host"] == entry["host_bytes"] > 0
    assert stats["shared"]["device"] == entry["device_bytes"] == {}  # nothing on a device


def test_required_memory_on_the_host_allocates_nothing():
    scheme = fresh_standard()
    entries_before = len(table_cache_info()["entries"])
    small = RoPE.required_memory(HEAD_DIM, 1000, scheme=scheme)
    large = RoPE.required_memory(HEAD_DIM, 1_000_000, scheme=scheme)
    half = RoPE.required_memory(HEAD_DIM, 1_000_000, scheme=scheme, rotary_dim=32)
    assert len(table_cache_info()["entries"]) == entries_before, "required_memory built a table"
    assert 0 < small <= large
    assert 0 < half < large
    # the tables store float32 (never the input dtype): cos and sin of each pair
    assert small % (4 * 2 * (HEAD_DIM // 2)) == 0
    assert RoPE.required_memory(128, 5000) == RoPE.required_memory(
        128, 5000, scheme=Standard(), rotary_dim=128
    )
    # a table that exists only on the host does not cover a device: the full cost remains
    rope = RoPE(HEAD_DIM, 2, scheme=scheme)
    rope.prefill(np.zeros((1, 1, 2 * HEAD_DIM), np.float32), None, 999)
    assert RoPE.required_memory(HEAD_DIM, 1000, scheme=scheme) == small


def test_check_without_a_device_is_a_no_op(rng):
    rope = RoPE(HEAD_DIM, 2, max_position=64)
    rope.check()
    q = random_data(rng, (1, 1, 2 * HEAD_DIM), "float32")
    rope.decode(q, None, 63)
    rope.check()


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RoPE(63, 8, 2), "head_dim"),
        (lambda: RoPE(64, 8, 3), "num_heads"),
        (lambda: RoPE(64, 0), "num_heads"),
        (lambda: RoPE(64, 8, 0), "num_kv_heads"),
        (lambda: RoPE(64, 8, rotary_dim=65), "rotary_dim"),
        (lambda: RoPE(64, 8, rotary_dim=66), "rotary_dim"),
        (lambda: RoPE(64, 8, rope_layout="gptj"), "rope_layout"),
        (lambda: RoPE(64, 8, max_position=0), "max_position"),
        (lambda: RoPE(64, 8, max_position=2**24 + 1), "max_position"),
        (lambda: RoPE(64, 8, target="tpu"), "target"),
    ],
    ids=[
        "odd-head-dim",
        "heads-not-multiple",
        "zero-heads",
        "zero-kv-heads",
        "odd-rotary-dim",
        "rotary-dim-too-big",
        "layout",
        "max-position-zero",
        "max-position-too-big",
        "target",
    ],
)
def test_constructor_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


B, T = 2, 3
_Q = (B, T, NUM_HEADS * HEAD_DIM)
_K = (B, T, NUM_KV_HEADS * HEAD_DIM)


def _zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype)


CALL_ERRORS = {
    "q-heads": (lambda r: r.forward(_zeros((B, T, 7 * HEAD_DIM)), _zeros(_K)), r"\bq\b"),
    "q-head-dim": (lambda r: r.forward(_zeros((B, T, NUM_HEADS, 32)), _zeros(_K)), r"\bq\b"),
    "q-rank": (lambda r: r.forward(_zeros((T, NUM_HEADS * HEAD_DIM)), None), r"\bq\b"),
    "k-heads": (lambda r: r.forward(_zeros(_Q), _zeros((B, T, 3, HEAD_DIM))), r"\bk\b"),
    "k-as-q-heads": (lambda r: r.forward(_zeros(_Q), _zeros(_Q)), r"\bk\b"),
    "k-seq": (lambda r: r.forward(_zeros(_Q), _zeros((B, T + 1, 2 * HEAD_DIM))), r"\bk\b"),
    "k-batch": (lambda r: r.forward(_zeros(_Q), _zeros((B + 1, T, 2 * HEAD_DIM))), r"\bk\b"),
    "decode-T": (lambda r: r.decode(_zeros(_Q), _zeros(_K), 0), r"T"),
    "decode-T0": (lambda r: r.decode(_zeros((B, 3, 512))[:, :0], None, 0), r"T"),
    "offset-beyond": (lambda r: r.prefill(_zeros(_Q), _zeros(_K), 1000 - T + 1), "position_offset"),
    "offset-negative": (lambda r: r.prefill(_zeros(_Q), _zeros(_K), -1), "position_offset"),
    "position-at-max": (lambda r: r.decode(_zeros((B, 1, 512)), None, 1000), r"\bposition\b"),
    "position-negative": (lambda r: r.decode(_zeros((B, 1, 512)), None, -2), r"\bposition\b"),
    "backward-beyond": (lambda r: r.backward(_zeros(_Q), _zeros(_K), 998), "position_offset"),
    "tensor-beyond": (
        lambda r: r.prefill(_zeros(_Q), _zeros(_K), np.array([0, 998])),
        "position_offset",
    ),
    "tensor-negative": (
        lambda r: r.prefill(_zeros(_Q), _zeros(_K), np.array([-1, 5])),
        "position_offset",
    ),
    "tensor-int64-wraps": (
        lambda r: r.decode(_zeros((B, 1, 512)), None, np.array([2**32 + 1, 0], np.int64)),
        r"\bposition\b",
    ),
    "tensor-long": (
        lambda r: r.prefill(_zeros(_Q), _zeros(_K), np.array([0, 1, 2])),
        "position_offset",
    ),
    "tensor-short": (lambda r: r.decode(_zeros((B, 1, 512)), None, np.array([4])), "position"),
    "tensor-2d": (
        lambda r: r.decode(_zeros((B, 1, 512)), None, np.zeros((B, 1), np.int64)),
        "position",
    ),
    "strided-last-dim": (
        lambda r: r.forward(_zeros((B, T, 2 * NUM_HEADS * HEAD_DIM))[..., ::2], None),
        r"\bq\b",
    ),
}


@pytest.mark.parametrize("name", list(CALL_ERRORS))
def test_call_errors_name_the_argument(name):
    call, match = CALL_ERRORS[name]
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=1000)
    with pytest.raises(ValueError, match=match):
        call(rope)


def test_torch_host_tensor_positions_are_validated():
    torch = _torch_or_skip()
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=1000)
    with pytest.raises(ValueError, match=r"\bposition\b"):
        rope.decode(_zeros((B, 1, 512)), None, torch.tensor([3, 1000]))
    with pytest.raises(ValueError, match="position_offset"):
        rope.prefill(_zeros(_Q), _zeros(_K), torch.tensor([3, 4, 5], dtype=torch.int32))


def test_a_rejected_call_changes_nothing(rng):
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=1000)
    q, k = _qk(rng, B, T, "float32")
    q_before, k_before = q.copy(), k.copy()
    with pytest.raises(ValueError):
        rope.prefill(q, k, np.array([0, 998]))
    with pytest.raises(ValueError):
        rope.prefill(q, k[:, :2], 0)
    assert np.array_equal(q, q_before) and np.array_equal(k, k_before)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda r: r.forward(_zeros(_Q, np.int32), None), r"\bq\b"),
        (lambda r: r.forward(_zeros(_Q), _zeros(_K, np.int64)), r"\bk\b"),
        (lambda r: r.forward(_zeros(_Q, np.complex64), None), r"\bq\b"),
        (lambda r: r.forward(_zeros(_Q), _zeros(_K, np.float16)), r"\bk\b"),
        (lambda r: r.prefill(_zeros(_Q), None, np.array([0.0, 1.0])), "position_offset"),
        (lambda r: r.forward([[0.0] * 512], None), r"\bq\b"),
    ],
    ids=["q-int32", "k-int64", "q-complex", "k-dtype-differs", "float-offsets", "list"],
)
def test_type_errors(call, match):
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    with pytest.raises(TypeError, match=match):
        call(rope)
