"""The cos_sin_cache drop-in (issue 11 item 4): ``apply_rope_with_cos_sin_cache`` and
``apply_rope_with_cos_sin_cache_inplace`` with FlashInfer's semantics, against a float64
rotation by the cache's own values (``_oracle.rotate_reference``).

``place`` is "cpu" (the host path, in CI) or "cuda" (marked ``gpu``). Fresh data per test
(``rng`` is seeded per test id); every output element is compared.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from _cases import PLACES, assert_runs_in_own_process
from _compile import compile_counting
from _oracle import (
    assert_gradcheck,
    assert_matches_reference,
    random_data,
    random_tensor,
    rotate_reference,
    to_float64,
    to_framework,
)

from tileops_cupy.rope import apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace

N, HEADS, KV_HEADS, HEAD_SIZE = 11, 4, 2, 32
MAX_POSITION = 3000


def _cache(rng, rotary_dim: int, place: str, rows: int = MAX_POSITION):
    """(float32 cache [rows, rotary_dim] on place, its float64 values): cos/sin of random
    angles (any values would do: the call reads them, it does not derive them)."""
    angles = rng.uniform(-1e4, 1e4, (rows, rotary_dim // 2))
    host = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    return torch.from_numpy(host).to(place), host.astype(np.float64)


def _data(rng, heads, dtype, place, three_d):
    """(query/key on place, [N, heads, head_size] float64 values)."""
    shape = (N, heads, HEAD_SIZE) if three_d else (N, heads * HEAD_SIZE)
    host = random_data(rng, shape, dtype)
    framework = "torch" if place == "cpu" else "torch-cuda"
    return to_framework(host, framework), host.astype(np.float64).reshape(N, heads, HEAD_SIZE)


def _positions(rng, place, dtype="int64", limit=MAX_POSITION):
    ids = rng.integers(0, limit, N)
    ids[rng.permutation(N)[:2]] = (0, limit - 1)
    return torch.from_numpy(ids.astype(dtype)).to(place), ids


def _assert_cached(y, x64, ids, cache64, neox, dtype, what, inverse=False):
    pairs = cache64.shape[1] // 2
    cos = cache64[ids, :pairs][:, None, :]  # per token, over heads
    sin = cache64[ids, pairs:][:, None, :]
    y64 = rotate_reference(x64, cos, sin, neox=neox, inverse=inverse)
    assert_matches_reference(to_float64(y).reshape(x64.shape), y64, x64, 2 * pairs, dtype,
                             what=what)  # fmt: skip


def _synchronize(place):
    if place == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16"))
@pytest.mark.parametrize("ids_dtype", ("int32", "int64"))
@pytest.mark.parametrize("three_d", (False, True), ids=("NHD-flat", "NHD"))
@pytest.mark.parametrize("is_neox", (True, False), ids=("neox", "interleaved"))
@pytest.mark.parametrize("rotary_dim", (HEAD_SIZE, 16))
def test_cos_sin_cache_matches_the_rotation_by_its_values(
    rng, rotary_dim, is_neox, three_d, ids_dtype, dtype, place
):
    cache, cache64 = _cache(rng, rotary_dim, place)
    query, q64 = _data(rng, HEADS, dtype, place, three_d)
    key, k64 = _data(rng, KV_HEADS, dtype, place, three_d)
    positions, ids = _positions(rng, place, ids_dtype)
    before = (query.clone(), key.clone())

    q_rot, k_rot = apply_rope_with_cos_sin_cache(positions, query, key, HEAD_SIZE, cache, is_neox)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1]), "inputs changed"
    assert q_rot.shape == query.shape and k_rot.shape == key.shape
    assert q_rot.dtype == query.dtype and q_rot.device == query.device
    _synchronize(place)
    _assert_cached(q_rot, q64, ids, cache64, is_neox, dtype, "query")
    _assert_cached(k_rot, k64, ids, cache64, is_neox, dtype, "key")

    returned = apply_rope_with_cos_sin_cache_inplace(
        positions, query, key, HEAD_SIZE, cache, is_neox
    )
    assert returned is None  # FlashInfer's in-place variant returns None
    assert torch.equal(query, q_rot) and torch.equal(key, k_rot)


@pytest.mark.parametrize("place", PLACES)
def test_cos_sin_cache_without_key_and_float64_on_the_host(rng, place):
    dtype = "float64" if place == "cpu" else "float32"
    cache, cache64 = _cache(rng, 16, place)
    query, q64 = _data(rng, HEADS, dtype, place, False)
    positions, ids = _positions(rng, place)
    q_rot, k_rot = apply_rope_with_cos_sin_cache(positions, query, None, HEAD_SIZE, cache)
    assert k_rot is None
    _synchronize(place)
    _assert_cached(q_rot, q64, ids, cache64, True, dtype, "query")
    assert apply_rope_with_cos_sin_cache_inplace(positions, query, None, HEAD_SIZE, cache) is None
    assert torch.equal(query, q_rot)


@pytest.mark.parametrize("place", PLACES)
def test_cos_sin_cache_in_place_on_fused_qkv_views_leaves_v(rng, place):
    cache, cache64 = _cache(rng, HEAD_SIZE, place)
    width = (HEADS + 2 * KV_HEADS) * HEAD_SIZE
    qkv = torch.from_numpy(rng.standard_normal((N, width)).astype(np.float32)).to(place)
    x64 = qkv.double().cpu().numpy()
    positions, ids = _positions(rng, place)
    q, k = qkv[:, : HEADS * HEAD_SIZE], qkv[:, HEADS * HEAD_SIZE : (HEADS + KV_HEADS) * HEAD_SIZE]
    apply_rope_with_cos_sin_cache_inplace(positions, q, k, HEAD_SIZE, cache)
    _synchronize(place)
    q64 = x64[:, : HEADS * HEAD_SIZE].reshape(N, HEADS, HEAD_SIZE)
    k64 = x64[:, HEADS * HEAD_SIZE : (HEADS + KV_HEADS) * HEAD_SIZE].reshape(N, KV_HEADS, -1)
    _assert_cached(q, q64, ids, cache64, True, "float32", "q")
    _assert_cached(k, k64, ids, cache64, True, "float32", "k")
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_SIZE :].cpu().numpy()
    assert np.array_equal(v, x64[:, (HEADS + KV_HEADS) * HEAD_SIZE :]), "v changed"


@pytest.mark.parametrize("place", PLACES)
def test_repeated_calls_read_each_calls_cache_and_positions(rng, place):
    """The direct path re-runs a planned launch for a repeated layout: it must patch in the
    new cache and positions, not reuse the first call's."""
    for _ in range(3):
        cache, cache64 = _cache(rng, HEAD_SIZE, place)
        query, q64 = _data(rng, HEADS, "bfloat16", place, True)
        positions, ids = _positions(rng, place, "int32")
        apply_rope_with_cos_sin_cache_inplace(positions, query, None, HEAD_SIZE, cache)
        _synchronize(place)
        _assert_cached(query, q64, ids, cache64, True, "bfloat16", "query")


