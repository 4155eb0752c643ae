"""The in-place Q/K RoPE component (issue 4) against the float64 oracle, on the host path and
on a CUDA device.

Covers ``RoPE.forward / prefill / decode / backward`` (GQA, fused-QKV views, chunked
prefill, per-sequence positions, partial rotary_dim, both layouts), ``apply_rope`` under
torch autograd, the shared table registry (sharing, growth, threads, memory accounting),
the argument errors, and on the device: streams, deferred device-side position checks and
CUDA-graph replay. A case that runs in both places is one test parametrized over the place
(``_cases``); the "cuda" cases are marked ``gpu`` and skip without a device. Results are
compared element by element with ``_oracle.rope_reference`` under the SPEC 5 bound
(``_oracle.assert_matches_oracle``), on fresh random data (``rng`` is seeded per test id).

The device runs the production head size (128) and, where its twin did, longer sequences;
where the host and device versions of a test used different schemes or offsets, both
settings run in both places.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from _cases import (
    GPU,
    PLACES,
    SLEEP_CYCLES,
    clone,
    frameworks_and_dtypes,
    per_place,
    product,
    require,
    synchronize,
    to_place,
)
from _layouts import chunks_only, takes_packs, takes_shared
from _oracle import (
    DEVICE_DTYPES,
    MROPE_SECTIONS,
    Frequencies,
    assert_gradcheck,
    assert_matches_oracle,
    assert_matches_reference,
    assert_within,
    contract_tolerance,
    dtype_name,
    llama31_frequencies,
    longrope_frequencies,
    mrope_pair_positions,
    random_data,
    raw_bytes,
    rotate_reference,
    standard_frequencies,
    to_float64,
    working_precision_roundtrip_tolerance,
    yarn_frequencies,
)

from tileops_cupy import _rotate
from tileops_cupy import rope as rope_module
from tileops_cupy.rope import (
    RoPE,
    RoPEFwdOp,
    apply_rope,
    apply_rope_with_cos_sin_cache_inplace,
    table_cache_info,
)
from tileops_cupy.schemes import Llama31, LongRoPE, Standard, YaRN

HEAD_DIMS = {"cpu": 64, "cuda": 128}  # the device runs the production head size
HEAD_DIM, DEVICE_HEAD_DIM = HEAD_DIMS["cpu"], HEAD_DIMS["cuda"]
NUM_HEADS, NUM_KV_HEADS = 8, 2
LAYOUTS = ("neox", "interleaved")

# --------------------------------------------------------------------------- schemes


def _longrope_factors(d: int) -> list[float]:
    return list(np.linspace(1.0, 6.0, d // 2))


@dataclass(frozen=True)
class SchemeCase:
    """A library scheme for rotary_dim ``d`` and the oracle's frequencies for it."""

    name: str
    scheme: Callable[[int], object]
    frequencies: Callable[[int], Frequencies]

    def __repr__(self) -> str:
        return self.name


SCHEMES = {
    "standard": SchemeCase(
        "standard", lambda d: Standard(10000.0), lambda d: standard_frequencies(d, 10000.0)
    ),
    "yarn": SchemeCase(
        "yarn",
        lambda d: YaRN(10000.0, 8.0, 4096, 32.0, 1.0, 1.0),
        lambda d: yarn_frequencies(d, 10000.0, 8.0, 4096, 32.0, 1.0, 1.0),
    ),
    "llama31": SchemeCase(
        "llama31",
        lambda d: Llama31(500000.0, 8.0, 1.0, 4.0, 8192),
        lambda d: llama31_frequencies(d, 500000.0, 8.0, 1.0, 4.0, 8192),
    ),
    "longrope": SchemeCase(
        "longrope",
        lambda d: LongRoPE(10000.0, _longrope_factors(d), 131072, 4096),
        lambda d: longrope_frequencies(d, 10000.0, _longrope_factors(d), 131072, 4096),
    ),
}
STANDARD_AND_YARN = [SCHEMES["standard"], SCHEMES["yarn"]]

# --------------------------------------------------------------------------- helpers


def _qk(
    rng,
    place,
    batch,
    seq,
    dtype,
    *,
    framework=None,
    ranks=(3, 4),
    heads=NUM_HEADS,
    kv_heads=NUM_KV_HEADS,
):
    """Random q and k on ``place`` (rank 3: ``[B, T, heads*head_dim]``, rank 4:
    ``[B, T, heads, head_dim]``) and float64 copies of their data as ``[B, T, heads, D]``."""
    head_dim = HEAD_DIMS[place]

    def make(rank, h):
        shape = (batch, seq, h * head_dim) if rank == 3 else (batch, seq, h, head_dim)
        host = random_data(rng, shape, dtype)
        x64 = host.astype(np.float64).reshape(batch, seq, h, head_dim)
        return to_place(host, place, framework), x64

    (q, q64), (k, k64) = make(ranks[0], heads), make(ranks[1], kv_heads)
    return q, k, q64, k64


def token_positions(batch: int, seq: int, offsets) -> np.ndarray:
    """``[B, T]`` positions ``offsets[b] + t`` (offsets an int or one per sequence)."""
    offsets = np.broadcast_to(np.asarray(offsets, dtype=np.int64), (batch,))
    return offsets[:, None] + np.arange(seq, dtype=np.int64)[None, :]


def assert_rotated(y, x64, positions, frequencies, dtype, *, layout="neox", inverse=False, what=""):
    """``y`` (any framework, any shape holding ``x64``'s ``[B, T, heads, D]``) is ``x64``
    rotated at ``positions`` ``[B, T]``: every element within SPEC 5 of the float64 oracle,
    the columns past rotary_dim unchanged (``_oracle.assert_matches_oracle``)."""
    assert_matches_oracle(
        to_float64(y).reshape(x64.shape),
        x64,
        np.asarray(positions)[..., None],  # one position per token, for all its heads
        frequencies,
        dtype,
        neox=layout == "neox",
        inverse=inverse,
        what=what or "result",
    )


def assert_same(result, *expected) -> None:
    """The component returns the very objects it was given (rotated in place)."""
    assert len(result) == len(expected)
    for got, want in zip(result, expected, strict=True):
        assert got is want, f"returned {type(got).__name__} is not the argument"


def positions_in(values: np.ndarray, container: str):
    """Per-sequence positions as "numpy", "torch-cpu" or "torch-cuda" (a device tensor)."""
    if container == "numpy":
        return values.copy()
    if container == "torch-cuda":
        require("cuda", "torch")
        return torch.from_numpy(values.copy()).cuda()
    return torch.from_numpy(values.copy())


def _positions_tensor(values, dtype: str, device: str = "cuda"):
    return torch.tensor(np.asarray(values), dtype=getattr(torch, dtype), device=device)


_fresh_bases = itertools.count()


def fresh_standard() -> Standard:
    """A Standard scheme no other test uses: its shared table starts empty."""
    return Standard(20011.0 + next(_fresh_bases))


def table_entries(scheme, rotary_dim: int) -> list[dict]:
    return [
        entry
        for entry in table_cache_info()["entries"]
        if entry["scheme"] == scheme and entry["rotary_dim"] == rotary_dim
    ]


# --------------------------------------------------------------------------- forward / prefill

FORWARD_SEQ = {"cpu": 13, "cuda": 37}
FORWARD_CASES = frameworks_and_dtypes(
    frameworks={"cpu": ("numpy",), "cuda": ("torch", "cupy")},
    dtypes={"cpu": ("float32", "float16", "bfloat16", "float64"), "cuda": DEVICE_DTYPES},
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ranks", [(3, 3), (4, 4), (3, 4)], ids=["flat", "heads", "mixed"])
@pytest.mark.parametrize("case", list(SCHEMES.values()), ids=list(SCHEMES))
@pytest.mark.parametrize(("place", "framework", "dtype"), FORWARD_CASES)
def test_forward_and_prefill_match_oracle(rng, place, framework, dtype, case, ranks, layout):
    """GQA q/k of every rank: forward (positions from 0), then prefill far out (2**22+17)."""
    batch, seq, head_dim = 2, FORWARD_SEQ[place], HEAD_DIMS[place]
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(head_dim), rope_layout=layout)
    frequencies = case.frequencies(head_dim)
    for offset in (0, 2**22 + 17):
        q, k, q64, k64 = _qk(rng, place, batch, seq, dtype, framework=framework, ranks=ranks)
        result = rope.forward(q, k) if offset == 0 else rope.prefill(q, k, offset)
        assert_same(result, q, k)
        assert dtype_name(q) == dtype and dtype_name(k) == dtype
        synchronize(place)
        positions = token_positions(batch, seq, offset)
        assert_rotated(q, q64, positions, frequencies, dtype, layout=layout, what="q")
        assert_rotated(k, k64, positions, frequencies, dtype, layout=layout, what="k")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("place", PLACES)
def test_forward_without_k_and_call_is_forward(rng, place, dtype):
    head_dim = HEAD_DIMS[place]
    rope = RoPE(head_dim, 4)
    host = random_data(rng, (3, 9, 4, head_dim), dtype)
    q = to_place(host, place)

    q_out, k_out = rope.forward(q, None)
    assert q_out is q and k_out is None
    synchronize(place)
    frequencies = SCHEMES["standard"].frequencies(head_dim)
    assert_rotated(q, host.astype(np.float64), token_positions(3, 9, 0), frequencies, dtype)

    again_host = random_data(rng, (3, 9, 4 * head_dim), dtype)
    again, expected = to_place(again_host, place), to_place(again_host, place)
    rope.forward(expected, None)
    assert rope(again)[0] is again
    np.testing.assert_array_equal(raw_bytes(again), raw_bytes(expected))


@pytest.mark.parametrize("case", list(SCHEMES.values()), ids=list(SCHEMES))
@pytest.mark.parametrize("place", PLACES)
def test_schemes_gqa_32q_8kv_and_k_none(rng, place, case):
    head_dim = HEAD_DIMS[place]
    rope = RoPE(head_dim, 32, 8, scheme=case.scheme(head_dim))
    frequencies = case.frequencies(head_dim)
    q, k, q64, k64 = _qk(rng, place, 3, 19, "float32", heads=32, kv_heads=8)
    rope.prefill(q, k, 1000)
    synchronize(place)
    positions = token_positions(3, 19, 1000)
    assert_rotated(q, q64, positions, frequencies, "float32", what="q")
    assert_rotated(k, k64, positions, frequencies, "float32", what="k")

    q, _, q64, _ = _qk(rng, place, 3, 19, "float32", heads=32, kv_heads=8)
    assert_same(rope.forward(q, None), q, None)
    synchronize(place)
    assert_rotated(q, q64, token_positions(3, 19, 0), frequencies, "float32", what="q")


