"""The in-place Q/K RoPE component (issue 4) on a CUDA device, against the float64 oracle.

Every test here is marked ``gpu`` and skips without a device (``conftest.py``). The
oracle and the comparison helpers come from ``test_component_host.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_component_host import (
    SCHEMES,
    as_heads,
    assert_matches,
    assert_same,
    fresh_standard,
    raw_bytes,
    rotate64,
    sequence_positions,
    standard_inv_freq,
    table_entries,
    to64,
)

from tileops_cupy.rope import RoPE, RoPEFwdOp, apply_rope, table_cache_info

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

DEVICE_DTYPES = ("float16", "bfloat16", "float32")
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 128, 8, 2
SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU time: work queued behind it is clearly ordered


def _fresh_standard():
    return fresh_standard(40011.0)


def device_tensor(rng, shape, dtype: str, framework: str = "torch"):
    """Random data on the GPU as (the object to pass, a torch alias of the same memory)."""
    host = rng.standard_normal(shape).astype(np.float32)
    alias = torch.from_numpy(host).to("cuda").to(TORCH_DTYPES[dtype])
    if framework == "cupy":
        cupy = pytest.importorskip("cupy")
        return cupy.from_dlpack(alias), alias
    return alias, alias


def _qk(rng, batch, seq, dtype, framework="torch", heads=NUM_HEADS, kv_heads=NUM_KV_HEADS):
    """q ``[B, T, H*D]`` and k ``[B, T, Hkv, D]`` on the GPU, their aliases and float64 copies."""
    q, q_alias = device_tensor(rng, (batch, seq, heads * HEAD_DIM), dtype, framework)
    k, k_alias = device_tensor(rng, (batch, seq, kv_heads, HEAD_DIM), dtype, framework)
    return q, k, q_alias, k_alias, as_heads(q_alias, heads, HEAD_DIM), to64(k_alias)


def _positions_tensor(values, dtype: str, device: str = "cuda"):
    return torch.tensor(np.asarray(values), dtype=getattr(torch, dtype), device=device)


# --------------------------------------------------------------------------- forward / prefill


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("case", [SCHEMES["standard"], SCHEMES["yarn"]], ids=["standard", "yarn"])
def test_gpu_forward_and_prefill_match_oracle(rng, case, framework, dtype, layout):
    batch, seq = 2, 37
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM), rope_layout=layout)
    frequencies = case.frequencies(HEAD_DIM)
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, batch, seq, dtype, framework)

    assert_same(rope.forward(q, k), q, k)
    torch.cuda.synchronize()
    positions = sequence_positions(batch, seq, 0)
    assert_matches(q_alias, rotate64(q64, positions, frequencies, layout), q64, dtype, "q")
    assert_matches(k_alias, rotate64(k64, positions, frequencies, layout), k64, dtype, "k")

    offset = 2**22 + 17
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, batch, seq, dtype, framework)
    assert_same(rope.prefill(q, k, offset), q, k)
    torch.cuda.synchronize()
    positions = sequence_positions(batch, seq, offset)
    assert_matches(q_alias, rotate64(q64, positions, frequencies, layout), q64, dtype, "q")
    assert_matches(k_alias, rotate64(k64, positions, frequencies, layout), k64, dtype, "k")


@pytest.mark.parametrize("case", list(SCHEMES.values()), ids=list(SCHEMES))
def test_gpu_schemes_gqa_and_k_none(rng, case):
    rope = RoPE(HEAD_DIM, 32, 8, scheme=case.scheme(HEAD_DIM))
    frequencies = case.frequencies(HEAD_DIM)
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, 3, 19, "float32", heads=32, kv_heads=8)
    rope.prefill(q, k, 1000)
    torch.cuda.synchronize()
    positions = sequence_positions(3, 19, 1000)
    assert_matches(q_alias, rotate64(q64, positions, frequencies), q64, "float32", "q")
    assert_matches(k_alias, rotate64(k64, positions, frequencies), k64, "float32", "k")

    q, _, q_alias, _, q64, _ = _qk(rng, 3, 19, "float32", heads=32, kv_heads=8)
    assert_same(rope.forward(q, None), q, None)
    torch.cuda.synchronize()
    positions = sequence_positions(3, 19, 0)
    assert_matches(q_alias, rotate64(q64, positions, frequencies), q64, "float32", "q")


# --------------------------------------------------------------------------- fused QKV


@pytest.mark.parametrize("view_rank", [3, 4])
@pytest.mark.parametrize(
    ("framework", "dtype"),
    [("torch", "bfloat16"), ("torch", "float32"), ("cupy", "float16"), ("cupy", "bfloat16")],
)
def test_gpu_fused_qkv_views_rotate_in_place(rng, framework, dtype, view_rank):
    batch, seq, hq, hkv = 2, 21, NUM_HEADS, NUM_KV_HEADS
    heads = hq + 2 * hkv
    qkv, alias = device_tensor(rng, (batch, seq, heads * HEAD_DIM), dtype, framework)
    before = to64(alias).reshape(batch, seq, heads, HEAD_DIM)
    if view_rank == 3:
        q, k = qkv[..., : hq * HEAD_DIM], qkv[..., hq * HEAD_DIM : (hq + hkv) * HEAD_DIM]
    else:
        split = qkv.reshape(batch, seq, heads, HEAD_DIM)
        q, k = split[:, :, :hq], split[:, :, hq : hq + hkv]
    v_before = raw_bytes(alias[..., (hq + hkv) * HEAD_DIM :])
    case = SCHEMES["llama31"]
    rope = RoPE(HEAD_DIM, hq, hkv, scheme=case.scheme(HEAD_DIM))

    assert_same(rope.prefill(q, k, 500), q, k)
    torch.cuda.synchronize()

    assert np.array_equal(raw_bytes(alias[..., (hq + hkv) * HEAD_DIM :]), v_before), "v changed"
    after = to64(alias).reshape(batch, seq, heads, HEAD_DIM)
    positions = sequence_positions(batch, seq, 500)
    frequencies = case.frequencies(HEAD_DIM)
    q64, k64 = before[:, :, :hq], before[:, :, hq : hq + hkv]
    assert_matches(after[:, :, :hq], rotate64(q64, positions, frequencies), q64, dtype, "q")
    k_expected = rotate64(k64, positions, frequencies)
    assert_matches(after[:, :, hq : hq + hkv], k_expected, k64, dtype, "k")


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_unaligned_views_are_right_or_refused(rng, dtype, layout):
    """Views that start one element into the buffer defeat 16-byte accesses: the result must
    still be right, or a ValueError that leaves the data alone (never a silent misread)."""
    batch, seq = 2, 5
    width = 1 + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    buffer, alias = device_tensor(rng, (batch, seq, width), dtype)
    before = to64(alias)
    q = buffer[..., 1 : 1 + NUM_HEADS * HEAD_DIM]
    k = buffer[..., 1 + NUM_HEADS * HEAD_DIM :]
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, rope_layout=layout)
    try:
        rope.prefill(q, k, 3)
    except ValueError:
        torch.cuda.synchronize()
        assert np.array_equal(to64(alias), before)
        return
    torch.cuda.synchronize()
    after = to64(alias)
    assert np.array_equal(after[..., 0], before[..., 0])
    positions = sequence_positions(batch, seq, 3)
    frequencies = SCHEMES["standard"].frequencies(HEAD_DIM)
    rows = before[..., 1:].reshape(batch, seq, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM)
    expected = rotate64(rows, positions, frequencies, layout)
    assert_matches(after[..., 1:], expected, rows, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [64, 96, 32])
def test_gpu_partial_rotary_dim_leaves_the_tail(rng, rotary_dim, layout, dtype):
    case = SCHEMES["yarn"]
    rope = RoPE(
        HEAD_DIM,
        NUM_HEADS,
        NUM_KV_HEADS,
        scheme=case.scheme(rotary_dim),
        rotary_dim=rotary_dim,
        rope_layout=layout,
    )
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, 2, 11, dtype)
    q_tail = raw_bytes(q_alias.reshape(2, 11, NUM_HEADS, HEAD_DIM)[..., rotary_dim:])
    k_tail = raw_bytes(k_alias[..., rotary_dim:])

    rope.prefill(q, k, 70_000)
    torch.cuda.synchronize()

    assert np.array_equal(
        raw_bytes(q_alias.reshape(2, 11, NUM_HEADS, HEAD_DIM)[..., rotary_dim:]), q_tail
    )
    assert np.array_equal(raw_bytes(k_alias[..., rotary_dim:]), k_tail)
    positions = sequence_positions(2, 11, 70_000)
    frequencies = case.frequencies(rotary_dim)
    assert_matches(q_alias, rotate64(q64, positions, frequencies, layout), q64, dtype, "q")
    assert_matches(k_alias, rotate64(k64, positions, frequencies, layout), k64, dtype, "k")


# --------------------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_chunked_prefill_equals_full_forward(rng, dtype):
    batch, seq = 2, 300
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=SCHEMES["yarn"].scheme(HEAD_DIM))
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, batch, seq, dtype)
    q_full, k_full = q.clone(), k.clone()
    rope.forward(q_full, k_full)
    for start, stop in ((0, 100), (100, 101), (101, 257), (257, 300)):
        rope.prefill(q[:, start:stop], k[:, start:stop], start)
    torch.cuda.synchronize()

    assert torch.equal(q.view(torch.uint8), q_full.view(torch.uint8))
    assert torch.equal(k.view(torch.uint8), k_full.view(torch.uint8))
    positions = sequence_positions(batch, seq, 0)
    frequencies = SCHEMES["yarn"].frequencies(HEAD_DIM)
    assert_matches(q_alias, rotate64(q64, positions, frequencies), q64, dtype, "q")
    assert_matches(k_alias, rotate64(k64, positions, frequencies), k64, dtype, "k")


@pytest.mark.parametrize("offsets_dtype", ["int32", "int64"])
@pytest.mark.parametrize("where", ["device", "host"])
def test_gpu_prefill_with_per_sequence_offsets(rng, where, offsets_dtype):
    batch, seq = 4, 9
    case = SCHEMES["longrope"]
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM), max_position=2**21)
    values = np.array([0, 33, 4090, 2**21 - seq], dtype=offsets_dtype)
    offsets = _positions_tensor(values, offsets_dtype, "cuda" if where == "device" else "cpu")
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, batch, seq, "float32")

    rope.prefill(q, k, offsets)
    torch.cuda.synchronize()
    rope.check()

    positions = sequence_positions(batch, seq, values)
    frequencies = case.frequencies(HEAD_DIM)
    assert_matches(q_alias, rotate64(q64, positions, frequencies), q64, "float32", "q")
    assert_matches(k_alias, rotate64(k64, positions, frequencies), k64, "float32", "k")


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize(
    "kind",
    ["int", "device-int32", "device-int64", "numpy-int32", "numpy-int64", "torch-cpu-int64"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_decode_per_sequence(rng, dtype, kind):
    batch, max_position = 64, 2**20
    case = SCHEMES["yarn"]
    rope = RoPE(HEAD_DIM, 32, 8, scheme=case.scheme(HEAD_DIM), max_position=max_position)
    values = rng.integers(0, max_position, batch)
    values[:4] = [0, 1, 1024, max_position - 1]
    if kind == "int":
        values[:] = 654_321
        position = 654_321
    elif kind.startswith("device"):
        position = _positions_tensor(values, kind.split("-")[1])
    elif kind.startswith("numpy"):
        position = values.astype(kind.split("-")[1])
    else:
        position = _positions_tensor(values, "int64", "cpu")
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, batch, 1, dtype, heads=32, kv_heads=8)

    assert_same(rope.decode(q, k, position), q, k)
    torch.cuda.synchronize()
    rope.check()

    positions = values.astype(np.int64)[:, None]
    frequencies = case.frequencies(HEAD_DIM)
    assert_matches(q_alias, rotate64(q64, positions, frequencies), q64, dtype, "q")
    assert_matches(k_alias, rotate64(k64, positions, frequencies), k64, dtype, "k")


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("offset", [0, 5000, "device"])
@pytest.mark.parametrize("case", [SCHEMES["yarn"], SCHEMES["longrope"]], ids=["yarn", "longrope"])
def test_gpu_backward(rng, case, offset):
    batch, seq = 3, 16
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM), max_position=2**16)
    frequencies = case.frequencies(HEAD_DIM)
    _, amplitude = frequencies
    values = np.array([7, 300, 60_000]) if offset == "device" else offset
    position = _positions_tensor(values, "int64") if offset == "device" else offset
    positions = sequence_positions(batch, seq, values)

    # backward alone is the transpose rotation
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, batch, seq, "float32")
    assert_same(rope.backward(q, k, position), q, k)
    torch.cuda.synchronize()
    expected = rotate64(q64, positions, frequencies, inverse=True)
    assert_matches(q_alias, expected, q64, "float32", "grad_q")
    expected = rotate64(k64, positions, frequencies, inverse=True)
    assert_matches(k_alias, expected, k64, "float32", "grad_k")

    # backward of forward is a*a times the identity
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, batch, seq, "float32")
    rope.prefill(q, k, position)
    rope.backward(q, k, position)
    torch.cuda.synchronize()
    rope.check()
    assert amplitude > 1.05
    tolerance = 2e-6 * amplitude**2 * float(np.abs(q64).max())
    assert np.abs(as_heads(q_alias, NUM_HEADS, HEAD_DIM) - amplitude**2 * q64).max() <= tolerance
    assert np.abs(to64(k_alias) - amplitude**2 * k64).max() <= tolerance


# --------------------------------------------------------------------------- streams


def test_gpu_runs_on_the_current_torch_stream(rng):
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    q = torch.zeros(4, 16, NUM_HEADS * HEAD_DIM, device="cuda")
    k = torch.zeros(4, 16, NUM_KV_HEADS * HEAD_DIM, device="cuda")
    _, _, fresh_q, fresh_k, q64, k64 = _qk(rng, 4, 16, "float32")
    k64 = k64.reshape(4, 16, NUM_KV_HEADS, HEAD_DIM)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # on `side` the copy waits behind the sleep; a launch on any other stream would
        # rotate the zeros first and the copy would then overwrite them unrotated
        torch.cuda._sleep(SLEEP_CYCLES)
        q.copy_(fresh_q)
        k.copy_(fresh_k.reshape(k.shape))
        rope.prefill(q, k, 11)
    torch.cuda.synchronize()
    positions = sequence_positions(4, 16, 11)
    frequencies = SCHEMES["standard"].frequencies(HEAD_DIM)
    assert_matches(q, rotate64(q64, positions, frequencies), q64, "float32", "q")
    assert_matches(k, rotate64(k64, positions, frequencies), k64, "float32", "k")


def test_gpu_runs_on_the_current_cupy_stream(rng):
    cupy = pytest.importorskip("cupy")
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    host_q = rng.standard_normal((4, 16, NUM_HEADS * HEAD_DIM)).astype(np.float32)
    host_k = rng.standard_normal((4, 16, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    fresh_q, fresh_k = cupy.asarray(host_q), cupy.asarray(host_k)
    q, k = cupy.zeros_like(fresh_q), cupy.zeros_like(fresh_k)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
            torch.cuda._sleep(SLEEP_CYCLES)
        q[...] = fresh_q
        k[...] = fresh_k
        rope.prefill(q, k, 11)
    stream.synchronize()
    positions = sequence_positions(4, 16, 11)
    frequencies = SCHEMES["standard"].frequencies(HEAD_DIM)
    q64, k64 = as_heads(host_q, NUM_HEADS, HEAD_DIM), host_k.astype(np.float64)
    assert_matches(q, rotate64(q64, positions, frequencies), q64, "float32", "q")
    assert_matches(k, rotate64(k64, positions, frequencies), k64, "float32", "k")


# --------------------------------------------------------------------------- device positions


@pytest.mark.parametrize("positions_dtype", ["int32", "int64"])
def test_gpu_out_of_range_device_positions_surface_at_the_next_call(rng, positions_dtype):
    max_position = 4096
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=max_position)
    bystander = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=max_position)
    values = [5, max_position, -3, max_position - 1, 2**31 - 1]
    clamped = [5, max_position - 1, 0, max_position - 1, max_position - 1]
    if positions_dtype == "int64":
        values.append(2**40 + 5)  # must not wrap to 5
        clamped.append(max_position - 1)
    batch = len(values)
    frequencies = SCHEMES["standard"].frequencies(HEAD_DIM)
    q, k, q_alias, k_alias, q64, k64 = _qk(rng, batch, 1, "float32")

    rope.decode(q, k, _positions_tensor(values, positions_dtype))  # no sync, no raise here
    torch.cuda.synchronize()

    # the kernel clamped: valid sequences are right, no table was read out of bounds
    positions = np.array(clamped)[:, None]
    assert_matches(q_alias, rotate64(q64, positions, frequencies), q64, "float32", "q")
    assert_matches(k_alias, rotate64(k64, positions, frequencies), k64, "float32", "k")

    # another component's flag is its own
    q2, k2, q2_alias, _, q2_64, _ = _qk(rng, batch, 1, "float32")
    bystander.decode(q2, k2, 9)
    torch.cuda.synchronize()

    # the next call of the faulty component raises, and rotates nothing
    q3, k3, q3_alias, _, q3_64, _ = _qk(rng, batch, 1, "float32")
    with pytest.raises(ValueError, match="position"):
        rope.decode(q3, k3, 7)
    torch.cuda.synchronize()
    assert np.array_equal(as_heads(q3_alias, NUM_HEADS, HEAD_DIM), q3_64)
    # once reported, the flag is clear
    rope.decode(q3, k3, 7)
    rope.check()

    # or rope.check() reports it, after waiting for the device
    rope.decode(q, k, _positions_tensor(values, positions_dtype))
    with pytest.raises(ValueError, match="position"):
        rope.check()
    rope.check()


def test_gpu_device_positions_need_max_position(rng):
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    q, k, q_alias, _, q64, _ = _qk(rng, 2, 1, "float32")
    with pytest.raises(ValueError, match="max_position"):
        rope.decode(q, k, _positions_tensor([1, 2], "int32"))
    with pytest.raises(ValueError, match="max_position"):
        rope.prefill(q, k, _positions_tensor([1, 2], "int64"))
    torch.cuda.synchronize()
    assert np.array_equal(as_heads(q_alias, NUM_HEADS, HEAD_DIM), q64)


def _call_error_cases():
    def q_k(batch=2, seq=1, dtype=torch.float32, device="cuda"):
        return (
            torch.zeros(batch, seq, NUM_HEADS * HEAD_DIM, dtype=dtype, device=device),
            torch.zeros(batch, seq, NUM_KV_HEADS * HEAD_DIM, dtype=dtype, device=device),
        )

    def positions(values, dtype="int64", device="cuda"):
        return _positions_tensor(values, dtype, device)

    return {
        "device-offsets-length": (
            lambda r: r.prefill(*q_k(seq=3), positions([0, 1, 2])),
            ValueError,
            "position_offset",
        ),
        "device-positions-2d": (
            lambda r: r.decode(*q_k(), positions([[0], [1]])),
            ValueError,
            r"\bposition\b",
        ),
        "device-positions-strided": (
            lambda r: r.decode(*q_k(), positions([0, 9, 1, 9])[::2]),
            ValueError,
            r"\bposition\b",
        ),
        "host-positions-beyond": (
            lambda r: r.decode(*q_k(), np.array([0, 1000])),
            ValueError,
            r"\bposition\b",
        ),
        "host-positions-negative": (
            lambda r: r.prefill(*q_k(seq=3), positions([-1, 0], device="cpu")),
            ValueError,
            "position_offset",
        ),
        "int-beyond": (lambda r: r.prefill(*q_k(seq=3), 998), ValueError, "position_offset"),
        "decode-T": (lambda r: r.decode(*q_k(seq=2), 0), ValueError, "T"),
        "k-heads": (
            lambda r: r.forward(q_k()[0], torch.zeros(2, 1, 3 * HEAD_DIM, device="cuda")),
            ValueError,
            r"\bk\b",
        ),
        "k-on-host": (lambda r: r.forward(q_k()[0], q_k(device="cpu")[1]), ValueError, r"\bk\b"),
        "float64-on-device": (
            lambda r: r.forward(*q_k(dtype=torch.float64)),
            TypeError,
            r"\bq\b",
        ),
        "int-data": (lambda r: r.forward(*q_k(dtype=torch.int32)), TypeError, r"\bq\b"),
        "float-positions": (
            lambda r: r.decode(*q_k(), positions([0.0, 1.0], "float32")),
            TypeError,
            r"\bposition\b",
        ),
    }


_CALL_ERRORS = _call_error_cases()


@pytest.mark.parametrize("name", list(_CALL_ERRORS))
def test_gpu_call_errors(name):
    call, error, match = _CALL_ERRORS[name]
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=1000)
    with pytest.raises(error, match=match):
        call(rope)
    rope.check()  # a refused call launched nothing


def test_gpu_target_cpu_refuses_device_data():
    rope = RoPE(HEAD_DIM, NUM_HEADS, target="cpu")
    with pytest.raises(ValueError, match="target"):
        rope.forward(torch.zeros(1, 2, NUM_HEADS * HEAD_DIM, device="cuda"))


# --------------------------------------------------------------------------- CUDA graphs


def test_gpu_cuda_graph_replays_decode_with_new_positions(rng):
    batch, hq, hkv = 8, NUM_HEADS, NUM_KV_HEADS
    max_position = 1 << 16
    case = SCHEMES["yarn"]
    frequencies = case.frequencies(HEAD_DIM)
    rope = RoPE(HEAD_DIM, hq, hkv, scheme=case.scheme(HEAD_DIM), max_position=max_position)
    qkv = torch.zeros(batch, 1, (hq + 2 * hkv) * HEAD_DIM, device="cuda")
    q, k = qkv[..., : hq * HEAD_DIM], qkv[..., hq * HEAD_DIM : (hq + hkv) * HEAD_DIM]
    positions = torch.zeros(batch, dtype=torch.int32, device="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, upload the table, map the flag
        rope.decode(q, k, positions)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope.decode(q, k, positions)

    def step(values):
        data = rng.standard_normal(tuple(qkv.shape)).astype(np.float32)
        positions.copy_(torch.from_numpy(np.asarray(values, dtype=np.int32)))
        qkv.copy_(torch.from_numpy(data))
        graph.replay()
        torch.cuda.synchronize()
        return data.astype(np.float64).reshape(batch, 1, hq + 2 * hkv, HEAD_DIM)

    def check(before, values):
        after = to64(qkv).reshape(batch, 1, hq + 2 * hkv, HEAD_DIM)
        rows = np.asarray(values, dtype=np.int64)[:, None]
        q64, k64 = before[:, :, :hq], before[:, :, hq : hq + hkv]
        assert_matches(after[:, :, :hq], rotate64(q64, rows, frequencies), q64, "float32", "q")
        k_expected = rotate64(k64, rows, frequencies)
        assert_matches(after[:, :, hq : hq + hkv], k_expected, k64, "float32", "k")
        assert np.array_equal(after[:, :, hq + hkv :], before[:, :, hq + hkv :]), "v changed"

    for replay in range(4):
        values = rng.integers(0, max_position, batch)
        values[0], values[-1] = replay, max_position - 1
        check(step(values), values)
        rope.check()
        if replay == 1:
            # another layer grows the shared table: the captured launch keeps reading the
            # copy it was captured with, which must stay alive and right
            grower = RoPE(HEAD_DIM, hq, hkv, scheme=case.scheme(HEAD_DIM))
            grower.prefill(*_qk(rng, 1, 2, "float32")[:2], 2**22)
            torch.cuda.synchronize()
            assert rope.table.capacity > max_position

    # an out-of-range position written into the captured tensor: clamped and reported
    values = rng.integers(0, max_position, batch)
    values[1] = max_position + 3
    before = step(values)
    with pytest.raises(ValueError, match="position"):
        rope.check()
    values[1] = max_position - 1
    check(before, values)


# --------------------------------------------------------------------------- the bench shape


def test_gpu_prefill_b1_t8192_32q_8kv_d128_bf16_in_one_call():
    seq, hq, hkv = 8192, 32, 8
    heads = hq + 2 * hkv
    generator = torch.Generator(device="cuda").manual_seed(8192)
    qkv = torch.randn(
        1, seq, heads * HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator
    )
    before = qkv.cpu()
    q, k = qkv[..., : hq * HEAD_DIM], qkv[..., hq * HEAD_DIM : (hq + hkv) * HEAD_DIM]
    case = SCHEMES["llama31"]
    rope = RoPE(HEAD_DIM, hq, hkv, scheme=case.scheme(HEAD_DIM))

    assert_same(rope.prefill(q, k, 0), q, k)
    torch.cuda.synchronize()

    after = qkv.cpu()
    v_slice = np.s_[..., (hq + hkv) * HEAD_DIM :]
    assert torch.equal(after[v_slice].view(torch.int16), before[v_slice].view(torch.int16))
    frequencies = case.frequencies(HEAD_DIM)
    chunk = 1024
    for start in range(0, seq, chunk):  # every element, in chunks of tokens to bound memory
        rows = np.s_[:, start : start + chunk]
        x64 = to64(before[rows]).reshape(1, chunk, heads, HEAD_DIM)
        y = to64(after[rows]).reshape(1, chunk, heads, HEAD_DIM)
        positions = sequence_positions(1, chunk, start)
        q64, k64 = x64[:, :, :hq], x64[:, :, hq : hq + hkv]
        assert_matches(y[:, :, :hq], rotate64(q64, positions, frequencies), q64, "bfloat16")
        k_expected = rotate64(k64, positions, frequencies)
        assert_matches(y[:, :, hq : hq + hkv], k_expected, k64, "bfloat16")


# --------------------------------------------------------------------------- apply_rope


@pytest.mark.parametrize("offset", [100, "device"])
def test_gpu_apply_rope_matches_the_host_path(rng, offset):
    case = SCHEMES["yarn"]
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM), max_position=4096)
    shape_q, shape_k = (2, 7, NUM_HEADS * HEAD_DIM), (2, 7, NUM_KV_HEADS, HEAD_DIM)
    host_q = rng.standard_normal(shape_q).astype(np.float32)
    host_k = rng.standard_normal(shape_k).astype(np.float32)
    weight_q = rng.standard_normal(shape_q).astype(np.float32)
    weight_k = rng.standard_normal(shape_k).astype(np.float32)
    values = np.array([3, 2000])
    results = {}
    for device in ("cpu", "cuda"):
        q = torch.tensor(host_q, device=device, requires_grad=True)
        k = torch.tensor(host_k, device=device, requires_grad=True)
        position = _positions_tensor(values, "int64", device) if offset == "device" else offset
        q_rot, k_rot = apply_rope(q, k, rope, position)
        assert q_rot.device.type == device and q_rot is not q
        loss = (q_rot * torch.tensor(weight_q, device=device)).sum() + (
            k_rot * torch.tensor(weight_k, device=device)
        ).sum()
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
            assert np.array_equal(q.detach().cpu().numpy(), host_q), "apply_rope modified q"
        results[device] = [to64(t) for t in (q_rot, k_rot, q.grad, k.grad)]
    rope.check()

    for name, host, device, x in zip(
        ("q", "k", "grad_q", "grad_k"),
        results["cpu"],
        results["cuda"],
        (host_q, host_k, weight_q, weight_k),
        strict=True,
    ):
        x64 = x.astype(np.float64)
        assert_matches(device, host, x64, "float32", name)
    positions = sequence_positions(2, 7, values if offset == "device" else offset)
    q64 = as_heads(host_q, NUM_HEADS, HEAD_DIM)
    expected = rotate64(q64, positions, case.frequencies(HEAD_DIM))
    assert_matches(results["cuda"][0], expected, q64, "float32", "q_rot")
    w64 = as_heads(weight_q, NUM_HEADS, HEAD_DIM)
    expected = rotate64(w64, positions, case.frequencies(HEAD_DIM), inverse=True)
    assert_matches(results["cuda"][2], expected, w64, "float32", "grad_q")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("rotary_dim", "layout"), [(96, "neox"), (64, "interleaved")])
def test_gpu_apply_rope_partial_rotary_copies_the_tail(rng, rotary_dim, layout, dtype):
    """Out of place, the columns past rotary_dim are copied (the in-place calls skip them)."""
    case = SCHEMES["yarn"]
    rope = RoPE(
        HEAD_DIM,
        NUM_HEADS,
        NUM_KV_HEADS,
        scheme=case.scheme(rotary_dim),
        rotary_dim=rotary_dim,
        rope_layout=layout,
    )
    frequencies = case.frequencies(rotary_dim)
    heads = NUM_HEADS + 2 * NUM_KV_HEADS
    qkv, _ = device_tensor(rng, (2, 6, heads * HEAD_DIM), dtype)
    qkv.requires_grad_(True)
    q = qkv[..., : NUM_HEADS * HEAD_DIM]
    k = qkv[..., NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM]
    before = to64(qkv).reshape(2, 6, heads, HEAD_DIM)

    q_rot, k_rot = apply_rope(q, k, rope, 40)
    grad_q, _ = device_tensor(rng, tuple(q_rot.shape), dtype)
    grad_k, _ = device_tensor(rng, tuple(k_rot.shape), dtype)
    torch.autograd.backward((q_rot, k_rot), (grad_q, grad_k))
    torch.cuda.synchronize()
    rope.check()

    assert np.array_equal(to64(qkv).reshape(before.shape), before), "apply_rope modified its input"
    positions = sequence_positions(2, 6, 40)
    q64, k64 = before[:, :, :NUM_HEADS], before[:, :, NUM_HEADS : NUM_HEADS + NUM_KV_HEADS]
    q_expected = rotate64(q64, positions, frequencies, layout)
    assert_matches(q_rot, q_expected, q64, dtype, "q_rot")
    k_expected = rotate64(k64, positions, frequencies, layout)
    assert_matches(k_rot, k_expected, k64, dtype, "k_rot")
    got_tail = to64(q_rot).reshape(q64.shape)[..., rotary_dim:]
    assert np.array_equal(got_tail, q64[..., rotary_dim:]), "tail not copied exactly"

    g64 = as_heads(grad_q, NUM_HEADS, HEAD_DIM)
    grad = to64(qkv.grad).reshape(before.shape)
    expected = rotate64(g64, positions, frequencies, layout, inverse=True)
    assert_matches(grad[:, :, :NUM_HEADS], expected, g64, dtype, "grad_q")
    assert not grad[:, :, NUM_HEADS + NUM_KV_HEADS :].any(), "v got a gradient"


# --------------------------------------------------------------------------- shared tables


def _decode_on_device(rope: RoPE, rng, batch=2) -> None:
    q, k, *_ = _qk(rng, batch, 1, "float32", heads=rope.num_heads, kv_heads=rope.num_kv_heads)
    rope.decode(q, k, _positions_tensor(np.arange(batch), "int32"))
    torch.cuda.synchronize()


def test_gpu_shared_table_device_bytes_and_required_memory(rng):
    scheme = _fresh_standard()
    max_position = 20_000
    needed = RoPE.required_memory(HEAD_DIM, max_position, scheme=scheme)
    assert needed > 0
    first = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=scheme, max_position=max_position)
    second = RoPE(HEAD_DIM, 4, scheme=scheme, max_position=max_position)
    assert RoPE.required_memory(HEAD_DIM, max_position, scheme=scheme) == needed

    _decode_on_device(first, rng)
    _decode_on_device(second, rng)
    op = RoPEFwdOp(input_layout="1d", base=scheme.base)
    x = torch.randn(100, HEAD_DIM, device="cuda")
    y = op(x)
    torch.cuda.synchronize()

    device = torch.cuda.current_device()
    assert first.table is second.table
    [entry] = table_entries(scheme, HEAD_DIM)
    assert entry["device_bytes"] == {device: needed}
    assert first.memory_stats()["shared"]["device"] == {device: needed}
    assert second.memory_stats() == first.memory_stats()
    info = table_cache_info()
    live_and_retired = (
        sum(e["device_bytes"].values()) + sum(e["device_retired_bytes"].values())
        for e in info["entries"]
    )
    assert info["device_bytes"] == sum(live_and_retired)
    assert RoPE.required_memory(HEAD_DIM, max_position, scheme=scheme) == 0
    assert RoPE.required_memory(HEAD_DIM, 1000, scheme=scheme) == 0
    assert RoPE.required_memory(HEAD_DIM, 2**20, scheme=scheme) > 0
    assert RoPE.required_memory(HEAD_DIM, max_position, scheme=scheme, rotary_dim=64) > 0
    x64 = to64(x)[None, :, None, :]
    frequencies = (standard_inv_freq(scheme.base, HEAD_DIM), 1.0)
    assert_matches(y, rotate64(x64, sequence_positions(1, 100, 0), frequencies), x64, "float32")


def test_gpu_required_memory_after_host_only_growth(rng):
    scheme = _fresh_standard()
    rope = RoPE(HEAD_DIM, 4, scheme=scheme, max_position=8192)
    _decode_on_device(rope, rng)
    before = rope.memory_stats()["shared"]["device"]
    host = RoPE(HEAD_DIM, 4, scheme=scheme)
    host.prefill(np.zeros((1, 1, 4 * HEAD_DIM), np.float32), None, 100_000)  # host path only
    if rope.memory_stats()["shared"]["device"] != before:
        pytest.fail("the host path changed the device copy")  # not the xfail's AssertionError
    assert RoPE.required_memory(HEAD_DIM, 100_001, scheme=scheme) > 0


def test_gpu_required_memory_predicts_device_growth(rng):
    cupy = pytest.importorskip("cupy")
    scheme = _fresh_standard()
    _decode_on_device(RoPE(HEAD_DIM, 4, scheme=scheme, max_position=8192), rng)
    predicted = RoPE.required_memory(HEAD_DIM, 2**20, scheme=scheme)
    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    big = RoPE(HEAD_DIM, 4, scheme=scheme, max_position=2**20)
    _decode_on_device(big, rng)
    grown = pool.used_bytes() - used
    assert grown == predicted, f"required_memory predicted {predicted} bytes, the pool grew {grown}"


def test_gpu_device_table_grows_on_demand(rng):
    scheme = _fresh_standard()
    small = RoPE.required_memory(HEAD_DIM, 8192, scheme=scheme)
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=scheme)
    q, k, *_ = _qk(rng, 1, 16, "float32")
    rope.prefill(q, k, 0)
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    assert rope.memory_stats()["shared"]["device"] == {device: small}
    q, k, *_ = _qk(rng, 1, 16, "float32")
    rope.prefill(q, k, 100_000)
    torch.cuda.synchronize()
    grown = rope.memory_stats()["shared"]["device"][device]
    assert small < grown < RoPE.required_memory(HEAD_DIM, 2**24, scheme=_fresh_standard())


def test_gpu_threads_share_and_upload_one_table(rng):
    scheme = _fresh_standard()
    frequencies = (standard_inv_freq(scheme.base, HEAD_DIM), 1.0)
    threads_count, rounds = 4, 3
    offsets = [[t * 1000 + r * 600_000 for r in range(rounds)] for t in range(threads_count)]
    offsets[2][0] = 2**24 - 8  # grows the table to the end while others upload and launch
    inputs = [[_qk(rng, 2, 8, "float32")[2:] for _ in range(rounds)] for _ in offsets]
    components: list[RoPE | None] = [None] * threads_count
    failures: list[BaseException] = []
    start = threading.Barrier(threads_count)

    def work(index: int) -> None:
        try:
            start.wait()
            rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=scheme)
            components[index] = rope
            for (q, k, _, _), offset in zip(inputs[index], offsets[index], strict=True):
                rope.prefill(q, k, offset)
            torch.cuda.synchronize()
        except BaseException as error:  # reported below
            failures.append(error)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not failures, failures
    assert all(rope is not None and rope.table is components[0].table for rope in components)
    for index in range(threads_count):
        for (q, k, q64, k64), offset in zip(inputs[index], offsets[index], strict=True):
            positions = sequence_positions(2, 8, offset)
            assert_matches(q, rotate64(q64, positions, frequencies), q64, "float32", "q")
            assert_matches(k, rotate64(k64, positions, frequencies), k64, "float32", "k")