# --------------------------------------------------------------------------- torch


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("is_neox", (True, False), ids=("neox", "interleaved"))
def test_cos_sin_cache_gradients(rng, is_neox, place):
    """The gradient is the transpose rotation by the same cache values (sin negated)."""
    cache, _ = _cache(rng, 16, place)
    query = random_tensor(rng, (4, HEADS * HEAD_SIZE), place, requires_grad=True)
    key = random_tensor(rng, (4, KV_HEADS, HEAD_SIZE), place, requires_grad=True)
    positions = torch.from_numpy(rng.integers(0, MAX_POSITION, 4)).to(place)

    def rotate(q, k):
        return apply_rope_with_cos_sin_cache(positions, q, k, HEAD_SIZE, cache, is_neox)

    q_rot, k_rot = rotate(query, key)
    assert q_rot.grad_fn is not None and k_rot.grad_fn is not None
    gq, gk = random_tensor(rng, query.shape, place), random_tensor(rng, key.shape, place)
    torch.autograd.backward((q_rot, k_rot), (gq, gk))
    g64 = gq.detach().double().cpu().numpy().reshape(4, HEADS, HEAD_SIZE)
    c64 = cache.double().cpu().numpy()
    ids = positions.cpu().numpy()
    dtype = "float64" if place == "cpu" else "float32"
    _assert_cached(query.grad, g64, ids, c64, is_neox, dtype, "query.grad", inverse=True)
    if place == "cpu":
        inputs = (query.detach().requires_grad_(), key.detach().requires_grad_())
        assert_gradcheck(rotate, inputs)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("call", ("copy", "inplace"))
