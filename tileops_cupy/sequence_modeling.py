"""Manifold-constrained hyper-connections (mHC, DeepSeek; TileOPs semantics): the pre-layer
reduction :class:`MHCPreFwdOp` and the post-layer mix :class:`MHCPostFwdOp`.

The residual stream is ``n`` streams wide: a token is a row of ``n * c_x`` values, stream k
being columns ``k*c_x .. (k+1)*c_x``. Pre projects the row onto ``phi`` (``h = x @ phi``),
turns ``h`` into gates and a doubly-stochastic-ish mixing matrix (Sinkhorn), and returns the
layer input ``x_layer`` (the streams weighted by ``h_pre``), the residual ``x_res`` (the
streams mixed by the matrix) and ``h_post``. Post puts the layer output back:
``x_out[i] = h_post[i] * x_layer_out + x_res[i]``. SPEC section 4 has the formulas.

Each op is one path: validate -> pick the place from where the data lives -> one primitive
(``mhc_pre``, ``mhc_post``) with a numpy body (``_mhc_host``) and a CUDA body
(``kernels_cu/mhc.cu``). Results come back in the framework of the first argument (torch in,
torch out; CuPy, CuPy; NumPy, NumPy), on its device; CUDA work runs on the caller's current
stream.

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
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _cuda
from . import _torch_ops as torch_ops
from ._arrays import (
    BUILTIN,
    ITEMSIZE,
    Operand,
    as_operand,
    check_target,
    contiguous,
    cupy,
    empty_like,
    select_place,
    stream_handle,
    to_caller,
)
from ._mhc_host import SinkhornGates, mhc_post_host, mhc_pre_host

__all__ = ["BUILTIN", "MHCPreFwdOp", "MHCPostFwdOp"]

Array = Any  # torch, CuPy, NumPy, JAX or any DLPack tensor

X_DTYPES = ("bfloat16", "float16", "float32")
_CUDA_TYPES = {"bfloat16": "mhc_bf16", "float16": "mhc_fp16", "float32": "float"}
CUDA_STREAMS = tuple(range(1, 9))  # n the CUDA kernels are compiled for (registers bound n)

PRE_PARAMS = _cuda.ParamStruct(
    "PreParams",
    (
        ("x", "P"), ("phi", "P"), ("bias", "P"), ("partial", "P"), ("counter", "P"),
        ("coef", "P"), ("pieces", "P"), ("x_res", "P"), ("x_layer", "P"), ("h_post", "P"),
        ("x_stride", "q"), ("phi_stride_k", "q"), ("phi_stride_q", "q"), ("bias_stride", "q"),
        ("batch", "q"), ("c_x", "q"), ("k_range", "q"), ("k_splits", "q"),
        ("vector_io", "i"), ("fuse", "i"), ("repeat", "i"), ("unused", "i"),
        ("alpha_pre", "f"), ("alpha_post", "f"), ("alpha_res", "f"), ("eps", "f"),
    ),
)  # fmt: skip
POST_PARAMS = _cuda.ParamStruct(
    "PostParams",
    (
        ("x_layer_out", "P"), ("h_post", "P"), ("x_res", "P"), ("out", "P"),
        ("layer_stride", "q"), ("h_stride_row", "q"), ("h_stride_col", "q"), ("res_stride", "q"),
        ("batch", "q"), ("n", "q"), ("c_x", "q"), ("units", "q"),
        ("vector_io", "i"), ("unused", "i"),
    ),
)  # fmt: skip
# Launch geometry fixed by the kernels (TILE_ROWS, BLOCK_K, STAGE_PITCH, thread counts).
_TILE_ROWS, _BLOCK_K, _STAGE_PITCH, _STAGES = 128, 64, 72, 3
_PROJECT_THREADS, _APPLY_THREADS, _POST_THREADS = 256, 256, 256
_MAX_FUSED_ROWS = 256  # batches this small: cooperative mhc_project, no mhc_apply launch
_COUNTER_TILES = 4  # first per-tile counter word (COUNTER_TILES in mhc.cu)
_SCRATCH_ALIGN_WORDS = 64  # 256-byte sections: the fragment copies are 16-byte cp.async


# --------------------------------------------------------------------------- ops


class MHCPreFwdOp:
    """The pre-layer half of mHC: reduce the ``n``-stream residual to the layer input.

    Args:
        alpha_pre: scale of the projection that makes the pre-layer gates ``h_pre``.
        alpha_post: scale of the projection that makes the post-layer gates ``h_post``.
        alpha_res: scale of the logits of the residual mixing matrix.
        sinkhorn_repeat: Sinkhorn iterations (each a row then a column normalisation), >= 0.
        sinkhorn_eps: added to every Sinkhorn row and column sum before dividing, >= 0.
        target: None or ``BUILTIN`` to run where the data lives, "cuda" or "cpu" to insist.

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
    CUDA kernels take n <= 8.

    Raises:
        ValueError: a non-2-D ``phi``/``x`` or non-1-D ``b``; a dtype other than the above;
            a phi width that is not ``n*n + 2n``; phi rows != x width; a width not divisible
            by n (or zero); ``len(b)`` != phi width; inputs on different devices; a
            ``target`` other than where the data lives; n > 8 on CUDA.
        TypeError: an argument that is not an array.

    Example (CUDA, torch)::

        op = MHCPreFwdOp(alpha_pre=1.0, alpha_post=1.0, alpha_res=1.0, sinkhorn_repeat=20)
        phi = torch.randn(4 * 7168, 24, device="cuda") / 170
        b = torch.zeros(24, device="cuda")
        x = torch.randn(16, 4 * 7168, device="cuda", dtype=torch.bfloat16)
        x_res, x_layer, h_post = op(phi, x, b)  # bf16 [16, 28672], bf16 [16, 7168], fp32 [16, 4]
    """

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
            _check_finite(name, value)
        if isinstance(sinkhorn_repeat, bool) or not isinstance(sinkhorn_repeat, (int, np.integer)):
            raise TypeError(f"sinkhorn_repeat must be an int, got {type(sinkhorn_repeat).__name__}")
        if sinkhorn_repeat < 0:
            raise ValueError(f"sinkhorn_repeat must be >= 0, got {sinkhorn_repeat}")
        _check_finite("sinkhorn_eps", sinkhorn_eps)
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
        # the op by value, as its torch custom op carries it
        self.config = (
            float(alpha_pre), float(alpha_post), float(alpha_res), int(sinkhorn_repeat),
            float(sinkhorn_eps), self.target or "",
        )  # fmt: skip
        torch_ops.register_if_torch_imported()

    def forward(self, phi: Array, x: Array, b: Array) -> tuple[Array, Array, Array]:
        """``(x_res, x_layer, h_post)`` for ``phi``, ``x`` and ``b``; see the class docstring."""
        if torch_ops.needs_dispatcher(phi, x, b):
            _refuse_autograd(self, phi=phi, x=x, b=b)
            return torch_ops.mhc_pre(self.config, phi, x, b)
        return self.direct(phi, x, b)

    def direct(self, phi: Array, x: Array, b: Array) -> tuple[Array, Array, Array]:
        """:meth:`forward` without the torch dispatcher (what its custom op runs)."""
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
            mhc_pre(place, self._gates, phi_op, x_op, b_op, x_res, x_layer, h_post)
        return to_caller(x_res), to_caller(x_layer), to_caller(h_post)

    __call__ = forward

    def __repr__(self) -> str:
        return (
            f"MHCPreFwdOp(alpha_pre={self.alpha_pre}, alpha_post={self.alpha_post}, "
            f"alpha_res={self.alpha_res}, sinkhorn_repeat={self.sinkhorn_repeat}, "
            f"sinkhorn_eps={self.sinkhorn_eps}, target={self.target!r})"
        )


class MHCPostFwdOp:
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
        ValueError: a non-2-D input; dtypes other than the above or differing between
            ``x_layer_out`` and ``x_res``; batch sizes that differ; ``x_res`` width != n*c_x;
            inputs on different devices; a ``target`` other than where the data lives.
        TypeError: an argument that is not an array.

    Example (CUDA, torch)::

        x_out = MHCPostFwdOp()(layer(x_layer), h_post, x_res)  # bf16 [batch, n*c_x]
    """

    def __init__(self, *, target: str | None = None) -> None:
        self.target = check_target(target)
        torch_ops.register_if_torch_imported()

    def forward(self, x_layer_out: Array, h_post: Array, x_res: Array) -> Array:
        """``x_out`` for the layer output, the post gates and the residual; see the class."""
        if torch_ops.needs_dispatcher(x_layer_out, h_post, x_res):
            _refuse_autograd(self, x_layer_out=x_layer_out, h_post=h_post, x_res=x_res)
            return torch_ops.mhc_post(self.target or "", x_layer_out, h_post, x_res)
        return self.direct(x_layer_out, h_post, x_res)

    def direct(self, x_layer_out: Array, h_post: Array, x_res: Array) -> Array:
        """:meth:`forward` without the torch dispatcher (what its custom op runs)."""
        layer_op = as_operand(x_layer_out, "x_layer_out")
        gates_op = as_operand(h_post, "h_post")
        res_op = as_operand(x_res, "x_res")
        _check_post(layer_op, gates_op, res_op)
        place = select_place(
            self.target, {"x_layer_out": layer_op, "h_post": gates_op, "x_res": res_op}
        )
        x_out = empty_like(layer_op, res_op.shape, res_op.dtype)
        if res_op.shape[0] and res_op.shape[1]:
            mhc_post(place, layer_op, gates_op, res_op, x_out)
        return to_caller(x_out)

    __call__ = forward

    def __repr__(self) -> str:
        return f"MHCPostFwdOp(target={self.target!r})"


