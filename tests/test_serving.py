"""Serving features (issue 11): per-token positions on the Q/K component and partial rotary
(``rotary_dim``) on every seed op, against the float64 oracle (``_oracle``).

One file for both places: ``place`` is "cpu" (the host path, in CI) or "cuda" (marked
``gpu``; skips without a device). Tests that only make sense on a device (deferred device
checks, CUDA graphs) are marked ``gpu`` alone. Every test draws fresh data (``rng`` is
seeded per test id) and compares every output element.
"""

from __future__ import annotations

import inspect
import math
import textwrap

import numpy as np
import pytest
import torch
from _cases import PLACES, assert_runs_in_own_process
from _compile import backends, compile_counting
from _oracle import (
    LLAMA31_PARAMS,
    LONGROPE_PARAMS,
    SEQUENCE_OP_IDS,
    SEQUENCE_OPS,
    YARN_PARAMS,
    assert_gradcheck,
    assert_matches_oracle,
    assert_positions_gradients,
    llama31_frequencies,
    longrope_frequencies,
    random_data,
    random_tensor,
    sequence_positions,
    standard_frequencies,
    to_float64,
    to_framework,
    yarn_frequencies,
)

from tileops_cupy.rope import (
    Llama31,
    LongRoPE,
    LongRoPEFwdOp,
    RoPE,
    RoPEFwdOp,
    Standard,
    YaRN,
    apply_rope,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)

B, T, HEADS, KV_HEADS, HEAD_DIM = 2, 5, 4, 2, 32
LIMIT = 1 << 24  # positions without max_position lie below 2**24
LAYOUTS = ("BT", "BTHD", "packed")  # q [B, T, H*D], [B, T, H, D], packed [N, H*D]

# --------------------------------------------------------------------------- helpers

# scheme case: (scheme name, the component's rotary_dim, rope_layout)
SCHEME_CASES = {
    "standard-neox": ("standard", HEAD_DIM, "neox"),
    "standard-interleaved-partial": ("standard", 16, "interleaved"),
    "llama31": ("llama31", HEAD_DIM, "neox"),
    "yarn-partial": ("yarn", 16, "neox"),
    "longrope-partial": ("longrope", 16, "neox"),
}


