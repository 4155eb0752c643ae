"""MRoPE on the Q/K component (issue 11 item 2): ``RoPE(..., mrope_section=(t, h, w),
mrope_interleaved=...)`` with positions ``(3, *token_shape)``, against HF's
``Qwen2VLRotaryEmbedding`` (sectioned) and ``Qwen3VLTextRotaryEmbedding`` (interleaved) at
small positions and against the float64 oracle (``_oracle``) at positions up to 2**24 - 1.

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
    assert_matches_oracle,
    assert_positions_gradients,
    mrope_pair_positions,
    random_data,
    random_tensor,
    standard_frequencies,
    to_float64,
    to_framework,
)

from tileops_cupy.rope import RoPE, apply_rope

B, T, HEADS, KV_HEADS, HEAD_DIM = 2, 5, 4, 2, 32
LIMIT = 1 << 24
LAYOUTS = ("BT", "BTHD", "packed")
BASE = 10000.0
# name: (mrope_section, interleaved, rotary_dim, rope_layout)
MROPE_CASES = {
    "sectioned": ((4, 6, 6), False, HEAD_DIM, "neox"),  # Qwen2-VL's proportions
    "interleaved": ((6, 5, 5), True, HEAD_DIM, "neox"),  # Qwen3-VL's
    "sectioned-partial-interleaved-layout": ((2, 3, 3), False, 16, "interleaved"),
    "interleaved-partial-empty-row": ((5, 3, 0), True, 16, "neox"),
}


def _rope(case: str, **extra) -> tuple[RoPE, tuple, bool, bool]:
    section, interleaved, rotary_dim, layout = MROPE_CASES[case]
    rope = RoPE(
        HEAD_DIM, HEADS, KV_HEADS, scheme=None, rotary_dim=rotary_dim, rope_layout=layout,
        mrope_section=section, mrope_interleaved=interleaved, **extra,
    )  # fmt: skip
    return rope, section, interleaved, layout == "neox"


def _token_shape(layout: str, seq=T) -> tuple[int, ...]:
    return (B * seq,) if layout == "packed" else (B, seq)


def _data(rng, layout, heads, dtype, place, seq=T):
    """(tensor on place, its float64 values as [*tokens, heads, head_dim])."""
    tokens = _token_shape(layout, seq)
    shape = (*tokens, heads, HEAD_DIM) if layout == "BTHD" else (*tokens, heads * HEAD_DIM)
    host = random_data(rng, shape, dtype)
    x64 = host.astype(np.float64).reshape(*tokens, heads, HEAD_DIM)
    return to_framework(host, "torch" if place == "cpu" else "torch-cuda"), x64


def _thw(rng, layout, place, dtype="int64", limit=LIMIT, seq=T):
    """(positions [3, *tokens] on place, int64 values): rows that differ, anywhere below
    ``limit``, both ends included."""
    tokens = _token_shape(layout, seq)
    ids = rng.integers(0, limit, (3, *tokens))
    flat = ids.reshape(-1)
    ends = rng.permutation(flat.size)[:2]
    flat[ends[0]], flat[ends[1]] = 0, limit - 1
    return torch.from_numpy(ids.astype(dtype)).to(place), ids


def _assert_mrope(y, x64, ids, case, dtype, what, inverse=False):
    section, interleaved, rotary_dim, layout = MROPE_CASES[case]
    per_pair = mrope_pair_positions(ids, section, interleaved)[..., None, :]  # over heads
    assert_matches_oracle(
        to_float64(y).reshape(x64.shape), x64, per_pair, standard_frequencies(rotary_dim, BASE),
        dtype, neox=layout == "neox", inverse=inverse, per_pair=True, what=what,
    )  # fmt: skip


def _synchronize(place):
    if place == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- vs HF


def _hf_embedding(section, interleaved, head_dim):
    if interleaved:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

        config, module = Qwen3VLTextConfig, Qwen3VLTextRotaryEmbedding
    else:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

        config, module = Qwen2VLTextConfig, Qwen2VLRotaryEmbedding
    parameters = {"rope_type": "default", "rope_theta": BASE, "mrope_section": list(section)}
    if interleaved:
        parameters["mrope_interleaved"] = True
    small = config(
        hidden_size=HEADS * head_dim, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=head_dim, rope_parameters=parameters,
    )  # fmt: skip
    return module(small)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ("sectioned", "interleaved"))
def test_mrope_matches_hf_modules(rng, case, layout, place):
    """HF computes cos/sin in float32 (positions * inv_freq rounded first), so at small
    positions its values are within a few float32 units of ours."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    section, interleaved, _, _ = MROPE_CASES[case]
    rope, *_ = _rope(case)
    q, q64 = _data(rng, layout, HEADS, "float32", place)
    k, k64 = _data(rng, layout, KV_HEADS, "float32", place)
    positions, ids = _thw(rng, layout, place, limit=64)
    rope.forward(q, k, positions=positions)

    hf = _hf_embedding(section, interleaved, HEAD_DIM)
    hf_ids = torch.from_numpy(ids.reshape(3, B, T) if layout == "packed" else ids)
    x = torch.zeros(1, dtype=torch.float64)
    cos, sin = hf(x, hf_ids)  # [B, T, head_dim], HF's float32 values
    expected_q, expected_k = apply_rotary_pos_emb(
        torch.from_numpy(q64.reshape(B, T, HEADS, HEAD_DIM)),
        torch.from_numpy(k64.reshape(B, T, KV_HEADS, HEAD_DIM)), cos, sin, unsqueeze_dim=2,
    )  # fmt: skip
    for got, want, x64 in ((q, expected_q, q64), (k, expected_k, k64)):
        got = to_float64(got).reshape(B, T, -1, HEAD_DIM)
        scale = float(np.abs(x64).max())
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-5 * scale)


