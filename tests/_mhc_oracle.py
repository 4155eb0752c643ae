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
H_POST_TOLERANCE = 5e-5  # SPEC 5: absolute, against float64
ROW_SCALE_TOLERANCE = 2.0**-7  # SPEC 5: x_res / x_layer, relative to each row's scale
# Post is float32 arithmetic rounded once to the output dtype: twice the dtype's unit
# roundoff (2**-8 bf16, 2**-11 fp16, 2**-24 fp32) leaves room for the float32 noise.
POST_TOLERANCE = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-22}


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
        bound = ROW_SCALE_TOLERANCE * ref[scale][:, None] + tiny
        error = np.abs(got - ref[name])
        worst = np.unravel_index(np.argmax(error - bound), error.shape)
        assert (error <= bound).all(), (
            f"{name}[{worst}] = {got[worst]} vs {ref[name][worst]} (bound {bound[worst[0], 0]})"
        )


def assert_post_matches(x_layer_out, h_post, x_res, x_out, dtype: str) -> None:
    ref, scale = post_reference(x_layer_out, h_post, x_res)
    got = to_float64(x_out)
    assert got.shape == ref.shape
    bound = POST_TOLERANCE[dtype] * scale + 1e-30
    error = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), f"x_out[{worst}] = {got[worst]} vs {ref[worst]}"