def _refuse_autograd(op: Any, **tensors: Any) -> None:
    """The mHC backward kernels do not exist yet: refuse a call autograd would record,
    rather than hand back outputs whose gradients silently stop here."""
    names = [name for name, tensor in tensors.items() if torch_ops.requires_grad(tensor)]
    if names:
        raise NotImplementedError(
            f"{type(op).__name__} has no backward yet, and {', '.join(names)} "
            f"require{'s' if len(names) == 1 else ''} grad: call it under torch.no_grad() "
            "or on detached tensors"
        )


@functools.cache
def _pre_op(config: tuple) -> MHCPreFwdOp:
    *numbers, target = config
    return MHCPreFwdOp(*numbers, target=target or None)


def pre_op(config: tuple) -> MHCPreFwdOp:
    """The MHCPreFwdOp a torch custom op's configuration describes (built once)."""
    return _pre_op(tuple(config))


@functools.cache
def post_op(target: str) -> MHCPostFwdOp:
    """The MHCPostFwdOp of one target ("" for None), built once."""
    return MHCPostFwdOp(target=target or None)


# --------------------------------------------------------------------------- validation


def _check_finite(name: str, value: Any) -> None:
    try:
        ok = math.isfinite(float(value))
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not ok:
        raise ValueError(f"{name} must be finite, got {value!r}")