# --------------------------------------------------------------------------- vs float64


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("ids_dtype", ("int32", "int64"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", MROPE_CASES)
def test_mrope_matches_oracle_up_to_2_24(rng, case, layout, ids_dtype, dtype, place):
    rope, *_ = _rope(case)
    q, q64 = _data(rng, layout, HEADS, dtype, place)
    k, k64 = _data(rng, layout, KV_HEADS, dtype, place)
    positions, ids = _thw(rng, layout, place, ids_dtype)
    result = rope.forward(q, k, positions=positions)
    assert result[0] is q and result[1] is k
    _synchronize(place)
    _assert_mrope(q, q64, ids, case, dtype, "q")
    _assert_mrope(k, k64, ids, case, dtype, "k")
    rope.check()


def test_mrope_float64_host(rng):
    rope, *_ = _rope("interleaved")
    q, q64 = _data(rng, "packed", HEADS, "float64", "cpu")
    positions, ids = _thw(rng, "packed", "cpu")
    rope.forward(q, positions=positions)
    _assert_mrope(q, q64, ids, "interleaved", "float64", "q")


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("case", ("sectioned", "interleaved"))
def test_mrope_backward_and_apply_rope(rng, case, place):
    """apply_rope leaves its inputs untouched and equals the in-place call; backward is the
    inverse rotation at the same (3, ...) positions."""
    rope, *_ = _rope(case)
    q, q64 = _data(rng, "BT", HEADS, "float32", place)
    grad = q.clone()
    positions, ids = _thw(rng, "BT", place, "int32")
    q_rot, k_rot = apply_rope(q, None, rope, positions=positions)
    assert k_rot is None
    assert np.array_equal(to_float64(q).reshape(q64.shape), q64), "apply_rope changed q"
    rope.forward(q, positions=positions)
    assert torch.equal(q, q_rot)
    rope.backward(grad, None, positions=positions)
    _synchronize(place)
    _assert_mrope(grad, q64, ids, case, "float32", "backward", inverse=True)


@pytest.mark.parametrize("place", PLACES)
def test_mrope_with_one_position_for_all_rows_is_the_plain_rotation(rng, place):
    """prefill/decode offsets give the three rows one position (text tokens), and so do
    per-token positions whose rows are equal: both are the plain rotation, bit for bit."""
    rope, *_ = _rope("sectioned")
    plain = RoPE(HEAD_DIM, HEADS, KV_HEADS)
    q, _ = _data(rng, "BT", HEADS, "float32", place)
    expected = q.clone()
    rope.prefill(q, None, 1000)
    plain.prefill(expected, None, 1000)
    assert torch.equal(q, expected)
    ids = torch.from_numpy(rng.integers(0, LIMIT, (B, T))).to(place)
    rope.forward(q, positions=ids.expand(3, B, T).contiguous())
    plain.forward(expected, positions=ids)
    assert torch.equal(q, expected)


# --------------------------------------------------------------------------- torch


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("case", ("sectioned", "interleaved-partial-empty-row"))
def test_mrope_gradients(rng, case, place):
    rope, *_ = _rope(case)
    tokens = _token_shape("packed", seq=2)
    q = random_tensor(rng, (*tokens, HEADS * HEAD_DIM), place, requires_grad=True)
    k = random_tensor(rng, (*tokens, KV_HEADS * HEAD_DIM), place, requires_grad=True)
    positions, _ = _thw(rng, "packed", place, seq=2, limit=1 << 20)
    assert_positions_gradients(rng, rope, q, k, positions, place)


@pytest.mark.parametrize("place", PLACES)
def test_mrope_compiles_fullgraph_without_recompiling(rng, place):
    rope, *_ = _rope("interleaved")
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM

    def attention_inputs(x, w, positions):
        qkv = x @ w
        rope.forward(qkv[..., : HEADS * HEAD_DIM], qkv[..., HEADS * HEAD_DIM : 6 * HEAD_DIM],
                     positions=positions)  # fmt: skip
        return qkv

    compiled, counter = compile_counting(attention_inputs, dynamic=True)
    for seq in (5, 9, 7):
        tokens = _token_shape("packed", seq)
        x, w = random_tensor(rng, (*tokens, 8), place), random_tensor(rng, (8, width), place)
        positions, _ = _thw(rng, "packed", place, "int32", seq=seq)
        with torch.no_grad():  # in place, through rope_qk_
            torch.testing.assert_close(compiled(x, w, positions), attention_inputs(x, w, positions))
        w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
        actual, expected = compiled(x, w1, positions), attention_inputs(x, w2, positions)
        torch.testing.assert_close(actual, expected)
        grad = random_tensor(rng, actual.shape, place)
        actual.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(w1.grad, w2.grad)
        counter.first_call_done()
    counter.assert_no_recompile()


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "section, interleaved, error, match",
    [
        ((4, 6, 5), False, ValueError, "summing to rotary_dim/2 = 16"),
        ((8, 8), False, ValueError, "3 non-negative ints"),
        ((20, -2, -2), False, ValueError, "non-negative"),
        ((4.0, 6, 6), False, ValueError, "ints"),
        ((True, 9, 6), False, ValueError, "ints"),
        ("4,6,6", False, ValueError, "mrope_section"),
        (None, True, ValueError, "needs an mrope_section"),
        ((4, 6, 6), 1, TypeError, "mrope_interleaved must be a bool"),
    ],
)
def test_mrope_construction_errors(section, interleaved, error, match):
    with pytest.raises(error, match=match):
        RoPE(HEAD_DIM, HEADS, mrope_section=section, mrope_interleaved=interleaved)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(
    "shape, match",
    [((B * T,), r"\[3, N\]"), ((2, B * T), r"\[3, N\]"), ((3, B, T), "q must be")],
)
def test_mrope_positions_of_the_wrong_shape_are_refused_before_any_write(rng, shape, match, place):
    rope, *_ = _rope("sectioned")
    q, _ = _data(rng, "packed", HEADS, "float32", place)
    before = q.clone()
    positions = torch.zeros(shape, dtype=torch.int64, device=place)
    with pytest.raises(ValueError, match=match):
        rope.forward(q, positions=positions)
    assert torch.equal(q, before)


@pytest.mark.parametrize("place", PLACES)
def test_mrope_host_positions_out_of_range_are_refused_before_any_write(rng, place):
    rope, *_ = _rope("interleaved", max_position=4096)
    q, _ = _data(rng, "BT", HEADS, "float32", place)
    k, _ = _data(rng, "BT", KV_HEADS, "float32", place)
    before = (q.clone(), k.clone())
    ids = rng.integers(0, 4096, (3, B, T))
    ids[2, 1, 3] = 4096  # one width position past the limit
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 4096\)"):
        rope.forward(q, k, positions=ids)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.gpu