def _scheme(name: str, rotary_dim: int):
    """(scheme, the oracle's frequencies over rotary_dim)."""
    if name == "standard":
        return Standard(500.0), standard_frequencies(rotary_dim, 500.0)
    if name == "llama31":
        return Llama31(**LLAMA31_PARAMS), llama31_frequencies(rotary_dim, **LLAMA31_PARAMS)
    if name == "yarn":
        return YaRN(**YARN_PARAMS), yarn_frequencies(rotary_dim, **YARN_PARAMS)
    factors = np.linspace(1.0, 7.0, rotary_dim // 2)[::-1]  # decreasing: order matters
    scheme = LongRoPE(rescale_factors=factors, **LONGROPE_PARAMS)
    return scheme, longrope_frequencies(rotary_dim, rescale_factors=factors, **LONGROPE_PARAMS)


def _rope(case: str, max_position=None):
    """(component, frequencies, neox) of one scheme case."""
    name, rotary_dim, rope_layout = SCHEME_CASES[case]
    scheme, frequencies = _scheme(name, rotary_dim)
    rope = RoPE(
        HEAD_DIM, HEADS, KV_HEADS, scheme=scheme, rotary_dim=rotary_dim,
        rope_layout=rope_layout, max_position=max_position,
    )  # fmt: skip
    return rope, frequencies, rope_layout == "neox"


def _framework(place: str) -> str:
    return "torch" if place == "cpu" else "torch-cuda"


def _token_shape(layout: str, batch=B, seq=T) -> tuple[int, ...]:
    return (batch * seq,) if layout == "packed" else (batch, seq)


def _data_shape(layout: str, heads: int, batch=B, seq=T) -> tuple[int, ...]:
    if layout == "BTHD":
        return (batch, seq, heads, HEAD_DIM)
    return (*_token_shape(layout, batch, seq), heads * HEAD_DIM)


def _data(rng, layout, heads, dtype, place, batch=B, seq=T):
    """(tensor on place, its float64 values as [..., heads, head_dim])."""
    host = random_data(rng, _data_shape(layout, heads, batch, seq), dtype)
    x64 = host.astype(np.float64).reshape(*_token_shape(layout, batch, seq), heads, HEAD_DIM)
    return to_framework(host, _framework(place)), x64


def _random_positions(rng, count: int, limit: int) -> np.ndarray:
    """Half small (< 4096), half anywhere below ``limit``; always 0 and limit - 1."""
    ids = rng.integers(0, min(4096, limit), count)
    anywhere = rng.permutation(count)[: count // 2]
    ids[anywhere] = rng.integers(0, limit, anywhere.size)
    ends = rng.permutation(count)[:2]
    ids[ends[0]], ids[ends[1]] = 0, limit - 1
    return ids


def _positions(rng, layout, place, dtype="int64", limit=LIMIT, batch=B, seq=T):
    """(positions tensor on place of the layout's token shape, int64 values)."""
    shape = _token_shape(layout, batch, seq)
    ids = _random_positions(rng, math.prod(shape), limit).reshape(shape)
    return torch.from_numpy(ids.astype(dtype)).to(place), ids


def _assert_rotated(y, x64, ids, frequencies, neox, dtype, what, inverse=False):
    positions = np.asarray(ids)[..., None]  # one per token, broadcast over heads
    assert_matches_oracle(
        to_float64(y).reshape(x64.shape), x64, positions, frequencies, dtype,
        neox=neox, inverse=inverse, what=what,
    )  # fmt: skip


def _synchronize(place):
    if place == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- per-token positions


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("ids_dtype", ("int32", "int64"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", SCHEME_CASES)
def test_per_token_positions_match_oracle(rng, case, layout, ids_dtype, dtype, place):
    """Every scheme, GQA, positions anywhere below 2**24 (max_position=None): on a device
    they are a device tensor, bounded by the kernel at 2**24, and check() stays quiet."""
    rope, frequencies, neox = _rope(case)
    q, q64 = _data(rng, layout, HEADS, dtype, place)
    k, k64 = _data(rng, layout, KV_HEADS, dtype, place)
    positions, ids = _positions(rng, layout, place, ids_dtype)
    result = rope.forward(q, k, positions=positions)
    assert result[0] is q and result[1] is k
    _synchronize(place)
    _assert_rotated(q, q64, ids, frequencies, neox, dtype, "q")
    _assert_rotated(k, k64, ids, frequencies, neox, dtype, "k")
    rope.check()


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_more_tokens_than_max_position(rng, layout, place):
    """max_position bounds the positions, not the tokens: a call with more tokens than it
    (packed, or B*T) at positions below it rotates every token."""
    max_position = 8
    rope, frequencies, neox = _rope("standard-neox", max_position=max_position)
    q, q64 = _data(rng, layout, HEADS, "float32", place, seq=3 * max_position)
    k, k64 = _data(rng, layout, KV_HEADS, "float32", place, seq=3 * max_position)
    positions, ids = _positions(rng, layout, place, limit=max_position, seq=3 * max_position)
    rope.forward(q, k, positions=positions)
    _synchronize(place)
    _assert_rotated(q, q64, ids, frequencies, neox, "float32", "q")
    _assert_rotated(k, k64, ids, frequencies, neox, "float32", "k")
    rope.check()


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_k_and_apply_rope_equals_in_place(rng, layout, place):
    rope, frequencies, neox = _rope("yarn-partial", max_position=1 << 20)
    q, q64 = _data(rng, layout, HEADS, "float32", place)
    positions, ids = _positions(rng, layout, place, "int32", limit=1 << 20)
    q_rot, k_rot = apply_rope(q, None, rope, positions=positions)
    assert k_rot is None
    assert np.array_equal(to_float64(q).reshape(q64.shape), q64), "apply_rope changed q"
    result = rope.forward(q, positions=positions)
    assert result[0] is q and result[1] is None
    torch.testing.assert_close(q_rot, q, rtol=0, atol=0)
    _assert_rotated(q, q64, ids, frequencies, neox, "float32", "q")


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", ("BT", "packed"))
def test_fused_qkv_views_rotate_in_place_and_leave_v(rng, layout, place):
    rope, frequencies, neox = _rope("llama31")
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    host = random_data(rng, (*_token_shape(layout), width), "bfloat16")
    qkv = to_framework(host, _framework(place))
    q, k = qkv[..., : HEADS * HEAD_DIM], qkv[..., HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM]
    positions, ids = _positions(rng, layout, place, "int64")
    rope.forward(q, k, positions=positions)
    _synchronize(place)
    x64 = host.astype(np.float64)
    v_start = (HEADS + KV_HEADS) * HEAD_DIM
    np.testing.assert_array_equal(to_float64(qkv)[..., v_start:], x64[..., v_start:])
    tokens = _token_shape(layout)
    q64 = x64[..., : HEADS * HEAD_DIM].reshape(*tokens, HEADS, HEAD_DIM)
    k64 = x64[..., HEADS * HEAD_DIM : v_start].reshape(*tokens, KV_HEADS, HEAD_DIM)
    _assert_rotated(q, q64, ids, frequencies, neox, "bfloat16", "q")
    _assert_rotated(k, k64, ids, frequencies, neox, "bfloat16", "k")


@pytest.mark.parametrize("place", PLACES)
def test_repeated_calls_read_each_calls_positions(rng, place):
    """A repeated layout re-runs its first launch with patched addresses: each call must
    still read its own positions (a new tensor, the same tensor rewritten, or a strided
    view that is copied), and its own q and k."""
    rope, frequencies, neox = _rope("standard-neox")
    storage = torch.zeros(B, 2 * T, dtype=torch.int64, device=place)
    same = torch.zeros(B, T, dtype=torch.int32, device=place)
    for step in range(3):
        for kind in ("new", "rewritten", "strided"):
            q, q64 = _data(rng, "BT", HEADS, "float32", place)
            k, k64 = _data(rng, "BT", KV_HEADS, "float32", place)
            positions, ids = _positions(rng, "BT", place, "int32" if kind != "strided" else "int64")
            if kind == "rewritten":
                same.copy_(positions)
                positions = same
            elif kind == "strided":
                storage[:, ::2] = positions
                positions = storage[:, ::2]
            rope.forward(q, k, positions=positions)
            _synchronize(place)
            _assert_rotated(q, q64, ids, frequencies, neox, "float32", f"q ({kind}, {step})")
            _assert_rotated(k, k64, ids, frequencies, neox, "float32", f"k ({kind}, {step})")


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", ("BTHD", "packed"))
def test_backward_with_positions_inverts_forward(rng, layout, place):
    """forward(backward(x)) == a*a*x at the same per-token positions (on the rotated
    columns), and backward alone is the transpose rotation (the oracle with sin negated)."""
    rope, frequencies, neox = _rope("yarn-partial")
    q, q64 = _data(rng, layout, HEADS, "float64" if place == "cpu" else "float32", place)
    positions, ids = _positions(rng, layout, place)
    dtype = "float64" if place == "cpu" else "float32"
    rope.backward(q, None, positions=positions)
    _synchronize(place)
    _assert_rotated(q, q64, ids, frequencies, neox, dtype, "backward", inverse=True)
    rope.forward(q, positions=positions)
    _synchronize(place)
    expected = q64.copy()  # the columns past rotary_dim are left as they were
    expected[..., : frequencies.rotary_dim] *= frequencies.amplitude**2
    relative = 1e-12 if dtype == "float64" else 1e-5  # two roundings in the working dtype
    atol = relative * float(np.abs(expected).max())
    np.testing.assert_allclose(to_float64(q).reshape(q64.shape), expected, rtol=0, atol=atol)


# --------------------------------------------------------------------------- refused calls

_BAD_HOST = {  # max_position, values
    "at-max": (1000, [3, 1000]),
    "negative": (1000, [-1, 5]),
    "int64-wraps-in-int32": (1000, [2**32 + 1, 0]),
    "at-2**24": (None, [0, 2**24]),
    "int64-beyond-2**24": (None, [2**40 + 5, 1]),
}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("container", ("torch", "numpy"))
@pytest.mark.parametrize("bad", _BAD_HOST)
def test_host_positions_out_of_range_are_refused_before_any_write(rng, bad, container, place):
    max_position, values = _BAD_HOST[bad]
    rope, _, _ = _rope("standard-neox", max_position)
    q, q64 = _data(rng, "BT", HEADS, "float32", place)
    k, k64 = _data(rng, "BT", KV_HEADS, "float32", place)
    ids = np.zeros((B, T), np.int64)
    ids[1, rng.integers(T)] = values[0]
    ids[0, rng.integers(T)] = values[1]
    positions = torch.from_numpy(ids) if container == "torch" else ids
    with pytest.raises(ValueError, match="positions must lie in"):
        rope.forward(q, k, positions=positions)
    with pytest.raises(ValueError, match="positions must lie in"):
        apply_rope(q, k, rope, positions=positions)
    _synchronize(place)
    np.testing.assert_array_equal(to_float64(q).reshape(q64.shape), q64)
    np.testing.assert_array_equal(to_float64(k).reshape(k64.shape), k64)


def _call_errors(place):
    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=place)

    q, k = zeros(B, T, HEADS * HEAD_DIM), zeros(B, T, KV_HEADS * HEAD_DIM)
    packed_q, packed_k = zeros(B * T, HEADS * HEAD_DIM), zeros(B * T, KV_HEADS * HEAD_DIM)
    good = torch.zeros(B, T, dtype=torch.int64, device=place)
    flat = torch.zeros(B * T, dtype=torch.int64, device=place)
    return {
        "positions-per-sequence": (lambda r: r.forward(q, k, positions=good[:, 0]), "positions"),
        "positions-too-long": (
            lambda r: r.forward(q, k, positions=torch.zeros(B, T + 1, dtype=torch.int64)),
            "positions",
        ),
        "flat-for-BT": (lambda r: r.forward(q, k, positions=flat), "positions"),
        "BT-for-packed": (lambda r: r.forward(packed_q, packed_k, positions=good), "positions"),
        "packed-without-positions": (lambda r: r.forward(packed_q, packed_k), r"\bq\b"),
        "packed-k-tokens": (
            lambda r: r.forward(packed_q, packed_k[:-1], positions=flat),
            r"\bk\b",
        ),
        "packed-k-heads": (lambda r: r.forward(packed_q, packed_q, positions=flat), r"\bk\b"),
        "offset-and-positions": (
            lambda r: r.backward(q, k, 3, positions=good),
            "position_offset",
        ),
        "apply-rope-offset-and-positions": (
            lambda r: apply_rope(q, k, r, 3, positions=good),
            "position_offset",
        ),
    }


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("name", list(_call_errors("cpu")))
def test_call_errors_name_the_argument(name, place):
    call, match = _call_errors(place)[name]
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, max_position=1000)
    with pytest.raises(ValueError, match=match):
        call(rope)


@pytest.mark.parametrize("place", PLACES)
def test_float_positions_are_a_type_error(place):
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS)
    q = torch.zeros(B, T, HEADS * HEAD_DIM, device=place)
    with pytest.raises(TypeError, match="positions must be an int32 or int64"):
        rope.forward(q, positions=torch.zeros(B, T, device=place))


# --------------------------------------------------------------------------- device bounds


@pytest.mark.gpu
@pytest.mark.parametrize("ids_dtype", ("int32", "int64"))
@pytest.mark.parametrize("max_position", (4096, None))
@pytest.mark.parametrize("layout", ("BT", "packed"))
def test_gpu_out_of_range_device_positions_are_flagged_and_clamped(
    rng, layout, max_position, ids_dtype
):
    limit = max_position or LIMIT
    rope, frequencies, neox = _rope("longrope-partial", max_position)
    values = [5, limit, -3, limit - 1, 2**31 - 1, 0, 77, limit + 1, 9, 1]
    if ids_dtype == "int64":
        values[-1] = 2**40 + 5  # must not wrap to 5
    ids = np.array(values, np.int64).reshape(_token_shape(layout))
    clamped = np.clip(ids, 0, limit - 1)
    q, q64 = _data(rng, layout, HEADS, "float32", "cuda")
    k, k64 = _data(rng, layout, KV_HEADS, "float32", "cuda")
    rope.forward(q, k, positions=torch.from_numpy(ids.astype(ids_dtype)).cuda())  # no raise
    torch.cuda.synchronize()
    # the kernel clamped: every row is the rotation at its clamped position
    _assert_rotated(q, q64, clamped, frequencies, neox, "float32", "q")
    _assert_rotated(k, k64, clamped, frequencies, neox, "float32", "k")

    # the next call raises before it writes anything
    q2, q2_64 = _data(rng, layout, HEADS, "float32", "cuda")
    good = torch.zeros(_token_shape(layout), dtype=torch.int64, device="cuda") + 3
    with pytest.raises(ValueError, match="position"):
        rope.forward(q2, positions=good)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(to_float64(q2).reshape(q2_64.shape), q2_64)
    rope.forward(q2, positions=good)  # reported once: the flag is clear
    rope.check()

    # or check() reports it, after waiting for the device
    rope.forward(q, k, positions=torch.from_numpy(ids.astype(ids_dtype)).cuda())
    with pytest.raises(ValueError, match="position"):
        rope.check()
    rope.check()


@pytest.mark.gpu
@pytest.mark.parametrize("offsets_dtype", ("int32", "int64"))
def test_gpu_device_offsets_without_max_position_are_bounded_by_2_24(rng, offsets_dtype):
    """prefill/decode with a device tensor no longer need max_position: 2**24 bounds them."""
    rope, frequencies, neox = _rope("standard-interleaved-partial")
    q, q64 = _data(rng, "BT", HEADS, "float32", "cuda")
    k, k64 = _data(rng, "BT", KV_HEADS, "float32", "cuda")
    offsets = np.array([0, LIMIT - T])
    rope.prefill(q, k, torch.from_numpy(offsets.astype(offsets_dtype)).cuda())
    torch.cuda.synchronize()
    ids = offsets[:, None] + np.arange(T)
    _assert_rotated(q, q64, ids, frequencies, neox, "float32", "q")
    _assert_rotated(k, k64, ids, frequencies, neox, "float32", "k")
    rope.check()

    step, step64 = _data(rng, "BT", HEADS, "float32", "cuda", seq=1)
    positions = np.array([LIMIT - 1, 12345])
    rope.decode(step, None, torch.from_numpy(positions.astype(offsets_dtype)).cuda())
    torch.cuda.synchronize()
    _assert_rotated(step, step64, positions[:, None], frequencies, neox, "float32", "decode")
    rope.check()
    rope.decode(step, None, torch.tensor([LIMIT, 0], device="cuda"))
    with pytest.raises(ValueError, match="position"):
        rope.check()


# --------------------------------------------------------------------------- rotary_dim

SEED_SHAPES = {"1d": (1100, 64), "2d": (2, 40, 3, 64)}  # 1100 rows cross the 1024 boundary


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("rotary_dim", (16, 48))  # 48: the run-time rotary_dim kernel
@pytest.mark.parametrize("direction", ("Fwd", "Bwd"))
@pytest.mark.parametrize("layout", ("1d", "2d"))
@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
def test_seed_ops_rotary_dim_match_oracle(rng, case, layout, direction, rotary_dim, dtype, place):
    """The first rotary_dim columns rotate with frequencies over rotary_dim (LongRoPE's
    factors: rotary_dim/2 of them); the tail is copied bit for bit; x is untouched."""
    op, frequencies, neox = case.make(direction, layout, rotary_dim, rng, rotary_dim=rotary_dim)
    assert op.rotary_dim == rotary_dim and f"rotary_dim={rotary_dim}" in repr(op)
    host = random_data(rng, SEED_SHAPES[layout], dtype)
    x = to_framework(host, _framework(place))
    y = op(x)
    x64 = host.astype(np.float64)
    assert_matches_oracle(
        y, x64, sequence_positions(host.shape, layout), frequencies, dtype,
        neox=neox, inverse=direction == "Bwd",
    )  # fmt: skip
    np.testing.assert_array_equal(to_float64(x), x64)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
def test_seed_ops_rotary_dim_through_the_dispatcher(rng, case, place):
    """Under autograd the op runs as its torch custom op, rebuilt from its configuration:
    the result is the direct call's, bit for bit (so rotary_dim travels in the config), and
    the gradient is the Bwd twin with the same rotary_dim."""
    state = rng.bit_generator.state  # LongRoPE draws its factors: the same for both ops
    fwd = case.make("Fwd", "2d", 8, rng, rotary_dim=8)[0]
    rng.bit_generator.state = state
    bwd = case.make("Bwd", "2d", 8, rng, rotary_dim=8)[0]
    dtype = torch.float64 if place == "cpu" else torch.float32
    x = torch.from_numpy(rng.standard_normal((2, 9, 3, 16))).to(place, dtype)
    x_grad = x.clone().requires_grad_()
    y = fwd(x_grad)
    assert y.grad_fn is not None
    torch.testing.assert_close(y, fwd(x), rtol=0, atol=0)
    grad = torch.from_numpy(rng.standard_normal(x.shape)).to(place, dtype)
    y.backward(grad)
    torch.testing.assert_close(x_grad.grad, bwd(grad), rtol=0, atol=0)
    torch.testing.assert_close(x_grad.grad[..., 8:], grad[..., 8:], rtol=0, atol=0)


def test_rotary_dim_equal_to_head_dim_is_the_full_rotation(rng):
    x = random_data(rng, (37, 64), "float32")
    full, partial = RoPEFwdOp("interleaved"), RoPEFwdOp("interleaved", rotary_dim=64)
    np.testing.assert_array_equal(partial(x), full(x))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: RoPEFwdOp(rotary_dim=7), ValueError, "rotary_dim"),
        (lambda: RoPEFwdOp(rotary_dim=0), ValueError, "rotary_dim"),
        (lambda: RoPEFwdOp(rotary_dim=True), TypeError, "rotary_dim"),
        (lambda: RoPEFwdOp(rotary_dim=16.0), TypeError, "rotary_dim"),
        (lambda: LongRoPEFwdOp(rescale_factors=[1.0] * 16, rotary_dim=16), ValueError,
         "rescale_factors must have rotary_dim/2 = 8"),
        (lambda: RoPEFwdOp(rotary_dim=80)(np.zeros((3, 64), np.float32)), ValueError,
         "rotary_dim must be <= head_dim"),
        (lambda: RoPEFwdOp("neox", "1d", 10000.0, 16), TypeError, "positional argument"),
    ],
    ids=["odd", "zero", "bool", "float", "longrope-factors", "above-head-dim", "positional"],
)  # fmt: skip
def test_rotary_dim_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", ("BT", "packed"))
def test_apply_rope_with_positions_gradients(rng, layout, place):
    rope, _, _ = _rope("longrope-partial", max_position=1 << 16)
    tokens = _token_shape(layout, seq=2)  # gradcheck's Jacobian is built column by column
    q = random_tensor(rng, (*tokens, HEADS * HEAD_DIM), place, requires_grad=True)
    k = random_tensor(rng, (*tokens, KV_HEADS * HEAD_DIM), place, requires_grad=True)
    positions, _ = _positions(rng, layout, place, "int32", limit=1 << 16, seq=2)
    assert_positions_gradients(rng, rope, q, k, positions, place)