@pytest.mark.parametrize("case", STANDARD_AND_YARN, ids=["standard", "yarn"])
@pytest.mark.parametrize("offset", [1000, 2**20 + 3, 2**24 - 5])
@pytest.mark.parametrize("place", PLACES)
def test_prefill_at_high_offsets_fp32(rng, place, offset, case):
    """The accuracy contract holds at every position below 2**24."""
    batch, seq, head_dim = 2, 5, HEAD_DIMS[place]
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(head_dim))
    q, k, q64, k64 = _qk(rng, place, batch, seq, "float32")
    frequencies = case.frequencies(head_dim)

    assert_same(rope.prefill(q, k, offset), q, k)
    synchronize(place)
    positions = token_positions(batch, seq, offset)
    assert_rotated(q, q64, positions, frequencies, "float32", what="q")
    assert_rotated(k, k64, positions, frequencies, "float32", what="k")


# --------------------------------------------------------------------------- fused QKV

FUSED_SEQ = {"cpu": 7, "cuda": 21}
FUSED_CASES = frameworks_and_dtypes(
    dtypes={"cpu": ("float32", "bfloat16", "float16"), "cuda": DEVICE_DTYPES}
)


@pytest.mark.parametrize("view_rank", [3, 4])
@pytest.mark.parametrize(("scheme", "offset"), [("yarn", 40), ("llama31", 500)])
@pytest.mark.parametrize(("place", "framework", "dtype"), FUSED_CASES)
def test_fused_qkv_views_rotate_in_place(rng, place, framework, dtype, scheme, offset, view_rank):
    batch, seq, hq, hkv = 2, FUSED_SEQ[place], NUM_HEADS, NUM_KV_HEADS
    head_dim, heads = HEAD_DIMS[place], hq + 2 * hkv
    host = random_data(rng, (batch, seq, heads * head_dim), dtype)
    qkv = to_place(host, place, framework)
    if view_rank == 3:
        q = qkv[..., : hq * head_dim]
        k = qkv[..., hq * head_dim : (hq + hkv) * head_dim]
    else:
        split = qkv.reshape(batch, seq, heads, head_dim)
        q, k = split[:, :, :hq], split[:, :, hq : hq + hkv]
    case = SCHEMES[scheme]
    rope = RoPE(head_dim, hq, hkv, scheme=case.scheme(head_dim))

    assert_same(rope.prefill(q, k, offset), q, k)
    synchronize(place)

    v_bytes = raw_bytes(qkv).reshape(batch, seq, heads, -1)[:, :, hq + hkv :]
    v_before = raw_bytes(host).reshape(batch, seq, heads, -1)[:, :, hq + hkv :]
    assert np.array_equal(v_bytes, v_before), "v changed"
    before = host.astype(np.float64).reshape(batch, seq, heads, head_dim)
    after = to_float64(qkv).reshape(batch, seq, heads, head_dim)
    positions = token_positions(batch, seq, offset)
    frequencies = case.frequencies(head_dim)
    q64, k64 = before[:, :, :hq], before[:, :, hq : hq + hkv]
    assert_rotated(after[:, :, :hq], q64, positions, frequencies, dtype, what="q")
    assert_rotated(after[:, :, hq : hq + hkv], k64, positions, frequencies, dtype, what="k")


@GPU
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_unaligned_views_are_right_or_refused(rng, dtype, layout):
    """Views that start one element into the buffer defeat 16-byte accesses: the result must
    still be right, or a ValueError that leaves the data alone (never a silent misread)."""
    batch, seq, head_dim = 2, 5, DEVICE_HEAD_DIM
    width = 1 + (NUM_HEADS + NUM_KV_HEADS) * head_dim
    host = random_data(rng, (batch, seq, width), dtype)
    buffer = to_place(host, "cuda", "torch")
    before = host.astype(np.float64)
    q = buffer[..., 1 : 1 + NUM_HEADS * head_dim]
    k = buffer[..., 1 + NUM_HEADS * head_dim :]
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, rope_layout=layout)
    try:
        rope.prefill(q, k, 3)
    except ValueError:
        synchronize("cuda")
        assert np.array_equal(raw_bytes(buffer), raw_bytes(host))
        return
    synchronize("cuda")
    after = to_float64(buffer)
    assert np.array_equal(after[..., 0], before[..., 0])
    positions = token_positions(batch, seq, 3)
    frequencies = SCHEMES["standard"].frequencies(head_dim)
    rows = before[..., 1:].reshape(batch, seq, NUM_HEADS + NUM_KV_HEADS, head_dim)
    assert_rotated(after[..., 1:], rows, positions, frequencies, dtype, layout=layout)


# --------------------------------------------------------------------------- partial rotary

# (scheme, position_offset, (q rank, k rank), seq): both twins' settings, in both places
PARTIAL_SETTINGS = {
    "longrope-300": ("longrope", 300, (4, 4), 9),
    "yarn-70000": ("yarn", 70_000, (3, 4), 11),
}
PARTIAL_ROTARY_DIMS = {"cpu": (32, 24, 2), "cuda": (64, 96, 32)}  # of head_dim 64 and 128


def _tail_bytes(x, heads: int, head_dim: int, rotary_dim: int) -> np.ndarray:
    return raw_bytes(x).reshape(*x.shape[:2], heads, head_dim, -1)[..., rotary_dim:, :]


def _partial_rope(case, head_dim: int, rotary_dim: int, layout: str) -> RoPE:
    """The component of ``case``'s scheme rotating the first rotary_dim columns of a head."""
    return RoPE(
        head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(rotary_dim), rotary_dim=rotary_dim,
        rope_layout=layout,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("setting", PARTIAL_SETTINGS)
@pytest.mark.parametrize(("place", "rotary_dim"), per_place(PARTIAL_ROTARY_DIMS))
def test_partial_rotary_dim_leaves_the_tail(rng, place, rotary_dim, setting, layout, dtype):
    scheme, offset, ranks, seq = PARTIAL_SETTINGS[setting]
    head_dim, case = HEAD_DIMS[place], SCHEMES[scheme]
    rope = _partial_rope(case, head_dim, rotary_dim, layout)
    q, k, q64, k64 = _qk(rng, place, 2, seq, dtype, ranks=ranks)
    q_tail = _tail_bytes(q, NUM_HEADS, head_dim, rotary_dim)
    k_tail = _tail_bytes(k, NUM_KV_HEADS, head_dim, rotary_dim)

    rope.prefill(q, k, offset)
    synchronize(place)

    assert np.array_equal(_tail_bytes(q, NUM_HEADS, head_dim, rotary_dim), q_tail)
    assert np.array_equal(_tail_bytes(k, NUM_KV_HEADS, head_dim, rotary_dim), k_tail)
    positions = token_positions(2, seq, offset)
    frequencies = case.frequencies(rotary_dim)  # d is the rotary dim (SPEC 1)
    assert_rotated(q, q64, positions, frequencies, dtype, layout=layout, what="q")
    assert_rotated(k, k64, positions, frequencies, dtype, layout=layout, what="k")


# --------------------------------------------------------------------------- chunked prefill

CHUNKS = {
    "29-tokens": ((0, 5), (5, 12), (12, 13), (13, 29)),
    "300-tokens": ((0, 100), (100, 101), (101, 257), (257, 300)),
}


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", STANDARD_AND_YARN, ids=["standard", "yarn"])
@pytest.mark.parametrize("place", PLACES)
def test_chunked_prefill_equals_full_forward(rng, place, case, dtype, layout, chunks):
    batch, seq, head_dim = 2, CHUNKS[chunks][-1][1], HEAD_DIMS[place]
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(head_dim), rope_layout=layout)
    q, k, q64, k64 = _qk(rng, place, batch, seq, dtype)
    q_full, k_full = clone(q), clone(k)
    rope.forward(q_full, k_full)

    for start, stop in CHUNKS[chunks]:
        q_chunk, k_chunk = q[:, start:stop], k[:, start:stop]
        assert_same(rope.prefill(q_chunk, k_chunk, start), q_chunk, k_chunk)
    synchronize(place)

    assert np.array_equal(raw_bytes(q), raw_bytes(q_full))
    assert np.array_equal(raw_bytes(k), raw_bytes(k_full))
    positions = token_positions(batch, seq, 0)
    frequencies = case.frequencies(head_dim)
    assert_rotated(q, q64, positions, frequencies, dtype, layout=layout, what="q")
    assert_rotated(k, k64, positions, frequencies, dtype, layout=layout, what="k")


def _layout_against_chunks(
    monkeypatch, host: np.ndarray, rotate, threshold: str, takes: Callable, taken: bool = True
) -> torch.Tensor:
    """``rotate(qkv)`` (q and k in place in a CUDA copy of ``host``) twice: with the
    ``_rotate`` head-row ``threshold`` of a layout out of reach (the chunk layout), then
    lowered to 0 so that the layout takes the call (``taken``; else that the chunk layout
    keeps it); asserts, by ``takes(plan)``, that each took its layout and that both wrote the
    same bits (the other layouts' bounds out of reach). Returns the second copy."""
    results, plans = {}, {}
    chunks_only(monkeypatch)
    for lowered in (False, True):
        monkeypatch.setattr(_rotate, threshold, 0 if lowered else 1 << 62)
        _rotate._plans.clear()
        # (the cos_sin_cache calls' component is kept per configuration and per call shape,
        # with its launches)
        rope_module._component.cache_clear()
        rope_module._CACHE_COMPONENTS.clear()
        qkv = to_place(host, "cuda", "torch")
        rotate(qkv)
        torch.cuda.synchronize()
        (plans[lowered],) = _rotate._plans.values()
        results[lowered] = qkv
    assert takes(plans[True]) == taken, plans
    assert not takes(plans[False]), plans
    assert torch.equal(results[True], results[False])
    return results[True]


def _whole_rows_against_chunks(
    monkeypatch, host: np.ndarray, rotate, packs: bool = True
) -> torch.Tensor:
    """:func:`_layout_against_chunks` of rope_rotate_packs (``_PACK_MIN_HEAD_ROWS``)."""
    return _layout_against_chunks(
        monkeypatch, host, rotate, "_PACK_MIN_HEAD_ROWS", takes_packs, packs
    )