@pytest.mark.parametrize("mode", ("reverse", "forward"))
def test_a_cache_that_would_take_a_gradient_is_refused(rng, call, mode, place):
    """No gradient flows to the cache, so one that requires grad (or carries a forward-mode
    tangent) is refused before any write, instead of its gradient silently staying None.
    Under torch.no_grad() (or detached) the same cache rotates."""
    import torch.autograd.forward_ad as forward_ad

    cache, _ = _cache(rng, HEAD_SIZE, place)
    positions = torch.from_numpy(rng.integers(0, MAX_POSITION, N)).to(place)
    query = random_tensor(rng, (N, HEADS * HEAD_SIZE), place)
    before = query.clone()
    rotate = (
        apply_rope_with_cos_sin_cache if call == "copy" else apply_rope_with_cos_sin_cache_inplace
    )
    refused = pytest.raises(
        ValueError, match="^cos_sin_cache requires grad .* pass cos_sin_cache.detach"
    )
    if mode == "reverse":
        learned = cache.clone().requires_grad_()
        with refused:
            rotate(positions, query, None, HEAD_SIZE, learned)
        with torch.no_grad():
            rotate(positions, query.clone(), None, HEAD_SIZE, learned)
    else:
        with forward_ad.dual_level(), refused:
            dual = forward_ad.make_dual(cache, torch.ones_like(cache))
            rotate(positions, query, None, HEAD_SIZE, dual)
    assert torch.equal(query, before)


@pytest.mark.parametrize("place", PLACES)
def test_cos_sin_cache_in_place_under_autograd_is_recorded(rng, place):
    cache, _ = _cache(rng, HEAD_SIZE, place)
    positions = torch.from_numpy(rng.integers(0, MAX_POSITION, N)).to(place)
    x = random_tensor(rng, (N, 8), place)
    w = random_tensor(rng, (8, HEADS * HEAD_SIZE), place, requires_grad=True)
    q = x @ w
    apply_rope_with_cos_sin_cache_inplace(positions, q, None, HEAD_SIZE, cache)
    weights = random_tensor(rng, q.shape, place)
    (q * weights).sum().backward()
    w2 = w.detach().requires_grad_()
    q2, _ = apply_rope_with_cos_sin_cache(positions, x @ w2, None, HEAD_SIZE, cache)
    (q2 * weights).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)
    leaf = random_tensor(rng, (N, HEADS * HEAD_SIZE), place, requires_grad=True)
    with pytest.raises(ValueError, match="query is a leaf tensor that requires grad"):
        apply_rope_with_cos_sin_cache_inplace(positions, leaf, None, HEAD_SIZE, cache)


@pytest.mark.parametrize("place", PLACES)
def test_cos_sin_cache_compiles_fullgraph_without_recompiling(rng, place):
    cache, _ = _cache(rng, HEAD_SIZE, place)

    def attention_inputs(x, w, positions):
        qkv = x @ w
        q, k = qkv[:, : HEADS * HEAD_SIZE], qkv[:, HEADS * HEAD_SIZE : 6 * HEAD_SIZE]
        apply_rope_with_cos_sin_cache_inplace(positions, q, k, HEAD_SIZE, cache)
        q_rot, _ = apply_rope_with_cos_sin_cache(positions, qkv[:, -HEAD_SIZE:], None,
                                                 HEAD_SIZE, cache, False)  # fmt: skip
        return qkv, q_rot

    compiled, counter = compile_counting(attention_inputs, dynamic=True)
    width = (HEADS + 2 * KV_HEADS) * HEAD_SIZE
    for tokens in (5, 9, 7):
        x, w = random_tensor(rng, (tokens, 8), place), random_tensor(rng, (8, width), place)
        positions = torch.from_numpy(rng.integers(0, MAX_POSITION, tokens)).to(place)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, w, positions), attention_inputs(x, w, positions))
        w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
        actual, expected = compiled(x, w1, positions), attention_inputs(x, w2, positions)
        torch.testing.assert_close(actual, expected)
        grad = (
            random_tensor(rng, actual[0].shape, place),
            random_tensor(rng, actual[1].shape, place),
        )
        torch.autograd.backward(actual, grad)
        torch.autograd.backward(expected, grad)
        torch.testing.assert_close(w1.grad, w2.grad)
        counter.first_call_done()
    counter.assert_no_recompile()


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("tracing_mode", ("symbolic", "fake", "real"))
def test_cos_sin_cache_calls_trace_with_make_fx(rng, place, tracing_mode):
    """Graph tools trace both calls (``make_fx``, as ``torch.export`` does), symbolic shapes
    included, whose configuration cannot key the remembered components."""
    from torch.fx.experimental.proxy_tensor import make_fx

    cache, _ = _cache(rng, HEAD_SIZE, place)
    query, _ = _data(rng, HEADS, "float32", place, False)
    key, _ = _data(rng, KV_HEADS, "float32", place, False)
    ids, _ = _positions(rng, place)

    def rotate(ids, query, key, cache):
        q, k = query.clone(), key.clone()
        apply_rope_with_cos_sin_cache_inplace(ids, q, k, HEAD_SIZE, cache)
        return q, k, *apply_rope_with_cos_sin_cache(ids, query, key, HEAD_SIZE, cache, False)

    graph = make_fx(rotate, tracing_mode=tracing_mode)(ids, query, key, cache)
    for actual, expected in zip(
        graph(ids, query, key, cache), rotate(ids, query, key, cache), strict=True
    ):
        assert torch.equal(actual, expected)


