"""Fused QK-RMSNorm + RoPE (issue 11 item 3, SPEC 9): the component's calls with
``q_norm_weight``/``k_norm_weight``, against the float64 oracle (``_oracle``), HF's
``Qwen3RMSNorm``/``Gemma3RMSNorm`` followed by HF's rotary, and torch autograd of the
same math in float64.

One file for both places: ``place`` is "cpu" (the host path, in CI) or "cuda" (marked
``gpu``; skips without a device). Every test draws fresh data (``rng`` is seeded per test
id) and compares every output element.
"""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
import torch
from _cases import PLACES, assert_runs_in_own_process
from _compile import backends, compile_counting
from _oracle import (
    BF16,
    MROPE_SECTIONS,
    assert_gradcheck,
    assert_norm_rope_matches_oracle,
    mrope_pair_positions,
    random_data,
    rms_norm_reference,
    rope_reference,
    standard_frequencies,
    to_float64,
    to_framework,
    torch_norm_rope_reference,
    yarn_frequencies,
)

from tileops_cupy import _rotate
from tileops_cupy.rope import RoPE, Standard, apply_rope

B, T, HEADS, KV_HEADS = 2, 5, 4, 2
BASE = 10000.0

# case: (head_dim, rotary_dim, rope_layout)
CASES = {
    "D64-neox": (64, 64, "neox"),
    "D64-interleaved": (64, 64, "interleaved"),
    "D128-partial64-neox": (128, 64, "neox"),  # a tail: normalised, not rotated
    "D64-partial48-interleaved": (64, 48, "interleaved"),  # the run-time rotary_dim kernel
    "D256-interleaved": (256, 256, "interleaved"),  # fp32: more chunks than a warp has lanes
    "D128-neox": (128, 128, "neox"),  # large 16-bit launches in place: one pack a lane
}
# weights: (their dtype: the data's or float32, norm_weight_offset, norm_eps)
WEIGHTS = {"qwen3": ("data", 0.0, 1e-6), "gemma-float32": ("float32", 1.0, 1e-5)}
DTYPES = {
    "cpu": ("float16", "bfloat16", "float32", "float64"),
    "cuda": ("float16", "bfloat16", "float32"),
}


def _per_place(values_of_place):
    """pytest params (place, value) for every value of each place, cuda ones marked gpu."""
    params = []
    for place in ("cpu", "cuda"):
        marks = (pytest.mark.gpu,) if place == "cuda" else ()
        for value in values_of_place(place):
            params.append(pytest.param(place, value, marks=marks, id=f"{place}-{value}"))
    return params


PLACE_DTYPES = _per_place(lambda place: DTYPES[place])


def _framework(place: str) -> str:
    return "torch" if place == "cpu" else "torch-cuda"


def _rope(case: str, weights: str = "qwen3", **extra) -> tuple[RoPE, int, object, bool]:
    """(component, head_dim, oracle frequencies, neox)."""
    head_dim, rotary_dim, layout = CASES[case]
    _, offset, eps = WEIGHTS[weights]
    rope = RoPE(
        head_dim, HEADS, KV_HEADS, scheme=Standard(BASE), rotary_dim=rotary_dim,
        rope_layout=layout, norm_eps=eps, norm_weight_offset=offset, **extra,
    )  # fmt: skip
    return rope, head_dim, standard_frequencies(rotary_dim, BASE), layout == "neox"


def _weight(rng, head_dim: int, dtype: str, weights: str, place: str):
    """(weight tensor on place, its float64 values): around 1 for Qwen3 (offset 0), around
    0 for Gemma (offset 1), in the data's dtype or float32."""
    kind, offset, _ = WEIGHTS[weights]
    weight_dtype = dtype if kind == "data" else "float32"
    values = rng.uniform(0.5, 1.5, head_dim) - offset
    tensor = torch.from_numpy(values).to(place, getattr(torch, weight_dtype))
    return tensor, to_float64(tensor)


def _data(rng, shape, dtype, place):
    host = random_data(rng, shape, dtype)
    return to_framework(host, _framework(place)), host.astype(np.float64)


def _randn(rng, place, *shape, around=0.0):
    """Normal data around ``around``: float64 on the host, float32 on a device."""
    dtype = torch.float64 if place == "cpu" else torch.float32
    return torch.from_numpy(around + rng.standard_normal(shape)).to(place, dtype)


def _fused_columns(head_dim: int) -> tuple[int, int, int]:
    """(width, end of q, end of k) of a fused QKV row."""
    return (HEADS + 2 * KV_HEADS) * head_dim, HEADS * head_dim, (HEADS + KV_HEADS) * head_dim


