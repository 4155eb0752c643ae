"""The RoPE seed ops against the float64 oracle, on the host path (numpy, torch CPU) and on a
CUDA device (torch CUDA, CuPy, JAX).

A case that runs in both places is one test parametrized over the place (``_cases``); the
"cuda" cases are marked ``gpu`` and skip without a device (``conftest.py``), as do the tests
that only make sense on a device (streams, deferred device-side id checks, JAX, two GPUs).
Every case draws fresh data (``rng`` is seeded per test id) and compares every output element
with ``_oracle.rope_reference`` under the SPEC 5 bound (``_oracle.contract_tolerance``).
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from _cases import (
    DTYPES,
    FRAMEWORKS,
    GPU,
    REPO,
    SLEEP_CYCLES,
    frameworks_and_dtypes,
    per_place,
    require,
    to_place,
)
from _layouts import chunks_only, takes_packs, takes_shared
from _oracle import (
    BF16,
    DEVICE_DTYPES,
    HOST_DTYPES,
    SEQUENCE_OP_IDS,
    SEQUENCE_OPS,
    SEQUENCE_SHAPES,
    assert_like,
    assert_matches_oracle,
    assert_unchanged,
    assert_within,
    contract_tolerance,
    dtype_name,
    llama31_frequencies,
    longrope_frequencies,
    max_angle,
    numpy_dtype,
    random_data,
    random_position_ids,
    raw_bytes,
    rope_reference,
    roundtrip_tolerance,
    sequence_positions,
    standard_frequencies,
    to_float64,
    to_framework,
    to_host,
    yarn_frequencies,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops_cupy import _rotate, rope
from tileops_cupy.rope import (
    BUILTIN,
    LongRoPEFwdOp,
    RoPEBwdOp,
    RoPEFwdOp,
    RoPELlama31FwdOp,
    RoPENeoxPositionIdsBwdOp,
    RoPENeoxPositionIdsFwdOp,
    YaRNFwdOp,
)

DIRECTIONS = ("Fwd", "Bwd")


def _ids_op(direction: str):
    return RoPENeoxPositionIdsFwdOp if direction == "Fwd" else RoPENeoxPositionIdsBwdOp


# --------------------------------------------------------------------------- the oracle itself


def test_oracle_neox_matches_transformers_rotate_half(rng):
    """Anchor the neox convention (and its sign) to HF's ``apply_rotary_pos_emb``."""
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    seq, heads, head_dim = 9, 2, 16
    freqs = standard_frequencies(head_dim, 10000.0)
    q = rng.standard_normal((1, heads, seq, head_dim))
    angles = np.arange(seq)[:, None] * freqs.inv_freq
    emb = np.concatenate([angles, angles], axis=-1)[None]
    cos, sin = torch.from_numpy(np.cos(emb)), torch.from_numpy(np.sin(emb))
    q_t = torch.from_numpy(q)
    hf, _ = modeling_llama.apply_rotary_pos_emb(q_t, q_t, cos, sin)
    ours = rope_reference(q, np.arange(seq)[None, None, :], freqs, neox=True)
    np.testing.assert_allclose(ours, hf.numpy(), rtol=0, atol=1e-13)


def test_oracle_interleaved_is_complex_multiplication(rng):
    """Interleaved pairs rotate as ``(x[2j] + i x[2j+1]) * a*exp(i p inv[j])`` (RoFormer,
    Meta's Llama reference)."""
    seq, head_dim = 7, 12
    freqs = yarn_frequencies(head_dim, scale=8.0)  # amplitude != 1
    x = rng.standard_normal((seq, head_dim))
    z = (x[:, 0::2] + 1j * x[:, 1::2]) * (
        freqs.amplitude * np.exp(1j * np.arange(seq)[:, None] * freqs.inv_freq)
    )
    expected = np.stack([z.real, z.imag], axis=-1).reshape(seq, head_dim)
    ours = rope_reference(x, np.arange(seq), freqs, neox=False)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-13)
    back = rope_reference(ours, np.arange(seq), freqs, neox=False, inverse=True)
    np.testing.assert_allclose(back, freqs.amplitude**2 * x, rtol=0, atol=1e-13)


# --------------------------------------------------------------------------- seed ops


@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("input_layout", ("1d", "2d"))
@pytest.mark.parametrize(("place", "framework", "dtype"), frameworks_and_dtypes())
def test_sequence_op_matches_oracle(rng, place, framework, dtype, input_layout, direction, case):
    shape = SEQUENCE_SHAPES[input_layout]
    op, freqs, neox = case.make(direction, input_layout, shape[-1], rng)
    host = random_data(rng, shape, dtype)
    x = to_place(host, place, framework)
    y = op(x)
    assert_like(y, x)
    assert_unchanged(x, host)
    assert_matches_oracle(
        y,
        host.astype(np.float64),
        sequence_positions(shape, input_layout),
        freqs,
        dtype,
        neox=neox,
        inverse=direction == "Bwd",
    )


@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
@pytest.mark.parametrize(("place", "dtype"), per_place(DTYPES))
def test_backward_of_forward_is_amplitude_squared(rng, place, dtype, case):
    """Bwd(Fwd(x)) == a*a*x for every scheme (YaRN and LongRoPE have a != 1)."""
    shape = SEQUENCE_SHAPES["2d"]
    seed = int(rng.integers(2**32))  # the twins draw the same LongRoPE factors
    fwd, freqs, _ = case.make("Fwd", "2d", shape[-1], np.random.default_rng(seed))
    bwd, _, _ = case.make("Bwd", "2d", shape[-1], np.random.default_rng(seed))
    if case.name in ("YaRN", "LongRoPE"):
        assert abs(freqs.amplitude - 1) > 0.05
    host = random_data(rng, shape, dtype)
    x64 = host.astype(np.float64)
    z = to_float64(bwd(fwd(to_place(host, place))))
    expected = freqs.amplitude**2 * x64
    angle = max_angle(sequence_positions(shape, "2d"), freqs)
    tolerance = roundtrip_tolerance(expected, x64, dtype, freqs.amplitude, angle)
    assert_within(z, expected, tolerance, f"Bwd(Fwd(x)) vs a*a*x ({dtype}, {place})")


@GPU
@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
def test_host_and_cuda_paths_agree(rng, dtype, case):
    """Both paths meet the contract on the same data, so they differ by at most the sum of
    their bounds (the host result is computed from the same torch tensor, on the CPU)."""
    require("cuda", "torch")
    shape = SEQUENCE_SHAPES["1d"]
    op, freqs, neox = case.make("Fwd", "1d", shape[-1], rng)
    host = random_data(rng, shape, dtype)
    x_cpu = to_framework(host, "torch")
    y_cuda = op(x_cpu.cuda())
    y_cpu = op(x_cpu)
    assert y_cuda.is_cuda and not y_cpu.is_cuda
    positions = sequence_positions(shape, "1d")
    x64 = host.astype(np.float64)
    a = assert_matches_oracle(y_cuda, x64, positions, freqs, dtype, neox=neox, what="CUDA")
    b = assert_matches_oracle(y_cpu, x64, positions, freqs, dtype, neox=neox, what="host")
    y64 = rope_reference(x64, positions, freqs, neox=neox)
    assert_within(a, b, 2 * contract_tolerance(y64, x64, dtype), "CUDA vs host")


