"""mHC backward (SPEC section 8): MHCPreBwdOp and MHCPostBwdOp on the host and on CUDA against
float64 torch autograd of SPEC section 4, every output element; ties in the row max, eps = 0,
saturated gates, the row norm of |x| ~ 1e19, the first pass's tensor-core products (16-bit
x, n <= 4), an empty batch, a chained training step, determinism and the validation errors.
Outputs start as NaN (``poisoned``), so an element an op leaves unwritten fails. CUDA cases
are ``gpu``-marked (skipped without a device)."""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
from _cases import PLACES, SLEEP_CYCLES, per_place, to_place
from _mhc_oracle import (
    NP_DTYPES,
    as_float64_tensor,
    assert_post_backward_matches,
    assert_pre_backward_matches,
    assert_pre_grads_match,
    assert_pre_matches,
    case_alphas,
    pre_reference,
    random_pre_case,
    to_float64,
    torch_pre_reference,
)
from _oracle import framework_name

from tileops_cupy import _cuda, _mhc, _mhc_host, sequence_modeling
from tileops_cupy.sequence_modeling import (
    MHCPostBwdOp,
    MHCPostFwdOp,
    MHCPreBwdOp,
    MHCPreFwdOp,
)

torch = pytest.importorskip("torch")  # the oracle is torch autograd

PRE_DTYPES = ("float32", "bfloat16")


def on(place: str, array: np.ndarray):
    """``array`` where ``place``'s op reads it: itself on the host, a torch CUDA tensor."""
    if place == "cpu":
        return array
    if array.dtype == NP_DTYPES["bfloat16"]:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to("cuda")
    return torch.from_numpy(np.ascontiguousarray(array)).to("cuda")


def dtype_name(array) -> str:
    return str(array.dtype).removeprefix("torch.")


@contextlib.contextmanager
def poisoned():
    """Every array the ops allocate starts as NaN."""
    allocate = sequence_modeling.empty_like

    def empty_like(template, shape, dtype=None):
        output = allocate(template, shape, dtype)
        if not output.is_cuda:
            output.host[...] = np.nan
        elif output.framework == "torch":
            output.obj.fill_(float("nan"))
        return output

    with mock.patch.object(sequence_modeling, "empty_like", empty_like):
        yield


def upstream_grads(rng, case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fresh (grad_x_res, grad_x_layer, grad_h_post) for a case: x's dtype, h_post's float32."""
    batch, width = case.x.shape
    return (
        rng.standard_normal((batch, width)).astype(case.x.dtype),
        rng.standard_normal((batch, width // case.n)).astype(case.x.dtype),
        rng.standard_normal((batch, case.n)).astype(np.float32),
    )


def pre_backward(place: str, case, upstream, op=None):
    """The case's gradients from ``op`` (a new MHCPreBwdOp of the case's settings if None)."""
    op = op or MHCPreBwdOp(*case.alphas, case.repeat, case.eps)
    with poisoned():
        return op(*(on(place, a) for a in (case.phi, case.x, case.b, *upstream)))


def check_pre_layouts(place: str, case, grads) -> None:
    """Types, places, shapes and dtypes of (grad_phi, grad_x, grad_b, grad_alpha)."""
    kind = np.ndarray if place == "cpu" else torch.Tensor
    assert all(isinstance(g, kind) for g in grads)
    if place == "cuda":
        assert all(g.is_cuda for g in grads)
    expected = (
        (case.phi.shape, "float32"),
        (case.x.shape, str(case.x.dtype)),
        (case.b.shape, "float32"),
        ((3,), "float32"),
    )
    got = tuple((tuple(g.shape), dtype_name(g)) for g in grads)
    assert got == expected


# --------------------------------------------------------------------------- pre


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", PRE_DTYPES)
@pytest.mark.parametrize("repeat", (0, 1, 20))
@pytest.mark.parametrize("n", (1, 2, 4, 6))
def test_pre_backward_matches_oracle(rng, place, n, repeat, dtype):
    case = random_pre_case(rng, n, 130, batch=5, dtype=dtype, repeat=repeat)
    upstream = upstream_grads(rng, case)
    grads = pre_backward(place, case, upstream)
    check_pre_layouts(place, case, grads)
    assert_pre_backward_matches(case, upstream, grads)


# batch 1 (decode), a few rows, widths with and without a vector-friendly c_x, and batches
# past one and two 128-row tiles
@pytest.mark.parametrize("place", PLACES)
def test_pre_backward_shapes(rng, place):
    """Each shape twice on one op with fresh data: the second call of a torch CUDA layout
    relaunches the first call's kernels with new addresses and scratch."""
    for c_x, batch in ((1000, 1), (130, 4), (1000, 37), (136, 200), (64, 300)):
        first = random_pre_case(rng, 4, c_x, batch)
        op = MHCPreBwdOp(*first.alphas, first.repeat, first.eps)
        for case in (first, random_pre_case(rng, 4, c_x, batch)):
            case.alphas = first.alphas  # (the op's)
            upstream = upstream_grads(rng, case)
            grads = pre_backward(place, case, upstream, op)
            check_pre_layouts(place, case, grads)
            assert_pre_backward_matches(case, upstream, grads)


# Two layouts that depend on n, each with every case of it, at c_x 136 (a partial last stage
# and chunk at every n), in one cooperative launch (9 tokens) and the five kernels (150: a
# partial second tile of 128):
# - 16-bit x with n <= 4 takes the first pass's tensor-core products (two tokens' rows in one
#   product; streams past n read as stream n-1, their products dropped): every such n, both
#   16-bit types;
# - past n = 4 the grad pass splits a token's streams into as many groups as its threads allow
#   (n = 7: the last group one stream short): every x dtype.
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(
    "dtype, n",
    [(dtype, n) for dtype in ("bfloat16", "float16") for n in (1, 2, 3, 4)]
    + [(dtype, n) for dtype in PRE_DTYPES for n in (5, 7, 8)],
)
@pytest.mark.parametrize("batch", (9, 150))
def test_pre_backward_n_dependent_layouts(rng, place, batch, n, dtype):
    case = random_pre_case(rng, n, 136, batch=batch, dtype=dtype)
    upstream = upstream_grads(rng, case)
    grads = pre_backward(place, case, upstream)
    check_pre_layouts(place, case, grads)
    assert_pre_backward_matches(case, upstream, grads)


# Padding tokens: rows of x that are all zero. The row norm has no derivative there; its
# subgradient 0 (torch.linalg.vector_norm's, the oracle's) leaves such a row's grad_x finite,
# the part through the mix and the gates alone. One launch (6 tokens) and the separate
# kernels (150).
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", PRE_DTYPES)
@pytest.mark.parametrize("n", (1, 4))
@pytest.mark.parametrize("batch", (6, 150))
def test_pre_backward_all_zero_rows(rng, place, n, dtype, batch):
    case = random_pre_case(rng, n, 136, batch=batch, dtype=dtype)
    case.x[[0, 3]] = 0
    upstream = upstream_grads(rng, case)
    grads = pre_backward(place, case, upstream)
    assert np.isfinite(to_float64(grads[1])[[0, 3]]).all()
    assert_pre_backward_matches(case, upstream, grads)


