"""The RoPE ops on a CUDA device (torch CUDA tensors, CuPy arrays, JAX arrays), against
the same float64 oracle and SPEC 5 bound as the host tests. Every test is ``gpu``-marked:
on a machine without a device they are skipped (tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracle import (
    DEVICE_DTYPES,
    SEQUENCE_OP_IDS,
    SEQUENCE_OPS,
    SEQUENCE_SHAPES,
    assert_like,
    assert_matches_oracle,
    assert_within,
    contract_tolerance,
    max_angle,
    random_data,
    random_position_ids,
    rope_reference,
    roundtrip_tolerance,
    sequence_positions,
    standard_frequencies,
    to_float64,
    to_framework,
    to_host,
)

from tileops_cupy.rope import (
    BUILTIN,
    RoPEBwdOp,
    RoPEFwdOp,
    RoPENeoxPositionIdsBwdOp,
    RoPENeoxPositionIdsFwdOp,
)

pytestmark = pytest.mark.gpu

DEVICE_FRAMEWORKS = ("torch-cuda", "cupy")
DIRECTIONS = ("Fwd", "Bwd")
ROTARY_CASES = ((32, 64), (64, 128), (16, 80), (None, 64), (None, 128))
ROTARY_IDS = tuple(f"rd{r}-hd{h}" for r, h in ROTARY_CASES)


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    return torch


def _cupy():
    return pytest.importorskip("cupy")


def _on_device(host: np.ndarray, framework: str):
    """``host`` data on device 0 in ``framework`` (skips when that framework has no CUDA)."""
    _torch() if framework == "torch-cuda" else _cupy()
    return to_framework(host, framework)


def _ids_op(direction: str):
    return RoPENeoxPositionIdsFwdOp if direction == "Fwd" else RoPENeoxPositionIdsBwdOp


def _synchronize():
    _cupy().cuda.runtime.deviceSynchronize()


# --------------------------------------------------------------------------- seed ops


@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("input_layout", ("1d", "2d"))
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("framework", DEVICE_FRAMEWORKS)
def test_sequence_op_on_device(rng, framework, dtype, input_layout, direction, case):
    shape = SEQUENCE_SHAPES[input_layout]
    op, freqs, neox = case.make(direction, input_layout, shape[-1], rng)
    host = random_data(rng, shape, dtype)
    x = _on_device(host, framework)
    y = op(x)
    assert_like(y, x)
    np.testing.assert_array_equal(to_host(x).view(np.uint8), host.view(np.uint8))
    assert_matches_oracle(
        y, host.astype(np.float64), sequence_positions(shape, input_layout), freqs, dtype,
        neox=neox, inverse=direction == "Bwd",
    )  # fmt: skip


@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
def test_backward_of_forward_on_device(rng, dtype, case):
    shape = SEQUENCE_SHAPES["2d"]
    seed = int(rng.integers(2**32))
    fwd, freqs, _ = case.make("Fwd", "2d", shape[-1], np.random.default_rng(seed))
    bwd, _, _ = case.make("Bwd", "2d", shape[-1], np.random.default_rng(seed))
    host = random_data(rng, shape, dtype)
    x64 = host.astype(np.float64)
    z = to_float64(bwd(fwd(_on_device(host, "torch-cuda"))))
    expected = freqs.amplitude**2 * x64
    angle = max_angle(sequence_positions(shape, "2d"), freqs)
    tolerance = roundtrip_tolerance(expected, x64, dtype, freqs.amplitude, angle)
    assert_within(z, expected, tolerance, f"Bwd(Fwd(x)) vs a*a*x ({dtype}, CUDA)")


@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
def test_host_and_cuda_paths_agree(rng, dtype, case):
    """Both paths meet the contract on the same data, so they differ by at most the sum of
    their bounds (the host result is computed from the same torch tensor, on the CPU)."""
    _torch()
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


# --------------------------------------------------------------------------- position ids


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(("rotary_dim", "head_dim"), ROTARY_CASES, ids=ROTARY_IDS)
@pytest.mark.parametrize("id_dtype", ("int32", "int64"))
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("framework", DEVICE_FRAMEWORKS)
def test_position_ids_op_on_device(
    rng, framework, dtype, id_dtype, rotary_dim, head_dim, direction
):
    tokens, heads, max_position = 700, 5, 70000
    op = _ids_op(direction)(max_position, 10000.0, rotary_dim)
    host = random_data(rng, (tokens, heads, head_dim), dtype)
    ids_host = random_position_ids(rng, tokens, max_position, id_dtype)
    x, ids = _on_device(host, framework), _on_device(ids_host, framework)
    y = op(x, ids)
    assert_like(y, x)
    np.testing.assert_array_equal(to_host(x).view(np.uint8), host.view(np.uint8))
    np.testing.assert_array_equal(to_host(ids), ids_host)
    assert_matches_oracle(
        y, host.astype(np.float64), ids_host[:, None], standard_frequencies(rotary_dim or head_dim),
        dtype, inverse=direction == "Bwd",
    )  # fmt: skip


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
def test_positions_near_2_20_and_2_24_on_device(rng, dtype, direction):
    k = rng.integers(0, 4096, 40)
    ids_host = np.concatenate(
        [
            [2**24 - 1, 2**24 - 2, 2**24 - 1024, 2**24 - 1025, 2**20 - 1, 2**20, 2**20 + 1],
            2**20 + k,
            2**24 - 1 - k,
            rng.integers(2**23, 2**24, 40),
        ]
    ).astype(np.int64)
    rng.shuffle(ids_host)
    host = random_data(rng, (ids_host.size, 4, 128), dtype)
    y = _ids_op(direction)(2**24)(
        _on_device(host, "torch-cuda"), _on_device(ids_host, "torch-cuda")
    )
    assert_matches_oracle(
        y, host.astype(np.float64), ids_host[:, None], standard_frequencies(128), dtype,
        inverse=direction == "Bwd",
    )  # fmt: skip


@pytest.mark.parametrize("id_dtype", ("int32", "int64"))
@pytest.mark.parametrize("framework", DEVICE_FRAMEWORKS)
def test_out_of_range_ids_raise_on_device_and_later_calls_work(rng, framework, id_dtype):
    """Device ids are bounded by the kernel without a sync: a bad id is clamped (no table is
    read out of bounds), flagged, and reported at this op's ``check()`` or next call, which
    then rotates nothing; another op's calls are unaffected."""
    max_position = 1000
    op = RoPENeoxPositionIdsFwdOp(max_position, rotary_dim=32)
    other = RoPENeoxPositionIdsBwdOp(max_position)
    host = random_data(rng, (64, 4, 64), "float16")
    x = _on_device(host, framework)
    freqs = standard_frequencies(32)
    bad_values = [-1, max_position, max_position + 12345, -(2**31), 2**31 - 1]
    if id_dtype == "int64":
        bad_values += [2**40, 2**40 + 7, -(2**40), 2**63 - 1]  # must not wrap to a valid row
    for i, bad in enumerate(bad_values):
        ids_host = random_position_ids(rng, 64, max_position, np.int64)
        row = int(rng.integers(64))
        ids_host[row] = bad
        y = op(x, _on_device(ids_host.astype(id_dtype), framework))  # no sync, no raise yet
        clamped = ids_host.copy()
        clamped[row] = 0 if bad < 0 else max_position - 1
        assert_matches_oracle(y, host.astype(np.float64), clamped[:, None], freqs, "float16")
        # another op's flag is its own
        good_host = random_position_ids(rng, 64, max_position, id_dtype)
        good = _on_device(good_host, framework)
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
        import torch

        torch.cuda.synchronize()


