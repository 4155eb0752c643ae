"""Bad inputs (issue 8): each is a clear error naming the argument, raised before anything
is written, or a correct result.

Covers the memory predicates of ``_arrays`` (``overlapping``, ``self_overlapping``,
``check_in_place``), their use by the in-place component (q and k sharing memory, an
operand that addresses an element twice, read-only memory), the scheme parameters' types
and shapes, argument names in interop errors, and ``bench --json`` printing JSON alone.
Every refused call is checked to leave every input's bytes unchanged.
"""

from __future__ import annotations

import json
import math
import re

import ml_dtypes
import numpy as np
import pytest
import torch
from _cases import GPU, PLACES, require

from tileops_cupy import _torch_ops, bench
from tileops_cupy._arrays import as_operand, overlapping, self_overlapping
from tileops_cupy._rotate import check_token_counts
from tileops_cupy._validate import check_in_place
from tileops_cupy.rope import (
    LongRoPEFwdOp,
    RoPE,
    RoPEFwdOp,
    RoPENeoxPositionIdsFwdOp,
    YaRNFwdOp,
    apply_rope,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)
from tileops_cupy.schemes import Llama31, LongRoPE, Standard, YaRN, scheme_args, scheme_from_args
from tileops_cupy.sequence_modeling import MHCPostBwdOp, MHCPostFwdOp, MHCPreBwdOp, MHCPreFwdOp

HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 16, 4, 2
B, T = 2, 3
Q_WIDTH, K_WIDTH = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
QKV_WIDTH = Q_WIDTH + 2 * K_WIDTH


def _rope(num_kv_heads: int = NUM_KV_HEADS) -> RoPE:
    return RoPE(HEAD_DIM, NUM_HEADS, num_kv_heads, max_position=1000)


def _random(rng, shape, framework="numpy", dtype=np.float32):
    values = rng.standard_normal(shape).astype(dtype)
    return torch.from_numpy(values) if framework == "torch" else values


def _bytes(*arrays) -> list[bytes]:
    """Every element's bytes, in each array's logical order."""
    out = []
    for array in arrays:
        if isinstance(array, torch.Tensor):
            array = array.detach().cpu().contiguous().view(torch.uint8).numpy()
        out.append(np.ascontiguousarray(array).tobytes())
    return out


def _op(array, name="x"):
    return as_operand(array, name)


def _fused(rng, framework, rank):
    """A fused QKV buffer and its q, k, v views ([B, T, H*D] or [B, T, H, D])."""
    qkv = _random(rng, (B, T, QKV_WIDTH), framework)
    if rank == 4:
        heads = qkv.reshape(B, T, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM)
        kv_end = NUM_HEADS + NUM_KV_HEADS
        return qkv, heads[:, :, :NUM_HEADS], heads[:, :, NUM_HEADS:kv_end], heads[:, :, kv_end:]
    q, k = qkv[..., :Q_WIDTH], qkv[..., Q_WIDTH : Q_WIDTH + K_WIDTH]
    return qkv, q, k, qkv[..., Q_WIDTH + K_WIDTH :]


# --------------------------------------------------------------------------- predicates


@pytest.mark.parametrize("framework", ("numpy", "torch"))
@pytest.mark.parametrize("rank", (3, 4))
def test_fused_qkv_views_are_disjoint(rng, framework, rank):
    _, q, k, v = _fused(rng, framework, rank)
    for a, b in ((q, k), (k, q), (k, v), (q, v)):
        assert not overlapping(_op(a), _op(b))
    check_in_place({"q": _op(q), "k": _op(k)})  # no error