def _check_ndim(operand: Operand, name: str, ndim: int, layout: str) -> None:
    if operand.ndim != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D {layout}, got {operand.ndim}-D shape {operand.shape}"
        )


def _check_dtype(operand: Operand, name: str, allowed: tuple[str, ...]) -> None:
    if operand.dtype not in allowed:
        raise ValueError(f"{name} must be {' or '.join(allowed)}, got {operand.dtype}")


def streams_of(q: int) -> int:
    """n for a phi of width ``q = n*n + 2n``: ``isqrt(q + 1) - 1``."""
    return math.isqrt(q + 1) - 1


def _check_pre(phi: Operand, x: Operand, b: Operand) -> tuple[int, int]:
    """(n, c_x), or ValueError naming the argument, what was expected and what came."""
    _check_ndim(phi, "phi", 2, "[n*c_x, n*n+2n]")
    _check_ndim(x, "x", 2, "[batch, n*c_x]")
    _check_ndim(b, "b", 1, "[n*n+2n]")
    _check_dtype(phi, "phi", ("float32",))
    _check_dtype(x, "x", X_DTYPES)
    _check_dtype(b, "b", ("float32",))
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
    _check_ndim(layer, "x_layer_out", 2, "[batch, c_x]")
    _check_ndim(gates, "h_post", 2, "[batch, n]")
    _check_ndim(res, "x_res", 2, "[batch, n*c_x]")
    _check_dtype(layer, "x_layer_out", X_DTYPES)
    _check_dtype(gates, "h_post", ("float32",))
    if res.dtype != layer.dtype:
        raise ValueError(f"x_res must have x_layer_out's dtype ({layer.dtype}), got {res.dtype}")
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