def _rows(x64: np.ndarray, head_dim: int) -> np.ndarray:
    return x64.reshape(*x64.shape[:-1], -1, head_dim)


def _check(y, x64, w64, rope, frequencies, neox, positions, dtype, what, per_pair=False):
    """``y`` (any shape whose last dims hold heads*head_dim) against the oracle, positions
    (``per_pair``: ``[..., pairs]``, MRoPE's) broadcast over the heads."""
    rows = _rows(x64, rope.head_dim)
    positions = np.asarray(positions)
    positions = positions[..., None, :] if per_pair else positions[..., None]  # (over the heads)
    assert_norm_rope_matches_oracle(
        to_float64(y).reshape(rows.shape), rows, w64, rope.norm_eps, rope.norm_weight_offset,
        positions, frequencies, dtype, neox=neox, per_pair=per_pair, what=what,
    )  # fmt: skip


def _synchronize(place):
    if place == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- the oracle


@pytest.mark.parametrize(("place", "dtype"), PLACE_DTYPES)
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("case", CASES)
def test_prefill_matches_oracle(rng, case, weights, dtype, place):
    """q and k (GQA) in one call, at positions crossing the 1024-row table boundary; every
    column of every row within one output unit of the float64 norm + rotation."""
    rope, head_dim, frequencies, neox = _rope(case, weights)
    q, q64 = _data(rng, (B, T, HEADS * head_dim), dtype, place)
    k, k64 = _data(rng, (B, T, KV_HEADS * head_dim), dtype, place)
    q_weight, q_w64 = _weight(rng, head_dim, dtype, weights, place)
    k_weight, k_w64 = _weight(rng, head_dim, dtype, weights, place)
    offset = 1020
    result = rope.prefill(q, k, offset, q_norm_weight=q_weight, k_norm_weight=k_weight)
    assert result[0] is q and result[1] is k
    _synchronize(place)
    positions = np.broadcast_to(offset + np.arange(T), (B, T))
    _check(q, q64, q_w64, rope, frequencies, neox, positions, dtype, "q")
    _check(k, k64, k_w64, rope, frequencies, neox, positions, dtype, "k")


