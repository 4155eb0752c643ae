"""mHC pre/post CUDA kernels against the float64 oracle (SPEC 5 on every element), with torch
and CuPy inputs, strided and misaligned views, a non-default torch stream, and the
device-side validation errors. Every test is ``gpu``-marked (skipped without a device).
"""

from __future__ import annotations

import numpy as np
import pytest
from _mhc_oracle import (
    NP_DTYPES,
    assert_post_matches,
    assert_pre_matches,
    random_pre_case,
    to_float64,
)

from tileops_cupy.sequence_modeling import MHCPostFwdOp, MHCPreFwdOp

pytestmark = pytest.mark.gpu
DTYPES = ("bfloat16", "float16", "float32")


def _torch():
    return pytest.importorskip("torch")


def to_torch(array: np.ndarray, device: str = "cuda"):
    torch = _torch()
    if array.dtype == NP_DTYPES["bfloat16"]:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def to_cupy(array: np.ndarray):
    cupy = pytest.importorskip("cupy")
    if array.dtype == NP_DTYPES["bfloat16"]:  # CuPy takes torch's bf16 zero-copy (SPEC 6)
        return cupy.from_dlpack(to_torch(array))
    return cupy.asarray(array)


def run_pre_torch(case, **kwargs):
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps, **kwargs)
    return op(to_torch(case.phi), to_torch(case.x), to_torch(case.b))


# --------------------------------------------------------------------------- pre


# batch <= 256 runs as one cooperative launch (K split over every multiprocessor; 200 is two
# tiles); 300 is three tiles whose K splits' last block computes the coefficients; a c_x that
# no vector width divides (130) takes the element-wise path
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 2, 4, 6, 8))
def test_pre_matches_oracle(rng, n, dtype):
    for c_x, batch in ((1000, 1), (130, 4), (1000, 37), (136, 200), (130, 300), (64, 5)):
        case = random_pre_case(rng, n, c_x, batch, dtype=dtype)
        outputs = run_pre_torch(case)
        torch = _torch()
        assert outputs[0].dtype == getattr(torch, dtype) and outputs[2].dtype == torch.float32
        assert all(o.is_cuda for o in outputs)
        assert_pre_matches(case, outputs)


@pytest.mark.parametrize("batch", (3, 40))
@pytest.mark.parametrize("eps", (0.0, 0.02))
@pytest.mark.parametrize("repeat", (0, 1, 20))
def test_pre_sinkhorn_settings(rng, repeat, eps, batch):
    case = random_pre_case(rng, 4, 256, batch, repeat=repeat, eps=eps)
    assert_pre_matches(case, run_pre_torch(case))


@pytest.mark.parametrize("n", (1, 4, 8))
def test_pre_saturated(rng, n):
    case = random_pre_case(rng, n, 136, batch=64, saturated=True)
    case.b[:n] = -1e4  # every pre gate is exactly 0: x_layer rows all zero
    x_res, x_layer, h_post = run_pre_torch(case)
    assert not x_layer.float().abs().sum().item()
    assert_pre_matches(case, (x_res, x_layer, h_post))


@pytest.mark.parametrize("batch", (2, 64))
def test_pre_saturated_without_eps_has_no_nan(rng, batch):
    case = random_pre_case(rng, 4, 136, batch, repeat=20, eps=0.0, saturated=True)
    assert_pre_matches(case, run_pre_torch(case), check_mix=False)


def test_pre_production_shapes(rng):
    """The PERF.md widths: many pipeline stages per block, decode (fused) and large K."""
    for c_x, batch in ((1280, 1), (4096, 4), (7168, 3), (4096, 128), (7168, 260)):
        case = random_pre_case(rng, 4, c_x, batch)
        assert_pre_matches(case, run_pre_torch(case))


def test_pre_large_batch_without_k_split(rng):
    """Enough tiles that every block takes all of K (k_splits = 1), last tile partial."""
    case = random_pre_case(rng, 4, 64, 132 * 128 + 77)
    assert_pre_matches(case, run_pre_torch(case))


def test_pre_cupy_in_cupy_out(rng):
    cupy = pytest.importorskip("cupy")
    case = random_pre_case(rng, 4, 256, 9, dtype="bfloat16")
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    outputs = op(to_cupy(case.phi), to_cupy(case.x), to_cupy(case.b))
    assert all(isinstance(o, cupy.ndarray) for o in outputs)
    assert str(outputs[0].dtype) == "bfloat16" and str(outputs[2].dtype) == "float32"
    assert_pre_matches(case, outputs)