# --------------------------------------------------------------------------- refusals


def _bad_calls(place):
    """name -> (call arguments, error, match); each refused before anything is written."""
    rng = np.random.default_rng(5)
    cache, _ = _cache(rng, 16, place)
    query = torch.zeros(N, HEADS * HEAD_SIZE, device=place)
    key = torch.zeros(N, KV_HEADS * HEAD_SIZE, device=place)
    ids = torch.zeros(N, dtype=torch.int64, device=place)
    far = ids.cpu().clone()  # host positions: checked before the launch (device ones are flagged)
    far[3] = MAX_POSITION
    negative = ids.cpu().clone()
    negative[0] = -1
    return {
        "cache float16": ((ids, query, key, HEAD_SIZE, cache.half()), TypeError, "float32"),
        "cache float64": ((ids, query, key, HEAD_SIZE, cache.double()), TypeError, "float32"),
        "cache odd width": ((ids, query, key, HEAD_SIZE, cache[:, :15]), ValueError, "even"),
        "cache too wide": (
            (ids, query, key, HEAD_SIZE, torch.zeros(8, 64, device=place)),
            ValueError,
            "head_size",
        ),
        "cache 1-D": ((ids, query, key, HEAD_SIZE, cache[0]), ValueError, "max_position, rot"),
        "cache strided": (
            (ids, query, key, HEAD_SIZE, torch.zeros(8, 32, device=place)[:, ::2]),
            ValueError,
            "contiguous",
        ),
        # rows whose last dim is contiguous but whose pitch is not their width (the left
        # columns of a wider table): the kernel reads row p at p * rotary_dim
        "cache rows padded": (
            (ids, query, key, HEAD_SIZE, torch.zeros(8, 32, device=place)[:, :16]),
            ValueError,
            r"contiguous \(strides \(16, 1\)\), got strides \(32, 1\)",
        ),
        "cache without rows": (
            (ids, query, key, HEAD_SIZE, cache[:0]),
            ValueError,
            "max_position >= 1, got shape",
        ),
        "cache without columns": ((ids, query, key, HEAD_SIZE, cache[:, :0]), ValueError, "even"),
        "query width": ((ids, query[:, :-2], key, HEAD_SIZE, cache), ValueError, "query must"),
        "key tokens": (
            (ids, query, key[:-1], HEAD_SIZE, cache),
            ValueError,
            rf"query and key must share \[N\], got query \({N},\) and key \({N - 1},\)",
        ),
        "key dtype": (  # (float16: a dtype both places take, unlike float64 on the device)
            (ids, query, key.half(), HEAD_SIZE, cache),
            TypeError,
            "query and key must share a dtype",
        ),
        "positions shape": ((ids[:-1], query, key, HEAD_SIZE, cache), ValueError, "positions"),
        "positions [B, T]": (
            (ids[None], query, key, HEAD_SIZE, cache),
            ValueError,
            rf"positions must be \[N\], one position per token, got shape \(1, {N}\)",
        ),
        "positions list": ((ids.tolist(), query, key, HEAD_SIZE, cache), TypeError, "positions"),
        "positions float": ((ids.float(), query, key, HEAD_SIZE, cache), TypeError, "int32"),
        "position past cache": ((far, query, key, HEAD_SIZE, cache), ValueError, r"\[0, 3000\)"),
        "negative position": ((negative, query, key, HEAD_SIZE, cache), ValueError, r"\[0, 3000"),
        "head_size": ((ids, query, key, 0, cache), ValueError, "head_size"),
        "is_neox": ((ids, query, key, HEAD_SIZE, cache, "neox"), TypeError, "is_neox"),
        "cache elsewhere": (
            (ids, query, key, HEAD_SIZE, cache.cpu() if place == "cuda" else cache.numpy()),
            ValueError if place == "cuda" else None,
            "same device",
        ),
    }


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("name", list(_bad_calls("cpu")))
def test_bad_calls_are_refused_before_any_write(name, place):
    arguments, error, match = _bad_calls(place)[name]
    if error is None:  # a NumPy cache with torch CPU data: both on the host, a valid call
        rotated = apply_rope_with_cos_sin_cache(*arguments)
        expected = apply_rope_with_cos_sin_cache(*arguments[:4], torch.from_numpy(arguments[4]))
        assert all(torch.equal(a, b) for a, b in zip(rotated, expected, strict=True))
        return
    _, query, key = arguments[:3]
    query.normal_()
    key.normal_()
    before = (query.clone(), key.clone())
    for call in (apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace):
        with pytest.raises(error, match=match):
            call(*arguments)
        assert torch.equal(query, before[0]) and torch.equal(key, before[1]), name