@GPU
@pytest.mark.parametrize("by", ["offsets", "positions"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(
    ("head_dim", "batch", "offsets"), [(128, 1, 7), (64, 2, "per sequence")], ids=["D128", "D64"]
)
@pytest.mark.parametrize(("hq", "hkv"), [(8, 4), (6, 2)], ids=["8q4kv", "6q2kv"])
def test_mid_sized_prefill_rotates_whole_rows(
    rng, monkeypatch, head_dim, batch, offsets, dtype, layout, by, hq, hkv
):
    """Mid-sized calls of q and k take rope_rotate_packs (an interleaved lane 16 bytes of
    four rows of one operand, a neox lane 16 bytes of each half of two rows, a token's row
    groups q's then k's: 6 q and 2 k heads take it in neox alone;
    ``_rotate._PACK_MIN_HEAD_ROWS`` lowered here to this call's rows; at 8 q and 4 k heads
    the last warp is partial), at a prefill's offsets or at per-token positions (``forward``, a
    device ``[B, T]`` tensor of random positions): q and k in place in a fused QKV row, every
    element against the oracle, v untouched, and the same bits as rope_rotate."""
    require("cuda", "torch")
    seq = 1031
    heads = hq + 2 * hkv
    host = random_data(rng, (batch, seq, heads * head_dim), dtype)
    if offsets == "per sequence":
        offsets = np.array([0, 3000])
    positions = token_positions(batch, seq, offsets)
    if by == "positions":
        positions = rng.integers(0, 1 << 16, (batch, seq))

    def rotate(qkv):
        split = qkv.view(batch, seq, heads, head_dim)
        q, k = split[:, :, :hq], split[:, :, hq : hq + hkv]
        rope = RoPE(head_dim, hq, hkv, rope_layout=layout, max_position=1 << 16)
        if by == "positions":
            device_positions = torch.from_numpy(positions).cuda()
            assert_same(rope.forward(q, k, positions=device_positions), q, k)
        else:
            assert_same(rope.prefill(q, k, offsets), q, k)

    packs = layout == "neox" or hq % 4 == hkv % 4 == 0
    packed = _whole_rows_against_chunks(monkeypatch, host, rotate, packs)
    before = host.astype(np.float64).reshape(batch, seq, heads, head_dim)
    after = to_float64(packed).reshape(batch, seq, heads, head_dim)
    v_after, v_before = (
        raw_bytes(x).reshape(batch, seq, heads, -1)[:, :, hq + hkv :] for x in (packed, host)
    )
    assert np.array_equal(v_after, v_before), "v changed"
    frequencies = standard_frequencies(head_dim)
    for name, heads_of in (("q", slice(0, hq)), ("k", slice(hq, hq + hkv))):
        assert_rotated(
            after[:, :, heads_of], before[:, :, heads_of], positions, frequencies, dtype,
            layout=layout, what=name,
        )  # fmt: skip


@GPU
@pytest.mark.parametrize("table", ["mrope", "mrope-split", "mrope-interleaved", "cos_sin_cache"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("head_dim", [128, 64], ids=["D128", "D64"])
def test_mid_sized_table_modes_rotate_whole_rows(rng, monkeypatch, head_dim, dtype, layout, table):
    """The cos_sin_cache drop-in, MRoPE whose sections fall on lane boundaries and interleaved
    MRoPE whose pairs group (the grouped tables: D128's (24, 20, 20), not D64's (12, 10, 10))
    take rope_rotate_packs at mid sizes as the plain per-token
    positions do (``_PACK_MIN_HEAD_ROWS`` lowered to this call's rows, an odd token count);
    MRoPE sections that split a lane's pairs, and interleaved ones that do not group, keep
    rope_rotate. q and k in place in a fused QKV row, every element against the float64
    oracle, v untouched, and the same bits in both layouts."""
    require("cuda", "torch")
    tokens, hq, hkv = 1031, 8, 4
    heads, pairs = hq + 2 * hkv, head_dim // 2
    neox = layout == "neox"
    host = random_data(rng, (tokens, heads * head_dim), dtype)
    if table == "cos_sin_cache":
        cache = rng.uniform(-1.5, 1.5, (300, head_dim)).astype(np.float32)
        ids = rng.integers(0, 300, tokens)
    else:
        section = MROPE_SECTIONS[pairs][table]
        ids = rng.integers(0, 1 << 16, (3, tokens))

    def rotate(qkv):
        q, k = qkv[:, : hq * head_dim], qkv[:, hq * head_dim : (hq + hkv) * head_dim]
        positions = torch.from_numpy(ids).cuda()
        if table == "cos_sin_cache":
            device_cache = torch.from_numpy(cache).cuda()
            apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, device_cache, neox)
        else:
            rope = RoPE(
                head_dim, hq, hkv, rope_layout=layout, max_position=1 << 16,
                mrope_section=section, mrope_interleaved=table == "mrope-interleaved",
            )  # fmt: skip
            assert_same(rope.forward(q, k, positions=positions), q, k)

    packs = table == "cos_sin_cache"
    if not packs:
        interleaved = table == "mrope-interleaved"
        planned = _rotate._packs_table(dtype, _rotate.MROPE, head_dim, section, interleaved)
        packs = table == "mrope" or (interleaved and head_dim == 128)
        assert (planned is not None) == packs, (table, dtype, head_dim, planned)
    packed = _whole_rows_against_chunks(monkeypatch, host, rotate, packs)
    before = host.astype(np.float64).reshape(1, tokens, heads, head_dim)
    after = to_float64(packed).reshape(1, tokens, heads, head_dim)
    v_after, v_before = (
        raw_bytes(x).reshape(tokens, heads, -1)[:, hq + hkv :] for x in (packed, host)
    )
    assert np.array_equal(v_after, v_before), "v changed"
    for name, heads_of in (("q", slice(0, hq)), ("k", slice(hq, hq + hkv))):
        x64, y = before[:, :, heads_of], after[:, :, heads_of]
        what = f"{table} {dtype} {layout} D{head_dim} {name}"
        if table == "cos_sin_cache":
            row = cache[ids][None, :, None, :].astype(np.float64)
            y64 = rotate_reference(x64, row[..., :pairs], row[..., pairs:], neox=neox)
            assert_matches_reference(y, y64, x64, head_dim, dtype, what=what)
        else:
            interleaved = table == "mrope-interleaved"
            per_pair = mrope_pair_positions(ids[:, None, :], section, interleaved)
            assert_matches_oracle(
                y, x64, per_pair[..., None, :], standard_frequencies(head_dim), dtype,
                neox=neox, per_pair=True, what=what,
            )  # fmt: skip


@GPU
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(("head_dim", "hq", "hkv"), [(128, 32, 8), (64, 6, 2)], ids=["D128", "D64"])
def test_shared_table_layout_rotates_like_the_chunks(
    rng, monkeypatch, head_dim, hq, hkv, dtype, layout
):
    """Large prefills take rope_rotate_shared (a chunk of one row a thread, a block's token's
    cos/sin formed once into shared memory; ``_rotate._SHARED_MIN_HEAD_ROWS`` lowered here to
    this call's rows): per-sequence offsets, q and k in place in a fused QKV row (32q/8kv: a
    token's 40 rows spread evenly over its blocks; 6q/2kv D64 at the fewest rows a token it
    takes), every element against the float64 oracle, v untouched, and the same bits as
    rope_rotate."""
    require("cuda", "torch")
    batch, seq = 2, 131
    heads = hq + 2 * hkv
    host = random_data(rng, (batch, seq, heads * head_dim), dtype)
    offsets = np.array([5, 3000])

    def rotate(qkv):
        split = qkv.view(batch, seq, heads, head_dim)
        q, k = split[:, :, :hq], split[:, :, hq : hq + hkv]
        rope = RoPE(head_dim, hq, hkv, rope_layout=layout, max_position=1 << 16)
        assert_same(rope.prefill(q, k, offsets), q, k)

    shared = _layout_against_chunks(
        monkeypatch,
        host,
        rotate,
        "_SHARED_MIN_HEAD_ROWS",
        takes_shared(dtype, head_dim, neox=layout == "neox"),
    )
    before = host.astype(np.float64).reshape(batch, seq, heads, head_dim)
    after = to_float64(shared).reshape(batch, seq, heads, head_dim)
    v_after, v_before = (
        raw_bytes(x).reshape(batch, seq, heads, -1)[:, :, hq + hkv :] for x in (shared, host)
    )
    assert np.array_equal(v_after, v_before), "v changed"
    for name, heads_of in (("q", slice(0, hq)), ("k", slice(hq, hq + hkv))):
        x64, y = before[:, :, heads_of], after[:, :, heads_of]
        assert_rotated(
            y, x64, token_positions(batch, seq, offsets), standard_frequencies(head_dim), dtype,
            layout=layout, what=f"{dtype} {layout} D{head_dim} {name}",
        )  # fmt: skip


# (scheme, per-sequence offsets, max_position, seq): both twins' settings, in both places
OFFSET_SETTINGS = {
    "yarn": ("yarn", (0, 17, 5000, 2**20), None, 6),
    "longrope": ("longrope", (0, 33, 4090, 2**21 - 9), 2**21, 9),
}
# device tensors cannot be checked before the launch: they need max_position
OFFSET_CASES = per_place(
    {
        "cpu": product(("numpy", "torch-cpu"), OFFSET_SETTINGS),
        "cuda": [
            (container, setting)
            for container, setting in product(("numpy", "torch-cpu", "torch-cuda"), OFFSET_SETTINGS)
            if not (container == "torch-cuda" and OFFSET_SETTINGS[setting][2] is None)
        ],
    }
)


@pytest.mark.parametrize("offsets_dtype", ["int32", "int64"])
@pytest.mark.parametrize(("place", "container", "setting"), OFFSET_CASES)
def test_prefill_with_per_sequence_offsets(rng, place, container, setting, offsets_dtype):
    """Sequences at different lengths prefill their next chunk in one call."""
    scheme, offsets, max_position, seq = OFFSET_SETTINGS[setting]
    head_dim, case = HEAD_DIMS[place], SCHEMES[scheme]
    rope = RoPE(
        head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(head_dim), max_position=max_position
    )
    values = np.array(offsets, dtype=offsets_dtype)
    q, k, q64, k64 = _qk(rng, place, len(values), seq, "float32")

    rope.prefill(q, k, positions_in(values, container))
    synchronize(place)
    rope.check()

    positions = token_positions(len(values), seq, values)
    frequencies = case.frequencies(head_dim)
    assert_rotated(q, q64, positions, frequencies, "float32", what="q")
    assert_rotated(k, k64, positions, frequencies, "float32", what="k")


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("position", [0, 4097, 2**24 - 1])
@pytest.mark.parametrize("place", PLACES)
def test_decode_at_int_position(rng, place, position, dtype):
    batch, head_dim = 3, HEAD_DIMS[place]
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS)
    q, k, q64, k64 = _qk(rng, place, batch, 1, dtype)
    positions = np.full((batch, 1), position)
    frequencies = SCHEMES["standard"].frequencies(head_dim)

    assert_same(rope.decode(q, k, position), q, k)
    synchronize(place)

    assert_rotated(q, q64, positions, frequencies, dtype, what="q")
    assert_rotated(k, k64, positions, frequencies, dtype, what="k")


# (scheme, max_position, heads, kv_heads, (q rank, k rank)); "boundaries" decodes 6 sequences
# at fixed positions around the table's 1024-row blocks, "random" 64 at random positions
DECODE_SETTINGS = {
    "boundaries-unbounded": ("llama31", None, 8, 2, (4, 3)),
    "boundaries-bounded": ("llama31", 2**21, 8, 2, (4, 3)),
    "random": ("yarn", 2**20, 32, 8, (3, 4)),
}
DECODE_KINDS = {
    "cpu": ("int", "numpy-int32", "numpy-int64", "torch-cpu-int32", "torch-cpu-int64"),
    "cuda": (
        "int",
        "numpy-int32",
        "numpy-int64",
        "torch-cpu-int32",
        "torch-cpu-int64",
        "torch-cuda-int32",
        "torch-cuda-int64",
    ),
}
DECODE_CASES = per_place(
    {
        place: [
            (kind, setting)
            for kind, setting in product(kinds, DECODE_SETTINGS)
            # device positions need max_position (a test of its own below)
            if not (kind.startswith("torch-cuda") and DECODE_SETTINGS[setting][1] is None)
        ]
        for place, kinds in DECODE_KINDS.items()
    }
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("place", "kind", "setting"), DECODE_CASES)
def test_decode_per_sequence(rng, place, kind, setting, dtype):
    scheme, max_position, heads, kv_heads, ranks = DECODE_SETTINGS[setting]
    head_dim, case = HEAD_DIMS[place], SCHEMES[scheme]
    rope = RoPE(head_dim, heads, kv_heads, scheme=case.scheme(head_dim), max_position=max_position)
    if setting.startswith("boundaries"):
        values = np.array([0, 1, 1023, 1024, 65537, 2**21 - 1])
    else:
        values = rng.integers(0, max_position, 64)
        values[:4] = [0, 1, 1024, max_position - 1]
    if kind == "int":
        values[:] = 654_321
        position = 654_321
    else:
        container, positions_dtype = kind.rsplit("-", 1)
        position = positions_in(values.astype(positions_dtype), container)
    q, k, q64, k64 = _qk(rng, place, len(values), 1, dtype, ranks=ranks, heads=heads,
                         kv_heads=kv_heads)  # fmt: skip

    assert_same(rope.decode(q, k, position), q, k)
    synchronize(place)
    rope.check()

    positions = values.astype(np.int64)[:, None]
    frequencies = case.frequencies(head_dim)
    assert_rotated(q, q64, positions, frequencies, dtype, what="q")
    assert_rotated(k, k64, positions, frequencies, dtype, what="k")


@pytest.mark.parametrize("place", PLACES)
def test_serving_loop_prefill_chunks_then_decode(rng, place):
    """Prefill in chunks, then decode token by token: every row as at its absolute position."""
    batch, prompt, steps, head_dim = 2, 10, 4, HEAD_DIMS[place]
    case = SCHEMES["yarn"]
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(head_dim))
    q, k, q64, k64 = _qk(rng, place, batch, prompt + steps, "float32")
    rope.prefill(q[:, :6], k[:, :6], 0)
    rope.prefill(q[:, 6:prompt], k[:, 6:prompt], 6)
    for step in range(steps):
        t = prompt + step
        rope.decode(q[:, t : t + 1], k[:, t : t + 1], t)
    synchronize(place)
    positions = token_positions(batch, prompt + steps, 0)
    frequencies = case.frequencies(head_dim)
    assert_rotated(q, q64, positions, frequencies, "float32", what="q")
    assert_rotated(k, k64, positions, frequencies, "float32", what="k")


def _zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _zeros((2, 5, 512))[:, :0], id="sliced-T0"),
        pytest.param(lambda: _zeros((3, 5, 512))[:0], id="sliced-B0"),
        # freshly allocated empty arrays have all-zero strides (numpy; torch CPU tensors
        # reach the host path through .numpy()): not a non-contiguous last dimension
        pytest.param(lambda: _zeros((2, 0, 512)), id="fresh-T0"),
        pytest.param(lambda: _zeros((0, 4, 8, 64)), id="fresh-B0"),
        pytest.param(lambda: torch.zeros(2, 0, 512), id="torch-T0"),
    ],
)
def test_empty_chunk_is_a_no_op(make):
    """An empty chunk (a sequence with nothing left to prefill) rotates nothing."""
    q = make()
    rope = RoPE(HEAD_DIM, NUM_HEADS)
    assert rope.prefill(q, None, 5)[0] is q
    assert rope.backward(q, None, 5)[0] is q