@GPU
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_large_neox_launches_move_8_bytes_an_access(rng, monkeypatch, dtype, direction):
    """16-bit neox rotations of large two-level launches take 8-byte accesses (4 pairs a
    chunk: 16 x-lanes a D128 row instead of 8; ``_rotate._NARROW_NEOX_ROWS``, lowered here
    to this call's 6180 head rows): every element against the oracle, and the same bits as
    16-byte accesses."""
    require("cuda", "torch")
    shape = SEQUENCE_SHAPES["2d"]
    host = random_data(rng, shape, dtype)
    x = to_place(host, "cuda")
    op_class = RoPEFwdOp if direction == "Fwd" else RoPEBwdOp
    outputs, lanes = {}, {}
    for narrow_from in (1 << 30, math.prod(shape[:3])):
        monkeypatch.setattr(_rotate, "_NARROW_NEOX_ROWS", narrow_from)
        _rotate._plans.clear()
        outputs[narrow_from] = op_class("neox", "2d")(x)
        torch.cuda.synchronize()
        (plan,) = _rotate._plans.values()
        lanes[narrow_from] = plan.steps[0].block[0]
    wide, narrow = outputs
    assert (lanes[wide], lanes[narrow]) == (8, 16), lanes
    assert_matches_oracle(
        outputs[narrow], host.astype(np.float64), sequence_positions(shape, "2d"),
        standard_frequencies(shape[-1]), dtype, neox=True, inverse=direction == "Bwd",
    )  # fmt: skip
    assert torch.equal(outputs[narrow], outputs[wide])


def _assert_layout_matches_chunks(monkeypatch, host, case, direction, threshold, bound, takes):
    """``case``'s op on ``host`` (on the device) with the ``_rotate`` head-row ``threshold`` of
    a layout at ``bound`` takes that layout (``takes(plan)``): every element against the
    oracle, and the same bits as the chunk layout (rope_rotate, forced by bounds of the other
    layouts that no launch reaches)."""
    x = to_place(host, "cuda")
    outputs, plans = {}, {}
    chunks_only(monkeypatch)
    for layout, at in (("chunks", 1 << 62), ("tried", bound)):
        monkeypatch.setattr(_rotate, threshold, at)
        _rotate._plans.clear()
        # (a new op each time, the same scheme: an op keeps the launch of its first call)
        op, freqs, neox = case.make(direction, "2d", host.shape[-1], np.random.default_rng(7))
        outputs[layout] = op(x)
        torch.cuda.synchronize()
        (plans[layout],) = _rotate._plans.values()
    assert takes(plans["tried"]) and not takes(plans["chunks"]), plans
    assert_matches_oracle(
        outputs["tried"], host.astype(np.float64), sequence_positions(host.shape, "2d"), freqs,
        dtype_name(host), neox=neox, inverse=direction == "Bwd",
    )  # fmt: skip
    assert torch.equal(outputs["tried"], outputs["chunks"])


def _assert_whole_rows_match_chunks(monkeypatch, host, case, direction, packs_from):
    """:func:`_assert_layout_matches_chunks` of rope_rotate_packs (``_PACK_MIN_HEAD_ROWS`` at
    ``packs_from``)."""
    _assert_layout_matches_chunks(
        monkeypatch, host, case, direction, "_PACK_MIN_HEAD_ROWS", packs_from, takes_packs
    )


@GPU
@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
@pytest.mark.parametrize("shape", ((1, 1031, 8, 128), (2, 515, 12, 64)), ids=("D128", "D64"))
def test_large_launches_share_a_token_s_cos_sin(rng, monkeypatch, shape, dtype, direction, case):
    """Large launches take rope_rotate_shared (a chunk of one row a thread, each block's
    token's cos/sin formed once into shared memory; ``_rotate._SHARED_MIN_HEAD_ROWS`` lowered
    here to this call's rows), every scheme, both directions: every element against the
    oracle, and the same bits as rope_rotate. The D64 calls number their tokens in grid rows
    of 7 (``_rotate._MAX_GRID_Y``), the last one partial."""
    require("cuda", "torch")
    if shape[-1] == 64:
        monkeypatch.setattr(_rotate, "_MAX_GRID_Y", 7)
    _assert_layout_matches_chunks(
        monkeypatch, random_data(rng, shape, dtype), case, direction, "_SHARED_MIN_HEAD_ROWS", 0,
        takes_shared(dtype, shape[-1]),
    )  # fmt: skip


@GPU
@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
@pytest.mark.parametrize("shape", ((1, 1031, 4, 128), (2, 1030, 8, 64)), ids=("D128", "D64"))
def test_mid_sized_launches_rotate_whole_rows(rng, monkeypatch, shape, dtype, direction, case):
    """Mid-sized launches of one operand at sequential positions take rope_rotate_packs (16
    bytes of a row a lane, a neox lane's from both halves; four rows of a token a lane;
    ``_rotate._PACK_MIN_HEAD_ROWS`` lowered here to this call's rows, whose last warp is half
    empty at 16-bit D128): every element against the oracle, and the same bits as
    rope_rotate."""
    require("cuda", "torch")
    _assert_whole_rows_match_chunks(monkeypatch, random_data(rng, shape, dtype), case, direction, 0)


@GPU
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_large_float32_interleaved_launches_rotate_whole_rows(rng, monkeypatch, direction):
    """float32 interleaved rows take rope_rotate_packs at every size, where neox leaves it
    from 2**19 head rows (``_rotate._PACK_MAX_HEAD_ROWS``): 2**19 + 2**13
    head rows under the shipped bounds, every element against the oracle, and the same bits
    as the chunk layout."""
    require("cuda", "torch")
    host = random_data(rng, (1, (1 << 14) + 256, 32, 128), "float32")
    case = SEQUENCE_OPS[SEQUENCE_OP_IDS.index("RoPE-interleaved")]
    _assert_whole_rows_match_chunks(monkeypatch, host, case, direction, _rotate._PACK_MIN_HEAD_ROWS)


def test_forward_and_call_agree_and_bwd_is_not_fwd(rng):
    x = random_data(rng, (33, 64), "float32")
    op = RoPEFwdOp()
    np.testing.assert_array_equal(op(x), op.forward(x))
    y_bwd = RoPEBwdOp()(x)
    assert not np.array_equal(y_bwd, op(x))  # the twin negates sin
    np.testing.assert_array_equal(y_bwd[0], x[0])  # position 0 is the identity either way


