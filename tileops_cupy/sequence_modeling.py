"""Manifold-constrained hyper-connections (mHC, DeepSeek; TileOPs semantics): the pre-layer
reduction :class:`MHCPreFwdOp` and the post-layer mix :class:`MHCPostFwdOp`, and their
gradients :class:`MHCPreBwdOp` and :class:`MHCPostBwdOp` (SPEC section 8).

The residual stream is ``n`` streams wide: a token is a row of ``n * c_x`` values, stream k
being columns ``k*c_x .. (k+1)*c_x``. Pre projects the row onto ``phi`` (``h = x @ phi``),
turns ``h`` into gates and a doubly-stochastic-ish mixing matrix (Sinkhorn), and returns the
layer input ``x_layer`` (the streams weighted by ``h_pre``), the residual ``x_res`` (the
streams mixed by the matrix) and ``h_post``. Post puts the layer output back:
``x_out[i] = h_post[i] * x_layer_out + x_res[i]``. SPEC section 4 has the formulas.

Each op is one path: validate -> pick the place from where the data lives -> one primitive
(``mhc_pre``, ``mhc_post``, ``mhc_pre_backward``, ``mhc_post_backward``) with a numpy body
(``_mhc_host``) and a CUDA body (``kernels_cu/``, the backward's launched from ``_mhc``).
Results come back in the framework of the first argument (torch in, torch out; CuPy, CuPy;
NumPy, NumPy), on its device; CUDA work runs on the caller's current stream.

Example (host, runs anywhere)::

    >>> import numpy as np
    >>> from tileops_cupy.sequence_modeling import MHCPreFwdOp, MHCPostFwdOp
    >>> rng = np.random.default_rng(0)
    >>> n, c_x, batch = 4, 64, 3
    >>> phi = (rng.standard_normal((n * c_x, n * n + 2 * n)) / 16).astype(np.float32)
    >>> b = np.zeros(n * n + 2 * n, np.float32)
    >>> x = rng.standard_normal((batch, n * c_x)).astype(np.float32)
    >>> x_res, x_layer, h_post = MHCPreFwdOp(1.0, 1.0, 1.0, sinkhorn_repeat=20)(phi, x, b)
    >>> x_res.shape, x_layer.shape, h_post.shape
    ((3, 256), (3, 64), (3, 4))
    >>> MHCPostFwdOp()(x_layer, h_post, x_res).shape
    (3, 256)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from . import _mhc
from . import _torch_ops as torch_ops
from ._arrays import (
    BUILTIN,
    Operand,
    as_operand,
    empty_like,
    in_framework_of,
    select_place,
    to_caller,
)
from ._cache import TWINS, LaunchRecords, ProcessLocal
from ._mhc_host import (
    SinkhornGates,
)
from ._validate import check_dtype, check_ndim, check_real, check_target, is_int

__all__ = ["BUILTIN", "MHCPreFwdOp", "MHCPostFwdOp", "MHCPreBwdOp", "MHCPostBwdOp"]

Array = Any  # torch, CuPy, NumPy, JAX or any DLPack tensor

X_DTYPES = tuple(_mhc.CUDA_TYPES)  # bfloat16, float16, float32


# --------------------------------------------------------------------------- ops


class _MHCOp(ProcessLocal):
    """An mHC op: what it holds for this process alone is the launches it recorded."""

    _process_state = frozenset({"_relaunches"})

    def _start(self) -> None:
        self._relaunches = LaunchRecords()  # torch layouts -> their recorded launch
        torch_ops.register_if_torch_imported()


class _PreSettings(_MHCOp):
    """The constructor MHCPreFwdOp and MHCPreBwdOp share: the arguments validated, the
    public attributes, the float32 gates the bodies use, and ``config`` (the op by value,
    as its torch custom op carries it)."""

    def __init__(
        self,
        alpha_pre: float,
        alpha_post: float,
        alpha_res: float,
        sinkhorn_repeat: int,
        sinkhorn_eps: float = 0.02,
        *,
        target: str | None = None,
    ) -> None:
        self.target = check_target(target)
        alphas = {"alpha_pre": alpha_pre, "alpha_post": alpha_post, "alpha_res": alpha_res}
        for name, value in alphas.items():
            check_real(name, value, float32=True)
        if not is_int(sinkhorn_repeat):
            raise TypeError(f"sinkhorn_repeat must be an int, got {type(sinkhorn_repeat).__name__}")
        # (the kernels count iterations, and the backward its checkpoints past them, in ints)
        if not 0 <= sinkhorn_repeat < 2**30:
            raise ValueError(f"sinkhorn_repeat must be in [0, 2**30), got {sinkhorn_repeat}")
        check_real("sinkhorn_eps", sinkhorn_eps, float32=True)
        if sinkhorn_eps < 0:
            raise ValueError(f"sinkhorn_eps must be >= 0, got {sinkhorn_eps}")
        self.alpha_pre, self.alpha_post, self.alpha_res = alpha_pre, alpha_post, alpha_res
        self.sinkhorn_repeat, self.sinkhorn_eps = int(sinkhorn_repeat), sinkhorn_eps
        self._gates = SinkhornGates(
            np.float32(alpha_pre),
            np.float32(alpha_post),
            np.float32(alpha_res),
            int(sinkhorn_repeat),
            np.float32(sinkhorn_eps),
        )
        self.config = (
            float(alpha_pre), float(alpha_post), float(alpha_res), int(sinkhorn_repeat),
            float(sinkhorn_eps), self.target or "",
        )  # fmt: skip
        self._start()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(alpha_pre={self.alpha_pre}, alpha_post={self.alpha_post}, "
            f"alpha_res={self.alpha_res}, sinkhorn_repeat={self.sinkhorn_repeat}, "
            f"sinkhorn_eps={self.sinkhorn_eps}, target={self.target!r})"
        )


class MHCPreFwdOp(_PreSettings):
    """The pre-layer half of mHC: reduce the ``n``-stream residual to the layer input.

    Args:
        alpha_pre: scale of the projection that makes the pre-layer gates ``h_pre``.
        alpha_post: scale of the projection that makes the post-layer gates ``h_post``.
        alpha_res: scale of the logits of the residual mixing matrix. (To learn the
            alphas, scale phi's three column blocks by them and pass 1.0: ``alpha * h`` is
            ``x @ (alpha * phi)``, and torch differentiates the scaling; see the README.)
        sinkhorn_repeat: Sinkhorn iterations (each a row then a column normalisation), >= 0.
        sinkhorn_eps: added to every Sinkhorn row and column sum before dividing, >= 0.
        target: None or ``BUILTIN`` to run where the data lives, "cuda" or "cpu" to insist.

    The alphas and ``sinkhorn_eps`` must lie within float32's range (the arithmetic is
    float32): a ValueError names the one that does not.

    ``forward(phi, x, b)`` (also ``op(phi, x, b)``):

    - ``phi`` ``[n*c_x, n*n + 2n]`` float32; ``n`` is read from its width.
    - ``x`` ``[batch, n*c_x]`` bfloat16, float16 or float32; token row, stream k at
      columns ``k*c_x .. (k+1)*c_x``. Read in place when its last dimension is contiguous
      (any row stride); otherwise copied once.
    - ``b`` ``[n*n + 2n]`` float32.

    Returns ``(x_res [batch, n*c_x], x_layer [batch, c_x], h_post [batch, n])``: the first
    two in x's dtype, each element one rounding of its float32 value; ``h_post`` float32.
    Arithmetic is float32 throughout (``x @ phi`` included: on CUDA the tensor cores see
    phi as three exact bf16 pieces, never TF32). A Sinkhorn row or column whose entries all
    underflowed to 0 (possible only with ``sinkhorn_eps=0``) stays 0 rather than NaN. The
    CUDA kernels take n <= 8 (float32 x on an sm_80 device, whose blocks get 163 KB of
    shared memory: n <= 6).

    Raises:
        ValueError: a non-2-D ``phi``/``x`` or non-1-D ``b``; a phi width that is not
            ``n*n + 2n``; phi rows != x width; a width not divisible by n (or zero);
            ``len(b)`` != phi width; inputs on different devices; a ``target`` other than
            where the data lives; n > 8 on CUDA (float32 x on a device with too little
            shared memory a block for n: n > 6 on sm_80).
        TypeError: an argument that is not an array; a dtype other than the above.

    Example (torch on the host; CUDA tensors run the kernels, e.g. n 4 with c_x 7168)::

        >>> import torch
        >>> op = MHCPreFwdOp(alpha_pre=1.0, alpha_post=1.0, alpha_res=1.0, sinkhorn_repeat=20)
        >>> phi = torch.randn(4 * 64, 24) / 16  # n = 4 streams of c_x = 64: Q = 4*4 + 2*4
        >>> b = torch.zeros(24)
        >>> x = torch.randn(16, 4 * 64, dtype=torch.bfloat16)
        >>> x_res, x_layer, h_post = op(phi, x, b)
        >>> x_res.shape, x_layer.shape, h_post.shape, h_post.dtype
        (torch.Size([16, 256]), torch.Size([16, 64]), torch.Size([16, 4]), torch.float32)
    """

    def forward(self, phi: Array, x: Array, b: Array) -> tuple[Array, Array, Array]:
        """``(x_res, x_layer, h_post)`` for ``phi``, ``x`` and ``b``; see the class docstring."""
        layout = torch_ops.classify(phi, x, b)
        if layout is torch_ops.DISPATCH:  # autograd's backward: MHCPreBwdOp
            return torch_ops.mhc_pre(self.config, phi, x, b)
        relaunch = self._relaunches.get(layout[0])
        if relaunch is not None:  # direct's first step, inline: decode pays for every call
            return relaunch(layout[1])
        return self.direct(phi, x, b, layout)

    def direct(
        self, phi: Array, x: Array, b: Array, layout: tuple | None = None
    ) -> tuple[Array, Array, Array]:
        """:meth:`forward` without the torch dispatcher (what its custom op runs);
        ``layout``: ``_torch_ops.layouts(phi, x, b)`` when the caller has it."""
        keys, pointers = layout or torch_ops.layouts(phi, x, b)
        relaunch = self._relaunches.get(keys)
        if relaunch is not None:  # this layout was validated and planned by an earlier call
            return relaunch(pointers)
        phi_op, x_op, b_op = as_operand(phi, "phi"), as_operand(x, "x"), as_operand(b, "b")
        n, c_x = _check_pre(phi_op, x_op, b_op)
        place = select_place(self.target, {"phi": phi_op, "x": x_op, "b": b_op})
        batch = x_op.shape[0]
        layouts = (
            ((batch, n * c_x), x_op.dtype),
            ((batch, c_x), x_op.dtype),
            ((batch, n), "float32"),
        )
        x_res, x_layer, h_post = (empty_like(phi_op, shape, dtype) for shape, dtype in layouts)
        if batch:
            planned = _mhc.mhc_pre(place, self._gates, phi_op, x_op, b_op, x_res, x_layer, h_post)
            if planned is not None and torch_ops.all_torch(keys) and x_op.last_dim_contiguous:
                self._relaunches[keys] = _mhc.pre_relauncher(planned, phi, x)
        return to_caller(x_res), to_caller(x_layer), to_caller(h_post)

    __call__ = forward


class MHCPostFwdOp(_MHCOp):
    """The post-layer half of mHC: mix the layer output back into the ``n``-stream residual.

    Args:
        target: None or ``BUILTIN`` to run where the data lives, "cuda" or "cpu" to insist.

    ``forward(x_layer_out, h_post, x_res)`` (also ``op(...)``):

    - ``x_layer_out`` ``[batch, c_x]`` bfloat16, float16 or float32 (the layer's output).
    - ``h_post`` ``[batch, n]`` float32 (from :class:`MHCPreFwdOp`).
    - ``x_res`` ``[batch, n*c_x]``, the same dtype as ``x_layer_out``.

    Returns ``x_out [batch, n*c_x]`` in that dtype:
    ``x_out[:, i*c_x + c] = h_post[:, i] * x_layer_out[:, c] + x_res[:, i*c_x + c]`` in float32,
    rounded once. ``x_layer_out`` and ``x_res`` are read in place when their last dimension
    is contiguous; otherwise copied once.

    Raises:
        ValueError: a non-2-D input; batch sizes that differ; ``x_res`` width != n*c_x;
            inputs on different devices; a ``target`` other than where the data lives.
        TypeError: an argument that is not an array; dtypes other than the above or
            differing between ``x_layer_out`` and ``x_res``.

    Example (torch on the host; CUDA tensors run the kernel)::

        >>> import torch
        >>> x_layer_out = torch.randn(16, 64, dtype=torch.bfloat16)  # the layer's output
        >>> h_post = 2 * torch.rand(16, 4)  # MHCPreFwdOp's post gates, n = 4
        >>> x_res = torch.randn(16, 4 * 64, dtype=torch.bfloat16)  # and its mixed streams
        >>> x_out = MHCPostFwdOp()(x_layer_out, h_post, x_res)
        >>> x_out.shape, x_out.dtype
        (torch.Size([16, 256]), torch.bfloat16)
    """

    def __init__(self, *, target: str | None = None) -> None:
        self.target = check_target(target)
        self._start()

    def forward(self, x_layer_out: Array, h_post: Array, x_res: Array) -> Array:
        """``x_out`` for the layer output, the post gates and the residual; see the class."""
        layout = torch_ops.classify(x_layer_out, h_post, x_res)
        if layout is torch_ops.DISPATCH:  # autograd's backward: MHCPostBwdOp
            return torch_ops.mhc_post(self.target or "", x_layer_out, h_post, x_res)
        return self.direct(x_layer_out, h_post, x_res, layout)

    def direct(
        self, x_layer_out: Array, h_post: Array, x_res: Array, layout: tuple | None = None
    ) -> Array:
        """:meth:`forward` without the torch dispatcher (what its custom op runs);
        ``layout``: ``_torch_ops.layouts(...)`` of the arguments when the caller has it."""
        keys, pointers = layout or torch_ops.layouts(x_layer_out, h_post, x_res)
        fast = self._relaunches.get(keys)
        if fast is not None:  # this layout was validated and planned by an earlier call
            return _mhc.relaunch_post(fast, pointers, x_res)
        layer_op = as_operand(x_layer_out, "x_layer_out")
        gates_op = as_operand(h_post, "h_post")
        res_op = as_operand(x_res, "x_res")
        _check_post(layer_op, gates_op, res_op)
        place = select_place(
            self.target, {"x_layer_out": layer_op, "h_post": gates_op, "x_res": res_op}
        )
        x_out = empty_like(layer_op, res_op.shape, res_op.dtype)
        if res_op.shape[0] and res_op.shape[1]:
            launch = _mhc.mhc_post(place, layer_op, gates_op, res_op, x_out)
            read_in_place = layer_op.last_dim_contiguous and res_op.last_dim_contiguous
            if launch is not None and torch_ops.all_torch(keys) and read_in_place:
                self._relaunches[keys] = launch
        return to_caller(x_out)

    __call__ = forward

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target!r})"


class MHCPreBwdOp(_PreSettings):
    """The gradient of :class:`MHCPreFwdOp` (SPEC section 8): from the upstream gradients of
    ``(x_res, x_layer, h_post)`` to those of ``phi``, ``x``, ``b`` and the three alphas.

    Args: those of :class:`MHCPreFwdOp`, validated the same way (``config`` too).

    ``forward(phi, x, b, grad_x_res, grad_x_layer, grad_h_post)`` (also ``op(...)``):

    - ``phi``, ``x``, ``b``: the forward's inputs, as :class:`MHCPreFwdOp` takes them.
    - ``grad_x_res`` ``[batch, n*c_x]`` and ``grad_x_layer`` ``[batch, c_x]`` in x's dtype,
      ``grad_h_post`` ``[batch, n]`` float32: the gradients of the forward's outputs.

    Returns ``(grad_phi [n*c_x, Q] float32, grad_x [batch, n*c_x] in x's dtype,
    grad_b [Q] float32, grad_alpha [3] float32)``, grad_alpha holding (alpha_pre,
    alpha_post, alpha_res). The exact gradient of the forward's float32 function: through
    the RMS ``r`` (x gets a gradient through its row norm too, 0 for an all-zero row), through
    every Sinkhorn iteration (eps in each denominator; a sum that was exactly 0, divided by 1
    instead, passes nothing back), the row max passing its gradient to the row's maximum,
    split evenly between ties (as ``torch.amax``). The forward's intermediates are
    recomputed, not stored. Float32 arithmetic; grad_x rounded once to x's dtype; the sums
    over the batch (grad_phi, grad_b, grad_alpha) run in a fixed order, so the same inputs
    give the same bits. An empty batch gives zero grad_phi, grad_b and grad_alpha.

    Range: the row norm never overflows (x finite). On the host, the products of x with the
    upstream gradients are taken of rows scaled by a power of two, so every gradient that
    fits in float32 comes out finite; on CUDA they are float32 sums of ``c_x`` products,
    finite while ``c_x * max|x| * max|grad_x_res, grad_x_layer|`` stays below about 3e38.

    Raises:
        ValueError: whatever :class:`MHCPreFwdOp` refuses so; an upstream gradient whose
            ndim or shape is not that of the forward output it belongs to.
        TypeError: whatever :class:`MHCPreFwdOp` refuses so; an upstream gradient whose
            dtype is not that of its forward output.
        RuntimeError: a backward through this op's outputs (a second-order gradient of
            :class:`MHCPreFwdOp`, after ``create_graph=True``): it is once differentiable.

    Example (host, runs anywhere)::

        >>> import numpy as np
        >>> from tileops_cupy.sequence_modeling import MHCPreBwdOp, MHCPreFwdOp
        >>> rng = np.random.default_rng(0)
        >>> phi = (rng.standard_normal((256, 24)) / 16).astype(np.float32)  # n = 4, c_x = 64
        >>> x, b = rng.standard_normal((3, 256)).astype(np.float32), np.zeros(24, np.float32)
        >>> settings = dict(alpha_pre=1.0, alpha_post=1.0, alpha_res=1.0, sinkhorn_repeat=20)
        >>> outputs = MHCPreFwdOp(**settings)(phi, x, b)
        >>> upstream = [np.ones_like(o) for o in outputs]  # d(sum of every output)
        >>> grad_phi, grad_x, grad_b, grad_alpha = MHCPreBwdOp(**settings)(phi, x, b, *upstream)
        >>> grad_phi.shape, grad_x.shape, grad_b.shape, grad_alpha.shape
        ((256, 24), (3, 256), (24,), (3,))
    """

    def forward(
        self, phi: Array, x: Array, b: Array, grad_x_res: Array, grad_x_layer: Array,
        grad_h_post: Array,
    ) -> tuple[Array, Array, Array, Array]:  # fmt: skip
        """``(grad_phi, grad_x, grad_b, grad_alpha)``; see the class docstring."""
        layout = torch_ops.classify(phi, x, b, grad_x_res, grad_x_layer, grad_h_post)
        if layout is torch_ops.DISPATCH:
            return torch_ops.mhc_pre_bwd(
                self.config, phi, x, b, grad_x_res, grad_x_layer, grad_h_post
            )
        relaunch = self._relaunches.get(layout[0])
        if relaunch is not None:  # direct's first step, inline (as MHCPreFwdOp's forward)
            return relaunch(layout[1])
        return self.direct(phi, x, b, grad_x_res, grad_x_layer, grad_h_post, layout)

    def direct(
        self, phi: Array, x: Array, b: Array, grad_x_res: Array, grad_x_layer: Array,
        grad_h_post: Array, layout: tuple | None = None,
    ) -> tuple[Array, Array, Array, Array]:  # fmt: skip
        """:meth:`forward` without the torch dispatcher; ``layout``:
        ``_torch_ops.layouts(...)`` of the arguments when the caller has it."""
        upstream = (grad_x_res, grad_x_layer, grad_h_post)
        keys, pointers = layout or torch_ops.layouts(phi, x, b, *upstream)
        relaunch = self._relaunches.get(keys)
        if relaunch is not None:  # this layout was validated and planned by an earlier call
            return relaunch(pointers)
        phi_op, x_op, b_op = as_operand(phi, "phi"), as_operand(x, "x"), as_operand(b, "b")
        up_res = as_operand(grad_x_res, "grad_x_res")
        up_layer = as_operand(grad_x_layer, "grad_x_layer")
        up_post = as_operand(grad_h_post, "grad_h_post")
        _check_pre_backward(phi_op, x_op, b_op, up_res, up_layer, up_post)
        batch = x_op.shape[0]
        operands = {"phi": phi_op, "x": x_op, "b": b_op, "grad_x_res": up_res}
        operands.update(grad_x_layer=up_layer, grad_h_post=up_post)
        place = select_place(self.target, operands)
        layouts = (
            (phi_op.shape, "float32"),
            (x_op.shape, x_op.dtype),
            (b_op.shape, "float32"),
            ((3,), "float32"),
        )
        grads = [empty_like(phi_op, shape, dtype) for shape, dtype in layouts]
        if batch:
            planned = _mhc.mhc_pre_backward(
                place, self._gates, phi_op, x_op, b_op, up_res, up_layer, up_post, *grads
            )
            read_in_place = all(a.last_dim_contiguous for a in (x_op, up_res, up_layer))
            if planned is not None and torch_ops.all_torch(keys) and read_in_place:
                self._relaunches[keys] = _mhc.pre_backward_relauncher(planned, phi, x, b)
        else:
            for grad in grads:
                _mhc.zero_fill(grad)
        grad_phi, grad_x, grad_b, grad_alpha = grads
        return to_caller(grad_phi), to_caller(grad_x), to_caller(grad_b), to_caller(grad_alpha)

    __call__ = forward


class MHCPostBwdOp(_MHCOp):
    """The gradient of :class:`MHCPostFwdOp` (SPEC section 8).

    Args:
        target: None or ``BUILTIN`` to run where the data lives, "cuda" or "cpu" to insist.

    ``forward(x_layer_out, h_post, x_res, grad_x_out)`` (also ``op(...)``): the forward's
    inputs, as :class:`MHCPostFwdOp` takes them, and ``grad_x_out`` ``[batch, n*c_x]`` in
    x_res's dtype, the gradient of its output.

    Returns ``(grad_x_layer_out [batch, c_x], grad_h_post [batch, n], grad_x_res
    [batch, n*c_x])`` in the dtypes of the forward's inputs (grad_h_post float32):
    ``grad_x_layer_out[:, c] = sum_i h_post[:, i] * grad_x_out[:, i*c_x + c]`` (float32,
    rounded once), ``grad_h_post[:, i] = sum_c x_layer_out[:, c] * grad_x_out[:, i*c_x + c]``
    (float32), and ``grad_x_res`` is ``grad_x_out`` itself, the same object (x_res enters
    the output with weight 1; torch's own ``add`` backward passes its gradient on the same
    way): nothing is copied. (A ``grad_x_out`` of another framework than ``x_layer_out``
    comes back as a view of its memory in ``x_layer_out``'s, as every result does, where
    that framework can view it without a copy: torch cannot view a reversed, big-endian or
    read-only NumPy array, which then comes back itself.)
    ``x_res`` only sets the shapes.

    Raises:
        ValueError: whatever :class:`MHCPostFwdOp` refuses so; a ``grad_x_out`` whose ndim
            or shape is not that of ``x_res``.
        TypeError: whatever :class:`MHCPostFwdOp` refuses so; a ``grad_x_out`` whose dtype
            is not that of ``x_res``.
        RuntimeError: a backward through this op's outputs (a second-order gradient of
            :class:`MHCPostFwdOp`): it is once differentiable.

    Example (host, runs anywhere)::

        >>> import numpy as np
        >>> from tileops_cupy.sequence_modeling import MHCPostBwdOp
        >>> x_layer_out = np.ones((2, 3), np.float32)
        >>> h_post = np.float32([[0.5, 2.0], [1.0, 1.0]])
        >>> x_res, grad_x_out = np.zeros((2, 6), np.float32), np.ones((2, 6), np.float32)
        >>> op = MHCPostBwdOp()
        >>> grad_layer, grad_h_post, grad_res = op(x_layer_out, h_post, x_res, grad_x_out)
        >>> grad_layer  # sum over the streams of h_post * grad_x_out
        array([[2.5, 2.5, 2.5],
               [2. , 2. , 2. ]], dtype=float32)
        >>> grad_h_post  # sum over a stream's columns of x_layer_out * grad_x_out
        array([[3., 3.],
               [3., 3.]], dtype=float32)
    """

    def __init__(self, *, target: str | None = None) -> None:
        self.target = check_target(target)
        self._start()

    def forward(
        self, x_layer_out: Array, h_post: Array, x_res: Array, grad_x_out: Array
    ) -> tuple[Array, Array, Array]:
        """``(grad_x_layer_out, grad_h_post, grad_x_res)``; see the class docstring."""
        tensors = (x_layer_out, h_post, x_res, grad_x_out)
        layout = torch_ops.classify(*tensors)
        if layout is torch_ops.DISPATCH:
            return torch_ops.mhc_post_bwd(self.target or "", *tensors)
        return self.direct(*tensors, layout)

    def direct(
        self,
        x_layer_out: Array,
        h_post: Array,
        x_res: Array,
        grad_x_out: Array,
        layout: tuple | None = None,
    ) -> tuple[Array, Array, Array]:
        """:meth:`forward` without the torch dispatcher; ``layout``:
        ``_torch_ops.layouts(...)`` of the arguments when the caller has it."""
        keys, pointers = layout or torch_ops.layouts(x_layer_out, h_post, x_res, grad_x_out)
        launch = self._relaunches.get(keys)
        if launch is not None:  # this layout was validated and planned by an earlier call
            grads = _mhc.relaunch_post_backward(launch, pointers, x_layer_out, h_post)
            return (*grads, grad_x_out)
        layer_op = as_operand(x_layer_out, "x_layer_out")
        gates_op = as_operand(h_post, "h_post")
        res_op = as_operand(x_res, "x_res")
        up_op = as_operand(grad_x_out, "grad_x_out")
        _check_post_backward(layer_op, gates_op, res_op, up_op)
        operands = {"x_layer_out": layer_op, "h_post": gates_op, "x_res": res_op}
        place = select_place(self.target, {**operands, "grad_x_out": up_op})
        grads = (
            empty_like(layer_op, layer_op.shape, layer_op.dtype),
            empty_like(layer_op, gates_op.shape, "float32"),
        )
        if res_op.shape[0] and res_op.shape[1]:
            launch = _mhc.mhc_post_backward(place, layer_op, gates_op, up_op, *grads)
            read_in_place = layer_op.last_dim_contiguous and up_op.last_dim_contiguous
            if launch is not None and torch_ops.all_torch(keys) and read_in_place:
                self._relaunches[keys] = launch
        else:  # nothing to sum: grad_h_post is 0 (and empty with the batch)
            for grad in grads:
                _mhc.zero_fill(grad)
        return (*(to_caller(grad) for grad in grads), in_framework_of(up_op, layer_op))

    __call__ = forward
    __repr__ = MHCPostFwdOp.__repr__


@functools.lru_cache(maxsize=TWINS)  # (see _cache.TWINS)
def _rebuilt(name: str, config: tuple) -> Any:
    *numbers, target = config
    return globals()[name](*numbers, target=target or None)


def rebuilt_op(name: str, config: tuple) -> Any:
    """The op ``name`` (MHCPreFwdOp, MHCPostBwdOp, ...) that a torch custom op's
    configuration describes: its numbers, then its target ("" for None). Built once (the
    TWINS most recently used are kept)."""
    return _rebuilt(name, tuple(config))


# --------------------------------------------------------------------------- validation


def streams_of(q: int) -> int:
    """n for a phi of width ``q = n*n + 2n``: ``isqrt(q + 1) - 1``."""
    return math.isqrt(q + 1) - 1


def _check_pre(phi: Operand, x: Operand, b: Operand) -> tuple[int, int]:
    """(n, c_x), or ValueError (TypeError for a dtype) naming the argument, what was
    expected and what came."""
    check_ndim(phi, "phi", 2, "[n*c_x, n*n+2n]")
    check_ndim(x, "x", 2, "[batch, n*c_x]")
    check_ndim(b, "b", 1, "[n*n+2n]")
    check_dtype(phi, "phi", ("float32",))
    check_dtype(x, "x", X_DTYPES)
    check_dtype(b, "b", ("float32",))
    width, q = phi.shape
    n = streams_of(q)
    if n < 1 or n * n + 2 * n != q:
        raise ValueError(
            f"phi must have n*n+2n columns for some n >= 1 (3, 8, 15, 24, 35, 48, 63, 80, ...), "
            f"got {q}"
        )
    if x.shape[1] != width:
        raise ValueError(f"x width must equal phi rows ({width}), got x of shape {x.shape}")
    if width == 0 or width % n:
        raise ValueError(
            f"x width (= phi rows) must be a positive multiple of n = {n}, got {width}"
        )
    if b.shape[0] != q:
        raise ValueError(f"b must have phi's width {q} entries (n*n+2n), got {b.shape[0]}")
    return n, width // n


def _check_post(layer: Operand, gates: Operand, res: Operand) -> None:
    check_ndim(layer, "x_layer_out", 2, "[batch, c_x]")
    check_ndim(gates, "h_post", 2, "[batch, n]")
    check_ndim(res, "x_res", 2, "[batch, n*c_x]")
    check_dtype(layer, "x_layer_out", X_DTYPES)
    check_dtype(gates, "h_post", ("float32",))
    if res.dtype != layer.dtype:
        raise TypeError(f"x_res must have x_layer_out's dtype ({layer.dtype}), got {res.dtype}")
    batch, c_x = layer.shape
    if gates.shape[0] != batch or res.shape[0] != batch:
        raise ValueError(
            f"x_layer_out, h_post and x_res must have the same batch, got {batch}, "
            f"{gates.shape[0]} and {res.shape[0]}"
        )
    n = gates.shape[1]
    if n < 1:
        raise ValueError(f"h_post must have at least one stream, got shape {gates.shape}")
    if res.shape[1] != n * c_x:
        raise ValueError(
            f"x_res width must be n*c_x = {n}*{c_x} = {n * c_x} (n from h_post, c_x from "
            f"x_layer_out), got {res.shape[1]}"
        )


def _check_pre_backward(
    phi: Operand, x: Operand, b: Operand, up_res: Operand, up_layer: Operand, up_post: Operand
) -> None:
    """:func:`_check_pre`, and each upstream gradient like the forward output it belongs to."""
    n, c_x = _check_pre(phi, x, b)
    batch = x.shape[0]
    _check_upstream(up_res, "grad_x_res", (batch, n * c_x), x.dtype, "x_res")
    _check_upstream(up_layer, "grad_x_layer", (batch, c_x), x.dtype, "x_layer")
    _check_upstream(up_post, "grad_h_post", (batch, n), "float32", "h_post")


def _check_post_backward(layer: Operand, gates: Operand, res: Operand, up: Operand) -> None:
    """:func:`_check_post`, and ``grad_x_out`` like x_out (x_res's shape and dtype)."""
    _check_post(layer, gates, res)
    _check_upstream(up, "grad_x_out", res.shape, res.dtype, "x_out")


def _check_upstream(
    grad: Operand, name: str, shape: tuple[int, ...], dtype: str, output: str
) -> None:
    """An upstream gradient has exactly the shape and dtype of the forward ``output`` it
    belongs to; ValueError (TypeError for the dtype) naming it, what was expected and what
    came."""
    layout = "[" + ", ".join(str(size) for size in shape) + "]"
    check_ndim(grad, name, len(shape), f"{layout} like {output}")
    if grad.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} like {output}, got {grad.dtype}")
    if tuple(grad.shape) != tuple(shape):
        raise ValueError(f"{name} must have {output}'s shape {layout}, got {list(grad.shape)}")