# Past _SINKHORN_KEPT_FLOATS a token (repeat * n * n), the CUDA token stage keeps only every
# segment-th Sinkhorn input and recomputes one segment at a time; up to n = 4 it takes each
# step's output from the step after's input, across segments too. One launch (5 tokens) and
# the separate kernels (130).
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("n, repeat", ((4, 70), (2, 300), (6, 40)))
@pytest.mark.parametrize("batch", (5, 130))
def test_pre_backward_checkpointed_sinkhorn(rng, place, n, repeat, batch):
    assert repeat * n * n > _mhc._SINKHORN_KEPT_FLOATS
    assert _mhc.sinkhorn_checkpoints(repeat, n)[0] > 1
    case = random_pre_case(rng, n, 64, batch=batch, dtype="bfloat16", repeat=repeat)
    upstream = upstream_grads(rng, case)
    assert_pre_backward_matches(case, upstream, pre_backward(place, case, upstream))


# Saturated logits at widths where float32 and float64 agree on which Sinkhorn entries
# underflow: at n*c_x ~ 800 and beyond, exp(L - max) underflows float32 entries (~1e-50) that
# float64 keeps and 40 eps-divisions lift back to O(1), so the float32 forward (and with it
# its exact gradient) parts from the float64 function; no float32 backward can follow that.
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", PRE_DTYPES)
@pytest.mark.parametrize("n, c_x", ((1, 256), (4, 64), (6, 32)))
def test_pre_backward_saturated(rng, place, n, c_x, dtype):
    case = random_pre_case(rng, n, c_x, batch=16, dtype=dtype, saturated=True)
    gates = pre_reference(case)["h_post"] / 2
    assert (np.minimum(gates, 1 - gates) < 1e-3).mean() > 0.05  # the sigmoids do saturate
    upstream = upstream_grads(rng, case)
    assert_pre_backward_matches(case, upstream, pre_backward(place, case, upstream))


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("repeat", (0, 3))
def test_pre_backward_ties_in_row_max(rng, place, repeat):
    """Rows of the logit matrix with tied maxima get them from b alone (their phi columns are
    0), so float32 and float64 tie alike; torch.amax splits the max's gradient between them.
    eps > 0, so the gradient reaching the max is not 0."""
    n = 4
    case = random_pre_case(rng, n, 64, batch=6, dtype="float32", repeat=repeat)
    first = 2 * n  # logit row 0: all four tie; row 1: two tie above the other two
    case.phi[:, first : first + 2 * n] = 0
    case.b[first : first + 2 * n] = (0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 3.0, -2.0)
    upstream = upstream_grads(rng, case)
    assert_pre_backward_matches(case, upstream, pre_backward(place, case, upstream))


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("repeat", (1, 20))
def test_pre_backward_without_eps(rng, place, repeat):
    case = random_pre_case(rng, 4, 130, batch=9, dtype="bfloat16", repeat=repeat, eps=0.0)
    upstream = upstream_grads(rng, case)
    assert_pre_backward_matches(case, upstream, pre_backward(place, case, upstream))


@pytest.mark.parametrize("place", PLACES)
def test_pre_backward_empty_sinkhorn_columns(rng, place):
    """eps = 0 and columns of the mixing matrix that are exactly 0 in float32 and float64
    alike (logits 1000 below their row's max): those column sums divide by 1 and pass no
    gradient, never NaN."""
    n = 4
    case = random_pre_case(rng, n, 32, batch=5, dtype="float32", repeat=5, eps=0.0)
    case.phi[:, 2 * n :] = 0
    logits = np.full((n, n), -1000.0, np.float32)
    logits[np.arange(n), np.arange(n) % 2] = 0.0  # every row's max in column 0 or 1
    case.b[2 * n :] = logits.ravel()
    upstream = upstream_grads(rng, case)
    grads = pre_backward(place, case, upstream)
    assert all(np.isfinite(to_float64(g)).all() for g in grads)
    assert_pre_backward_matches(case, upstream, grads)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", PRE_DTYPES)
@pytest.mark.parametrize("magnitude", (1e19, 2e37))
def test_pre_forward_row_norm_does_not_overflow(rng, place, dtype, magnitude):
    """Rows of width 512 whose sum(x*x) overflows float32 (|x| ~ 1e19), and whose norm itself
    does (|x| ~ 2e37, norm ~ 5e38) though their RMS fits: the RMS must come out finite and
    right. x is clipped to 2 * magnitude so that x_layer (up to n times max |x|) fits."""
    case = random_pre_case(rng, 4, 128, batch=6, dtype=dtype)
    normal = np.clip(rng.standard_normal(case.x.shape), -2, 2)
    case.x = (magnitude * normal).astype(case.x.dtype)
    with np.errstate(over="ignore"):
        squares = np.square(case.x.astype(np.float32))
        assert np.isinf(squares.sum(axis=1, dtype=np.float32)).all()
        norms = np.sqrt(squares.astype(np.float64).sum(axis=1))
        assert magnitude < 1e20 or np.isinf(norms.astype(np.float32)).all()
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    outputs = op(*(on(place, a) for a in (case.phi, case.x, case.b)))
    assert_pre_matches(case, outputs)  # h_post within 5e-5 of float64, x_res and x_layer too


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", PRE_DTYPES)
@pytest.mark.parametrize("magnitude", (1e19, 2e37))
def test_pre_backward_row_norm_does_not_overflow(rng, place, dtype, magnitude):
    """The forward test's rows; upstream gradients of 1e-2 at |x| ~ 2e37, so that every true
    gradient (grad_phi ~ x times them) fits in float32."""
    case = random_pre_case(rng, 4, 128, batch=6, dtype=dtype)
    normal = np.clip(rng.standard_normal(case.x.shape), -2, 2)
    case.x = (magnitude * normal).astype(case.x.dtype)
    size = 1e-2 if magnitude > 1e20 else 1.0
    upstream = tuple((size * g).astype(g.dtype) for g in upstream_grads(rng, case))
    assert_pre_backward_matches(case, upstream, pre_backward(place, case, upstream))