# --------------------------------------------------------------------------- backward

# position offsets: ints, per-sequence host values, and per-sequence device values (which need
# max_position); (values, container, max_position)
BACKWARD_OFFSETS = {
    "0": (0, "int", None),
    "777": (777, "int", None),
    "1234": (1234, "int", None),
    "5000": (5000, "int", None),
    "per-sequence": ((3, 900, 70000), "numpy", None),
    "device": ((7, 300, 60_000), "torch-cuda", 2**16),
}
BACKWARD_SEQ = {"cpu": 8, "cuda": 16}


def _backward_offset(name: str):
    """(values for the oracle, the argument to pass, max_position)."""
    values, container, max_position = BACKWARD_OFFSETS[name]
    if container == "int":
        return values, values, max_position
    values = np.array(values)
    return values, positions_in(values, container), max_position


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", [SCHEMES["yarn"], SCHEMES["longrope"]], ids=["yarn", "longrope"])
@pytest.mark.parametrize(
    ("place", "offset"),
    per_place(
        {
            "cpu": ("0", "777", "5000", "per-sequence"),
            "cuda": ("0", "777", "5000", "per-sequence", "device"),
        }
    ),
)
def test_backward_matches_transpose_oracle(rng, place, offset, case, layout):
    batch, seq, head_dim = 3, BACKWARD_SEQ[place], HEAD_DIMS[place]
    values, position, max_position = _backward_offset(offset)
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(head_dim),
                rope_layout=layout, max_position=max_position)  # fmt: skip
    grad_q, grad_k, gq64, gk64 = _qk(rng, place, batch, seq, "float32")

    assert_same(rope.backward(grad_q, grad_k, position), grad_q, grad_k)
    synchronize(place)
    rope.check()

    positions = token_positions(batch, seq, values)
    frequencies = case.frequencies(head_dim)
    assert_rotated(grad_q, gq64, positions, frequencies, "float32", layout=layout, inverse=True,
                   what="grad_q")  # fmt: skip
    assert_rotated(grad_k, gk64, positions, frequencies, "float32", layout=layout, inverse=True,
                   what="grad_k")  # fmt: skip


ROUNDTRIP_SIZES = {"cpu": (2, 11), "cuda": (3, 16)}  # batch, seq: 3 device offsets
ROUNDTRIP_CASES = per_place(
    {
        "cpu": product(("float32", "float64"), ("0", "1234", "5000")),
        "cuda": product(("float32",), ("0", "1234", "5000", "device")),
    }
)


@pytest.mark.parametrize("case", list(SCHEMES.values()), ids=list(SCHEMES))
@pytest.mark.parametrize(("place", "dtype", "offset"), ROUNDTRIP_CASES)
def test_backward_of_forward_is_amplitude_squared(rng, place, dtype, offset, case):
    (batch, seq), head_dim = ROUNDTRIP_SIZES[place], HEAD_DIMS[place]
    values, position, max_position = _backward_offset(offset)
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(head_dim),
                max_position=max_position)  # fmt: skip
    amplitude = case.frequencies(head_dim).amplitude
    q, k, q64, k64 = _qk(rng, place, batch, seq, dtype)

    rope.prefill(q, k, position)
    assert_same(rope.backward(q, k, position), q, k)
    synchronize(place)
    rope.check()

    if case.name in ("yarn", "longrope"):
        assert amplitude > 1.05  # the case must exercise a != 1
    for name, x, x64 in (("q", q, q64), ("k", k, k64)):
        tolerance = working_precision_roundtrip_tolerance(x64, dtype, amplitude)
        got = to_float64(x).reshape(x64.shape)
        assert_within(got, amplitude**2 * x64, np.full(x64.shape, tolerance),
                      f"Bwd(Fwd({name})) vs a*a*{name} ({dtype}, {place})")  # fmt: skip


@pytest.mark.parametrize("place", PLACES)
def test_backward_default_offset_is_zero(rng, place):
    head_dim = HEAD_DIMS[place]
    rope = RoPE(head_dim, 2)
    host = random_data(rng, (1, 5, 2 * head_dim), "float32")
    grad, expected = to_place(host, place), to_place(host, place)
    rope.backward(expected, None, 0)
    assert rope.backward(grad, None)[0] is grad
    np.testing.assert_array_equal(raw_bytes(grad), raw_bytes(expected))


# --------------------------------------------------------------------------- apply_rope


def _float64_leaf(rng, shape):
    return torch.from_numpy(random_data(rng, shape, "float64")).requires_grad_(True)


@pytest.mark.parametrize("position_offset", [0, 5, "tensor"])
@pytest.mark.parametrize("case", STANDARD_AND_YARN, ids=["standard", "yarn"])
def test_apply_rope_gradcheck(rng, case, position_offset):
    """Host only: gradcheck needs float64, which the device does not take."""
    head_dim = 8
    rope = RoPE(head_dim, 4, 2, scheme=case.scheme(head_dim))
    q = _float64_leaf(rng, (2, 3, 4 * head_dim))
    k = _float64_leaf(rng, (2, 3, 2, head_dim))
    offset = torch.tensor([7, 2000]) if position_offset == "tensor" else position_offset

    assert_gradcheck(lambda a, b: apply_rope(a, b, rope, offset), (q, k))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_apply_rope_is_out_of_place_and_equals_in_place(rng, dtype):
    case = SCHEMES["yarn"]
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(HEAD_DIM))
    q_host, k_host, _, _ = _qk(rng, "cpu", 2, 6, dtype)
    q = torch.from_numpy(q_host.copy()).requires_grad_(True)
    k = torch.from_numpy(k_host.copy()).requires_grad_(True)

    q_rot, k_rot = apply_rope(q, k, rope, 321)

    assert isinstance(q_rot, torch.Tensor) and q_rot is not q and k_rot is not k
    assert q_rot.shape == q.shape and k_rot.shape == k.shape and q_rot.dtype == q.dtype
    assert np.array_equal(q.detach().numpy(), q_host), "apply_rope modified q"
    assert np.array_equal(k.detach().numpy(), k_host), "apply_rope modified k"
    q_in_place, k_in_place = rope.prefill(q_host.copy(), k_host.copy(), 321)
    assert np.array_equal(q_rot.detach().numpy(), q_in_place)
    assert np.array_equal(k_rot.detach().numpy(), k_in_place)

    # the gradient is the transpose rotation of the upstream gradient
    grad_q, grad_k, _, _ = _qk(rng, "cpu", 2, 6, dtype)
    torch.autograd.backward((q_rot, k_rot), (torch.from_numpy(grad_q), torch.from_numpy(grad_k)))
    expected_q, expected_k = rope.backward(grad_q.copy(), grad_k.copy(), 321)
    assert np.array_equal(q.grad.numpy(), expected_q)
    assert np.array_equal(k.grad.numpy(), expected_k)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_apply_rope_partial_rotary_gradcheck_and_tail(rng, layout):
    """Out of place, columns past rotary_dim are copied, and their gradient passes through."""
    rope = RoPE(8, 2, 1, rotary_dim=4, rope_layout=layout, scheme=SCHEMES["yarn"].scheme(4))
    q = _float64_leaf(rng, (1, 3, 2, 8))
    k = _float64_leaf(rng, (1, 3, 8))

    assert_gradcheck(lambda a, b: apply_rope(a, b, rope, 9), (q, k))
    q_rot, k_rot = apply_rope(q, k, rope, 9)
    assert torch.equal(q_rot[..., 4:], q[..., 4:])
    frequencies = SCHEMES["yarn"].frequencies(4)
    q64 = q.detach().numpy()
    assert_rotated(q_rot, q64, token_positions(1, 3, 9), frequencies, "float64", layout=layout)