def test_bwd_twins_take_and_name_grad(rng):
    """SPEC 3: a Bwd twin's call is ``forward(grad, ...)``: ``grad`` by keyword too, and
    every error names it (as RoPE.backward's name grad_q and grad_k), not the Fwd op's x."""
    grad = random_data(rng, (5, 2, 64), "float32")
    ids = np.arange(5)
    np.testing.assert_array_equal(
        rope.RoPENeoxPositionIdsBwdOp(8).forward(grad=grad, position_ids=ids),
        rope.RoPENeoxPositionIdsBwdOp(8)(grad, ids),
    )
    np.testing.assert_array_equal(RoPEBwdOp().forward(grad=grad[:, 0]), RoPEBwdOp()(grad[:, 0]))
    with pytest.raises(ValueError, match=r"^head_dim \(grad.shape\[-1\]\) must be even"):
        RoPEBwdOp()(grad[:, 0, :63])
    with pytest.raises(TypeError, match="^grad must be float16"):
        rope.RoPENeoxPositionIdsBwdOp(8)(grad.astype(np.int32), ids)
    with pytest.raises(ValueError, match=r"^grad must be \[tokens, heads, head_dim\]"):
        rope.RoPENeoxPositionIdsBwdOp(8)(grad[0], ids)
    grad_q, grad_k = (random_data(rng, (1, 3, width), "float32") for width in (128, 63))
    with pytest.raises(ValueError, match=r"^grad_k must be \[B, T, 1\*64\]"):
        rope.RoPE(64, 2, 1).backward(grad_q, grad_k)


def test_bfloat16_results_are_rounded_to_nearest_even(rng):
    """The host bf16 path rounds the float32 result once, to nearest even: the output is
    exactly the float32 host result (fp32 data of the same values) rounded by ml_dtypes."""
    host = random_data(rng, (64, 128), "bfloat16")
    y_bf16 = RoPEFwdOp()(host)
    y_fp32 = RoPEFwdOp()(host.astype(np.float32))
    np.testing.assert_array_equal(y_bf16.view(np.uint16), y_fp32.astype(BF16).view(np.uint16))
    t = to_framework(host, "torch")
    np.testing.assert_array_equal(to_host(RoPEFwdOp()(t)).view(np.uint16), y_bf16.view(np.uint16))


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    ("place", "dtype"), per_place({place: ("bfloat16", "float32") for place in ("cpu", "cuda")})
)
def test_subnormal_data_is_not_flushed_to_zero(rng, place, dtype, direction):
    """Data below the smallest normal float32 (2**-126) is rotated at full precision, never
    flushed to zero: the CUDA kernels are compiled without CuPy's default ``-ftz=true``
    (``contract_tolerance`` floors the float32 error at float32's spacing there)."""
    shape = (2, 16, 3, 64)
    # (a fixed scale: bf16's own subnormal spacing, 2**-133, must not round the data to 0)
    host = (rng.standard_normal(shape) * 2.0**-128).astype(numpy_dtype(dtype))
    assert np.count_nonzero(host) > 0.9 * host.size
    op = RoPEFwdOp(input_layout="2d") if direction == "Fwd" else RoPEBwdOp(input_layout="2d")
    y = op(to_place(host, place))
    assert np.count_nonzero(to_float64(y)) > 0.9 * host.size
    assert_matches_oracle(
        y, host.astype(np.float64), sequence_positions(shape, "2d"),
        standard_frequencies(64, 10000.0), dtype, inverse=direction == "Bwd",
    )  # fmt: skip


# --------------------------------------------------------------------------- position ids

# (rotary_dim, head_dim, base): None rotates the whole head; the CUDA path compiles head_dims
# 64 and 128 as constants and passes others (80) at run time
ROTARY_CASES = (
    (32, 64, 10000.0),
    (64, 128, 500000.0),
    (64, 128, 10000.0),
    (16, 80, 10000.0),
    (None, 64, 10000.0),
    (None, 128, 10000.0),
)
ROTARY_IDS = tuple(f"rd{r}-hd{h}-base{b:g}" for r, h, b in ROTARY_CASES)
# tokens, heads, max_position: the device's span many blocks and 70000 table rows
POSITION_ID_SIZES = {"cpu": (300, 3, 5000), "cuda": (700, 5, 70000)}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(("rotary_dim", "head_dim", "base"), ROTARY_CASES, ids=ROTARY_IDS)
@pytest.mark.parametrize("id_dtype", ("int32", "int64"))
@pytest.mark.parametrize(("place", "framework", "dtype"), frameworks_and_dtypes())
def test_position_ids_op_matches_oracle(
    rng, place, framework, dtype, id_dtype, rotary_dim, head_dim, base, direction
):
    tokens, heads, max_position = POSITION_ID_SIZES[place]
    op = _ids_op(direction)(max_position, base, rotary_dim)
    host = random_data(rng, (tokens, heads, head_dim), dtype)
    ids_host = random_position_ids(rng, tokens, max_position, id_dtype)
    x, ids = to_place(host, place, framework), to_place(ids_host, place, framework)
    y = op(x, ids)
    assert_like(y, x)
    assert_unchanged(x, host)
    assert_unchanged(ids, ids_host, "position_ids")
    freqs = standard_frequencies(rotary_dim or head_dim, base)
    assert_matches_oracle(
        y, host.astype(np.float64), ids_host[:, None], freqs, dtype, inverse=direction == "Bwd"
    )


# ids per group near each boundary, heads
NEAR_2_24_SIZES = {"cpu": (24, 2), "cuda": (40, 4)}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(("place", "dtype"), per_place(DTYPES))
def test_positions_near_2_20_and_2_24(rng, place, dtype, direction):
    """fp32 at positions up to 2**24-1 within 4e-6*max|x| (SPEC 5)."""
    samples, heads = NEAR_2_24_SIZES[place]
    k = rng.integers(0, 4096, samples)
    ids = np.concatenate(
        [
            [2**24 - 1, 2**24 - 2, 2**24 - 1024, 2**24 - 1025, 2**20 - 1, 2**20, 2**20 + 1],
            2**20 + k,
            2**24 - 1 - k,
            rng.integers(2**23, 2**24, samples),
        ]
    ).astype(np.int64)
    rng.shuffle(ids)
    host = random_data(rng, (ids.size, heads, 128), dtype)
    y = _ids_op(direction)(2**24)(to_place(host, place), to_place(ids, place))
    assert_matches_oracle(
        y,
        host.astype(np.float64),
        ids[:, None],
        standard_frequencies(128),
        dtype,
        inverse=direction == "Bwd",
    )


@pytest.mark.parametrize("id_dtype", ("int32", "int64"))
@pytest.mark.parametrize("framework", FRAMEWORKS["cpu"])
def test_position_ids_out_of_range_raise(rng, framework, id_dtype):
    """Host ids are checked before the call (the device's: the deferred test below)."""
    max_position = 1000
    op = RoPENeoxPositionIdsFwdOp(max_position, rotary_dim=32)
    host = random_data(rng, (6, 2, 64), "float32")
    x = to_framework(host, framework)
    bad_values = [-1, max_position, max_position + 7, -(2**31)]
    if id_dtype == "int64":
        bad_values += [2**40, 2**40 + 5, -(2**40)]  # must not wrap to a valid row
    for bad in bad_values:
        ids_host = random_position_ids(rng, 6, max_position, np.int64)
        ids_host[3] = bad
        ids = to_framework(ids_host.astype(id_dtype), framework)
        with pytest.raises(ValueError, match="position_ids") as error:
            op(x, ids)
        assert str(bad) in str(error.value) and str(max_position) in str(error.value)
    ids_host = random_position_ids(rng, 6, max_position, id_dtype)  # the op still works afterwards
    y = op(x, to_framework(ids_host, framework))
    assert_matches_oracle(
        y, host.astype(np.float64), ids_host[:, None], standard_frequencies(32), "float32"
    )