@pytest.mark.parametrize("n", (1, 2))
@pytest.mark.parametrize("dtype", PRE_DTYPES)
def test_pre_backward_products_with_x_do_not_overflow(rng, n, dtype):
    """|x| ~ 1e38 of one sign and upstream gradients of 1: M's and h_pre's gradients (sums of
    c_x products of x with them) exceed float32, while every gradient the op returns fits.
    The host path takes them of the scaled rows (the class docstring's range)."""
    case = random_pre_case(rng, n, 4, batch=1, dtype=dtype)
    case.x = (1e38 * rng.uniform(0.9, 1.0, case.x.shape)).astype(case.x.dtype)
    batch, width = case.x.shape
    upstream = (
        np.ones((batch, width), case.x.dtype),
        np.ones((batch, width // n), case.x.dtype),
        rng.standard_normal((batch, n)).astype(np.float32),
    )
    with np.errstate(over="ignore"):
        layer_product = case.x[0, :4].astype(np.float32).sum(dtype=np.float32)
    assert np.isinf(layer_product)  # grad of h_pre[0], unscaled
    grads = pre_backward("cpu", case, upstream)
    assert all(np.isfinite(to_float64(g)).all() for g in grads)
    assert_pre_backward_matches(case, upstream, grads)


@pytest.mark.parametrize("place", PLACES)
def test_pre_backward_reads_strided_inputs(rng, place):
    """Padded rows, a column-major phi and grad_h_post, a strided b."""
    case = random_pre_case(rng, 4, 130, batch=7, dtype="bfloat16")
    grad_res, grad_layer, grad_post = upstream_grads(rng, case)
    width = case.x.shape[1]

    def padded(array):
        wide = np.zeros((array.shape[0], array.shape[1] + 8), array.dtype)
        wide[:, 3 : 3 + array.shape[1]] = array
        return on(place, wide)[:, 3 : 3 + array.shape[1]]

    def column_major(array):
        return on(place, np.ascontiguousarray(array.T)).T

    op = MHCPreBwdOp(*case.alphas, case.repeat, case.eps)
    with poisoned():
        grads = op(
            column_major(case.phi),
            padded(case.x),
            on(place, np.repeat(case.b, 2))[::2],
            padded(grad_res),
            padded(grad_layer),
            column_major(grad_post),
        )
    assert grads[1].shape == (7, width)
    assert_pre_backward_matches(case, (grad_res, grad_layer, grad_post), grads)


@pytest.mark.gpu
def test_mixed_frameworks_keep_copies_and_scratch_on_the_launch_stream(rng):
    """phi (torch) names the launch's stream; x and the upstream gradients come from CuPy,
    with strided columns, so they are copied. The copies and the scratch must come from the
    launch's stream: with it held behind a sleep, memory that CuPy hands out at once on its
    own stream (here filled with NaN) must not be memory the kernels read."""
    cupy = pytest.importorskip("cupy")
    case = random_pre_case(rng, 4, 256, 300, dtype="float32")  # 300: fresh scratch a call
    upstream = upstream_grads(rng, case)
    layer = rng.standard_normal((300, 256)).astype(np.float32)
    gates = rng.uniform(0, 2, (300, 4)).astype(np.float32)
    pre = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    pre_bwd = MHCPreBwdOp(*case.alphas, case.repeat, case.eps)
    post_bwd = MHCPostBwdOp()
    phi, b, grad_post, layer, gates = (
        on("cuda", a) for a in (case.phi, case.b, upstream[2], layer, gates)
    )

    def calls(x, grad_res, grad_layer):
        return (
            *pre(phi, x, b),
            *pre_bwd(phi, x, b, grad_res, grad_layer, grad_post),
            *post_bwd(layer, gates, grad_res, grad_res)[:2],
        )

    expected = calls(*(on("cuda", a) for a in (case.x, *upstream[:2])))
    templates = []
    allocate = _mhc._operand_buffer

    def spy(template, words):
        templates.append(template.framework)
        return allocate(template, words)

    cupy_stream, side = cupy.cuda.Stream(non_blocking=True), torch.cuda.Stream()
    with cupy_stream, mock.patch.object(_mhc, "_operand_buffer", spy):
        strided = [cupy.asarray(np.repeat(a, 2, axis=1))[:, ::2] for a in (case.x, *upstream[:2])]
        cupy_stream.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)  # the launches below wait behind it
            got = calls(*strided)
        # at once, on CuPy's stream: what its pool freed there is taken and overwritten
        poison = [cupy.full(1 << size, np.nan, np.float32) for size in range(8, 24)]
    torch.cuda.synchronize()
    cupy_stream.synchronize()
    del poison
    assert templates and set(templates) == {"torch"}, "scratch from another framework's pool"
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


def test_pre_backward_torch_cpu_in_torch_out(rng):
    case = random_pre_case(rng, 2, 64, batch=3, dtype="bfloat16")
    upstream = upstream_grads(rng, case)

    def tensor(array):
        if array.dtype == NP_DTYPES["bfloat16"]:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    op = MHCPreBwdOp(*case.alphas, case.repeat, case.eps)
    with poisoned():
        grads = op(*(tensor(a) for a in (case.phi, case.x, case.b, *upstream)))
    assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16, torch.float32, torch.float32]
    assert all(g.device.type == "cpu" for g in grads)
    assert_pre_backward_matches(case, upstream, grads)


def test_pre_backward_in_row_blocks(rng, monkeypatch):
    """Batches larger than one row block (here one row) sum their blocks in order."""
    case = random_pre_case(rng, 4, 64, batch=10, dtype="float32")
    upstream = upstream_grads(rng, case)
    monkeypatch.setattr(_mhc_host, "_BLOCK_FLOATS", 1)
    assert_pre_backward_matches(case, upstream, pre_backward("cpu", case, upstream))


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("batch", (300, 64))  # five launches; one (mhc_bwd_fused)
def test_pre_backward_is_deterministic(rng, place, batch):
    case = random_pre_case(rng, 4, 256, batch=batch, dtype="bfloat16")
    upstream = upstream_grads(rng, case)
    first = [to_float64(g) for g in pre_backward(place, case, upstream)]
    second = [to_float64(g) for g in pre_backward(place, case, upstream)]
    names = ("grad_phi", "grad_x", "grad_b", "grad_alpha")
    for name, a, b in zip(names, first, second, strict=True):
        assert np.array_equal(a, b), f"{name} differs between two runs"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", PRE_DTYPES)
