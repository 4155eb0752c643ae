"""The ops as torch ops: autograd, torch.compile, torch.export, the in-place rules and
CUDA-graph capture. One file for both places: ``place`` is "cpu" (the host path, in CI)
or "cuda" (marked ``gpu``).

Gradients: ``torch.autograd.gradcheck`` in float64 on the host (the Bwd op is the exact
transpose, so the numerical Jacobian must match it); on the device (no float64 kernels)
the recorded gradient must equal the Bwd op applied to the upstream gradient, bit for bit.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from _cases import PLACES, assert_runs_in_own_process
from _compile import backends, compile_counting
from _oracle import (
    SEQUENCE_OP_IDS,
    SEQUENCE_OPS,
    assert_gradcheck,
    random_position_ids,
    random_tensor,
)

from tileops_cupy.rope import (
    RoPE,
    RoPEFwdOp,
    RoPENeoxPositionIdsBwdOp,
    RoPENeoxPositionIdsFwdOp,
    Standard,
    YaRN,
    apply_rope,
    apply_rope_with_cos_sin_cache,
)
from tileops_cupy.sequence_modeling import MHCPostBwdOp, MHCPostFwdOp, MHCPreBwdOp, MHCPreFwdOp

SHAPES = {"1d": (37, 16), "2d": (2, 19, 3, 16)}
GRADCHECK_SHAPES = {"1d": (6, 16), "2d": (2, 3, 2, 16)}  # the Jacobian is checked column by column
HEAD_DIM, HEADS, KV_HEADS = 16, 4, 2


def _seed_pair(rng, case, layout):
    """(Fwd op, Bwd op) of one seed case with equal parameters (LongRoPE draws factors)."""
    head_dim = SHAPES[layout][-1]
    state = rng.bit_generator.state
    fwd = case.make("Fwd", layout, head_dim, rng)[0]
    rng.bit_generator.state = state
    bwd = case.make("Bwd", layout, head_dim, rng)[0]
    return fwd, bwd


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", ("1d", "2d"))
@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
def test_seed_op_gradients(rng, case, layout, place):
    fwd, bwd = _seed_pair(rng, case, layout)
    x = random_tensor(rng, SHAPES[layout], place, requires_grad=True)
    y = fwd(x)
    assert y.grad_fn is not None, "gradients must flow through the op"
    grad = random_tensor(rng, SHAPES[layout], place)
    y.backward(grad)
    _assert_same(x.grad, bwd(grad))  # y = a R x  =>  dx = a R^T dy, the Bwd op
    if place == "cpu":
        small = random_tensor(rng, GRADCHECK_SHAPES[layout], place, requires_grad=True)
        for op in (fwd, bwd):
            assert_gradcheck(op, (small,))
            assert torch.autograd.gradgradcheck(op, (small,), check_fwd_over_rev=True)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("ids_dtype", (torch.int32, torch.int64))
def test_position_ids_op_gradients(rng, place, ids_dtype):
    tokens, max_position = 29, 3000
    fwd = RoPENeoxPositionIdsFwdOp(max_position=max_position, rotary_dim=8)
    bwd = RoPENeoxPositionIdsBwdOp(max_position=max_position, rotary_dim=8)
    ids_host = random_position_ids(rng, tokens, max_position, np.int64)
    ids = torch.from_numpy(ids_host).to(place, ids_dtype)
    x = random_tensor(rng, (tokens, 3, HEAD_DIM), place, requires_grad=True)
    grad = random_tensor(rng, (tokens, 3, HEAD_DIM), place)
    fwd(x, ids).backward(grad)
    _assert_same(x.grad, bwd(grad, ids))
    if place == "cpu":
        x64 = x.detach().requires_grad_()
        assert_gradcheck(lambda t: fwd(t, ids), (x64,))


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("offsets", ("int", "tensor"))
def test_apply_rope_gradients(rng, place, offsets):
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, scheme=YaRN(scale=4.0), rotary_dim=8, max_position=4096)
    q = random_tensor(rng, (2, 5, HEADS * HEAD_DIM), place, requires_grad=True)
    k = random_tensor(rng, (2, 5, KV_HEADS * HEAD_DIM), place, requires_grad=True)
    position = 700 if offsets == "int" else torch.tensor([3, 1500], device=place)
    q_rot, k_rot = apply_rope(q, k, rope, position)
    gq, gk = random_tensor(rng, q.shape, place), random_tensor(rng, k.shape, place)
    torch.autograd.backward((q_rot, k_rot), (gq, gk))
    expected = rope.backward(gq.clone(), gk.clone(), position)
    _assert_same(q.grad, expected[0])
    _assert_same(k.grad, expected[1])
    if place == "cpu":
        inputs = (q.detach().requires_grad_(), k.detach().requires_grad_())
        assert_gradcheck(lambda a, b: apply_rope(a, b, rope, position), inputs)


# --------------------------------------------------------------------------- in-place rules


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("call", ("forward", "prefill", "decode", "backward"))
def test_in_place_on_a_leaf_that_requires_grad_is_refused_before_any_write(rng, place, call):
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS)
    seq = 1 if call == "decode" else 2  # forward's position 0 alone would not rotate
    q = random_tensor(rng, (2, seq, HEADS * HEAD_DIM), place)
    k = random_tensor(rng, (2, seq, KV_HEADS * HEAD_DIM), place, requires_grad=True)
    before = q.clone(), k.detach().clone()
    args = {"forward": (), "prefill": (3,), "decode": (3,), "backward": (3,)}[call]
    with pytest.raises(ValueError, match="k is a leaf tensor that requires grad.*apply_rope"):
        getattr(rope, call)(q, k, *args)
    _assert_same(q, before[0])
    _assert_same(k.detach(), before[1])
    with torch.no_grad():  # torch allows in-place writes to leaves under no_grad: so do we
        getattr(rope, call)(q, k, *args)
    assert not torch.equal(k.detach(), before[1])


@pytest.mark.parametrize("place", PLACES)
def test_in_place_on_a_non_leaf_is_recorded_by_autograd(rng, place):
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, scheme=Standard(500.0))
    x = random_tensor(rng, (2, 6, 8), place, requires_grad=True)
    w = random_tensor(rng, (8, (HEADS + 2 * KV_HEADS) * HEAD_DIM), place, requires_grad=True)
    qkv = x @ w  # a fused projection: q and k are views of it, v follows
    q, k = qkv[..., : HEADS * HEAD_DIM], qkv[..., HEADS * HEAD_DIM : (HEADS + KV_HEADS) * 16]
    rope.prefill(q, k, 11)
    weights = random_tensor(rng, qkv.shape, place)
    (qkv * weights).sum().backward()

    # the same model, out of place
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    qkv2 = x2 @ w2
    q2, k2 = qkv2[..., : HEADS * HEAD_DIM], qkv2[..., HEADS * HEAD_DIM : (HEADS + KV_HEADS) * 16]
    q_rot, k_rot = apply_rope(q2, k2, rope, 11)
    out = torch.cat([q_rot, k_rot, qkv2[..., (HEADS + KV_HEADS) * 16 :]], dim=-1)
    (out * weights).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("grad_mode", ("recorded", "direct"))
def test_in_place_after_autograd_saved_the_tensor_makes_backward_raise(rng, place, grad_mode):
    """``q = x @ w; z = (q*q).sum(); rope.forward(q); z.backward()`` must not give a wrong
    w.grad: the write bumps q's version counter, so backward raises."""
    rope = RoPE(HEAD_DIM, HEADS)
    x = random_tensor(rng, (1, 3, 8), place)
    w = random_tensor(rng, (8, HEADS * HEAD_DIM), place, requires_grad=True)
    if grad_mode == "recorded":  # q requires grad: the call is recorded
        q = x @ w
        z = (q * q).sum()
        rope.forward(q)
    else:  # q needs no grad but was saved by a product that does: the direct path bumps it
        q = random_tensor(rng, (1, 3, HEADS * HEAD_DIM), place)
        z = (q * w.sum()).sum()
        rope.forward(q)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


