"""mHC pre/post on the host (numpy body) against the float64 oracle, every validation error,
and the NVRTC compile of every mHC kernel (no GPU needed). GPU tests: test_mhc_gpu.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _mhc_oracle import (
    NP_DTYPES,
    assert_post_matches,
    assert_pre_matches,
    pre_reference,
    random_pre_case,
)

from tileops_cupy import sequence_modeling
from tileops_cupy.sequence_modeling import MHCPostFwdOp, MHCPreFwdOp, plan_geometry, streams_of

DTYPES = ("bfloat16", "float16", "float32")


def run_pre(case, **kwargs):
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps, **kwargs)
    return op(case.phi, case.x, case.b)


# --------------------------------------------------------------------------- pre, host


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c_x", (1000, 130))
@pytest.mark.parametrize("n", (1, 2, 4, 6, 8))
def test_pre_matches_oracle(rng, n, c_x, dtype):
    case = random_pre_case(rng, n, c_x, batch=5, dtype=dtype)
    outputs = run_pre(case)
    assert all(isinstance(o, np.ndarray) for o in outputs)
    assert outputs[0].dtype == NP_DTYPES[dtype] and outputs[1].dtype == NP_DTYPES[dtype]
    assert outputs[2].dtype == np.float32
    assert_pre_matches(case, outputs)


@pytest.mark.parametrize("eps", (0.0, 0.02))
@pytest.mark.parametrize("repeat", (0, 1, 20))
def test_pre_sinkhorn_settings(rng, repeat, eps):
    case = random_pre_case(rng, 4, 64, batch=9, repeat=repeat, eps=eps)
    assert_pre_matches(case, run_pre(case))


def test_pre_sinkhorn_converges_to_doubly_stochastic(rng):
    """With eps = 0 and many iterations the mixing matrix is doubly stochastic, so x_res
    conserves the streams' column sums."""
    case = random_pre_case(rng, 4, 32, batch=6, dtype="float32", repeat=200, eps=0.0)
    x_res, _, _ = run_pre(case)
    x = case.x.astype(np.float64).reshape(6, 4, 32)
    mixed = x_res.astype(np.float64).reshape(6, 4, 32)
    np.testing.assert_allclose(mixed.sum(axis=1), x.sum(axis=1), atol=1e-4)


@pytest.mark.parametrize("n", (1, 4, 8))
def test_pre_saturated(rng, n):
    case = random_pre_case(rng, n, 130, batch=64, saturated=True)
    case.b[:n] = -1e4  # every pre gate is exactly 0: x_layer rows all zero
    x_res, x_layer, h_post = run_pre(case)
    assert not np.asarray(x_layer, np.float32).any()
    assert_pre_matches(case, (x_res, x_layer, h_post))
    gates = np.asarray(h_post)
    assert (np.minimum(gates, 2 - gates) < 1e-3).mean() > 0.5  # the post gates saturate too


@pytest.mark.parametrize("n", (2, 4))
def test_pre_saturated_without_eps_has_no_nan(rng, n):
    """eps = 0 with saturated logits underflows whole Sinkhorn rows or columns to 0: they
    stay 0 (no 0/0). float64 keeps 1e-200 there, so only finiteness and h_post compare."""
    case = random_pre_case(rng, n, 130, batch=64, repeat=20, eps=0.0, saturated=True)
    assert_pre_matches(case, run_pre(case), check_mix=False)


def test_pre_reads_strided_inputs(rng):
    case = random_pre_case(rng, 4, 130, batch=7, dtype="float16")
    width = case.x.shape[1]
    wide = np.zeros((7, width + 5), np.float16)
    wide[:, 3 : 3 + width] = case.x
    phi_t = np.ascontiguousarray(case.phi.T).T  # column-major phi
    b_strided = np.repeat(case.b, 2)[::2]
    outputs = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)(
        phi_t, wide[:, 3 : 3 + width], b_strided
    )
    assert_pre_matches(case, outputs)