@pytest.mark.parametrize("n, c_x, batch", ((1, 1000, 1), (4, 130, 4), (8, 72, 37), (4, 136, 64)))
def test_pre_backward_one_launch_is_the_five_kernels(rng, monkeypatch, n, c_x, batch, dtype):
    """Small calls (_MAX_FUSED_BWD_*) run the five kernels as stages of one cooperative
    launch (mhc_bwd_fused) on the stream's workspace: the same bits as the five launches of
    the same first-pass stages (the narrow ones, which one launch takes), both within the
    contract, and the workspace's counters left zeroed for the next call (a second call on
    new data)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert _mhc._pre_backward_plan(0, dtype, n, c_x, batch, 20).fused
    for _ in range(2):
        case = random_pre_case(rng, n, c_x, batch, dtype=dtype, repeat=20)
        upstream = upstream_grads(rng, case)
        fused = pre_backward("cuda", case, upstream)
        with monkeypatch.context() as five:
            five.setattr(_mhc, "_MAX_FUSED_BWD_ROWS", 0)
            five.setattr(_mhc, "_wide_first_pass", lambda *args: False)
            five.setattr(_mhc, "_pre_backward_plans", {})
            separate = pre_backward("cuda", case, upstream)
        names = ("grad_phi", "grad_x", "grad_b", "grad_alpha")
        for name, a, b in zip(names, fused, separate, strict=True):
            assert torch.equal(a, b), f"{name}: one launch and five differ"
        assert_pre_backward_matches(case, upstream, fused)


@pytest.mark.gpu
@pytest.mark.parametrize("n, c_x, batch", ((4, 136, 200), (8, 72, 100), (2, 1000, 70)))
def test_pre_backward_token_trace_in_scratch_or_shared_memory(rng, monkeypatch, n, c_x, batch):
    """mhc_bwd_token keeps the Sinkhorn trace in shared memory where its blocks all fit at
    once, else in the scratch (forced here), and with many first-pass splits runs after
    mhc_bwd_splits: the same bits each way, within the contract."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    case = random_pre_case(rng, n, c_x, batch, dtype="bfloat16", repeat=20)
    upstream = upstream_grads(rng, case)
    monkeypatch.setattr(_mhc, "_pre_backward_plans", {})
    plan = _mhc._pre_backward_plan(0, "bfloat16", n, c_x, batch, 20)
    token = plan.steps[-3]
    assert not plan.fused and token.shared_mem > 0 and plan.scratch[-1] == 0
    summed_apart = plan.k_splits > _mhc._TOKEN_SPLITS
    assert (plan.token_splits == 1) == (len(plan.steps) == 6) == summed_apart
    in_shared = pre_backward("cuda", case, upstream)
    with monkeypatch.context() as scratch:
        scratch.setattr(_mhc, "_pre_backward_plans", {})
        scratch.setattr(_mhc, "_token_trace_smem", lambda *args: 0)
        scratch.setattr(_mhc, "_TOKEN_SPLITS", 1 << 30)  # every split summed by the token
        in_scratch = pre_backward("cuda", case, upstream)
        plan = _mhc._pre_backward_plan(0, "bfloat16", n, c_x, batch, 20)
        assert plan.steps[-3].shared_mem == 0 and len(plan.steps) == 5
    names = ("grad_phi", "grad_x", "grad_b", "grad_alpha")
    for name, a, b in zip(names, in_shared, in_scratch, strict=True):
        assert torch.equal(a, b), f"{name}: the token stage's two layouts differ"
    assert_pre_backward_matches(case, upstream, in_shared)