@pytest.mark.parametrize("place", PLACES)
def test_subnormal_rows_are_normalised_not_flushed(rng, place):
    """bf16 rows below the smallest normal float32 (their squares underflow to 0, so the
    scale is 1/sqrt(eps)) come out at full precision: the CUDA kernels are compiled without
    CuPy's default ``-ftz=true``, which flushed them to zero."""
    rope, head_dim, frequencies, neox = _rope("D64-neox")
    host = (rng.standard_normal((B, T, HEADS * head_dim)) * 2.0**-128).astype(BF16)
    assert np.count_nonzero(host) > 0.9 * host.size  # (bf16 spacing here: 2**-133)
    q, q64 = to_framework(host, _framework(place)), host.astype(np.float64)
    weight, w64 = _weight(rng, head_dim, "bfloat16", "qwen3", place)
    rope.prefill(q, None, 0, q_norm_weight=weight)
    _synchronize(place)
    assert np.count_nonzero(to_float64(q)) > 0.9 * host.size
    positions = np.broadcast_to(np.arange(T), (B, T))
    _check(q, q64, w64, rope, frequencies, neox, positions, "bfloat16", "q")


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("call", ("forward-packed", "forward-BTHD", "prefill-offsets", "decode"))
def test_fused_qkv_views_in_place_leave_v(rng, call, place):
    """In place through views of one fused QKV buffer (bf16), every position kind: v is
    untouched, q and k normalised and rotated."""
    rope, head_dim, frequencies, neox = _rope("D128-partial64-neox")
    seq = 1 if call == "decode" else T
    tokens = (B * seq,) if call == "forward-packed" else (B, seq)
    width, q_end, k_end = _fused_columns(head_dim)
    qkv, x64 = _data(rng, (*tokens, width), "bfloat16", place)
    q, k = qkv[..., :q_end], qkv[..., q_end:k_end]
    if call == "forward-BTHD":
        q, k = q.unflatten(-1, (HEADS, head_dim)), k.unflatten(-1, (KV_HEADS, head_dim))
    q_weight, q_w64 = _weight(rng, head_dim, "bfloat16", "qwen3", place)
    k_weight, k_w64 = _weight(rng, head_dim, "bfloat16", "qwen3", place)
    weights = dict(q_norm_weight=q_weight, k_norm_weight=k_weight)
    ids = rng.integers(0, 1 << 20, tokens)
    if call.startswith("forward"):
        rope.forward(q, k, positions=torch.from_numpy(ids).to(place), **weights)
    else:
        starts = rng.integers(0, 1 << 20, B)
        ids = starts[:, None] + np.arange(seq)
        position = torch.from_numpy(starts.astype(np.int32)).to(place)
        call_rope = rope.decode if call == "decode" else rope.prefill
        call_rope(q, k, position, **weights)
    _synchronize(place)
    np.testing.assert_array_equal(to_float64(qkv)[..., k_end:], x64[..., k_end:], "v changed")
    _check(q, x64[..., :q_end], q_w64, rope, frequencies, neox, ids, "bfloat16", "q")
    _check(k, x64[..., q_end:k_end], k_w64, rope, frequencies, neox, ids, "bfloat16", "k")


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("with_k", (True, False))
def test_apply_rope_equals_in_place_and_leaves_inputs(rng, with_k, place):
    rope, head_dim, frequencies, neox = _rope("D64-interleaved", "gemma-float32")
    q, q64 = _data(rng, (B, T, HEADS * head_dim), "float32", place)
    k, _ = _data(rng, (B, T, KV_HEADS * head_dim), "float32", place)
    q_weight, q_w64 = _weight(rng, head_dim, "float32", "gemma-float32", place)
    k_weight, _ = _weight(rng, head_dim, "float32", "gemma-float32", place)
    k, k_weight = (k, k_weight) if with_k else (None, None)
    before = [t.clone() for t in (q, k) if t is not None]
    q_rot, k_rot = apply_rope(q, k, rope, 3, q_norm_weight=q_weight, k_norm_weight=k_weight)
    for tensor, saved in zip((t for t in (q, k) if t is not None), before, strict=True):
        assert torch.equal(tensor, saved), "apply_rope changed its input"
    assert (k_rot is None) == (k is None)
    rope.prefill(q, k, 3, q_norm_weight=q_weight, k_norm_weight=k_weight)
    assert torch.equal(q_rot, q)
    if with_k:
        assert torch.equal(k_rot, k)
    positions = np.broadcast_to(3 + np.arange(T), (B, T))
    _check(q_rot, q64, q_w64, rope, frequencies, neox, positions, "float32", "q")