def test_pre_torch_cpu_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    case = random_pre_case(rng, 4, 64, batch=3)
    x = torch.from_numpy(case.x.view(np.int16)).view(torch.bfloat16)
    outputs = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)(
        torch.from_numpy(case.phi), x, torch.from_numpy(case.b)
    )
    assert [o.dtype for o in outputs] == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert all(o.device.type == "cpu" for o in outputs)
    assert_pre_matches(case, outputs)


def test_pre_empty_batch():
    phi = np.zeros((8, 8), np.float32)
    x_res, x_layer, h_post = MHCPreFwdOp(1, 1, 1, 3)(phi, np.zeros((0, 8), np.float32), phi[0])
    assert x_res.shape == (0, 8) and x_layer.shape == (0, 4) and h_post.shape == (0, 2)


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


# --------------------------------------------------------------------------- post, host


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c_x", (1000, 130))
@pytest.mark.parametrize("n", (1, 2, 4, 6, 8))
def test_post_matches_oracle(rng, n, c_x, dtype):
    batch = 5
    layer = rng.standard_normal((batch, c_x)).astype(NP_DTYPES[dtype])
    gates = rng.uniform(0, 2, (batch, n)).astype(np.float32)
    res = rng.standard_normal((batch, n * c_x)).astype(NP_DTYPES[dtype])
    out = MHCPostFwdOp()(layer, gates, res)
    assert out.dtype == NP_DTYPES[dtype] and out.shape == res.shape
    assert_post_matches(layer, gates, res, out, dtype)


def test_post_strided_and_torch(rng):
    torch = pytest.importorskip("torch")
    layer = rng.standard_normal((6, 2 * 70)).astype(np.float32)[:, ::2]  # strided columns
    gates = rng.uniform(0, 2, (4, 6)).astype(np.float32).T  # column-major
    res = rng.standard_normal((6, 4 * 70)).astype(np.float32)
    out = MHCPostFwdOp()(torch.from_numpy(layer), torch.from_numpy(gates), torch.from_numpy(res))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert_post_matches(layer, gates, res, out, "float32")


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
    "mutate, message",
    [
        (lambda phi, x, b: (phi[None], x, b), "phi must be 2-D"),
        (lambda phi, x, b: (phi, x[0], b), "x must be 2-D"),
        (lambda phi, x, b: (phi, x, b[None]), "b must be 1-D"),
        (lambda phi, x, b: (phi.astype(np.float64), x, b), "phi must be float32"),
        (lambda phi, x, b: (phi, x, b.astype(np.float16)), "b must be float32"),
        (lambda phi, x, b: (phi, x.astype(np.float64), b), "x must be bfloat16"),
        (lambda phi, x, b: (phi, x.astype(np.int32), b), "x must be bfloat16"),
        (lambda phi, x, b: (phi[:, :7], x, b[:7]), "phi must have n\\*n\\+2n columns"),
        (lambda phi, x, b: (phi[:, :0], x, b[:0]), "phi must have n\\*n\\+2n columns"),
        (lambda phi, x, b: (phi, x[:, :15], b), "x width must equal phi rows"),
        (lambda phi, x, b: (phi[:15], x[:, :15], b), "positive multiple of n = 2"),
        (lambda phi, x, b: (phi[:0], x[:, :0], b), "positive multiple of n = 2"),
        (lambda phi, x, b: (phi, x, b[:7]), "b must have phi's width 8"),
    ],
)
def test_pre_validation(mutate, message):
    with pytest.raises(ValueError, match=message):
        MHCPreFwdOp(1, 1, 1, 20)(*mutate(*_pre_inputs()))


