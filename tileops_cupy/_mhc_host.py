"""The numpy bodies of the mHC primitives: float32 arithmetic, one rounding to x's dtype.

Same contract as ``kernels_cu/mhc.cu`` (SPEC section 4): ``h = x @ phi`` and the RMS in
float32, sigmoid gates, ``exp(L - rowmax(L))`` then ``sinkhorn_repeat`` row-then-column
normalisations with ``eps`` added to each denominator. bfloat16 arrays arrive as
``ml_dtypes.bfloat16`` views, whose ``astype`` rounds to nearest even. Rows are processed in
blocks so the float32 temporaries stay a few MB whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_BLOCK_FLOATS = 1 << 22  # float32 elements of x per row block (16 MB)


@dataclass(frozen=True, slots=True)
class SinkhornGates:
    """The scalar parameters of mHC pre, rounded to float32 as the kernels use them."""

    alpha_pre: np.float32
    alpha_post: np.float32
    alpha_res: np.float32
    sinkhorn_repeat: int
    sinkhorn_eps: np.float32


def coefficients(
    h: np.ndarray, sumsq: np.ndarray, bias: np.ndarray, gates: SinkhornGates, n: int, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(h_pre [rows, n], h_post [rows, n], M [rows, n, n]) from ``h = x @ phi`` and
    ``sum(x*x)`` of each row, all float32."""
    rms = np.sqrt(sumsq) / np.sqrt(np.float32(width)) + np.float32(1e-4)
    rms = rms[:, None]
    with np.errstate(over="ignore"):  # exp(-z) overflowing to inf gives the gate 0, as on device
        h_pre = 1 / (1 + np.exp(-(gates.alpha_pre * h[:, :n] / rms + bias[:n])))
        h_post = 2 * (
            1 / (1 + np.exp(-(gates.alpha_post * h[:, n : 2 * n] / rms + bias[n : 2 * n])))
        )
    logits = (gates.alpha_res * h[:, 2 * n :] / rms + bias[2 * n :]).reshape(-1, n, n)
    matrix = np.exp(logits - logits.max(axis=2, keepdims=True))
    eps = gates.sinkhorn_eps
    for _ in range(gates.sinkhorn_repeat):
        # a sum of non-negative entries plus eps is 0 only when every entry is 0 (eps = 0
        # after the exponentials underflowed): divide those by 1, keeping zeros, not NaN
        rows = matrix.sum(axis=2, keepdims=True) + eps
        matrix = matrix / np.where(rows == 0, np.float32(1), rows)
        columns = matrix.sum(axis=1, keepdims=True) + eps
        matrix = matrix / np.where(columns == 0, np.float32(1), columns)
    return h_pre, h_post, matrix


def mhc_pre_host(
    phi: np.ndarray,
    x: np.ndarray,
    bias: np.ndarray,
    gates: SinkhornGates,
    x_res: np.ndarray,
    x_layer: np.ndarray,
    h_post: np.ndarray,
) -> None:
    """Fill ``x_res [B, n*c_x]``, ``x_layer [B, c_x]`` (x's dtype) and ``h_post [B, n]``."""
    batch, width = x.shape
    n = h_post.shape[1]
    c_x = width // n
    phi32 = phi.astype(np.float32, copy=False)
    bias32 = bias.astype(np.float32, copy=False)
    step = max(1, _BLOCK_FLOATS // max(width, 1))
    for start in range(0, batch, step):
        stop = min(batch, start + step)
        xb = x[start:stop].astype(np.float32)
        h = xb @ phi32
        sumsq = np.einsum("ij,ij->i", xb, xb)
        h_pre, post, matrix = coefficients(h, sumsq, bias32, gates, n, width)
        streams = xb.reshape(stop - start, n, c_x)
        x_layer[start:stop] = np.matmul(h_pre[:, None, :], streams)[:, 0, :].astype(x_layer.dtype)
        mixed = np.matmul(matrix, streams).reshape(stop - start, width)
        x_res[start:stop] = mixed.astype(x_res.dtype)
        h_post[start:stop] = post


def mhc_post_host(
    x_layer_out: np.ndarray, h_post: np.ndarray, x_res: np.ndarray, x_out: np.ndarray
) -> None:
    """``x_out[b, i*c_x + c] = h_post[b, i] * x_layer_out[b, c] + x_res[b, i*c_x + c]``."""
    batch, c_x = x_layer_out.shape
    n = h_post.shape[1]
    step = max(1, _BLOCK_FLOATS // max(n * c_x, 1))
    for start in range(0, batch, step):
        stop = min(batch, start + step)
        layer = x_layer_out[start:stop].astype(np.float32)
        gates = h_post[start:stop].astype(np.float32)
        residual = x_res[start:stop].astype(np.float32).reshape(stop - start, n, c_x)
        mixed = gates[:, :, None] * layer[:, None, :] + residual
        x_out[start:stop] = mixed.reshape(stop - start, n * c_x).astype(x_out.dtype)
