"""The mHC primitives every mHC op calls: one contract, two bodies (as ``_rotate`` is for
RoPE).

``mhc_pre``, ``mhc_post``, ``mhc_pre_backward`` and ``mhc_post_backward`` take validated
:class:`~tileops_cupy._arrays.Operand` arguments and fresh contiguous outputs the caller
allocated with ``empty_like``, and run either the numpy body (``_mhc_host``) or the CUDA
body (``kernels_cu/mhc.cu``, ``kernels_cu/mhc_backward.cu``) on the caller's current
stream. Validation belongs to the callers. Nothing here synchronises the host or
allocates outside the caller's allocator, so every launch can be captured in a CUDA graph.

Pre is one kernel per call for small batches (decode: on sm_90 one launch of thread block
clusters where each block's slice of x is small, else up to 64 tokens and 2**18 elements of
x), one cooperative launch up to 256 tokens, four beyond (``mhc.cu``'s header describes them);
pre backward is five (phi's fragments; a first pass over x and the upstream gradients; the
per-token chain rule; a second pass writing grad_x and grad_phi's partials; the fixed-order
reductions), as the stages of one cooperative launch up to 64 tokens; post and post
backward one each. Scratch (partial sums, per-token coefficients, Sinkhorn checkpoints) is
one fresh buffer of the caller's allocator per call, except for the one-launch pre and pre
backward, which keep a workspace per stream (:func:`_scratch` says why); the cluster launch
needs none unless it splits K over several clusters of a token group (then the workspace
too, for their sums and tickets).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import _cuda
from . import _torch_ops as torch_ops
from ._arrays import ITEMSIZE, Operand, as_cupy, contiguous, cupy, empty_like, stream_handle
from ._cache import ForkSafeLock, LaunchRecords
from ._mhc_host import (
    SinkhornGates,
    mhc_post_backward_host,
    mhc_post_host,
    mhc_pre_backward_host,
    mhc_pre_host,
)

__all__ = [
    "mhc_pre", "mhc_post", "mhc_pre_backward", "mhc_post_backward", "pre_relauncher",
    "pre_backward_relauncher",
    "relaunch_post", "relaunch_post_backward", "zero_fill",
]  # fmt: skip

CUDA_TYPES = _cuda.CUDA_TYPES
CUDA_STREAMS = tuple(range(1, 9))  # n the CUDA kernels are compiled for (registers bound n)

# the kernels' argument structs, fields as their .cu files declare them (packed by name)
PRE_PARAMS = _cuda.ParamStruct.declared("mhc", "PreParams")
POST_PARAMS = _cuda.ParamStruct.declared("mhc", "PostParams")
PRE_BWD_PARAMS = _cuda.ParamStruct.declared("mhc_backward", "PreBwdParams")
POST_BWD_PARAMS = _cuda.ParamStruct.declared("mhc_backward", "PostBwdParams")
# Launch geometry fixed by the kernels (TILE_ROWS, BLOCK_K, thread counts).
_GEOMETRY = {
    "TILE_ROWS": 128, "BLOCK_K": 64, "PROJECT_THREADS": 256, "APPLY_THREADS": 256,
    "POST_THREADS": 256, "COEF_ROWS": 16, "COEF_TOKEN_ROWS": 32, "COUNTER_GROUPS": 4,
    "SMALL_ROWS": 32, "SMALL_CHUNK": 32, "SMALL_FAN_IN": 16, "CLUSTER_BLOCKS": 16,
}  # fmt: skip
_FORWARD_DEFINES = tuple(f"{name}={value}" for name, value in _GEOMETRY.items())
_TILE_ROWS, _BLOCK_K = _GEOMETRY["TILE_ROWS"], _GEOMETRY["BLOCK_K"]
_PROJECT_THREADS, _APPLY_THREADS, _POST_THREADS = (
    _GEOMETRY[name] for name in ("PROJECT_THREADS", "APPLY_THREADS", "POST_THREADS")
)
_COEF_ROWS = _GEOMETRY["COEF_ROWS"]  # tokens per mhc_coefficients block
_COEF_TOKEN_ROWS = _GEOMETRY["COEF_TOKEN_ROWS"]  # the same, one thread a token
# From this many tokens (n <= 5) mhc_coefficients takes one thread a token (mhc.cu says why).
# H100, bf16 n4 unless named, the whole call, device us, n*n lanes a token -> one thread a
# token (the same bits): B4096 c_x4096 181.8 -> 175.6, B8192 c_x4096 339.3 -> 326.0, B16384
# c_x7168 1096.8 -> 1078.0, n2 B4096 c_x4096 103.2 -> 98.6; fp32 B2048 c_x2048 110.0 ->
# 110.1, B1024 c_x7168 90.9 -> 92.1, B512 c_x4096 38.2 -> 41.2, B300 c_x2048 30.6 -> 33.2.
_MIN_TOKEN_COEFFICIENT_ROWS = 4096
_COUNTER_GROUPS = _GEOMETRY["COUNTER_GROUPS"]  # counter words before mhc_pre_small's groups
_MAX_FUSED_ROWS = 256  # batches this small: cooperative mhc_project, no mhc_apply launch
_MIN_EARLY_ROWS = 512  # from here on sm_90 a plan's kernels after the first start early
# mhc_project's pipelines, (STAGE_K, STAGES): stages of one or two 64-wide fragment blocks,
# so 128- or 256-byte runs of each 16-bit row of x (DRAM serves the longer runs faster), 3
# or 2 deep (_project_plan chooses). 16-bit x with n <= 4 takes 256-byte runs three stages
# deep (one block a multiprocessor, by shared memory); where a block streams at least
# _MIN_TWO_STAGE_RUN stages, bf16 n4 takes them two deep (two blocks, whose registers only
# bf16 n <= 4 allows); where the 256-byte runs would leave half the multiprocessors or more
# without a (tile, K range) block (few tokens of narrow rows), 128-byte runs three deep.
# float32, and n > 4, keep 128-byte runs three deep (a 256-column float32 or n = 8 stage
# does not fit twice). H200, device time, us, (64, 3) / (128, 3) / (128, 2), with (128, 3)
# at the one-block register bound:
# - bf16 n4: B128 c_x4096 37.1 / 29.1 / 29.9, B512 c_x7168 59.0 / 51.4 / 58.2, B2048 c_x4096
#   89.0 / 84.2 / 88.8, B4096 c_x4096 149.1 / 143.0 / 145.5, B16384 c_x7168 874.5 / 845.2 /
#   832.3 (a session before, two-block (128, 3): B4096 c_x7168 238.3 / 231.6 for the last two,
#   B8192 c_x4096 272.9 / 265.5, B16384 c_x1280 191.6 / 191.4);
# - bf16 n2: B128 c_x4096 21.3 / 25.7 / 25.6 (64 blocks of 128 columns on 132
#   multiprocessors), B512 c_x7168 34.3 / 30.9 / 34.3, B2048 c_x4096 51.7 / 49.0 / 52.0,
#   B4096 c_x4096 86.4 / 84.2 / 86.4, B16384 c_x7168 448.8 / 438.3 / 442.0;
# - fp16 n4 (one block a multiprocessor: its x takes two bf16 pieces): B128 c_x4096 29.9 /
#   29.4, B512 c_x7168 55.0 / 54.3, B2048 c_x4096 93.8 / 90.5, B4096 c_x4096 166.6 / 159.7,
#   B16384 c_x7168 1032.6 / 978.9.
_NARROW, _WIDE, _WIDE_TWO_STAGES = (64, 3), (128, 3), (128, 2)
_MIN_TWO_STAGE_RUN = 32
# mhc_pre_small, one ordinary launch, for batches of at most _MAX_SMALL_ROWS tokens and
# _SMALL_WORK elements of x: its projection runs on the CUDA cores, which beyond that lose to
# the tensor-core path (H200, n = 4, device time: B32 c_x1280 27.7 us vs 30.3 fused, B4
# c_x7168 27.6 vs 32.8; B16 c_x7168 34.9 vs 31.5)
_MAX_SMALL_ROWS, _SMALL_WORK = 64, 1 << 18
_SMALL_ROWS, _SMALL_CHUNK, _FAN_IN = (
    _GEOMETRY[name] for name in ("SMALL_ROWS", "SMALL_CHUNK", "SMALL_FAN_IN")
)
# mhc_pre_small's counters (mhc.cu): tickets, blocks finished, then per group of tokens the
# splits finished of each fan-in, the fan-in sums finished and the group's flag
_SMALL_COUNTER_WORDS = _COUNTER_GROUPS + (_FAN_IN + 2) * -(-_MAX_SMALL_ROWS // _SMALL_ROWS)
# mhc_pre_cluster (sm_90): one launch of clusters of _MAX_CLUSTER_BLOCKS blocks (the largest
# cluster sm_90 allows, non-portable), every cluster resident at once. It is planned where a
# cluster's tokens fit: at most _MAX_CLUSTER_ROWS tokens a cluster (the kernel takes up to
# 32, but its projection reads phi from shared memory once a token, so more tokens a
# cluster lose to the split plans) and their slices of x in a block's shared memory. H200,
# bf16 n4, device time against the plans before it: B1 c_x1280 18.5 -> 13.2 us, B4 c_x7168
# 24.5 -> 21.6 (first version); since its projection holds every column of h a thread, b is
# read during the loads, the barrier after the partials is relaxed and the projection
# starts on each stream as it lands (2026-12-04): B1 c_x1280 11.9, B1 c_x4096 13.5, B1
# c_x7168 14.0, B4 c_x7168 15.0, B8 c_x4096 17.2, B16 c_x1280 14.9 us. Up to 8 tokens a
# cluster (2 before, with at most 1792 elements a block): B8 c_x7168 20.7 (K split over
# two clusters) -> 16.4, B16 c_x4096 24.5 -> 19.8, B16 c_x7168 32.2 -> 19.0, B32 c_x1280
# 24.5 -> 17.5, B32 c_x4096 32.0 -> 22.6, B64 c_x1280 21.4 -> 19.8, B64 c_x4096 32.7 ->
# 27.6 us.
_MAX_CLUSTER_ROWS = 8
# K split over clusters (mhc.cu: cluster_groups) only where one cluster a token group does
# not fit: each token group's clusters then meet through the scratch, which costs more than
# the share of phi each reads saves (H200, B1 n4 bf16, device time, one cluster against
# 2-8: c_x1280 11.8 vs 14.4-15.7 us, c_x4096 13.9 vs 15.0-20.5, c_x7168 15.2 vs 16.6-20.8),
# while it took B8 c_x7168 26.3-26.9 -> 20.7-21.9 when at most 1792 elements of x fitted a
# block (one cluster of two tokens a group, since: 16.4). Sizes from H200 runs.
_MIN_CLUSTER_GROUPS, _MAX_CLUSTER_GROUPS = 1, 8
_MAX_CLUSTER_BLOCKS = _GEOMETRY["CLUSTER_BLOCKS"]

# The sections of mHC pre backward's scratch, in their order in the one buffer (each a
# PreBwdParams pointer; the counters first, in a section of one size for every plan, as
# mhc_pre_small's; the Sinkhorn checkpoints, last, are sized per call).
_PRE_BWD_SCRATCH = (
    "counter", "pieces", "stats", "coef", "dh_pieces", "per_token", "phi_partial", "sinkhorn",
)  # fmt: skip
_PRE_BWD_COUNTER_WORDS = 2  # mhc_bwd_fused: barrier arrivals, blocks finished


# Launch geometry: NVRTC gets these as the BWD_* defines (one source of truth), and
# mhc_backward.cu asserts the stage sizes it derives against the ones _geometry computes.
_THREADS = 256  # mhc_bwd_pieces, mhc_bwd_stats, mhc_bwd_grad
_STATS_TILE = 128  # tokens per mhc_bwd_stats block: two threads per token
_GRAD_TILE = 32  # tokens per mhc_bwd_grad item: two 16-token m-tiles
# mhc_bwd_token: one thread per token, in blocks of 16 spread over the SMs (H100, whole pre
# backward, 64 -> 16 threads a block, bits unchanged: bf16 n7 B1024 c_x2048 255.2 -> 230.9 us,
# bf16 n4 B1024 c_x4096 132.7 -> 132.1; 32 threads: 233.1, 132.7)
_TOKEN_THREADS = 16
# mhc_bwd_token sums up to this many first-pass splits itself; mhc_bwd_splits sums more
# first, over many more threads (each token's thread waits one L2 round trip a few splits).
# H200, bf16 n4, whole call: B1024 c_x4096 (16 splits) 136.9 -> 134.4 us, B256 c_x4096 (64)
# 96.5 -> 80.0, B128 c_x7168 (112) 112.8 -> 83.0, B100 c_x1280 76.2 -> 55.2.
_TOKEN_SPLITS = 4
_REDUCE_THREADS = 256
_POST_BWD_THREADS = 256  # mhc_post_bwd: one block per token row
_MAX_STAGES = 3  # cp.async pipeline depth where shared memory allows (at least 2)
# Up to n = 4, mhc_bwd_grad takes a whole number of blocks a column chunk where that keeps
# this share of its resident blocks: block j then walks tiles [h*T/k, (h+1)*T/k) of chunk j
# // k (h = j % k), so at any moment the k token tiles in work are the same in every chunk and
# DRAM serves whole rows of them at once, where the even shares of every block put each
# chunk's blocks at tiles of their own (the items of one block are 128-byte runs of 32 rows).
# H100, whole call: bf16 n4 B4096 c_x4096 341.3 -> 332.5 us, float32 n4 B2048 c_x2048 204.4 ->
# 198.5. Past n = 4 the pass waits on its products more than on DRAM (2-3x slower a byte), and
# the idle blocks cost more than the rows save: float32 n5 B2048 c_x2048 421.7 -> 426.8.
_GRAD_ALIGNED_SHARE = 0.95
# Pre backward calls this small run as one cooperative launch (mhc_bwd_fused) on the
# stream's workspace: up to _MAX_FUSED_BWD_ROWS tokens, rows (n*c_x) up to
# _MAX_FUSED_BWD_WIDTH and _MAX_FUSED_BWD_ELEMENTS elements of x in all. Its stages have fewer
# blocks than the separate kernels, so it saves host time (H200, B4 n4 c_x256: 50 -> 31 µs a
# call when it came) and costs device time, which wins past a few thousand elements. H200,
# bf16 n4, µs a call in a tight loop, one launch / the kernels: c_x256 B1-B64 38.6-42.3 /
# 43.4-46.3; c_x512 B16 40.5 / 47.8, B64 44.6 / 41.6; c_x1280 B4 42.8 / 44.6, B16 43.6 /
# 40.8, B64 48.1 / 41.4; c_x4096 B1 52.1 / 42.4, B64 60.4 / 47.3.
_MAX_FUSED_BWD_ROWS = 64
_MAX_FUSED_BWD_WIDTH = 8192
_MAX_FUSED_BWD_ELEMENTS = 1 << 16
_SCRATCH_ALIGN_WORDS = 64  # 256-byte sections: the scratch rows are read by 16-byte cp.async
_SINKHORN_KEPT_FLOATS = 1024  # per token: every Sinkhorn step's input kept up to this
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute


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
) -> tuple[_cuda.Launch, _PrePlan] | None:
    """Fill the outputs (fresh contiguous arrays) from validated inputs, on ``place``.
    Returns the CUDA launch and its plan (None on the host)."""
    if place == "cpu":
        mhc_pre_host(phi.host, x.host, b.host, gates, x_res.host, x_layer.host, h_post.host)
        return None
    if not x.last_dim_contiguous:
        x = contiguous(x, phi)  # (on phi's stream, the launch's)
    batch, width = x.shape
    n = h_post.shape[1]
    c_x = width // n
    device = x.device
    plan = _pre_plan(device, x.dtype, n, c_x, batch)
    stream = stream_handle(phi)
    # (scratch in phi's framework: its pool hands the memory back on the launch's stream)
    keep, scratch = _scratch(plan, device, stream, _operand_buffer, phi)
    params = pre_launch_params(gates, plan, x, phi, b, x_res, x_layer, h_post, scratch)
    launch = _cuda.launch(device, params, plan.steps, stream)
    del keep  # (alive until the launch is on the stream)
    return launch, plan


def _operand_buffer(template: Operand, words: int) -> tuple[Operand, int]:
    buffer = empty_like(template, (words,), "float32")
    return buffer, buffer.ptr


def mhc_post(
    place: str, layer: Operand, gates: Operand, res: Operand, x_out: Operand
) -> _cuda.Launch | None:
    """Fill ``x_out`` (a fresh contiguous array) from validated inputs, on ``place``.
    Returns the CUDA launch (None on the host)."""
    if place == "cpu":
        mhc_post_host(layer.host, gates.host, res.host, x_out.host)
        return None
    return _post_cuda(layer, gates, res, x_out, stream_handle(layer))


def mhc_pre_backward(
    place: str,
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
) -> tuple[_cuda.Launch, _PreBackwardPlan] | None:
    """Fill the gradients (fresh contiguous arrays) from validated inputs with batch >= 1,
    on ``place``: ``grad_phi [n*c_x, Q]`` (float32), ``grad_x [B, n*c_x]`` (x's dtype),
    ``grad_b [Q]`` (float32) and ``grad_alpha [3]`` (float32: pre, post, res), the exact
    gradient of mHC pre (SPEC section 8) for the upstream gradients ``grad_x_res``
    ``[B, n*c_x]`` and ``grad_x_layer`` ``[B, c_x]`` (x's dtype) and ``grad_h_post``
    ``[B, n]`` (float32). Reductions over the batch are deterministic. Returns the CUDA
    launch and its plan (None on the host)."""
    if place == "cpu":
        mhc_pre_backward_host(
            phi.host, x.host, b.host, gates, grad_x_res.host, grad_x_layer.host,
            grad_h_post.host, grad_phi.host, grad_x.host, grad_b.host, grad_alpha.host,
        )  # fmt: skip
        return None
    x, grad_x_res, grad_x_layer = (  # (copies on phi's stream, the launch's)
        operand if operand.last_dim_contiguous else contiguous(operand, phi)
        for operand in (x, grad_x_res, grad_x_layer)
    )
    batch, width = x.shape
    q = phi.shape[1]
    n = math.isqrt(q + 1) - 1
    c_x = width // n
    device = x.device
    streams = CUDA_STREAMS
    if n not in streams:
        raise ValueError(
            f"the CUDA mHC kernels take n <= {streams[-1]} streams, got n = {n} "
            "(phi width n*n+2n); run on the host (target='cpu' with host arrays) instead"
        )
    plan = _pre_backward_plan(device, x.dtype, n, c_x, batch, gates.sinkhorn_repeat)
    stream = stream_handle(phi)
    keep, pointers = _scratch(plan, device, stream, _operand_buffer, phi)  # (as mhc_pre's)
    scratch = dict(zip(_PRE_BWD_SCRATCH, pointers, strict=True))
    size = ITEMSIZE[x.dtype]
    alignment = x.ptr | grad_x_res.ptr | grad_x_layer.ptr | grad_x.ptr
    if batch > 1:
        alignment |= (x.strides[0] | grad_x_res.strides[0] | grad_x_layer.strides[0]) * size
    params = PRE_BWD_PARAMS.pack(
        x=x.ptr, phi=phi.ptr, bias=b.ptr, grad_x_res=grad_x_res.ptr,
        grad_x_layer=grad_x_layer.ptr, grad_h_post=grad_h_post.ptr, grad_phi=grad_phi.ptr,
        grad_x=grad_x.ptr, grad_b=grad_b.ptr, grad_alpha=grad_alpha.ptr, **scratch,
        x_stride=x.strides[0], gxr_stride=grad_x_res.strides[0],
        gxl_stride=grad_x_layer.strides[0], ghp_stride_row=grad_h_post.strides[0],
        ghp_stride_col=grad_h_post.strides[1], phi_stride_k=phi.strides[0],
        phi_stride_q=phi.strides[1], bias_stride=b.strides[0], batch=batch, c_x=c_x,
        k_splits=plan.k_splits, grad_items=plan.grad_items,
        grad_blocks=plan.grad_blocks, slot_cap=plan.slot_cap,
        vector_io=c_x % (16 // size) == 0 and alignment % 16 == 0,
        repeat=gates.sinkhorn_repeat, segment=plan.segment, stats_stages=plan.stats_stages,
        grad_stages=plan.grad_stages, token_splits=plan.token_splits,
        alpha_pre=gates.alpha_pre, alpha_post=gates.alpha_post, alpha_res=gates.alpha_res,
        eps=gates.sinkhorn_eps,
    )  # fmt: skip
    launch = _cuda.launch(device, params, plan.steps, stream)
    del keep  # (alive until the launch is on the stream)
    return launch, plan


def mhc_post_backward(
    place: str,
    layer: Operand,
    gates: Operand,
    grad_x_out: Operand,
    grad_layer: Operand,
    grad_gates: Operand,
) -> _cuda.Launch | None:
    """Fill grad_x_layer_out and grad_h_post (fresh contiguous arrays) from validated inputs
    with batch and c_x >= 1, on ``place``. (grad_x_res is grad_x_out itself.) Returns the
    CUDA launch (None on the host)."""
    if place == "cpu":
        mhc_post_backward_host(
            layer.host, gates.host, grad_x_out.host, grad_layer.host, grad_gates.host
        )
        return None
    stream = stream_handle(layer)
    return post_backward_cuda(layer, gates, grad_x_out, grad_layer, grad_gates, stream)


def zero_fill(output: Operand) -> None:
    """Zeros into a fresh output (the gradient sums of an empty batch), on the caller's
    stream."""
    if not output.is_cuda:
        output.host[...] = 0
    elif output.framework == "torch":
        output.obj.zero_()
    else:  # CuPy's current stream is the caller's stream for everything but torch
        with cupy().cuda.Device(output.device):
            as_cupy(output).fill(0)


# --------------------------------------------------------------------------- CUDA body


def project_pipelines(dtype: str, n: int) -> tuple[tuple[int, int], ...]:
    """The (STAGE_K, STAGES) pipelines mhc_project is compiled with for x's dtype and n."""
    if ITEMSIZE[dtype] == 2 and n <= 4:
        return (
            (_WIDE, _WIDE_TWO_STAGES, _NARROW)
            if dtype == "bfloat16" and n == 4
            else (_WIDE, _NARROW)
        )
    return (_NARROW,)


def _project_name(dtype: str, n: int, pipeline: tuple[int, int], fused: bool = False) -> str:
    """mhc_project's instantiation: large batches, or (``fused``) the one-launch plan."""
    suffix = ", true" if fused else ""
    return f"mhc_project<{CUDA_TYPES[dtype]}, {n}, {pipeline[0]}, {pipeline[1]}{suffix}>"


def _token_coefficients(n: int) -> bool:
    """Whether mhc_coefficients is compiled with one thread a token for n (its n*n matrix
    held whole in a thread's registers)."""
    return n * n <= 32


def _coefficients_name(dtype: str, n: int, per_token: bool) -> str:
    """mhc_coefficients' instantiation: n*n lanes a token, or (``per_token``) one thread."""
    return f"mhc_coefficients<{CUDA_TYPES[dtype]}, {n}{', true' if per_token else ''}>"


def _fragment_bytes(n: int, columns: int) -> int:
    """Bytes of phi's bf16 B fragments for ``columns`` rows of phi (mhc.cu build_pieces:
    three pieces of each of the n-tiles' 8-byte slots, 32 lanes a k-step of 16; its
    piece_words, which tests/test_nvrtc.py holds equal)."""
    return columns // 16 * ((n * n + 2 * n + 7) // 8) * 3 * 32 * 8


def _project_smem(dtype: str, n: int, pipeline: tuple[int, int]) -> int:
    """Dynamic shared memory of mhc_project: STAGES stages of x (TILE_ROWS rows of STAGE_K
    elements, 8 elements of padding each) and of phi's B fragments (mhc.cu
    project_smem_bytes, which tests/test_nvrtc.py holds equal)."""
    stage_k, stages = pipeline
    return stages * (_TILE_ROWS * (stage_k + 8) * ITEMSIZE[dtype] + _fragment_bytes(n, stage_k))


def pre_module(dtype: str, n: int) -> _cuda.ModuleSpec:
    """The phi-fragment, projection (one per pipeline, and its fused twin), coefficient and
    apply kernels of one x dtype and n, and the one-launch kernels of small batches
    (mhc_pre_cluster last)."""
    cuda_type = CUDA_TYPES[dtype]
    pipelines = project_pipelines(dtype, n)
    names = (
        f"mhc_phi_pieces<{n}>",
        *(_project_name(dtype, n, pipeline) for pipeline in pipelines),
        *(_project_name(dtype, n, pipeline, fused=True) for pipeline in pipelines),
        _coefficients_name(dtype, n, per_token=False),
        *((_coefficients_name(dtype, n, per_token=True),) if _token_coefficients(n) else ()),
        f"mhc_apply<{cuda_type}, {n}>",
        f"mhc_pre_small<{cuda_type}, {n}>",
        f"mhc_pre_cluster<{cuda_type}, {n}>",
    )
    return _cuda.ModuleSpec("mhc", names, _FORWARD_DEFINES)


def post_module() -> _cuda.ModuleSpec:
    """The post kernel for every dtype (small: one module)."""
    names = tuple(f"mhc_post<{t}>" for t in CUDA_TYPES.values())
    return _cuda.ModuleSpec("mhc", names, _FORWARD_DEFINES)


def forward_module_specs() -> list[_cuda.ModuleSpec]:
    """The forward's modules: pre for each x dtype and n, and post."""
    return [pre_module(dtype, n) for dtype in CUDA_TYPES for n in CUDA_STREAMS] + [post_module()]


def scratch_sections(sizes: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(words, word offset of each section) of one float32 scratch buffer holding sections
    of ``sizes`` words, each starting on 256 bytes (the kernels read scratch rows with
    16-byte cp.async)."""
    offsets, words = [], 0
    for size in sizes:
        offsets.append(words)
        words += -(-size // _SCRATCH_ALIGN_WORDS) * _SCRATCH_ALIGN_WORDS
    return words, tuple(offsets)


@dataclass(frozen=True, slots=True)
class _PrePlan:
    """Launch geometry of one (device, dtype, n, c_x, batch), computed once. ``small``: one
    mhc_pre_small launch, whose scratch is the stream's workspace (:func:`_scratch`).
    ``fuse``: one cooperative mhc_project launch (its blocks wait for each other, so all
    must be resident at once) on the stream's workspace too. Otherwise phi's fragments, the
    projection, the coefficients and the mix."""

    steps: tuple[_cuda.Step, ...]
    n: int
    c_x: int
    k_range: int
    k_splits: int
    fuse: bool
    small: bool
    scratch: tuple[int, int, int, int]  # words of partials, coefficients, counters, pieces
    cluster_rows: int = 0  # mhc_pre_cluster: tokens a cluster (0: another plan)
    cluster_columns: int = 0  # mhc_pre_cluster: columns of each stream a block
    cluster_groups: int = 1  # mhc_pre_cluster: clusters splitting K for one group of tokens
    # (words, word offset of the partials, coefficients, counters and pieces) in one buffer
    scratch_layout: tuple[int, tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        # mhc_pre_small's counters come first, in a section of one size for every plan: a
        # stream's workspace serves plans of any batch, and each launch zeroes only the
        # counters it used, so every other word there must be a counter too
        if self.workspace:
            partials, coefficients, counters, _ = self.scratch
            words, (counter, partial, coef) = scratch_sections((counters, partials, coefficients))
            layout = words, (partial, coef, counter, words)
        else:
            layout = scratch_sections(self.scratch)
        object.__setattr__(self, "scratch_layout", layout)

    @property
    def workspace(self) -> bool:
        """Whether the scratch is the stream's workspace (:func:`_scratch`): the one-launch
        plans with counters (mhc_pre_small, mhc_pre_cluster split over clusters, the fused
        mhc_project)."""
        return self.small or self.cluster_groups > 1 or self.fuse

    @property
    def counters(self) -> tuple[int, int]:
        """(word offset, words) of the counters in the scratch."""
        return self.scratch_layout[1][2], self.scratch[2]


_pre_plans: dict[tuple, _PrePlan] = {}
_smem_raised: set[tuple[int, int]] = set()
_lock = ForkSafeLock()


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


def plan_geometry(
    batch: int, width: int, resident_blocks: int, stage_k: int = _BLOCK_K
) -> tuple[int, int, bool]:
    """(k_range, k_splits, fuse): how mhc_project splits K over its blocks.

    At most ``resident_blocks`` (tile, K range) blocks, as many as fit at once: a large
    batch has about one tile per block and splits K little; a small batch splits K over
    every block, since reading phi is then much of the work. K ranges are whole stages
    (``stage_k`` wide). Small batches (``fuse``) run as one cooperative launch, which needs
    every block resident at once.
    """
    tiles = -(-batch // _TILE_ROWS)
    wanted = max(1, resident_blocks // tiles)
    k_range = max(stage_k, -(-width // (wanted * stage_k)) * stage_k)
    return k_range, -(-width // k_range), batch <= _MAX_FUSED_ROWS


def small_geometry(batch: int, width: int, resident_blocks: int) -> tuple[int, int, int]:
    """(k_range, k_splits, groups) of mhc_pre_small: groups of SMALL_ROWS tokens, each
    projected by k_splits blocks of K ranges of whole SMALL_CHUNKs, about
    ``resident_blocks`` projection blocks in all (as many as are resident at once: enough to
    read phi at full bandwidth, in one wave), and at most SMALL_FAN_IN**2 per group (the
    partials' two-level tree)."""
    groups = -(-batch // _SMALL_ROWS)
    wanted = min(_FAN_IN * _FAN_IN, max(1, resident_blocks // groups))
    k_range = max(_SMALL_CHUNK, -(-width // (wanted * _SMALL_CHUNK)) * _SMALL_CHUNK)
    return k_range, -(-width // k_range), groups


def cluster_geometry(c_x: int, groups: int = 1) -> tuple[int, int, int]:
    """(groups, blocks, columns) of mhc_pre_cluster's clusters of one group of tokens: up to
    ``groups`` clusters (fewer where fewer cover c_x) of up to _MAX_CLUSTER_BLOCKS blocks of
    ``columns`` (a multiple of 8) columns of every stream, which cover c_x."""
    columns = -(-c_x // (groups * _MAX_CLUSTER_BLOCKS * 8)) * 8
    slices = -(-c_x // columns)
    blocks = -(-slices // groups)
    return -(-slices // blocks), blocks, columns


def cluster_smem_bytes(n: int, rows: int, columns: int, itemsize: int) -> int:
    """Dynamic shared memory of an mhc_pre_cluster block (mhc.cu's ClusterLayout, whose
    sections these are; the kernel traps if it gets less)."""
    q, nc = n * n + 2 * n, n + n * n

    def floats4(floats: int) -> int:
        return -(-floats // 4) * 4

    red = rows * (_PROJECT_THREADS // 32) * floats4(q + 1)  # each warp's sums
    xs = n * columns * q + 2 * floats4(rows * (q + 1)) + floats4(rows * nc) + red
    return 4 * xs + rows * n * columns * itemsize


def _dynamic_smem_limit(kernel: Any, device: int) -> int:
    """The most dynamic shared memory a block of ``kernel`` may have on ``device`` (the
    device's opt-in limit less the kernel's static shared memory), allowed once; clusters
    of up to 16 blocks allowed too (non-portable sizes)."""
    cp = cupy()
    driver = cp.cuda.driver
    with cp.cuda.Device(device):
        static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kernel.ptr)
        limit = _cuda.device_attribute(device, _cuda.MAX_SMEM_OPTIN) - static
        key = (kernel.ptr, device)
        if key not in _smem_raised:
            driver.funcSetAttribute(
                kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, limit
            )
            driver.funcSetAttribute(kernel.ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            _smem_raised.add(key)
    return limit


def _resident_clusters(kernel: Any, device: int, blocks: int, smem: int) -> int:
    """Clusters of ``blocks`` blocks of ``kernel`` with ``smem`` bytes each (within
    :func:`_dynamic_smem_limit`) that the device holds at once (cuOccupancyMaxActiveClusters;
    0: none fits)."""
    with cupy().cuda.Device(device):
        step = _cuda.Step(kernel, (blocks, 1, 1), (_PROJECT_THREADS, 1, 1), smem, cluster=blocks)
        clusters = ctypes.c_int(0)
        result = _cuda.driver_function("cuOccupancyMaxActiveClusters")(
            ctypes.byref(clusters), ctypes.c_void_p(kernel.ptr),
            ctypes.byref(_cuda.launch_config(step)),
        )  # fmt: skip
    return clusters.value if result == 0 else 0


def _cluster_plan(device: int, dtype: str, n: int, c_x: int, batch: int) -> _PrePlan | None:
    """mhc_pre_cluster's plan, or None where it does not apply: before sm_90, c_x not a
    multiple of 8, or where every cluster resident at once would take more than
    _MAX_CLUSTER_ROWS tokens or their slices of x more than a block's shared memory at
    every split of K over up to _MAX_CLUSTER_GROUPS clusters of a token group. The fewest
    clusters a token group that fit (from _MIN_CLUSTER_GROUPS), then the fewest tokens a
    cluster that let every cluster be resident at once."""
    if _cuda.device_attribute(device, _cuda.COMPUTE_MAJOR) < 9 or c_x % 8 or batch == 0:
        return None
    spec = pre_module(dtype, n)
    kernel = _cuda.function(spec, spec.name_expressions[-1], device)
    limit = _dynamic_smem_limit(kernel, device)
    for split in range(_MIN_CLUSTER_GROUPS, _MAX_CLUSTER_GROUPS + 1):
        groups, blocks, columns = cluster_geometry(c_x, split)
        if groups < split:
            continue  # (the same geometry as a smaller split)
        rows = 1
        while rows <= _MAX_CLUSTER_ROWS:
            smem = cluster_smem_bytes(n, rows, columns, ITEMSIZE[dtype])
            resident = _resident_clusters(kernel, device, blocks, smem) if smem <= limit else 0
            if resident < groups:
                break
            token_groups = -(-batch // rows)
            if token_groups * groups <= resident:
                if groups > 1 and token_groups > _SMALL_COUNTER_WORDS:
                    break  # (one counter per token group, in the stream's workspace)
                step = _cuda.Step(
                    kernel, (token_groups * groups * blocks, 1, 1), (_PROJECT_THREADS, 1, 1),
                    smem, cluster=blocks,
                )  # fmt: skip
                partials = token_groups * groups * rows * (n * n + 2 * n + 1) if groups > 1 else 0
                return _PrePlan(
                    steps=(step,), n=n, c_x=c_x, k_range=0, k_splits=0, fuse=False,
                    small=False, cluster_rows=rows, cluster_columns=columns,
                    cluster_groups=groups,
                    scratch=(partials, 0, _SMALL_COUNTER_WORDS if groups > 1 else 0, 0),
                )  # fmt: skip
            rows = max(rows + 1, -(-batch // (resident // groups)))
    return None


def _launched_early(
    steps: tuple[_cuda.Step, ...], device: int, batch: int
) -> tuple[_cuda.Step, ...]:
    """A multi-kernel mHC plan's steps (pre's four, pre backward's five or six), every one
    after the first launched with programmatic stream serialization on sm_90 and newer from
    _MIN_EARLY_ROWS tokens (mhc.cu: programmatic dependent launch; each of those kernels
    waits in the kernel for what the ones before wrote), else as they are."""
    if _cuda.device_attribute(device, _cuda.COMPUTE_MAJOR) < 9 or batch < _MIN_EARLY_ROWS:
        return steps
    return (steps[0], *(replace(step, programmatic=True) for step in steps[1:]))


def _pre_plan(device: int, dtype: str, n: int, c_x: int, batch: int) -> _PrePlan:
    key = (device, dtype, n, c_x, batch)
    plan = _pre_plans.get(key)
    if plan is not None:
        return plan
    if n not in CUDA_STREAMS:
        raise ValueError(
            f"the CUDA mHC kernels take n <= {CUDA_STREAMS[-1]} streams, got n = {n} "
            "(phi width n*n+2n); run on the host (target='cpu' with host arrays) instead"
        )
    items = batch * -(-c_x // 8)  # the mix: one thread per 8 columns of a row
    if items >= 1 << 32:
        raise ValueError(f"mHC pre takes batch * ceil(c_x / 8) < 2**32, got {items}")
    plan = _cluster_plan(device, dtype, n, c_x, batch)
    if plan is not None:
        return _remember(key, plan)
    spec = pre_module(dtype, n)
    pieces_name, *_, apply_name, small_name, _ = spec.name_expressions
    width, q = n * c_x, n * n + 2 * n
    threads = (_PROJECT_THREADS, 1, 1)
    if batch <= _MAX_SMALL_ROWS and batch * width <= _SMALL_WORK:
        small = _cuda.function(spec, small_name, device)
        resident = _resident_blocks(small, device, _PROJECT_THREADS, 0)
        k_range, k_splits, groups = small_geometry(batch, width, resident)
        blocks = groups * k_splits + -(-items // _PROJECT_THREADS)
        plan = _PrePlan(
            steps=(_cuda.Step(small, (blocks, 1, 1), threads),),
            n=n, c_x=c_x, k_range=k_range, k_splits=k_splits, fuse=False, small=True,
            scratch=(
                (k_splits + -(-k_splits // _FAN_IN)) * -(-batch * (q + 1) // 4) * 4,
                batch * (n + n * n),
                _SMALL_COUNTER_WORDS,
                0,
            ),
        )  # fmt: skip
        return _remember(key, plan)
    project, smem, (k_range, k_splits, fuse), stage_k = _project_plan(device, dtype, n, batch, c_x)
    grid = (-(-batch // _TILE_ROWS) * k_splits, 1, 1)
    partial_words, coef_words = k_splits * batch * (q + 1), batch * (n + n * n)  # scratch
    if fuse:
        # one launch: its blocks split their own ranges of phi into fragments, each takes
        # its run of tokens' coefficients at once, and the last one out zeroes the counters
        # of the stream's workspace. Before, mhc_phi_pieces ran first (the cooperative
        # launch started 5.4 us after it ended) and a block took its tokens' coefficients
        # one after another (5-7 us each). H100, bf16 n4, device us, before -> one launch:
        # B96 c_x7168 34.5 -> 30.2, B128 c_x1280 29.8 -> 21.7, B128 c_x4096 31.1 -> 27.0,
        # B200 c_x2048 33.0 -> 26.1, B256 c_x1280 38.5 -> 25.6, B256 c_x4096 40.5 -> 32.3
        return _remember(key, _PrePlan(
            steps=(_cuda.Step(project, grid, threads, smem, cooperative=True),), n=n, c_x=c_x,
            k_range=k_range, k_splits=k_splits, fuse=True, small=False,
            scratch=(partial_words, coef_words, _SMALL_COUNTER_WORDS, 0),
        ))  # fmt: skip
    k_blocks = -(-width // stage_k) * (stage_k // _BLOCK_K)  # (a last stage's are whole)
    # the projection and the mix start, and load x, while the kernel before them runs
    # (mhc.cu: programmatic dependent launch). H200, bf16 n4, median us, plain -> early:
    # B512 c_x4096 48.9 -> 45.8-46.4, B2000 c_x1280 46.0-46.8 -> 42.0-42.3, B4096 c_x4096
    # 151.2 -> 147.3, B16384 c_x7168 869-871 -> 863-867; at B300 c_x2048 runs disagreed
    # (37.5 -> 34.7-41.0), so batches that small launch in plain stream order. The
    # coefficients launch the same way (mhc_project does not trigger, so their blocks start
    # as its last ones exit, without a plain launch's gap): H100, 2026-12-06, plain -> early,
    # B512 c_x7168 55.6 -> 53.9, B4096 c_x4096 173.9 -> 172.1, B16384 c_x7168 1062.6 -> 1060.6
    per_token = _token_coefficients(n) and batch >= _MIN_TOKEN_COEFFICIENT_ROWS
    coefficients = _cuda.function(spec, _coefficients_name(dtype, n, per_token), device)
    coefficient_rows = _COEF_TOKEN_ROWS if per_token else _COEF_ROWS
    apply = _cuda.function(spec, apply_name, device)
    steps = _launched_early((
        _cuda.Step(_cuda.function(spec, pieces_name, device), (k_blocks, 1, 1), threads),
        _cuda.Step(project, grid, threads, smem),
        _cuda.Step(coefficients, (-(-batch // coefficient_rows), 1, 1), threads),
        _cuda.Step(apply, (-(-items // _APPLY_THREADS), 1, 1), (_APPLY_THREADS, 1, 1)),
    ), device, batch)  # fmt: skip
    plan = _PrePlan(
        steps=steps, n=n, c_x=c_x, k_range=k_range, k_splits=k_splits, fuse=False, small=False,
        scratch=(
            partial_words, coef_words, _COUNTER_GROUPS, k_blocks * _fragment_bytes(n, _BLOCK_K) // 4
        ),
    )  # fmt: skip
    return _remember(key, plan)


def _project_plan(
    device: int, dtype: str, n: int, batch: int, c_x: int
) -> tuple[Any, int, tuple[int, int, bool], int]:
    """(kernel, shared memory, plan_geometry, STAGE_K) of mhc_project for this batch, among
    the project_pipelines whose blocks fit the device's shared memory: 128-column stages,
    three deep, or two deep where a block streams at least _MIN_TWO_STAGE_RUN of them; 64
    columns where 128 would leave half the multiprocessors or more without a block (and 64
    give more blocks), and wherever 128 are not compiled. Up to _MAX_FUSED_ROWS tokens the
    kernel is the pipeline's fused instantiation (the whole of mHC pre, one launch)."""
    spec = pre_module(dtype, n)
    optin = _cuda.device_attribute(device, _cuda.MAX_SMEM_OPTIN)
    multiprocessors = _cuda.device_attribute(device, _cuda.MULTIPROCESSORS)
    tiles = -(-batch // _TILE_ROWS)
    fused = batch <= _MAX_FUSED_ROWS  # (plan_geometry's fuse)
    options = {}  # pipeline: (kernel, shared memory, plan_geometry)
    needs = {}  # pipeline: bytes of shared memory a block
    for pipeline in project_pipelines(dtype, n):
        smem = _project_smem(dtype, n, pipeline)
        # (and the kernel's static float a thread; sm_80 allows 163 KB a block, which float32
        # x with n >= 7 passes)
        needs[pipeline] = smem + 4 * _PROJECT_THREADS
        if needs[pipeline] > optin:
            continue
        kernel = _cuda.function(spec, _project_name(dtype, n, pipeline, fused), device)
        with _lock:
            per_multiprocessor = _raise_smem_limit(kernel, device, smem)
        resident = per_multiprocessor * multiprocessors
        options[pipeline] = kernel, smem, plan_geometry(batch, n * c_x, resident, pipeline[0])
    if not options:
        raise ValueError(
            f"mHC pre's projection with {dtype} x and n = {n} needs {min(needs.values())} bytes "
            f"of shared memory per block; this device allows {optin}: use 16-bit x, or run on "
            "the host (target='cpu' with host arrays)"
        )
    blocks = {pipeline: tiles * option[2][1] for pipeline, option in options.items()}
    # the narrow pipeline (the smallest, compiled for every dtype and n) unless the wide one
    # is better; a test that compiles or forces one pipeline alone gets that one
    chosen = _NARROW if _NARROW in options else next(iter(options))
    if _WIDE in options and (
        2 * blocks[_WIDE] > multiprocessors or blocks[_WIDE] >= blocks.get(_NARROW, 0)
    ):
        chosen = _WIDE
        two_stages = options.get(_WIDE_TWO_STAGES)  # (its k_range: whole stages a block)
        if two_stages is not None and two_stages[2][0] >= _MIN_TWO_STAGE_RUN * _WIDE_TWO_STAGES[0]:
            chosen = _WIDE_TWO_STAGES
    kernel, smem, geometry = options[chosen]
    return kernel, smem, geometry, chosen[0]


def _remember(key: tuple, plan: _PrePlan) -> _PrePlan:
    if len(_pre_plans) > 4096:  # shapes churn (e.g. growing prefill chunks): start over
        _pre_plans.clear()
    _pre_plans[key] = plan
    return plan


# (device, stream, plan type) -> ((what keeps it alive, address), words): the scratch of the
# one-launch plans with counters (_PrePlan.workspace, _PreBackwardPlan.workspace), one per
# stream and plan type, its counters left zeroed by every launch.
# Bounded as an op's launches are: a server that makes streams as it goes would otherwise
# keep a workspace per stream it ever used. (A forgotten one is freed in its stream's
# order, by torch's or CuPy's allocator; its stream's next call makes a new one.)
_workspaces: dict[tuple[int, int, type], tuple[tuple[Any, int], int]] = LaunchRecords()


class _Runtime:
    """The two CUDA runtime calls the scratch needs, bound once."""

    is_capturing: Any = None

    @classmethod
    def bind(cls) -> None:
        runtime = cupy().cuda.runtime
        cls.memset = runtime.memsetAsync
        cls.is_capturing = runtime.streamIsCapturing


def _scratch(
    plan: _PrePlan | _PreBackwardPlan, device: int, stream: int, allocate: Any, template: Any
) -> tuple[Any, tuple[int, ...]]:
    """(what keeps it alive, the device pointer of each section of ``plan.scratch_layout``)
    of one call's scratch; ``allocate(template, words)`` returns (a fresh float32 buffer of
    the caller's allocator, its address).

    Fresh memory for the multi-kernel plans (mhc_phi_pieces zeroes the forward's counters,
    pre backward's five kernels use none): stream-ordered, graph-capturable (torch's
    allocator serves a capture from the graph's pool) and never shared between concurrent
    calls. The one-launch plans with counters (``plan.workspace``: mhc_pre_small, the fused
    mhc_project, mhc_pre_cluster split over clusters, mhc_bwd_fused) need
    their counters zeroed when they start and leave them zeroed when they end, so they run
    on one workspace per stream and kind of plan, zeroed once when made (launches on one
    stream never overlap; every plan of a kind has its counters first, in a section of one
    size); under CUDA-graph capture they get fresh memory and a captured memset instead, so
    that replays never share the stream's workspace with eager calls."""
    words, offsets = plan.scratch_layout
    if words == 0:  # (mhc_pre_cluster: none)
        return None, tuple(0 for _ in offsets)
    if not plan.workspace:
        keep, base = allocate(template, words)
    else:
        if _Runtime.is_capturing is None:
            _Runtime.bind()
        capturing = _Runtime.is_capturing(stream)
        key = (device, stream, type(plan))
        workspace = None if capturing else _workspaces.get(key)
        if workspace is not None and workspace[1] >= words:
            keep, base = workspace[0]
        else:
            keep, base = allocate(template, words)
            counter, counters = plan.counters
            _Runtime.memset(base + 4 * counter, 0, 4 * counters, stream)
            if not capturing:
                with _lock:
                    _workspaces[key] = ((keep, base), words)
    return keep, tuple(base + 4 * offset for offset in offsets)


def _scratch_source(
    plan: _PrePlan | _PreBackwardPlan, device: int, template: Any
) -> Callable[[int], tuple[Any, tuple[int, ...]]]:
    """``scratch(stream)``: :func:`_scratch` of torch memory for a relauncher, which keeps
    the workspace of its last stream (fit for every later call there, even once _scratch
    has grown a new one: each launch leaves its counters zeroed, and launches on one stream
    never overlap) and so skips the lookup on the next call there."""
    if _Runtime.is_capturing is None:
        _Runtime.bind()
    is_capturing = _Runtime.is_capturing
    last: tuple = (None, None, None)  # (stream, what keeps its workspace alive, pointers)
    if plan.scratch_layout[0] == 0:  # (mhc_pre_cluster: no scratch at all)
        nothing = _scratch(plan, device, 0, _torch_buffer, template)
        return lambda stream: nothing

    def scratch(stream: int) -> tuple[Any, tuple[int, ...]]:
        nonlocal last
        capturing = is_capturing(stream)
        if last[0] == stream and not capturing:
            return last[1], last[2]
        keep, pointers = _scratch(plan, device, stream, _torch_buffer, template)
        if plan.workspace and not capturing:
            last = (stream, keep, pointers)
        return keep, pointers

    return scratch


_PRE_RELAUNCH = PRE_PARAMS.field_writer(
    "x", "phi", "bias", "partial", "counter", "coef", "pieces", "x_res", "x_layer", "h_post"
)
_POST_RELAUNCH = POST_PARAMS.field_writer("x_layer_out", "h_post", "x_res", "out")


def relaunch_post(launch: _cuda.Launch, pointers: list[int], x_res: Any) -> Any:
    """mHC post on torch tensors whose layout an earlier call validated and planned
    (x_layer_out, h_post and x_res at ``pointers``): a new output patched into that launch."""
    x_out = torch_ops.new_contiguous(x_res)
    stream = torch_ops.current_stream(launch.device)
    launch.relaunch(stream, _POST_RELAUNCH, *pointers, x_out.data_ptr())
    return x_out


_POST_BWD_RELAUNCH = POST_BWD_PARAMS.field_writer(
    "x_layer_out", "h_post", "grad_x_out", "grad_x_layer_out", "grad_h_post"
)


def relaunch_post_backward(
    launch: _cuda.Launch, pointers: list[int], x_layer_out: Any, h_post: Any
) -> tuple[Any, Any]:
    """mHC post backward on torch tensors whose layout an earlier call validated and
    planned (x_layer_out, h_post, x_res and grad_x_out at ``pointers``): new
    ``(grad_x_layer_out, grad_h_post)`` patched into that launch."""
    grad_layer = torch_ops.new_contiguous(x_layer_out)
    grad_gates = torch_ops.new_contiguous(h_post)
    layer_ptr, gates_ptr, _, grad_ptr = pointers
    launch.relaunch(
        torch_ops.current_stream(launch.device), _POST_BWD_RELAUNCH, layer_ptr, gates_ptr,
        grad_ptr, grad_layer.data_ptr(), grad_gates.data_ptr(),
    )  # fmt: skip
    return grad_layer, grad_gates


_PRE_BWD_RELAUNCH = PRE_BWD_PARAMS.field_writer(
    "x", "phi", "bias", "grad_x_res", "grad_x_layer", "grad_h_post", "grad_phi", "grad_x",
    "grad_b", "grad_alpha", *_PRE_BWD_SCRATCH,
)  # fmt: skip


def pre_backward_relauncher(
    planned: tuple[_cuda.Launch, _PreBackwardPlan], phi: Any, x: Any, b: Any
) -> Callable[[list[int]], tuple]:
    """``run(pointers)``: mHC pre backward on torch tensors of the layout that
    ``planned``'s call (on ``phi``, ``x`` and ``b``) validated and planned, with phi, x, b
    and the three upstream gradients at ``pointers``: new gradients and scratch
    (:func:`_scratch`) patched into that launch (outputs made as :func:`pre_relauncher`
    makes them)."""
    import torch  # (x is a torch tensor)

    launch, plan = planned
    phi_like, x_like, b_like, alpha_like = (
        torch_ops.shape_template(like, shape)
        for like, shape in ((phi, phi.shape), (x, x.shape), (phi, b.shape), (phi, (3,)))
    )
    scratch = _scratch_source(plan, launch.device, torch_ops.shape_template(phi, (1,)))
    device, relaunch = launch.device, launch.relaunch
    new_like, current_stream = torch.empty_like, torch._C._cuda_getCurrentRawStream

    def run(pointers: list[int]) -> tuple:
        phi_ptr, x_ptr, b_ptr, res_ptr, layer_ptr, post_ptr = pointers
        grad_phi, grad_x = new_like(phi_like), new_like(x_like)
        grad_b, grad_alpha = new_like(b_like), new_like(alpha_like)
        stream = current_stream(device)
        keep, sections = scratch(stream)
        relaunch(
            stream, _PRE_BWD_RELAUNCH, x_ptr, phi_ptr, b_ptr, res_ptr, layer_ptr, post_ptr,
            grad_phi.data_ptr(), grad_x.data_ptr(), grad_b.data_ptr(), grad_alpha.data_ptr(),
            *sections,
        )  # fmt: skip
        del keep  # (alive until the launch is on the stream; stream-ordered, like the grads)
        return grad_phi, grad_x, grad_b, grad_alpha

    return run


def pre_relauncher(
    planned: tuple[_cuda.Launch, _PrePlan], phi: Any, x: Any
) -> Callable[[list[int]], tuple]:
    """``run(pointers)``: mHC pre on torch tensors of the layout that ``planned``'s call
    (on ``phi`` and ``x``) validated and planned, with phi, x and b at ``pointers``: new
    outputs and scratch (:func:`_scratch`), their addresses patched into that launch.

    Made once per layout so that a decode step does only what it must: the outputs are
    ``torch.empty_like`` of templates of their shapes (:func:`_torch_ops.shape_template`)."""
    import torch  # (x is a torch tensor)

    launch, plan = planned
    batch, width = x.shape
    x_res_like = torch_ops.shape_template(x, (batch, width))
    x_layer_like = torch_ops.shape_template(x, (batch, plan.c_x))
    h_post_like = torch_ops.shape_template(phi, (batch, plan.n))
    scratch = _scratch_source(plan, launch.device, h_post_like)
    device, relaunch = launch.device, launch.relaunch
    # torch's own entry points, bound here: a decode step pays for every call in between
    new_like, current_stream = torch.empty_like, torch._C._cuda_getCurrentRawStream

    def run(pointers: list[int]) -> tuple:
        phi_ptr, x_ptr, b_ptr = pointers
        x_res, x_layer, h_post = new_like(x_res_like), new_like(x_layer_like), new_like(h_post_like)
        stream = current_stream(device)
        keep, (partial, coef, counter, pieces) = scratch(stream)
        relaunch(
            stream, _PRE_RELAUNCH, x_ptr, phi_ptr, b_ptr, partial, counter, coef, pieces,
            x_res.data_ptr(), x_layer.data_ptr(), h_post.data_ptr(),
        )  # fmt: skip
        del keep  # (alive until the launch is on the stream)
        return x_res, x_layer, h_post

    return run


def _torch_buffer(template: Any, words: int) -> tuple[Any, int]:
    buffer = template.new_empty((words,))
    return buffer, buffer.data_ptr()


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
    q = n * n + 2 * n
    partial, coef, counter, pieces = scratch
    return PRE_PARAMS.pack(
        x=x.ptr, phi=phi.ptr, bias=b.ptr, partial=partial, counter=counter, coef=coef,
        pieces=pieces, x_res=x_res.ptr, x_layer=x_layer.ptr, h_post=h_post.ptr,
        x_stride=x.strides[0], phi_stride_k=phi.strides[0], phi_stride_q=phi.strides[1],
        bias_stride=b.strides[0], batch=batch, c_x=c_x, k_range=plan.k_range,
        k_splits=plan.k_splits, vector_io=c_x % 8 == 0 and (x.ptr | row_bytes) % 16 == 0,
        repeat=gates.sinkhorn_repeat,
        phi_dense=phi.strides == (q, 1) and phi.ptr % 16 == 0,
        alpha_pre=gates.alpha_pre, alpha_post=gates.alpha_post, alpha_res=gates.alpha_res,
        eps=gates.sinkhorn_eps, cluster_rows=plan.cluster_rows,
        cluster_columns=plan.cluster_columns, cluster_groups=plan.cluster_groups, unused=(0, 0),
    )  # fmt: skip


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


def _post_cuda(
    layer: Operand, gates: Operand, res: Operand, x_out: Operand, stream: int
) -> _cuda.Launch:
    if not layer.last_dim_contiguous:
        layer = contiguous(layer)
    if not res.last_dim_contiguous:
        res = contiguous(res, layer)  # (on layer's stream, the launch's)
    batch, c_x = layer.shape
    items = batch * -(-c_x // 8)
    if items >= 1 << 32:
        raise ValueError(f"mHC post takes batch * ceil(c_x / 8) < 2**32, got {items}")
    spec = post_module()
    kernel = _cuda.function(spec, f"mhc_post<{CUDA_TYPES[layer.dtype]}>", layer.device)
    params = post_launch_params(layer, gates, res, x_out)
    grid = (-(-items // _POST_THREADS), 1, 1)
    step = _cuda.Step(kernel, grid, (_POST_THREADS, 1, 1))
    return _cuda.launch(layer.device, params, (step,), stream)


# --------------------------------------------------------------------------- backward CUDA bodies


def post_backward_cuda(
    x_layer_out: Operand,
    h_post: Operand,
    grad_x_out: Operand,
    grad_x_layer_out: Operand,
    grad_h_post: Operand,
    stream: int,
) -> _cuda.Launch:
    """Fill ``grad_x_layer_out [B, c_x]`` and ``grad_h_post [B, n]`` (float32) for
    ``x_out = h_post[i] * x_layer_out + x_res[i]``; returns the launch."""
    layer, grad = (  # (copies on x_layer_out's stream, the launch's)
        operand if operand.last_dim_contiguous else contiguous(operand, x_layer_out)
        for operand in (x_layer_out, grad_x_out)
    )
    batch, c_x = layer.shape
    n = h_post.shape[1]
    if batch >= 1 << 31:
        raise ValueError(f"mHC post backward takes batch < 2**31, got {batch}")
    size = ITEMSIZE[layer.dtype]
    alignment = layer.ptr | grad.ptr | grad_x_layer_out.ptr
    if batch > 1:
        alignment |= (layer.strides[0] | grad.strides[0]) * size
    spec = post_backward_module(layer.dtype)
    # n streams unrolled up to 8, a kernel for any n beyond; 16-byte accesses where the
    # columns and rows allow them
    vector = c_x % 8 == 0 and alignment % 16 == 0
    name = post_backward_kernel(layer.dtype, n, vector)
    params = POST_BWD_PARAMS.pack(
        x_layer_out=layer.ptr, h_post=h_post.ptr, grad_x_out=grad.ptr,
        grad_x_layer_out=grad_x_layer_out.ptr, grad_h_post=grad_h_post.ptr,
        layer_stride=layer.strides[0],
        h_stride_row=h_post.strides[0], h_stride_col=h_post.strides[1],
        grad_stride=grad.strides[0], batch=batch, n=n, c_x=c_x, units=-(-c_x // 8),
    )  # fmt: skip
    kernel = _cuda.function(spec, name, layer.device)
    step = _cuda.Step(kernel, (batch, 1, 1), (_POST_BWD_THREADS, 1, 1))
    return _cuda.launch(layer.device, params, (step,), stream)


# --------------------------------------------------------------------------- modules


@dataclass(frozen=True)
class _Geometry:
    """The layout of one (x dtype, n) pre-backward module: ``BwdGeo`` in mhc_backward.cu."""

    n: int
    c_stage: int  # mhc_bwd_stats: columns of every stream per pipeline stage
    c_grad: int  # mhc_bwd_grad: columns of every stream per chunk
    stats_stage_bytes: int
    grad_stage_bytes: int
    grad_d_bytes: int  # mhc_bwd_grad's (dh @ phi^T) tile, after its stages
    stats_row: int  # h, sum(x*x), dh_pre, dM: Q + 1 + n + n*n floats
    coef_row: int  # h_pre, M, c_r, scale, padded to 4 floats
    dh_row: int  # u16 per token: dloss/dh in bf16 pieces
    piece_words: int  # phi fragments of one stats column block

    @property
    def defines(self) -> tuple[str, ...]:
        return (
            f"BWD_N={self.n}", f"BWD_C_STAGE={self.c_stage}", f"BWD_C_GRAD={self.c_grad}",
            f"BWD_STATS_STAGE_BYTES={self.stats_stage_bytes}",
            f"BWD_GRAD_STAGE_BYTES={self.grad_stage_bytes}",
            f"BWD_GRAD_D_BYTES={self.grad_d_bytes}", f"BWD_THREADS={_THREADS}",
            f"BWD_STATS_TILE={_STATS_TILE}", f"BWD_GRAD_TILE={_GRAD_TILE}",
            f"BWD_TOKEN_THREADS={_TOKEN_THREADS}", f"BWD_REDUCE_THREADS={_REDUCE_THREADS}",
        )  # fmt: skip


def _tensor_core_products(dtype: str, n: int) -> bool:
    """Whether pre backward's per-token products run on the tensor cores (mhc_backward.cu's
    MMA_PRODUCTS: 16-bit x, n <= 4). Its first pass's stages are then whole 16-column steps,
    and only there may they be wide (_geometry)."""
    return ITEMSIZE[dtype] == 2 and n <= 4


@functools.cache
def _geometry(dtype: str, n: int, wide_stats: bool = False) -> _Geometry:
    size = ITEMSIZE[dtype]
    vec = 16 // size  # elements per 16-byte copy
    q = n * n + 2 * n
    n_tiles, q16 = -(-q // 8), -(-q // 16) * 16
    # first pass: about 64 (16-bit x) or 32 (float32) K positions per stage, 128 where wide
    # (_wide_first_pass), in whole 16-byte copies of each stream (whole 16-column steps where
    # the token products run on the tensor cores), padded to whole 16-deep k-steps. Longer
    # runs of each row are read faster, and the plan takes the wide stages where two fit a
    # block and the call is not one launch: bf16 n4 then takes 32 columns a stream (64-byte
    # runs; 16 narrow). H200, whole call, us, narrow -> wide: B4096 c_x4096 326.1 -> 312.9,
    # B16384 c_x7168 1947.9 -> 1844.3, B1024 c_x4096 129.0 -> 129.4, B512 c_x7168 121.8 ->
    # 123.3; the one launch of <= 64 tokens loses with them (B64 c_x1280 48.9 -> 52.8, B8
    # c_x4096 51.2 -> 54.0: half the column blocks to spread over the device).
    step = 16 if _tensor_core_products(dtype, n) else vec
    positions_wanted = 128 if wide_stats else 64 if size == 2 else 32
    c_stage = max(step, positions_wanted // n // step * step)
    positions = -(-n * c_stage // 16) * 16
    piece_words = positions // 16 * n_tiles * 3 * 32 * 2
    stats_stage = (2 * (positions + 8) + c_stage + vec) * _STATS_TILE * size + 4 * piece_words
    # second pass: 128-byte rows of each stream per chunk where grad_phi's accumulators
    # (chunk positions x Q, in registers) allow
    c_grad = max(16, (64 if n <= 4 else 32 if n <= 6 else 16) // (size // 2))
    chunk = n * c_grad
    dh_pieces = 3 if size == 4 else 2
    coef_row = -(-(n + n * n + 2) // 4) * 4
    coef_pitch = coef_row + 4 * (1 - coef_row // 4 % 2)  # an odd number of 16-byte units
    grad_stage = _GRAD_TILE * (
        (2 * (chunk + vec) + c_grad + vec) * size + (dh_pieces * q16 + 8) * 2 + 4 * coef_pitch
    )
    return _Geometry(
        n=n,
        c_stage=c_stage,
        c_grad=c_grad,
        stats_stage_bytes=stats_stage,
        grad_stage_bytes=grad_stage,
        grad_d_bytes=_GRAD_TILE * (chunk + 8) * 4,
        stats_row=q + 1 + n + n * n,
        coef_row=coef_row,
        dh_row=dh_pieces * q16,
        piece_words=piece_words,
    )


_PRE_BACKWARD_KERNELS = (
    "mhc_bwd_pieces", "mhc_bwd_stats", "mhc_bwd_splits", "mhc_bwd_token", "mhc_bwd_grad",
    "mhc_bwd_reduce", "mhc_bwd_fused",
)  # fmt: skip


def pre_backward_module(dtype: str, n: int, wide_stats: bool = False) -> _cuda.ModuleSpec:
    """The five pre-backward kernels of one x dtype and n, in launch order, then the five
    as one (mhc_bwd_fused); the first pass's stages wide or not (_geometry)."""
    cuda_type = CUDA_TYPES[dtype]
    names = tuple(f"{kernel}<{cuda_type}, {n}>" for kernel in _PRE_BACKWARD_KERNELS)
    # compiled after mhc.cu's text: the forward's PTX wrappers and 8-element helpers as they are
    defines = (*_FORWARD_DEFINES, *_geometry(dtype, n, wide_stats).defines)
    return _cuda.ModuleSpec("mhc_backward", names, defines, prelude=("mhc",))


def post_backward_kernel(dtype: str, n: int, vector: bool) -> str:
    """The name expression of mhc_post_bwd for ``dtype``, ``n`` streams (unrolled up to 8,
    0: any n) and 16-byte accesses or not."""
    return f"mhc_post_bwd<{CUDA_TYPES[dtype]}, {n if n <= 8 else 0}, {str(vector).lower()}>"


def post_backward_module(dtype: str) -> _cuda.ModuleSpec:
    """The post-backward kernels of one dtype: n = 1 .. 8 unrolled and any n (0), each with
    and without 16-byte accesses."""
    names = tuple(
        post_backward_kernel(dtype, n, vector) for n in range(9) for vector in (True, False)
    )
    defines = (*_FORWARD_DEFINES, f"BWD_POST_THREADS={_POST_BWD_THREADS}")
    return _cuda.ModuleSpec("mhc_backward", names, defines, prelude=("mhc",))


def module_specs() -> list[_cuda.ModuleSpec]:
    """Every module this primitive may launch: the forward's, then pre backward for each x
    dtype and n and post backward for each dtype."""
    backward = [
        pre_backward_module(dtype, n, wide)
        for dtype in CUDA_TYPES
        for n in CUDA_STREAMS
        for wide in ((False, True) if _tensor_core_products(dtype, n) else (False,))
    ]
    return forward_module_specs() + backward + [post_backward_module(d) for d in CUDA_TYPES]


# --------------------------------------------------------------------------- plans


def sinkhorn_checkpoints(repeat: int, n: int) -> tuple[int, int]:
    """(segment, slots): mhc_bwd_token keeps the Sinkhorn matrix before every segment-th step
    (ceil(repeat / segment) checkpoints) and recomputes one segment at a time into
    ``segment - 1`` more slots. Every step's input (segment 1, nothing recomputed) while
    that is at most _SINKHORN_KEPT_FLOATS per token; ~2*sqrt(repeat) matrices beyond."""
    if repeat * n * n <= _SINKHORN_KEPT_FLOATS:
        return 1, repeat
    segment = math.isqrt(repeat - 1) + 1  # ceil(sqrt(repeat))
    return segment, -(-repeat // segment) + segment - 1


@dataclass(frozen=True, slots=True)
class _PreBackwardPlan:
    """Launch geometry of one (device, dtype, n, c_x, batch, sinkhorn_repeat), computed
    once. ``fused``: one mhc_bwd_fused launch, whose scratch is the stream's workspace."""

    steps: tuple[_cuda.Step, ...]
    fused: bool
    stats_stages: int  # cp.async pipeline depths of the first and second pass
    grad_stages: int
    k_splits: int
    token_splits: int  # partials mhc_bwd_token sums (1 where mhc_bwd_splits or fused did)
    grad_items: int  # second pass: (column chunk, token tile) items ...
    grad_blocks: int  # ... shared evenly by this many blocks
    slot_cap: int  # most blocks sharing one chunk (grad_phi partials per chunk)
    segment: int  # Sinkhorn steps between checkpoints (sinkhorn_checkpoints)
    scratch: tuple[int, ...]  # words of each _PRE_BWD_SCRATCH section
    scratch_layout: tuple[int, tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scratch_layout", scratch_sections(self.scratch))

    @property
    def workspace(self) -> bool:
        """Whether the scratch is the stream's workspace (:func:`_scratch`)."""
        return self.fused

    @property
    def counters(self) -> tuple[int, int]:
        """(word offset, words) of the counters in the scratch: first, one size for all."""
        return 0, _PRE_BWD_COUNTER_WORDS


_pre_backward_plans: dict[tuple, _PreBackwardPlan] = {}


def _resident_blocks(kernel: Any, device: int, threads: int, smem: int) -> int:
    """Blocks of ``kernel`` resident at once on the device, with ``smem`` bytes of dynamic
    shared memory each (allowed past 48 KB first; idempotent)."""
    cp = cupy()
    driver = cp.cuda.driver
    with cp.cuda.Device(device):
        driver.funcSetAttribute(
            kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem
        )
    return max(1, _per_multiprocessor(kernel, device, threads, smem)) * _cuda.device_attribute(
        device, _cuda.MULTIPROCESSORS
    )


def _per_multiprocessor(kernel: Any, device: int, threads: int, smem: int) -> int:
    """Blocks of ``kernel`` one multiprocessor holds at once with ``smem`` bytes of dynamic
    shared memory each (0: none fits)."""
    with cupy().cuda.Device(device):
        return cupy().cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.ptr, threads, smem
        )


def _token_trace_smem(kernel: Any, device: int, kept: int, blocks: int) -> int:
    """Dynamic shared memory of mhc_bwd_token's blocks: the Sinkhorn trace of their tokens
    (``kept`` floats a token) where that fits and leaves all ``blocks`` resident at once (a
    second wave would wait out the whole chain again: the scratch then, which any number of
    blocks share), else 0 (the trace in the scratch). H200, bf16 n4, 20 steps, mhc_bwd_token
    alone, scratch -> shared memory: B4096 30.7 -> 27.4 us, B16384 41.7 -> 39.1, B1024 36.5 ->
    32.9, B256 62.8 -> 59.6."""
    smem = kept * _TOKEN_THREADS * 4
    if smem > _dynamic_smem_limit(kernel, device):
        return 0
    per_multiprocessor = _per_multiprocessor(kernel, device, _TOKEN_THREADS, smem)
    return (
        smem
        if blocks <= per_multiprocessor * _cuda.device_attribute(device, _cuda.MULTIPROCESSORS)
        else 0
    )


def _grad_owner(item: int, items: int, blocks: int) -> int:
    """The mhc_bwd_grad block that takes ``item``: block j takes items
    [j*items // blocks, (j+1)*items // blocks) (the kernel's formula)."""
    return ((item + 1) * blocks - 1) // items


def _wide_first_pass(dtype: str, n: int, fused: bool, smem_cap: int) -> bool:
    """Whether a plan takes the first pass's wide stages (_geometry says why): where the
    token products run on the tensor cores, two wide stages fit a block (not in sm_80's 163
    KB) and the call is not one launch."""
    return (
        _tensor_core_products(dtype, n)
        and not fused
        and 2 * _geometry(dtype, n, True).stats_stage_bytes <= smem_cap
    )


def _pre_backward_plan(
    device: int, dtype: str, n: int, c_x: int, batch: int, repeat: int
) -> _PreBackwardPlan:
    key = (device, dtype, n, c_x, batch, repeat)
    plan = _pre_backward_plans.get(key)
    if plan is not None:
        return plan
    fused = (
        batch <= _MAX_FUSED_BWD_ROWS
        and n * c_x <= _MAX_FUSED_BWD_WIDTH
        and batch * n * c_x <= _MAX_FUSED_BWD_ELEMENTS
    )
    smem_cap = _cuda.device_attribute(device, _cuda.MAX_SMEM_OPTIN)
    wide_stats = _wide_first_pass(dtype, n, fused, smem_cap)
    geometry = _geometry(dtype, n, wide_stats)
    spec = pre_backward_module(dtype, n, wide_stats)
    pieces, stats, splits, token, grad, reduce, fused_kernel = (
        _cuda.function(spec, name, device) for name in spec.name_expressions
    )
    stats_stages = min(_MAX_STAGES, smem_cap // geometry.stats_stage_bytes)
    grad_stages = min(_MAX_STAGES, (smem_cap - geometry.grad_d_bytes) // geometry.grad_stage_bytes)
    if min(stats_stages, grad_stages) < 2:
        raise ValueError(
            f"the mHC backward kernels need {2 * geometry.stats_stage_bytes} and "
            f"{2 * geometry.grad_stage_bytes + geometry.grad_d_bytes} bytes of shared memory "
            f"per block; this device allows {smem_cap}"
        )
    stats_smem = stats_stages * geometry.stats_stage_bytes
    grad_smem = grad_stages * geometry.grad_stage_bytes + geometry.grad_d_bytes
    fused_smem = max(stats_smem, grad_smem)
    threads = (_THREADS, 1, 1)
    q = n * n + 2 * n
    if fused:  # every stage runs on the one launch's resident blocks
        stats_resident = grad_resident = _resident_blocks(
            fused_kernel, device, _THREADS, fused_smem
        )
    else:
        stats_resident = _resident_blocks(stats, device, _THREADS, stats_smem)
        grad_resident = _resident_blocks(grad, device, _THREADS, grad_smem)
    # first pass: tiles of 128 tokens times K splits (split s takes column blocks s, s +
    # k_splits, ...: at most per_split of them), about one block per resident slot
    tiles = -(-batch // _STATS_TILE)
    column_blocks = -(-c_x // geometry.c_stage)
    wanted = max(1, stats_resident // tiles)
    per_split = -(-column_blocks // wanted)
    k_splits = -(-column_blocks // per_split)
    # second pass: (chunk, tile) items shared evenly by the resident blocks
    chunks = -(-c_x // geometry.c_grad)
    grad_tiles = -(-batch // _GRAD_TILE)
    items = chunks * grad_tiles
    blocks = min(items, grad_resident)
    per_chunk = min(grad_tiles, grad_resident // chunks)
    if n <= 4 and not fused and per_chunk and chunks * per_chunk >= _GRAD_ALIGNED_SHARE * blocks:
        blocks = chunks * per_chunk
    slot_cap = max(
        _grad_owner((chunk + 1) * grad_tiles - 1, items, blocks)
        - _grad_owner(chunk * grad_tiles, items, blocks)
        + 1
        for chunk in range(chunks)
    )
    reduce_blocks = -(-(n * c_x * q) // _REDUCE_THREADS) + q + 3
    segment, slots = sinkhorn_checkpoints(repeat, n)
    token_blocks = -(-batch // _TOKEN_THREADS)
    token_smem = 0 if fused else _token_trace_smem(token, device, slots * n * n, token_blocks)
    summed_apart = not fused and k_splits > _TOKEN_SPLITS
    split_blocks = -(-(geometry.stats_row * batch) // _REDUCE_THREADS)
    if fused:  # as many blocks as the largest stage has, all resident
        stages_blocks = (column_blocks, tiles * k_splits, -(-batch // _THREADS), blocks)
        grid = min(stats_resident, max(*stages_blocks, reduce_blocks))
        steps = (_cuda.Step(fused_kernel, (grid, 1, 1), threads, fused_smem, cooperative=True),)
    else:
        # every kernel after the first waits for the one before in the kernel
        # (griddepcontrol.wait at its start), so on sm_90 it launches early: its blocks start
        # as the last of the one before exit, without a plain launch's gap. H100, device us,
        # plain -> early: bf16 n4 B4096 c_x4096 333.3 -> 327.8, B1024 131.9 -> 124.3,
        # float32 n5 B2048 c_x2048 389.1 -> 379.4, bf16 n8 B1024 c_x1280 219.4 -> 215.9
        steps = _launched_early((
            _cuda.Step(pieces, (column_blocks, 1, 1), threads),
            _cuda.Step(stats, (tiles * k_splits, 1, 1), threads, stats_smem),
            *(
                (_cuda.Step(splits, (split_blocks, 1, 1), (_REDUCE_THREADS, 1, 1)),)
                if summed_apart
                else ()
            ),
            _cuda.Step(token, (token_blocks, 1, 1), (_TOKEN_THREADS, 1, 1), token_smem),
            _cuda.Step(grad, (blocks, 1, 1), threads, grad_smem),
            _cuda.Step(reduce, (reduce_blocks, 1, 1), (_REDUCE_THREADS, 1, 1)),
        ), device, batch)  # fmt: skip
    plan = _PreBackwardPlan(
        steps=steps,
        fused=fused,
        stats_stages=stats_stages,
        grad_stages=grad_stages,
        k_splits=k_splits,
        token_splits=1 if fused or summed_apart else k_splits,
        grad_items=items,
        grad_blocks=blocks,
        slot_cap=slot_cap,
        segment=segment,
        scratch=(
            _PRE_BWD_COUNTER_WORDS,
            column_blocks * geometry.piece_words,
            k_splits * geometry.stats_row * batch,
            batch * geometry.coef_row,
            -(-batch * geometry.dh_row // 2),
            (q + 3) * batch,
            chunks * slot_cap * n * geometry.c_grad * q,
            0 if token_smem else slots * n * n * batch,
        ),
    )
    if len(_pre_backward_plans) > 4096:  # shapes churn (e.g. growing prefill chunks): start over
        _pre_backward_plans.clear()
    _pre_backward_plans[key] = plan
    return plan