# --------------------------------------------------------------------------- mHC


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("saved", ("positions", "offsets", "position_ids", "cos_sin_cache"))
def test_positions_changed_before_backward_make_it_raise(rng, place, saved):
    """The backward rotates at the forward's positions (or cache): a caller that changes
    them in place in between (a reused positions buffer) gets torch's "modified by an
    inplace operation" error, as for any tensor saved for backward, not a gradient taken
    at the new positions."""
    rope = RoPE(HEAD_DIM, 2, 1)
    q = random_tensor(rng, (1, 3, 2 * HEAD_DIM), place).float().requires_grad_()
    if saved == "positions":
        tensor = torch.tensor([[0, 5, 9]], device=place)
        out = apply_rope(q, None, rope, positions=tensor)[0]
    elif saved == "offsets":
        tensor = torch.tensor([4], device=place)
        out = apply_rope(q, None, rope, tensor)[0]
    elif saved == "position_ids":
        tensor = torch.tensor([0, 5, 9], device=place)
        out = RoPENeoxPositionIdsFwdOp(max_position=100)(q.view(3, 2, HEAD_DIM), tensor)
    else:
        tensor = random_tensor(rng, (16, HEAD_DIM), place).float()
        packed = q.view(3, 2 * HEAD_DIM)
        positions = torch.tensor([0, 5, 9], device=place)
        out = apply_rope_with_cos_sin_cache(positions, packed, None, HEAD_DIM, tensor)[0]
    tensor.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_traced_in_place_rotation_refuses_tensors_that_require_grad(rng):
    """A graph traced (or exported) with nothing requiring grad holds the raw in-place op,
    which has no gradient formula: replayed on tensors that require grad it must refuse,
    before writing, rather than pass gradients through as the identity."""
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS)

    def step(q):
        q = q * 1
        rope.prefill(q, None, 3)
        return q

    traced = torch.jit.trace(step, (random_tensor(rng, (1, 4, HEADS * HEAD_DIM), "cpu"),))
    q = random_tensor(rng, (1, 4, HEADS * HEAD_DIM), "cpu").requires_grad_()
    with pytest.raises(RuntimeError, match="rope_qk_ .* got tensors that require grad"):
        traced(q)
    leaf = q.detach().requires_grad_()
    before = leaf.detach().clone()
    call = (None, 3, None, None, False, False, None, None, *rope.config)  # offset 3, no k
    with pytest.raises(RuntimeError, match="rope_qk_ .* got tensors that require grad"):
        torch.ops.tileops_cupy.rope_qk_(leaf, None, *call)
    assert torch.equal(leaf.detach(), before)
    with torch.no_grad():  # (what the public calls dispatch: nothing to record)
        torch.ops.tileops_cupy.rope_qk_(leaf, None, *call)
    assert not torch.equal(leaf.detach(), before)


def _mhc_inputs(rng, place, n=2, c_x=16, batch=3, x_dtype=torch.float32):
    phi = torch.from_numpy(rng.standard_normal((n * c_x, n * n + 2 * n)) / 8).float().to(place)
    b = torch.from_numpy(rng.standard_normal(n * n + 2 * n) / 4).float().to(place)
    x = torch.from_numpy(rng.standard_normal((batch, n * c_x))).to(place, x_dtype)
    return phi, x, b


@pytest.mark.parametrize("place", PLACES)
def test_mhc_gradients_are_the_backward_ops(rng, place):
    """loss.backward() through pre -> layer -> post gives phi, x and b the gradients the
    MHCPreBwdOp / MHCPostBwdOp ops compute for the same upstream gradients."""
    phi, x, b = _mhc_inputs(rng, place, n=4, c_x=32, batch=5)
    alphas, repeat = (0.8, 1.1, 0.9), 6
    pre, post = MHCPreFwdOp(*alphas, repeat), MHCPostFwdOp()
    leaves = [t.clone().requires_grad_() for t in (phi, x, b)]
    x_res, x_layer, h_post = pre(*leaves)
    assert all(t.grad_fn is not None for t in (x_res, x_layer, h_post))
    layer_out = x_layer * 2  # a layer whose gradient (2 g) is exact in any order
    x_out = post(layer_out, h_post, x_res)
    weights = random_tensor(rng, x_out.shape, place).float()
    (x_out * weights).sum().backward()

    g_layer, g_h_post, g_x_res = MHCPostBwdOp()(layer_out.detach(), h_post.detach(),
                                                x_res.detach(), weights)  # fmt: skip
    g_x_layer = g_layer * 2
    expected = MHCPreBwdOp(*alphas, repeat)(phi, x, b, g_x_res, g_x_layer, g_h_post)
    for leaf, grad in zip(leaves, expected[:3], strict=True):
        _assert_same(leaf.grad, grad)


@pytest.mark.parametrize("place", PLACES)
def test_mhc_unused_outputs_take_zero_gradients(rng, place):
    phi, x, b = _mhc_inputs(rng, place)
    x = x.requires_grad_()
    pre = MHCPreFwdOp(1.0, 1.0, 1.0, 4)
    x_res, _, _ = pre(phi, x, b)  # x_layer and h_post unused
    x_res.sum().backward()
    zeros = [torch.zeros(s, device=place) for s in ((3, 32), (3, 16), (3, 2))]
    ones = torch.ones_like(x_res)
    expected = MHCPreBwdOp(1.0, 1.0, 1.0, 4)(phi, x.detach(), b, ones, zeros[1], zeros[2])
    _assert_same(x.grad, expected[1])


def test_mhc_second_order_gradients_raise(rng):
    """The mHC ops are once differentiable: a gradient taken with create_graph=True is the
    first-order gradient, and backpropagating through it raises an error that names the op
    (never a silently wrong or zero second-order gradient). Also for a backward op called
    directly on tensors that require grad."""
    phi, x, b = _mhc_inputs(rng, "cpu", n=2, c_x=8, batch=3)
    pre, post = MHCPreFwdOp(0.8, 1.1, 0.9, 3), MHCPostFwdOp()

    def loss(*leaves):
        x_res, x_layer, h_post = pre(*leaves)
        return post(x_layer * 2, h_post, x_res).square().sum()

    leaves = [t.clone().requires_grad_() for t in (phi, x, b)]
    first = torch.autograd.grad(loss(*leaves), leaves, create_graph=True)
    for actual, expected in zip(first, torch.autograd.grad(loss(*leaves), leaves), strict=True):
        _assert_same(actual.detach(), expected)
    second_order = "MHCPreBwdOp .* no derivative: second-order gradients through MHCPreFwdOp"
    with pytest.raises(RuntimeError, match=second_order):
        torch.autograd.grad(sum(g.square().sum() for g in first), leaves)

    layer, gates, res = (random_tensor(rng, s, "cpu").float() for s in ((3, 8), (3, 2), (3, 16)))
    post_leaves = [t.detach().requires_grad_() for t in (layer, gates, res)]
    out = post(*post_leaves)
    grads = torch.autograd.grad(out.square().sum(), post_leaves, create_graph=True)
    with pytest.raises(RuntimeError, match="MHCPostBwdOp .* through MHCPostFwdOp"):
        torch.autograd.grad(grads[1].sum(), post_leaves)

    with pytest.raises(RuntimeError, match=second_order):  # also under torch.func
        torch.func.grad(lambda x: torch.func.grad(loss, argnums=1)(phi, x, b).sum())(x)

    upstream = [torch.ones(s) for s in ((3, 16), (3, 8), (3, 2))]
    direct = MHCPreBwdOp(0.8, 1.1, 0.9, 3)(*leaves, *upstream)
    with pytest.raises(RuntimeError, match="MHCPreBwdOp .* no derivative"):
        direct[0].sum().backward()


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("case", SEQUENCE_OPS, ids=SEQUENCE_OP_IDS)
def test_seed_ops_compile_forward_and_backward(rng, case, place):
    fwd, _ = _seed_pair(rng, case, "2d")
    for backend in backends(place):

        def step(x):
            return (fwd(x) * 3).sin()

        compiled, counter = compile_counting(step, dynamic=True, backend=backend)
        for seq in (19, 33, 7):  # new sequence lengths: no recompile
            x = random_tensor(rng, (2, seq, 3, 16), place, requires_grad=True)
            x_eager = x.detach().requires_grad_()
            y, y_eager = compiled(x), step(x_eager)
            counter.first_call_done()
            torch.testing.assert_close(y, y_eager)
            grad = random_tensor(rng, y.shape, place)
            y.backward(grad)
            y_eager.backward(grad)
            torch.testing.assert_close(x.grad, x_eager.grad)
        counter.assert_no_recompile()


@pytest.mark.parametrize("place", PLACES)
def test_position_ids_op_compiles(rng, place):
    op = RoPENeoxPositionIdsFwdOp(max_position=4096, rotary_dim=8)
    for backend in backends(place):
        compiled, counter = compile_counting(
            lambda x, ids: op(x, ids) + 1, dynamic=True, backend=backend
        )
        for tokens in (9, 40, 17):
            x = random_tensor(rng, (tokens, 2, HEAD_DIM), place)
            ids = torch.from_numpy(random_position_ids(rng, tokens, 4096, np.int64)).to(place)
            torch.testing.assert_close(compiled(x, ids), op(x, ids) + 1)
            counter.first_call_done()
        counter.assert_no_recompile()