def test_gpu_mrope_device_positions_out_of_range_are_flagged_and_clamped(rng):
    rope, *_ = _rope("sectioned", max_position=4096)
    q, _ = _data(rng, "packed", HEADS, "float32", "cuda")
    positions, _ = _thw(rng, "packed", "cuda", limit=4096)
    positions[1, 3] = 5000  # a height position past the limit: clamped, flagged
    rope.forward(q, positions=positions)
    with pytest.raises(ValueError, match="outside"):
        rope.check()
    assert torch.isfinite(q).all()
    rope.check()  # the flag was taken


# --------------------------------------------------------------------------- CUDA graphs

_CAPTURE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    sys.path.insert(0, "tests")
    from _cases import assert_graph_replays_like_eager
    from _oracle import assert_matches_oracle, mrope_pair_positions, standard_frequencies
    from tileops_cupy.rope import RoPE

    interleaved = sys.argv[1] == "interleaved"
    rng = np.random.default_rng(int(sys.argv[2]))
    heads, kv_heads, head_dim, tokens = 8, 2, 128, 48
    section = (24, 20, 20) if interleaved else (16, 24, 24)
    rope = RoPE(head_dim, heads, kv_heads, mrope_section=section,
                mrope_interleaved=interleaved)
    width = (heads + 2 * kv_heads) * head_dim

    def fresh():
        qkv = torch.from_numpy(rng.standard_normal((tokens, width))).to("cuda", torch.bfloat16)
        ids = rng.integers(0, 1 << 24, (3, tokens))
        return [qkv, torch.from_numpy(ids).cuda()]

    def step(qkv, positions):
        rope.forward(qkv[:, : heads * head_dim],
                     qkv[:, heads * head_dim : (heads + kv_heads) * head_dim],
                     positions=positions)

    def check(new, written):
        x64 = new[0].double().cpu().numpy()[:, : heads * head_dim].reshape(tokens, heads, -1)
        y = written[0].double().cpu().numpy()[:, : heads * head_dim].reshape(tokens, heads, -1)
        ids = mrope_pair_positions(new[1].cpu().numpy(), section, interleaved)
        assert_matches_oracle(y, x64, ids[:, None, :], standard_frequencies(head_dim),
                              "bfloat16", per_pair=True)

    assert_graph_replays_like_eager(step, fresh, check)
    rope.check()
    print("replayed", sys.argv[1])
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ("sectioned", "interleaved"))
def test_gpu_mrope_cuda_graph_replays_with_new_positions(mode):
    assert_runs_in_own_process(_CAPTURE, mode, "13")


def test_mrope_positions_broadcast_helper_matches_the_row_map():
    """The oracle's HF-style recomposition and the package's row map agree (the kernel's
    mrope_row is the same formula as _rotate.mrope_rows)."""
    from tileops_cupy._rotate import mrope_rows

    for section, interleaved, _, _ in MROPE_CASES.values():
        pairs = sum(section)
        expected = mrope_pair_positions(np.arange(3)[:, None], section, interleaved)[0]
        assert expected.shape == (pairs,)
        assert np.array_equal(mrope_rows(section, interleaved, pairs), expected)