def test_per_head_interleaved_views_are_disjoint(rng):
    """q and k as alternating head blocks of one buffer ([B, T, H, 2, D]): still disjoint."""
    buffer = _random(rng, (B, T, NUM_HEADS, 2, HEAD_DIM))
    q, k = buffer[:, :, :, 0], buffer[:, :, :, 1]
    assert not overlapping(_op(q), _op(k))
    assert overlapping(_op(q), _op(buffer[:, :, :, 0, HEAD_DIM // 2 :]))


@pytest.mark.parametrize("framework", ("numpy", "torch"))
def test_k_a_view_of_q_heads_overlaps(rng, framework):
    q = _random(rng, (B, T, Q_WIDTH), framework)
    k = q[..., 2 * HEAD_DIM : 4 * HEAD_DIM]
    assert overlapping(_op(q), _op(k)) and overlapping(_op(k), _op(q))
    assert overlapping(_op(q), _op(q))
    assert overlapping(_op(q[:, ::-1] if framework == "numpy" else q.flip(1)), _op(q)) == (
        framework == "numpy"  # flip copies in torch; a reversed NumPy view shares memory
    )


def test_separate_and_empty_arrays_do_not_overlap(rng):
    a, b = _random(rng, (B, T, Q_WIDTH)), _random(rng, (B, T, Q_WIDTH))
    assert not overlapping(_op(a), _op(b))
    assert not overlapping(_op(a[:, :0]), _op(a))
    assert not overlapping(_op(a[:, :1]), _op(a[:, 1:]))


@pytest.mark.parametrize("dtype", (np.float32, np.float16))
def test_a_band_one_element_past_the_row_end_meets_the_next_row(dtype):
    """Rows of ``width`` elements and ``a`` their left halves: the right halves are apart
    from ``a``; the same band one element further on ends on the next row's first element,
    which is ``a``'s."""
    rows, width = 4, 16
    buffer = np.zeros(rows * width + 1, dtype)
    pitch, size = width * buffer.itemsize, buffer.itemsize

    def band(start: int) -> np.ndarray:
        return np.lib.stride_tricks.as_strided(buffer[start:], (rows, width // 2), (pitch, size))

    a = band(0)
    assert not overlapping(_op(a), _op(band(width // 2)))
    assert overlapping(_op(a), _op(band(width // 2 + 1)))
    assert overlapping(_op(band(width // 2 + 1)), _op(a))


def test_expand_and_broadcast_are_self_overlapping(rng):
    row = _random(rng, (1, T, Q_WIDTH), "torch")
    assert self_overlapping(_op(row.expand(B, T, Q_WIDTH)))
    assert self_overlapping(_op(np.broadcast_to(row.numpy(), (B, T, Q_WIDTH))))
    flat = _random(rng, (T + 1) * Q_WIDTH)
    # batch b, row t is batch 0, row t + b: overlapping rows without any zero stride
    shifted = np.lib.stride_tricks.as_strided(flat, (B, T, Q_WIDTH), (4 * Q_WIDTH, 4 * Q_WIDTH, 4))
    assert self_overlapping(_op(shifted))
    assert not self_overlapping(_op(row.expand(1, T, Q_WIDTH)))  # a size-1 dim repeats nothing


def test_transposed_and_strided_views_do_not_self_overlap(rng):
    x = _random(rng, (6, 8, 10))
    for view in (x, x.T, x.transpose(1, 0, 2), x[::2, ::-1], x[:, 1::3, ::2], x[:0]):
        assert not self_overlapping(_op(view))
    t = torch.from_numpy(x)
    for view in (t.permute(2, 0, 1), t[:, ::2], t.transpose(0, 1)[1:]):
        assert not self_overlapping(_op(view))
    _, q, k, _ = _fused(rng, "torch", 4)
    assert not self_overlapping(_op(q)) and not self_overlapping(_op(k))


def _elements(buffer: np.ndarray, view: np.ndarray) -> list[int]:
    size = buffer.itemsize
    start = (view.__array_interface__["data"][0] - buffer.__array_interface__["data"][0]) // size
    steps = np.array(view.strides) // size
    return [start + int(np.dot(index, steps)) for index in np.ndindex(*view.shape)]


# (2-byte elements too: a band that runs one element past a row's end then starts the next
# row, which a byte of slack in the predicates' bounds would miss)
@pytest.mark.parametrize("dtype", (np.float32, np.float16))
def test_predicates_never_miss_a_shared_element(rng, dtype):
    """Random strided views of one buffer against an exact element count: the predicates
    may be conservative, never wrong the other way."""
    buffer = np.zeros(4096, dtype)
    checked = shared = 0
    while checked < 400:
        views = []
        for _ in range(2):
            ndim = int(rng.integers(1, 4))
            shape = tuple(int(n) for n in rng.integers(1, 5, ndim))
            steps = [int(s) for s in rng.integers(-40, 40, ndim)]
            start = int(rng.integers(200, 500))
            if start + sum((n - 1) * s for n, s in zip(shape, steps, strict=True) if s < 0) < 0:
                continue
            strides = tuple(buffer.itemsize * s for s in steps)
            views.append(np.lib.stride_tricks.as_strided(buffer[start:], shape, strides))
        if len(views) < 2:
            continue
        checked += 1
        a, b = views
        elements_a, elements_b = _elements(buffer, a), _elements(buffer, b)
        if set(elements_a) & set(elements_b):
            shared += 1
            assert overlapping(_op(a), _op(b)), (a.shape, a.strides, b.shape, b.strides)
        if len(set(elements_a)) < len(elements_a):
            assert self_overlapping(_op(a)), (a.shape, a.strides)
    assert shared > 10  # the draw did test overlaps


# --------------------------------------------------------------------------- item 1: q, k overlap

CALLS = {
    "forward": lambda rope, q, k: rope.forward(q, k),
    "prefill": lambda rope, q, k: rope.prefill(q, k, 4),
    "backward": lambda rope, q, k: rope.backward(q, k, 2),
    "decode": lambda rope, q, k: rope.decode(q[:, :1], k[:, :1], np.array([3, 9])),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("framework", ("numpy", "torch"))
def test_q_and_k_the_same_memory_are_refused(rng, framework, call):
    rope = _rope(num_kv_heads=NUM_HEADS)
    q = _random(rng, (B, T, Q_WIDTH), framework)
    before = _bytes(q)
    with pytest.raises(ValueError, match=r"^(grad_)?q and (grad_)?k overlap in memory") as error:
        CALLS[call](rope, q, q)
    assert "expected disjoint memory" in str(error.value)
    assert _bytes(q) == before


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("rank", (3, 4))
@pytest.mark.parametrize("framework", ("numpy", "torch"))
def test_k_a_view_of_q_heads_is_refused(rng, framework, rank, call):
    rope = _rope()
    q = _random(rng, (B, T, Q_WIDTH), framework)
    k = q[..., 2 * HEAD_DIM :]
    if rank == 4:
        q, k = q.reshape(B, T, NUM_HEADS, HEAD_DIM), k.reshape(B, T, NUM_KV_HEADS, HEAD_DIM)
    before = _bytes(q)
    with pytest.raises(ValueError, match=r"^(grad_)?q and (grad_)?k overlap in memory"):
        CALLS[call](rope, q, k)
    assert _bytes(q) == before


@pytest.mark.parametrize("rank", (3, 4))
@pytest.mark.parametrize("framework", ("numpy", "torch"))
def test_fused_qkv_views_still_rotate_in_place(rng, framework, rank):
    rope = _rope()
    qkv, q, k, v = _fused(rng, framework, rank)
    v_before = _bytes(v)
    q_expected, k_expected = apply_rope(q, k, rope, 5)
    rope.prefill(q, k, 5)
    assert _bytes(q, k) == _bytes(q_expected, k_expected)
    assert _bytes(v) == v_before


def test_out_of_place_q_and_k_may_share_memory(rng):
    """apply_rope only reads q and k: the same array twice is fine."""
    rope = _rope(num_kv_heads=NUM_HEADS)
    q = _random(rng, (B, T, Q_WIDTH))
    before = _bytes(q)
    q_rot, k_rot = apply_rope(q, q, rope, 7)
    assert _bytes(q_rot) == _bytes(k_rot) and _bytes(q) == before


def _memory_of(array):
    """``array``'s memory with no autograd history (a torch tensor detached)."""
    return array.detach() if isinstance(array, torch.Tensor) else array


def _positions_in(array, shape):
    """A contiguous int32 view of the start of ``array``'s memory (a contiguous float32
    array), of ``shape``, set to positions 0, 1, ...: an argument that aliases what an
    in-place call writes."""
    memory = _memory_of(array).reshape(-1)
    if isinstance(memory, torch.Tensor):
        ints = memory.view(torch.int32)[: math.prod(shape)].view(shape)
        ints.copy_(torch.arange(ints.numel()).view(shape))
    else:
        ints = memory.view(np.int32)[: math.prod(shape)].reshape(shape)
        ints[...] = np.arange(ints.size).reshape(shape)
    return ints


def _positions(like, count):
    if isinstance(like, torch.Tensor):
        return torch.arange(count, device=like.device)
    return np.arange(count)


# in-place calls with an argument in the memory of ``home`` (q, or an array shaped as q):
# (q, k, home) -> (a function of the component, its further arguments, its keywords), the
# argument made (and its positions written) when the call is
READS_OF_Q = {
    "positions": lambda q, k, home: (
        RoPE.forward,
        (q, k),
        {"positions": _positions_in(home, (B, T))},
    ),
    "position_offset": lambda q, k, home: (
        RoPE.prefill,
        (q, k, _positions_in(home, (B,))),
        {},
    ),
    "position": lambda q, k, home: (
        RoPE.decode,
        (q[:, :1], k[:, :1], _positions_in(home, (B,))),
        {},
    ),
    "cos_sin_cache": lambda q, k, home: (
        lambda _, *arguments: apply_rope_with_cos_sin_cache_inplace(*arguments),
        (_positions(q, T), q[0], k[0], HEAD_DIM, _memory_of(home)[0, 0].reshape(-1, HEAD_DIM)),
        {},
    ),
    "q_norm_weight": lambda q, k, home: (
        RoPE.prefill,
        (q, k, 0),
        {
            "q_norm_weight": _memory_of(home)[0, 0, :HEAD_DIM],
            "k_norm_weight": _memory_of(k)[0, 0, :HEAD_DIM] * 0 + 1,
        },
    ),
}


def _refused_as_reading_q(rope, q, k, read):
    """The call READS_OF_Q[read] with its argument in q's memory: refused, nothing written."""
    rotate, arguments, keywords = READS_OF_Q[read](q, k, q)  # (aliasing positions written)
    before = _bytes(q, k)
    written = "query" if read == "cos_sin_cache" else "q"
    with pytest.raises(ValueError, match=f"^{read} overlaps {written} in memory, which this call"):
        rotate(rope, *arguments, **keywords)
    assert _bytes(q, k) == before


@pytest.mark.parametrize("read", list(READS_OF_Q))
@pytest.mark.parametrize(
    ("place", "framework", "grad"),
    [
        ("cpu", "numpy", False), ("cpu", "torch", False), ("cpu", "torch", True),
        *(pytest.param("cuda", "torch", grad, marks=GPU) for grad in (False, True)),
    ],
)  # fmt: skip
def test_an_argument_in_q_memory_is_refused_before_any_write(rng, place, framework, read, grad):
    """Positions, offsets, a cos_sin_cache or a norm weight in q's memory would be read after
    q is written (the host rotates q, then k; on a device the two race): a ValueError naming
    both, before anything changes, with or without autograd (torch tensors only)."""
    require(place, framework)
    q, k = (_random(rng, (B, T, width), framework) for width in (Q_WIDTH, K_WIDTH))
    if framework == "torch":
        q, k = (t.to(place).requires_grad_(grad) * 1 for t in (q, k))
    _refused_as_reading_q(_rope(), q, k, read)


@GPU
@pytest.mark.parametrize("read", list(READS_OF_Q))
def test_a_recorded_launch_refuses_an_argument_in_q_memory(rng, read):
    """A later call of a recorded layout re-runs its launch with new addresses: an argument
    that now lies in q's memory (the layout unchanged) takes the validated path, refused."""
    require("cuda", "torch")
    rope = _rope()
    q, k, home = (
        torch.from_numpy(_random(rng, (B, T, width))).cuda()
        for width in (Q_WIDTH, K_WIDTH, Q_WIDTH)
    )
    rotate, arguments, keywords = READS_OF_Q[read](q, k, home)
    rotate(rope, *arguments, **keywords)  # apart: rotated, and its launch recorded
    _refused_as_reading_q(rope, q, k, read)


# --------------------------------------------------------------------------- item 2: self overlap


def _expanded(rng, framework, width):
    row = _random(rng, (1, T, width), framework)
    if framework == "torch":
        return row, row.expand(B, T, width)
    # a writable zero-stride view (np.broadcast_to would be read-only)
    return row, np.lib.stride_tricks.as_strided(row, (B, T, width), (0, *row.strides[1:]))


@pytest.mark.parametrize("name", ("q", "k"))
@pytest.mark.parametrize("framework", ("numpy", "torch"))
def test_expanded_batch_is_refused_in_place(rng, framework, name):
    rope = _rope()
    q = _random(rng, (B, T, Q_WIDTH), framework)
    k = _random(rng, (B, T, K_WIDTH), framework)
    row, expanded = _expanded(rng, framework, Q_WIDTH if name == "q" else K_WIDTH)
    q, k = (expanded, k) if name == "q" else (q, expanded)
    before = _bytes(row, q, k)
    for positions in (np.array([0, 11]), 0):
        with pytest.raises(ValueError, match=rf"^{name} addresses some elements more than once"):
            rope.prefill(q, k, positions)
    assert _bytes(row, q, k) == before


def test_overlapping_rows_are_refused_in_place(rng):
    """Batch 1's row t is batch 0's row t+1: no zero stride, still written twice."""
    rope = _rope()
    flat = _random(rng, (T + 1) * Q_WIDTH)
    q = np.lib.stride_tricks.as_strided(flat, (B, T, Q_WIDTH), (4 * Q_WIDTH, 4 * Q_WIDTH, 4))
    before = _bytes(flat)
    with pytest.raises(ValueError, match=r"^q addresses some elements more than once"):
        rope.prefill(q, None, np.array([0, 20]))
    assert _bytes(flat) == before


@pytest.mark.parametrize("framework", ("numpy", "torch"))
def test_out_of_place_inputs_may_alias_themselves(rng, framework):
    """An expanded input is only read by apply_rope: each sequence gets its own rotation."""
    rope = _rope()
    _, q = _expanded(rng, framework, Q_WIDTH)
    positions = np.array([0, 11])
    q_rot, _ = apply_rope(q, None, rope, positions)
    dense = q.clone() if framework == "torch" else q.copy()
    rope.prefill(dense, None, positions)
    assert _bytes(q_rot) == _bytes(dense)
    assert _bytes(q_rot[0]) != _bytes(q_rot[1])


# --------------------------------------------------------------------------- item 3: read-only


@pytest.mark.parametrize("read_only", ("q", "k"))
@pytest.mark.parametrize("q_framework", ("numpy", "torch"))
def test_read_only_operand_is_refused_before_any_write(rng, q_framework, read_only):
    rope = _rope()
    q = _random(rng, (B, T, Q_WIDTH), q_framework)
    k = _random(rng, (B, T, K_WIDTH))
    if read_only == "q":
        q = _random(rng, (B, T, Q_WIDTH))
        q.flags.writeable = False
    else:
        k.flags.writeable = False
    before = _bytes(q, k)
    for call in CALLS.values():
        with pytest.raises(
            ValueError, match=rf"^(grad_)?{read_only} is read-only.*expected writable"
        ):
            call(rope, q, k)
    assert _bytes(q, k) == before
    q_rot, k_rot = apply_rope(q, k, rope, 3)  # reading read-only memory is fine
    assert q_rot.shape == q.shape and k_rot.shape == k.shape


def test_read_only_view_of_a_writable_buffer_is_refused(rng):
    rope = _rope()
    qkv, q, k, _ = _fused(rng, "numpy", 3)
    k = k.view()
    k.flags.writeable = False
    before = _bytes(qkv)
    with pytest.raises(ValueError, match=r"^k is read-only"):
        rope.prefill(q, k, 0)
    assert _bytes(qkv) == before


# --------------------------------------------------------------------------- items 4, 5: schemes

TYPE_ERRORS = [
    (lambda: YaRNFwdOp(original_max_position="4096"), "original_max_position"),
    (lambda: LongRoPEFwdOp(max_position_embeddings="8192"), "max_position_embeddings"),
    (
        lambda: LongRoPEFwdOp(original_max_position_embeddings="2048"),
        "original_max_position_embeddings",
    ),
    (lambda: LongRoPEFwdOp(rescale_factors="abc"), "rescale_factors"),
    (lambda: LongRoPE(rescale_factors=["1.0", "2.0"]), "rescale_factors"),
    (lambda: LongRoPE(rescale_factors=[True, False]), "rescale_factors"),
    (lambda: LongRoPE(rescale_factors=[1.0, None]), "rescale_factors"),
    (lambda: LongRoPE(rescale_factors=[[1.0, 2.0], [3.0]]), "rescale_factors"),
    (lambda: Llama31(original_max_position=8192.0), "original_max_position"),
    (lambda: Llama31(original_max_position=True), "original_max_position"),
    (lambda: YaRN(original_max_position=4096.5), "original_max_position"),
    (lambda: LongRoPE(max_position_embeddings=np.float64(8192)), "max_position_embeddings"),
    (lambda: Standard(base="10000"), "base"),
    (lambda: Standard(base=True), "base"),
    (lambda: YaRN(scale="4"), "scale"),
    (lambda: Llama31(scale_factor=np.array(8.0)), "scale_factor"),
    (lambda: RoPE("64", 4), "head_dim"),
    (lambda: RoPE(64, 4.0), "num_heads"),
    (lambda: RoPE(64, 4, mrope_section=(8, 12, 12), mrope_interleaved=1), "mrope_interleaved"),
    (
        lambda: apply_rope_with_cos_sin_cache(
            np.zeros(1, int), np.zeros((1, 64)), None, True, np.zeros((2, 64))
        ),
        "head_size",
    ),
]


@pytest.mark.parametrize(("make", "name"), TYPE_ERRORS)
def test_scheme_parameters_of_the_wrong_type_fail_at_construction(make, name):
    with pytest.raises(TypeError, match=rf"^{name} must be") as error:
        make()
    assert "got" in str(error.value)


@pytest.mark.parametrize(
    "make",
    (
        lambda: LongRoPEFwdOp(max_position_embeddings=10**400),
        lambda: Llama31(original_max_position=2**53 + 1),
    ),
)
def test_scheme_ints_beyond_float64_are_refused_by_name(make):
    """A scheme's numbers travel as float64 (scheme_args): an int field must come back
    equal, so one past 2**53 is a ValueError naming it, not an OverflowError (or a
    different table) later."""
    with pytest.raises(ValueError, match=r"^(max_position_embeddings|original_max_position) "):
        make()


def test_numpy_bools_and_bfloat16_factors_are_taken_as_python_ones():
    """NumPy's bool is taken where a bool is, as NumPy's ints are where an int is, and an
    ml_dtypes bfloat16 array of factors as a torch bfloat16 tensor is."""
    q = np.ones((2, 64), np.float32)
    cache = np.tile(np.float32([1] * 16 + [0] * 16), (4, 1))
    for neox in (np.True_, np.False_):
        got = apply_rope_with_cos_sin_cache(np.array([1, 3]), q, None, 64, cache, neox)[0]
        assert np.array_equal(got, q)  # cos 1, sin 0: the identity
    assert RoPE(64, 4, mrope_section=(8, 12, 12), mrope_interleaved=np.True_).mrope_interleaved
    factors = np.linspace(1, 4, 32)
    assert LongRoPE(rescale_factors=factors.astype(ml_dtypes.bfloat16)) == LongRoPE(
        rescale_factors=factors.astype(ml_dtypes.bfloat16).astype(np.float64)
    )


def test_int_fields_stay_ints_and_numpy_numbers_are_accepted():
    llama = Llama31(original_max_position=np.int64(8192), scale_factor=np.float32(8.0))
    assert type(llama.original_max_position) is int and type(llama.scale_factor) is float
    assert llama == Llama31() and hash(llama) == hash(Llama31())
    longrope = LongRoPE(10000, None, np.int32(8192), 4096)
    assert type(longrope.max_position_embeddings) is int
    assert type(YaRN(original_max_position=np.int16(4096)).original_max_position) is int


@pytest.mark.parametrize(
    "scheme",
    [
        Standard(500000.0),
        Llama31(original_max_position=8192),
        YaRN(scale=4.0, original_max_position=2048, attn_factor=0.5),
        LongRoPE(10000.0, [1.0, 1.5, 2.0, 8.0], 8192, 2048),
        LongRoPE(10000.0, None, 4096, 4096),
    ],
    ids=str,
)
def test_scheme_args_round_trip(scheme):
    name, numbers = scheme_args(scheme)
    assert all(type(n) is float for n in numbers)  # what a torch schema carries
    rebuilt = scheme_from_args(name, numbers)
    assert rebuilt == scheme and hash(rebuilt) == hash(scheme)
    for field, value in vars(scheme).items():
        assert type(getattr(rebuilt, field)) is type(value), field


@pytest.mark.parametrize(
    "factors",
    [np.ones((2, 4)), [[1.0] * 4] * 2, torch.ones(2, 4), np.float64(2.0), np.ones((8, 1))],
    ids=["numpy-2x4", "list-2x4", "torch-2x4", "scalar", "numpy-8x1"],
)
def test_rescale_factors_must_be_one_dimensional(factors):
    shape = tuple(np.shape(factors))
    for make in (lambda: LongRoPE(rescale_factors=factors),
                 lambda: LongRoPEFwdOp(rescale_factors=factors)):  # fmt: skip
        with pytest.raises(ValueError, match="rescale_factors") as error:
            make()
        assert str(shape) in str(error.value)


def test_one_dimensional_rescale_factors_still_work(rng):
    factors = rng.uniform(1.0, 4.0, 8)
    x = rng.standard_normal((5, 16))
    for given in (factors, factors.tolist(), torch.from_numpy(factors), tuple(factors)):
        op = LongRoPEFwdOp(rescale_factors=given)
        assert np.array_equal(op(x), LongRoPEFwdOp(rescale_factors=factors)(x))


# --------------------------------------------------------------------------- item 6: names


def test_meta_tensor_is_named():
    """Memory on meta is nothing a body can read: named where it would be described. (The
    ops themselves answer meta tensors with meta tensors, through their fake
    implementations: test_torch.py.)"""
    meta = torch.empty(4, 16, device="meta")
    with pytest.raises(ValueError, match=r"^x is a torch tensor on meta; expected cpu or cuda"):
        as_operand(meta, "x")


SPARSE_AND_NESTED = {
    "sparse_coo": lambda t: t.to_sparse(),
    "sparse_csr": lambda t: t.to_sparse_csr(),
    "nested": lambda t: torch.nested.nested_tensor(list(t)),
}


@pytest.mark.parametrize("layout", list(SPARSE_AND_NESTED))
@pytest.mark.parametrize("grad", (False, True))
def test_sparse_and_nested_tensors_are_named(rng, layout, grad):
    """A sparse or nested tensor has no one pointer and strides: each op's call names it
    (the seed op's x, apply_rope's k, mHC pre's x), with or without autograd watching,
    instead of failing inside torch ("Cannot access data pointer ...")."""

    def dense(*shape):
        return torch.from_numpy(rng.standard_normal(shape)).float()

    def odd(*shape):  # (a nested tensor of rows: one per leading index)
        return SPARSE_AND_NESTED[layout](dense(*shape)).requires_grad_(grad)

    calls = {
        "x": lambda: RoPEFwdOp()(odd(4, HEAD_DIM)),
        "k": lambda: apply_rope(dense(1, T, Q_WIDTH), odd(T, K_WIDTH), _rope()),
        "x ": lambda: MHCPreFwdOp(1.0, 1.0, 1.0, 2)(dense(2 * 8, 8), odd(3, 2 * 8), dense(8)),
    }
    for name, call in calls.items():
        expected = f"^{name.strip()} must be a dense \\(strided\\) torch tensor, got a {layout}"
        with pytest.raises(TypeError, match=expected):
            call()


def test_a_tensor_with_the_negation_bit_is_named(rng):
    """``z.conj().imag`` of a complex z: a float tensor whose memory holds the negated
    values (torch's lazy negation bit). Read as memory it would be the wrong sign; it is
    refused, naming the argument, instead of torch's error from ``.numpy()``."""
    z = torch.from_numpy(rng.standard_normal((4, 2 * HEAD_DIM))).float()
    negated = torch.view_as_complex(z.view(4, HEAD_DIM, 2)).conj().imag
    assert negated.is_neg()
    with pytest.raises(TypeError, match=r"^x has torch's lazy negation bit set .* x.resolve_neg"):
        RoPEFwdOp()(negated)
    torch.testing.assert_close(RoPEFwdOp()(negated.resolve_neg()), RoPEFwdOp()(-z[:, 1::2]))


def _packed_field(rng, shape):
    """A float32 field of a packed structured array: byte strides that are not whole
    float32 elements."""
    packed = np.zeros(shape, dtype=[("tag", "u1"), ("value", "f4")])
    packed["value"] = rng.standard_normal(shape)
    return packed, packed["value"]


def test_misaligned_strides_are_named(rng):
    packed, x = _packed_field(rng, (6, HEAD_DIM))
    before = _bytes(packed)
    with pytest.raises(ValueError, match=r"^x has byte strides \(80, 5\).*itemsize 4"):
        RoPEFwdOp()(x)
    _, q = _packed_field(rng, (B, T, Q_WIDTH))
    with pytest.raises(ValueError, match=r"^q has byte strides"):
        _rope().forward(q, None)
    with pytest.raises(ValueError, match=r"^q has byte strides"):
        apply_rope(q, None, _rope())
    assert _bytes(packed) == before
    # the copy the message suggests is accepted
    assert np.array_equal(RoPEFwdOp()(np.ascontiguousarray(x)), RoPEFwdOp()(x.copy()))


# --------------------------------------------------------------------------- through torch
# A call that autograd records or a tracer watches goes through torch's dispatcher, not the
# direct path: it must refuse what the direct path refuses, before anything is written.


def _unwritable(kind: str, width: int) -> torch.Tensor:
    """A [B, T, width] tensor that autograd forbids to change in place, made as ``kind``."""
    if kind == "split":  # one of the views a multi-output function returned
        x = torch.randn(B, T, 8, requires_grad=True)
        return (x @ torch.randn(8, 2 * width)).split([width, width], dim=-1)[0]
    if kind == "view of a leaf":
        return torch.randn(B, T, 2 * width, requires_grad=True)[..., :width]
    with torch.inference_mode():
        return torch.randn(B, T, width)


@pytest.mark.parametrize("which", ("q", "k"))
@pytest.mark.parametrize("kind", ("split", "view of a leaf", "inference tensor"))
def test_in_place_under_autograd_refuses_before_any_write(rng, which, kind):
    """q rotates first and k second (copies of the rotation, as torch records in-place
    ops): a q or k that autograd will not let change must be refused, with a ValueError
    naming it, before either changes."""
    width = {"q": Q_WIDTH, "k": K_WIDTH}
    tensors = {
        name: _unwritable(kind, width[name])
        if name == which
        else _random(rng, (B, T, width[name]), "torch").requires_grad_() * 1
        for name in ("q", "k")
    }
    before = _bytes(*tensors.values())
    reason = "is an inference tensor" if kind == "inference tensor" else "cannot be rotated"
    with pytest.raises(ValueError, match=f"^{which} {reason}"):
        _rope().forward(tensors["q"], tensors["k"])
    assert _bytes(*tensors.values()) == before


# in-place calls under autograd that are refused after q and k pass their own checks, with
# the argument each names
REFUSED_LATE = {
    "positions out of range": (
        "positions",
        lambda q, k: _rope().forward(q, k, positions=torch.full((B, T), 1000)),
    ),
    "float positions": (
        "positions",
        lambda q, k: _rope().forward(q, k, positions=torch.zeros(B, T)),
    ),
    "float64 cos_sin_cache": (
        "cos_sin_cache",
        lambda q, k: apply_rope_with_cos_sin_cache_inplace(
            torch.arange(T), q[0], k[0], HEAD_DIM, torch.zeros(T, HEAD_DIM, dtype=torch.float64)
        ),
    ),
}


@pytest.mark.parametrize("call", list(REFUSED_LATE))
def test_a_refused_in_place_call_under_autograd_leaves_autograd_as_it_was(rng, call):
    """q and k views of one tensor autograd tracks, which an op saved for its backward: a
    call refused for another argument leaves their version counter alone (torch's probe of
    whether q and k may change writes nothing), so that backward still runs."""
    name, rotate = REFUSED_LATE[call]
    x = torch.from_numpy(_random(rng, (B, T, Q_WIDTH + K_WIDTH))).requires_grad_()
    mixed = x * 1
    q, k = mixed[..., :Q_WIDTH], mixed[..., Q_WIDTH:]
    saved = (mixed * mixed).sum()  # saves mixed
    with pytest.raises((ValueError, TypeError), match=name):
        rotate(q, k)
    assert mixed._version == 0
    saved.backward()
    np.testing.assert_array_equal(x.grad.numpy(), 2 * x.detach().numpy())


def test_a_view_made_under_no_grad_is_refused_and_left_usable(rng):
    """k made under no_grad from the memory q (made with grad) views: autograd forbids k to
    change in place, so the call names k; q's probe before it must not have left k's base
    changed in autograd's eyes, which would make every later use of k raise."""
    mixed = torch.from_numpy(_random(rng, (B, T, Q_WIDTH + K_WIDTH))).requires_grad_() * 1
    with torch.no_grad():
        k = mixed[..., Q_WIDTH:]
    q = mixed[..., :Q_WIDTH]
    before = _bytes(q, k)
    with pytest.raises(ValueError, match="^k "):
        _rope().prefill(q, k, 0)
    assert _bytes(q, k) == before
    assert torch.equal(k * 1, mixed.detach()[..., Q_WIDTH:])


def test_a_k_refused_after_q_passed_its_probe_leaves_their_base_unchanged(rng):
    """q a plain view of a tensor autograd saved, k one of the views ``split`` returned (which
    autograd forbids to change in place): q's probe passes and k's fails, so the call names
    k; the version counter that q's probe bumped on their base is put back, so the backward
    that saved the base still runs."""
    x = torch.from_numpy(_random(rng, (B, T, QKV_WIDTH))).requires_grad_()
    mixed = x * 1
    saved = (mixed * mixed).sum()  # saves mixed
    q = mixed[..., :Q_WIDTH]
    _, k, _ = mixed.split([Q_WIDTH, K_WIDTH, K_WIDTH], dim=-1)
    before = _bytes(q, k)
    with pytest.raises(ValueError, match="^k cannot be rotated in place here"):
        _rope().prefill(q, k, 0)
    assert _bytes(q, k) == before
    assert mixed._version == 0
    saved.backward()
    np.testing.assert_array_equal(x.grad.numpy(), 2 * x.detach().numpy())


@pytest.mark.parametrize(
    ("call", "name"),
    (
        (lambda q, k: _rope().prefill(q, k, 0), "k"),
        (
            lambda q, k: apply_rope_with_cos_sin_cache_inplace(
                torch.arange(T), q[0], k[0], HEAD_DIM, torch.zeros(T, HEAD_DIM)
            ),
            "key",
        ),
    ),
    ids=("prefill", "cos_sin_cache"),
)
def test_a_numpy_k_beside_a_q_autograd_tracks_is_named(rng, call, name):
    """The dispatcher takes torch tensors only: a NumPy k is a TypeError naming it (under
    the cos_sin_cache call's name), before any write."""
    q = torch.from_numpy(_random(rng, (B, T, Q_WIDTH))).requires_grad_() * 1
    k = _random(rng, (B, T, K_WIDTH))
    before = _bytes(q, k)
    with pytest.raises(TypeError, match=f"^{name} must be a torch tensor, got numpy.ndarray"):
        call(q, k)
    assert _bytes(q, k) == before


# the in-place calls and the names they give q and k, on tensors of one device
INFERENCE_CALLS = {
    "forward": (
        ("q", "k"),
        lambda rope, q, k: rope.forward(
            q, k, positions=torch.randint(0, 1000, (B, T), device=q.device)
        ),
    ),
    "prefill": (("q", "k"), lambda rope, q, k: rope.prefill(q, k, 4)),
    "decode": (
        ("q", "k"),
        lambda rope, q, k: rope.decode(q[:, :1], k[:, :1], torch.tensor([3, 9], device=q.device)),
    ),
    "cos_sin_cache": (
        ("query", "key"),
        lambda rope, q, k: apply_rope_with_cos_sin_cache_inplace(
            torch.arange(T, device=q.device),
            q[0],
            k[0],
            HEAD_DIM,
            torch.randn(T, HEAD_DIM, device=q.device),
        ),
    ),
}


@pytest.mark.parametrize("which", (0, 1), ids=("q", "k"))
@pytest.mark.parametrize("call", list(INFERENCE_CALLS))
@pytest.mark.parametrize("place", PLACES)
def test_an_inference_tensor_outside_inference_mode_is_refused_before_any_write(
    rng, place, call, which
):
    """Torch refuses to write an inference tensor (made under ``torch.inference_mode``) in
    place outside inference mode, and so does every in-place call where no autograd is
    involved (the direct path): a ValueError naming q or k before either changes. Under
    inference mode the same call rotates both."""
    require(place, "torch")
    names, rotate = INFERENCE_CALLS[call]
    tensors = []
    for i, width in enumerate((Q_WIDTH, K_WIDTH)):
        values = torch.from_numpy(_random(rng, (B, T, width))).to(place)
        if i == which:
            with torch.inference_mode():
                values = values.clone()
        tensors.append(values)
    q, k = tensors
    assert tensors[which].is_inference() and not tensors[1 - which].is_inference()
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=f"^{names[which]} is an inference tensor .* forbids"):
        rotate(_rope(), q, k)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    with torch.inference_mode():
        rotate(_rope(), q, k)
    assert not any(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


def test_the_relaunch_test_refuses_exactly_inference_tensors_outside_inference_mode():
    """The recorded in-place launch's test (``_torch_ops.inference_writes_refused``, which
    the GPU test below exercises through a decode step): true when q or k is an inference
    tensor and inference mode is off; false under inference mode, for either tensor."""
    normal = torch.zeros(2)
    with torch.inference_mode():
        inference = torch.zeros(2)
    refused = _torch_ops.inference_writes_refused
    assert not refused(normal, None) and not refused(normal, normal)
    assert refused(inference, None) and refused(normal, inference) and refused(inference, normal)
    with torch.inference_mode():
        assert not refused(inference, inference) and not refused(normal, inference)


@GPU
def test_a_recorded_launch_is_not_rerun_on_an_inference_tensor_outside_inference_mode(rng):
    """A decode step's launch, recorded by calls under inference mode on inference tensors,
    is not re-run for the same layout once inference mode is off: that call takes the
    validated path, which refuses q before anything is written."""
    require("cuda", "torch")
    rope = _rope()
    positions = torch.tensor([3, 9], device="cuda")
    with torch.inference_mode():
        q = torch.randn(B, 1, Q_WIDTH, device="cuda")
        k = torch.randn(B, 1, K_WIDTH, device="cuda")
        for _ in range(2):  # (the first call records the launch, the second re-runs it)
            rope.decode(q, k, positions)
    assert rope._relaunches, "the calls under inference mode recorded no launch"
    before = (q.clone(), k.clone())
    with pytest.raises(ValueError, match="^q is an inference tensor"):
        rope.decode(q, k, positions)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


# the call a recorded launch is made by, for each argument it leaves out
RECORDED_WITHOUT = {
    "positions": lambda rope, q, k: rope.forward(q, k),
    "norm weights": lambda rope, q, k: rope.prefill(q, k, 0),
    "k": lambda rope, q, k: rope.prefill(q, None, 0),
}


def _call_with(argument, rope, q, k, convert, data):
    """RECORDED_WITHOUT[argument]'s call passing that argument (``convert`` of its data);
    returns the k it rotated."""
    if argument == "positions":
        rope.forward(q, k, positions=convert(data["ids"]))
    elif argument == "norm weights":
        weights = (convert(data["q_weight"]), convert(data["k_weight"]))
        rope.prefill(q, k, 0, q_norm_weight=weights[0], k_norm_weight=weights[1])
    else:
        k = convert(data["k"])
        rope.prefill(q, k, 0)
    return k


@GPU
@pytest.mark.parametrize("framework", ("numpy", "cupy"))
@pytest.mark.parametrize("argument", list(RECORDED_WITHOUT))
def test_a_recorded_launch_is_not_rerun_with_an_argument_it_did_not_have(rng, argument, framework):
    """A launch recorded for a call without positions, norm weights or k re-runs only for
    calls without them: the same call passing them as NumPy or CuPy arrays takes the
    validated path, which uses them as a first call does or refuses them before writing."""
    require("cuda", "torch")
    convert = np.asarray if framework == "numpy" else pytest.importorskip("cupy").asarray
    data = {
        "q": _random(rng, (B, T, Q_WIDTH)),
        "k": _random(rng, (B, T, K_WIDTH)),
        "ids": rng.integers(0, 1000, (B, T)),
        "q_weight": _random(rng, HEAD_DIM),
        "k_weight": _random(rng, HEAD_DIM),
    }

    def fresh():
        return tuple(torch.from_numpy(data[name]).cuda() for name in ("q", "k"))

    def on_device(array):
        return torch.from_numpy(array).cuda()

    rope = _rope()
    for _ in range(2):  # (the first records the launch, the second re-runs it)
        RECORDED_WITHOUT[argument](rope, *fresh())
    assert rope._relaunches, "the first calls recorded no launch"
    q_expected, k = fresh()
    k_expected = _call_with(argument, _rope(), q_expected, k, on_device, data)
    q, k = fresh()
    before = _bytes(q, k)
    try:
        k_got = _call_with(argument, rope, q, k, convert, data)
    except (ValueError, TypeError) as error:  # refused: named, nothing written
        assert re.search(r"\b(positions|q_norm_weight|k_norm_weight|k)\b", str(error))
        assert _bytes(q, k) == before
    else:
        k_got = k_got.get() if hasattr(k_got, "get") else k_got
        assert _bytes(q, k_got) == _bytes(q_expected, k_expected)


@pytest.mark.parametrize("transform", ("vjp", "vmap"))
def test_overlapping_q_and_k_are_refused_under_torch_func(rng, transform):
    """A transform's wrappers hold the memory they address: q and k sharing a head are
    refused there as in eager mode, and nothing is written."""
    rope = _rope()

    def rotate(x):
        rope.forward(x[..., :Q_WIDTH], x[..., HEAD_DIM : HEAD_DIM + K_WIDTH])
        return x

    data = _random(rng, (B, B, T, QKV_WIDTH), "torch")
    before = _bytes(data)
    with pytest.raises(ValueError, match="^q and k overlap in memory"):
        if transform == "vjp":
            torch.func.vjp(lambda x: rotate(x * 1), data[0].requires_grad_())
        else:
            torch.func.vmap(rotate)(data)
    assert _bytes(data) == before


@pytest.mark.parametrize("grad", (False, True))
@pytest.mark.parametrize("offset", (True, 2.0, np.float32(2)))
def test_a_position_offset_that_is_no_int_is_refused(rng, grad, offset):
    """A bool is an int to Python and a float no array: either way, a TypeError naming the
    argument, on the direct path and through the dispatcher alike."""
    q = _random(rng, (B, T, Q_WIDTH), "torch").requires_grad_(grad)
    with pytest.raises(TypeError, match="^position_offset must be an int or an int32/int64"):
        apply_rope(q, None, _rope(), offset)


@pytest.mark.parametrize("framework", ("numpy", "torch"))
def test_per_sequence_offsets_of_an_empty_chunk_are_taken(rng, framework):
    """A chunk of T = 0 tokens has no positions, so offsets in range pass, as an int offset
    does (its last position, offset + T - 1, was checked: -1 for an offset 0); with tokens,
    a last position past max_position is named as such."""
    rope = _rope()
    offsets = np.array([0, 999]) if framework == "numpy" else torch.tensor([0, 999])
    q = _random(rng, (B, 0, Q_WIDTH), framework)
    rope.prefill(q, None, offsets)
    assert apply_rope(q, None, rope, offsets)[0].shape == (B, 0, Q_WIDTH)
    q = _random(rng, (B, T, Q_WIDTH), framework)
    before = _bytes(q)
    with pytest.raises(ValueError, match=r"^position_offset \+ T - 1 \(a sequence's last "):
        rope.prefill(q, None, offsets)
    assert _bytes(q) == before


@pytest.mark.filterwarnings("error")  # (a NumPy int's overflow warns)
@pytest.mark.parametrize("position", (2**63, np.int64(2**63 - 1), np.uint64(2**64 - 1)))
@pytest.mark.parametrize("grad", (False, True))
def test_a_position_offset_beyond_int64_is_refused(rng, grad, position):
    q = _random(rng, (B, 1, Q_WIDTH), "torch").requires_grad_(grad) * 1
    with pytest.raises(ValueError, match=r"^position must (keep positions|be a position) in"):
        _rope().decode(q, None, position)


def test_arrays_of_another_framework_are_named_through_the_dispatcher(rng):
    """Autograd records calls on tensors that require grad: torch's dispatcher then takes
    every tensor argument, and one that is a NumPy array is named, not a schema type."""
    q = _random(rng, (T, Q_WIDTH), "torch").requires_grad_()
    positions = np.arange(T)
    apply_rope(q.detach(), None, _rope(), positions=positions)  # direct: any framework
    with pytest.raises(TypeError, match="^positions must be a torch tensor, got numpy.ndarray"):
        apply_rope(q, None, _rope(), positions=positions)
    phi = np.zeros((32, 24), np.float32)
    x = _random(rng, (B, 32), "torch").requires_grad_()
    with pytest.raises(TypeError, match="^phi must be a torch tensor, got numpy.ndarray"):
        MHCPreFwdOp(1, 1, 1, 3)(phi, x, torch.zeros(24))
    # in place (autograd records the rotation, then its copy into q and k): the same names,
    # before anything is written
    q, k = (
        _random(rng, (B, T, width), "torch").requires_grad_() * 1 for width in (Q_WIDTH, K_WIDTH)
    )
    before = _bytes(q, k)
    weight = np.ones(HEAD_DIM, np.float32)
    in_place = {
        "positions": lambda: _rope().forward(q, k, positions=np.zeros((B, T), np.int64)),
        "position_offset": lambda: _rope().prefill(q, k, np.arange(B)),
        "q_norm_weight": lambda: _rope().prefill(
            q, k, 0, q_norm_weight=weight, k_norm_weight=weight
        ),
    }
    for name, call in in_place.items():
        with pytest.raises(TypeError, match=f"^{name} must be a torch tensor, got numpy.ndarray"):
            call()
    assert _bytes(q, k) == before


def test_an_empty_head_dim_is_refused():
    with pytest.raises(ValueError, match=r"head_dim \(x.shape\[-1\]\) must be even and positive"):
        RoPEFwdOp()(np.ones((4, 0), np.float32))


@pytest.mark.parametrize("scheme", ("llama3", Llama31))
def test_a_scheme_that_is_no_scheme_instance_is_named(scheme):
    with pytest.raises(TypeError, match="^scheme must be a scheme instance"):
        RoPE(HEAD_DIM, NUM_HEADS, scheme=scheme)


def test_apply_rope_names_a_rope_that_is_no_component(rng):
    with pytest.raises(TypeError, match="^rope must be a RoPE component, got RoPEFwdOp"):
        apply_rope(_random(rng, (B, T, Q_WIDTH), "torch"), None, RoPEFwdOp())


@pytest.mark.parametrize("make", ("float8", "conjugate"))
def test_torch_tensors_numpy_cannot_view_are_named(make):
    x = (
        torch.zeros(2, 4, dtype=torch.float8_e4m3fn)
        if make == "float8"
        else torch.zeros(2, 4, dtype=torch.complex64).conj()
    )
    with pytest.raises(TypeError, match="^x is a torch .* tensor that NumPy cannot view"):
        RoPEFwdOp()(x)


def test_mrope_section_may_be_a_numpy_array(rng):
    """A 1-D int array is a section as a tuple is (HF configs hold lists; numpy holds
    arrays), with the same rotation."""
    positions = rng.integers(0, 100, (3, B, T))
    out = []
    for section in ((4, 2, 2), np.array([4, 2, 2])):
        q = _random(np.random.default_rng(1), (B, T, Q_WIDTH))
        RoPE(HEAD_DIM, NUM_HEADS, mrope_section=section).forward(q, positions=positions)
        out.append(q)
    assert _bytes(out[0]) == _bytes(out[1])


def test_mrope_positions_without_their_rows_are_named(rng):
    rope = RoPE(HEAD_DIM, NUM_HEADS, mrope_section=(4, 2, 2))
    q = _random(rng, (B, T, Q_WIDTH))
    with pytest.raises(ValueError, match=r"^positions must be \[3, B, T\] or \[3, N\]"):
        rope.forward(q, positions=np.zeros((B, T), np.int64))


def test_an_offset_beyond_the_table_is_named_as_given(rng):
    """offset + T - 1 wraps past int64 for the largest offsets: the offset is checked first."""
    q = _random(rng, (B, T, Q_WIDTH))
    with pytest.raises(ValueError, match=f"e.g. {2**63 - 1}$"):
        _rope().prefill(q, None, np.array([1, 2**63 - 1]))


def test_an_odd_head_size_is_named_as_the_cos_sin_cache_calls_name_it():
    query, cache = np.zeros((1, 14), np.float32), np.ones((2, 6), np.float32)
    for call in (apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace):
        with pytest.raises(ValueError, match="^head_size must be even, got 7$"):
            call(np.array([0]), query, None, 7, cache)


def test_cos_sin_cache_heads_are_named_query_and_key():
    query, key = np.zeros((1, 2 * HEAD_DIM), np.float32), np.zeros((1, 3 * HEAD_DIM), np.float32)
    cache = np.ones((2, HEAD_DIM), np.float32)
    with pytest.raises(ValueError, match=r"^query's heads \(2\) must be a multiple of key's \(3\)"):
        apply_rope_with_cos_sin_cache(np.array([0]), query, key, HEAD_DIM, cache)


def test_a_jax_array_in_place_points_to_the_out_of_place_calls():
    jnp = pytest.importorskip("jax.numpy")
    query, cache = jnp.zeros((1, HEAD_DIM)), jnp.ones((2, HEAD_DIM))
    with pytest.raises(TypeError, match="cannot change in place; use an out-of-place call"):
        apply_rope_with_cos_sin_cache_inplace(jnp.array([0]), query, None, HEAD_DIM, cache)


def test_numpy_subclasses_are_read_as_plain_arrays(rng):
    """np.matrix's arithmetic is not an array's (its * is a product, its rows stay 2-D): a
    subclass is read as a plain array of the same memory, so the results are the plain
    array's, bit for bit; a masked array is refused, since its mask would be ignored."""
    phi = (rng.standard_normal((8, 8)) / 4).astype(np.float32)  # n = 2, c_x = 4
    x, b = _random(rng, (B, 8)), np.zeros(8, np.float32)
    op = MHCPreFwdOp(1, 1, 1, 3)
    assert _bytes(*op(np.asmatrix(phi), np.asmatrix(x), b)) == _bytes(*op(phi, x, b))
    with pytest.raises(TypeError, match="^phi is a masked array, whose mask"):
        op(np.ma.masked_array(phi), x, b)


def test_cuda_calls_refuse_token_counts_past_32_bits():
    """The kernels' parameter block holds batch and seq as 32-bit ints: a CUDA call past them
    is refused by name before any launch (the host path has no such bound)."""
    check_token_counts(2**31 - 1, 2**31 - 1)
    for batch, seq in ((2**31, 1), (1, 2**31)):
        with pytest.raises(ValueError, match=r"fewer than 2\*\*31 sequences and tokens"):
            check_token_counts(batch, seq)


_SEED_CALLS = {  # (op, x's shape, position_ids' shape and dtype, or None)
    "odd head_dim": (RoPEFwdOp(input_layout="2d"), (2, 3, 2, 15), None),
    "rotary_dim past head_dim": (RoPEFwdOp(rotary_dim=32), (3, 16), None),
    "1d layout given 2d": (RoPEFwdOp(), (2, 3, 2, 16), None),
    "ids of another length": (RoPENeoxPositionIdsFwdOp(100), (5, 2, 16), ((4,), torch.int64)),
    "float ids": (RoPENeoxPositionIdsFwdOp(100), (5, 2, 16), ((5,), torch.float32)),
    "x of ids op 2-D": (RoPENeoxPositionIdsFwdOp(100), (5, 16), ((5,), torch.int64)),
}


@pytest.mark.parametrize("call", list(_SEED_CALLS))
def test_seed_op_fake_implementations_refuse_what_eager_refuses(call):
    """The seed RoPE ops check every shape and dtype without memory (``checked_rows``), on
    the direct path and in their fake implementations alike: the same error on meta."""
    op, shape, ids = _SEED_CALLS[call]

    def arguments(device):
        x = torch.zeros(shape, device=device)
        return [x] if ids is None else [x, torch.zeros(ids[0], dtype=ids[1], device=device)]

    _assert_meta_refuses_as_eager(op, arguments)


def _assert_meta_refuses_as_eager(op, arguments) -> None:
    """``op(*arguments(device))`` raises the same error (type and message) on cpu, where the
    direct path validates, and on meta, where the fake implementation does."""
    errors = []
    for device in ("cpu", "meta"):
        with pytest.raises((ValueError, TypeError)) as caught:
            op(*arguments(device))
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]


_N, _C_X = 2, 4
_W, _Q = _N * _C_X, _N * _N + 2 * _N
_MHC_CALLS = {  # (op, good argument shapes and dtypes, the index and shape of one bad one)
    "pre phi width": (MHCPreFwdOp(1, 1, 1, 3), [(_W, _Q), (B, _W), (_Q,)], 0, (_W, _Q + 1)),
    "pre x width": (MHCPreFwdOp(1, 1, 1, 3), [(_W, _Q), (B, _W), (_Q,)], 1, (B, _W + 2)),
    "pre x ndim": (MHCPreFwdOp(1, 1, 1, 3), [(_W, _Q), (B, _W), (_Q,)], 1, (_W,)),
    "post batch": (MHCPostFwdOp(), [(B, _C_X), (B, _N), (B, _W)], 1, (B + 1, _N)),
    "pre bwd upstream": (
        MHCPreBwdOp(1, 1, 1, 3),
        [(_W, _Q), (B, _W), (_Q,), (B, _W), (B, _C_X), (B, _N)],
        4,
        (B, _C_X + 1),
    ),
    "post bwd upstream": (MHCPostBwdOp(), [(B, _C_X), (B, _N), (B, _W), (B, _W)], 3, (B, 1)),
}


@pytest.mark.parametrize("call", list(_MHC_CALLS))
def test_mhc_fake_implementations_refuse_what_eager_refuses(call):
    """On meta tensors (and under torch.compile) the ops run their fake implementations,
    which validate as the direct path does: the same error, not made-up shapes."""
    op, shapes, bad, bad_shape = _MHC_CALLS[call]
    shapes = [bad_shape if i == bad else shape for i, shape in enumerate(shapes)]
    _assert_meta_refuses_as_eager(
        op, lambda device: [torch.zeros(shape, device=device) for shape in shapes]
    )


def _component_cases() -> dict:
    """(call, argument shapes and dtypes) of component calls with one fault each: what the
    component checks without memory (``RoPE._checked``)."""
    rope, normed = _rope(), RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, norm_eps=1e-6)
    q, k = ((B, T, Q_WIDTH), torch.float32), ((B, T, K_WIDTH), torch.float32)
    ids, offsets = ((B, T), torch.int64), ((B,), torch.int32)
    weight = ((HEAD_DIM,), torch.float32)
    packed_q, packed_k = ((5, Q_WIDTH), torch.float32), ((5, K_WIDTH), torch.float32)

    def cache_call(positions, query, key, cache):
        apply_rope_with_cos_sin_cache_inplace(positions, query, key, HEAD_DIM, cache)

    return {
        "q of other heads": (rope.prefill, [((B, T, Q_WIDTH + HEAD_DIM), torch.float32), k, 0]),
        "k of other tokens": (rope.prefill, [q, ((B, T + 1, K_WIDTH), torch.float32), 0]),
        "k of another dtype": (rope.prefill, [q, ((B, T, K_WIDTH), torch.bfloat16), 0]),
        "q of integers": (rope.prefill, [((B, T, Q_WIDTH), torch.int32), k, 0]),
        "offset past max_position": (rope.prefill, [q, k, 1000 - T + 1]),
        "negative offset": (rope.prefill, [q, k, -1]),
        "offsets of another batch": (rope.prefill, [q, k, ((B + 1,), torch.int32)]),
        "float offsets": (rope.prefill, [q, k, ((B,), torch.float32)]),
        "decode of two tokens": (rope.decode, [q, k, offsets]),
        "positions of another length": (
            lambda q, k, p: rope.forward(q, k, positions=p),
            [q, k, ((B, T + 1), torch.int64)],
        ),
        "float positions": (
            lambda q, k, p: rope.forward(q, k, positions=p),
            [q, k, ((B, T), torch.float32)],
        ),
        "positions and an offset": (
            lambda q, k, p: apply_rope(q, k, rope, 4, positions=p),
            [q, k, ids],
        ),
        "norm weight of another size": (
            lambda q, k, wq, wk: normed.forward(q, k, q_norm_weight=wq, k_norm_weight=wk),
            [q, k, ((HEAD_DIM + 1,), torch.float32), weight],
        ),
        "norm weight of another dtype": (
            lambda q, k, wq, wk: normed.forward(q, k, q_norm_weight=wq, k_norm_weight=wk),
            [q, k, weight, ((HEAD_DIM,), torch.float16)],
        ),
        "q's norm weight alone": (
            lambda q, k, wq: normed.forward(q, k, q_norm_weight=wq),
            [q, k, weight],
        ),
        "cos_sin_cache of an odd width": (
            cache_call,
            [((5,), torch.int64), packed_q, packed_k, ((64, HEAD_DIM - 1), torch.float32)],
        ),
        "cos_sin_cache of doubles": (
            cache_call,
            [((5,), torch.int64), packed_q, packed_k, ((64, HEAD_DIM), torch.float64)],
        ),
    }


_COMPONENT_CALLS = _component_cases()


@pytest.mark.parametrize("call", list(_COMPONENT_CALLS))
def test_component_fake_implementations_refuse_what_eager_refuses(call):
    """On meta tensors (and under torch.compile) the component's calls run the fake
    implementations of its custom ops, which check what needs no memory as the direct path
    does: the same error, not made-up shapes."""
    op, arguments = _COMPONENT_CALLS[call]

    def made(device):
        return [
            a if isinstance(a, int) else torch.zeros(a[0], dtype=a[1], device=device)
            for a in arguments
        ]

    _assert_meta_refuses_as_eager(op, made)


# --------------------------------------------------------------------------- item 7: bench --json


def _fake_bench(monkeypatch):
    """Replace what needs a GPU: the table rows are printed as the real ones are."""
    row = {
        "name": "rope fake", "ours_us": 1.0, "eager_us": 2.0, "compile_us": None, "gbs": 3.0,
        "pct_ceiling": 4.0, "floor_us": 0.5, "note": "",
    }  # fmt: skip

    def rope_rows(ceiling, with_compile):
        print(bench.format_row(row), flush=True)
        return [row]

    def cold_start():
        print("cold start: fake", flush=True)
        return {"cold_first_call_s": 0.5}

    monkeypatch.setattr(bench, "copy_ceiling_gbs", lambda: 1000.0)
    monkeypatch.setattr(bench, "rope_rows", rope_rows)
    monkeypatch.setattr(bench, "cold_start", cold_start)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "fake device")
    return row


def test_bench_json_prints_json_alone_on_stdout(monkeypatch, capsys):
    row = _fake_bench(monkeypatch)
    bench.main(["--json", "--only", "rope"])
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "copy_ceiling_gbs": 1000.0, "rows": [row], "cold_start": {"cold_first_call_s": 0.5}
    }  # fmt: skip
    assert "| rope fake" in err and "fake device" in err and "cold start" in err
    assert re.search(r"^\| workload", err, re.MULTILINE)


def test_bench_without_json_prints_the_table_on_stdout(monkeypatch, capsys):
    _fake_bench(monkeypatch)
    bench.main(["--only", "rope"])
    out, err = capsys.readouterr()
    assert "| rope fake" in out and "fake device" in out and err == ""


def test_bench_host_group_runs_without_a_gpu(monkeypatch, capsys):
    """``--only host`` measures the NumPy path beside torch's CPU eager with no device (one
    timed call each here, to keep the test short)."""
    from tileops_cupy import _bench_host

    timed_once = _bench_host.wall_us
    monkeypatch.setattr(_bench_host, "wall_us", lambda fn, runs=1: timed_once(fn, 1))
    bench.main(["--json", "--only", "host"])
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["copy_ceiling_gbs"] is None  # (no device ceiling: the host measures its own)
    names = [row["name"] for row in result["rows"]]
    assert names == [f"host rope neox B1 S4096 H32 D128 {d}" for d in ("bfloat16", "float32")]
    for row in result["rows"]:
        assert row["ours_us"] > 0 and row["eager_us"] > 0 and "torch CPU eager" in row["note"]
    assert "host:" in err and "device:" not in err


def test_peer_rows_rotate_through_copies_of_their_inputs(monkeypatch):
    """Each timed run of a peer row takes the next set of inputs, copies that share no memory,
    enough of them to hold ``_ROTATED_BYTES`` (four at least: on two, TileOPs' evict-last
    lines still served its median run, as if those of the first set stayed for each later
    turn of it); trailing items of a set can go by keyword."""
    from tileops_cupy import _bench_peers

    monkeypatch.setattr(_bench_peers, "_ROTATED_BYTES", 1000)
    x, ids = torch.arange(50.0), torch.arange(5)  # 200 + 40 bytes: five sets
    sets = _bench_peers._input_sets(x, ids)
    assert len(sets) == 5 and sets[0][0] is x and sets[0][1] is ids
    pointers = {t.data_ptr() for s in sets for t in s}
    assert len(pointers) == 10
    assert all(torch.equal(s[0], x) and torch.equal(s[1], ids) for s in sets)
    assert len(_bench_peers._input_sets(torch.zeros(1000))) == 4
    monkeypatch.setattr(_bench_peers, "_MAX_INPUT_SETS", 3)
    assert len(_bench_peers._input_sets(torch.zeros(1))) == 3

    seen = []
    run = _bench_peers._rotating(lambda x, *, ids: seen.append((x, ids)), sets, "ids")
    for _ in range(7):
        run()
    assert [(a.data_ptr(), b.data_ptr()) for a, b in seen] == [
        (sets[i % 5][0].data_ptr(), sets[i % 5][1].data_ptr()) for i in range(7)
    ]


def test_peer_rows_name_a_side_whose_dispatch_outlasts_the_flush(monkeypatch, capsys):
    """A peer row measures each side's host time a call; a side that takes longer than
    do_bench's flush is named in the row and its note (its device time then counts host
    time), and a side below it is not."""
    from tileops_cupy import _bench_peers

    device_us = {"ours": 30.0, "theirs": 40.0}
    dispatch_us = {"ours": 12.0, "theirs": 150.0}
    monkeypatch.setattr(_bench_peers, "median_us", lambda call: device_us[call()])
    monkeypatch.setattr(_bench_peers, "host_us", lambda call: dispatch_us[call()])
    monkeypatch.setattr(_bench_peers, "flush_us", lambda: 85.0)
    row = _bench_peers._row("w", "tileops", lambda: "ours", lambda: "theirs", 10**6, 1000.0)
    assert row["host_bound"] == ["tileops"] and row["flush_us"] == 85.0
    assert (row["ours_host_us"], row["peer_host_us"]) == (12.0, 150.0)
    assert row["ours_over_peer"] == 0.75
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith("| host-bound: tileops's dispatch 150.0 µs a call, the flush 85.0 µs;")
    dispatch_us["theirs"] = 60.0
    row = _bench_peers._row("w", "tileops", lambda: "ours", lambda: "theirs", 10**6, 1000.0)
    assert row["host_bound"] == []
    assert capsys.readouterr().out.strip().endswith("|")


@GPU
def test_bench_host_and_flush_timers():
    """``host_us`` gives a call's host time and ``flush_us`` do_bench's flush's device time
    (the peer rows compare the two), both positive and bounded."""
    require("cuda", "torch")
    from tileops_cupy._bench_harness import flush_us, host_us

    x = torch.randn(1 << 20, device="cuda")
    assert 0 < host_us(lambda: x.mul_(1.0)) < 1e5
    assert 10 < flush_us() < 1e4  # 256 MiB zeroed: about 90 µs on an H100


@GPU
def test_bench_timer_resets_l2_persisting_lines_first():
    """``median_us`` resets L2's persisting lines before it times (a failed reset raises), so
    that lines an earlier measurement loaded evict-last (as TileOPs' neox RoPE does) are not read
    from L2 by the next; then a device time comes back."""
    require("cuda", "torch")
    from tileops_cupy._bench_harness import median_us

    x = torch.randn(1 << 20, device="cuda")
    assert 0 < median_us(lambda: x.mul_(1.0)) < 1e4


class _Producer:
    """A DLPack producer the package knows by no name (its host memory: a torch tensor's)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_any_dlpack_producer_on_the_host_is_read_in_place(dtype):
    """SPEC 6: any object with ``__dlpack__``, bfloat16 included (NumPy refuses its dtype
    code: the bits are read as ml_dtypes' bfloat16). Out of place the same bits as on the
    torch tensor itself; in place the producer's own memory is rotated."""
    rope = RoPE(HEAD_DIM, NUM_HEADS, max_position=1000)
    q = torch.randn(B, T, Q_WIDTH).to(dtype)
    expected = apply_rope(q, None, rope, 5)[0]
    rotated = apply_rope(_Producer(q), None, rope, 5)[0]
    assert torch.equal(
        torch.from_numpy(np.asarray(rotated).view(np.int8)), expected.view(torch.int8)
    )
    rope.prefill(_Producer(q), None, 5)
    assert torch.equal(q, expected)


@GPU
@pytest.mark.parametrize("kind", ("positions", "offsets"))
def test_big_endian_host_positions_with_device_data(rng, kind):
    """Host positions or offsets in non-native byte order, with CUDA data: uploaded in the
    native order (neither torch nor CuPy takes another), the same bits as native ones."""
    require("cuda", "torch")
    rope = _rope()
    q = torch.from_numpy(_random(rng, (B, T, Q_WIDTH))).cuda()
    values = rng.integers(0, 990, (B, T) if kind == "positions" else (B,))
    rotated = []
    for order in ("<", ">"):
        given = values.astype(f"{order}i8")
        if kind == "positions":
            rotated.append(apply_rope(q, None, rope, positions=given)[0])
        else:
            rotated.append(apply_rope(q, None, rope, given)[0])
    assert torch.equal(rotated[0], rotated[1])