@pytest.mark.parametrize("place", PLACES)
def test_component_compiles_in_place_and_with_autograd(rng, place):
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, scheme=YaRN(scale=2.0), max_position=1 << 16)

    def attention_inputs(qkv, position):
        q, k = qkv[..., : HEADS * HEAD_DIM], qkv[..., HEADS * HEAD_DIM : (HEADS + KV_HEADS) * 16]
        rope.prefill(q, k, position)
        return qkv * 2

    def loss(x, w):
        return attention_inputs(x @ w, 3).square().sum()

    for backend in backends(place):
        compiled, counter = compile_counting(attention_inputs, dynamic=True, backend=backend)
        for seq in (3, 8, 5):
            positions = torch.tensor([5, 900], device=place)
            for position in (positions, 17 + seq):
                qkv = random_tensor(rng, (2, seq, (HEADS + 2 * KV_HEADS) * HEAD_DIM), place)
                expected = attention_inputs(qkv.clone(), position)
                torch.testing.assert_close(compiled(qkv, position), expected)
            # one graph per kind of position (tensor, int), then none for new lengths
            counter.first_call_done()
        counter.assert_no_recompile()

        # under autograd: the rotation is recorded, gradients match eager
        w = random_tensor(rng, (8, (HEADS + 2 * KV_HEADS) * HEAD_DIM), place, requires_grad=True)
        x = random_tensor(rng, (2, 5, 8), place)
        compiled, _ = compile_counting(loss, backend=backend)
        compiled(x, w).backward()
        grad = w.grad.clone()
        w.grad = None
        loss(x, w).backward()
        torch.testing.assert_close(grad, w.grad)


@pytest.mark.parametrize("place", PLACES)
def test_component_decode_and_apply_rope_compile(rng, place):
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, max_position=4096)

    def decode(q, k, positions):
        rope.decode(q, k, positions)
        return q + 0, k + 0

    def rotate(q, k):
        return apply_rope(q, k, rope, 9)

    for backend in backends(place):
        compiled_decode, _ = compile_counting(decode, backend=backend)
        compiled_rotate, _ = compile_counting(rotate, backend=backend)
        q = random_tensor(rng, (3, 1, HEADS * HEAD_DIM), place)
        k = random_tensor(rng, (3, 1, KV_HEADS * HEAD_DIM), place)
        positions = torch.tensor([0, 4095, 77], device=place, dtype=torch.int32)
        expected = decode(q.clone(), k.clone(), positions)
        actual = compiled_decode(q.clone(), k.clone(), positions)
        torch.testing.assert_close(actual, expected)
        q.requires_grad_()
        q_rot, _ = compiled_rotate(q, k)
        q_rot.sum().backward()
        torch.testing.assert_close(q.grad, rope.backward(torch.ones_like(q), None, 9)[0])


@pytest.mark.parametrize("place", PLACES)
def test_compiled_in_place_call_refuses_overlapping_q_and_k_before_any_write(rng, place):
    """Compiled, the in-place rotation of q and k that share memory is refused when the graph
    runs (the op sees the caller's tensors), before any write; disjoint views of the same
    buffer rotate as in eager mode."""
    rope = RoPE(HEAD_DIM, 2, 2)

    def rotate(rows, k_start):
        q, k = rows[..., : 2 * HEAD_DIM], rows[..., k_start : k_start + 2 * HEAD_DIM]
        rope.prefill(q, k, 5)
        return rows + 0

    for backend in backends(place):
        compiled, _ = compile_counting(rotate, backend=backend)
        rows = random_tensor(rng, (2, 3, 4 * HEAD_DIM), place)
        before = rows.clone()
        with pytest.raises(ValueError, match="^q and k overlap in memory"):
            compiled(rows, HEAD_DIM)
        assert torch.equal(rows, before)
        torch.testing.assert_close(compiled(rows, 2 * HEAD_DIM), rotate(before, 2 * HEAD_DIM))


def test_compiled_component_call_refuses_bad_shapes_when_traced(rng):
    """A component call that its eager form refuses (here k of other tokens than q) is
    refused as torch.compile traces it, by the op's fake implementation (torch wraps the
    error), before any graph runs: nothing is written."""
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS)

    def rotate(q, k):
        rope.prefill(q, k, 0)
        return q + 0

    compiled, _ = compile_counting(rotate)
    q = random_tensor(rng, (2, 3, HEADS * HEAD_DIM), "cpu")
    k = random_tensor(rng, (2, 4, KV_HEADS * HEAD_DIM), "cpu")
    before = q.clone(), k.clone()
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="q and k must share"):
        compiled(q, k)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize("place", PLACES)
def test_mhc_ops_compile(rng, place):
    pre, post = MHCPreFwdOp(0.8, 1.1, 0.9, 5), MHCPostFwdOp()

    def block(phi, x, b):
        x_res, x_layer, h_post = pre(phi, x, b)
        return post(torch.tanh(x_layer), h_post, x_res)

    for backend in backends(place):
        compiled, counter = compile_counting(block, dynamic=True, backend=backend)
        for batch in (3, 6, 9):
            phi, x, b = _mhc_inputs(rng, place, batch=batch)
            torch.testing.assert_close(compiled(phi, x, b), block(phi, x, b))
            # forward and backward: the same gradients as eager
            leaves = [t.clone().requires_grad_() for t in (phi, x, b)]
            eager_leaves = [t.clone().requires_grad_() for t in (phi, x, b)]
            compiled(*leaves).square().sum().backward()
            block(*eager_leaves).square().sum().backward()
            for leaf, eager in zip(leaves, eager_leaves, strict=True):
                torch.testing.assert_close(leaf.grad, eager.grad)
            counter.first_call_done()  # one graph without grad, one with: then no more
        counter.assert_no_recompile()


def test_export_traces_the_ops(rng):
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS)
    fwd = SEQUENCE_OPS[2].make("Fwd", "2d", HEAD_DIM, rng)[0]

    class Block(torch.nn.Module):
        def forward(self, x, qkv):
            q, k = qkv[..., : HEADS * HEAD_DIM], qkv[..., HEADS * HEAD_DIM : 6 * HEAD_DIM]
            q_rot, k_rot = apply_rope(q, k, rope, 4)
            return fwd(x), q_rot, k_rot

    x = random_tensor(rng, (2, 5, 3, HEAD_DIM), "cpu")
    qkv = random_tensor(rng, (2, 5, 8 * HEAD_DIM), "cpu")
    seq = torch.export.Dim("seq", min=2, max=4096)
    exported = torch.export.export(
        Block(), (x, qkv), dynamic_shapes=({1: seq}, {1: seq}), strict=True
    )
    names = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"tileops_cupy.rope.default", "tileops_cupy.rope_qk.default"} <= names
    x, qkv = (
        random_tensor(rng, (2, 9, 3, HEAD_DIM), "cpu"),
        random_tensor(rng, (2, 9, 8 * HEAD_DIM), "cpu"),
    )
    for actual, expected in zip(exported.module()(x, qkv), Block()(x, qkv), strict=True):
        _assert_same(actual, expected)


_LOAD_EXPORTED = """
import sys
import torch
import tileops_cupy  # (after torch: registers the ops; nothing else of the package is built)
program = torch.export.load(sys.argv[1])
inputs, expected = torch.load(sys.argv[2])
for actual, want in zip(program.module()(*inputs), expected, strict=True):
    assert torch.equal(actual, want)
print(sorted(name for name in sys.modules if name.startswith("tileops_cupy.")))
"""


def _opcheck_cases(rng, place):
    """name: (custom op, its arguments) of each registered op, as the public ops call them
    (inputs that require grad where autograd would record the call)."""
    ops = torch.ops.tileops_cupy
    seed, ids_op = RoPEFwdOp(input_layout="2d"), RoPENeoxPositionIdsFwdOp(max_position=100)
    rope = RoPE(HEAD_DIM, 2, 1, rotary_dim=8, norm_weight_offset=1.0)
    pre = MHCPreFwdOp(1.0, 0.9, 1.1, 4)

    def data(*shape, grad=False):
        return random_tensor(rng, shape, place).float().requires_grad_(grad)

    ids = torch.tensor([1, 5, 9, 2, 0], device=place)
    q, k = data(1, 3, 2 * HEAD_DIM, grad=True), data(1, 3, HEAD_DIM, grad=True)
    norms = data(HEAD_DIM, grad=True), data(HEAD_DIM, grad=True)
    call = (None, 3, None, None, False, False)  # offsets, offset, positions, cache, ...
    return {
        "rope": (ops.rope.default, (data(2, 3, 2, HEAD_DIM, grad=True), None, *seed.config)),
        "rope ids": (ops.rope.default, (data(5, 2, HEAD_DIM, grad=True), ids, *ids_op.config)),
        "rope_qk": (ops.rope_qk.default, (q, k, *call, None, None, *rope.config)),
        "rope_qk norm": (ops.rope_qk.default, (q, k, *call, *norms, *rope.config)),
        "rope_qk_": (
            ops.rope_qk_.default,
            (q.detach().clone(), k.detach().clone(), *call, None, None, *rope.config),
        ),
        "mhc_pre": (
            ops.mhc_pre.default,
            (data(64, 24, grad=True), data(3, 64, grad=True), data(24, grad=True), *pre.config),
        ),
        "mhc_post": (
            ops.mhc_post.default,
            (data(3, 16, grad=True), data(3, 4, grad=True), data(3, 64, grad=True), ""),
        ),
        "mhc_pre_bwd": (
            ops.mhc_pre_bwd.default,
            (
                data(64, 24),
                data(3, 64),
                data(24),
                data(3, 64),
                data(3, 16),
                data(3, 4),
                *pre.config,
            ),
        ),
        "mhc_post_bwd": (
            ops.mhc_post_bwd.default,
            (data(3, 16), data(3, 4), data(3, 64), data(3, 64), ""),
        ),
    }


