"""mHC pre/post against the float64 oracle (SPEC 5 on every element), on the host path (the
numpy body) and on a CUDA device (the kernels), plus every validation error and the CUDA
launch planning (no GPU needed).

A case that runs in both places is one test parametrized over the place (``_cases``): numpy
and torch CPU inputs on the host, torch CUDA and CuPy on the device (``gpu``-marked: skipped
without one). The device runs the shapes that pick its launch paths (one ordinary launch for
decode batches, one cooperative launch for batch <= 256, K split over tiles, the
element-wise path for a c_x no vector width divides); the tests of streams, decode launches
and device errors are device only.
"""

from __future__ import annotations

import inspect
import math
import re

import ml_dtypes
import numpy as np
import pytest
from _cases import FRAMEWORKS, GPU, PLACES, per_place, require, synchronize, to_place
from _mhc_oracle import (
    NP_DTYPES,
    assert_post_matches,
    assert_pre_matches,
    pre_reference,
    random_pre_case,
    to_float64,
)
from _oracle import dtype_name, framework_name

from tileops_cupy import _cuda, _mhc
from tileops_cupy._mhc import plan_geometry, small_geometry
from tileops_cupy.sequence_modeling import (
    MHCPostBwdOp,
    MHCPostFwdOp,
    MHCPreBwdOp,
    MHCPreFwdOp,
    streams_of,
)

_EMPTY = inspect.Parameter.empty

DTYPES = ("bfloat16", "float16", "float32")


def run_pre(case, place="cpu", framework=None, **kwargs):
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps, **kwargs)
    return op(*(to_place(a, place, framework) for a in (case.phi, case.x, case.b)))


def assert_placed(outputs, place: str, framework: str | None, dtypes) -> None:
    """Each output is an array of ``framework`` (default: numpy on the host, torch on the
    device) on ``place``, of its dtype."""
    framework = framework or {"cpu": "numpy", "cuda": "torch"}[place]
    for output, dtype in zip(outputs, dtypes, strict=True):
        assert framework_name(output) == framework, (type(output), framework)
        assert dtype_name(output) == dtype, (dtype_name(output), dtype)
        if framework == "torch":
            assert output.device.type == place, output.device


# --------------------------------------------------------------------------- pre

# (c_x, batch). On the device, a batch of <= 64 tokens and <= 2**18 elements runs as one
# mhc_pre_small launch (37 and 64: two groups of tokens, the second partial or full; 1000 x 37
# with n = 8 is too large), batch <= 256 as one cooperative launch (K
# split over every multiprocessor; 200 is two tiles); 300 is three tiles whose K splits' last
# block computes the coefficients; a c_x that no vector width divides (130) takes the
# element-wise path
PRE_SHAPES = {
    "cpu": ((1000, 5), (130, 5)),
    "cuda": ((1000, 1), (130, 4), (1000, 37), (136, 64), (136, 200), (130, 300), (64, 5)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 2, 4, 6, 8))
@pytest.mark.parametrize(("place", "c_x", "batch"), per_place(PRE_SHAPES))
def test_pre_matches_oracle(rng, place, c_x, batch, n, dtype):
    case = random_pre_case(rng, n, c_x, batch, dtype=dtype)
    outputs = run_pre(case, place)
    assert_placed(outputs, place, None, (dtype, dtype, "float32"))
    assert_pre_matches(case, outputs)


SINKHORN_SHAPES = {"cpu": ((64, 9),), "cuda": ((256, 3), (256, 40))}  # (c_x, batch)


@pytest.mark.parametrize("eps", (0.0, 0.02))
@pytest.mark.parametrize("repeat", (0, 1, 20))
@pytest.mark.parametrize(("place", "c_x", "batch"), per_place(SINKHORN_SHAPES))
def test_pre_sinkhorn_settings(rng, place, c_x, batch, repeat, eps):
    case = random_pre_case(rng, 4, c_x, batch, repeat=repeat, eps=eps)
    assert_pre_matches(case, run_pre(case, place))


@pytest.mark.parametrize("place", PLACES)
def test_pre_sinkhorn_converges_to_doubly_stochastic(rng, place):
    """With eps = 0 and many iterations the mixing matrix is doubly stochastic, so x_res
    conserves the streams' column sums."""
    case = random_pre_case(rng, 4, 32, batch=6, dtype="float32", repeat=200, eps=0.0)
    x_res, _, _ = run_pre(case, place)
    x = case.x.astype(np.float64).reshape(6, 4, 32)
    mixed = to_float64(x_res).reshape(6, 4, 32)
    np.testing.assert_allclose(mixed.sum(axis=1), x.sum(axis=1), atol=1e-4)


SATURATED_C_X = {"cpu": 130, "cuda": 136}


@pytest.mark.parametrize("n", (1, 4, 8))
@pytest.mark.parametrize("place", PLACES)
def test_pre_saturated(rng, place, n):
    case = random_pre_case(rng, n, SATURATED_C_X[place], batch=64, saturated=True)
    case.b[:n] = -1e4  # every pre gate is exactly 0: x_layer rows all zero
    alpha_pre, alpha_post, alpha_res = case.alphas
    # alpha_post as drawn, then raised to |alpha_post| >= 2, which puts most post gates within
    # 1e-3 of 0 or 2 (a drawn 0.5 leaves n = 1 short of half for 40% of seeds)
    for alpha in (alpha_post, math.copysign(max(abs(alpha_post), 2.0), alpha_post)):
        case.alphas = (alpha_pre, alpha, alpha_res)
        x_res, x_layer, h_post = run_pre(case, place)
        assert not to_float64(x_layer).any()
        assert_pre_matches(case, (x_res, x_layer, h_post))
    gates = to_float64(h_post)
    assert (np.minimum(gates, 2 - gates) < 1e-3).mean() > 0.5  # the post gates saturate too


@pytest.mark.parametrize("place", PLACES)
def test_pre_wide_rows_keep_h_post_within_tolerance(rng, place):
    """28672-wide rows (n 4, c_x 7168) whose post gates read 64 of x's columns through
    weights of scale 20, so that ``h / rms`` is about 160 while h itself is a short sum, and
    post biases that put one post gate of each of four rows at its steepest: there h_post
    carries the row's sum of squares' relative error times ``h / rms``, so that sum in one
    running float32 total (4e-6 of the row) misses SPEC's 5e-5 by 4x."""
    n, c_x, batch = 4, 7168, 8
    case = random_pre_case(rng, n, c_x, batch, saturated=True)
    case.alphas = (case.alphas[0], 1.0, case.alphas[2])
    read = rng.choice(n * c_x, 64, replace=False)
    case.phi[:, n : 2 * n] = 0
    case.phi[read, n : 2 * n] = 20 * rng.standard_normal((64, n))
    x = case.x.astype(np.float64)
    rms = np.sqrt((x * x).mean(axis=1)) + 1e-4
    post_logits = (x @ case.phi[:, n : 2 * n].astype(np.float64)) / rms[:, None]
    for gate in range(n):
        case.b[n + gate] = -post_logits[gate, gate]  # row `gate`'s gate `gate` at 0
    assert_pre_matches(case, run_pre(case, place))


