"""Float64 oracle, random data and SPEC 5 assertions for the mHC tests (host and GPU)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

NP_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
DTYPE_NAMES = {dtype: name for name, dtype in NP_DTYPES.items()}
H_POST_TOLERANCE = 5e-5  # SPEC 5: absolute, against float64
# SPEC 5: x_res / x_layer within 2**-7 of each row's scale; for float32 x, SPEC 4's float32
# arithmetic rounded once to float32 is held to 2**-12 (the host reaches 2**-15.5 on
# saturated rows), which a mix in bfloat16 (2**-9) does not pass and 2**-7 would
ROW_SCALE_TOLERANCE = {"bfloat16": 2.0**-7, "float16": 2.0**-7, "float32": 2.0**-12}
# Post is float32 arithmetic rounded once to the output dtype (SPEC 4, 8): the float32
# result lies within FLOAT32_ERROR of its terms' magnitudes (plus a float32 subnormal step a
# product, where they are that small), and its one rounding within the dtype's unit
# roundoff of that result (UNIT_ROUNDOFF), or half a subnormal step of it
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
FLOAT32_ERROR = 2.0**-22  # of the terms' magnitudes: a product and a sum, with room


def one_rounding_bound(exact: np.ndarray, float32_error: np.ndarray, dtype: str) -> np.ndarray:
    """How far from ``exact`` a float32 result within ``float32_error`` of it may land once
    rounded to ``dtype``: a second rounding (through the dtype on the way, say) overshoots
    it wherever the result is not itself near a representable value."""
    subnormal = float(ml_dtypes.finfo(NP_DTYPES[dtype]).smallest_subnormal)
    return UNIT_ROUNDOFF[dtype] * (np.abs(exact) + float32_error) + float32_error + subnormal / 2


@dataclass
class PreCase:
    phi: np.ndarray  # float32 [n*c_x, Q]
    x: np.ndarray  # [batch, n*c_x] in the case's dtype (bf16 as ml_dtypes)
    b: np.ndarray  # float32 [Q]
    alphas: tuple[float, float, float]
    repeat: int
    eps: float

    @property
    def n(self) -> int:
        return math.isqrt(self.phi.shape[1] + 1) - 1


def random_pre_case(
    rng: np.random.Generator,
    n: int,
    c_x: int,
    batch: int,
    dtype: str = "bfloat16",
    repeat: int = 20,
    eps: float = 0.02,
    saturated: bool = False,
) -> PreCase:
    """Fresh data. Moderate: phi ~ N(0, 1/width), so ``h/rms`` is O(1) and the gates and
    the Sinkhorn matrix sit in their sensitive range. Saturated: phi ~ N(0, 1) and alphas of
    magnitude 0.5 + |N(0, 1)|, so ``h/rms`` is O(sqrt(width)) and the sigmoids hit 0 or 1."""
    width, q = n * c_x, n * n + 2 * n
    x = rng.standard_normal((batch, width)).astype(NP_DTYPES[dtype])
    if saturated:
        phi = rng.standard_normal((width, q)).astype(np.float32)
        # N(0, 1) magnitudes kept off zero, so every gate family saturates
        alphas = tuple(
            float(a) for a in rng.choice((-1, 1), 3) * (0.5 + abs(rng.standard_normal(3)))
        )
        b = rng.standard_normal(q).astype(np.float32)
    else:
        phi = (rng.standard_normal((width, q)) / math.sqrt(width)).astype(np.float32)
        alphas = tuple(float(a) for a in rng.uniform(0.5, 2.0, 3))
        b = (0.5 * rng.standard_normal(q)).astype(np.float32)
    return PreCase(phi, x, b, alphas, repeat, eps)


def pre_reference(case: PreCase) -> dict[str, np.ndarray]:
    """Float64 SPEC section 4, plus each output row's scale: max over the row of
    sum_k |weight_k| * |x_k[c]| (what a float32 weighted sum can be off by, relatively)."""
    phi = case.phi.astype(np.float64)
    x = np.asarray(case.x).astype(np.float64)
    b = case.b.astype(np.float64)
    n = case.n
    batch, width = x.shape
    c_x = width // n
    alpha_pre, alpha_post, alpha_res = case.alphas
    h = x @ phi
    rms = np.sqrt((x * x).sum(axis=1)) / math.sqrt(width) + 1e-4
    z = h / rms[:, None]
    with np.errstate(over="ignore"):
        h_pre = 1 / (1 + np.exp(-(alpha_pre * z[:, :n] + b[:n])))
        h_post = 2 / (1 + np.exp(-(alpha_post * z[:, n : 2 * n] + b[n : 2 * n])))
    logits = (alpha_res * z[:, 2 * n :] + b[2 * n :]).reshape(batch, n, n)
    m = np.exp(logits - logits.max(axis=2, keepdims=True))
    for _ in range(case.repeat):
        rows = m.sum(axis=2, keepdims=True) + case.eps
        m = m / np.where(rows == 0, 1.0, rows)
        cols = m.sum(axis=1, keepdims=True) + case.eps
        m = m / np.where(cols == 0, 1.0, cols)
    streams = x.reshape(batch, n, c_x)
    x_layer = np.einsum("bk,bkc->bc", h_pre, streams)
    x_res = np.einsum("bik,bkc->bic", m, streams).reshape(batch, width)
    layer_scale = np.einsum("bk,bkc->bc", np.abs(h_pre), np.abs(streams)).max(axis=1)
    res_scale = np.einsum("bik,bkc->bic", np.abs(m), np.abs(streams)).reshape(batch, -1).max(axis=1)
    return {
        "x_res": x_res,
        "x_layer": x_layer,
        "h_post": h_post,
        "res_scale": res_scale,
        "layer_scale": layer_scale,
    }


def post_reference(x_layer_out, h_post, x_res) -> tuple[np.ndarray, np.ndarray]:
    """(x_out, per-element scale |h*x_layer_out| + |x_res|) in float64."""
    layer = np.asarray(x_layer_out).astype(np.float64)
    gates = np.asarray(h_post).astype(np.float64)
    res = np.asarray(x_res).astype(np.float64)
    batch, c_x = layer.shape
    n = gates.shape[1]
    product = gates[:, :, None] * layer[:, None, :]
    out = product + res.reshape(batch, n, c_x)
    scale = np.abs(product) + np.abs(res.reshape(batch, n, c_x))
    return out.reshape(batch, n * c_x), scale.reshape(batch, n * c_x)


def to_float64(array) -> np.ndarray:
    """Any returned array (NumPy, torch CPU/CUDA, CuPy) as a float64 NumPy array."""
    module = type(array).__module__.split(".", 1)[0]
    if module == "torch":
        import torch

        return array.detach().to("cpu", torch.float64).numpy()
    if module == "cupy":
        import torch  # reads CuPy's bf16 through DLPack, where CuPy's astype may not

        return torch.from_dlpack(array).to("cpu", torch.float64).numpy()
    return np.asarray(array).astype(np.float64)


def assert_pre_matches(case: PreCase, outputs, *, check_mix: bool = True) -> None:
    """Every element of (x_res, x_layer, h_post) within SPEC 5 of the float64 oracle."""
    x_res, x_layer, h_post = (to_float64(o) for o in outputs)
    ref = pre_reference(case)
    batch, width = ref["x_res"].shape
    assert x_res.shape == (batch, width) and x_layer.shape == (batch, width // case.n)
    assert h_post.shape == (batch, case.n)
    for name, got in (("x_res", x_res), ("x_layer", x_layer), ("h_post", h_post)):
        assert np.isfinite(got).all(), f"{name} has non-finite values"
    np.testing.assert_allclose(h_post, ref["h_post"], rtol=0, atol=H_POST_TOLERANCE)
    if not check_mix:
        return
    tiny = 1e-30  # values far below every dtype's resolution round to zero either way
    for name, scale in (("x_res", "res_scale"), ("x_layer", "layer_scale")):
        got = x_res if name == "x_res" else x_layer
        tolerance = ROW_SCALE_TOLERANCE[DTYPE_NAMES[case.x.dtype]]
        bound = tolerance * ref[scale][:, None] + tiny
        error = np.abs(got - ref[name])
        worst = np.unravel_index(np.argmax(error - bound), error.shape)
        assert (error <= bound).all(), (
            f"{name}[{worst}] = {got[worst]} vs {ref[name][worst]} (bound {bound[worst[0], 0]})"
        )


def assert_post_matches(x_layer_out, h_post, x_res, x_out, dtype: str) -> None:
    ref, scale = post_reference(x_layer_out, h_post, x_res)
    got = to_float64(x_out)
    assert got.shape == ref.shape
    bound = one_rounding_bound(ref, FLOAT32_ERROR * scale + 2.0**-149, dtype)
    error = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), f"x_out[{worst}] = {got[worst]} vs {ref[worst]}"


# --------------------------------------------------------------------------- backward (SPEC 8)

GRAD_X_TOLERANCE = {"bfloat16": 2.0**-7, "float16": 2.0**-7, "float32": 1e-4}  # of a row's max
GRAD_SUM_TOLERANCE = 1e-3  # grad_phi, grad_b, grad_alpha: of the output's max |grad|


def torch_pre_reference(phi, x, b, alphas, repeat: int, eps: float):
    """SPEC section 4 in torch, differentiable in every tensor argument: ``(x_res, x_layer,
    h_post)`` for ``phi [n*c_x, Q]``, ``x [B, n*c_x]``, ``b [Q]`` and ``alphas`` (three
    0-d tensors or numbers). The row max is ``torch.amax``, whose gradient goes to the row's
    maximum (ties split evenly); a Sinkhorn sum that is exactly 0 divides by 1. The row norm
    is ``torch.linalg.vector_norm``, whose gradient at an all-zero row is 0 (the
    subgradient the ops document; ``sqrt(sum(x*x))`` would give NaN there)."""
    import torch

    alpha_pre, alpha_post, alpha_res = alphas
    batch, width = x.shape
    n = math.isqrt(phi.shape[1] + 1) - 1
    h = x @ phi
    rms = torch.linalg.vector_norm(x, dim=1, keepdim=True) / math.sqrt(width) + 1e-4
    z = h / rms
    h_pre = torch.sigmoid(alpha_pre * z[:, :n] + b[:n])
    h_post = 2 * torch.sigmoid(alpha_post * z[:, n : 2 * n] + b[n : 2 * n])
    logits = (alpha_res * z[:, 2 * n :] + b[2 * n :]).reshape(batch, n, n)
    m = torch.exp(logits - torch.amax(logits, dim=2, keepdim=True))
    for _ in range(repeat):
        for dim in (2, 1):
            sums = m.sum(dim=dim, keepdim=True) + eps
            m = m / torch.where(sums == 0, torch.ones_like(sums), sums)
    streams = x.reshape(batch, n, width // n)
    x_layer = torch.einsum("bk,bkc->bc", h_pre, streams)
    x_res = (m @ streams).reshape(batch, width)
    return x_res, x_layer, h_post


def as_float64_tensor(array):
    """A float64 torch CPU tensor of a NumPy array (bf16 included), requiring grad."""
    import torch

    values = torch.from_numpy(np.asarray(array).astype(np.float64))
    return values.requires_grad_(True)


def case_alphas(case: PreCase) -> tuple[float, float, float]:
    """The alphas as the op uses them (rounded to float32), as float64 numbers."""
    return tuple(float(np.float32(a)) for a in case.alphas)


def pre_backward_reference(case: PreCase, grad_x_res, grad_x_layer, grad_h_post) -> dict:
    """Float64 torch autograd of :func:`torch_pre_reference` on the case's inputs (x as
    rounded to its dtype) for the given upstream gradients: grad_phi, grad_x, grad_b and
    grad_alpha [3] (pre, post, res) as float64 NumPy arrays."""
    import torch

    phi, x, b = (as_float64_tensor(a) for a in (case.phi, case.x, case.b))
    alphas = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in case_alphas(case)]
    outputs = torch_pre_reference(phi, x, b, alphas, case.repeat, float(np.float32(case.eps)))
    upstream = [to_float64(g) for g in (grad_x_res, grad_x_layer, grad_h_post)]
    grads = torch.autograd.grad(
        outputs, (phi, x, b, *alphas), [torch.from_numpy(g) for g in upstream]
    )
    grad_phi, grad_x, grad_b, *grad_alpha = (g.numpy() for g in grads)
    return {
        "grad_phi": grad_phi,
        "grad_x": grad_x,
        "grad_b": grad_b,
        "grad_alpha": np.array([float(a) for a in grad_alpha]),
    }


def assert_within(name: str, got, ref: np.ndarray, bound) -> None:
    """Every element of ``got`` within ``bound`` (broadcast against ``ref``) of ``ref``;
    the message names the worst element (largest excess over its bound)."""
    got = to_float64(got)
    assert got.shape == ref.shape, f"{name} has shape {got.shape}, expected {ref.shape}"
    bound = np.broadcast_to(bound, ref.shape)
    error = np.abs(got - ref)
    error = np.where(np.isnan(error), np.inf, error)  # NaN never passes
    if error.size == 0:
        return
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), (
        f"{name}{list(worst)} = {got[worst]!r} vs {ref[worst]!r}: off by {error[worst]:.3g}, "
        f"bound {bound[worst]:.3g}"
    )


def assert_pre_backward_matches(case: PreCase, upstream, grads) -> None:
    """(grad_phi, grad_x, grad_b, grad_alpha) within SPEC 8 of the float64 autograd oracle
    for the upstream gradients (grad_x_res, grad_x_layer, grad_h_post)."""
    assert_pre_grads_match(pre_backward_reference(case, *upstream), grads, str(case.x.dtype))


def assert_pre_grads_match(ref: dict, grads, dtype: str) -> None:
    """SPEC 8 against float64 gradients ``ref``: grad_x per row within GRAD_X_TOLERANCE of
    the row's max |grad|, the batch reductions within GRAD_SUM_TOLERANCE of their max |grad|."""
    grad_phi, grad_x, grad_b, grad_alpha = grads
    tiny = 1e-30  # a row or output whose exact gradient is all zero
    row_max = np.abs(ref["grad_x"]).max(axis=1, keepdims=True)
    assert_within("grad_x", grad_x, ref["grad_x"], GRAD_X_TOLERANCE[dtype] * row_max + tiny)
    for name, got in (("grad_phi", grad_phi), ("grad_b", grad_b), ("grad_alpha", grad_alpha)):
        bound = GRAD_SUM_TOLERANCE * np.abs(ref[name]).max() + tiny
        assert_within(name, got, ref[name], bound)