def test_apply_rope_without_k_and_on_fused_views(rng):
    rope = RoPE(HEAD_DIM, 2, 1)
    qkv = _float64_leaf(rng, (1, 4, 4 * HEAD_DIM))
    before = qkv.detach().clone()
    q, k = qkv[..., : 2 * HEAD_DIM], qkv[..., 2 * HEAD_DIM : 3 * HEAD_DIM]

    q_rot, none = apply_rope(q, None, rope, 2)
    assert none is None
    q_rot2, k_rot = apply_rope(q, k, rope, 2)
    assert torch.equal(q_rot, q_rot2)
    assert torch.equal(qkv.detach(), before)
    (q_rot.sum() + k_rot.sum()).backward()
    assert torch.equal(qkv.grad[..., 3 * HEAD_DIM :], torch.zeros_like(qkv.grad[..., :HEAD_DIM]))
    q64 = before.numpy()[..., : 2 * HEAD_DIM].reshape(1, 4, 2, HEAD_DIM)
    frequencies = SCHEMES["standard"].frequencies(HEAD_DIM)
    assert_rotated(q_rot, q64, token_positions(1, 4, 2), frequencies, "float64")


@pytest.mark.parametrize("with_k", [False, True])
@pytest.mark.parametrize("place", PLACES)
def test_apply_rope_on_a_strided_last_dimension(rng, place, with_k):
    """Out of place, q and k whose last dimension is strided are read through a copy made
    once, and rotated as the oracle says; the inputs stay as they were."""
    head_dim = HEAD_DIMS[place]
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS)
    frequencies = SCHEMES["standard"].frequencies(head_dim)
    wide = {
        name: random_data(rng, (2, 5, 2 * heads * head_dim), "float32")
        for name, heads in (("q", NUM_HEADS), ("k", NUM_KV_HEADS))
    }
    q, k = (to_place(wide[name], place, "torch")[..., ::2] for name in ("q", "k"))

    q_rot, k_rot = apply_rope(q, k if with_k else None, rope, 30)
    synchronize(place)
    rope.check()

    positions = token_positions(2, 5, 30)
    for name, heads, got in (("q", NUM_HEADS, q_rot), ("k", NUM_KV_HEADS, k_rot)):
        x64 = wide[name][..., ::2].astype(np.float64).reshape(2, 5, heads, head_dim)
        if got is not None:
            assert_rotated(got, x64, positions, frequencies, "float32", what=name)
    assert (k_rot is not None) == with_k
    for name, tensor in (("q", q), ("k", k)):
        assert np.array_equal(raw_bytes(tensor), raw_bytes(wide[name][..., ::2])), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("rotary_fraction", "layout"), [(0.75, "neox"), (0.5, "interleaved")])
@pytest.mark.parametrize("place", PLACES)
def test_apply_rope_partial_rotary_copies_the_tail(rng, place, rotary_fraction, layout, dtype):
    """Out of place on fused-QKV views, the columns past rotary_dim are copied (the in-place
    calls skip them), and the gradient reaches q and k only."""
    head_dim = HEAD_DIMS[place]
    rotary_dim = int(rotary_fraction * head_dim)
    case = SCHEMES["yarn"]
    rope = _partial_rope(case, head_dim, rotary_dim, layout)
    frequencies = case.frequencies(rotary_dim)
    heads = NUM_HEADS + 2 * NUM_KV_HEADS
    host = random_data(rng, (2, 6, heads * head_dim), dtype)
    qkv = to_place(host, place, "torch").requires_grad_(True)
    q = qkv[..., : NUM_HEADS * head_dim]
    k = qkv[..., NUM_HEADS * head_dim : (NUM_HEADS + NUM_KV_HEADS) * head_dim]
    before = host.astype(np.float64).reshape(2, 6, heads, head_dim)

    q_rot, k_rot = apply_rope(q, k, rope, 40)
    grad_host = random_data(rng, tuple(q_rot.shape), dtype)
    grad_q = to_place(grad_host, place, "torch")
    grad_k = to_place(random_data(rng, tuple(k_rot.shape), dtype), place, "torch")
    torch.autograd.backward((q_rot, k_rot), (grad_q, grad_k))
    synchronize(place)
    rope.check()

    assert np.array_equal(raw_bytes(qkv.detach()), raw_bytes(host)), "apply_rope modified its input"
    positions = token_positions(2, 6, 40)
    q64, k64 = before[:, :, :NUM_HEADS], before[:, :, NUM_HEADS : NUM_HEADS + NUM_KV_HEADS]
    assert_rotated(q_rot, q64, positions, frequencies, dtype, layout=layout, what="q_rot")
    assert_rotated(k_rot, k64, positions, frequencies, dtype, layout=layout, what="k_rot")
    got_tail = to_float64(q_rot).reshape(q64.shape)[..., rotary_dim:]
    assert np.array_equal(got_tail, q64[..., rotary_dim:]), "tail not copied exactly"

    g64 = grad_host.astype(np.float64).reshape(2, 6, NUM_HEADS, head_dim)
    grad = to_float64(qkv.grad).reshape(before.shape)
    assert_rotated(grad[:, :, :NUM_HEADS], g64, positions, frequencies, dtype, layout=layout,
                   inverse=True, what="grad_q")  # fmt: skip
    assert not grad[:, :, NUM_HEADS + NUM_KV_HEADS :].any(), "v got a gradient"


@GPU
@pytest.mark.parametrize("offset", [100, "device"])
def test_gpu_apply_rope_matches_the_host_path(rng, offset):
    require("cuda", "torch")
    head_dim = DEVICE_HEAD_DIM
    case = SCHEMES["yarn"]
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=case.scheme(head_dim), max_position=4096)
    shape_q, shape_k = (2, 7, NUM_HEADS * head_dim), (2, 7, NUM_KV_HEADS, head_dim)
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
        results[device] = [to_float64(t) for t in (q_rot, k_rot, q.grad, k.grad)]
    rope.check()

    for name, host, device, x in zip(
        ("q", "k", "grad_q", "grad_k"),
        results["cpu"],
        results["cuda"],
        (host_q, host_k, weight_q, weight_k),
        strict=True,
    ):
        # both paths meet the float32 contract at x's scale: the device within it of the host
        tolerance = contract_tolerance(host, x.astype(np.float64), "float32")
        assert_within(device, host, tolerance, f"{name}: CUDA vs host")
    positions = token_positions(2, 7, values if offset == "device" else offset)
    frequencies = case.frequencies(head_dim)
    q64 = host_q.astype(np.float64).reshape(2, 7, NUM_HEADS, head_dim)
    assert_rotated(results["cuda"][0], q64, positions, frequencies, "float32", what="q_rot")
    w64 = weight_q.astype(np.float64).reshape(2, 7, NUM_HEADS, head_dim)
    assert_rotated(results["cuda"][2], w64, positions, frequencies, "float32", inverse=True,
                   what="grad_q")  # fmt: skip


# --------------------------------------------------------------------------- streams (device)


@GPU
def test_gpu_runs_on_the_current_torch_stream(rng):
    require("cuda", "torch")
    head_dim = DEVICE_HEAD_DIM
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS)
    q = torch.zeros(4, 16, NUM_HEADS * head_dim, device="cuda")
    k = torch.zeros(4, 16, NUM_KV_HEADS * head_dim, device="cuda")
    fresh_q, fresh_k, q64, k64 = _qk(rng, "cuda", 4, 16, "float32")
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
    positions = token_positions(4, 16, 11)
    frequencies = SCHEMES["standard"].frequencies(head_dim)
    assert_rotated(q, q64, positions, frequencies, "float32", what="q")
    assert_rotated(k, k64, positions, frequencies, "float32", what="k")


@GPU
def test_gpu_runs_on_the_current_cupy_stream(rng):
    cupy = pytest.importorskip("cupy")
    require("cuda", "torch")
    head_dim = DEVICE_HEAD_DIM
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS)
    host_q = random_data(rng, (4, 16, NUM_HEADS * head_dim), "float32")
    host_k = random_data(rng, (4, 16, NUM_KV_HEADS, head_dim), "float32")
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
    positions = token_positions(4, 16, 11)
    frequencies = SCHEMES["standard"].frequencies(head_dim)
    q64 = host_q.astype(np.float64).reshape(4, 16, NUM_HEADS, head_dim)
    k64 = host_k.astype(np.float64)
    assert_rotated(q, q64, positions, frequencies, "float32", what="q")
    assert_rotated(k, k64, positions, frequencies, "float32", what="k")


# --------------------------------------------------------------------------- device positions