_OPCHECK_NAMES = list(_opcheck_cases(np.random.default_rng(0), "cpu"))


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("name", _OPCHECK_NAMES)
def test_custom_ops_pass_torch_opcheck(rng, name, place):
    """``torch.library.opcheck``, torch's conformance test of a custom op: the schema
    (mutations declared), the fake implementation against the real one (shapes, strides,
    dtypes), the autograd registration, and AOT dispatch (what torch.compile runs)."""
    op, arguments = _opcheck_cases(rng, place)[name]
    results = torch.library.opcheck(op, arguments)
    assert all(result == "SUCCESS" for result in results.values()), results


def test_exported_program_loads_where_the_package_is_imported(rng, tmp_path):
    """A saved ``torch.export`` program runs in a fresh process that imported torch, then
    ``tileops_cupy`` (which registers the custom ops when torch came first), and gives the
    exporting process's bits."""
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS)
    pre = MHCPreFwdOp(1.0, 0.8, 1.2, 5)

    class Block(torch.nn.Module):
        def forward(self, phi, x, b, q):
            q_rot, _ = apply_rope(q, None, rope, 3)
            return (*pre(phi, x, b), q_rot)

    inputs = (  # (mHC's phi, x and b are float32)
        *(random_tensor(rng, shape, "cpu").float() for shape in ((4 * 16, 24), (3, 64), (24,))),
        random_tensor(rng, (1, 4, HEADS * HEAD_DIM), "cpu"),
    )
    torch.export.save(torch.export.export(Block(), inputs), tmp_path / "block.pt2")
    torch.save((inputs, Block()(*inputs)), tmp_path / "data.pt")
    loaded = assert_runs_in_own_process(
        _LOAD_EXPORTED, str(tmp_path / "block.pt2"), str(tmp_path / "data.pt")
    )
    assert "tileops_cupy._torch_ops" in loaded


def test_jit_trace_records_the_ops(rng):
    """``torch.jit.trace`` (and the TorchScript-based ONNX export on top of it) records each
    op as its custom op, so the traced function recomputes on new inputs. The direct path
    used to run unseen: the trace kept an ``aten::empty`` where the output was made and
    returned uninitialised memory for every new input."""
    op, rope = RoPEFwdOp(input_layout="2d"), RoPE(HEAD_DIM, HEADS, KV_HEADS)
    pre, post = MHCPreFwdOp(1.0, 0.9, 1.1, 4), MHCPostFwdOp()

    def block(x, q, phi, x_streams, b):
        q = q * 1
        rope.prefill(q, None, 3)
        x_res, x_layer, h_post = pre(phi, x_streams, b)
        return op(x), q, post(x_layer, h_post, x_res)

    def inputs():
        shapes = ((2, 3, 2, HEAD_DIM), (1, 4, HEADS * HEAD_DIM), (4 * 16, 24), (3, 64), (24,))
        return [random_tensor(rng, shape, "cpu").float() for shape in shapes]

    traced = torch.jit.trace(block, tuple(inputs()))  # (deprecated by torch, still used)
    names = {node.kind() for node in traced.graph.nodes()}
    assert {"tileops_cupy::rope", "tileops_cupy::rope_qk_", "tileops_cupy::mhc_pre"} <= names
    fresh = inputs()
    for got, want in zip(traced(*fresh), block(*fresh), strict=True):
        assert torch.equal(got, want)


@pytest.fixture
def without_vmap_fallback():
    """torch's batching fallback switched off for the test, so that vmap of an op without
    a rule of its own raises (torch would otherwise run it slice by slice, with a
    "performance drop ... file us an issue" warning)."""
    switch = getattr(torch._C._functorch, "_set_vmap_fallback_enabled", None)
    if switch is None:
        pytest.skip("this torch cannot switch its vmap fallback off")
    switch(False)
    yield
    switch(True)


def _assert_vmap_is_a_loop(function, inputs, in_dims=0):
    """``torch.vmap(function, in_dims)(*inputs)`` equals ``function`` on each slice,
    stacked, bit for bit (every output of a tuple)."""
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(inputs)
    size = next(t.shape[d] for t, d in zip(inputs, dims, strict=True) if d is not None)
    batched = torch.vmap(function, in_dims=in_dims)(*inputs)
    slices = [
        function(*(t if d is None else t.select(d, i) for t, d in zip(inputs, dims, strict=True)))
        for i in range(size)
    ]
    if isinstance(batched, tuple):
        for got, *wanted in zip(batched, *slices, strict=True):
            assert torch.equal(got, torch.stack(wanted))
    else:
        assert torch.equal(batched, torch.stack(slices))


@pytest.mark.parametrize("place", PLACES)
def test_vmap_has_a_rule_for_every_op(rng, place, without_vmap_fallback):
    """``torch.vmap`` of every op, with torch's fallback off: the seed ops' rotations and
    mHC post join the vmapped slices into one call (a row's result cannot depend on the
    others); the component, mHC pre and the backward ops run slice by slice, whose plans and
    sums depend on the batch. Either way the same bits as a loop, batched in any argument."""
    seed, seed_1d = RoPEFwdOp(input_layout="2d"), RoPEFwdOp()
    ids_op = RoPENeoxPositionIdsFwdOp(64, rotary_dim=8)
    x, rows = random_tensor(rng, (3, *SHAPES["2d"]), place), random_tensor(rng, (37, 3, 16), place)
    tokens = random_tensor(rng, (3, 11, HEADS, HEAD_DIM), place)
    ids = torch.from_numpy(rng.integers(0, 64, (3, 11))).to(place)
    _assert_vmap_is_a_loop(seed, (x,))
    _assert_vmap_is_a_loop(seed_1d, (rows,), in_dims=1)
    _assert_vmap_is_a_loop(ids_op, (tokens, ids))
    _assert_vmap_is_a_loop(ids_op, (tokens, ids[0]), in_dims=(0, None))
    _assert_vmap_is_a_loop(ids_op, (tokens[0], ids), in_dims=(None, 0))

    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, scheme=YaRN(scale=4.0), max_position=64)
    q = random_tensor(rng, (3, 11, HEADS * HEAD_DIM), place)
    k = random_tensor(rng, (3, 11, KV_HEADS * HEAD_DIM), place)
    weight = random_tensor(rng, (HEAD_DIM,), place)

    def rotated(q, k, positions):
        return rope.forward(q.clone(), k.clone(), positions=positions)

    def normed(q, k, positions):
        return rope.forward(
            q.clone(), k.clone(), positions=positions, q_norm_weight=weight, k_norm_weight=weight
        )

    def in_place(q, k, positions):
        q, k = q * 1, k * 1
        rope.forward(q, k, positions=positions)
        return q, k

    for function in (rotated, normed, in_place):
        _assert_vmap_is_a_loop(function, (q, k, ids))
    _assert_vmap_is_a_loop(rotated, (q, k, ids[0]), in_dims=(0, 0, None))

    pre, post = MHCPreFwdOp(1.0, 0.8, 1.2, 5), MHCPostFwdOp()
    pre_bwd, post_bwd = MHCPreBwdOp(1.0, 0.8, 1.2, 5), MHCPostBwdOp()
    phi, x_rows, b = _mhc_inputs(rng, place, n=2, c_x=16, batch=4)
    xs = torch.stack([x_rows, x_rows.flip(0), x_rows * 2])
    _assert_vmap_is_a_loop(pre, (phi, xs, b), in_dims=(None, 0, None))
    _assert_vmap_is_a_loop(pre, (torch.stack([phi, phi / 2, -phi]), xs, b), in_dims=(0, 0, None))
    x_res, x_layer, h_post = torch.vmap(pre, in_dims=(None, 0, None))(phi, xs, b)
    _assert_vmap_is_a_loop(post, (x_layer, h_post, x_res))
    _assert_vmap_is_a_loop(post, (x_layer[0], h_post, x_res[0]), in_dims=(None, 0, None))
    _assert_vmap_is_a_loop(post_bwd, (x_layer, h_post, x_res, x_res.flip(0)))
    grads = (x_res.flip(0), x_layer * 3, h_post.flip(0))
    _assert_vmap_is_a_loop(lambda x, *grads: pre_bwd(phi, x, b, *grads), (xs, *grads))