def assert_post_backward_matches(x_layer_out, h_post, grad_x_out, grads, dtype: str) -> None:
    """(grad_x_layer_out, grad_h_post, grad_x_res) of mHC post against float64:
    grad_x_layer_out (a sum of n products in float32, each term's error 2**-23 of the sum of
    |terms| at most, or half a float32 subnormal step) rounded once
    (:func:`one_rounding_bound`), and grad_h_post (float32, a
    sum over c_x) within FLOAT32_ERROR of the sum of |terms|, plus the smallest subnormal;
    grad_x_res is grad_x_out exactly."""
    layer = np.asarray(x_layer_out).astype(np.float64)
    gates = np.asarray(h_post).astype(np.float64)
    upstream = np.asarray(grad_x_out).astype(np.float64)
    batch, c_x = layer.shape
    n = gates.shape[1]
    upstream = upstream.reshape(batch, n, c_x)
    terms_layer = gates[:, :, None] * upstream  # summed over i
    terms_gates = upstream * layer[:, None, :]  # summed over c
    grad_layer, grad_gates, grad_res = grads
    exact_layer = terms_layer.sum(axis=1)
    float32_error = n * (2.0**-23 * np.abs(terms_layer).sum(axis=1) + 2.0**-149)
    bound = one_rounding_bound(exact_layer, float32_error, dtype)
    assert_within("grad_x_layer_out", grad_layer, exact_layer, bound)
    assert_within(
        "grad_h_post",
        grad_gates,
        terms_gates.sum(axis=2),
        FLOAT32_ERROR * np.abs(terms_gates).sum(axis=2) + 2.0**-149,
    )
    assert_within("grad_x_res", grad_res, upstream.reshape(batch, n * c_x), 0.0)