@GPU
@pytest.mark.parametrize("positions_dtype", ["int32", "int64"])
def test_gpu_out_of_range_device_positions_surface_at_the_next_call(rng, positions_dtype):
    require("cuda", "torch")
    max_position, head_dim = 4096, DEVICE_HEAD_DIM
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, max_position=max_position)
    # (components built alike share their configuration's flag: this one is built otherwise)
    bystander = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, max_position=2 * max_position)
    values = [5, max_position, -3, max_position - 1, 2**31 - 1]
    clamped = [5, max_position - 1, 0, max_position - 1, max_position - 1]
    if positions_dtype == "int64":
        values.append(2**40 + 5)  # must not wrap to 5
        clamped.append(max_position - 1)
    batch = len(values)
    frequencies = SCHEMES["standard"].frequencies(head_dim)
    q, k, q64, k64 = _qk(rng, "cuda", batch, 1, "float32")

    rope.decode(q, k, _positions_tensor(values, positions_dtype))  # no sync, no raise here
    torch.cuda.synchronize()

    # the kernel clamped: valid sequences are right, no table was read out of bounds
    positions = np.array(clamped)[:, None]
    assert_rotated(q, q64, positions, frequencies, "float32", what="q")
    assert_rotated(k, k64, positions, frequencies, "float32", what="k")

    # a component of another configuration has a flag of its own
    q2, k2, _, _ = _qk(rng, "cuda", batch, 1, "float32")
    bystander.decode(q2, k2, 9)
    torch.cuda.synchronize()

    # the next call of the faulty component raises, and rotates nothing
    q3, k3, q3_64, _ = _qk(rng, "cuda", batch, 1, "float32")
    with pytest.raises(ValueError, match="position"):
        rope.decode(q3, k3, 7)
    torch.cuda.synchronize()
    assert np.array_equal(to_float64(q3).reshape(q3_64.shape), q3_64)
    # once reported, the flag is clear
    rope.decode(q3, k3, 7)
    rope.check()

    # or rope.check() reports it, after waiting for the device
    rope.decode(q, k, _positions_tensor(values, positions_dtype))
    with pytest.raises(ValueError, match="position"):
        rope.check()
    rope.check()


def _call_error_cases():
    head_dim = DEVICE_HEAD_DIM

    def q_k(batch=2, seq=1, dtype=torch.float32, device="cuda"):
        return (
            torch.zeros(batch, seq, NUM_HEADS * head_dim, dtype=dtype, device=device),
            torch.zeros(batch, seq, NUM_KV_HEADS * head_dim, dtype=dtype, device=device),
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
            lambda r: r.forward(q_k()[0], torch.zeros(2, 1, 3 * head_dim, device="cuda")),
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


_GPU_CALL_ERRORS = _call_error_cases()


@GPU
@pytest.mark.parametrize("name", list(_GPU_CALL_ERRORS))
def test_gpu_call_errors(name):
    require("cuda", "torch")
    call, error, match = _GPU_CALL_ERRORS[name]
    rope = RoPE(DEVICE_HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=1000)
    with pytest.raises(error, match=match):
        call(rope)
    rope.check()  # a refused call launched nothing


@GPU
def test_gpu_target_cpu_refuses_device_data():
    require("cuda", "torch")
    rope = RoPE(DEVICE_HEAD_DIM, NUM_HEADS, target="cpu")
    with pytest.raises(ValueError, match="target"):
        rope.forward(torch.zeros(1, 2, NUM_HEADS * DEVICE_HEAD_DIM, device="cuda"))


# --------------------------------------------------------------------------- CUDA graphs


@GPU
def test_gpu_cuda_graph_replays_decode_with_new_positions(rng):
    require("cuda", "torch")
    batch, hq, hkv, head_dim = 8, NUM_HEADS, NUM_KV_HEADS, DEVICE_HEAD_DIM
    max_position = 1 << 16
    case = SCHEMES["yarn"]
    frequencies = case.frequencies(head_dim)
    rope = RoPE(head_dim, hq, hkv, scheme=case.scheme(head_dim), max_position=max_position)
    qkv = torch.zeros(batch, 1, (hq + 2 * hkv) * head_dim, device="cuda")
    q, k = qkv[..., : hq * head_dim], qkv[..., hq * head_dim : (hq + hkv) * head_dim]
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
        return data.astype(np.float64).reshape(batch, 1, hq + 2 * hkv, head_dim)

    def check(before, values):
        after = to_float64(qkv).reshape(batch, 1, hq + 2 * hkv, head_dim)
        rows = np.asarray(values, dtype=np.int64)[:, None]
        q64, k64 = before[:, :, :hq], before[:, :, hq : hq + hkv]
        assert_rotated(after[:, :, :hq], q64, rows, frequencies, "float32", what="q")
        assert_rotated(after[:, :, hq : hq + hkv], k64, rows, frequencies, "float32", what="k")
        assert np.array_equal(after[:, :, hq + hkv :], before[:, :, hq + hkv :]), "v changed"

    for replay in range(4):
        values = rng.integers(0, max_position, batch)
        values[0], values[-1] = replay, max_position - 1
        check(step(values), values)
        rope.check()
        if replay == 1:
            # another layer grows the shared table: the captured launch keeps reading the
            # copy it was captured with, which must stay alive and right
            grower = RoPE(head_dim, hq, hkv, scheme=case.scheme(head_dim))
            grower.prefill(*_qk(rng, "cuda", 1, 2, "float32")[:2], 2**22)
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


@GPU
def test_gpu_prefill_b1_t8192_32q_8kv_d128_bf16_in_one_call(rng):
    require("cuda", "torch")
    seq, hq, hkv, head_dim = 8192, 32, 8, DEVICE_HEAD_DIM
    heads = hq + 2 * hkv
    # 50M elements drawn on the device, seeded from this test's rng
    generator = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**63)))
    qkv = torch.randn(
        1, seq, heads * head_dim, device="cuda", dtype=torch.bfloat16, generator=generator
    )
    before = qkv.cpu()
    q, k = qkv[..., : hq * head_dim], qkv[..., hq * head_dim : (hq + hkv) * head_dim]
    case = SCHEMES["llama31"]
    rope = RoPE(head_dim, hq, hkv, scheme=case.scheme(head_dim))

    assert_same(rope.prefill(q, k, 0), q, k)
    torch.cuda.synchronize()

    after = qkv.cpu()
    v_slice = np.s_[..., (hq + hkv) * head_dim :]
    assert torch.equal(after[v_slice].view(torch.int16), before[v_slice].view(torch.int16))
    frequencies = case.frequencies(head_dim)
    chunk = 1024
    for start in range(0, seq, chunk):  # every element, in chunks of tokens to bound memory
        rows = np.s_[:, start : start + chunk]
        x64 = to_float64(before[rows]).reshape(1, chunk, heads, head_dim)
        y = to_float64(after[rows]).reshape(1, chunk, heads, head_dim)
        positions = token_positions(1, chunk, start)
        q64, k64 = x64[:, :, :hq], x64[:, :, hq : hq + hkv]
        assert_rotated(y[:, :, :hq], q64, positions, frequencies, "bfloat16", what="q")
        assert_rotated(y[:, :, hq : hq + hkv], k64, positions, frequencies, "bfloat16", what="k")


# --------------------------------------------------------------------------- shared tables


def test_components_and_ops_share_one_table(rng):
    scheme = fresh_standard()
    first = RoPE(HEAD_DIM, 8, 2, scheme=scheme)
    second = RoPE(HEAD_DIM, 4, scheme=scheme, rope_layout="interleaved", max_position=4096)
    wider = RoPE(2 * HEAD_DIM, 4, scheme=scheme, rotary_dim=HEAD_DIM)  # same rotary_dim
    other = RoPE(HEAD_DIM, 4, scheme=scheme, rotary_dim=32)

    assert first.table is second.table is wider.table
    assert other.table is not first.table
    assert len(table_entries(scheme, HEAD_DIM)) == 1
    assert len(table_entries(scheme, 32)) == 1

    # the seed op with the same (scheme, rotary_dim) uses the same table: its growth shows
    op = RoPEFwdOp(input_layout="1d", base=scheme.base)
    seq = 3 * 8192 + 5
    capacity = first.table.capacity
    assert capacity < seq
    x = random_data(rng, (seq, HEAD_DIM), "float32")
    y = op(x)
    assert first.table.capacity >= seq and second.table is first.table
    [entry] = table_entries(scheme, HEAD_DIM)
    assert entry["positions"] == first.table.capacity
    assert entry["host_bytes"] == first.table.bytes()["host"] > 0
    info = table_cache_info()
    assert info["host_bytes"] == sum(e["host_bytes"] for e in info["entries"])
    keys = [(e["scheme"], e["rotary_dim"], e["pair_order"]) for e in info["entries"]]
    assert len(keys) == len(set(keys)), "an entry is listed twice"
    x64 = x.astype(np.float64)[None, :, None, :]
    frequencies = standard_frequencies(HEAD_DIM, scheme.base)
    assert_rotated(y, x64, token_positions(1, seq, 0), frequencies, "float32")


# Host positions tell the device copy of the table how far it must reach: the highest
# position, plus one. In each form the last position, 8192, is the first that a table's first
# size (8 coarse rows of 1024) does not hold, so a fresh table must grow on the device for
# the kernel to read inside it.
HOST_POSITION_FORMS = {
    "int offset": lambda rope, q, k: (rope.prefill(q, k, 8190), token_positions(1, 3, 8190)),
    "offsets [B]": lambda rope, q, k: (
        rope.prefill(q, k, np.array([8190])),
        token_positions(1, 3, 8190),
    ),
    "positions [B, T]": lambda rope, q, k: (
        rope.forward(q, k, positions=np.array([[5, 8192, 0]])),
        np.array([[5, 8192, 0]]),
    ),
}


@GPU
@pytest.mark.parametrize("form", list(HOST_POSITION_FORMS))
def test_gpu_host_positions_past_a_tables_first_size_grow_its_device_copy(rng, form):
    scheme = fresh_standard()
    rope = RoPE(DEVICE_HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, scheme=scheme)
    q, k, q64, k64 = _qk(rng, "cuda", 1, 3, "float32")
    _, positions = HOST_POSITION_FORMS[form](rope, q, k)
    assert rope.table.device_capacity(q.device.index) > 8192
    frequencies = standard_frequencies(DEVICE_HEAD_DIM, scheme.base)
    assert_rotated(q, q64, positions, frequencies, "float32", what="q")
    assert_rotated(k, k64, positions, frequencies, "float32", what="k")


def test_table_grows_for_a_longer_position(rng):
    scheme = fresh_standard()
    rope = RoPE(HEAD_DIM, 2, 1, scheme=scheme)
    other = RoPE(HEAD_DIM, 4, 4, scheme=scheme)
    table = rope.table
    q, k, _, _ = _qk(rng, "cpu", 1, 4, "float32", heads=2, kv_heads=1)
    rope.forward(q, k)
    small = table.capacity
    small_bytes = table.bytes()["host"]
    assert small >= 4

    offset = small + 100_000
    q, k, q64, k64 = _qk(rng, "cpu", 1, 3, "float32", heads=2, kv_heads=1)
    rope.prefill(q, k, offset)

    assert rope.table is table and other.table is table
    assert table.capacity >= offset + 3 > small
    assert table.bytes()["host"] > small_bytes
    assert rope.memory_stats()["positions"] == table.capacity
    [entry] = table_entries(scheme, HEAD_DIM)
    assert entry["positions"] == table.capacity
    frequencies = standard_frequencies(HEAD_DIM, scheme.base)
    positions = token_positions(1, 3, offset)
    assert_rotated(q, q64, positions, frequencies, "float32", what="q")
    assert_rotated(k, k64, positions, frequencies, "float32", what="k")