def test_pre_strided_and_misaligned_views(rng):
    torch = _torch()
    case = random_pre_case(rng, 4, 256, 6, dtype="float16")
    width = case.x.shape[1]
    wide = torch.zeros(6, width + 24, dtype=torch.float16, device="cuda")
    wide[:, 8 : 8 + width] = to_torch(case.x)  # padded rows, still 16-byte aligned
    phi_cm = to_torch(np.ascontiguousarray(case.phi.T)).T  # column-major phi
    b = to_torch(np.repeat(case.b, 3))[::3]
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    assert_pre_matches(case, op(phi_cm, wide[:, 8 : 8 + width], b))
    wide[:, 1 : 1 + width] = to_torch(case.x)  # 2-byte offset: element-wise path
    assert_pre_matches(case, op(phi_cm, wide[:, 1 : 1 + width], b))
    doubled = torch.zeros(6, 2 * width, dtype=torch.float16, device="cuda")
    doubled[:, ::2] = to_torch(case.x)  # strided last dimension: copied once
    assert_pre_matches(case, op(phi_cm, doubled[:, ::2], b))


def test_pre_on_a_side_stream_is_ordered_and_deterministic(rng):
    torch = _torch()
    case = random_pre_case(rng, 4, 1024, 200)
    phi, x, b = to_torch(case.phi), to_torch(case.x), to_torch(case.b)
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


def test_pre_decode_back_to_back(rng):
    """Fused launches reset their block counter: many in a row all stay correct."""
    torch = _torch()
    case = random_pre_case(rng, 4, 1280, 2)
    phi, b = to_torch(case.phi), to_torch(case.b)
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    xs = [rng.standard_normal(case.x.shape).astype(case.x.dtype) for _ in range(20)]
    results = [op(phi, to_torch(x), b) for x in xs]
    torch.cuda.synchronize()
    for x, outputs in zip(xs, results, strict=True):
        case.x = x
        assert_pre_matches(case, outputs)


def test_pre_device_errors(rng):
    torch = _torch()
    case = random_pre_case(rng, 4, 64, 2)
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    with pytest.raises(ValueError, match="x is on cuda:0 but phi is on the host"):
        op(case.phi, to_torch(case.x), case.b)
    with pytest.raises(ValueError, match="target='cpu' but phi is on cuda:0"):
        on_cpu = MHCPreFwdOp(1, 1, 1, 3, target="cpu")
        on_cpu(to_torch(case.phi), to_torch(case.x), to_torch(case.b))
    q = 9 * 9 + 18
    with pytest.raises(ValueError, match="CUDA mHC kernels take n <= 8"):
        op(
            torch.zeros(9 * 8, q, device="cuda"),
            torch.zeros(1, 72, device="cuda"),
            torch.zeros(q, device="cuda"),
        )


# --------------------------------------------------------------------------- post


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 2, 4, 6, 8))
def test_post_matches_oracle(rng, n, dtype):
    for c_x, batch in ((1000, 3), (130, 33), (4096, 2)):
        layer = rng.standard_normal((batch, c_x)).astype(NP_DTYPES[dtype])
        gates = rng.uniform(0, 2, (batch, n)).astype(np.float32)
        res = rng.standard_normal((batch, n * c_x)).astype(NP_DTYPES[dtype])
        out = MHCPostFwdOp()(to_torch(layer), to_torch(gates), to_torch(res))
        assert out.is_cuda and out.shape == res.shape
        assert_post_matches(layer, gates, res, out, dtype)


def test_post_cupy_strided_and_misaligned(rng):
    cupy = pytest.importorskip("cupy")
    batch, n, c_x = 5, 4, 512
    layer = rng.standard_normal((batch, c_x)).astype(NP_DTYPES["bfloat16"])
    gates = rng.uniform(0, 2, (batch, n)).astype(np.float32)
    res = rng.standard_normal((batch, n * c_x)).astype(NP_DTYPES["bfloat16"])
    out = MHCPostFwdOp()(to_cupy(layer), to_cupy(gates), to_cupy(res))
    assert isinstance(out, cupy.ndarray)
    assert_post_matches(layer, gates, res, out, "bfloat16")
    torch = _torch()
    wide = torch.zeros(batch, n * c_x + 1, dtype=torch.bfloat16, device="cuda")
    wide[:, 1:] = to_torch(res)  # misaligned rows: element-wise path
    gates_cm = to_torch(np.ascontiguousarray(gates.T)).T
    out = MHCPostFwdOp()(to_torch(layer), gates_cm, wide[:, 1:])
    assert_post_matches(layer, gates, res, out, "bfloat16")
    doubled = torch.zeros(batch, 2 * c_x, dtype=torch.bfloat16, device="cuda")
    doubled[:, ::2] = to_torch(layer)  # strided last dimension: copied once
    out = MHCPostFwdOp()(doubled[:, ::2], to_torch(gates), to_torch(res))
    assert_post_matches(layer, gates, res, out, "bfloat16")


def test_pre_device_matches_host(rng):
    case = random_pre_case(rng, 4, 512, 16, dtype="float32")
    op = MHCPreFwdOp(*case.alphas, case.repeat, case.eps)
    device = [to_float64(o) for o in op(to_torch(case.phi), to_torch(case.x), to_torch(case.b))]
    host = [to_float64(o) for o in op(case.phi, case.x, case.b)]
    for d, h in zip(device, host, strict=True):
        np.testing.assert_allclose(d, h, rtol=1e-4, atol=1e-4)