@pytest.mark.parametrize("place", PLACES)
def test_a_checked_call_shape_is_remembered_apart_from_n_and_argument_types(rng, place):
    """A call's shapes are checked once and remembered (a decode step's host time), apart
    from the token count, and with head_size's and is_neox's types: ``32.0`` and ``1``
    compare and hash equal to ``32`` and ``True``, and stay refused after them."""
    cache, _ = _cache(rng, HEAD_SIZE, place)
    query, _ = _data(rng, HEADS, "float32", place, False)
    ids, _ = _positions(rng, place)
    whole, _ = apply_rope_with_cos_sin_cache(ids, query, None, HEAD_SIZE, cache, True)
    part, _ = apply_rope_with_cos_sin_cache(ids[:5], query[:5], None, HEAD_SIZE, cache, True)
    assert torch.equal(part, whole[:5])  # (the same shapes past N: the same component)
    for head_size, is_neox, name in (
        (float(HEAD_SIZE), True, "head_size"),
        (HEAD_SIZE, 1, "is_neox"),
    ):
        for call in (apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace):
            with pytest.raises(TypeError, match=name):
                call(ids, query, None, head_size, cache, is_neox)
    # another cache width, other heads: checked anew (the tail of each shape is the key)
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        apply_rope_with_cos_sin_cache(
            ids, query, None, HEAD_SIZE, torch.zeros(8, 2 * HEAD_SIZE, device=place)
        )
    with pytest.raises(ValueError, match="query must be"):
        apply_rope_with_cos_sin_cache(ids, query[:, 1:], None, HEAD_SIZE, cache)


@pytest.mark.gpu
def test_gpu_device_positions_past_the_cache_are_flagged_and_clamped(rng):
    cache, cache64 = _cache(rng, HEAD_SIZE, "cuda")
    query, _ = _data(rng, HEADS, "float32", "cuda", False)
    positions, _ = _positions(rng, "cuda")
    positions[2] = MAX_POSITION + 7  # clamped to the last row, flagged
    q_rot, _ = apply_rope_with_cos_sin_cache(positions, query, None, HEAD_SIZE, cache)
    torch.cuda.synchronize()
    assert torch.isfinite(q_rot).all()
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rope_with_cos_sin_cache(positions[:1] * 0, query[:1], None, HEAD_SIZE, cache)


# --------------------------------------------------------------------------- CUDA graphs

_CAPTURE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    sys.path.insert(0, "tests")
    from _cases import assert_graph_replays_like_eager
    from tileops_cupy.rope import (apply_rope_with_cos_sin_cache,
        apply_rope_with_cos_sin_cache_inplace)

    in_place = sys.argv[1] == "inplace"
    rng = np.random.default_rng(int(sys.argv[2]))
    heads, kv_heads, head_size, tokens, rows = 8, 2, 128, 48, 4096
    angles = rng.uniform(0, 100, (rows, 32))
    cache = torch.from_numpy(np.concatenate([np.cos(angles), np.sin(angles)], 1)).float().cuda()

    def fresh():
        q = torch.from_numpy(rng.standard_normal((tokens, heads * head_size))).to(
            "cuda", torch.bfloat16)
        k = torch.from_numpy(rng.standard_normal((tokens, kv_heads, head_size))).to(
            "cuda", torch.bfloat16)
        return [q, k, torch.from_numpy(rng.integers(0, rows, tokens)).cuda()]

    def step(q, k, positions):
        if in_place:
            apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_size, cache, False)
            return q, k
        return apply_rope_with_cos_sin_cache(positions, q, k, head_size, cache, False)

    assert_graph_replays_like_eager(step, fresh)
    print("replayed", sys.argv[1])
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ("inplace", "copy"))
def test_gpu_cos_sin_cache_cuda_graph_replays_with_new_positions(mode):
    assert_runs_in_own_process(_CAPTURE, mode, "17")