def _assert_vmap_of_no_slices_is_empty(function, inputs, in_dims=0):
    """``torch.vmap`` over the first 0 slices of ``inputs``: each result [0, ...] of the
    shape, dtype and device of one slice's result."""
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(inputs)
    pairs = list(zip(inputs, dims, strict=True))
    one = function(*(t if d is None else t.select(d, 0) for t, d in pairs))
    empty = torch.vmap(function, in_dims=in_dims)(
        *(t if d is None else t.narrow(d, 0, 0) for t, d in pairs)
    )
    as_tuples = ((r if isinstance(r, tuple) else (r,)) for r in (empty, one))
    for got, slice_result in zip(*as_tuples, strict=True):
        assert got.shape == (0, *slice_result.shape), (got.shape, slice_result.shape)
        assert (got.dtype, got.device) == (slice_result.dtype, slice_result.device)


@pytest.mark.parametrize("place", PLACES)
def test_vmap_over_no_slices_gives_empty_results(rng, place, without_vmap_fallback):
    """vmap over an empty batch, as torch's own ops take it (the rules ran a first slice
    that was not there, or joined no rows into a shape unflatten could not split)."""
    x = random_tensor(rng, (3, *SHAPES["2d"]), place)
    _assert_vmap_of_no_slices_is_empty(RoPEFwdOp(input_layout="2d"), (x,))
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, max_position=64)
    q = random_tensor(rng, (3, 1, 11, HEADS * HEAD_DIM), place)

    def rotated(q):
        return apply_rope(q, None, rope, 3)[0]

    _assert_vmap_of_no_slices_is_empty(rotated, (q,))
    pre, post = MHCPreFwdOp(1.0, 0.8, 1.2, 5), MHCPostFwdOp()
    phi, x_rows, b = _mhc_inputs(rng, place, n=2, c_x=16, batch=4)
    xs = torch.stack([x_rows, x_rows * 2])
    _assert_vmap_of_no_slices_is_empty(pre, (phi, xs, b), in_dims=(None, 0, None))
    x_res, x_layer, h_post = torch.vmap(pre, in_dims=(None, 0, None))(phi, xs, b)
    _assert_vmap_of_no_slices_is_empty(post, (x_layer, h_post, x_res))
    _assert_vmap_of_no_slices_is_empty(MHCPostBwdOp(), (x_layer, h_post, x_res, x_res))