# threads, rounds, q heads, kv heads, the offset of (thread, round), the (thread, round) that
# grows the table to the end (2**24 - 8) while the others read it (or upload and launch)
THREAD_SCHEDULES = {
    "6x4": (6, 4, 4, 2, lambda t, r: (t * 7919 + r * 300_000) % 2_000_000, (0, 1)),
    "4x3": (4, 3, 8, 2, lambda t, r: t * 1000 + r * 600_000, (2, 0)),
}


@pytest.mark.parametrize("schedule", THREAD_SCHEDULES)
@pytest.mark.parametrize("place", PLACES)
def test_threads_share_one_table(rng, place, schedule):
    """Threads build components of one fresh key at once and prefill concurrently, some
    asking for positions that grow the shared table while others read it."""
    threads_count, rounds, heads, kv_heads, offset_of, grower = THREAD_SCHEDULES[schedule]
    head_dim = HEAD_DIMS[place]
    scheme = fresh_standard()
    frequencies = standard_frequencies(head_dim, scheme.base)
    offsets = [[offset_of(t, r) for r in range(rounds)] for t in range(threads_count)]
    offsets[grower[0]][grower[1]] = 2**24 - 8
    inputs = [
        [_qk(rng, place, 2, 8, "float32", heads=heads, kv_heads=kv_heads) for _ in range(rounds)]
        for _ in range(threads_count)
    ]
    components: list[RoPE | None] = [None] * threads_count
    failures: list[BaseException] = []
    start = threading.Barrier(threads_count)

    def work(index: int) -> None:
        try:
            start.wait()
            rope = RoPE(head_dim, heads, kv_heads, scheme=scheme)
            components[index] = rope
            for (q, k, _, _), offset in zip(inputs[index], offsets[index], strict=True):
                rope.prefill(q, k, offset)
            synchronize(place)
        except BaseException as error:  # reported below, with the thread's traceback
            failures.append(error)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not failures, failures
    assert all(rope is not None and rope.table is components[0].table for rope in components)
    assert len(table_entries(scheme, head_dim)) == 1
    for index in range(threads_count):
        for (q, k, q64, k64), offset in zip(inputs[index], offsets[index], strict=True):
            positions = token_positions(2, 8, offset)
            assert_rotated(q, q64, positions, frequencies, "float32", what="q")
            assert_rotated(k, k64, positions, frequencies, "float32", what="k")


def test_memory_stats_report_the_shared_table():
    scheme = fresh_standard()
    first = RoPE(HEAD_DIM, 8, 2, scheme=scheme)
    second = RoPE(HEAD_DIM, 16, 4, scheme=scheme)
    first.prefill(np.zeros((1, 1, 8 * HEAD_DIM), np.float32), None, 20_000)

    stats = first.memory_stats()
    assert stats == second.memory_stats(), "one shared table, the same report"
    assert stats["owned"] == 0
    assert stats["shared_key"] == (scheme, HEAD_DIM)
    assert stats["positions"] == first.table.capacity >= 20_001
    [entry] = table_entries(scheme, HEAD_DIM)
    assert stats["shared"]["host"] == entry["host_bytes"] > 0
    assert stats["shared"]["device"] == entry["device_bytes"] == {}  # nothing on a device


@GPU
def test_memory_stats_count_the_grouped_table():
    """Interleaved MRoPE sections that group (Qwen3-VL's) keep the shared table's columns in
    the grouped order on the device too, from the first CUDA call of any size (a call
    captured later uploads nothing); memory_stats counts both."""
    require("cuda", "torch")
    rope = RoPE(
        DEVICE_HEAD_DIM, 8, 4, scheme=fresh_standard(), max_position=1 << 12,
        mrope_section=(24, 20, 20), mrope_interleaved=True,
    )  # fmt: skip
    q = torch.zeros(5, 8 * DEVICE_HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(5, 4 * DEVICE_HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    rope.forward(q, k, positions=torch.zeros(3, 5, dtype=torch.int64, device="cuda"))
    device = q.device.index
    natural = rope.table.bytes()["device"][device]
    assert natural > 0
    pair_columns = DEVICE_HEAD_DIM // 2 * 2 * 4  # the grouped fine table's one row more
    assert rope.memory_stats()["shared"]["device"] == {device: 2 * natural + pair_columns}


def test_required_memory_on_the_host_allocates_nothing():
    scheme = fresh_standard()
    entries_before = len(table_cache_info()["entries"])
    small = RoPE.required_memory(HEAD_DIM, 1000, scheme=scheme)
    large = RoPE.required_memory(HEAD_DIM, 1_000_000, scheme=scheme)
    half = RoPE.required_memory(HEAD_DIM, 1_000_000, scheme=scheme, rotary_dim=32)
    assert len(table_cache_info()["entries"]) == entries_before, "required_memory built a table"
    assert 0 < small <= large
    assert 0 < half < large
    # the tables store float32 (never the input dtype): cos and sin of each pair
    assert small % (4 * 2 * (HEAD_DIM // 2)) == 0
    assert RoPE.required_memory(128, 5000) == RoPE.required_memory(
        128, 5000, scheme=Standard(), rotary_dim=128
    )
    # interleaved MRoPE sections that group (Qwen3-VL's) keep a second, grouped table, whose
    # fine table has a row more (its pairs' columns)
    qwen3 = dict(mrope_section=(24, 20, 20), mrope_interleaved=True)
    natural = RoPE.required_memory(128, 1000, scheme=scheme)
    assert RoPE.required_memory(128, 1000, scheme=scheme, **qwen3) == 2 * natural + 64 * 2 * 4
    for section, interleaved in (((16, 24, 24), False), ((16, 24, 24), True)):  # (no groups)
        alone = RoPE.required_memory(
            128, 1000, scheme=scheme, mrope_section=section, mrope_interleaved=interleaved
        )
        assert alone == RoPE.required_memory(128, 1000, scheme=scheme)
    # rows not rotated whole never take the grouped layout: no second table
    partial = dict(rotary_dim=64, mrope_section=(16, 8, 8), mrope_interleaved=True)
    assert RoPE.required_memory(128, 1000, scheme=scheme, **partial) == RoPE.required_memory(
        128, 1000, scheme=scheme, rotary_dim=64
    )
    natural = RoPE.required_memory(64, 1000, scheme=scheme)
    assert RoPE.required_memory(64, 1000, scheme=scheme, **partial) == 2 * natural + 32 * 2 * 4
    with pytest.raises(ValueError, match="mrope_section must be 3 non-negative ints"):
        RoPE.required_memory(128, 1000, mrope_section=(24, 20, 21), mrope_interleaved=True)
    assert len(table_cache_info()["entries"]) == entries_before, "required_memory built a table"
    # a table that exists only on the host does not cover a device: the full cost remains
    rope = RoPE(HEAD_DIM, 2, scheme=scheme)
    rope.prefill(np.zeros((1, 1, 2 * HEAD_DIM), np.float32), None, 999)
    assert RoPE.required_memory(HEAD_DIM, 1000, scheme=scheme) == small


def test_check_without_a_device_is_a_no_op(rng):
    rope = RoPE(HEAD_DIM, 2, max_position=64)
    rope.check()
    q = random_data(rng, (1, 1, 2 * HEAD_DIM), "float32")
    rope.decode(q, None, 63)
    rope.check()


def _decode_on_device(rope: RoPE, rng, batch=2) -> None:
    q, k, _, _ = _qk(rng, "cuda", batch, 1, "float32", heads=rope.num_heads,
                     kv_heads=rope.num_kv_heads)  # fmt: skip
    rope.decode(q, k, _positions_tensor(np.arange(batch), "int32"))
    torch.cuda.synchronize()


@GPU
def test_gpu_shared_table_device_bytes_and_required_memory(rng):
    require("cuda", "torch")
    head_dim = DEVICE_HEAD_DIM
    scheme = fresh_standard()
    max_position = 20_000
    needed = RoPE.required_memory(head_dim, max_position, scheme=scheme)
    assert needed > 0
    first = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=scheme, max_position=max_position)
    second = RoPE(head_dim, 4, scheme=scheme, max_position=max_position)
    assert RoPE.required_memory(head_dim, max_position, scheme=scheme) == needed

    _decode_on_device(first, rng)
    _decode_on_device(second, rng)
    op = RoPEFwdOp(input_layout="1d", base=scheme.base)
    host = random_data(rng, (100, head_dim), "float32")
    y = op(to_place(host, "cuda", "torch"))
    torch.cuda.synchronize()

    device = torch.cuda.current_device()
    assert first.table is second.table
    [entry] = table_entries(scheme, head_dim)
    assert entry["device_bytes"] == {device: needed}
    assert first.memory_stats()["shared"]["device"] == {device: needed}
    assert second.memory_stats() == first.memory_stats()
    info = table_cache_info()
    live_and_retired = (
        sum(e["device_bytes"].values()) + sum(e["device_retired_bytes"].values())
        for e in info["entries"]
    )
    assert info["device_bytes"] == sum(live_and_retired)
    assert RoPE.required_memory(head_dim, max_position, scheme=scheme) == 0
    assert RoPE.required_memory(head_dim, 1000, scheme=scheme) == 0
    assert RoPE.required_memory(head_dim, 2**20, scheme=scheme) > 0
    assert RoPE.required_memory(head_dim, max_position, scheme=scheme, rotary_dim=64) > 0
    x64 = host.astype(np.float64)[None, :, None, :]
    frequencies = standard_frequencies(head_dim, scheme.base)
    assert_rotated(y, x64, token_positions(1, 100, 0), frequencies, "float32")


@GPU
def test_gpu_required_memory_after_host_only_growth(rng):
    require("cuda", "torch")
    head_dim = DEVICE_HEAD_DIM
    scheme = fresh_standard()
    rope = RoPE(head_dim, 4, scheme=scheme, max_position=8192)
    _decode_on_device(rope, rng)
    before = rope.memory_stats()["shared"]["device"]
    host = RoPE(head_dim, 4, scheme=scheme)
    host.prefill(np.zeros((1, 1, 4 * head_dim), np.float32), None, 100_000)  # host path only
    if rope.memory_stats()["shared"]["device"] != before:
        pytest.fail("the host path changed the device copy")  # not the xfail's AssertionError
    assert RoPE.required_memory(head_dim, 100_001, scheme=scheme) > 0


@GPU
def test_gpu_required_memory_predicts_device_growth(rng):
    cupy = pytest.importorskip("cupy")
    require("cuda", "torch")
    head_dim = DEVICE_HEAD_DIM
    scheme = fresh_standard()
    _decode_on_device(RoPE(head_dim, 4, scheme=scheme, max_position=8192), rng)
    predicted = RoPE.required_memory(head_dim, 2**20, scheme=scheme)
    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    big = RoPE(head_dim, 4, scheme=scheme, max_position=2**20)
    _decode_on_device(big, rng)
    grown = pool.used_bytes() - used
    assert grown == predicted, f"required_memory predicted {predicted} bytes, the pool grew {grown}"


@GPU
def test_gpu_device_table_grows_on_demand(rng):
    require("cuda", "torch")
    head_dim = DEVICE_HEAD_DIM
    scheme = fresh_standard()
    small = RoPE.required_memory(head_dim, 8192, scheme=scheme)
    rope = RoPE(head_dim, NUM_HEADS, NUM_KV_HEADS, scheme=scheme)
    q, k, _, _ = _qk(rng, "cuda", 1, 16, "float32")
    rope.prefill(q, k, 0)
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    assert rope.memory_stats()["shared"]["device"] == {device: small}
    q, k, _, _ = _qk(rng, "cuda", 1, 16, "float32")
    rope.prefill(q, k, 100_000)
    torch.cuda.synchronize()
    grown = rope.memory_stats()["shared"]["device"][device]
    assert small < grown < RoPE.required_memory(head_dim, 2**24, scheme=fresh_standard())


# --------------------------------------------------------------------------- errors (host)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RoPE(63, 8, 2), "head_dim"),
        (lambda: RoPE(64, 8, 3), "num_heads"),
        (lambda: RoPE(64, 0), "num_heads"),
        (lambda: RoPE(64, 8, 0), "num_kv_heads"),
        (lambda: RoPE(64, 8, rotary_dim=65), "rotary_dim"),
        (lambda: RoPE(64, 8, rotary_dim=66), "rotary_dim"),
        (lambda: RoPE(64, 8, rope_layout="gptj"), "rope_layout"),
        (lambda: RoPE(64, 8, max_position=0), "max_position"),
        (lambda: RoPE(64, 8, max_position=2**24 + 1), "max_position"),
        (lambda: RoPE(64, 8, target="tpu"), "target"),
    ],
    ids=[
        "odd-head-dim",
        "heads-not-multiple",
        "zero-heads",
        "zero-kv-heads",
        "odd-rotary-dim",
        "rotary-dim-too-big",
        "layout",
        "max-position-zero",
        "max-position-too-big",
        "target",
    ],
)
def test_constructor_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


B, T = 2, 3
_Q = (B, T, NUM_HEADS * HEAD_DIM)
_K = (B, T, NUM_KV_HEADS * HEAD_DIM)

CALL_ERRORS = {
    "q-heads": (lambda r: r.forward(_zeros((B, T, 7 * HEAD_DIM)), _zeros(_K)), r"\bq\b"),
    "q-head-dim": (lambda r: r.forward(_zeros((B, T, NUM_HEADS, 32)), _zeros(_K)), r"\bq\b"),
    "q-rank": (lambda r: r.forward(_zeros((T, NUM_HEADS * HEAD_DIM)), None), r"\bq\b"),
    "k-heads": (lambda r: r.forward(_zeros(_Q), _zeros((B, T, 3, HEAD_DIM))), r"\bk\b"),
    "k-as-q-heads": (lambda r: r.forward(_zeros(_Q), _zeros(_Q)), r"\bk\b"),
    "k-seq": (
        lambda r: r.forward(_zeros(_Q), _zeros((B, T + 1, 2 * HEAD_DIM))),
        rf"q and k must share \[B, T\], got q \({B}, {T}\) and k \({B}, {T + 1}\)",
    ),
    "k-tokens-packed": (
        lambda r: r.forward(_zeros((5, 512)), _zeros((4, 128)), positions=np.zeros(5, np.int64)),
        r"q and k must share \[N\], got q \(5,\) and k \(4,\)",
    ),
    "positions-3d": (
        lambda r: r.forward(_zeros((5, 512)), None, positions=np.zeros((1, 1, 5), np.int64)),
        r"positions must be \[B, T\] or \[N\], one position per token, got shape \(1, 1, 5\)",
    ),
    "k-batch": (lambda r: r.forward(_zeros(_Q), _zeros((B + 1, T, 2 * HEAD_DIM))), r"\bk\b"),
    "decode-T": (lambda r: r.decode(_zeros(_Q), _zeros(_K), 0), r"T"),
    "decode-T0": (lambda r: r.decode(_zeros((B, 3, 512))[:, :0], None, 0), r"T"),
    "offset-beyond": (lambda r: r.prefill(_zeros(_Q), _zeros(_K), 1000 - T + 1), "position_offset"),
    "offset-negative": (lambda r: r.prefill(_zeros(_Q), _zeros(_K), -1), "position_offset"),
    "position-at-max": (lambda r: r.decode(_zeros((B, 1, 512)), None, 1000), r"\bposition\b"),
    "position-negative": (lambda r: r.decode(_zeros((B, 1, 512)), None, -2), r"\bposition\b"),
    "backward-beyond": (lambda r: r.backward(_zeros(_Q), _zeros(_K), 998), "position_offset"),
    "tensor-beyond": (
        lambda r: r.prefill(_zeros(_Q), _zeros(_K), np.array([0, 998])),
        "position_offset",
    ),
    "tensor-negative": (
        lambda r: r.prefill(_zeros(_Q), _zeros(_K), np.array([-1, 5])),
        "position_offset",
    ),
    "tensor-int64-wraps": (
        lambda r: r.decode(_zeros((B, 1, 512)), None, np.array([2**32 + 1, 0], np.int64)),
        r"\bposition\b",
    ),
    "tensor-long": (
        lambda r: r.prefill(_zeros(_Q), _zeros(_K), np.array([0, 1, 2])),
        "position_offset",
    ),
    "tensor-short": (lambda r: r.decode(_zeros((B, 1, 512)), None, np.array([4])), "position"),
    "tensor-2d": (
        lambda r: r.decode(_zeros((B, 1, 512)), None, np.zeros((B, 1), np.int64)),
        "position",
    ),
    "strided-last-dim": (
        lambda r: r.forward(_zeros((B, T, 2 * NUM_HEADS * HEAD_DIM))[..., ::2], None),
        r"\bq\b",
    ),
}


@pytest.mark.parametrize("name", list(CALL_ERRORS))
def test_call_errors_name_the_argument(name):
    call, match = CALL_ERRORS[name]
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=1000)
    with pytest.raises(ValueError, match=match):
        call(rope)