@pytest.mark.parametrize(
    ("place", "n", "c_x", "batch"),
    per_place({"cpu": ((2, 130, 64), (4, 130, 64)), "cuda": ((4, 136, 2), (4, 136, 64))}),
)
def test_pre_saturated_without_eps_has_no_nan(rng, place, n, c_x, batch):
    """eps = 0 with saturated logits underflows whole Sinkhorn rows or columns to 0: they
    stay 0 (no 0/0). float64 keeps 1e-200 there, so only finiteness and h_post compare."""
    case = random_pre_case(rng, n, c_x, batch, repeat=20, eps=0.0, saturated=True)
    assert_pre_matches(case, run_pre(case, place), check_mix=False)


FRAMEWORK_SHAPES = {"cpu": (64, 3), "cuda": (256, 9)}  # (c_x, batch), contiguous
STRIDED_SHAPES = {"cpu": (130, 7), "cuda": (256, 6)}  # (c_x, batch), views


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize(("place", "framework"), per_place(FRAMEWORKS))
def test_pre_frameworks_strided_and_misaligned_views(rng, place, framework, dtype):
    """Every framework of the place in, the same framework out; phi column-major, b strided,
    x rows padded (16-byte aligned), misaligned (the element-wise path) or strided (copied
    once)."""

    def placed(host):
        return to_place(host, place, framework)

    contiguous = random_pre_case(rng, 4, *FRAMEWORK_SHAPES[place], dtype=dtype)
    outputs = run_pre(contiguous, place, framework)
    assert_placed(outputs, place, framework, (dtype, dtype, "float32"))
    assert_pre_matches(contiguous, outputs)

    case = random_pre_case(rng, 4, *STRIDED_SHAPES[place], dtype=dtype)
    batch, width = case.x.shape
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    phi_cm = placed(np.ascontiguousarray(case.phi.T)).T  # column-major phi
    views = {"strided": _embedded(case.x, (batch, 2 * width), np.s_[:, ::2], placed)}
    for offset in (8, 3, 1):  # 16 bytes in, then 6 and 2 bytes in: misaligned rows
        window = np.s_[:, offset : offset + width]
        views[f"offset-{offset}"] = _embedded(case.x, (batch, width + 24), window, placed)
    for b_stride in (2, 3):
        b_strided = placed(np.repeat(case.b, b_stride))[::b_stride]
        for name, view in views.items():
            outputs = op(phi_cm, view, b_strided)
            assert_placed(outputs, place, framework, (dtype, dtype, "float32"))
            try:
                assert_pre_matches(case, outputs)
            except AssertionError as error:
                raise AssertionError(f"x {name}, b stride {b_stride}: {error}") from error


def _embedded(values: np.ndarray, shape, window, placed):
    """``values`` written at ``window`` of a zero buffer of ``shape`` (built on the host, so
    no device copy kernel of the dtype is needed), placed, and that window of it."""
    buffer = np.zeros(shape, values.dtype)
    buffer[window] = values
    return placed(buffer)[window]


@pytest.mark.parametrize("place", PLACES)
def test_pre_empty_batch(place):
    phi = np.zeros((8, 8), np.float32)
    x_res, x_layer, h_post = MHCPreFwdOp(1, 1, 1, 3)(
        to_place(phi, place), to_place(np.zeros((0, 8), np.float32), place), to_place(phi[0], place)
    )
    assert tuple(x_res.shape) == (0, 8) and tuple(x_layer.shape) == (0, 4)
    assert tuple(h_post.shape) == (0, 2)