@pytest.mark.parametrize("place", PLACES)
def test_repeated_calls_read_each_calls_weights(rng, place):
    """A repeated layout re-runs its first launch with patched addresses (on a device):
    each call reads its own weights, and a call without weights is not normalised."""
    rope, head_dim, frequencies, neox = _rope("D64-neox")
    for step in range(3):
        for normed in (True, False, True):
            q, q64 = _data(rng, (B, T, HEADS * head_dim), "float32", place)
            k, k64 = _data(rng, (B, T, KV_HEADS * head_dim), "float32", place)
            q_weight, q_w64 = _weight(rng, head_dim, "float32", "qwen3", place)
            k_weight, k_w64 = _weight(rng, head_dim, "float32", "qwen3", place)
            if not normed:  # the oracle's norm with these weights would differ everywhere
                rope.decode(q[:, :1], k[:, :1], step)
                rope.prefill(q, k, step)
                _synchronize(place)
                y = to_float64(q)
                assert not np.allclose(
                    _rows(y, head_dim),
                    rms_norm_reference(_rows(q64, head_dim), q_w64, rope.norm_eps),
                    atol=1e-3,
                )
                continue
            rope.prefill(q, k, step, q_norm_weight=q_weight, k_norm_weight=k_weight)
            _synchronize(place)
            positions = np.broadcast_to(step + np.arange(T), (B, T))
            what = f"step {step}"
            _check(q, q64, q_w64, rope, frequencies, neox, positions, "float32", f"q {what}")
            _check(k, k64, k_w64, rope, frequencies, neox, positions, "float32", f"k {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("rope_layout", ("neox", "interleaved"))
def test_gpu_unaligned_views_take_the_one_element_path(rng, rope_layout, dtype):
    """q starting one element into its buffer: no 16-byte access fits, the one-element
    kernel (VEC == 1) runs, and a row then has more chunks than a warp has lanes."""
    head_dim = 128
    rope = RoPE(head_dim, HEADS, KV_HEADS, rope_layout=rope_layout)
    frequencies = standard_frequencies(head_dim)
    buffer, x64 = _data(rng, (B, T, 1 + (HEADS + KV_HEADS) * head_dim), dtype, "cuda")
    q, k = buffer[..., 1 : 1 + HEADS * head_dim], buffer[..., 1 + HEADS * head_dim :]
    q_weight, q_w64 = _weight(rng, head_dim, dtype, "qwen3", "cuda")
    k_weight, k_w64 = _weight(rng, head_dim, "float32", "qwen3", "cuda")
    rope.prefill(q, k, 7, q_norm_weight=q_weight, k_norm_weight=k_weight)
    torch.cuda.synchronize()
    positions = np.broadcast_to(7 + np.arange(T), (B, T))
    neox = rope_layout == "neox"
    _check(q, x64[..., 1 : 1 + HEADS * head_dim], q_w64, rope, frequencies, neox, positions,
           dtype, "q")  # fmt: skip
    _check(k, x64[..., 1 + HEADS * head_dim :], k_w64, rope, frequencies, neox, positions,
           dtype, "k")  # fmt: skip
    assert to_float64(buffer)[..., 0].tolist() == x64[..., 0].tolist()


def _packed_tokens_match_oracle(
    rng, case: str, dtype: str, weights: str, tokens: int, mrope_section=None
):
    """The norm and rotation of ``tokens`` packed tokens at random positions (q and k views of
    one fused buffer; ``mrope_section``: MRoPE's three rows of them) in one launch, every
    element against the oracle and v untouched; returns the launch's block (which layout
    took it)."""
    extra = {} if mrope_section is None else {"mrope_section": mrope_section}
    rope, head_dim, frequencies, neox = _rope(case, weights, **extra)
    width, q_end, k_end = _fused_columns(head_dim)
    qkv, x64 = _data(rng, (tokens, width), dtype, "cuda")
    q_weight, q_w64 = _weight(rng, head_dim, dtype, weights, "cuda")
    k_weight, k_w64 = _weight(rng, head_dim, dtype, weights, "cuda")
    ids = rng.integers(0, 1 << 20, tokens if mrope_section is None else (3, tokens))
    per_pair = mrope_section is not None
    positions = mrope_pair_positions(ids, mrope_section, False) if per_pair else ids
    _rotate._plans.clear()
    rope.forward(
        qkv[:, :q_end], qkv[:, q_end:k_end], positions=torch.from_numpy(ids).cuda(),
        q_norm_weight=q_weight, k_norm_weight=k_weight,
    )  # fmt: skip
    torch.cuda.synchronize()
    (plan,) = _rotate._plans.values()
    np.testing.assert_array_equal(to_float64(qkv)[:, k_end:], x64[:, k_end:], "v changed")
    for name, columns, w64 in (("q", slice(0, q_end), q_w64), ("k", slice(q_end, k_end), k_w64)):
        _check(
            qkv[:, columns], x64[:, columns], w64, rope, frequencies, neox, positions, dtype,
            name, per_pair,
        )  # fmt: skip
    rope.check()
    return plan.steps[0].block


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
@pytest.mark.parametrize(
    "case", ("D128-partial64-neox", "D64-interleaved", "D256-interleaved", "D128-neox")
)
def test_gpu_large_launches_match_oracle(rng, case, dtype):
    """Enough tokens for the large-launch layouts, which the small cases above never reach:
    _rotate._LARGE_LAUNCH_LAYOUT (more heads a thread, in rounds) and, for 16-bit rows rotated
    whole (D64, D128), NORM_ROWS (one 16-byte pack a lane, the neox partner by shuffle).
    Packed tokens at random positions (an odd count: the last block runs past them), q and k
    views of one fused buffer, a tail past rotary_dim or a row wider than a warp's chunks,
    every element against the oracle."""
    block = _packed_tokens_match_oracle(rng, case, dtype, "qwen3", 16385)  # (large from 16384)
    rows_layout = dtype != "float32" and case in ("D64-interleaved", "D128-neox")
    assert (math.prod(block) == _rotate._ROWS_THREADS) == rows_layout, block


@pytest.mark.gpu
@pytest.mark.parametrize("positions", ("ids", "mrope"))
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("case", ("D64-interleaved", "D128-neox"))
def test_gpu_mid_sized_launches_take_whole_rows_a_lane(
    rng, monkeypatch, case, dtype, weights, positions
):
    """16-bit rows rotated whole at mid sizes take rope_rotate_packs with the norm (16 bytes
    of a row a lane, a neox lane's from both halves, four rows of one operand a lane, each
    row's sum of squares over its lanes by shuffles; ``_rotate._PACK_MIN_HEAD_ROWS`` lowered
    here to this call's rows, and 8 q / 4 kv heads: whole groups of four): packed tokens at
    random positions (an odd count: a last warp past the last row), or MRoPE's three rows of
    them in sections on lane boundaries, q and k views of one fused buffer, weights in the
    data's type and in float32, every element against the oracle, v untouched."""
    monkeypatch.setattr(_rotate, "_PACK_MIN_HEAD_ROWS", 0)
    monkeypatch.setitem(globals(), "HEADS", 8)
    monkeypatch.setitem(globals(), "KV_HEADS", 4)
    section = None
    if positions == "mrope":
        section = MROPE_SECTIONS[CASES[case][1] // 2]["mrope"]
    block = _packed_tokens_match_oracle(rng, case, dtype, weights, 1031, section)
    assert block == (_rotate._PACK_THREADS, 1, 1), block


# --------------------------------------------------------------------------- HF modules


def _hf_rotary(head_dim: int, positions: np.ndarray, like: torch.Tensor):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config(
        head_dim=head_dim, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        hidden_size=HEADS * head_dim, rope_parameters={"rope_type": "default", "rope_theta": BASE},
    )  # fmt: skip
    rotary = Qwen3RotaryEmbedding(config).to(like.device)
    return rotary(like, torch.from_numpy(positions).to(like.device))


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("norm", ("Qwen3RMSNorm", "Gemma3RMSNorm"))
def test_matches_hf_norm_then_rotary(rng, norm, dtype, place):
    """HF's module (weights in the data's dtype for Qwen3, float32 for Gemma) and HF's
    ``apply_rotary_pos_emb`` at small positions: float32 within float32 noise; bf16 within
    the two bf16 units that HF's intermediate roundings add."""
    pytest.importorskip("transformers")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    head_dim = 64
    gemma = norm == "Gemma3RMSNorm"
    weights = "gemma-float32" if gemma else "qwen3"
    rope = RoPE(head_dim, HEADS, KV_HEADS, norm_eps=1e-6, norm_weight_offset=float(gemma))
    torch_dtype = getattr(torch, dtype)
    q = torch.from_numpy(rng.standard_normal((B, T, HEADS, head_dim))).to(place, torch_dtype)
    k = torch.from_numpy(rng.standard_normal((B, T, KV_HEADS, head_dim))).to(place, torch_dtype)
    modules = []
    for _ in ("q", "k"):
        module = (Gemma3RMSNorm if gemma else Qwen3RMSNorm)(head_dim, eps=1e-6).to(place)
        weight, _ = _weight(rng, head_dim, dtype, weights, place)
        with torch.no_grad():
            module.weight.copy_(weight)
        modules.append(module.to(weight.dtype))
    positions = rng.integers(0, 64, (B, T))
    cos, sin = _hf_rotary(head_dim, positions, q)
    with torch.no_grad():
        expected = apply_rotary_pos_emb(modules[0](q), modules[1](k), cos, sin, unsqueeze_dim=2)
        got = apply_rope(
            q, k, rope, positions=torch.from_numpy(positions).to(place),
            q_norm_weight=modules[0].weight, k_norm_weight=modules[1].weight,
        )  # fmt: skip
    for ours, theirs, what in zip(got, expected, ("q", "k"), strict=True):
        scale = float(theirs.abs().max())
        atol = 2e-6 * scale if dtype == "float32" else 2 * 2**-8 * scale
        torch.testing.assert_close(
            ours.float(), theirs.float(), rtol=0, atol=atol, msg=f"{what} vs HF {norm}"
        )


# --------------------------------------------------------------------------- autograd


def _torch_reference(q, k, q_weight, k_weight, rope, positions, frequencies, neox):
    """The same math as torch ops in float64 (autograd differentiates it)."""
    settings = (rope.norm_eps, rope.norm_weight_offset, rope.head_dim, positions, frequencies)
    return [
        torch_norm_rope_reference(x, weight, *settings, neox)
        for x, weight in ((q, q_weight), (k, k_weight))
    ]


@pytest.mark.parametrize("case", ("D128-partial64-neox", "D64-interleaved"))
def test_the_numpy_and_torch_oracles_agree(rng, case):
    """The torch form of the norm and rotation (the gradients' oracle) gives the numpy
    oracle's float64 numbers, amplitude and unrotated tail included."""
    head_dim, rotary_dim, layout = CASES[case]
    frequencies = yarn_frequencies(rotary_dim, 10000.0, 4.0, 2048)  # (an amplitude > 1)
    x = rng.standard_normal((B, T, HEADS * head_dim))
    weight = rng.standard_normal(head_dim)
    ids = rng.integers(0, 1 << 16, (B, T))
    torch_form = torch_norm_rope_reference(
        torch.from_numpy(x), torch.from_numpy(weight), 1e-6, 1.0, head_dim, ids, frequencies,
        layout == "neox",
    )  # fmt: skip
    rows = x.reshape(B, T, HEADS, head_dim)
    normed = rms_norm_reference(rows, weight, 1e-6, 1.0)
    numpy_form = rope_reference(normed, ids[..., None], frequencies, neox=layout == "neox")
    np.testing.assert_allclose(
        torch_form.numpy(), numpy_form.reshape(x.shape), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("case", ("D128-partial64-neox", "D64-interleaved"))
def test_gradients_match_torch_autograd_of_the_math(rng, case, place):
    """apply_rope's gradients (to q, k and both weights: the rotation's transpose, then the
    norm's backward) equal autograd through the float64 torch math."""
    rope, head_dim, frequencies, neox = _rope(case, "gemma-float32")
    shapes = ((B, T, HEADS * head_dim), (B, T, KV_HEADS * head_dim), (head_dim,), (head_dim,))
    inputs = [_randn(rng, place, *shape, around=0.1).requires_grad_() for shape in shapes]
    ids = rng.integers(0, 1 << 16, (B, T))
    positions = torch.from_numpy(ids).to(place)
    got = apply_rope(inputs[0], inputs[1], rope, positions=positions,
                     q_norm_weight=inputs[2], k_norm_weight=inputs[3])  # fmt: skip
    grads = [_randn(rng, place, *t.shape) for t in got]
    ours = torch.autograd.grad(got, inputs, grads)
    references = [t.detach().double().requires_grad_() for t in inputs]
    expected = _torch_reference(*references, rope, ids, frequencies, neox)
    theirs = torch.autograd.grad(expected, references, [g.double() for g in grads])
    relative = 1e-10 if place == "cpu" else 2e-5
    for name, mine, reference in zip(("q", "k", "q_weight", "k_weight"), ours, theirs, strict=True):
        atol = relative * float(reference.abs().max())
        torch.testing.assert_close(mine.double(), reference, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("rope_layout", ("neox", "interleaved"))
@pytest.mark.parametrize("offset", (0.0, 1.0))
def test_gradcheck(rng, offset, rope_layout):
    rope = RoPE(8, 2, 1, rotary_dim=4, rope_layout=rope_layout, norm_weight_offset=offset)

    def leaf(*shape):
        return torch.from_numpy(rng.standard_normal(shape)).requires_grad_()

    inputs = (leaf(1, 3, 16), leaf(1, 3, 8), leaf(8), leaf(8))
    positions = torch.tensor([[5, 1030, 2]])

    def function(q, k, q_weight, k_weight):
        return apply_rope(q, k, rope, positions=positions, q_norm_weight=q_weight,
                          k_norm_weight=k_weight)  # fmt: skip

    assert_gradcheck(function, inputs)


@pytest.mark.parametrize("place", PLACES)
def test_in_place_under_autograd_is_recorded(rng, place):
    """forward(q, k, ...) on views of a non-leaf with Parameter weights: the same gradients
    (to the projection and to both weights) as the out-of-place apply_rope."""
    rope, head_dim, _, _ = _rope("D64-neox")
    width, q_end, k_end = _fused_columns(head_dim)
    x, projection = _randn(rng, place, B, T, 8), _randn(rng, place, 8, width)
    upstream = _randn(rng, place, B, T, width)
    weights = [_randn(rng, place, head_dim, around=1.0) for _ in "qk"]
    positions = torch.from_numpy(rng.integers(0, 4096, (B, T))).to(place)

    def run(in_place: bool):
        w = torch.nn.Parameter(projection.clone())
        q_weight, k_weight = (torch.nn.Parameter(t.clone()) for t in weights)
        qkv = x @ w
        q, k = qkv[..., :q_end], qkv[..., q_end:k_end]
        norm = dict(q_norm_weight=q_weight, k_norm_weight=k_weight)
        if in_place:
            rope.forward(q, k, positions=positions, **norm)
        else:
            q, k = apply_rope(q, k, rope, positions=positions, **norm)
            qkv = torch.cat([q, k, qkv[..., k_end:]], dim=-1)
        (qkv * upstream).sum().backward()
        return qkv.detach(), w.grad, q_weight.grad, k_weight.grad

    for name, a, b in zip(("qkv", "w", "q_weight", "k_weight"), run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, msg=name)


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("place", PLACES)
def test_compiles_fullgraph_without_recompiling(rng, place):
    rope, head_dim, frequencies, neox = _rope("D128-partial64-neox")
    width, q_end, k_end = _fused_columns(head_dim)

    def attention_inputs(x, w, positions, q_weight, k_weight):
        qkv = x @ w
        rope.forward(qkv[..., :q_end], qkv[..., q_end:k_end], positions=positions,
                     q_norm_weight=q_weight, k_norm_weight=k_weight)  # fmt: skip
        return qkv

    for backend in backends(place):
        compiled, counter = compile_counting(attention_inputs, dynamic=True, backend=backend)
        for seq in (5, 9, 7):
            x, w = _randn(rng, place, B, seq, 8), _randn(rng, place, 8, width)
            weights = [_randn(rng, place, head_dim, around=1.0) for _ in "qk"]
            ids = rng.integers(0, 1 << 16, (B, seq))
            positions = torch.from_numpy(ids.astype(np.int32)).to(place)
            with torch.no_grad():  # in place, through rope_qk_
                actual = compiled(x, w, positions, *weights)
            torch.testing.assert_close(actual, attention_inputs(x, w, positions, *weights))
            x64 = (x @ w).double().cpu().numpy()
            w64 = weights[0].double().cpu().numpy()
            _check(actual[..., :q_end], x64[..., :q_end], w64, rope, frequencies, neox, ids,
                   "float64" if place == "cpu" else "float32", "compiled q")  # fmt: skip

            # under autograd: recorded, and the same gradients as eager
            leaves = [[t.clone().requires_grad_() for t in (w, *weights)] for _ in range(2)]
            actual = compiled(x, leaves[0][0], positions, *leaves[0][1:])
            expected = attention_inputs(x, leaves[1][0], positions, *leaves[1][1:])
            torch.testing.assert_close(actual, expected)
            grad = _randn(rng, place, *actual.shape)
            actual.backward(grad)
            expected.backward(grad)
            for mine, theirs in zip(leaves[0], leaves[1], strict=True):
                torch.testing.assert_close(mine.grad, theirs.grad)
            counter.first_call_done()
        counter.assert_no_recompile()


# --------------------------------------------------------------------------- refused calls


def _bad_calls(place):
    head_dim = 64
    other = "cpu" if place == "cuda" else "meta"

    def zeros(*shape, dtype=torch.float32, device=place):
        return torch.zeros(*shape, dtype=dtype, device=device)

    good = zeros(head_dim)
    buffer = torch.ones(1, 2, (HEADS + KV_HEADS) * head_dim + head_dim, device=place)
    return {  # name: (call(rope, q, k), error, match)
        "shape": (lambda r, q, k: r.prefill(q, k, 0, q_norm_weight=zeros(head_dim + 2),
                                            k_norm_weight=good), ValueError, "q_norm_weight"),
        "2-D": (lambda r, q, k: r.prefill(q, k, 0, q_norm_weight=good,
                                          k_norm_weight=zeros(1, head_dim)),
                ValueError, "k_norm_weight"),
        "dtype": (lambda r, q, k: r.prefill(q, k, 0, q_norm_weight=good,
                                            k_norm_weight=zeros(head_dim, dtype=torch.float16)),
                  TypeError, "k_norm_weight must be float32 or the data's dtype"),
        "int": (lambda r, q, k: r.forward(q, k, q_norm_weight=zeros(head_dim, dtype=torch.int32),
                                          k_norm_weight=good), TypeError, "q_norm_weight"),
        "device": (lambda r, q, k: r.decode(q[:, :1], k[:, :1], 3,
                                            q_norm_weight=zeros(head_dim, device=other),
                                            k_norm_weight=good),
                   (ValueError, TypeError), "q_norm_weight"),
        "strided": (lambda r, q, k: r.prefill(q, k, 0, q_norm_weight=zeros(2 * head_dim)[::2],
                                              k_norm_weight=good), ValueError, "contiguous"),
        "k-weight-only": (lambda r, q, k: r.prefill(q, k, 0, k_norm_weight=good), ValueError,
                          "without q_norm_weight"),
        "q-weight-only": (lambda r, q, k: r.prefill(q, k, 0, q_norm_weight=good), ValueError,
                          "k_norm_weight is None"),
        "k-weight-without-k": (lambda r, q, k: r.prefill(q, None, 0, q_norm_weight=good,
                                                         k_norm_weight=good),
                               ValueError, "without k"),
        "weight-inside-q": (lambda r, q, k: r.prefill(q, k, 0, q_norm_weight=q[0, 0, :head_dim],
                                                      k_norm_weight=good),
                            ValueError, "overlaps q"),
        "weight-in-the-buffer": (
            lambda r, q, k: r.prefill(buffer[..., : HEADS * head_dim],
                                      buffer[..., HEADS * head_dim : (HEADS + KV_HEADS) * head_dim],
                                      0, q_norm_weight=good,
                                      k_norm_weight=buffer[0, 0, (HEADS + KV_HEADS) * head_dim :]),
            None, None),  # apart from q and k (the v part): allowed
        "backward": (lambda r, q, k: r.backward(q, k, 0, q_norm_weight=good), TypeError,
                     "unexpected keyword argument 'q_norm_weight'"),
    }  # fmt: skip


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("name", list(_bad_calls("cpu")))
def test_bad_weights_are_refused_before_any_write(rng, name, place):
    rope, head_dim, _, _ = _rope("D64-neox")
    call, error, match = _bad_calls(place)[name]
    q, q64 = _data(rng, (1, 2, HEADS * head_dim), "float32", place)
    k, k64 = _data(rng, (1, 2, KV_HEADS * head_dim), "float32", place)
    if error is None:
        call(rope, q, k)
        return
    with pytest.raises(error, match=match):
        call(rope, q, k)
    _synchronize(place)
    np.testing.assert_array_equal(to_float64(q), q64)
    np.testing.assert_array_equal(to_float64(k), k64)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(norm_eps=-1e-6), "norm_eps"),
        (dict(norm_eps=math.nan), "norm_eps"),
        (dict(norm_weight_offset="1"), "norm_weight_offset"),
        (dict(norm_weight_offset=math.inf), "norm_weight_offset"),
        # finite, but inf in the float32 arithmetic (the output would be 0 or inf)
        (dict(norm_eps=1e39), "norm_eps must lie within float32's range"),
        (dict(norm_weight_offset=-1e39), "norm_weight_offset must lie within float32's range"),
    ],
)
def test_constructor_refuses_bad_norm_settings(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RoPE(64, 4, 2, **kwargs)


def test_constructor_takes_float32s_largest_settings():
    largest = float(np.finfo(np.float32).max)
    rope = RoPE(64, 4, 2, norm_eps=largest, norm_weight_offset=-largest)
    assert (rope.norm_eps, rope.norm_weight_offset) == (largest, -largest)


# --------------------------------------------------------------------------- CUDA graphs

# In its own process: a failed capture poisons the CUDA context.
_CAPTURE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    sys.path.insert(0, "tests")
    from _cases import assert_graph_replays_like_eager
    from tileops_cupy.rope import RoPE

    call = sys.argv[1]
    rng = np.random.default_rng(int(sys.argv[2]))
    heads, kv_heads, head_dim = 8, 2, 128
    batch, seq = (4, 1) if call == "decode" else (2, 16)
    rope = RoPE(head_dim, heads, kv_heads, max_position=8192)
    width = (heads + 2 * kv_heads) * head_dim
    q_weight = torch.from_numpy(rng.uniform(0.5, 1.5, head_dim)).to("cuda", torch.bfloat16)
    k_weight = torch.from_numpy(rng.uniform(0.5, 1.5, head_dim)).to("cuda", torch.float32)

    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim

    def fresh():
        qkv = torch.from_numpy(rng.standard_normal((batch, seq, width))).to("cuda", torch.bfloat16)
        positions = torch.from_numpy(rng.integers(0, 4096, batch).astype(np.int32)).cuda()
        return [qkv, positions]

    def step(qkv, positions):
        run = rope.decode if call == "decode" else rope.prefill
        run(qkv[..., :q_end], qkv[..., q_end:k_end], positions, q_norm_weight=q_weight,
            k_norm_weight=k_weight)

    def change_weight():  # the graph reads the weights' memory at each replay
        with torch.no_grad():
            q_weight.mul_(1.25)

    def check(new, written):
        assert not torch.equal(written[0][..., :q_end], new[0][..., :q_end])
        assert torch.equal(written[0][..., k_end:], new[0][..., k_end:])

    assert_graph_replays_like_eager(step, fresh, check, change_weight)
    rope.check()
    print("replayed", call)
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("call", ("prefill", "decode"))
def test_gpu_cuda_graph_capture_and_replay(call):
    assert_runs_in_own_process(_CAPTURE, call, "13")
