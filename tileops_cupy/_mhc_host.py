"""The numpy bodies of the mHC primitives: float32 arithmetic, one rounding to x's dtype.

Same contract as ``kernels_cu/mhc.cu`` (SPEC section 4): ``h = x @ phi`` and the RMS in
float32, sigmoid gates, ``exp(L - rowmax(L))`` then ``sinkhorn_repeat`` row-then-column
normalisations with ``eps`` added to each denominator. bfloat16 arrays arrive as
``ml_dtypes.bfloat16`` views, whose ``astype`` rounds to nearest even. Rows are processed in
blocks so the float32 temporaries stay a few MB whatever the batch.

The backward bodies (SPEC section 8) recompute the forward's cheap intermediates (``h``, the
row norm, the gates, every Sinkhorn step) from the inputs rather than storing them, and sum
the batch reductions (``grad_phi``, ``grad_b``, ``grad_alpha``) in float32, block after block
in a fixed order, so the same inputs always give the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

_BLOCK_FLOATS = 1 << 22  # float32 elements of x per row block (16 MB)

# The entry points run quiet: float32 overflow to inf (h = x @ phi near 3e38) and NaN rows from
# non-finite x are the kernels' arithmetic too, where nothing warns; numpy's RuntimeWarnings
# about them would reach the caller as noise.
_quiet = np.errstate(all="ignore")


def _row_blocks(batch: int, row_floats: int) -> Iterator[slice]:
    """Slices of at most ``_BLOCK_FLOATS / row_floats`` rows covering ``[0, batch)``: the
    float32 temporaries of a block stay a few MB whatever the batch."""
    step = max(1, _BLOCK_FLOATS // max(row_floats, 1))
    for start in range(0, batch, step):
        yield slice(start, min(batch, start + step))


@dataclass(frozen=True, slots=True)
class SinkhornGates:
    """The scalar parameters of mHC pre, rounded to float32 as the kernels use them."""

    alpha_pre: np.float32
    alpha_post: np.float32
    alpha_res: np.float32
    sinkhorn_repeat: int
    sinkhorn_eps: np.float32


def scaled_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(scaled, root, exponent)`` of float32 ``x [rows, width]``: each row scaled by the
    power of two ``2**-exponent`` that brings its max |x| into [0.5, 1) (a zero row by 1), and
    ``root = sqrt(sum(scaled*scaled))``, so a row's norm is ``root * 2**exponent``.

    Squaring scaled values neither overflows (|x| ~ 1e19 and up) nor underflows, and scaling
    by a power of two is exact, so a row whose squares fit in float32 gets the very bits of
    the unscaled sum, as the kernels do: they scale only a row whose sum overflowed
    (``mhc.cu``'s ``rows_rms``), in the same way.

    The squares are summed in float64 and the root rounded once to float32: einsum's one
    running float32 total drifts by about 4e-6 of a 28672-wide row, which ``alpha *
    h / rms`` of a few hundred carries past SPEC's 5e-5 on h_post; a float64 sum costs about
    7% of a host pre call and leaves only the rounding."""
    _, exponent = np.frexp(np.abs(x).max(axis=1))  # max |x| = m * 2**exponent; 0 -> 0
    scaled = np.ldexp(x, -exponent[:, None])
    squares = np.einsum("ij,ij->i", scaled, scaled, dtype=np.float64)
    return scaled, np.sqrt(squares).astype(np.float32), exponent


def row_rms(root: np.ndarray, exponent: np.ndarray, width: int) -> np.ndarray:
    """``rms [rows, 1] = sqrt(sum(x*x)) / sqrt(width) + 1e-4`` from :func:`scaled_rows`,
    divided by sqrt(width) before the scale returns (as the kernels do): the norm itself may
    exceed float32 where the RMS does not (|x| near 3e38)."""
    rms = np.ldexp(root / np.sqrt(np.float32(width)), exponent) + np.float32(1e-4)
    return rms[:, None]


def sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))``; exp overflowing to inf gives 0, as on device (quietly: it runs
    inside the entry points' ``_quiet``)."""
    return 1 / (1 + np.exp(-z))


def logits(
    h: np.ndarray, rms: np.ndarray, bias: np.ndarray, gates: SinkhornGates, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pre [rows, n], post [rows, n], res [rows, n, n]): the arguments of the two sigmoids
    and of the Sinkhorn exponentials, from ``h = x @ phi`` and :func:`row_rms`, all
    float32."""
    pre = gates.alpha_pre * h[:, :n] / rms + bias[:n]
    post = gates.alpha_post * h[:, n : 2 * n] / rms + bias[n : 2 * n]
    res = (gates.alpha_res * h[:, 2 * n :] / rms + bias[2 * n :]).reshape(-1, n, n)
    return pre, post, res


def sinkhorn(matrix: np.ndarray, gates: SinkhornGates, trace: list | None = None) -> np.ndarray:
    """``sinkhorn_repeat`` row-then-column normalisations of ``matrix [rows, n, n]``; each
    step's (axis, result) is appended to ``trace`` when one is given."""
    eps = gates.sinkhorn_eps
    for _ in range(gates.sinkhorn_repeat):
        for axis in (2, 1):  # rows, then columns
            # a sum of non-negative entries plus eps is 0 only when every entry is 0 (eps = 0
            # after the exponentials underflowed): divide those by 1, keeping zeros, not NaN
            sums = matrix.sum(axis=axis, keepdims=True) + eps
            divisor = np.where(sums == 0, np.float32(1), sums)
            matrix = matrix / divisor
            if trace is not None:
                trace.append((axis, matrix))
    return matrix


def sinkhorn_backward(grad_log: np.ndarray, trace: list) -> np.ndarray:
    """The gradient with respect to the log of the Sinkhorn input from the one with respect
    to the log of its output (``grad * M`` elementwise), through every step of ``trace``.

    A step ``out = m / d``, ``d = sum(m) + eps`` along the axis, has
    ``grad_m = (grad_out - sum(grad_out * out)) / d``; times ``m`` that is
    ``u_m = u_out - out * sum(u_out)`` for ``u = grad * m``: no division. The plain form
    divides by ``d >= eps`` at every step, so where the forward lifted a near-empty column
    (tiny entries over ``eps``, 2*sinkhorn_repeat times) the gradient of its entries grows
    past float32 before the tiny entries would scale it back; in this form it never does.
    Where ``d`` was replaced by 1, ``out`` is all zero and the formula still holds (no
    gradient through the sum)."""
    for axis, out in reversed(trace):
        grad_log = grad_log - out * grad_log.sum(axis=axis, keepdims=True)
    return grad_log


def coefficients(
    xb: np.ndarray, phi: np.ndarray, bias: np.ndarray, gates: SinkhornGates, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(h_pre [rows, n], h_post [rows, n], M [rows, n, n]) of the float32 rows ``xb``, all
    float32."""
    _, root, exponent = scaled_rows(xb)
    pre, post, res = logits(xb @ phi, row_rms(root, exponent, xb.shape[1]), bias, gates, n)
    matrix = np.exp(res - res.max(axis=2, keepdims=True))
    return sigmoid(pre), 2 * sigmoid(post), sinkhorn(matrix, gates)


@_quiet
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
    for block in _row_blocks(batch, width):
        xb = x[block].astype(np.float32)
        h_pre, post, matrix = coefficients(xb, phi32, bias32, gates, n)
        streams = xb.reshape(-1, n, c_x)
        x_layer[block] = np.matmul(h_pre[:, None, :], streams)[:, 0, :].astype(x_layer.dtype)
        mixed = np.matmul(matrix, streams).reshape(-1, width)
        x_res[block] = mixed.astype(x_res.dtype)
        h_post[block] = post


def _post_blocks(
    x_layer_out: np.ndarray, h_post: np.ndarray, streams: np.ndarray
) -> Iterator[tuple[slice, np.ndarray, np.ndarray, np.ndarray]]:
    """Post's operands block by block (:func:`_row_blocks`) in float32: ``(rows,
    x_layer_out [b, c_x], h_post [b, n], streams [b, n, c_x])``, where ``streams`` is
    ``[B, n*c_x]`` (x_res forward, grad_x_out backward)."""
    batch, c_x = x_layer_out.shape
    n = h_post.shape[1]
    for block in _row_blocks(batch, n * c_x):
        layer = x_layer_out[block].astype(np.float32)
        gates = h_post[block].astype(np.float32)
        yield block, layer, gates, streams[block].astype(np.float32).reshape(-1, n, c_x)


@_quiet
def mhc_post_host(
    x_layer_out: np.ndarray, h_post: np.ndarray, x_res: np.ndarray, x_out: np.ndarray
) -> None:
    """``x_out[b, i*c_x + c] = h_post[b, i] * x_layer_out[b, c] + x_res[b, i*c_x + c]``."""
    for block, layer, gates, residual in _post_blocks(x_layer_out, h_post, x_res):
        mixed = gates[:, :, None] * layer[:, None, :] + residual
        x_out[block] = mixed.reshape(-1, x_out.shape[1]).astype(x_out.dtype)


@_quiet
def mhc_pre_backward_host(
    phi: np.ndarray,
    x: np.ndarray,
    bias: np.ndarray,
    gates: SinkhornGates,
    grad_x_res: np.ndarray,
    grad_x_layer: np.ndarray,
    grad_h_post: np.ndarray,
    grad_phi: np.ndarray,
    grad_x: np.ndarray,
    grad_b: np.ndarray,
    grad_alpha: np.ndarray,
) -> None:
    """Fill ``grad_phi [n*c_x, Q]``, ``grad_x [B, n*c_x]`` (x's dtype), ``grad_b [Q]`` and
    ``grad_alpha [3]`` (pre, post, res) with the exact gradient of :func:`mhc_pre_host` for
    the upstream ``grad_x_res [B, n*c_x]``, ``grad_x_layer [B, c_x]`` and
    ``grad_h_post [B, n]``."""
    batch, width = x.shape
    q = phi.shape[1]
    n = grad_h_post.shape[1]
    c_x = width // n
    phi32 = phi.astype(np.float32, copy=False)
    bias32 = bias.astype(np.float32, copy=False)
    alpha = np.array([gates.alpha_pre, gates.alpha_post, gates.alpha_res], np.float32)
    alpha_of_logit = np.repeat(alpha, (n, n, n * n))  # the alpha each logit is scaled by
    # the logits whose gradients are products of x with the upstream ones (pre's and res's)
    of_x = np.repeat(np.array([1, 0, 1]), (n, n, n * n))
    sum_phi = np.zeros((width, q), np.float32)
    sum_b = np.zeros(q, np.float32)
    sum_alpha = np.zeros(3, np.float32)
    # float32 temporaries per row: x, the upstream and partial x gradients, h-sized vectors
    # and every Sinkhorn step's result
    row_floats = 5 * width + 6 * q + 2 * gates.sinkhorn_repeat * n * n
    for block in _row_blocks(batch, row_floats):
        rows = block.stop - block.start
        # the forward again, keeping what the chain rule needs
        xb = x[block].astype(np.float32)
        h = xb @ phi32
        scaled, root, exponent = scaled_rows(xb)
        rms = row_rms(root, exponent, width)
        pre, post, res = logits(h, rms, bias32, gates, n)
        h_pre = sigmoid(pre)
        peak = res.max(axis=2, keepdims=True)
        shifted = np.exp(res - peak)
        trace: list = []
        matrix = sinkhorn(shifted, gates, trace)
        scaled_streams = scaled.reshape(rows, n, c_x)
        up_res = grad_x_res[block].astype(np.float32).reshape(rows, n, c_x)
        up_layer = grad_x_layer[block].astype(np.float32)
        up_post = grad_h_post[block].astype(np.float32)
        # x_res = M @ streams and x_layer = h_pre @ streams
        grad_streams = np.matmul(matrix.transpose(0, 2, 1), up_res)
        grad_streams += h_pre[:, :, None] * up_layer[:, None, :]
        # M's and h_pre's gradients are products of x with the upstream gradients: taken of
        # the scaled rows (x times 2**-exponent), they stay finite where |x| ~ 1e37 across a
        # wide row would overflow them, while x's own gradient is O(1). Each step from there
        # to the logits is linear and a power of two scales exactly, so those logits'
        # gradients carry the factor until divided by the RMS scaled alike.
        grad_matrix = np.matmul(up_res, scaled_streams.transpose(0, 2, 1))
        grad_h_pre = np.matmul(scaled_streams, up_layer[:, :, None])[:, :, 0]
        # Sinkhorn, exp, and the row max (torch.amax: ties share the gradient evenly)
        grad_shifted = sinkhorn_backward(grad_matrix * matrix, trace)  # d/d(res - peak)
        ties = res == peak
        to_peak = grad_shifted.sum(axis=2, keepdims=True) / ties.sum(axis=2, keepdims=True)
        grad_res = grad_shifted - ties * to_peak
        # the sigmoids: s' = s * (1 - s), with 1 - s as sigmoid(-z) (no cancellation)
        scaled_grad_logit = np.concatenate(
            (
                grad_h_pre * h_pre * sigmoid(-pre),
                2 * up_post * sigmoid(post) * sigmoid(-post),
                grad_res.reshape(rows, n * n),
            ),
            axis=1,
        )
        shift = of_x * exponent[:, None]  # scaled_grad_logit = grad_logit * 2**-shift
        grad_logit = np.ldexp(scaled_grad_logit, shift)  # inf only where the true value is
        # logit = alpha * h / rms + b, rms = norm / sqrt(width) + 1e-4, norm = |x|, h = x @ phi
        z = h / rms
        grad_h = scaled_grad_logit * alpha_of_logit / np.ldexp(rms, -shift)
        grad_norm = -(grad_h * z).sum(axis=1) / np.sqrt(np.float32(width))
        unit = scaled / np.where(root == 0, np.float32(1), root)[:, None]  # d norm / dx (0 at 0)
        grad_xb = grad_streams.reshape(rows, width) + grad_h @ phi32.T
        grad_xb += grad_norm[:, None] * unit
        grad_x[block] = grad_xb.astype(grad_x.dtype)
        sum_phi += xb.T @ grad_h
        sum_b += grad_logit.sum(axis=0)
        per_alpha = (grad_logit * z).sum(axis=0)
        sum_alpha += (per_alpha[:n].sum(), per_alpha[n : 2 * n].sum(), per_alpha[2 * n :].sum())
    grad_phi[...] = sum_phi
    grad_b[...] = sum_b
    grad_alpha[...] = sum_alpha


@_quiet
def mhc_post_backward_host(
    x_layer_out: np.ndarray,
    h_post: np.ndarray,
    grad_x_out: np.ndarray,
    grad_x_layer_out: np.ndarray,
    grad_h_post: np.ndarray,
) -> None:
    """Fill ``grad_x_layer_out [B, c_x]`` (its dtype) and ``grad_h_post [B, n]`` (float32)
    for ``x_out[b, i*c_x + c] = h_post[b, i] * x_layer_out[b, c] + x_res[b, i*c_x + c]``
    (grad_x_res is ``grad_x_out`` itself: x_res enters x_out with weight 1)."""
    for block, layer, gates, grad in _post_blocks(x_layer_out, h_post, grad_x_out):
        grad_layer = np.matmul(gates[:, None, :], grad)[:, 0, :]
        grad_x_layer_out[block] = grad_layer.astype(grad_x_layer_out.dtype)
        grad_h_post[block] = np.matmul(grad, layer[:, :, None])[:, :, 0]