def test_pre_rounds_bf16_to_nearest_even(rng):
    """bf16 outputs are the float32 results rounded once to nearest even: the bf16 path
    equals the float32 path on the same values, rounded by ml_dtypes."""
    case = random_pre_case(rng, 2, 64, batch=4, dtype="bfloat16")
    x_res, x_layer, _ = run_pre(case)
    case32 = random_pre_case(rng, 2, 64, batch=4, dtype="float32")
    case32.phi, case32.b, case32.alphas = case.phi, case.b, case.alphas
    case32.x = case.x.astype(np.float32)
    res32, layer32, _ = run_pre(case32)
    np.testing.assert_array_equal(x_res, res32.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(x_layer, layer32.astype(ml_dtypes.bfloat16))


@GPU
def test_pre_production_shapes(rng):
    """The PERF.md widths: many pipeline stages per block, decode (fused) and large K."""
    for c_x, batch in ((1280, 1), (4096, 4), (7168, 3), (4096, 128), (7168, 260)):
        case = random_pre_case(rng, 4, c_x, batch)
        assert_pre_matches(case, run_pre(case, "cuda"))


# (c_x, batch) that sm_90 runs as one mhc_pre_cluster launch: 16 blocks of 80 columns;
# 1000 = 15 blocks of 64 and one of 40; 136 = 8 blocks of 16 and one of 8; several tokens a
# cluster where the batch outnumbers the resident clusters (7-8 on the H200): 3 at B20,
# 2 of 256 columns at B16 c_x4096, 5-6 at B40
CLUSTER_SHAPES = ((1280, 1), (1000, 3), (136, 4), (64, 2), (256, 20), (4096, 16), (1280, 40))


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 2, 4, 8))
def test_pre_cluster_launch(rng, n, dtype):
    """Decode on sm_90: the cluster plan (checked chosen), every output against the
    oracle, and a second call bit-identical (every block of a cluster sums the partials
    in the same order)."""
    require("cuda", "torch")
    import torch

    clustered = _cuda.device_attribute(0, _cuda.COMPUTE_MAJOR) >= 9
    for c_x, batch in CLUSTER_SHAPES:
        case = random_pre_case(rng, n, c_x, batch, dtype=dtype)
        plan = _mhc._pre_plan(0, dtype, n, c_x, batch)
        _, blocks, columns = _mhc.cluster_geometry(c_x, plan.cluster_groups)
        spec = _mhc.pre_module(dtype, n)
        kernel = _mhc._cuda.function(spec, spec.name_expressions[-1], 0)  # mhc_pre_cluster
        # planned for certain where _MAX_CLUSTER_ROWS tokens a cluster fit and enough such
        # clusters are resident at once for the batch
        most = _mhc.cluster_smem_bytes(n, _mhc._MAX_CLUSTER_ROWS, columns, _mhc.ITEMSIZE[dtype])
        resident = 0
        if clustered and most <= _mhc._dynamic_smem_limit(kernel, 0):
            resident = _mhc._resident_clusters(kernel, 0, blocks, most)
        if resident and batch <= resident * _mhc._MAX_CLUSTER_ROWS:
            assert plan.cluster_columns == columns and plan.steps[0].cluster == blocks
        first, second = run_pre(case, "cuda"), run_pre(case, "cuda")
        assert_pre_matches(case, first)
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b)


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 4, 6))
def test_pre_cluster_launch_split_over_clusters(rng, n, dtype, monkeypatch):
    """Decode on sm_90 with K split over several clusters of one token group (forced): the
    plan (checked chosen), every output against the oracle, and a second and third call
    bit-identical (whichever cluster arrives last sums the clusters' partials in the same
    order, and leaves the counters zeroed for the next)."""
    require("cuda", "torch")
    import torch

    if _cuda.device_attribute(0, _cuda.COMPUTE_MAJOR) < 9:
        pytest.skip("thread block clusters need sm_90")
    monkeypatch.setattr(_mhc, "_MIN_CLUSTER_GROUPS", 3)
    monkeypatch.setattr(_mhc, "_pre_plans", {})
    split = 0
    for c_x, batch in ((7168, 1), (1280, 1), (1000, 3), (4096, 2), (256, 4)):
        case = random_pre_case(rng, n, c_x, batch, dtype=dtype)
        plan = _mhc._pre_plan(0, dtype, n, c_x, batch)
        split += plan.cluster_groups > 1
        first, second, third = (run_pre(case, "cuda") for _ in range(3))
        assert_pre_matches(case, first)
        for a, b, c in zip(first, second, third, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
    assert split >= 3  # (not a test of the single-cluster path)


@pytest.mark.parametrize("groups", (1, 2, 3, 8))
@pytest.mark.parametrize("c_x", (8, 64, 136, 1000, 1280, 4096, 7168, 8200))
def test_cluster_geometry_covers_c_x(c_x, groups):
    """Up to ``groups`` clusters of up to 16 blocks of a multiple of 8 columns: every
    column in one block, no cluster empty, and one group of clusters as before."""
    used, blocks, columns = _mhc.cluster_geometry(c_x, groups)
    assert 1 <= used <= groups and 1 <= blocks <= 16 and columns % 8 == 0
    assert (used * blocks - blocks) * columns < c_x <= used * blocks * columns
    if groups == 1:
        assert (blocks - 1) * columns < c_x


def test_cluster_plan_takes_the_fewest_clusters_a_token_group_that_fit(monkeypatch):
    """_cluster_plan's choices on a modelled sm_90 device (7 resident clusters of blocks
    with more than 100 KB of shared memory, else 16): one cluster a token group wherever
    it fits, with no scratch; K split over the fewest clusters that fit otherwise, their
    sums and tickets in the stream's workspace (counters first, the size every workspace
    plan gives them)."""
    monkeypatch.setattr(_cuda, "device_attribute", lambda device, attribute: 9)
    monkeypatch.setattr(_mhc._cuda, "function", lambda spec, name, device: None)
    monkeypatch.setattr(_mhc, "_dynamic_smem_limit", lambda kernel, device: 227 * 1024)
    monkeypatch.setattr(
        _mhc,
        "_resident_clusters",
        lambda kernel, device, blocks, smem: 7 if smem > 100 << 10 else 16,
    )
    whole = _mhc._cluster_plan(0, "bfloat16", 4, 1280, 1)
    assert (whole.cluster_groups, whole.cluster_rows, whole.cluster_columns) == (1, 1, 80)
    assert whole.steps[0].grid[0] == 16 and whole.steps[0].cluster == 16
    assert not whole.workspace and whole.scratch_layout[0] == 0
    # 64 tokens of c_x 4096: one cluster a token group does not fit (7 resident, so 10
    # tokens a cluster > _MAX_CLUSTER_ROWS); two clusters of 128 columns a block, 16
    # resident, 8 tokens each, do
    split = _mhc._cluster_plan(0, "bfloat16", 4, 4096, 64)
    assert (split.cluster_groups, split.cluster_rows, split.cluster_columns) == (2, 8, 128)
    assert split.steps[0].grid[0] == 8 * 2 * 16 and split.steps[0].cluster == 16
    assert split.workspace and split.counters == (0, _mhc._SMALL_COUNTER_WORDS)
    words, (partial, _, counter, _) = split.scratch_layout
    assert counter == 0 and partial >= _mhc._SMALL_COUNTER_WORDS
    assert words >= partial + 8 * 2 * 8 * 25  # [token groups][clusters][tokens][Q+1]
    several = _mhc._cluster_plan(0, "bfloat16", 4, 7168, 16)  # 6 clusters of 3 tokens
    assert (several.cluster_groups, several.cluster_rows, several.steps[0].grid[0]) == (1, 3, 96)
    monkeypatch.setattr(_mhc, "_MIN_CLUSTER_GROUPS", 3)
    forced = _mhc._cluster_plan(0, "bfloat16", 4, 1280, 1)
    assert (forced.cluster_groups, forced.cluster_columns) == (3, 32)
    assert forced.steps[0].grid[0] == 3 * 14 and forced.steps[0].cluster == 14


def test_cluster_smem_counts_every_section():
    """ClusterLayout (mhc.cu) for n = 4, 2 tokens, 80 columns, bf16: phi 4*80 rows of 24
    floats, partials and sums 2*25 floats each (rounded to 4), coefficients 2*20, the
    8 warps' sums of each token (25 floats, rounded to 28), then x."""
    floats = 4 * 80 * 24 + 52 + 52 + 40 + 2 * 8 * 28
    assert _mhc.cluster_smem_bytes(4, 2, 80, 2) == 4 * floats + 2 * 4 * 80 * 2


@GPU
def test_pre_launched_early_gives_the_same_bits(rng):
    """On sm_90 mhc_project starts while mhc_phi_pieces runs, mhc_coefficients as
    mhc_project's blocks exit and mhc_apply while mhc_coefficients runs (programmatic
    dependent launch, griddepcontrol.wait before what the kernel before wrote is read): the
    same bits as the plan launched in plain stream order, and the oracle's values."""
    require("cuda", "torch")
    import dataclasses

    import torch

    case = random_pre_case(rng, 4, 512, 300 + 4096)
    phi, x, b = (to_place(a, "cuda", "torch") for a in (case.phi, case.x, case.b))
    plan = _mhc._pre_plan(0, "bfloat16", 4, 512, x.shape[0])
    early = _cuda.device_attribute(0, _cuda.COMPUTE_MAJOR) >= 9
    assert [step.programmatic for step in plan.steps] == [False, early, early, early]
    results = []
    for programmatic in (False, early):  # (the cached plan is left as it was made)
        steps = tuple(
            dataclasses.replace(step, programmatic=programmatic and i > 0)
            for i, step in enumerate(plan.steps)
        )
        object.__setattr__(plan, "steps", steps)
        results.append(MHCPreFwdOp(*case.alphas, case.repeat, case.eps)(phi, x, b))
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)
    assert_pre_matches(case, results[1])


@GPU
@pytest.mark.parametrize(
    "dtype, pipeline",
    (("bfloat16", (128, 3)), ("bfloat16", (128, 2)), ("bfloat16", (64, 3)), ("float16", (128, 3))),
)
@pytest.mark.parametrize("c_x, batch", ((200, 300), (1000, 129), (72, 5000), (4096, 700)))
def test_pre_projection_pipelines(rng, monkeypatch, c_x, batch, dtype, pipeline):
    """Each pipeline mhc_project is compiled with for 16-bit x and n4 (forced here for every
    batch): tiles ending in a partial one, K ranges ending in a partial stage (c_x 200 and
    1000: 800 and 4000 columns), the cooperative plan (129 tokens) and K unsplit, each
    against the oracle and a second call bit-identical."""
    require("cuda", "torch")
    import torch

    assert pipeline in _mhc.project_pipelines(dtype, 4)
    monkeypatch.setattr(_mhc, "project_pipelines", lambda *_: (pipeline,))
    monkeypatch.setattr(_mhc, "_pre_plans", {})
    case = random_pre_case(rng, 4, c_x, batch, dtype)
    plan = _mhc._pre_plan(0, dtype, 4, c_x, batch)
    name = _mhc._project_name(dtype, 4, pipeline, fused=plan.fuse)  # (fused: 129 tokens)
    projection = plan.steps[0 if plan.fuse else 1]
    assert projection.kernel is _mhc._cuda.function(_mhc.pre_module(dtype, 4), name, 0)
    first, second = run_pre(case, "cuda"), run_pre(case, "cuda")
    assert_pre_matches(case, first)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@GPU