@GPU
@pytest.mark.parametrize("id_dtype", ("int32", "int64"))
@pytest.mark.parametrize("framework", FRAMEWORKS["cuda"])
def test_out_of_range_ids_raise_on_device_and_later_calls_work(rng, framework, id_dtype):
    """Device ids are bounded by the kernel without a sync: a bad id is clamped (no table is
    read out of bounds), flagged, and reported at this op's ``check()`` or next call, which
    then rotates nothing; an op of another configuration is unaffected."""
    max_position = 1000
    op = RoPENeoxPositionIdsFwdOp(max_position, rotary_dim=32)
    other = RoPENeoxPositionIdsBwdOp(max_position)
    host = random_data(rng, (64, 4, 64), "float16")
    x = to_place(host, "cuda", framework)
    freqs = standard_frequencies(32)
    bad_values = [-1, max_position, max_position + 12345, -(2**31), 2**31 - 1]
    if id_dtype == "int64":
        bad_values += [2**40, 2**40 + 7, -(2**40), 2**63 - 1]  # must not wrap to a valid row
    for i, bad in enumerate(bad_values):
        ids_host = random_position_ids(rng, 64, max_position, np.int64)
        row = int(rng.integers(64))
        ids_host[row] = bad
        y = op(x, to_place(ids_host.astype(id_dtype), "cuda", framework))  # no sync, no raise yet
        clamped = ids_host.copy()
        clamped[row] = 0 if bad < 0 else max_position - 1
        assert_matches_oracle(y, host.astype(np.float64), clamped[:, None], freqs, "float16")
        # an op of another configuration has a flag of its own
        good_host = random_position_ids(rng, 64, max_position, id_dtype)
        good = to_place(good_host, "cuda", framework)
        assert_matches_oracle(other(x, good), host.astype(np.float64), good_host[:, None],
                              standard_frequencies(64), "float16", inverse=True)  # fmt: skip
        if i % 2:  # reported by check() ...
            with pytest.raises(ValueError, match="position_ids"):
                op.check()
        else:  # ... or by the next call, which then launches nothing
            _wait_for_device(framework)
            with pytest.raises(ValueError, match="position_ids"):
                op(x, good)
        # reported once: the next calls are valid
        op.check()
        assert_matches_oracle(op(x, good), host.astype(np.float64), good_host[:, None], freqs,
                              "float16")  # fmt: skip


def _wait_for_device(framework: str) -> None:
    if framework == "cupy":
        import cupy

        cupy.cuda.Device().synchronize()
    else:
        torch.cuda.synchronize()


def test_position_ids_bad_length_dtype_and_rank(rng):
    op = RoPENeoxPositionIdsFwdOp(64)
    x = random_data(rng, (5, 2, 16), "float32")
    wrong_shapes = (np.arange(4), np.arange(6), np.arange(5).reshape(5, 1), np.zeros((5, 2), int))
    for ids in wrong_shapes:
        with pytest.raises(ValueError, match="position_ids"):
            op(x, ids)
    for ids in (
        np.arange(5.0),
        np.arange(5, dtype=np.float32),
        np.arange(5, dtype=np.int16),
        np.arange(5, dtype=np.uint32),
        torch.arange(5.0),
    ):
        with pytest.raises(TypeError, match="position_ids"):
            op(x, ids)
    with pytest.raises(TypeError, match="position_ids"):
        op(x, [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"\bx\b"):
        op(x[0], np.arange(2))  # [heads, head_dim] is not [tokens, heads, head_dim]
    with pytest.raises(ValueError, match=r"\bx\b"):
        op(x[None], np.arange(1))


@GPU
@pytest.mark.parametrize("framework", FRAMEWORKS["cuda"])
def test_position_ids_errors_on_device(rng, framework):
    op = RoPENeoxPositionIdsFwdOp(64)
    x = to_place(random_data(rng, (5, 2, 16), "float32"), "cuda", framework)
    with pytest.raises(ValueError, match="position_ids"):
        op(x, to_place(np.arange(4), "cuda", framework))
    with pytest.raises(TypeError, match="position_ids"):
        op(x, to_place(np.arange(5, dtype=np.float32), "cuda", framework))
    with pytest.raises(ValueError, match="position_ids"):  # ids on the host, x on the device
        op(x, np.arange(5))
    with pytest.raises(ValueError, match=r"\bx\b|position_ids"):  # x on the host, ids on the device
        op(random_data(rng, (5, 2, 16), "float32"), to_place(np.arange(5), "cuda", framework))


def test_call_accepts_keyword_arguments(rng):
    op = RoPENeoxPositionIdsFwdOp(64)
    x, ids = random_data(rng, (5, 2, 16), "float32"), np.arange(5)
    np.testing.assert_array_equal(op(x, position_ids=ids), op.forward(x, position_ids=ids))
    np.testing.assert_array_equal(RoPEFwdOp()(x=x[0]), RoPEFwdOp().forward(x=x[0]))


# --------------------------------------------------------------------------- strided views


def _strided_views(rng, place, framework, dtype):
    """(name, view, whole buffer, input_layout) for views the ops must read correctly."""

    def make(shape):
        return to_place(random_data(rng, shape, dtype), place, framework)

    qkv_4q = make((2, 17, 4 + 2 * 2, 64))  # fused QKV: 4 q heads, 2 k and 2 v heads
    qkv_8q = make((2, 17, 8 + 2 * 2, 64))  # 8 q heads, 2 k and 2 v heads
    qkv_1d = make((19, 3 * 64))
    bhsd = make((2, 3, 21, 64))
    wide = make((23, 2 * 64))
    odd = make((13, 1 + 64 + 3))
    shifted = make((13, 2 + 64 + 6))
    row = make((1, 64))
    cases = [
        ("q-of-fused-qkv-4q", qkv_4q[:, :, :4, :], qkv_4q, "2d"),
        ("k-of-fused-qkv-4q", qkv_4q[:, :, 4:6, :], qkv_4q, "2d"),
        ("q-of-fused-qkv-8q", qkv_8q[:, :, :8], qkv_8q, "2d"),
        ("k-of-fused-qkv-8q", qkv_8q[:, :, 8:10], qkv_8q, "2d"),
        ("k-of-fused-qkv-1d", qkv_1d[:, 64:128], qkv_1d, "1d"),
        ("v-of-fused-qkv-1d", qkv_1d[:, 128:], qkv_1d, "1d"),
        ("transposed-seq-head", bhsd.swapaxes(1, 2), bhsd, "2d"),
        ("strided-last-dim", wide[:, ::2], wide, "1d"),
        ("odd-element-offset", odd[:, 1:65], odd, "1d"),  # last dim contiguous, odd offsets
        ("two-element-offset", shifted[:, 2:66], shifted, "1d"),
    ]
    if framework == "torch":  # torch has no negative strides
        cases += [("broadcast-row", row.expand(40, 64), row, "1d")]
    else:
        xp = np if framework == "numpy" else pytest.importorskip("cupy")
        cases += [
            ("reversed-seq", wide[::-1, 64:], wide, "1d"),
            ("broadcast-row", xp.broadcast_to(row, (40, 64)), row, "1d"),
        ]
    return cases


@pytest.mark.parametrize("layout", ("neox", "interleaved"))
@pytest.mark.parametrize(
    ("place", "framework", "dtype"),
    frameworks_and_dtypes(dtypes=dict.fromkeys(DTYPES, DEVICE_DTYPES)),
)
def test_strided_views(rng, place, framework, dtype, layout):
    freqs = standard_frequencies(64)
    for name, view, buffer, input_layout in _strided_views(rng, place, framework, dtype):
        before = raw_bytes(buffer)
        y = RoPEFwdOp(layout, input_layout)(view)
        assert_like(y, view)
        assert_unchanged(buffer, before, name)
        x64 = to_float64(view)
        assert_matches_oracle(
            y,
            x64,
            sequence_positions(x64.shape, input_layout),
            freqs,
            dtype,
            neox=layout == "neox",
            what=name,
        )


@pytest.mark.parametrize("id_dtype", ("int32", "int64"))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize(("place", "framework"), per_place(FRAMEWORKS))
def test_position_ids_on_fused_qkv_views(rng, place, framework, dtype, id_dtype):
    qkv = to_place(random_data(rng, (50, 8 + 2 + 2, 128), dtype), place, framework)
    ids_host = random_position_ids(rng, 50, 4096, id_dtype)
    ids_buffer = to_place(np.repeat(ids_host, 2), place, framework)
    before = raw_bytes(qkv)
    op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=64)
    for view in (qkv[:, :8], qkv[:, 8:10]):
        y = op(view, ids_buffer[::2])  # strided ids too
        assert_unchanged(qkv, before, "qkv")
        assert_matches_oracle(
            y, to_float64(view), ids_host[:, None], standard_frequencies(64), dtype
        )