@pytest.mark.parametrize("place", PLACES)
def test_in_place_forward_with_positions_is_recorded_by_autograd(rng, place):
    """forward(q, k, positions=...) on views of a non-leaf: the same gradients as the
    out-of-place apply_rope."""
    rope, _, _ = _rope("yarn-partial")
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    x = random_tensor(rng, (B, T, 8), place)
    w = random_tensor(rng, (8, width), place, requires_grad=True)
    positions, _ = _positions(rng, "BT", place)
    weights = random_tensor(rng, (B, T, width), place)

    qkv = x @ w
    rope.forward(qkv[..., : HEADS * HEAD_DIM], qkv[..., HEADS * HEAD_DIM : 6 * HEAD_DIM],
                 positions=positions)  # fmt: skip
    (qkv * weights).sum().backward()

    w2 = w.detach().requires_grad_()
    qkv2 = x @ w2
    q_rot, k_rot = apply_rope(
        qkv2[..., : HEADS * HEAD_DIM], qkv2[..., HEADS * HEAD_DIM : 6 * HEAD_DIM], rope,
        positions=positions,
    )  # fmt: skip
    (torch.cat([q_rot, k_rot, qkv2[..., 6 * HEAD_DIM :]], dim=-1) * weights).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)


@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
@pytest.mark.parametrize("layout", ("1d", "2d"))
def test_seed_ops_with_rotary_dim_gradcheck(rng, case, layout):
    shape = {"1d": (6, 16), "2d": (2, 3, 2, 16)}[layout]
    state = rng.bit_generator.state
    for direction in ("Fwd", "Bwd"):
        rng.bit_generator.state = state
        op = case.make(direction, layout, 8, rng, rotary_dim=8)[0]
        x = torch.from_numpy(rng.standard_normal(shape)).requires_grad_()
        assert_gradcheck(op, (x,))


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", ("BT", "packed"))
def test_forward_with_positions_compiles_without_recompiling(rng, layout, place):
    rope, frequencies, neox = _rope("yarn-partial")
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM

    def attention_inputs(x, w, positions):
        qkv = x @ w
        q, k = qkv[..., : HEADS * HEAD_DIM], qkv[..., HEADS * HEAD_DIM : 6 * HEAD_DIM]
        rope.forward(q, k, positions=positions)
        return qkv

    for backend in backends(place):
        compiled_inputs, counter = compile_counting(attention_inputs, dynamic=True, backend=backend)
        for seq in (5, 9, 7):  # new lengths: no recompile
            tokens = _token_shape(layout, seq=seq)
            x = random_tensor(rng, (*tokens, 8), place)
            w = random_tensor(rng, (8, width), place)
            positions, ids = _positions(rng, layout, place, "int32", seq=seq)
            with torch.no_grad():  # in place, through rope_qk_
                actual = compiled_inputs(x, w, positions)
            expected = attention_inputs(x, w, positions)
            torch.testing.assert_close(actual, expected)
            q64 = (x @ w).detach().double().cpu().numpy()[..., : HEADS * HEAD_DIM]
            q64 = q64.reshape(*tokens, HEADS, HEAD_DIM)
            dtype = "float64" if place == "cpu" else "float32"
            _assert_rotated(actual[..., : HEADS * HEAD_DIM], q64, ids, frequencies, neox,
                            dtype, "compiled q")  # fmt: skip

            # under autograd: recorded, and the same gradients as eager
            w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
            actual = compiled_inputs(x, w1, positions)
            expected = attention_inputs(x, w2, positions)
            torch.testing.assert_close(actual, expected)
            grad = random_tensor(rng, actual.shape, place)
            actual.backward(grad)
            expected.backward(grad)
            torch.testing.assert_close(w1.grad, w2.grad)
            counter.first_call_done()  # one graph without grad, one with: then no more
        counter.assert_no_recompile()