def test_torch_host_tensor_positions_are_validated():
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=1000)
    with pytest.raises(ValueError, match=r"\bposition\b"):
        rope.decode(_zeros((B, 1, 512)), None, torch.tensor([3, 1000]))
    with pytest.raises(ValueError, match="position_offset"):
        rope.prefill(_zeros(_Q), _zeros(_K), torch.tensor([3, 4, 5], dtype=torch.int32))


def test_a_rejected_call_changes_nothing(rng):
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, max_position=1000)
    q, k, _, _ = _qk(rng, "cpu", B, T, "float32")
    q_before, k_before = q.copy(), k.copy()
    with pytest.raises(ValueError, match=r"^position_offset \+ T - 1 .* e\.g\. 1000$"):
        rope.prefill(q, k, np.array([0, 998]))
    with pytest.raises(ValueError, match=r"^q and k must share \[B, T\]"):
        rope.prefill(q, k[:, :2], 0)
    assert np.array_equal(q, q_before) and np.array_equal(k, k_before)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda r: r.forward(_zeros(_Q, np.int32), None), r"\bq\b"),
        (lambda r: r.forward(_zeros(_Q), _zeros(_K, np.int64)), r"\bk\b"),
        (lambda r: r.forward(_zeros(_Q, np.complex64), None), r"\bq\b"),
        (lambda r: r.forward(_zeros(_Q), _zeros(_K, np.float16)), r"\bk\b"),
        (lambda r: r.prefill(_zeros(_Q), None, np.array([0.0, 1.0])), "position_offset"),
        (lambda r: r.forward([[0.0] * 512], None), r"\bq\b"),
        (lambda r: r.forward(_zeros((5, 512)), None, positions=[0] * 5), "positions must be an"),
    ],
    ids=[
        "q-int32",
        "k-int64",
        "q-complex",
        "k-dtype-differs",
        "float-offsets",
        "list",
        "positions-list",
    ],  # fmt: skip
)
def test_type_errors(call, match):
    rope = RoPE(HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    with pytest.raises(TypeError, match=match):
        call(rope)


@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32", "float64"))
def test_host_chunks_do_not_change_a_bit(rng, monkeypatch, dtype):
    """The host path rotates a few thousand elements at a time (for its caches); every row's
    arithmetic is the same whatever the chunk, so tiny chunks (many, the last one partial)
    and one chunk for the whole call give the same bits: the seed op (both layouts, partial
    rotary_dim), the component in place with k, per-token positions, MRoPE and the fused
    norm, and the cos_sin_cache call."""
    from tileops_cupy.rope import apply_rope_with_cos_sin_cache

    def data(*shape):
        return random_data(rng, shape, dtype)

    x, q, k = data(2, 37, 3, 16), data(2, 37, 4 * 16), data(2, 37, 2, 16)
    weights = {"q_norm_weight": data(16), "k_norm_weight": data(16)}
    positions, sections = rng.integers(0, 900, (2, 37)), rng.integers(0, 900, (3, 2, 37))
    angles = rng.uniform(0, 100, (900, 4))
    cache = np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
    tokens = rng.integers(0, 900, 74)
    plain, mrope = RoPE(16, 4, 2, max_position=900), RoPE(16, 4, 2, mrope_section=(2, 3, 3))

    def in_place(rope, **call):
        q_in, k_in = q.copy(), k.copy()
        rope.forward(q_in, k_in, **call)
        return q_in, k_in

    calls = {
        "neox": lambda: (RoPEFwdOp("neox", "2d", rotary_dim=8)(x),),
        "interleaved": lambda: (RoPEFwdOp("interleaved", "2d")(x),),
        "positions": lambda: in_place(plain, positions=positions),
        "norm": lambda: in_place(plain, positions=positions, **weights),
        "mrope": lambda: in_place(mrope, positions=sections),
        "cos_sin_cache": lambda: apply_rope_with_cos_sin_cache(
            tokens, q.reshape(74, 64), k.reshape(74, 2, 16), 16, cache, False
        ),
    }
    for name, call in calls.items():
        monkeypatch.setattr(_rotate, "_HOST_CHUNK_ELEMENTS", 1 << 40)  # the whole call at once
        whole = call()
        monkeypatch.setattr(_rotate, "_HOST_CHUNK_ELEMENTS", 100)  # 1-2 tokens a chunk
        for got, want in zip(call(), whole, strict=True):
            assert np.array_equal(raw_bytes(got), raw_bytes(want)), name