# --------------------------------------------------------------------------- primitives


def mhc_pre(
    place: str,
    gates: SinkhornGates,
    phi: Operand,
    x: Operand,
    b: Operand,
    x_res: Operand,
    x_layer: Operand,
    h_post: Operand,
) -> None:
    """Fill the outputs (fresh contiguous arrays) from validated inputs, on ``place``."""
    if place == "cpu":
        mhc_pre_host(phi.host, x.host, b.host, gates, x_res.host, x_layer.host, h_post.host)
    else:
        _pre_cuda(gates, phi, x, b, x_res, x_layer, h_post, stream_handle(phi))


def mhc_post(place: str, layer: Operand, gates: Operand, res: Operand, x_out: Operand) -> None:
    """Fill ``x_out`` (a fresh contiguous array) from validated inputs, on ``place``."""
    if place == "cpu":
        mhc_post_host(layer.host, gates.host, res.host, x_out.host)
    else:
        _post_cuda(layer, gates, res, x_out, stream_handle(layer))


# --------------------------------------------------------------------------- CUDA body


def pre_module(dtype: str, n: int) -> _cuda.ModuleSpec:
    """The phi-fragment, projection (with the coefficients) and apply kernels of one x
    dtype and n."""
    cuda_type = _CUDA_TYPES[dtype]
    names = (
        f"mhc_phi_pieces<{n}>",
        f"mhc_project<{cuda_type}, {n}>",
        f"mhc_apply<{cuda_type}, {n}>",
    )
    return _cuda.ModuleSpec("mhc", names)


def post_module() -> _cuda.ModuleSpec:
    """The post kernel for every dtype (small: one module)."""
    return _cuda.ModuleSpec("mhc", tuple(f"mhc_post<{t}>" for t in _CUDA_TYPES.values()))


@_cuda.register_catalog
def _catalog():
    for dtype in X_DTYPES:
        for n in CUDA_STREAMS:
            yield pre_module(dtype, n)
    yield post_module()


@dataclass(frozen=True, slots=True)
class _PrePlan:
    """Launch geometry of one (device, dtype, n, c_x, batch), computed once."""

    pieces: Any
    project: Any
    apply: Any
    pieces_grid: tuple[int, int, int]
    project_grid: tuple[int, int, int]
    apply_grid: tuple[int, int, int]
    project_smem: int
    k_range: int
    k_splits: int
    fuse: bool
    scratch: tuple[int, int, int, int]  # words of partials, coefficients, counters, pieces


_plans: dict[tuple, _PrePlan] = {}
_multiprocessors: dict[int, int] = {}
_smem_raised: set[tuple[int, int]] = set()
_lock = threading.Lock()


def _multiprocessor_count(device: int) -> int:
    count = _multiprocessors.get(device)
    if count is None:
        count = cupy().cuda.runtime.deviceGetAttribute(16, device)  # cudaDevAttrMultiProcessorCount
        _multiprocessors[device] = count
    return count


def _raise_smem_limit(kernel: Any, device: int, nbytes: int) -> int:
    """Kernels get more than 48 KB of dynamic shared memory only after asking for it.
    Returns how many blocks of 256 threads then fit on one multiprocessor."""
    cp = cupy()
    driver = cp.cuda.driver
    with cp.cuda.Device(device):
        key = (kernel.ptr, device)
        if key not in _smem_raised:
            driver.funcSetAttribute(
                kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes
            )
            _smem_raised.add(key)
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.ptr, _PROJECT_THREADS, nbytes
        )