def test_vmap_of_an_in_place_call_that_cannot_write_k_writes_neither():
    """Under vmap a batched q rotates in place, but an unbatched k captured from outside
    cannot take a batched result: the call names k before q is written."""
    rope = RoPE(8, 2, 1)
    q_rows, k = torch.randn(3, 1, 4, 16), torch.randn(1, 4, 8)
    before = q_rows.clone(), k.clone()

    def rotate(q):
        rope.prefill(q, k, 5)
        return q

    with pytest.raises(ValueError, match="^k cannot be rotated in place here: vmap"):
        torch.vmap(rotate)(q_rows)
    assert torch.equal(q_rows, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize(
    ("call", "name"),
    (
        (lambda q, k: RoPE(8, 2, 1).decode(q, k, np.array([1, 2])), "position"),
        (
            lambda q, k: apply_rope_with_cos_sin_cache(
                torch.arange(2), q[:, 0], k[:, 0].numpy(), 8, torch.randn(10, 8)
            ),
            "key",
        ),
        (lambda q, k: apply_rope(q, k.numpy(), RoPE(8, 2, 1)), "k"),
    ),
    ids=("decode position", "cos_sin_cache key", "apply_rope k"),
)
def test_a_non_torch_argument_on_the_dispatcher_is_named_as_the_api_names_it(call, name):
    """Through the dispatcher (q requires grad) a NumPy argument is a TypeError naming it
    as the call's own API does, not by the custom op's schema."""
    q = torch.randn(2, 1, 16, requires_grad=True) * 1
    with pytest.raises(TypeError, match=f"^{name} must be a torch tensor, got numpy.ndarray"):
        call(q, torch.randn(2, 1, 8))


def _autograd_gradients(function, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    function(*leaves).backward()
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("place", PLACES)
def test_func_transforms_take_the_same_gradients_as_autograd(rng, place, without_vmap_fallback):
    """``torch.func.grad`` (and ``vmap`` of it, per-sample gradients, through the ops' vmap
    rules) through every kind of op: the seed op, ``apply_rope`` with the fused norm, the
    component in place on a non-leaf, and mHC pre -> layer -> post. torch's custom-op
    autograd raises under these transforms; the ops' autograd.Functions give autograd's
    gradients, bit for bit."""
    op = RoPEFwdOp(input_layout="2d")
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, scheme=YaRN(scale=4.0), rotary_dim=8)
    pre, post = MHCPreFwdOp(0.8, 1.1, 0.9, 6), MHCPostFwdOp()
    q = random_tensor(rng, (2, 3, HEADS * HEAD_DIM), place)
    k = random_tensor(rng, (2, 3, KV_HEADS * HEAD_DIM), place)
    weight = random_tensor(rng, (HEAD_DIM,), place)

    def rotated_in_place(q, k):
        q, k = q * 1, k * 1  # non-leaves: the rotation is recorded
        rope.prefill(q, k, 11)
        return (q.square().sum() + k.cos().sum()) / 7

    def mhc_block(phi, x, b):
        x_res, x_layer, h_post = pre(phi, x, b)
        return post(x_layer * 2, h_post, x_res).square().sum()

    losses = {
        "seed op": (lambda x: op(x).square().sum(), (random_tensor(rng, SHAPES["2d"], place),)),
        "apply_rope with the norm": (
            lambda q, k, w: (
                apply_rope(q, k, rope, 5, q_norm_weight=w, k_norm_weight=w)[0].sin().sum()
            ),
            (q, k, weight),
        ),
        "in place": (rotated_in_place, (q, k)),
        "mHC": (mhc_block, _mhc_inputs(rng, place, n=4, c_x=8, batch=5)),
    }
    for name, (loss, inputs) in losses.items():
        argnums = tuple(range(len(inputs)))
        transformed = torch.func.grad(loss, argnums=argnums)(*inputs)
        for got, want in zip(transformed, _autograd_gradients(loss, inputs), strict=True):
            assert torch.equal(got, want), name

    phi, x, b = losses["mHC"][1]

    def row_loss(row):
        return mhc_block(phi, row[None], b)

    looped = [_autograd_gradients(row_loss, (row,))[0] for row in x]
    assert torch.equal(torch.func.vmap(torch.func.grad(row_loss))(x), torch.stack(looped))

    def vmapped_loss(x):  # (the gradient transform outside, vmap inside)
        return torch.func.vmap(op)(x).square().sum()

    rows = random_tensor(rng, (3, *SHAPES["2d"]), place)
    transformed = torch.func.grad(vmapped_loss)(rows)
    assert torch.equal(transformed, _autograd_gradients(vmapped_loss, (rows,))[0])


def test_hessians_of_the_rope_ops(rng, without_vmap_fallback):
    """``torch.func.hessian`` (forward mode over reverse mode, under vmap) of losses through
    the seed op, apply_rope with k, and the fused norm equals autograd's double backward.
    (Torch's generated vmap rules once failed on the configurations' lists: they now travel
    as one opaque argument.) mHC is once differentiable: its hessian names the op."""
    op = RoPEFwdOp(input_layout="2d")
    rope = RoPE(HEAD_DIM, 2, 1, rotary_dim=8, norm_weight_offset=1.0)
    weight = random_tensor(rng, (HEAD_DIM,), "cpu")
    positions = torch.tensor([[3, 700]])

    def rotated_pair(q):
        return apply_rope(q, q[..., :HEAD_DIM] * 2, rope, positions=positions)

    losses = {
        "seed op": (lambda x: op(x).sin().sum(), (1, 2, 1, HEAD_DIM)),
        "apply_rope with k": (lambda q: sum(t.sin().sum() for t in rotated_pair(q)), (1, 2, 32)),
        "the fused norm": (
            lambda q: apply_rope(q, None, rope, 5, q_norm_weight=weight)[0].sin().sum(),
            (1, 2, 32),
        ),
    }
    for name, (loss, shape) in losses.items():
        x = random_tensor(rng, shape, "cpu")
        expected = torch.autograd.functional.hessian(loss, x)
        torch.testing.assert_close(torch.func.hessian(loss)(x), expected, rtol=0, atol=1e-12,
                                   msg=name)  # fmt: skip
    phi, x, b = _mhc_inputs(rng, "cpu", n=2, c_x=8, batch=2)
    pre = MHCPreFwdOp(1.0, 1.0, 1.0, 3)
    with pytest.raises(RuntimeError, match="MHCPreFwdOp has no forward-mode derivative"):
        torch.func.hessian(lambda x: pre(phi, x, b)[1].sum())(x)


@pytest.mark.parametrize("place", PLACES)
def test_forward_mode_gives_every_tangent_or_says_it_cannot(rng, place):
    """Forward-mode AD (``torch.func.jvp``, dual tensors): a RoPE op's tangent is the same
    op applied to the input's tangent (it is linear), mHC post's is its bilinear
    derivative; mHC pre and the backward ops have none and raise an error that names the op.
    The tangents were once silently dropped (the outputs came back without them)."""
    import torch.autograd.forward_ad as forward_ad

    op = RoPEFwdOp(input_layout="2d")
    x, tangent = (random_tensor(rng, SHAPES["2d"], place) for _ in range(2))
    _, jvp = torch.func.jvp(op, (x,), (tangent,))
    assert torch.equal(jvp, op(tangent))
    with forward_ad.dual_level():
        dual = op(forward_ad.make_dual(x, tangent))
        assert torch.equal(forward_ad.unpack_dual(dual).tangent, op(tangent))

    post = MHCPostFwdOp()
    streams = [random_tensor(rng, shape, place).float() for shape in ((3, 8), (3, 2), (3, 16))]
    tangents = [random_tensor(rng, t.shape, place).float() for t in streams]
    _, jvp = torch.func.jvp(post, tuple(streams), tuple(tangents))
    (layer, gates, _), (layer_t, gates_t, res_t) = (
        [t.double() for t in ts] for ts in (streams, tangents)
    )
    terms = (
        (gates_t[:, :, None] * layer[:, None]).flatten(1),
        (gates[:, :, None] * layer_t[:, None]).flatten(1),
        res_t,
    )
    bound = sum(term.abs() for term in terms).max().item()  # 3 float32 roundings at most
    torch.testing.assert_close(jvp.double(), sum(terms), rtol=0, atol=2**-21 * bound)

    phi, x, b = _mhc_inputs(rng, place, n=2, c_x=8, batch=3)
    pre = MHCPreFwdOp(1.0, 1.0, 1.0, 3)
    with pytest.raises(RuntimeError, match="MHCPreFwdOp has no forward-mode derivative"):
        torch.func.jvp(lambda x: pre(phi, x, b), (x,), (x,))
    no_derivative = pytest.raises(RuntimeError, match="MHCPreFwdOp has no forward-mode derivative")
    with no_derivative, forward_ad.dual_level():
        pre(phi, forward_ad.make_dual(x, x), b)
    upstream = [torch.ones(s, device=place) for s in ((3, 16), (3, 8), (3, 2))]
    backward = MHCPreBwdOp(1.0, 1.0, 1.0, 3)
    with pytest.raises(RuntimeError, match="MHCPreBwdOp has no forward-mode derivative"):
        torch.func.jvp(lambda x: backward(phi, x, b, *upstream)[1], (x,), (x,))


def test_in_place_under_forward_mode_rotates_the_tangent_and_checks_memory(rng):
    """The component in place on dual tensors: recorded as a rotated copy and ``copy_``, so
    the tangent rotates with the data; q and k that overlap are refused before any write,
    as without forward mode (the memory check is skipped only for torch.func's wrappers,
    which have none to compare)."""
    import torch.autograd.forward_ad as forward_ad

    rope = RoPE(HEAD_DIM, 2, 2)
    data, tangent = (random_tensor(rng, (1, 3, 4 * HEAD_DIM), "cpu") for _ in range(2))
    expected = data.clone(), tangent.clone()
    for rows in expected:
        rope.prefill(rows[..., : 2 * HEAD_DIM], rows[..., 2 * HEAD_DIM :], 5)
    with forward_ad.dual_level():  # (the tangent is written in place too)
        dual = forward_ad.make_dual(data.clone(), tangent.clone())
        q, k = dual[..., : 2 * HEAD_DIM], dual[..., 2 * HEAD_DIM :]
        rope.prefill(q, k, 5)
        rotated = forward_ad.unpack_dual(dual)
    assert torch.equal(rotated.primal, expected[0])
    assert torch.equal(rotated.tangent, expected[1])

    with forward_ad.dual_level():
        dual = forward_ad.make_dual(data.clone(), tangent)
        overlapping = dual[..., : 2 * HEAD_DIM], dual[..., HEAD_DIM : 3 * HEAD_DIM]
        with pytest.raises(ValueError, match="^q and k overlap in memory"):
            rope.prefill(*overlapping, 5)
        assert torch.equal(forward_ad.unpack_dual(dual).primal, data)


def test_functionalize_keeps_the_custom_ops(rng):
    """``torch.func.functionalize`` (and ``make_fx`` over it, as graph tools trace) takes
    the custom ops themselves, which torch functionalizes (it functionalizes no
    autograd.Function): the results are eager's, and the in-place component becomes the
    rotated copy and a copy."""
    from torch.fx.experimental.proxy_tensor import make_fx

    op, rope = RoPEFwdOp(input_layout="2d"), RoPE(HEAD_DIM, HEADS, KV_HEADS)

    def rotated_in_place(q):
        q = q * 1
        rope.prefill(q, None, 3)
        return q

    x = random_tensor(rng, SHAPES["2d"], "cpu")
    q = random_tensor(rng, (1, 4, HEADS * HEAD_DIM), "cpu")
    assert torch.equal(torch.func.functionalize(op)(x), op(x))
    assert torch.equal(torch.func.functionalize(rotated_in_place)(q), rotated_in_place(q))
    graph = make_fx(torch.func.functionalize(rotated_in_place))(q)
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert {"tileops_cupy.rope_qk.default", "aten.copy.default"} <= targets
    fresh = random_tensor(rng, q.shape, "cpu")
    assert torch.equal(graph(fresh), rotated_in_place(fresh))


def test_the_profiler_shows_each_call_as_its_op(rng):
    """While the torch profiler records, calls take the dispatcher, so a trace names each
    op (and the kernels it launched sit under it); the results are the direct path's."""
    op, rope, post = RoPEFwdOp(), RoPE(HEAD_DIM, HEADS, KV_HEADS), MHCPostFwdOp()
    x = random_tensor(rng, (5, HEAD_DIM), "cpu")
    q = random_tensor(rng, (1, 3, HEADS * HEAD_DIM), "cpu")
    k = random_tensor(rng, (1, 3, KV_HEADS * HEAD_DIM), "cpu")
    streams = [random_tensor(rng, shape, "cpu").float() for shape in ((3, 16), (3, 4), (3, 64))]

    def calls():
        return op(x), *rope.prefill(q.clone(), k.clone(), 2), post(*streams)

    direct = calls()
    with torch.profiler.profile() as profile:
        recorded = calls()
    names = {event.name for event in profile.events()}
    assert {"tileops_cupy::rope", "tileops_cupy::rope_qk_", "tileops_cupy::mhc_post"} <= names
    for got, want in zip(recorded, direct, strict=True):
        assert torch.equal(got, want)


def test_meta_tensors_take_the_fake_implementations(rng):
    """Shape inference on the meta device (a model's forward run with no memory behind its
    tensors): every op answers with meta tensors of the shapes its CPU call gives."""
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS)
    calls = {
        "seed": (RoPEFwdOp(input_layout="2d"), ((2, 5, 3, HEAD_DIM),)),
        "apply_rope": (
            lambda q, k: apply_rope(q, k, rope, 4),
            ((2, 5, HEADS * HEAD_DIM), (2, 5, KV_HEADS * HEAD_DIM)),
        ),
        "mhc pre": (MHCPreFwdOp(1.0, 1.0, 1.0, 5), ((4 * 16, 24), (3, 4 * 16), (24,))),
        "mhc post": (MHCPostFwdOp(), ((3, 16), (3, 4), (3, 4 * 16))),
    }
    for name, (call, shapes) in calls.items():
        on_cpu = call(*(random_tensor(rng, shape, "cpu").float() for shape in shapes))
        on_meta = call(*(torch.empty(shape, device="meta") for shape in shapes))
        on_cpu, on_meta = (o if isinstance(o, tuple) else (o,) for o in (on_cpu, on_meta))
        assert [(o.device.type, o.shape, o.dtype) for o in on_meta] == [
            ("meta", o.shape, o.dtype) for o in on_cpu
        ], name
    # some on meta, some not: no shapes to infer, and no memory to compute on; named
    meta_phi, x, b = torch.empty(64, 24, device="meta"), torch.zeros(3, 64), torch.zeros(24)
    with pytest.raises(ValueError, match="^phi is a torch tensor on meta"):
        MHCPreFwdOp(1.0, 1.0, 1.0, 5)(meta_phi, x, b)