def test_pre_constructor_validation():
    with pytest.raises(ValueError, match="sinkhorn_repeat must be >= 0"):
        MHCPreFwdOp(1, 1, 1, -1)
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
    "mutate, message",
    [
        (lambda layer, h, res: (layer[None], h, res), "x_layer_out must be 2-D"),
        (lambda layer, h, res: (layer, h[0], res), "h_post must be 2-D"),
        (lambda layer, h, res: (layer, h, res[0]), "x_res must be 2-D"),
        (lambda layer, h, res: (layer.astype(np.int8), h, res), "x_layer_out must be bfloat16"),
        (lambda layer, h, res: (layer, h.astype(np.float16), res), "h_post must be float32"),
        (lambda layer, h, res: (layer, h, res.astype(np.float16)), "x_res must have x_layer_out"),
        (lambda layer, h, res: (layer[:2], h, res), "same batch, got 2, 3 and 3"),
        (lambda layer, h, res: (layer, h[:2], res), "same batch, got 3, 2 and 3"),
        (lambda layer, h, res: (layer, h, res[:, :15]), "x_res width must be n\\*c_x"),
        (lambda layer, h, res: (layer, h[:, :0], res), "at least one stream"),
    ],
)
def test_post_validation(mutate, message):
    with pytest.raises(ValueError, match=message):
        MHCPostFwdOp()(*mutate(*_post_inputs()))


# --------------------------------------------------------------------------- CUDA planning


def test_streams_of():
    for n in range(1, 40):
        assert streams_of(n * n + 2 * n) == n


@pytest.mark.parametrize("resident", (132, 264))
@pytest.mark.parametrize("batch", (1, 4, 5, 128, 129, 256, 257, 4096, 16384, 40000))
@pytest.mark.parametrize("width", (4 * 1280, 4 * 4096, 4 * 7168, 8 * 130, 64))
def test_plan_geometry_covers_k(batch, width, resident):
    k_range, k_splits, fuse = plan_geometry(batch, width, resident)
    assert k_range % 64 == 0 and k_range >= 64
    assert (k_splits - 1) * k_range < width <= k_splits * k_range  # every split has work
    assert fuse == (batch <= 256)
    tiles = -(-batch // 128)
    if tiles >= resident:
        assert k_splits == 1
    else:  # one wave: a cooperative launch needs every block resident
        assert tiles * k_splits <= resident


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
    plan = sequence_modeling._PrePlan((), n, c_x, k_range, k_splits, fuse, (1, 1, 1, 1))
    x = _device_operand((batch, n * c_x), dtype)
    phi = _device_operand((n * c_x, 24), "float32")
    b = _device_operand((24,), "float32")
    outputs = [
        _device_operand(s, d)
        for s, d in (((3, 520), dtype), ((3, 130), dtype), ((3, 4), "float32"))
    ]
    params = sequence_modeling.pre_launch_params(gates, plan, x, phi, b, *outputs, (1, 2, 3, 4))
    assert len(params) == 176
    fields = sequence_modeling.PRE_PARAMS
    assert fields.read(params, "x") == x.ptr and fields.read(params, "pieces") == 4
    assert fields.read(params, "batch") == batch and fields.read(params, "c_x") == c_x
    params = sequence_modeling.post_launch_params(outputs[1], outputs[2], outputs[0], outputs[0])
    assert len(params) == 104
    assert sequence_modeling.POST_PARAMS.read(params, "n") == n


# --------------------------------------------------------------------------- NVRTC

MHC_SPECS = [spec for spec in sequence_modeling._catalog()]


def test_catalogue_holds_every_launchable_module():
    for dtype in DTYPES:
        for n in sequence_modeling.CUDA_STREAMS:
            assert sequence_modeling.pre_module(dtype, n) in MHC_SPECS
    assert sequence_modeling.post_module() in MHC_SPECS
    assert len(set(MHC_SPECS)) == len(MHC_SPECS)


# Compiling the mHC modules for sm_80 and sm_90 is tests/test_nvrtc.py's job: it compiles the
# whole shipped catalogue, which includes every module listed here.