# --------------------------------------------------------------------------- CUDA graphs

# In its own process: a failed capture poisons the CUDA context.
_CAPTURE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    sys.path.insert(0, "tests")
    from _cases import assert_graph_replays_like_eager
    from _oracle import assert_matches_oracle, standard_frequencies
    from tileops_cupy.rope import RoPE

    layout, max_position = sys.argv[1], None if sys.argv[2] == "none" else int(sys.argv[2])
    rng = np.random.default_rng(int(sys.argv[3]))
    heads, kv_heads, head_dim, batch, seq = 8, 2, 128, 2, 16
    tokens = (batch * seq,) if layout == "packed" else (batch, seq)
    limit = max_position or 1 << 24
    rope = RoPE(head_dim, heads, kv_heads, max_position=max_position)
    width = (heads + 2 * kv_heads) * head_dim

    def fresh():
        qkv = torch.from_numpy(rng.standard_normal((*tokens, width))).to("cuda", torch.bfloat16)
        ids = rng.integers(0, limit, tokens)
        return [qkv, torch.from_numpy(ids.astype(np.int32)).cuda()]

    def step(qkv, positions):
        rope.forward(qkv[..., : heads * head_dim],
                     qkv[..., heads * head_dim : (heads + kv_heads) * head_dim],
                     positions=positions)

    def check(new, written):
        x64 = new[0].double().cpu().numpy()[..., : heads * head_dim]
        y = written[0].double().cpu().numpy()[..., : heads * head_dim]
        ids = new[1].cpu().numpy().astype(np.int64)[..., None]
        shape = (*tokens, heads, head_dim)
        assert_matches_oracle(y.reshape(shape), x64.reshape(shape), ids,
                              standard_frequencies(head_dim), "bfloat16")
        v_start = (heads + kv_heads) * head_dim
        assert torch.equal(written[0][..., v_start:], new[0][..., v_start:])

    assert_graph_replays_like_eager(step, fresh, check)
    rope.check()
    print("replayed", layout, max_position)
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("max_position", ("8192", "none"))
@pytest.mark.parametrize("layout", ("BT", "packed"))
def test_gpu_cuda_graph_replays_forward_with_new_positions(layout, max_position):
    assert_runs_in_own_process(_CAPTURE, layout, max_position, "11")


def test_serving_signatures_and_defaults_are_spec_9s():
    """SPEC 9's names and defaults: the component's MRoPE and norm settings, the
    cos_sin_cache calls' FlashInfer argument order, per-token positions by keyword."""
    component = inspect.signature(RoPE).parameters
    defaults = {name: component[name].default for name in component}
    assert (defaults["mrope_section"], defaults["mrope_interleaved"]) == (None, False)
    assert (defaults["norm_eps"], defaults["norm_weight_offset"]) == (1e-6, 0.0)
    assert component["rotary_dim"].kind == inspect.Parameter.KEYWORD_ONLY
    forward = inspect.signature(RoPE.forward).parameters
    assert list(forward)[:3] == ["self", "q", "k"] and forward["k"].default is None
    assert forward["positions"].kind == inspect.Parameter.KEYWORD_ONLY
    for call in (apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace):
        parameters = inspect.signature(call).parameters
        names = ["positions", "query", "key", "head_size", "cos_sin_cache", "is_neox"]
        assert list(parameters) == names and parameters["is_neox"].default is True