def test_pre_large_batch_without_k_split(rng):
    """Enough tiles that every block takes all of K (k_splits = 1), last tile partial."""
    case = random_pre_case(rng, 4, 64, 132 * 128 + 77)
    assert_pre_matches(case, run_pre(case, "cuda"))


@GPU
def test_pre_on_a_side_stream_is_ordered_and_deterministic(rng):
    require("cuda", "torch")
    import torch

    case = random_pre_case(rng, 4, 1024, 200)
    phi, x, b = (to_place(a, "cuda", "torch") for a in (case.phi, case.x, case.b))
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    expected = op(phi, x, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x_side = x * 1  # produced on the side stream: the op must run after it there
        outputs = [op(phi, x_side, b) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    for got in outputs:
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)  # bitwise: fixed-order reductions, no atomics on floats
    assert_pre_matches(case, outputs[-1])


@GPU
def test_pre_small_batches_on_two_streams_and_growing(rng):
    """The one-launch plans' workspace is per stream (decode plans and the fused mhc_project
    up to 256 tokens share it): launches on two streams at once, and batches that outgrow
    the stream's workspace, all without synchronising, stay bit-identical to one call at a
    time."""
    require("cuda", "torch")
    import torch

    case = random_pre_case(rng, 4, 1024, 256)
    phi, x, b = (to_place(a, "cuda", "torch") for a in (case.phi, case.x, case.b))
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    batches = (1, 40, 3, 64, 2, 64, 200, 5, 100, 256)
    expected = []
    for batch in batches:
        expected.append(op(phi, x[:batch], b))
        torch.cuda.synchronize()
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    got = []
    for i, batch in enumerate(batches * 2):
        with torch.cuda.stream(streams[i % 2]):
            got.append(op(phi, x[:batch], b))
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    for outputs, reference in zip(got, expected * 2, strict=True):
        for g, e in zip(outputs, reference, strict=True):
            assert torch.equal(g, e)
    assert_pre_matches(case, got[-1])


@GPU
def test_pre_decode_back_to_back(rng):
    """Decode launches leave their counters zeroed: many in a row all stay correct."""
    case = random_pre_case(rng, 4, 1280, 2)
    phi, b = to_place(case.phi, "cuda", "torch"), to_place(case.b, "cuda", "torch")
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    xs = [rng.standard_normal(case.x.shape).astype(case.x.dtype) for _ in range(20)]
    results = [op(phi, to_place(x, "cuda", "torch"), b) for x in xs]
    synchronize("cuda")
    for x, outputs in zip(xs, results, strict=True):
        case.x = x
        assert_pre_matches(case, outputs)


@GPU
def test_pre_device_errors(rng):
    require("cuda", "torch")
    import torch

    case = random_pre_case(rng, 4, 64, 2)
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)

    def on_device(host):
        return to_place(host, "cuda", "torch")

    with pytest.raises(ValueError, match="x is on cuda:0 but phi is on the host"):
        op(case.phi, on_device(case.x), case.b)
    with pytest.raises(ValueError, match="target='cpu' but phi is on cuda:0"):
        on_cpu = MHCPreFwdOp(1, 1, 1, 3, target="cpu")
        on_cpu(on_device(case.phi), on_device(case.x), on_device(case.b))
    q = 9 * 9 + 18
    with pytest.raises(ValueError, match="CUDA mHC kernels take n <= 8"):
        op(
            torch.zeros(9 * 8, q, device="cuda"),
            torch.zeros(1, 72, device="cuda"),
            torch.zeros(q, device="cuda"),
        )


@GPU
def test_pre_device_matches_host(rng):
    case = random_pre_case(rng, 4, 512, 16, dtype="float32")
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    device = [to_float64(o) for o in op(*(to_place(a, "cuda") for a in (case.phi, case.x, case.b)))]
    host = [to_float64(o) for o in op(case.phi, case.x, case.b)]
    for d, h in zip(device, host, strict=True):
        np.testing.assert_allclose(d, h, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- post

POST_SHAPES = {"cpu": ((1000, 5), (130, 5)), "cuda": ((1000, 3), (130, 33), (4096, 2))}


def _post_inputs_random(rng, batch, n, c_x, dtype):
    layer = rng.standard_normal((batch, c_x)).astype(NP_DTYPES[dtype])
    gates = rng.uniform(0, 2, (batch, n)).astype(np.float32)
    res = rng.standard_normal((batch, n * c_x)).astype(NP_DTYPES[dtype])
    return layer, gates, res


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 2, 4, 6, 8))
@pytest.mark.parametrize(("place", "c_x", "batch"), per_place(POST_SHAPES))
def test_post_matches_oracle(rng, place, c_x, batch, n, dtype):
    layer, gates, res = _post_inputs_random(rng, batch, n, c_x, dtype)
    out = MHCPostFwdOp()(*(to_place(a, place) for a in (layer, gates, res)))
    assert_placed((out,), place, None, (dtype,))
    assert tuple(out.shape) == res.shape
    assert_post_matches(layer, gates, res, out, dtype)


POST_STRIDED_SHAPES = {"cpu": (6, 4, 70), "cuda": (5, 4, 512)}  # (batch, n, c_x)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize(("place", "framework"), per_place(FRAMEWORKS))
def test_post_frameworks_strided_and_misaligned(rng, place, framework, dtype):
    """Every framework of the place in, the same framework out; x_layer_out with strided
    columns (copied once), h_post column-major, x_res rows misaligned (the element-wise
    path)."""
    batch, n, c_x = POST_STRIDED_SHAPES[place]
    layer, gates, res = _post_inputs_random(rng, batch, n, c_x, dtype)

    def placed(host):
        return to_place(host, place, framework)

    layer_p, gates_p, res_p = placed(layer), placed(gates), placed(res)
    gates_cm = placed(np.ascontiguousarray(gates.T)).T
    layer_strided = _embedded(layer, (batch, 2 * c_x), np.s_[:, ::2], placed)
    res_misaligned = _embedded(res, (batch, n * c_x + 1), np.s_[:, 1:], placed)
    for name, arguments in (
        ("contiguous", (layer_p, gates_p, res_p)),
        ("strided-layer-column-major-gates", (layer_strided, gates_cm, res_p)),
        ("strided-layer", (layer_strided, gates_p, res_p)),
        ("misaligned-res-column-major-gates", (layer_p, gates_cm, res_misaligned)),
    ):
        out = MHCPostFwdOp()(*arguments)
        assert_placed((out,), place, framework, (dtype,))
        assert tuple(out.shape) == res.shape, name
        assert_post_matches(layer, gates, res, out, dtype)