def plan_geometry(batch: int, width: int, resident_blocks: int) -> tuple[int, int, bool]:
    """(k_range, k_splits, fuse): how mhc_project splits K over its blocks.

    At most ``resident_blocks`` (tile, K range) blocks, as many as fit at once: a large
    batch has about one tile per block and splits K little; a small batch splits K over
    every block, since reading phi is then much of the work. K ranges are whole 64-wide K
    blocks. Small batches (``fuse``) run as one cooperative launch, which needs every block
    resident at once.
    """
    tiles = -(-batch // _TILE_ROWS)
    wanted = max(1, resident_blocks // tiles)
    k_range = max(_BLOCK_K, -(-width // (wanted * _BLOCK_K)) * _BLOCK_K)
    return k_range, -(-width // k_range), batch <= _MAX_FUSED_ROWS


def _pre_plan(device: int, dtype: str, n: int, c_x: int, batch: int) -> _PrePlan:
    key = (device, dtype, n, c_x, batch)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    if n not in CUDA_STREAMS:
        raise ValueError(
            f"the CUDA mHC kernels take n <= {CUDA_STREAMS[-1]} streams, got n = {n} "
            "(phi width n*n+2n); run on the host (target='cpu' with host arrays) instead"
        )
    spec = pre_module(dtype, n)
    pieces_name, project_name, apply_name = spec.name_expressions
    project = _cuda.function(spec, project_name, device)
    width, q = n * c_x, n * n + 2 * n
    piece_bytes = 4 * ((q + 7) // 8) * 3 * 32 * 8  # bf16 B fragments of one K block
    smem = _STAGES * (_TILE_ROWS * _STAGE_PITCH * ITEMSIZE[dtype] + piece_bytes)
    with _lock:
        per_multiprocessor = _raise_smem_limit(project, device, smem)
    resident = per_multiprocessor * _multiprocessor_count(device)
    k_range, k_splits, fuse = plan_geometry(batch, width, resident)
    items = batch * -(-c_x // 8)  # mhc_apply: one thread per 8 columns of a row
    if items >= 1 << 32:
        raise ValueError(f"mHC pre takes batch * ceil(c_x / 8) < 2**32, got {items}")
    tiles = -(-batch // _TILE_ROWS)
    k_blocks = -(-width // _BLOCK_K)
    plan = _PrePlan(
        pieces=_cuda.function(spec, pieces_name, device),
        project=project,
        apply=_cuda.function(spec, apply_name, device),
        pieces_grid=(k_blocks, 1, 1),
        project_grid=(tiles * k_splits, 1, 1),
        apply_grid=(-(-items // _APPLY_THREADS), 1, 1),
        project_smem=smem,
        k_range=k_range,
        k_splits=k_splits,
        fuse=fuse,
        scratch=(
            k_splits * batch * (q + 1),
            batch * (n + n * n),
            _COUNTER_TILES + tiles,
            k_blocks * piece_bytes // 4,
        ),
    )
    if len(_plans) > 4096:  # shapes churn (e.g. growing prefill chunks): start over
        _plans.clear()
    _plans[key] = plan
    return plan


def _scratch(template: Operand, plan: _PrePlan) -> tuple[int, ...]:
    """Device pointers of (partials, coefficients, counters, pieces) for one call, carved
    from one fresh buffer of the caller's allocator: stream-ordered, graph-capturable
    (torch's allocator serves a capture from the graph's pool) and never shared between
    concurrent calls. mhc_phi_pieces zeroes the counters, so nothing needs initialising."""
    offsets, words = [], 0
    for size in plan.scratch:
        offsets.append(words)
        words += -(-size // _SCRATCH_ALIGN_WORDS) * _SCRATCH_ALIGN_WORDS
    buffer = empty_like(template, (words,), "float32")
    return tuple(buffer.ptr + 4 * offset for offset in offsets)


def pre_launch_params(
    gates: SinkhornGates,
    plan: _PrePlan,
    x: Operand,
    phi: Operand,
    b: Operand,
    x_res: Operand,
    x_layer: Operand,
    h_post: Operand,
    scratch: tuple[int, ...],
) -> bytes:
    """PreParams (kernels_cu/mhc.cu) packed; ``scratch`` holds the (partials, coefficients,
    counters, pieces) pointers."""
    batch, width = x.shape
    n = h_post.shape[1]
    c_x = width // n
    row_bytes = x.strides[0] * ITEMSIZE[x.dtype] if batch > 1 else 0
    partial, coef, counter, pieces = scratch
    return PRE_PARAMS.pack(
        x=x.ptr, phi=phi.ptr, bias=b.ptr, partial=partial, counter=counter, coef=coef,
        pieces=pieces, x_res=x_res.ptr, x_layer=x_layer.ptr, h_post=h_post.ptr,
        x_stride=x.strides[0], phi_stride_k=phi.strides[0], phi_stride_q=phi.strides[1],
        bias_stride=b.strides[0], batch=batch, c_x=c_x, k_range=plan.k_range,
        k_splits=plan.k_splits, vector_io=c_x % 8 == 0 and (x.ptr | row_bytes) % 16 == 0,
        fuse=plan.fuse, repeat=gates.sinkhorn_repeat, unused=0,
        alpha_pre=gates.alpha_pre, alpha_post=gates.alpha_post, alpha_res=gates.alpha_res,
        eps=gates.sinkhorn_eps,
    )  # fmt: skip


def _pre_cuda(
    gates: SinkhornGates,
    phi: Operand,
    x: Operand,
    b: Operand,
    x_res: Operand,
    x_layer: Operand,
    h_post: Operand,
    stream: int,
) -> None:
    if not x.last_dim_contiguous:
        x = contiguous(x)
    batch, width = x.shape
    n = h_post.shape[1]
    c_x = width // n
    device = x.device
    plan = _pre_plan(device, x.dtype, n, c_x, batch)
    scratch = _scratch(x, plan)
    params = pre_launch_params(gates, plan, x, phi, b, x_res, x_layer, h_post, scratch)
    threads = (_PROJECT_THREADS, 1, 1)
    _cuda.launch(plan.pieces, device, plan.pieces_grid, threads, params, stream)
    # fused: the blocks wait for each other, so all must be resident at once (cooperative)
    _cuda.launch(
        plan.project, device, plan.project_grid, threads, params, stream, plan.project_smem,
        cooperative=plan.fuse,
    )  # fmt: skip
    if not plan.fuse:
        _cuda.launch(plan.apply, device, plan.apply_grid, (_APPLY_THREADS, 1, 1), params, stream)


def post_launch_params(layer: Operand, gates: Operand, res: Operand, x_out: Operand) -> bytes:
    """PostParams (kernels_cu/mhc.cu) packed."""
    batch, c_x = layer.shape
    itemsize = ITEMSIZE[layer.dtype]
    alignment = layer.ptr | res.ptr
    if batch > 1:
        alignment |= (layer.strides[0] | res.strides[0]) * itemsize
    return POST_PARAMS.pack(
        x_layer_out=layer.ptr, h_post=gates.ptr, x_res=res.ptr, out=x_out.ptr,
        layer_stride=layer.strides[0], h_stride_row=gates.strides[0],
        h_stride_col=gates.strides[1], res_stride=res.strides[0], batch=batch,
        n=gates.shape[1], c_x=c_x, units=-(-c_x // 8),
        vector_io=c_x % 8 == 0 and alignment % 16 == 0, unused=0,
    )  # fmt: skip


def _post_cuda(layer: Operand, gates: Operand, res: Operand, x_out: Operand, stream: int) -> None:
    if not layer.last_dim_contiguous:
        layer = contiguous(layer)
    if not res.last_dim_contiguous:
        res = contiguous(res)
    batch, c_x = layer.shape
    items = batch * -(-c_x // 8)
    if items >= 1 << 32:
        raise ValueError(f"mHC post takes batch * ceil(c_x / 8) < 2**32, got {items}")
    spec = post_module()
    kernel = _cuda.function(spec, f"mhc_post<{_CUDA_TYPES[layer.dtype]}>", layer.device)
    params = post_launch_params(layer, gates, res, x_out)
    grid = (-(-items // _POST_THREADS), 1, 1)
    _cuda.launch(kernel, layer.device, grid, (_POST_THREADS, 1, 1), params, stream)