@pytest.mark.gpu
@pytest.mark.parametrize("n, c_x, batch", ((4, 136, 600), (8, 72, 520), (2, 64, 700)))
def test_pre_backward_launched_early_gives_the_same_bits(rng, monkeypatch, n, c_x, batch):
    """On sm_90, from _MIN_EARLY_ROWS tokens, every kernel after mhc_bwd_pieces starts as the
    one before it ends (programmatic dependent launch; each waits in the kernel for what the
    ones before wrote): the same bits as the plan launched in plain stream order (a larger
    threshold here), and the oracle's values. On an H100 or H200 the first two shapes take
    mhc_bwd_splits too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    case = random_pre_case(rng, n, c_x, batch, dtype="bfloat16", repeat=20)
    upstream = upstream_grads(rng, case)
    results = []
    for threshold in (1 << 30, _mhc._MIN_EARLY_ROWS):  # plain, then as shipped
        monkeypatch.setattr(_mhc, "_MIN_EARLY_ROWS", threshold)
        monkeypatch.setattr(_mhc, "_pre_backward_plans", {})
        plan = _mhc._pre_backward_plan(0, "bfloat16", n, c_x, batch, 20)
        early = _cuda.device_attribute(0, _cuda.COMPUTE_MAJOR) >= 9 and threshold <= batch
        assert [step.programmatic for step in plan.steps[1:]] == [early] * (len(plan.steps) - 1)
        results.append(pre_backward("cuda", case, upstream))
    names = ("grad_phi", "grad_x", "grad_b", "grad_alpha")
    for name, a, b in zip(names, *results, strict=True):
        assert torch.equal(a, b), f"{name}: the early launches differ from plain ones"
    assert_pre_backward_matches(case, upstream, results[1])


def _modelled_device(monkeypatch, optin: int, function, major: int = 9) -> None:
    """A device for _pre_backward_plan: sm_``major``0 with 132 multiprocessors, ``optin``
    bytes of shared memory a block, 132 resident blocks of any kernel, kernels as
    ``function`` makes them, and no plan remembered."""
    limits = {_cuda.MAX_SMEM_OPTIN: optin, _cuda.MULTIPROCESSORS: 132, _cuda.COMPUTE_MAJOR: major}
    monkeypatch.setattr(
        _cuda, "device_attribute", lambda device, attribute: limits.get(attribute, 9)
    )
    monkeypatch.setattr(_mhc._cuda, "function", function)
    monkeypatch.setattr(_mhc, "_resident_blocks", lambda kernel, device, threads, smem: 132)
    monkeypatch.setattr(_mhc, "_pre_backward_plans", {})


@pytest.mark.parametrize("major", (8, 9))
def test_pre_backward_launches_early_from_sm90_and_512_tokens(monkeypatch, major):
    """Beyond the one-launch plan, every pre backward kernel after mhc_bwd_pieces waits for
    the one before in the kernel (griddepcontrol.wait) and is launched with programmatic
    stream serialization on sm_90 from _MIN_EARLY_ROWS tokens (mhc_bwd_splits too, where the
    first pass's splits are summed apart); below that, and before sm_90, plain stream order."""
    _modelled_device(monkeypatch, 227 << 10, lambda spec, name, device: name.split("<")[0], major)
    monkeypatch.setattr(_mhc, "_token_trace_smem", lambda *args: 0)
    kernels = set()
    for batch, c_x in ((65, 4096), (_mhc._MIN_EARLY_ROWS - 1, 4096), (_mhc._MIN_EARLY_ROWS, 64),
                       (4096, 4096), (16384, 7168)):  # fmt: skip
        plan = _mhc._pre_backward_plan(0, "bfloat16", 4, c_x, batch, 20)
        assert not plan.fused and plan.steps[0].kernel == "mhc_bwd_pieces"
        early = major >= 9 and batch >= _mhc._MIN_EARLY_ROWS
        assert [step.programmatic for step in plan.steps] == [False] + [early] * (
            len(plan.steps) - 1
        )
        kernels.update(step.kernel for step in plan.steps)
    assert "mhc_bwd_splits" in kernels


def test_pre_backward_plan_token_stage(monkeypatch):
    """_pre_backward_plan on a modelled device (132 multiprocessors, 227 KB of shared memory
    a block, two token blocks of the n = 4 trace each): mhc_bwd_splits before mhc_bwd_token
    past _TOKEN_SPLITS first-pass splits, the trace in shared memory while every token block
    is resident at once (no scratch section for it), else in the scratch."""
    _modelled_device(monkeypatch, 227 << 10, lambda spec, name, device: name.split("<")[0])
    monkeypatch.setattr(_mhc, "_dynamic_smem_limit", lambda kernel, device: 227 << 10)
    monkeypatch.setattr(
        _mhc, "_per_multiprocessor", lambda kernel, device, threads, smem: (227 << 10) // smem
    )
    trace = 20 * 16 * _mhc._TOKEN_THREADS * 4  # bytes: 20 steps of a 4x4 matrix a token
    for batch, c_x, splits, apart, shared in (
        (256, 4096, 64, True, trace),  # 2 tiles of 128 tokens: many splits
        (4096, 4096, 4, False, trace),  # 32 tiles: 4 splits, summed by each token's thread
        (65536, 1024, 1, False, 0),  # 1024 token blocks: more than resident at once
    ):
        plan = _mhc._pre_backward_plan(0, "bfloat16", 4, c_x, batch, 20)
        kernels = [step.kernel for step in plan.steps]
        assert kernels[:2] == ["mhc_bwd_pieces", "mhc_bwd_stats"]
        assert kernels[-3:] == ["mhc_bwd_token", "mhc_bwd_grad", "mhc_bwd_reduce"]
        assert ("mhc_bwd_splits" in kernels) == apart and plan.k_splits == splits
        assert plan.token_splits == (1 if apart else splits)
        token = plan.steps[-3]
        assert token.shared_mem == shared and token.grid[0] == batch // _mhc._TOKEN_THREADS
        assert plan.scratch[-1] == (0 if shared else 20 * 16 * batch)
        if apart:
            assert plan.steps[2].grid[0] == -(-45 * batch // _mhc._REDUCE_THREADS)
    fused = _mhc._pre_backward_plan(0, "bfloat16", 4, 256, 64, 20)
    assert fused.fused and fused.token_splits == 1 and len(fused.steps) == 1
    # one launch only where the rows and all of x are small (_MAX_FUSED_BWD_*)
    for c_x, batch in ((4096, 1), (1280, 16), (256, 65)):
        assert not _mhc._pre_backward_plan(0, "bfloat16", 4, c_x, batch, 20).fused


@pytest.mark.parametrize(
    "dtype, n, c_x, batch, blocks, per_chunk",
    (
        ("bfloat16", 4, 4096, 4096, 128, 2),  # 64 chunks: 2 blocks each, 128 of 132
        ("float32", 4, 2048, 2048, 128, 2),
        ("bfloat16", 4, 4096, 256, 128, 2),  # 8 tiles a chunk
        ("bfloat16", 4, 7168, 16384, 132, 0),  # 112 chunks: one block each would idle 20
        ("float32", 5, 2048, 2048, 132, 0),  # past n = 4 the even shares stay
    ),
)
def test_pre_backward_grad_blocks_align_with_chunks(
    monkeypatch, dtype, n, c_x, batch, blocks, per_chunk
):
    """Up to n = 4 the grad pass takes a whole number of blocks a column chunk where that
    keeps _GRAD_ALIGNED_SHARE of the resident blocks (132 on the modelled device): then each
    block's share of the (chunk, tile) items lies in one chunk, chunk j // per_chunk, and a
    chunk has per_chunk partials of grad_phi. Elsewhere every resident block takes a share."""
    _modelled_device(monkeypatch, 227 << 10, lambda spec, name, device: name.split("<")[0])
    monkeypatch.setattr(_mhc, "_token_trace_smem", lambda *args: 0)
    plan = _mhc._pre_backward_plan(0, dtype, n, c_x, batch, 20)
    assert not plan.fused and plan.grad_blocks == blocks
    assert plan.steps[-2].grid[0] == blocks
    tiles = -(-batch // _mhc._GRAD_TILE)
    items = plan.grad_items
    assert items == -(-c_x // _mhc._geometry(dtype, n).c_grad) * tiles
    chunks_of = [  # the chunks of block j's first and last item (the kernel's shares)
        (j * items // blocks // tiles, ((j + 1) * items // blocks - 1) // tiles)
        for j in range(blocks)
    ]
    if per_chunk:
        assert chunks_of == [(j // per_chunk, j // per_chunk) for j in range(blocks)]
        assert plan.slot_cap == per_chunk
    else:
        assert any(first != last for first, last in chunks_of)


@pytest.mark.parametrize(
    "dtype, n, c_x, batch, optin, c_stage",
    (
        ("bfloat16", 4, 4096, 4096, 227 << 10, 32),  # wide: 128 positions a stage
        ("float16", 2, 4096, 4096, 227 << 10, 64),
        ("bfloat16", 4, 256, 64, 227 << 10, 16),  # one launch: narrow
        ("bfloat16", 4, 4096, 4096, 166912, 16),  # sm_80: two wide stages do not fit
        ("bfloat16", 6, 4096, 4096, 227 << 10, 8),  # FMA products: 64 positions
        ("float32", 4, 4096, 4096, 227 << 10, 8),  # 32 positions
    ),
)
def test_pre_backward_first_pass_stage_width(monkeypatch, dtype, n, c_x, batch, optin, c_stage):
    """The first pass takes about 128 K positions a stage (64-byte runs of each bf16 row at
    n = 4) where the token products run on the tensor cores, two such stages fit a block
    and the call is more than one launch; else 64 (16-bit x) or 32 (float32). The module's
    BWD_C_STAGE and the plan agree, and every K split has a block of columns."""
    _modelled_device(monkeypatch, optin, lambda spec, name, device: spec.defines)
    monkeypatch.setattr(_mhc, "_per_multiprocessor", lambda kernel, device, threads, smem: 1)
    monkeypatch.setattr(_mhc, "_token_trace_smem", lambda *args: 0)
    plan = _mhc._pre_backward_plan(0, dtype, n, c_x, batch, 20)
    assert f"BWD_C_STAGE={c_stage}" in plan.steps[0].kernel
    assert plan.k_splits <= -(-c_x // c_stage)  # every split has a column block
    stage_bytes = _mhc._geometry(dtype, n, c_stage == 128 // n).stats_stage_bytes
    assert plan.stats_stages == min(3, optin // stage_bytes) >= 2


@pytest.mark.parametrize("n", (1, 2, 4))
@pytest.mark.parametrize("saturated", (False, True))
@pytest.mark.parametrize(("repeat", "eps"), ((0, 0.02), (3, 0.0), (20, 0.02)))
def test_the_numpy_and_torch_oracles_agree(rng, n, saturated, repeat, eps):
    """The forward oracle (numpy, pre_reference) and the one torch differentiates for the
    gradients (torch_pre_reference) are one oracle: the same float64 numbers."""
    case = random_pre_case(rng, n, 24, 6, dtype="float32", repeat=repeat, eps=eps,
                           saturated=saturated)  # fmt: skip
    ref = pre_reference(case)
    as_tensors = (torch.from_numpy(a.astype(np.float64)) for a in (case.phi, case.x, case.b))
    outputs = torch_pre_reference(*as_tensors, case.alphas, repeat, eps)
    for name, got in zip(("x_res", "x_layer", "h_post"), outputs, strict=True):
        np.testing.assert_allclose(got.numpy(), ref[name], rtol=1e-12, atol=1e-12, err_msg=name)


# --------------------------------------------------------------------------- post


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
@pytest.mark.parametrize("n", (1, 2, 4, 6, 8))
def test_post_backward_matches_oracle(rng, place, n, dtype):
    """Each shape twice on one op with fresh data: the second call of a torch CUDA layout
    relaunches the first call's launch with new addresses. 19 rows: a batch no power of two
    divides, so a layout that put several rows in a block would have a partial last one."""
    op = MHCPostBwdOp()
    for c_x, batch in ((130, 5), (1000, 19), (4096, 2)):
        for _ in range(2):
            layer = rng.standard_normal((batch, c_x)).astype(NP_DTYPES[dtype])
            gates = rng.uniform(0, 2, (batch, n)).astype(np.float32)
            res = rng.standard_normal((batch, n * c_x)).astype(NP_DTYPES[dtype])
            grad_out = rng.standard_normal((batch, n * c_x)).astype(NP_DTYPES[dtype])
            inputs = [on(place, a) for a in (layer, gates, res, grad_out)]
            with poisoned():
                grads = op(*inputs)
            assert grads[2] is inputs[3]  # the gradient passes through x_res uncopied
            assert [dtype_name(g) for g in grads] == [dtype, "float32", dtype]
            assert [tuple(g.shape) for g in grads] == [layer.shape, gates.shape, res.shape]
            assert_post_backward_matches(layer, gates, grad_out, grads, dtype)


@pytest.mark.parametrize("place", PLACES)
def test_post_backward_strided_inputs(rng, place):
    batch, n, c_x = 6, 4, 70
    layer = rng.standard_normal((batch, c_x)).astype(np.float32)
    gates = rng.uniform(0, 2, (batch, n)).astype(np.float32)
    res = rng.standard_normal((batch, n * c_x)).astype(np.float32)
    grad_out = rng.standard_normal((batch, n * c_x)).astype(np.float32)
    wide = np.zeros((batch, n * c_x + 5), np.float32)
    wide[:, 2:-3] = grad_out
    with poisoned():
        grads = MHCPostBwdOp()(
            on(place, np.repeat(layer, 2, axis=1))[:, ::2],  # strided columns
            on(place, np.ascontiguousarray(gates.T)).T,  # column-major
            on(place, res),
            on(place, wide)[:, 2:-3],  # padded rows
        )
    assert_post_backward_matches(layer, gates, grad_out, grads, "float32")


@pytest.mark.parametrize(
    ("place", "first", "upstream", "dtype"),
    per_place({
        "cpu": (
            ("numpy", "torch", "bfloat16"),
            ("torch", "numpy", "float32"),
            ("torch", "numpy", "bfloat16"),  # (NumPy's bf16 bits as a torch bfloat16 view)
        ),
        "cuda": (("torch", "cupy", "bfloat16"), ("cupy", "torch", "float32")),
    }),
)  # fmt: skip
def test_post_backward_results_come_in_the_first_arguments_framework(
    rng, place, first, upstream, dtype
):
    """SPEC 6: every result in x_layer_out's framework, grad_x_res too where grad_x_out is
    another framework's: a view of grad_x_out's own memory (a write through it shows there)."""
    batch, n, c_x = 3, 2, 8
    layer = rng.standard_normal((batch, c_x)).astype(NP_DTYPES[dtype])
    gates = rng.uniform(0, 2, (batch, n)).astype(np.float32)
    res = rng.standard_normal((batch, n * c_x)).astype(NP_DTYPES[dtype])
    grad_out = rng.standard_normal((batch, n * c_x)).astype(NP_DTYPES[dtype])
    inputs = [to_place(a, place, first) for a in (layer, gates, res)]
    grad_in = to_place(grad_out, place, upstream)
    grads = MHCPostBwdOp()(*inputs, grad_in)
    assert [framework_name(g) for g in grads] == [first] * 3
    assert_post_backward_matches(layer, gates, grad_out, grads, dtype)
    grads[2][1, 5] = 7
    assert to_float64(grad_in)[1, 5] == 7


# --------------------------------------------------------------------------- empty, chained


@pytest.mark.parametrize("place", PLACES)
def test_empty_batch(rng, place):
    n, c_x = 2, 8
    case = random_pre_case(rng, n, c_x, batch=0, dtype="bfloat16")
    upstream = upstream_grads(rng, case)
    grads = pre_backward(place, case, upstream)
    check_pre_layouts(place, case, grads)
    sums = (grads[0], grads[2], grads[3])
    for name, grad in zip(("grad_phi", "grad_b", "grad_alpha"), sums, strict=True):
        assert not to_float64(grad).any(), f"{name} of an empty batch must be 0"
    layer, gates = np.zeros((0, c_x), np.float32), np.zeros((0, n), np.float32)
    res = np.zeros((0, n * c_x), np.float32)
    with poisoned():
        grads = MHCPostBwdOp()(*(on(place, a) for a in (layer, gates, res, res)))
    assert [tuple(g.shape) for g in grads] == [(0, c_x), (0, n), (0, n * c_x)]
    # c_x = 0: nothing to sum, grad_h_post is 0
    layer = res = np.zeros((3, 0), np.float32)
    gates = np.ones((3, n), np.float32)
    with poisoned():
        grads = MHCPostBwdOp()(*(on(place, a) for a in (layer, gates, res, res)))
    assert tuple(grads[1].shape) == (3, n) and not to_float64(grads[1]).any()


def _tanh(array):
    return np.tanh(array) if isinstance(array, np.ndarray) else array.tanh()


@pytest.mark.parametrize("place", PLACES)
def test_training_step_chain(rng, place):
    """pre -> tanh layer -> post -> loss = sum(x_out * G): the ops' forward and backward
    chained by hand give the float64 torch autograd gradients of phi, x, b and the alphas."""
    batch, n, c_x = 6, 4, 64
    case = random_pre_case(rng, n, c_x, batch, dtype="float32")
    weights = rng.standard_normal((batch, n * c_x)).astype(np.float32)  # d loss / d x_out
    phi, x, b = (on(place, a) for a in (case.phi, case.x, case.b))
    pre_fwd = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    pre_bwd = MHCPreBwdOp(*case.alphas, case.repeat, case.eps)
    x_res, x_layer, h_post = pre_fwd(phi, x, b)
    layer_out = _tanh(x_layer)
    x_out = MHCPostFwdOp()(layer_out, h_post, x_res)
    with poisoned():
        grad_layer_out, grad_h_post, grad_x_res = MHCPostBwdOp()(
            layer_out, h_post, x_res, on(place, weights)
        )
        grad_x_layer = grad_layer_out * (1 - layer_out * layer_out)
        grads = pre_bwd(phi, x, b, grad_x_res, grad_x_layer, grad_h_post)

    phi64, x64, b64 = (as_float64_tensor(a) for a in (case.phi, case.x, case.b))
    alphas = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in case_alphas(case)]
    res64, layer64, post64 = torch_pre_reference(phi64, x64, b64, alphas, case.repeat, case.eps)
    out64 = post64[:, :, None] * torch.tanh(layer64)[:, None, :] + res64.reshape(batch, n, c_x)
    (out64.reshape(batch, -1) * torch.from_numpy(weights.astype(np.float64))).sum().backward()
    np.testing.assert_allclose(to_float64(x_out), out64.detach().reshape(batch, -1), atol=1e-4)
    ref = {
        "grad_phi": phi64.grad.numpy(),
        "grad_x": x64.grad.numpy(),
        "grad_b": b64.grad.numpy(),
        "grad_alpha": np.array([a.grad.item() for a in alphas]),
    }
    assert_pre_grads_match(ref, grads, "float32")


def _phi_scaled(phi, alphas, n: int):
    """phi with its three column blocks scaled by (alpha_pre, alpha_post, alpha_res)."""
    scale = torch.cat([alphas[0].expand(n), alphas[1].expand(n), alphas[2].expand(n * n)])
    return phi * scale


@pytest.mark.parametrize("place", PLACES)
def test_alphas_learned_through_phi(rng, place):
    """The README's way to learn the alphas: folded into phi's columns (``alpha*h`` is
    ``x @ (phi*scale)``), the op built with 1.0. The outputs are those of the op built
    with the alphas; the alphas' gradients, through torch, are its grad_alpha; and a
    function compiled once serves every value of the alphas, without a recompile."""
    from torch._dynamo.testing import CompileCounter

    case = random_pre_case(rng, 4, 64, 6, dtype="float32")
    phi, x, b = (torch.from_numpy(a).to(place) for a in (case.phi, case.x, case.b))
    alphas = torch.tensor(case.alphas, device=place, requires_grad=True)
    folded = MHCPreFwdOp(1.0, 1.0, 1.0, case.repeat, case.eps)
    outputs = folded(_phi_scaled(phi, alphas, 4), x, b)
    built_with_alphas = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)(phi, x, b)
    for got, want in zip(outputs, built_with_alphas, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    upstream = [torch.randn_like(output) for output in outputs]
    torch.autograd.backward(outputs, upstream)
    *_, grad_alpha = MHCPreBwdOp(*case.alphas, case.repeat, case.eps)(phi, x, b, *upstream)
    scale = grad_alpha.abs().max().item()
    torch.testing.assert_close(alphas.grad, grad_alpha, rtol=0, atol=1e-4 * scale)

    counter = CompileCounter()
    step = torch.compile(
        lambda alphas: folded(_phi_scaled(phi, alphas, 4), x, b)[1].sum(),
        backend=counter, fullgraph=True,
    )  # fmt: skip
    for value in (0.5, 1.5, 2.5):
        step(torch.full((3,), value, device=place, requires_grad=True)).backward()
    assert counter.frame_count == 1


# --------------------------------------------------------------------------- validation


@contextlib.contextmanager
def nothing_written():
    """Fail if an op allocates or computes before its validation raised."""

    def refuse(*args, **kwargs):
        raise AssertionError("an output was allocated or written before validation")

    with (
        mock.patch.object(sequence_modeling, "empty_like", refuse),
        mock.patch.object(_mhc, "mhc_pre_backward", refuse),
        mock.patch.object(_mhc, "mhc_post_backward", refuse),
    ):
        yield


def _pre_arguments(n=2, c_x=8, batch=3) -> dict:
    q = n * n + 2 * n
    return {
        "phi": np.zeros((n * c_x, q), np.float32),
        "x": np.zeros((batch, n * c_x), np.float32),
        "b": np.zeros(q, np.float32),
        "grad_x_res": np.zeros((batch, n * c_x), np.float32),
        "grad_x_layer": np.zeros((batch, c_x), np.float32),
        "grad_h_post": np.zeros((batch, n), np.float32),
    }


BF16 = NP_DTYPES["bfloat16"]


@pytest.mark.parametrize(
    "name, mutate, error, message",
    [
        ("phi", lambda a: a[None], ValueError, "phi must be 2-D"),
        ("phi", lambda a: a[:, :7], ValueError, r"phi must have n\*n\+2n columns"),
        ("x", lambda a: a.astype(np.float64), TypeError, "x must be bfloat16"),
        ("x", lambda a: a[:, :15], ValueError, "x width must equal phi rows"),
        ("b", lambda a: a[:7], ValueError, "b must have phi's width 8"),
        ("phi", lambda a: a.tolist(), TypeError, "phi must be an array"),
        ("grad_x_res", lambda a: a[None], ValueError, r"grad_x_res must be 2-D \[3, 16\]"),
        ("grad_x_res", lambda a: a[:, :15], ValueError, r"x_res's shape \[3, 16\], got \[3, 15\]"),
        ("grad_x_res", lambda a: a[:2], ValueError, r"x_res's shape \[3, 16\], got \[2, 16\]"),
        ("grad_x_res", lambda a: a.astype(BF16), TypeError, "float32 like x_res, got bfloat16"),
        ("grad_x_layer", lambda a: a[0], ValueError, r"grad_x_layer must be 2-D \[3, 8\]"),
        ("grad_x_layer", lambda a: a[:, :7], ValueError, r"x_layer's shape \[3, 8\], got \[3, 7\]"),
        ("grad_x_layer", lambda a: a.astype(np.float16), TypeError, "float32 like x_layer"),
        ("grad_x_layer", lambda a: a.tolist(), TypeError, "grad_x_layer must be an array"),
        ("grad_h_post", lambda a: a[:, :1], ValueError, r"h_post's shape \[3, 2\], got \[3, 1\]"),
        ("grad_h_post", lambda a: a[None], ValueError, "grad_h_post must be 2-D"),
        ("grad_h_post", lambda a: a.astype(np.float64), TypeError, "grad_h_post must be float32"),
    ],
)
def test_pre_backward_validation(name, mutate, error, message):
    arguments = _pre_arguments()
    arguments[name] = mutate(arguments[name])
    op = MHCPreBwdOp(1, 1, 1, 20)
    with nothing_written(), pytest.raises(error, match=message):
        op(*arguments.values())


def test_pre_backward_bf16_upstream_follows_x():
    arguments = _pre_arguments()
    for name in ("x", "grad_x_res", "grad_x_layer"):
        arguments[name] = arguments[name].astype(BF16)
    with poisoned():
        grads = MHCPreBwdOp(1, 1, 1, 20)(*arguments.values())
    assert [dtype_name(g) for g in grads] == ["float32", "bfloat16", "float32", "float32"]
    arguments["grad_x_layer"] = arguments["grad_x_layer"].astype(np.float32)
    with nothing_written(), pytest.raises(TypeError, match="bfloat16 like x_layer, got float32"):
        MHCPreBwdOp(1, 1, 1, 20)(*arguments.values())


def test_pre_backward_constructor_is_the_forward_one():
    for args, error, message in (
        ((1, 1, 1, -1), ValueError, r"sinkhorn_repeat must be in \[0, 2\*\*30\)"),
        ((1, 1, 1, 2**63), ValueError, r"sinkhorn_repeat must be in \[0, 2\*\*30\)"),
        ((1, 1, 1, 2.5), TypeError, "sinkhorn_repeat must be an int"),
        ((1, 1, 1, 3, -0.1), ValueError, "sinkhorn_eps must be >= 0"),
        ((1, 1, float("nan"), 3), ValueError, "alpha_res must be finite"),
        (("one", 1, 1, 3), TypeError, "alpha_pre must be a number"),
        # finite, but inf in the float32 arithmetic
        ((1, -1e39, 1, 3), ValueError, "alpha_post must lie within float32's range"),
        ((1, 1, 1, 3, 1e39), ValueError, "sinkhorn_eps must lie within float32's range"),
    ):
        for op_class in (MHCPreFwdOp, MHCPreBwdOp):
            with pytest.raises(error, match=message):
                op_class(*args)
    with pytest.raises(ValueError, match="target must be"):
        MHCPreBwdOp(1, 1, 1, 3, target="tpu")
    forward, backward = MHCPreFwdOp(1.5, 2, 0.5, 7, 0.01), MHCPreBwdOp(1.5, 2, 0.5, 7, 0.01)
    assert backward.config == forward.config == (1.5, 2.0, 0.5, 7, 0.01, "")
    assert repr(backward) == repr(forward).replace("MHCPreFwdOp", "MHCPreBwdOp")
    with nothing_written(), pytest.raises(ValueError, match="target='cuda' but phi is on the host"):
        MHCPreBwdOp(1, 1, 1, 3, target="cuda")(*_pre_arguments().values())


def _post_arguments(n=2, c_x=8, batch=3, dtype=np.float32) -> dict:
    return {
        "x_layer_out": np.zeros((batch, c_x), dtype),
        "h_post": np.zeros((batch, n), np.float32),
        "x_res": np.zeros((batch, n * c_x), dtype),
        "grad_x_out": np.zeros((batch, n * c_x), dtype),
    }


@pytest.mark.parametrize(
    "name, mutate, error, message",
    [
        ("x_layer_out", lambda a: a[None], ValueError, "x_layer_out must be 2-D"),
        ("h_post", lambda a: a.astype(np.float16), TypeError, "h_post must be float32"),
        ("x_res", lambda a: a[:, :15], ValueError, r"x_res width must be n\*c_x"),
        ("x_res", lambda a: a[:2], ValueError, "same batch, got 3, 3 and 2"),
        ("grad_x_out", lambda a: a[0], ValueError, r"grad_x_out must be 2-D \[3, 16\]"),
        ("grad_x_out", lambda a: a[:, :15], ValueError, r"x_out's shape \[3, 16\], got \[3, 15\]"),
        ("grad_x_out", lambda a: a[:2], ValueError, r"x_out's shape \[3, 16\], got \[2, 16\]"),
        ("grad_x_out", lambda a: a.astype(BF16), TypeError, "float32 like x_out, got bfloat16"),
        ("grad_x_out", lambda a: a.tolist(), TypeError, "grad_x_out must be an array"),
    ],
)
def test_post_backward_validation(name, mutate, error, message):
    arguments = _post_arguments()
    arguments[name] = mutate(arguments[name])
    with nothing_written(), pytest.raises(error, match=message):
        MHCPostBwdOp()(*arguments.values())
    with nothing_written(), pytest.raises(ValueError, match="target='cuda' but x_layer_out"):
        MHCPostBwdOp(target="cuda")(*_post_arguments().values())


@pytest.mark.gpu
def test_backward_inputs_on_different_devices():
    arguments = {name: on("cuda", a) for name, a in _pre_arguments().items()}
    arguments["grad_h_post"] = _pre_arguments()["grad_h_post"]
    with nothing_written(), pytest.raises(ValueError, match="grad_h_post is on the host"):
        MHCPreBwdOp(1, 1, 1, 3)(*arguments.values())
    arguments = {name: on("cuda", a) for name, a in _post_arguments().items()}
    arguments["grad_x_out"] = _post_arguments()["grad_x_out"]
    with nothing_written(), pytest.raises(ValueError, match="grad_x_out is on the host"):
        MHCPostBwdOp()(*arguments.values())


@pytest.mark.parametrize("layout", ("reversed", "big-endian", "read-only"))
def test_post_backward_hands_back_a_grad_torch_cannot_view(rng, layout):
    """A NumPy grad_x_out beside torch inputs comes back as a torch view of its memory,
    where torch can make one; reversed, big-endian or read-only it cannot (nor without a
    copy), and grad_x_res is then grad_x_out itself, as when the frameworks agree."""
    batch, n, c_x = 3, 2, 8
    layer = torch.from_numpy(rng.standard_normal((batch, c_x)).astype(np.float32))
    gates = torch.from_numpy(rng.uniform(0, 2, (batch, n)).astype(np.float32))
    res = torch.zeros(batch, n * c_x)
    grad_out = rng.standard_normal((batch, n * c_x)).astype(np.float32)
    if layout == "reversed":
        grad_out = grad_out[::-1]
    elif layout == "big-endian":
        grad_out = grad_out.astype(">f4")
    else:
        grad_out.flags.writeable = False
    grads = MHCPostBwdOp()(layer, gates, res, grad_out)
    assert grads[2] is grad_out
    assert_post_backward_matches(layer.numpy(), gates.numpy(), grad_out, grads, "float32")