@pytest.mark.parametrize("framework", DEVICE_FRAMEWORKS)
def test_position_ids_errors_on_device(rng, framework):
    op = RoPENeoxPositionIdsFwdOp(64)
    x = _on_device(random_data(rng, (5, 2, 16), "float32"), framework)
    with pytest.raises(ValueError, match="position_ids"):
        op(x, _on_device(np.arange(4), framework))
    with pytest.raises(TypeError, match="position_ids"):
        op(x, _on_device(np.arange(5, dtype=np.float32), framework))
    with pytest.raises(ValueError, match="position_ids"):  # ids on the host, x on the device
        op(x, np.arange(5))
    with pytest.raises(ValueError, match=r"\bx\b|position_ids"):  # x on the host, ids on the device
        op(random_data(rng, (5, 2, 16), "float32"), _on_device(np.arange(5), framework))


# --------------------------------------------------------------------------- strided views


def _device_views(rng, framework, dtype):
    """(name, view, whole buffer, input_layout) read through strides on the device."""

    def make(shape):
        return _on_device(random_data(rng, shape, dtype), framework)

    qkv_2d = make((2, 17, 8 + 2 * 2, 64))  # fused QKV: 8 q heads, 2 k and 2 v heads
    qkv_1d = make((19, 3 * 64))
    bhsd = make((2, 3, 21, 64))
    wide = make((23, 2 * 64))
    shifted = make((13, 2 + 64 + 6))
    row = make((1, 64))
    cases = [
        ("q-of-fused-qkv", qkv_2d[:, :, :8], qkv_2d, "2d"),
        ("k-of-fused-qkv", qkv_2d[:, :, 8:10], qkv_2d, "2d"),
        ("v-of-fused-qkv-1d", qkv_1d[:, 128:], qkv_1d, "1d"),
        ("transposed-seq-head", bhsd.swapaxes(1, 2), bhsd, "2d"),
        ("strided-last-dim", wide[:, ::2], wide, "1d"),
        ("two-element-offset", shifted[:, 2:66], shifted, "1d"),
    ]
    if framework == "cupy":
        cp = _cupy()
        cases += [
            ("reversed-seq", wide[::-1, 64:], wide, "1d"),
            ("broadcast-row", cp.broadcast_to(row, (40, 64)), row, "1d"),
        ]
    else:
        cases += [("broadcast-row", row.expand(40, 64), row, "1d")]
    return cases