def test_pre_then_post_round_trip(rng):
    case = random_pre_case(rng, 4, 96, batch=3, dtype="float32")
    x_res, x_layer, h_post = run_pre(case)
    out = MHCPostFwdOp()(x_layer, h_post, x_res)
    ref = pre_reference(case)
    expected = (ref["h_post"][:, :, None] * ref["x_layer"][:, None, :]).reshape(3, -1)
    np.testing.assert_allclose(out, expected + ref["x_res"], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- validation


def _pre_inputs(n=2, c_x=8, batch=3):
    q = n * n + 2 * n
    return (
        np.zeros((n * c_x, q), np.float32),
        np.zeros((batch, n * c_x), np.float32),
        np.zeros(q, np.float32),
    )


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda phi, x, b: (phi[None], x, b), ValueError, "phi must be 2-D"),
        (lambda phi, x, b: (phi, x[0], b), ValueError, "x must be 2-D"),
        (lambda phi, x, b: (phi, x, b[None]), ValueError, "b must be 1-D"),
        (lambda phi, x, b: (phi.astype(np.float64), x, b), TypeError, "phi must be float32"),
        (lambda phi, x, b: (phi, x, b.astype(np.float16)), TypeError, "b must be float32"),
        (lambda phi, x, b: (phi, x.astype(np.float64), b), TypeError, "x must be bfloat16"),
        (lambda phi, x, b: (phi, x.astype(np.int32), b), TypeError, "x must be bfloat16"),
        (lambda phi, x, b: (phi[:, :7], x, b[:7]), ValueError, "phi must have n\\*n\\+2n columns"),
        (lambda phi, x, b: (phi[:, :0], x, b[:0]), ValueError, "phi must have n\\*n\\+2n columns"),
        (lambda phi, x, b: (phi, x[:, :15], b), ValueError, "x width must equal phi rows"),
        (lambda phi, x, b: (phi[:15], x[:, :15], b), ValueError, "positive multiple of n = 2"),
        (lambda phi, x, b: (phi[:0], x[:, :0], b), ValueError, "positive multiple of n = 2"),
        (lambda phi, x, b: (phi, x, b[:7]), ValueError, "b must have phi's width 8"),
    ],
)
def test_pre_validation(mutate, error, message):
    with pytest.raises(error, match=message):
        MHCPreFwdOp(1, 1, 1, 20)(*mutate(*_pre_inputs()))


# seed 003 (and SPEC 8 for the backward ops): (name, default) of each op's positional
# parameters, then keyword-only target=None
MHC_SIGNATURES = {
    MHCPreFwdOp: [("alpha_pre", _EMPTY), ("alpha_post", _EMPTY), ("alpha_res", _EMPTY),
                  ("sinkhorn_repeat", _EMPTY), ("sinkhorn_eps", 0.02)],
    MHCPreBwdOp: [("alpha_pre", _EMPTY), ("alpha_post", _EMPTY), ("alpha_res", _EMPTY),
                  ("sinkhorn_repeat", _EMPTY), ("sinkhorn_eps", 0.02)],
    MHCPostFwdOp: [],
    MHCPostBwdOp: [],
}  # fmt: skip


@pytest.mark.parametrize("cls", list(MHC_SIGNATURES), ids=lambda cls: cls.__name__)
def test_constructor_matches_the_seed(cls):
    parameters = list(inspect.signature(cls).parameters.values())
    positional = [(p.name, p.default) for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == MHC_SIGNATURES[cls]
    keyword_only = [(p.name, p.default) for p in parameters if p.kind == p.KEYWORD_ONLY]
    assert keyword_only == [("target", None)]


def test_pre_constructor_validation():
    for repeat in (-1, 2**30):
        with pytest.raises(ValueError, match=re.escape("sinkhorn_repeat must be in [0, 2**30)")):
            MHCPreFwdOp(1, 1, 1, repeat)
    with pytest.raises(TypeError, match="sinkhorn_repeat must be an int"):
        MHCPreFwdOp(1, 1, 1, 2.5)
    with pytest.raises(ValueError, match="sinkhorn_eps must be >= 0"):
        MHCPreFwdOp(1, 1, 1, 3, -0.1)
    with pytest.raises(ValueError, match="alpha_res must be finite"):
        MHCPreFwdOp(1, 1, float("nan"), 3)
    with pytest.raises(TypeError, match="alpha_pre must be a number"):
        MHCPreFwdOp("one", 1, 1, 3)
    with pytest.raises(ValueError, match="target must be"):
        MHCPreFwdOp(1, 1, 1, 3, target="tpu")
    with pytest.raises(TypeError, match="x must be an array"):
        MHCPreFwdOp(1, 1, 1, 3)(_pre_inputs()[0], [[1.0]], _pre_inputs()[2])
    with pytest.raises(ValueError, match="target='cuda' but phi is on the host"):
        MHCPreFwdOp(1, 1, 1, 3, target="cuda")(*_pre_inputs())


def _post_inputs(n=2, c_x=8, batch=3, dtype=np.float32):
    return (
        np.zeros((batch, c_x), dtype),
        np.zeros((batch, n), np.float32),
        np.zeros((batch, n * c_x), dtype),
    )


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda layer, h, res: (layer[None], h, res), ValueError, "x_layer_out must be 2-D"),
        (lambda layer, h, res: (layer, h[0], res), ValueError, "h_post must be 2-D"),
        (lambda layer, h, res: (layer, h, res[0]), ValueError, "x_res must be 2-D"),
        (
            lambda layer, h, res: (layer.astype(np.int8), h, res),
            TypeError,
            "x_layer_out must be bfloat16",
        ),
        (
            lambda layer, h, res: (layer, h.astype(np.float16), res),
            TypeError,
            "h_post must be float32",
        ),
        (
            lambda layer, h, res: (layer, h, res.astype(np.float16)),
            TypeError,
            "x_res must have x_layer_out",
        ),
        (lambda layer, h, res: (layer[:2], h, res), ValueError, "same batch, got 2, 3 and 3"),
        (lambda layer, h, res: (layer, h[:2], res), ValueError, "same batch, got 3, 2 and 3"),
        (lambda layer, h, res: (layer, h, res[:, :15]), ValueError, "x_res width must be n\\*c_x"),
        (lambda layer, h, res: (layer, h[:, :0], res), ValueError, "at least one stream"),
    ],
)
def test_post_validation(mutate, error, message):
    with pytest.raises(error, match=message):
        MHCPostFwdOp()(*mutate(*_post_inputs()))


# --------------------------------------------------------------------------- CUDA planning


def test_streams_of():
    for n in range(1, 40):
        assert streams_of(n * n + 2 * n) == n