@pytest.mark.parametrize("entry", ("RoPE", "apply_rope_with_cos_sin_cache", "MHCPreFwdOp"))
def test_compiled_before_any_eager_call_does_not_recompile(entry):
    """In a fresh process, a function compiled (fullgraph, dynamic) before any eager call of
    the package: its second call, at another length, reuses the graph (the package's lazily
    bound torch state once made the first graph guard on it)."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        sys.path.insert(0, "tests")
        from _compile import compile_counting
        from tileops_cupy.rope import RoPE, apply_rope_with_cos_sin_cache
        from tileops_cupy.sequence_modeling import MHCPreFwdOp

        entry = sys.argv[1]
        rope, pre = RoPE(16, 2), MHCPreFwdOp(1.0, 1.0, 1.0, 2)
        cache, phi, b = torch.randn(64, 16), torch.randn(32, 24), torch.randn(24)
        def call(x):
            if entry == "RoPE":
                return rope.forward(x.clone(), positions=torch.arange(x.shape[0]))[0]
            if entry == "apply_rope_with_cos_sin_cache":
                return apply_rope_with_cos_sin_cache(torch.arange(x.shape[0]), x, None, 16,
                                                     cache)[0]
            return pre(phi, x, b)[1]

        compiled, counter = compile_counting(call, dynamic=True)
        compiled(torch.randn(5, 32))
        counter.first_call_done()
        compiled(torch.randn(9, 32))
        counter.assert_no_recompile()
        """
    )
    assert_runs_in_own_process(script, entry)


def test_torch_is_not_imported_by_the_host_path():
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        from tileops_cupy.rope import RoPE, RoPEFwdOp
        from tileops_cupy.sequence_modeling import MHCPreFwdOp
        RoPEFwdOp()(np.ones((4, 8), np.float32))
        RoPE(8, 1).forward(np.ones((1, 2, 8), np.float32))
        assert "torch" not in sys.modules, "the numpy path imported torch"
        """
    )
    assert_runs_in_own_process(script)


@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (1, 4), (5, 7), (2, 3, 4), (0, 3), (4, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_outputs_from_a_shape_template_are_fresh_and_contiguous(shape, dtype):
    """The decode relaunch's outputs (``torch.empty_like`` of a ``shape_template``): the
    shape, dtype and device asked for, torch's contiguous strides, new memory every call."""
    from tileops_cupy import _torch_ops

    template = _torch_ops.shape_template(torch.zeros(3, dtype=dtype), shape)
    first, second = torch.empty_like(template), torch.empty_like(template)
    expected = torch.empty(shape, dtype=dtype)
    for made in (first, second):
        assert (made.shape, made.stride(), made.dtype) == (shape, expected.stride(), dtype)
        assert not made.requires_grad
    assert template.untyped_storage().nbytes() <= dtype.itemsize
    if first.numel():
        assert first.data_ptr() != second.data_ptr()


def test_layout_keys_stand_contiguity_for_strides():
    """A relaunch is keyed on the layout of its arguments: contiguous tensors of one shape,
    dtype and alignment share a key whatever the strides of their size-1 dimensions (which
    address no element but the first); any other layout keys on its strides."""
    from tileops_cupy import _torch_ops

    base = torch.zeros(4, 6, 8)
    one_row, one_row_strided = base[:1], base[1:4:2][:1]
    assert one_row.stride() != one_row_strided.stride()
    assert one_row.is_contiguous() and one_row_strided.is_contiguous()
    fresh = torch.zeros(1, 6, 8)
    keys = _torch_ops.layouts(one_row, one_row_strided, fresh)[0]
    assert keys[0] == keys[1] == keys[2]
    transposed = torch.zeros(4, 8, 6).transpose(1, 2)
    same_strides = torch.zeros(5, 8, 6).transpose(1, 2)[:4]
    (key_t, key_s), pointers = _torch_ops.layouts(transposed, same_strides)
    # (a last stride other than 1: the key holds the negative bit too)
    assert key_t[1] == (transposed.stride(), False) and key_t == key_s
    assert _torch_ops.layouts(base)[0] != keys[:1], "a shape change must change the key"
    shifted = base.flatten()[1:49].view(6, 8)  # 4 bytes past a 16-byte boundary
    assert _torch_ops.layouts(shifted)[0] != _torch_ops.layouts(base[0])[0]
    assert pointers == [transposed.data_ptr(), same_strides.data_ptr()]


def test_layout_keys_tell_absent_foreign_and_negative_arguments_apart():
    """A recorded launch re-runs on its arguments' addresses alone, so the keys must tell
    apart what validation does: an argument left out (None) from one of another framework
    (a NumPy array, a list), which no recorded launch reads; and a negative view
    (``z.conj().imag``, refused) from a plain view of the same memory and strides."""
    from tileops_cupy import _torch_ops

    absent, numpy_array, listed, number = _torch_ops.layouts(None, np.zeros(3), [1, 2], 7)[0]
    assert absent is None and number is None
    assert numpy_array == listed == _torch_ops.FOREIGN and numpy_array is not None
    assert not _torch_ops.all_torch((numpy_array,)) and not _torch_ops.all_torch((None,))
    z = torch.zeros(4, 8, dtype=torch.complex64)
    negative, plain = z.conj().imag, torch.view_as_real(z)[..., 1]
    assert negative.is_neg() and not plain.is_neg()
    assert (negative.stride(), negative.data_ptr()) == (plain.stride(), plain.data_ptr())
    key_negative, key_plain = _torch_ops.layouts(negative, plain)[0]
    assert key_negative != key_plain and _torch_ops.all_torch((key_negative, key_plain))


@pytest.mark.gpu
def test_gpu_a_negative_view_of_a_recorded_layout_is_refused(rng):
    """h_post as every other float of a buffer is read in place, and its launch recorded;
    the negative view of the same memory and strides is refused, not read as its memory."""
    post = MHCPostFwdOp()
    layer = torch.tensor(rng.standard_normal((3, 64)), dtype=torch.float32, device="cuda")
    res = torch.tensor(rng.standard_normal((3, 4 * 64)), dtype=torch.float32, device="cuda")
    gates = torch.tensor(rng.standard_normal((3, 4)), dtype=torch.complex64, device="cuda")
    post(layer, torch.view_as_real(gates)[..., 1], res)
    assert len(post._relaunches) == 1
    with pytest.raises(TypeError, match="^h_post has torch's lazy negation bit set"):
        post(layer, gates.conj().imag, res)


@pytest.mark.gpu
def test_gpu_relaunch_serves_contiguous_rows_of_any_size_one_stride(rng):
    """A call on one contiguous row whose (size-1) batch dimension has another stride than
    the first call's takes the first call's launch (one layout key for both) and gives what
    a first call on its data gives."""
    op = MHCPreFwdOp(1.0, 1.0, 1.0, 20)
    phi = torch.tensor(rng.standard_normal((4 * 64, 24)) / 16, dtype=torch.float32, device="cuda")
    b = torch.tensor(rng.standard_normal(24), dtype=torch.float32, device="cuda")
    rows = torch.tensor(rng.standard_normal((2, 4 * 64)), device="cuda").bfloat16()
    op(phi, rows[:1], b)  # plans the launch: batch stride 256
    strided = torch.empty_strided((1, 256), (999, 1), dtype=torch.bfloat16, device="cuda")
    strided.copy_(rows[1:])
    relaunched = op(phi, strided, b)
    assert len(op._relaunches) == 1, "both rows must share one layout key"
    planned = MHCPreFwdOp(1.0, 1.0, 1.0, 20)(phi, strided.contiguous(), b)
    for got, expected in zip(relaunched, planned, strict=True):
        _assert_same(got, expected)


# --------------------------------------------------------------------------- CUDA graphs