@pytest.mark.parametrize("layout", ("neox", "interleaved"))
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("framework", DEVICE_FRAMEWORKS)
def test_strided_views_on_device(rng, framework, dtype, layout):
    freqs = standard_frequencies(64)
    for name, view, buffer, input_layout in _device_views(rng, framework, dtype):
        before = to_host(buffer).copy()
        y = RoPEFwdOp(layout, input_layout)(view)
        assert_like(y, view)
        np.testing.assert_array_equal(to_host(buffer).view(np.uint8), before.view(np.uint8))
        x64 = to_float64(view)
        assert_matches_oracle(
            y, x64, sequence_positions(x64.shape, input_layout), freqs, dtype,
            neox=layout == "neox", what=name,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_odd_element_offset_neox_view_on_device(rng, dtype):
    buffer = _on_device(random_data(rng, (13, 1 + 64 + 3), dtype), "torch-cuda")
    view = buffer[:, 1:65]  # last dim contiguous, rows at odd element offsets
    y = RoPEFwdOp()(view)
    assert_matches_oracle(y, to_float64(view), np.arange(13), standard_frequencies(64), dtype)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32"))
def test_odd_element_offset_interleaved_view_on_device(rng, dtype):
    buffer = _on_device(random_data(rng, (13, 1 + 64 + 3), dtype), "torch-cuda")
    view = buffer[:, 1:65]
    y = RoPEFwdOp("interleaved")(view)
    assert_matches_oracle(
        y, to_float64(view), np.arange(13), standard_frequencies(64), dtype, neox=False
    )


@pytest.mark.parametrize("id_dtype", ("int32", "int64"))
@pytest.mark.parametrize("framework", DEVICE_FRAMEWORKS)
def test_position_ids_on_fused_qkv_views_on_device(rng, framework, id_dtype):
    qkv = _on_device(random_data(rng, (50, 8 + 2 + 2, 128), "bfloat16"), framework)
    ids_host = random_position_ids(rng, 50, 4096, id_dtype)
    ids_buffer = _on_device(np.repeat(ids_host, 2), framework)
    before = to_host(qkv).copy()
    op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=64)
    for view in (qkv[:, :8], qkv[:, 8:10]):
        y = op(view, ids_buffer[::2])  # strided ids too
        np.testing.assert_array_equal(to_host(qkv).view(np.uint8), before.view(np.uint8))
        assert_matches_oracle(
            y, to_float64(view), ids_host[:, None], standard_frequencies(64), "bfloat16"
        )