@pytest.mark.parametrize("stage_k", (64, 128))
@pytest.mark.parametrize("resident", (132, 264))
@pytest.mark.parametrize("batch", (1, 4, 5, 128, 129, 256, 257, 4096, 16384, 40000))
@pytest.mark.parametrize("width", (4 * 1280, 4 * 4096, 4 * 7168, 8 * 130, 64))
def test_plan_geometry_covers_k(batch, width, resident, stage_k):
    k_range, k_splits, fuse = plan_geometry(batch, width, resident, stage_k)
    assert k_range % stage_k == 0 and k_range >= stage_k
    assert (k_splits - 1) * k_range < width <= k_splits * k_range  # every split has work
    assert fuse == (batch <= 256)
    tiles = -(-batch // 128)
    if tiles >= resident:
        assert k_splits == 1
    else:  # one wave: a cooperative launch needs every block resident
        assert tiles * k_splits <= resident


def _modelled_sm90(monkeypatch, optin: int = 227 << 10, major: int = 9) -> None:
    """An H200-like device for the planners: 132 multiprocessors of sm_90 (sm_``major``0)
    with 227 KB of shared memory each (``optin`` a block; up to two blocks of 256 threads
    fit, by shared memory alone), no kernels, and no cluster plan
    (test_cluster_plan_takes_the_fewest_clusters_a_token_group_that_fit)."""
    attributes = {
        _cuda.MULTIPROCESSORS: 132,
        _cuda.MAX_SMEM_OPTIN: optin,
        _cuda.COMPUTE_MAJOR: major,
    }
    monkeypatch.setattr(_mhc, "_cluster_plan", lambda *args: None)
    monkeypatch.setattr(
        _cuda, "device_attribute", lambda device, attribute: attributes.get(attribute, 9)
    )
    monkeypatch.setattr(_mhc._cuda, "function", lambda spec, name, device: name)
    monkeypatch.setattr(
        _mhc, "_raise_smem_limit", lambda kernel, device, nbytes: min(2, (227 << 10) // nbytes)
    )
    monkeypatch.setattr(_mhc, "_pre_plans", {})


@pytest.mark.parametrize(
    "dtype, n, batch, c_x, project, k_range",
    (
        ("bfloat16", 4, 128, 4096, "mhc_project<bfloat16_t, 4, 128, 3>", 128),
        ("bfloat16", 4, 512, 7168, "mhc_project<bfloat16_t, 4, 128, 3>", 896),
        ("bfloat16", 4, 2048, 4096, "mhc_project<bfloat16_t, 4, 128, 3>", 2048),
        ("bfloat16", 4, 4096, 4096, "mhc_project<bfloat16_t, 4, 128, 3>", 4096),
        ("bfloat16", 4, 8192, 4096, "mhc_project<bfloat16_t, 4, 128, 2>", 4096),
        ("bfloat16", 4, 16384, 7168, "mhc_project<bfloat16_t, 4, 128, 2>", 2 * 7168),
        ("bfloat16", 2, 16384, 7168, "mhc_project<bfloat16_t, 2, 128, 3>", 2 * 7168),
        ("bfloat16", 2, 128, 4096, "mhc_project<bfloat16_t, 2, 64, 3>", 64),
        ("bfloat16", 1, 256, 4096, "mhc_project<bfloat16_t, 1, 64, 3>", 64),
        ("bfloat16", 6, 4096, 4096, "mhc_project<bfloat16_t, 6, 64, 3>", 6 * 4096 // 8),
        ("float32", 4, 4096, 4096, "mhc_project<float, 4, 64, 3>", 4 * 4096 // 4),
        ("float16", 4, 16384, 7168, "mhc_project<half_t, 4, 128, 3>", 4 * 7168),
        ("float16", 4, 128, 4096, "mhc_project<half_t, 4, 128, 3>", 128),
        ("float16", 2, 128, 4096, "mhc_project<half_t, 2, 64, 3>", 64),
    ),
)
def test_pre_plan_picks_the_projection_pipeline(
    monkeypatch, dtype, n, batch, c_x, project, k_range
):
    """16-bit x with n <= 4 projects 128 columns a stage (256-byte runs of each row), three
    stages deep; bf16 n4 two deep (two blocks a multiprocessor) where a block streams at
    least 32 stages; 64 columns where 128 would leave half of the 132 multiprocessors or more
    without a block (64 and 32 blocks of 128 columns at n2 and n1, B128 c_x4096: 128 of 64).
    Other x dtypes and n keep 64 columns, three deep. The pieces kernel (beyond 256 tokens;
    the fused launch splits its own) covers every stage's fragments whole."""
    _modelled_sm90(monkeypatch)
    plan = _mhc._pre_plan(0, dtype, n, c_x, batch)
    projection = plan.steps[0 if plan.fuse else 1]
    assert projection.kernel == (project[:-1] + ", true>" if plan.fuse else project)
    assert plan.k_range == k_range
    stage_k, stages = (int(v) for v in project.rstrip(">").split(", ")[2:])
    assert projection.shared_mem == _mhc._project_smem(dtype, n, (stage_k, stages))
    if not plan.fuse:
        assert plan.steps[0].grid[0] * 64 == -(-n * c_x // stage_k) * stage_k


@pytest.mark.parametrize("major", (8, 9))
def test_pre_launches_early_from_sm90_and_512_tokens(monkeypatch, major):
    """The four-kernel plan launches mhc_project, mhc_coefficients and mhc_apply with
    programmatic stream serialization (each waits in the kernel for what the one before
    wrote) on sm_90 from _MIN_EARLY_ROWS tokens; mhc_phi_pieces, the first, never. Below
    that, and before sm_90, all four launch in plain stream order."""
    _modelled_sm90(monkeypatch, major=major)
    for batch in (_mhc._MAX_FUSED_ROWS + 1, _mhc._MIN_EARLY_ROWS - 1, _mhc._MIN_EARLY_ROWS, 16384):
        plan = _mhc._pre_plan(0, "bfloat16", 4, 4096, batch)
        early = major >= 9 and batch >= _mhc._MIN_EARLY_ROWS
        assert [step.programmatic for step in plan.steps] == [False, early, early, early]


@pytest.mark.parametrize("batch, c_x", ((65, 4096), (128, 4096), (256, 1280), (256, 64)))
def test_fused_pre_is_one_launch_on_the_streams_workspace(monkeypatch, batch, c_x):
    """Up to 256 tokens (where no one-launch decode plan takes them) mHC pre is one
    cooperative mhc_project launch, which splits phi into fragments itself: no pieces
    section, and its scratch is the stream's workspace, counters first in the section size
    of every workspace plan (the last block out leaves them zeroed). Beyond, four kernels
    on fresh scratch."""
    _modelled_sm90(monkeypatch)
    plan = _mhc._pre_plan(0, "bfloat16", 4, c_x, batch)
    (step,) = plan.steps
    assert plan.fuse and step.cooperative and step.kernel.startswith("mhc_project<")
    assert step.kernel.endswith(", true>")  # the fused instantiation
    assert plan.workspace and plan.counters == (0, _mhc._SMALL_COUNTER_WORDS)
    words, (partial, coef, counter, pieces) = plan.scratch_layout
    assert counter == 0 and min(partial, coef) >= _mhc._SMALL_COUNTER_WORDS
    assert plan.scratch[3] == 0 and pieces == words
    assert max(partial + plan.k_splits * batch * 25, coef + batch * 20) <= words
    larger = _mhc._pre_plan(0, "bfloat16", 4, c_x, 257)
    assert not larger.fuse and not larger.workspace and len(larger.steps) == 4


def test_pre_projection_falls_back_to_stages_that_fit(monkeypatch):
    """On a device with too little shared memory a block for 128-column stages (100 KB here:
    (128, 3) needs 157 KB, (128, 2) 105 KB), bf16 n4 projects 64 columns three deep."""
    _modelled_sm90(monkeypatch, optin=100 << 10)
    plan = _mhc._pre_plan(0, "bfloat16", 4, 4096, 4096)
    assert plan.steps[1].kernel == "mhc_project<bfloat16_t, 4, 64, 3>"


@pytest.mark.parametrize("pipeline", _mhc.project_pipelines("bfloat16", 4))
def test_pre_projection_takes_a_pipeline_given_alone(monkeypatch, pipeline):
    """Given one pipeline (as test_pre_projection_pipelines and tests/gpu_memcheck.py force
    each in turn), the plan projects with it, at every batch: the narrow pipeline is the
    default only when it is among those given."""
    _modelled_sm90(monkeypatch)
    monkeypatch.setattr(_mhc, "project_pipelines", lambda *_: (pipeline,))
    name = f"mhc_project<bfloat16_t, 4, {pipeline[0]}, {pipeline[1]}>"
    for batch, c_x in ((300, 200), (700, 4096), (16384, 7168)):
        assert _mhc._pre_plan(0, "bfloat16", 4, c_x, batch).steps[1].kernel == name


@pytest.mark.parametrize("n", _mhc.CUDA_STREAMS)
def test_pre_coefficients_take_one_thread_a_token_in_large_batches(monkeypatch, n):
    """From _MIN_TOKEN_COEFFICIENT_ROWS tokens, n <= 5, mhc_coefficients is the instantiation
    with one thread a token, COEF_TOKEN_ROWS tokens a block; below, and for n >= 6, n*n
    lanes (or n) a token, COEF_ROWS a block. Both are compiled where the first is planned."""
    _modelled_sm90(monkeypatch)
    threshold = _mhc._MIN_TOKEN_COEFFICIENT_ROWS
    names = _mhc.pre_module("bfloat16", n).name_expressions
    for batch in (threshold - 1, threshold, 3 * threshold + 5):
        step = _mhc._pre_plan(0, "bfloat16", n, 1280, batch).steps[2]
        per_token = n <= 5 and batch >= threshold
        lanes = f"mhc_coefficients<bfloat16_t, {n}>"
        assert step.kernel == (lanes[:-1] + ", true>" if per_token else lanes)
        assert step.kernel in names
        rows = _mhc._COEF_TOKEN_ROWS if per_token else _mhc._COEF_ROWS
        assert step.grid == (-(-batch // rows), 1, 1)


@GPU
@pytest.mark.parametrize(
    "n, c_x, batch", ((4, 256, 300), (4, 1000, 4100), (2, 64, 1000), (5, 48, 77))
)
def test_pre_coefficient_layouts_write_the_same_bits(rng, monkeypatch, n, c_x, batch):
    """mhc_coefficients with n*n lanes a token and with one thread a token (forced at every
    batch here: a partial last block of either) write the same bits, within the oracle."""
    require("cuda", "torch")
    import torch

    case = random_pre_case(rng, n, c_x, batch, "bfloat16")
    monkeypatch.setattr(_mhc, "_MAX_FUSED_ROWS", 0)  # four kernels even at 77 tokens
    monkeypatch.setattr(_mhc, "_cluster_plan", lambda *args: None)
    monkeypatch.setattr(_mhc, "_MAX_SMALL_ROWS", 0)
    outputs = []
    for threshold in (1 << 62, 0):  # lanes, then one thread a token
        monkeypatch.setattr(_mhc, "_MIN_TOKEN_COEFFICIENT_ROWS", threshold)
        monkeypatch.setattr(_mhc, "_pre_plans", {})  # (plans are cached per shape)
        plan = _mhc._pre_plan(0, "bfloat16", n, c_x, batch)
        assert plan.steps[2].kernel is _mhc._cuda.function(
            _mhc.pre_module("bfloat16", n),
            _mhc._coefficients_name("bfloat16", n, per_token=threshold == 0),
            0,
        )
        outputs.append(run_pre(case, "cuda"))
    assert_pre_matches(case, outputs[1])
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", _mhc.CUDA_STREAMS)
def test_pre_projection_that_does_not_fit_is_refused(monkeypatch, n):
    """On a device of sm_80's 163 KB a block (166912 bytes), float32 x projects up to n = 6;
    n = 7 and 8 (three stages of 64 columns: 185 and 203 KB) are refused before any launch,
    naming what they need, and 16-bit x plans for every n."""
    _modelled_sm90(monkeypatch, optin=166912)
    for dtype in ("bfloat16", "float16"):
        assert _mhc._pre_plan(0, dtype, n, 4096, 4096).steps
    if n <= 6:
        assert _mhc._pre_plan(0, "float32", n, 4096, 4096).steps
    else:
        with pytest.raises(
            ValueError, match=r"float32 x and n = \d needs \d+ bytes.*allows 166912"
        ):
            _mhc._pre_plan(0, "float32", n, 4096, 4096)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", _mhc.CUDA_STREAMS)
def test_projection_pipelines_fit_shared_memory(dtype, n):
    """Every shipped mhc_project pipeline fits sm_90's 227 KB a block, and the bf16 n <= 4
    ones fit as the plan wants them: three stages once, two stages twice a multiprocessor
    (228 KB, 1 KB of it the driver's a block, and the kernel's 1 KB of static scratch)."""
    for pipeline in _mhc.project_pipelines(dtype, n):
        smem = _mhc._project_smem(dtype, n, pipeline) + 1024
        assert smem <= 227 << 10, (pipeline, smem)
        if pipeline == (128, 2):
            assert 2 * (smem + 1024) <= 228 << 10, smem


@pytest.mark.parametrize("resident", (66, 132, 264, 400))
@pytest.mark.parametrize("batch", (1, 4, 32, 33, 64))
@pytest.mark.parametrize("width", (4 * 1280, 4 * 7168, 8 * 130, 64, 3))
def test_small_geometry_covers_k(batch, width, resident):
    k_range, k_splits, groups = small_geometry(batch, width, resident)
    assert k_range % 32 == 0 and groups == -(-batch // 32)
    assert (k_splits - 1) * k_range < width <= k_splits * k_range  # every split has work
    assert groups * k_splits <= max(groups, resident)  # one wave of projection blocks
    assert k_splits <= 16 * 16  # the partials' two-level tree


def test_small_scratch_counters_come_first():
    """A stream's one workspace serves mhc_pre_small plans of every batch: their counters
    must be the same words (zeroed by each launch), before anything else."""
    counters = _mhc._SMALL_COUNTER_WORDS
    for batch in (1, 33, 64):
        sizes = (8 * batch * 25, batch * 20, counters, 0)
        plan = _mhc._PrePlan((), 4, 64, 32, 8, False, True, sizes)
        words, (partial, coef, counter, _) = plan.scratch_layout
        assert counter == 0 and min(partial, coef) >= counters
        assert max(partial + sizes[0], coef + sizes[1]) <= words


def test_small_scratch_is_the_streams_workspace(monkeypatch):
    """The one-launch pre's scratch (no GPU needed: the runtime calls recorded): one
    workspace per (device, stream), zeroed once when made and reused; a larger plan makes a
    larger one; under graph capture fresh memory with its counters zeroed on the stream,
    never kept; the large-batch plans fresh memory on every call."""
    capturing, memsets, allocations = set(), [], []
    monkeypatch.setattr(_mhc._Runtime, "is_capturing", lambda stream: stream in capturing)
    monkeypatch.setattr(_mhc._Runtime, "memset", lambda *args: memsets.append(args), raising=False)
    monkeypatch.setattr(_mhc, "_workspaces", {})

    def allocate(template, words):
        base = (len(allocations) + 1) << 32
        allocations.append((template, words))
        return ("buffer", base), base

    def plan(batch, small=True):
        sizes = (8 * batch * 28, batch * 20, _mhc._SMALL_COUNTER_WORDS, 0 if small else 99)
        return _mhc._PrePlan((), 4, 64, 32, 8, False, small, sizes)

    def scratch(plan, stream, device=0):
        return _mhc._scratch(plan, device, stream, allocate, "template")

    small, larger = plan(4), plan(64)
    _, first = scratch(small, stream=7)
    counters_bytes = 4 * _mhc._SMALL_COUNTER_WORDS
    assert memsets == [(first[2], 0, counters_bytes, 7)] and len(allocations) == 1
    assert scratch(small, stream=7)[1] == first  # reused: no allocation, no memset
    assert len(allocations) == 1 and len(memsets) == 1
    _, other = scratch(small, stream=8)  # another stream: its own
    assert other[2] != first[2] and len(allocations) == 2
    _, grown = scratch(larger, stream=7)  # outgrown: a new one, zeroed
    assert len(allocations) == 3 and memsets[-1] == (grown[2], 0, counters_bytes, 7)
    assert scratch(small, stream=7)[1][2] == grown[2]  # the larger one serves smaller plans
    capturing.add(7)
    for _ in range(2):  # fresh each time, zeroed on the stream, not kept
        _, captured = scratch(small, stream=7)
        assert captured[2] != grown[2] and memsets[-1] == (captured[2], 0, counters_bytes, 7)
    assert len(allocations) == 5
    capturing.clear()
    assert scratch(small, stream=7)[1][2] == grown[2]
    before = len(memsets)
    for _ in range(2):  # the large-batch kernels: fresh, zeroed by mhc_phi_pieces
        scratch(plan(300, small=False), stream=7)
    assert len(allocations) == 7 and len(memsets) == before


def test_fused_backward_scratch_is_its_own_workspace(monkeypatch):
    """mhc_bwd_fused's scratch: its counters first in a section of one size for every batch,
    on a workspace of its own per stream (never mhc_pre_small's, whose counter section
    differs), zeroed once when made; the five-kernel plans fresh memory, no memset."""
    memsets, allocations = [], []
    monkeypatch.setattr(_mhc._Runtime, "is_capturing", lambda stream: False)
    monkeypatch.setattr(_mhc._Runtime, "memset", lambda *args: memsets.append(args), raising=False)
    monkeypatch.setattr(_mhc, "_workspaces", {})

    def allocate(template, words):
        base = (len(allocations) + 1) << 32
        allocations.append(words)
        return ("buffer", base), base

    def backward_plan(batch, fused=True):
        sizes = (_mhc._PRE_BWD_COUNTER_WORDS, 99, 30 * batch, 8 * batch, 9 * batch, 27 * batch,
                 5000, 320 * batch)  # fmt: skip
        return _mhc._PreBackwardPlan(
            steps=(), fused=fused, stats_stages=3, grad_stages=3, k_splits=16,
            token_splits=1, grad_items=4, grad_blocks=4, slot_cap=1, segment=1, scratch=sizes,
        )  # fmt: skip

    for batch in (1, 37, 256):
        words, offsets = backward_plan(batch).scratch_layout
        assert len(offsets) == len(_mhc._PRE_BWD_SCRATCH) and offsets[0] == 0
        assert min(offsets[1:]) >= _mhc._PRE_BWD_COUNTER_WORDS
    forward = _mhc._PrePlan((), 4, 64, 32, 8, False, True, (800, 80, _mhc._SMALL_COUNTER_WORDS, 0))
    _, (_, _, forward_counter, _) = _mhc._scratch(forward, 0, 7, allocate, "template")
    _, first = _mhc._scratch(backward_plan(4), 0, 7, allocate, "template")
    assert first[0] != forward_counter and len(allocations) == 2
    assert memsets[-1] == (first[0], 0, 4 * _mhc._PRE_BWD_COUNTER_WORDS, 7)
    assert _mhc._scratch(backward_plan(2), 0, 7, allocate, "template")[1][0] == first[0]
    assert len(allocations) == 2 and len(memsets) == 2  # reused, not zeroed again
    for _ in range(2):
        _mhc._scratch(backward_plan(300, fused=False), 0, 7, allocate, "template")
    assert len(allocations) == 4 and len(memsets) == 2


def _device_operand(shape, dtype, strides=None, ptr=1 << 20):
    from tileops_cupy._arrays import Operand, contiguous_strides

    strides = strides or contiguous_strides(shape)
    return Operand(None, "cupy", 0, dtype, shape, strides, ptr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_launch_values_pack_into_the_kernel_structs(dtype):
    """Every field is packed by name into PreParams/PostParams (whose sizes mhc.cu asserts;
    test_nvrtc checks the names and types against the declarations)."""
    n, c_x, batch = 4, 130, 3
    gates = MHCPreFwdOp(1.0, 1.0, 1.0, 20)._gates
    k_range, k_splits, fuse = plan_geometry(batch, n * c_x, 132)
    plan = _mhc._PrePlan((), n, c_x, k_range, k_splits, fuse, False, (1, 1, 1, 1))
    x = _device_operand((batch, n * c_x), dtype)
    phi = _device_operand((n * c_x, 24), "float32")
    b = _device_operand((24,), "float32")
    outputs = [
        _device_operand(s, d)
        for s, d in (((3, 520), dtype), ((3, 130), dtype), ((3, 4), "float32"))
    ]
    params = _mhc.pre_launch_params(gates, plan, x, phi, b, *outputs, (1, 2, 3, 4))
    assert len(params) == 192
    fields = _mhc.PRE_PARAMS
    assert fields.read(params, "x") == x.ptr and fields.read(params, "pieces") == 4
    assert fields.read(params, "batch") == batch and fields.read(params, "c_x") == c_x
    assert fields.read(params, "phi_dense") == 1
    params = _mhc.post_launch_params(outputs[1], outputs[2], outputs[0], outputs[0])
    assert len(params) == 104
    assert _mhc.POST_PARAMS.read(params, "n") == n


# --------------------------------------------------------------------------- NVRTC

MHC_SPECS = _mhc.module_specs()


def test_catalogue_holds_every_launchable_module():
    for dtype in DTYPES:
        for n in _mhc.CUDA_STREAMS:
            assert _mhc.pre_module(dtype, n) in MHC_SPECS
    assert _mhc.post_module() in MHC_SPECS
    assert len(set(MHC_SPECS)) == len(MHC_SPECS)


# Compiling the mHC modules for sm_80 and sm_90 is tests/test_nvrtc.py's job: it compiles the
# whole shipped catalogue, which includes every module listed here.


def test_relaunches_rewrite_one_run_of_fields():
    """A relaunch (a decode step's, or a small backward's) patches its addresses with one
    packing call: the fields it rewrites are adjacent in the kernel's struct, in its order."""
    writers = (
        _mhc._PRE_RELAUNCH, _mhc._POST_RELAUNCH, _mhc._PRE_BWD_RELAUNCH, _mhc._POST_BWD_RELAUNCH
    )  # fmt: skip
    assert [len(writer) for writer in writers] == [1, 1, 1, 1]