# Each capture runs in its own process: a failed capture poisons the CUDA context.
_CAPTURE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    sys.path.insert(0, "tests")
    from _cases import assert_graph_replays_like_eager
    from tileops_cupy.rope import (RoPE, RoPEFwdOp, RoPEBwdOp, RoPELlama31FwdOp, YaRNFwdOp,
        LongRoPEBwdOp, RoPENeoxPositionIdsFwdOp, apply_rope)
    from tileops_cupy.sequence_modeling import MHCPreFwdOp, MHCPostFwdOp, MHCPreBwdOp, MHCPostBwdOp

    rng = np.random.default_rng(int(sys.argv[2]))
    def randn(*shape, dtype=torch.bfloat16):
        return torch.from_numpy(rng.standard_normal(shape)).to("cuda", dtype)

    rope = RoPE(128, 8, 2, max_position=8192)
    ids_op = RoPENeoxPositionIdsFwdOp(max_position=8192, rotary_dim=64)
    pre, post = MHCPreFwdOp(1.0, 1.0, 1.0, 20), MHCPostFwdOp()
    phi = randn(4 * 512, 24, dtype=torch.float32) / 16
    b = randn(24, dtype=torch.float32)
    pre_bwd, post_bwd = MHCPreBwdOp(1.0, 1.0, 1.0, 20), MHCPostBwdOp()

    def pre_bwd_inputs(batch):  # x, then the upstream gradients of x_res, x_layer, h_post
        return [randn(batch, 4 * 512), randn(batch, 4 * 512), randn(batch, 512),
                randn(batch, 4, dtype=torch.float32)]

    def train_step(phi, x, b, weights):  # autograd through pre -> layer -> post
        leaves = [t.detach().requires_grad_() for t in (phi, x, b)]
        x_res, x_layer, h_post = pre(*leaves)
        x_out = post(x_layer * 2, h_post, x_res)
        return torch.autograd.grad((x_out.float() * weights).sum(), leaves)

    ops = {
        "RoPEFwdOp": (RoPEFwdOp(input_layout="2d"), lambda: [randn(2, 64, 4, 128)]),
        "RoPEBwdOp": (RoPEBwdOp("interleaved"), lambda: [randn(64, 128)]),
        "RoPELlama31FwdOp": (RoPELlama31FwdOp(), lambda: [randn(64, 128)]),
        "YaRNFwdOp": (YaRNFwdOp("2d"), lambda: [randn(1, 32, 4, 64)]),
        "LongRoPEBwdOp": (LongRoPEBwdOp(), lambda: [randn(64, 128)]),
        "RoPENeoxPositionIdsFwdOp": (ids_op, lambda: [
            randn(48, 4, 128), torch.from_numpy(rng.integers(0, 8192, 48)).cuda()]),
        "prefill": (lambda q, k, p: rope.prefill(q, k, p), lambda: [
            randn(2, 16, 8 * 128), randn(2, 16, 2 * 128),
            torch.from_numpy(rng.integers(0, 4096, 2)).cuda()]),
        "decode": (lambda q, k, p: rope.decode(q, k, p), lambda: [
            randn(4, 1, 8 * 128), randn(4, 1, 2 * 128),
            torch.from_numpy(rng.integers(0, 8192, 4).astype(np.int32)).cuda()]),
        "backward": (lambda q, k: rope.backward(q, k, 100), lambda: [
            randn(2, 16, 8 * 128), randn(2, 16, 2 * 128)]),
        "apply_rope": (lambda q, k: apply_rope(q, k, rope, 7), lambda: [
            randn(2, 16, 8 * 128), randn(2, 16, 2 * 128)]),
        "MHCPreFwdOp-B4": (lambda x: pre(phi, x, b), lambda: [randn(4, 4 * 512)]),
        "MHCPreFwdOp-B300": (lambda x: pre(phi, x, b), lambda: [randn(300, 4 * 512)]),
        # (from 512 tokens on sm_90 the projection and the mix are launched early)
        "MHCPreFwdOp-B600": (lambda x: pre(phi, x, b), lambda: [randn(600, 4 * 512)]),
        "MHCPostFwdOp": (post, lambda: [randn(8, 512), randn(8, 4, dtype=torch.float32),
                                       randn(8, 4 * 512)]),
        "MHCPreBwdOp-B4": (lambda x, *up: pre_bwd(phi, x, b, *up), lambda: pre_bwd_inputs(4)),
        "MHCPreBwdOp-B300": (lambda x, *up: pre_bwd(phi, x, b, *up),
                             lambda: pre_bwd_inputs(300)),
        # (from 512 tokens on sm_90 every kernel after the first is launched early)
        "MHCPreBwdOp-B600": (lambda x, *up: pre_bwd(phi, x, b, *up),
                             lambda: pre_bwd_inputs(600)),
        "MHCPostBwdOp": (post_bwd, lambda: [randn(8, 512), randn(8, 4, dtype=torch.float32),
                                           randn(8, 4 * 512), randn(8, 4 * 512)]),
        "MHC-autograd": (train_step, lambda: [randn(4 * 512, 24, dtype=torch.float32) / 16,
                                              randn(64, 4 * 512), randn(24, dtype=torch.float32),
                                              randn(64, 4 * 512, dtype=torch.float32)]),
    }
    assert_graph_replays_like_eager(*ops[sys.argv[1]])  # (in place ones return q and k)
    print("replayed", sys.argv[1])
    """
)
_CAPTURED = (
    "RoPEFwdOp",
    "RoPEBwdOp",
    "RoPELlama31FwdOp",
    "YaRNFwdOp",
    "LongRoPEBwdOp",
    "RoPENeoxPositionIdsFwdOp",
    "prefill",
    "decode",
    "backward",
    "apply_rope",
    "MHCPreFwdOp-B4",
    "MHCPreFwdOp-B300",
    "MHCPreFwdOp-B600",
    "MHCPostFwdOp",
    "MHCPreBwdOp-B4",
    "MHCPreBwdOp-B300",
    "MHCPreBwdOp-B600",
    "MHCPostBwdOp",
    "MHC-autograd",
)


@pytest.mark.gpu
@pytest.mark.parametrize("name", _CAPTURED)
def test_gpu_cuda_graph_capture_and_replay(name):
    assert_runs_in_own_process(_CAPTURE, name, "7")


class _UserTensor(torch.Tensor):
    """A torch.Tensor subclass defined outside torch (as torchao's are)."""


SUBCLASS_CALLS = {
    "RoPEFwdOp": lambda make: RoPEFwdOp()(make((5, 64), torch.float32)),
    "apply_rope": lambda make: apply_rope(make((1, 5, 128), torch.float32), None, RoPE(64, 2))[0],
    "MHCPostFwdOp": lambda make: MHCPostFwdOp()(
        make((3, 16), torch.float32), make((3, 4), torch.float32), make((3, 64), torch.float32)
    ),
    "prefill bf16": lambda make: _rotated_in_place(make((1, 5, 128), torch.bfloat16)),
}


def _rotated_in_place(q):
    RoPE(64, 2).prefill(q, None, 3)
    return q


@pytest.mark.parametrize("call", list(SUBCLASS_CALLS))
def test_a_tensor_subclass_of_another_module_is_taken_as_torch(call):
    """torch in, torch out, whatever module defines the subclass: the same bits as on plain
    tensors (it was read as a generic DLPack producer: a NumPy output the op then failed to
    return, and bfloat16 refused)."""
    values = []
    for kind in (torch.Tensor, _UserTensor):
        generator = torch.Generator().manual_seed(len(call))  # the same data for both

        def make(shape, dtype, kind=kind, generator=generator):
            return torch.randn(shape, generator=generator).to(dtype).as_subclass(kind)

        result = SUBCLASS_CALLS[call](make)
        assert isinstance(result, torch.Tensor)
        values.append(result.as_subclass(torch.Tensor))
    assert torch.equal(values[0], values[1])


@pytest.mark.parametrize("call", ("RoPEFwdOp", "apply_rope", "MHCPostFwdOp"))
def test_a_tensor_subclass_that_requires_grad_gets_its_gradient(call):
    """A subclass that requires grad goes through the dispatcher as a plain tensor does: the
    call is recorded, and every input's gradient is the plain tensors' (on the direct path
    the result would come back without a grad_fn: the gradient silently stopped)."""
    grads = []
    for kind in (torch.Tensor, _UserTensor):
        generator = torch.Generator().manual_seed(len(call))  # the same data for both
        inputs = []

        def make(shape, dtype, kind=kind, generator=generator, inputs=inputs):
            tensor = torch.randn(shape, generator=generator).to(dtype).as_subclass(kind)
            inputs.append(tensor.requires_grad_())
            return tensor

        result = SUBCLASS_CALLS[call](make)
        assert result.grad_fn is not None
        (result * torch.randn(result.shape, generator=generator)).sum().backward()
        grads.append([tensor.grad.as_subclass(torch.Tensor) for tensor in inputs])
    for plain, subclass in zip(*grads, strict=True):
        assert torch.equal(plain, subclass)


@pytest.mark.parametrize("transform", ("vmap", "functionalize"))
def test_in_place_calls_under_a_transform_in_inference_mode(transform):
    """Inference tensors keep no version counter: the in-place call's writability rehearsal
    must not ask for one (it made every such call under vmap or functionalize fail)."""
    rope = RoPE(8, 2, 1)
    with torch.inference_mode():
        q, k = torch.randn(3, 4, 16), torch.randn(3, 4, 8)
        expected = apply_rope(q, k, rope, 3)

        def rotate(q, k):
            rope.prefill(q, k, 3)
            return q, k

        if transform == "vmap":  # (one slice: the whole batch)
            got = [t[0] for t in torch.vmap(rotate)(q[None].clone(), k[None].clone())]
        else:
            got = torch.func.functionalize(rotate)(q.clone(), k.clone())
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_bwd_twin_forward_is_a_method_named_forward():
    """The Bwd twins' forward(grad, ...) pickles and copies as a bound method (found by its
    name) and shows its parameters to inspect and help()."""
    import copy
    import inspect
    import pickle

    op = RoPENeoxPositionIdsBwdOp(16)
    assert list(inspect.signature(op.forward).parameters) == ["grad", "position_ids"]
    assert pickle.loads(pickle.dumps(op.forward)).__name__ == "forward"
    assert copy.copy(op.forward).__self__ is op
