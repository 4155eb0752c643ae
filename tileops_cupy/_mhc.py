"""CUDA bodies of the mHC primitives (launchers of ``kernels_cu/mhc*.cu``).

Callers validate; these functions only launch. Every array argument is an
:class:`~tileops_cupy._arrays.Operand` on one CUDA device; outputs are fresh contiguous
arrays the caller allocated with ``empty_like``; ``stream`` is the raw handle of the
caller's current stream. Nothing here synchronises the host or allocates outside the
caller's allocator, so every launch can be captured in a CUDA graph.
"""

from __future__ import annotations

from ._arrays import Operand
from ._mhc_host import SinkhornGates

__all__ = ["pre_backward_cuda", "post_backward_cuda"]


def pre_backward_cuda(
    gates: SinkhornGates,
    phi: Operand,
    x: Operand,
    b: Operand,
    grad_x_res: Operand,
    grad_x_layer: Operand,
    grad_h_post: Operand,
    grad_phi: Operand,
    grad_x: Operand,
    grad_b: Operand,
    grad_alpha: Operand,
    stream: int,
) -> None:
    """Fill ``grad_phi [n*c_x, Q]`` (float32), ``grad_x [B, n*c_x]`` (x's dtype),
    ``grad_b [Q]`` (float32) and ``grad_alpha [3]`` (float32: pre, post, res) with the
    exact gradient of mHC pre (SPEC section 8) for the upstream gradients ``grad_x_res``
    ``[B, n*c_x]`` and ``grad_x_layer`` ``[B, c_x]`` (x's dtype) and ``grad_h_post``
    ``[B, n]`` (float32). Reductions over the batch are deterministic."""
    raise NotImplementedError("mHC pre backward has no CUDA body yet")


def post_backward_cuda(
    x_layer_out: Operand,
    h_post: Operand,
    x_res: Operand,
    grad_x_out: Operand,
    grad_x_layer_out: Operand,
    grad_h_post: Operand,
    grad_x_res: Operand,
    stream: int,
) -> None:
    """Fill ``grad_x_layer_out [B, c_x]``, ``grad_h_post [B, n]`` (float32) and
    ``grad_x_res [B, n*c_x]`` for ``x_out = h_post[i] * x_layer_out + x_res[i]``."""
    raise NotImplementedError("mHC post backward has no CUDA body yet")