# --------------------------------------------------------------------------- streams


def test_runs_on_the_current_torch_stream(rng):
    """The input is written on a side stream after a long sleep; only a kernel ordered on
    that stream (the caller's current one) sees it, one on any other stream reads zeros."""
    torch = _torch()
    host = random_data(rng, (2, 300, 8, 128), "bfloat16")
    ids_host = random_position_ids(rng, 600, 4096, np.int64)
    source = to_framework(host, "torch-cuda")
    ids_source = torch.from_numpy(ids_host).cuda()
    x, ids = torch.zeros_like(source), torch.zeros_like(ids_source)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
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


def test_runs_on_the_current_cupy_stream(rng):
    cp = _cupy()
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
    _synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        spin((1,), (1,), (np.int64(100_000_000),))
        x[...] = source
        y = RoPEBwdOp("interleaved")(x)
    stream.synchronize()
    assert_matches_oracle(y, host.astype(np.float64), np.arange(1100), standard_frequencies(64),
                          "float32", neox=False, inverse=True)  # fmt: skip


# --------------------------------------------------------------------------- places and errors


@pytest.mark.parametrize("framework", DEVICE_FRAMEWORKS)
def test_target_checks_on_device(rng, framework):
    host = random_data(rng, (40, 64), "float16")
    x = _on_device(host, framework)
    with pytest.raises(ValueError, match=r"target='cpu'"):
        RoPEFwdOp(target="cpu")(x)
    with pytest.raises(ValueError, match=r"target='cpu'"):
        RoPENeoxPositionIdsFwdOp(64, target="cpu")(x[:, None], _on_device(np.arange(40), framework))
    expected = to_host(RoPEFwdOp()(x))
    for target in ("cuda", BUILTIN, None):
        y = RoPEFwdOp(target=target)(x)
        assert_like(y, x)
        np.testing.assert_array_equal(to_host(y).view(np.uint16), expected.view(np.uint16))
    assert_matches_oracle(expected, host.astype(np.float64), np.arange(40),
                          standard_frequencies(64), "float16")  # fmt: skip


@pytest.mark.parametrize("framework", DEVICE_FRAMEWORKS)
def test_data_errors_on_device(rng, framework):
    x64 = _on_device(random_data(rng, (4, 64), "float64"), framework)
    with pytest.raises(TypeError, match=r"\bx\b"):
        RoPEFwdOp()(x64)  # float64 runs on the host path only
    with pytest.raises(TypeError, match=r"\bx\b"):
        RoPEFwdOp()(_on_device(np.ones((4, 64), np.int32), framework))
    with pytest.raises(ValueError, match="head_dim"):
        RoPEFwdOp()(_on_device(random_data(rng, (4, 62 + 1), "float32"), framework))
    with pytest.raises(ValueError, match=r"(?s)\bx\b.*input_layout"):
        RoPEFwdOp(input_layout="2d")(_on_device(random_data(rng, (4, 64), "float32"), framework))


def test_inputs_on_two_devices():
    torch = _torch()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    rng = np.random.default_rng(2)
    host = random_data(rng, (30, 2, 64), "float32")
    ids_host = random_position_ids(rng, 30, 128, np.int32)
    x1 = torch.from_numpy(host).to("cuda:1")
    with pytest.raises(ValueError, match="position_ids"):
        RoPENeoxPositionIdsFwdOp(128)(x1, torch.from_numpy(ids_host).to("cuda:0"))
    y = RoPENeoxPositionIdsFwdOp(128)(x1, torch.from_numpy(ids_host).to("cuda:1"))
    assert y.device == x1.device  # runs on the input's device, not the current one
    assert_matches_oracle(y, host.astype(np.float64), ids_host[:, None],
                          standard_frequencies(64), "float32")  # fmt: skip


# --------------------------------------------------------------------------- JAX


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