# --------------------------------------------------------------------------- hypothesis (host)


@st.composite
def _sequence_cases(draw):
    input_layout = draw(st.sampled_from(("1d", "2d")))
    head_dim = 2 * draw(st.integers(1, 80))
    seq = draw(st.integers(1, 40))
    shape = (
        (seq, head_dim)
        if input_layout == "1d"
        else (draw(st.integers(1, 3)), seq, draw(st.integers(1, 4)), head_dim)
    )
    kind = draw(st.sampled_from(("neox", "interleaved", "llama31", "yarn", "longrope")))
    base = draw(st.sampled_from((100.0, 10000.0, 500000.0, 1e6)))
    return dict(
        input_layout=input_layout,
        shape=shape,
        kind=kind,
        base=base,
        dtype=draw(st.sampled_from(HOST_DTYPES)),
        direction=draw(st.sampled_from(DIRECTIONS)),
        scale=draw(st.floats(1.0, 64.0)),
        seed=draw(st.integers(0, 2**32 - 1)),
        original=draw(st.sampled_from((16, 256, 4096))),
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_sequence_cases())
def test_hypothesis_sequence_ops(case):
    rng = np.random.default_rng(case["seed"])
    shape, layout, base = case["shape"], case["input_layout"], case["base"]
    head_dim, direction, kind = shape[-1], case["direction"], case["kind"]
    neox = kind != "interleaved"
    if kind in ("neox", "interleaved"):
        op = getattr(rope, f"RoPE{direction}Op")(kind, layout, base)
        freqs = standard_frequencies(head_dim, base)
    elif kind == "llama31":
        params = dict(
            base=base,
            scale_factor=case["scale"],
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position=case["original"],
        )
        op = getattr(rope, f"RoPELlama31{direction}Op")(layout, **params)
        freqs = llama31_frequencies(head_dim, **params)
    elif kind == "yarn":
        params = dict(
            base=base,
            scale=case["scale"],
            original_max_position=case["original"],
            beta_fast=32.0,
            beta_slow=1.0,
            attn_factor=1.0,
        )
        op = getattr(rope, f"YaRN{direction}Op")(layout, **params)
        freqs = yarn_frequencies(head_dim, **params)
    else:
        factors = rng.uniform(0.5, 8.0, head_dim // 2)
        params = dict(
            base=base,
            max_position_embeddings=case["original"] * 4,
            original_max_position_embeddings=case["original"],
        )
        op = getattr(rope, f"LongRoPE{direction}Op")(layout, rescale_factors=factors, **params)
        freqs = longrope_frequencies(head_dim, rescale_factors=factors, **params)
    host = random_data(rng, shape, case["dtype"])
    y = op(host)
    assert_like(y, host)
    assert_matches_oracle(
        y,
        host.astype(np.float64),
        sequence_positions(shape, layout),
        freqs,
        case["dtype"],
        neox=neox,
        inverse=direction == "Bwd",
    )


@st.composite
def _position_id_cases(draw):
    head_dim = 2 * draw(st.integers(1, 80))
    rotary_dim = draw(st.one_of(st.none(), st.integers(1, head_dim // 2).map(lambda r: 2 * r)))
    return dict(
        tokens=draw(st.integers(1, 50)),
        heads=draw(st.integers(1, 5)),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        # kept to 2**17 so the shared tables stay small; 2**24 has its own test
        max_position=draw(st.integers(1, 2**17)),
        dtype=draw(st.sampled_from(HOST_DTYPES)),
        id_dtype=draw(st.sampled_from(("int32", "int64"))),
        direction=draw(st.sampled_from(DIRECTIONS)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=40, deadline=None, derandomize=True)
@given(_position_id_cases())
def test_hypothesis_position_ids(case):
    rng = np.random.default_rng(case["seed"])
    tokens, max_position = case["tokens"], case["max_position"]
    op = _ids_op(case["direction"])(max_position, 10000.0, case["rotary_dim"])
    host = random_data(rng, (tokens, case["heads"], case["head_dim"]), case["dtype"])
    ids = random_position_ids(rng, tokens, max_position, case["id_dtype"])
    y = op(host, ids)
    freqs = standard_frequencies(case["rotary_dim"] or case["head_dim"])
    assert_matches_oracle(
        y,
        host.astype(np.float64),
        ids[:, None],
        freqs,
        case["dtype"],
        inverse=case["direction"] == "Bwd",
    )


# --------------------------------------------------------------------------- streams (device)


@GPU
def test_runs_on_the_current_torch_stream(rng):
    """The input is written on a side stream after a long sleep; only a kernel ordered on
    that stream (the caller's current one) sees it, one on any other stream reads zeros."""
    require("cuda", "torch")
    host = random_data(rng, (2, 300, 8, 128), "bfloat16")
    ids_host = random_position_ids(rng, 600, 4096, np.int64)
    source = to_place(host, "cuda", "torch")
    ids_source = torch.from_numpy(ids_host).cuda()
    x, ids = torch.zeros_like(source), torch.zeros_like(ids_source)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.copy_(source)
        ids.copy_(ids_source)
        y = RoPEFwdOp(input_layout="2d")(x)
        y_ids = RoPENeoxPositionIdsBwdOp(4096, rotary_dim=64)(x.view(600, 8, 128), ids)
    stream.synchronize()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    x64 = host.astype(np.float64)
    assert_matches_oracle(y, x64, sequence_positions(host.shape, "2d"),
                          standard_frequencies(128), "bfloat16")  # fmt: skip
    assert_matches_oracle(y_ids, x64.reshape(600, 8, 128), ids_host[:, None],
                          standard_frequencies(64), "bfloat16", inverse=True)  # fmt: skip


@GPU
def test_runs_on_the_current_cupy_stream(rng):
    cp = pytest.importorskip("cupy")
    spin = cp.RawKernel(
        r"""extern "C" __global__ void spin(long long cycles) {
            long long start = clock64();
            while (clock64() - start < cycles) {}
        }""",
        "spin",
    )
    host = random_data(rng, (1100, 64), "float32")
    source = cp.asarray(host)
    x = cp.zeros_like(source)
    cp.cuda.runtime.deviceSynchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        spin((1,), (1,), (np.int64(100_000_000),))
        x[...] = source
        y = RoPEBwdOp("interleaved")(x)
    stream.synchronize()
    assert_matches_oracle(y, host.astype(np.float64), np.arange(1100), standard_frequencies(64),
                          "float32", neox=False, inverse=True)  # fmt: skip


# --------------------------------------------------------------------------- places and targets

ALL_CLASSES = [
    getattr(rope, f"{prefix}{direction}Op")
    for prefix in ("RoPE", "RoPELlama31", "YaRN", "LongRoPE", "RoPENeoxPositionIds")
    for direction in DIRECTIONS
]
TARGET_OPS = [f"{case}-{direction}" for case in SEQUENCE_OP_IDS for direction in DIRECTIONS]
TARGET_OPS += [f"PositionIds-{direction}" for direction in DIRECTIONS]


def _target_op(name: str, seed: int, target):
    """(op, frequencies, neox) of one seed op built with ``target``; the same ``seed`` builds
    the same op (LongRoPE draws its factors)."""
    case_name, direction = name.rsplit("-", 1)
    if case_name == "PositionIds":
        return _ids_op(direction)(64, target=target), standard_frequencies(64), True
    [case] = [case for case in SEQUENCE_OPS if case.name == case_name]
    return case.make(direction, "1d", 64, np.random.default_rng(seed), target=target)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_bad_target_names(cls):
    make = (lambda **kw: cls(64, **kw)) if cls.__name__.startswith("RoPENeoxPositionIds") else cls
    for bad in ("gpu", "CUDA", "cuda:0", 0, "builtin-ish"):
        with pytest.raises(ValueError, match=rf"(?s)target.*{bad!r}"):
            make(target=bad)


@pytest.mark.parametrize("name", TARGET_OPS)
@pytest.mark.parametrize(
    ("place", "framework", "dtype"),
    frameworks_and_dtypes(dtypes={"cpu": ("float32",), "cuda": ("float16",)}),
)
def test_target_must_match_the_data(rng, place, framework, dtype, name):
    """``target=`` the other place is a ValueError (never a silent copy; for host data it is
    raised before any CUDA is touched, the same on machines with or without a GPU);
    ``target=`` the data's place, ``BUILTIN`` and ``None`` run there and agree bit for bit."""
    other = "cuda" if place == "cpu" else "cpu"
    seed = int(rng.integers(2**32))
    host = random_data(rng, (40, 64), dtype)
    ids_host = random_position_ids(rng, 40, 64, np.int64)
    x = to_place(host, place, framework)
    takes_ids = name.startswith("PositionIds")
    args = (x[:, None], to_place(ids_host, place, framework)) if takes_ids else (x,)
    with pytest.raises(ValueError, match=rf"target='{other}'"):
        _target_op(name, seed, other)[0](*args)
    op, freqs, neox = _target_op(name, seed, None)
    expected = op(*args)
    assert_like(expected, args[0])
    x64 = to_float64(args[0])
    positions = ids_host[:, None] if takes_ids else np.arange(40)
    inverse = name.endswith("Bwd")
    assert_matches_oracle(expected, x64, positions, freqs, dtype, neox=neox, inverse=inverse)
    for target in (place, BUILTIN):
        y = _target_op(name, seed, target)[0](*args)
        assert_like(y, args[0])
        np.testing.assert_array_equal(raw_bytes(y), raw_bytes(expected))


@GPU
@pytest.mark.parametrize("framework", FRAMEWORKS["cuda"])
def test_data_errors_on_device(rng, framework):
    def on_device(host):
        return to_place(host, "cuda", framework)

    with pytest.raises(TypeError, match=r"\bx\b"):
        RoPEFwdOp()(on_device(random_data(rng, (4, 64), "float64")))  # float64: host path only
    with pytest.raises(TypeError, match=r"\bx\b"):
        RoPEFwdOp()(on_device(np.ones((4, 64), np.int32)))
    with pytest.raises(ValueError, match="head_dim"):
        RoPEFwdOp()(on_device(random_data(rng, (4, 62 + 1), "float32")))
    with pytest.raises(ValueError, match=r"(?s)\bx\b.*input_layout"):
        RoPEFwdOp(input_layout="2d")(on_device(random_data(rng, (4, 64), "float32")))


@GPU
def test_inputs_on_two_devices(rng):
    require("cuda", "torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    host = random_data(rng, (30, 2, 64), "float32")
    ids_host = random_position_ids(rng, 30, 128, np.int32)
    x1 = torch.from_numpy(host).to("cuda:1")
    with pytest.raises(ValueError, match="position_ids"):
        RoPENeoxPositionIdsFwdOp(128)(x1, torch.from_numpy(ids_host).to("cuda:0"))
    y = RoPENeoxPositionIdsFwdOp(128)(x1, torch.from_numpy(ids_host).to("cuda:1"))
    assert y.device == x1.device  # runs on the input's device, not the current one
    assert_matches_oracle(y, host.astype(np.float64), ids_host[:, None],
                          standard_frequencies(64), "float32")  # fmt: skip


@pytest.mark.parametrize("transform", ("jit", "vmap", "grad"))
def test_jax_tracers_are_named(transform):
    """Inside jax.jit, jax.grad or jax.vmap the ops get tracers, not arrays: the error says
    so and names the argument (it used to read as if the argument were not an array). JAX
    is not a test dependency: this runs where it is installed (the device machine)."""
    jax = pytest.importorskip("jax")
    op = RoPEFwdOp()
    x = jax.numpy.ones((4, 16), jax.numpy.float32)
    calls = {
        "jit": lambda: jax.jit(op)(x),
        "vmap": lambda: jax.vmap(op)(x[None]),
        "grad": lambda: jax.grad(lambda t: op(t).sum())(x),
    }
    with pytest.raises(TypeError, match=r"^x is a JAX tracer \(\w*Tracer\): the ops run on"):
        calls[transform]()


@GPU
def test_jax_arrays(rng):
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("jax has no GPU backend here")
    for dtype in DEVICE_DTYPES:
        host = random_data(rng, (2, 64, 4, 128), dtype)
        x = jax.device_put(host, gpus[0])
        y = RoPEFwdOp("interleaved", "2d")(x)
        assert type(y).__module__.split(".")[0] in ("jax", "jaxlib")
        assert_matches_oracle(y, host.astype(np.float64), sequence_positions(host.shape, "2d"),
                              standard_frequencies(128), dtype, neox=False)  # fmt: skip
        ids_host = random_position_ids(rng, 128, 300, np.int32)
        y = RoPENeoxPositionIdsFwdOp(300, rotary_dim=64)(
            x.reshape(128, 4, 128), jax.device_put(ids_host, gpus[0])
        )
        assert_matches_oracle(y, host.astype(np.float64).reshape(128, 4, 128), ids_host[:, None],
                              standard_frequencies(64), dtype)  # fmt: skip


# --------------------------------------------------------------------------- errors (host)

SEQUENCE_CLASSES = [
    (getattr(rope, f"{prefix}{direction}Op"), prefix)
    for prefix in ("RoPE", "RoPELlama31", "YaRN", "LongRoPE")
    for direction in DIRECTIONS
]
SEQUENCE_CLASS_IDS = [cls.__name__ for cls, _ in SEQUENCE_CLASSES]


def _construct(cls, prefix, **kwargs):
    if prefix == "RoPE":
        return cls(**kwargs)
    kwargs.pop("rope_layout", None)
    return cls(**kwargs)


@pytest.mark.parametrize(("cls", "prefix"), SEQUENCE_CLASSES, ids=SEQUENCE_CLASS_IDS)
def test_wrong_rank_for_layout(rng, cls, prefix):
    name = _data_name(cls)
    for input_layout, shape in (
        ("1d", (3, 5, 64)),
        ("1d", (64,)),
        ("2d", (5, 64)),
        ("2d", (2, 5, 64)),
        ("2d", (1, 2, 5, 3, 64)),
    ):
        op = _construct(cls, prefix, input_layout=input_layout)
        x = random_data(rng, shape, "float32")
        with pytest.raises(ValueError, match=rf"(?s)\b{name}\b.*{input_layout}") as error:
            op(x)
        assert str(shape) in str(error.value)


@pytest.mark.parametrize(("cls", "prefix"), SEQUENCE_CLASSES, ids=SEQUENCE_CLASS_IDS)
@pytest.mark.parametrize("input_layout", ("1d", "2d"))
def test_odd_head_dim(rng, cls, prefix, input_layout):
    op = _construct(cls, prefix, input_layout=input_layout)
    shape = (4, 63) if input_layout == "1d" else (1, 4, 2, 63)
    with pytest.raises(ValueError, match=r"(?s)head_dim.*63"):
        op(random_data(rng, shape, "float32"))


def test_odd_head_dim_position_ids(rng):
    with pytest.raises(ValueError, match=r"(?s)head_dim.*65"):
        RoPENeoxPositionIdsFwdOp(16, rotary_dim=32)(
            random_data(rng, (3, 1, 65), "float32"), np.arange(3)
        )


@pytest.mark.parametrize("cls", (RoPENeoxPositionIdsFwdOp, RoPENeoxPositionIdsBwdOp))
def test_bad_rotary_dim(rng, cls):
    for bad in (3, 31, 0, -2, 2.0, "32"):  # (a value, or a type: not an int)
        error = ValueError if isinstance(bad, int) else TypeError
        with pytest.raises(error, match=rf"(?s)rotary_dim.*{bad!r}"):
            cls(16, rotary_dim=bad)
    op = cls(16, rotary_dim=66)  # larger than head_dim: known only at the call
    with pytest.raises(ValueError, match=r"(?s)rotary_dim.*66"):
        op(random_data(rng, (3, 1, 64), "float32"), np.arange(3))


@pytest.mark.parametrize("cls", (RoPENeoxPositionIdsFwdOp, RoPENeoxPositionIdsBwdOp))
def test_bad_max_position(cls):
    for bad in (0, -5, 2**24 + 1, 2**40, 16.0, None):  # (a value, or a type: not an int)
        error = ValueError if isinstance(bad, int) else TypeError
        with pytest.raises(error, match="max_position"):
            cls(bad)


@pytest.mark.parametrize(("cls", "prefix"), SEQUENCE_CLASSES, ids=SEQUENCE_CLASS_IDS)
@pytest.mark.parametrize("framework", FRAMEWORKS["cpu"])
def test_non_float_data_is_a_type_error(cls, prefix, framework):
    op = _construct(cls, prefix)
    for dtype in (np.int32, np.int64, np.int16, np.uint8, np.bool_, np.complex64):
        if framework == "torch" and dtype is np.complex64:
            continue
        x = to_framework(np.ones((4, 64), dtype), framework)
        with pytest.raises(TypeError, match=rf"\b{_data_name(cls)}\b"):
            op(x)
    with pytest.raises(TypeError, match=rf"\b{_data_name(cls)}\b"):
        op([[1.0, 2.0]])


def _data_name(cls: type) -> str:
    """What a seed op's errors call its data: x, or a Bwd twin's grad (SPEC 3)."""
    return "grad" if cls.__name__.endswith("BwdOp") else "x"


def test_non_float_data_position_ids_op():
    op = RoPENeoxPositionIdsFwdOp(16)
    with pytest.raises(TypeError, match=r"\bx\b"):
        op(np.ones((3, 1, 8), np.int32), np.arange(3))


@pytest.mark.parametrize(("cls", "prefix"), SEQUENCE_CLASSES, ids=SEQUENCE_CLASS_IDS)
def test_bad_layout_names(cls, prefix):
    for bad in ("3d", "1D", "", None, "neox"):
        with pytest.raises(ValueError, match=rf"(?s)input_layout.*{bad!r}"):
            _construct(cls, prefix, input_layout=bad)
    if prefix == "RoPE":
        for bad in ("gptj", "NEOX", "", None, "1d"):
            with pytest.raises(ValueError, match=rf"(?s)rope_layout.*{bad!r}"):
                cls(rope_layout=bad)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_bad_base(cls):
    for bad in (0.0, -1.0, -10000.0, math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="base"):
            if cls.__name__.startswith("RoPENeoxPositionIds"):
                cls(16, base=bad)
            else:
                cls(base=bad)


def _float64_tensor(values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("cls", (LongRoPEFwdOp, rope.LongRoPEBwdOp))
def test_bad_rescale_factors(rng, cls):
    good = rng.uniform(1, 4, 32)
    for bad_value in (0.0, math.nan, math.inf, -math.inf, -0.0):
        for container in (list, np.asarray, _float64_tensor):
            factors = good.copy()
            factors[5] = bad_value
            with pytest.raises(ValueError, match="rescale_factors"):
                cls(rescale_factors=container(factors.tolist()))
    op = cls(rescale_factors=good)  # 32 factors for head_dim 64
    with pytest.raises(ValueError, match=r"(?s)rescale_factors.*32"):
        op(random_data(rng, (4, 128), "float32"))
    for container in (list, np.asarray, _float64_tensor):  # any container reads the same
        y = cls(rescale_factors=container(good.tolist()))(np.ones((5, 64), np.float32))
        np.testing.assert_array_equal(y, op(np.ones((5, 64), np.float32)))


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (RoPELlama31FwdOp, {"scale_factor": 0.0}, "scale_factor"),
        (RoPELlama31FwdOp, {"scale_factor": math.nan}, "scale_factor"),
        (RoPELlama31FwdOp, {"low_freq_factor": -1.0}, "low_freq_factor"),
        (RoPELlama31FwdOp, {"high_freq_factor": 1.0}, "high_freq_factor"),
        (RoPELlama31FwdOp, {"original_max_position": 0}, "original_max_position"),
        (YaRNFwdOp, {"scale": 0.0}, "scale"),
        (YaRNFwdOp, {"scale": math.inf}, "scale"),
        (YaRNFwdOp, {"beta_fast": 0.0}, "beta_fast"),
        (YaRNFwdOp, {"beta_slow": -1.0}, "beta_slow"),
        (YaRNFwdOp, {"attn_factor": math.nan}, "attn_factor"),
        (YaRNFwdOp, {"original_max_position": -4096}, "original_max_position"),
        (LongRoPEFwdOp, {"max_position_embeddings": 0}, "max_position_embeddings"),
        (LongRoPEFwdOp, {"original_max_position_embeddings": -1}, "original_max_position"),
    ],
)
def test_bad_scheme_parameters(cls, kwargs, name):
    with pytest.raises(ValueError, match=name):
        cls(**kwargs)


def test_too_many_positions_for_the_tables():
    """A seq longer than 2**24 positions is refused up front (a zero-stride view: no memory)."""
    x = np.lib.stride_tricks.as_strided(np.zeros(8, np.float32), (2**24 + 1, 8), (0, 4))
    with pytest.raises(ValueError, match=r"\bx\b"):
        RoPEFwdOp()(x)


def test_empty_inputs():
    y = RoPEFwdOp()(np.zeros((0, 64), np.float32))
    assert y.shape == (0, 64) and y.dtype == np.float32
    y = RoPEFwdOp(input_layout="2d")(np.zeros((2, 0, 3, 64), np.float16))
    assert y.shape == (2, 0, 3, 64) and y.dtype == np.float16
    y = RoPENeoxPositionIdsFwdOp(8)(np.zeros((0, 2, 64), np.float32), np.zeros(0, np.int64))
    assert y.shape == (0, 2, 64)


# --------------------------------------------------------------------------- API and interop

SEED_SIGNATURES = {
    "RoPE": [("rope_layout", "neox"), ("input_layout", "1d"), ("base", 10000.0)],
    "RoPENeoxPositionIds": [
        ("max_position", inspect.Parameter.empty),
        ("base", 10000.0),
        ("rotary_dim", None),
    ],
    "RoPELlama31": [
        ("input_layout", "1d"),
        ("base", 10000.0),
        ("scale_factor", 8.0),
        ("low_freq_factor", 1.0),
        ("high_freq_factor", 4.0),
        ("original_max_position", 8192),
    ],
    "YaRN": [
        ("input_layout", "1d"),
        ("base", 10000.0),
        ("scale", 16.0),
        ("original_max_position", 4096),
        ("beta_fast", 32.0),
        ("beta_slow", 1.0),
        ("attn_factor", 1.0),
    ],
    "LongRoPE": [
        ("input_layout", "1d"),
        ("base", 10000.0),
        ("rescale_factors", None),
        ("max_position_embeddings", 4096),
        ("original_max_position_embeddings", 4096),
    ],
}


@pytest.mark.parametrize("prefix", SEED_SIGNATURES)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_constructor_matches_the_seed(prefix, direction):
    cls = getattr(rope, f"{prefix}{direction}Op")
    parameters = list(inspect.signature(cls).parameters.values())
    positional = [p for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == SEED_SIGNATURES[prefix]
    keyword_only = {p.name: p for p in parameters if p.kind == p.KEYWORD_ONLY}
    assert "target" in keyword_only and keyword_only["target"].default is None
    assert all(p.default is not p.empty for p in keyword_only.values())
    assert cls.__doc__
    assert cls.__module__ == "tileops_cupy.rope"


def test_package_import_and_lazy_submodules():
    import tileops_cupy

    assert tileops_cupy.rope is rope
    assert tileops_cupy.schemes.Standard is rope.Standard
    assert tileops_cupy.BUILTIN == BUILTIN
    assert isinstance(tileops_cupy.cuda_available(), bool)
    with pytest.raises(AttributeError):
        _ = tileops_cupy.no_such_module


_NO_CUDA_FRAMEWORKS = textwrap.dedent(
    """
    import sys

    BLOCKED = ("cupy", "cupyx", "cupy_backends", "torch", "jax", "jaxlib")

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked for this test")
            return None

    sys.meta_path.insert(0, Blocker())

    import ml_dtypes
    import numpy as np

    import tileops_cupy
    from tileops_cupy.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp

    assert tileops_cupy.cuda_available() is False
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    y = RoPEFwdOp()(x)
    assert type(y) is np.ndarray and y.shape == x.shape and np.abs(y[0] - x[0]).max() == 0
    assert RoPEFwdOp()(x.astype(ml_dtypes.bfloat16)).dtype == ml_dtypes.bfloat16
    ids = np.array([3, 0, 7], np.int32)
    assert RoPENeoxPositionIdsFwdOp(8, rotary_dim=16)(x[:3, None], ids).shape == (3, 1, 64)
    try:
        RoPEFwdOp(target="cuda")(x)
    except ValueError as error:
        assert "target" in str(error)
    else:
        raise AssertionError("target='cuda' with host data did not raise")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok")
    """
)


def test_import_and_host_path_without_cupy_or_torch():
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    result = subprocess.run(
        [sys.executable, "-c", _NO_CUDA_FRAMEWORKS],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_shared_tables_grow_safely_under_concurrent_readers():
    """A reader that sees the grown capacity must find both the float32 and the float64
    coarse tables grown (the growth publishes them without the reader taking the lock)."""
    from tileops_cupy._tables import RotaryTable
    from tileops_cupy.schemes import Standard

    errors: list[str] = []
    for trial in range(4):
        table = RotaryTable(Standard(1234.5 + trial), 128)
        table.ensure(1)
        stop = threading.Event()

        def reader(table=table, stop=stop):
            positions = np.array([2**24 - 1])
            while not stop.is_set():
                try:
                    if table.capacity >= 2**24:
                        table.host_cos_sin(positions, False)
                        table.host_cos_sin(positions, True)
                except Exception as error:  # reported below
                    errors.append(repr(error))
                    return

        thread = threading.Thread(target=reader)
        thread.start()
        table.ensure(2**24)
        stop.set()
        thread.join()
    assert not errors, errors[:3]
