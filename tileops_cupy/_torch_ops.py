"""The torch layer: every op as a torch custom op (namespace ``tileops_cupy``) with a fake
implementation and, where the math has one, an autograd formula, so the ops compose with
autograd, ``torch.compile`` (``fullgraph=True``, dynamic shapes), ``torch.export`` and
CUDA graphs.

Nothing here imports torch at import time, and the NumPy, CuPy and JAX paths never reach
this module's torch code. The ops register once, the first time an op is built or called
while torch is imported. A call takes the dispatcher only when it must: autograd has to
record it, or a tracer (Dynamo, export, a dispatch mode, a tensor subclass) is watching.
Otherwise the public op calls its direct path, which costs a fraction of a dispatcher
round trip; in-place calls then bump the version counters themselves, as the dispatcher
would, so autograd still sees every write.

Each custom op carries its op's configuration by value (scheme name and numbers, layout,
rotary_dim, ...), so a traced or exported graph holds no Python object; its
implementation is the op's own direct path, rebuilt from that configuration once.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

NAMESPACE = "tileops_cupy"

# Schemas, one per data path. RoPE configurations travel as
#   seed ops:   scheme, scheme_args, rotary_dim (0 = head_dim), neox, inverse,
#               input_layout, max_position (0 = none), target ("" = none), flag
#   component:  scheme, scheme_args, rotary_dim, neox, head_dim, num_heads,
#               num_kv_heads, max_position (0 = none), target ("" = none), flag
# where flag keys the op's device error flag (_rotate.error_flag), so the op rebuilt
# behind the dispatcher raises its caller's flag.
_SEED_CONFIG = (
    "str scheme, float[] scheme_args, int rotary_dim, bool neox, bool inverse, "
    "str input_layout, int max_position, str target, int flag"
)
_COMPONENT_CONFIG = (
    "str scheme, float[] scheme_args, int rotary_dim, bool neox, int head_dim, "
    "int num_heads, int num_kv_heads, int max_position, str target, int flag"
)
_MHC_PRE_CONFIG = (
    "float alpha_pre, float alpha_post, float alpha_res, int sinkhorn_repeat, "
    "float sinkhorn_eps, str target"
)
SCHEMAS = {
    "rope": f"(Tensor x, Tensor? position_ids, {_SEED_CONFIG}) -> Tensor",
    "rope_qk": (
        f"(Tensor q, Tensor? k, Tensor? offsets, SymInt offset, bool inverse, bool decode, "
        f"{_COMPONENT_CONFIG}) -> (Tensor, Tensor)"
    ),
    "rope_qk_": (
        f"(Tensor(a!) q, Tensor(b!)? k, Tensor? offsets, SymInt offset, bool inverse, "
        f"bool decode, {_COMPONENT_CONFIG}) -> ()"
    ),
    "mhc_pre": f"(Tensor phi, Tensor x, Tensor b, {_MHC_PRE_CONFIG}) -> (Tensor, Tensor, Tensor)",
    "mhc_post": "(Tensor x_layer_out, Tensor h_post, Tensor x_res, str target) -> Tensor",
}

_registered = False
_lock = threading.Lock()


# --------------------------------------------------------------------------- routing

DISPATCH = "dispatch"


def classify(*args: Any) -> Any:
    """How a call on ``args`` runs: :data:`DISPATCH` when the torch dispatcher must see it
    (some argument is a torch tensor and autograd must record the call, or a tracer such as
    Dynamo, export or a dispatch mode watches it); otherwise :func:`layouts` of the
    arguments, for the direct path. One pass over the arguments: this runs on every call."""
    torch = sys.modules.get("torch")
    if torch is None:
        return (None,) * len(args)
    tensor = torch.Tensor
    tracing = torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
    if tracing and any(isinstance(arg, tensor) for arg in args):
        ensure_registered()
        return DISPATCH
    grad = torch.is_grad_enabled()
    keys = []
    for arg in args:
        if not isinstance(arg, tensor):
            keys.append(None)
        elif type(arg) is not tensor or (grad and arg.requires_grad):  # a subclass: FakeTensor..
            ensure_registered()
            return DISPATCH
        else:
            keys.append((arg.shape, arg.stride(), arg.dtype, arg.device, arg.data_ptr() & 15))
    return tuple(keys)


def is_compiling() -> bool:
    """True while Dynamo traces the caller."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def layouts(*args: Any) -> tuple:
    """Per argument, the layout key of a plain torch tensor (shape, strides, dtype, device,
    address mod 16), None for anything else. An op remembers, per key of its arguments, the
    launch its first call made; a later call with equal keys was validated and planned by
    that call and only patches addresses into the launch (:meth:`_cuda.Launch.relaunch`)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return (None,) * len(args)
    return tuple(
        (arg.shape, arg.stride(), arg.dtype, arg.device, arg.data_ptr() & 15)
        if type(arg) is torch.Tensor
        else None
        for arg in args
    )


def current_stream(device: int) -> int:
    """torch's current raw stream on ``device``."""
    return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)


def new_contiguous(tensor: Any) -> Any:
    """A fresh contiguous tensor of ``tensor``'s shape, dtype and device."""
    torch = sys.modules["torch"]
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def requires_grad(*tensors: Any) -> bool:
    """True when autograd would record an op on any of the (torch) ``tensors``."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def bump_versions(*tensors: Any) -> None:
    """Tell autograd that the direct path wrote into these (torch) tensors in place, so a
    tensor saved for backward before the write makes that backward raise."""
    torch = sys.modules.get("torch")
    if torch is not None:
        written = [t for t in tensors if isinstance(t, torch.Tensor)]
        if written:
            torch._C._increment_version(written)


def register_if_torch_imported() -> None:
    """Register now when torch is already imported (op constructors call this, so that a
    compiled function meets registered ops)."""
    if not _registered and "torch" in sys.modules:
        ensure_registered()


# --------------------------------------------------------------------------- the calls


def rope(config: tuple, x: Any, position_ids: Any) -> Any:
    import torch

    return torch.ops.tileops_cupy.rope(x, position_ids, *config)


def rope_qk(
    config: tuple, q: Any, k: Any, offsets: Any, offset: Any, inverse: bool, decode: bool
) -> Any:
    import torch

    return torch.ops.tileops_cupy.rope_qk(q, k, offsets, offset, inverse, decode, *config)


def rope_qk_(
    config: tuple, q: Any, k: Any, offsets: Any, offset: Any, inverse: bool, decode: bool
) -> None:
    import torch

    torch.ops.tileops_cupy.rope_qk_(q, k, offsets, offset, inverse, decode, *config)


def mhc_pre(config: tuple, phi: Any, x: Any, b: Any) -> Any:
    import torch

    return torch.ops.tileops_cupy.mhc_pre(phi, x, b, *config)


def mhc_post(target: str, x_layer_out: Any, h_post: Any, x_res: Any) -> Any:
    import torch

    return torch.ops.tileops_cupy.mhc_post(x_layer_out, h_post, x_res, target)


# --------------------------------------------------------------------------- implementations
# Each is the public op's direct path; the ops module rebuilds the op from its configuration.


def _rope_impl(x, position_ids, *config):
    from .rope import seed_op

    return seed_op(config).direct(x, position_ids)


def _rope_fake(x, position_ids, *config):
    return x.new_empty(x.shape)


def _rope_setup(ctx, inputs, output):
    ctx.position_ids, ctx.config = inputs[1], inputs[2:]


def _rope_backward(ctx, grad):
    # y = a R x  =>  dx = a R^T dy: the same op with the rotation inverted
    scheme, args, rotary_dim, neox, inverse, *rest = ctx.config
    flipped = (scheme, args, rotary_dim, neox, not inverse, *rest)
    return (rope(flipped, grad, ctx.position_ids), None, *(None,) * len(ctx.config))


def _rope_qk_impl(q, k, offsets, offset, inverse, decode, *config):
    from .rope import component

    position = _position(offsets, offset)
    q_out, k_out = component(config).rotated(q, k, position, inverse, decode)
    return q_out, (q.new_empty(0) if k_out is None else k_out)


def _rope_qk_fake(q, k, offsets, offset, inverse, decode, *config):
    return q.new_empty(q.shape), (q.new_empty(0) if k is None else k.new_empty(k.shape))


def _rope_qk_setup(ctx, inputs, output):
    q, k, offsets, offset, inverse, decode, *config = inputs
    ctx.has_k, ctx.offsets, ctx.offset, ctx.inverse, ctx.config = (
        k is not None, offsets, offset, inverse, tuple(config)
    )  # fmt: skip


def _rope_qk_backward(ctx, grad_q, grad_k):
    # the transpose rotation at the same positions; decode's T == 1 was checked forward
    grad_k = grad_k if ctx.has_k else None
    dq, dk = rope_qk(ctx.config, grad_q, grad_k, ctx.offsets, ctx.offset, not ctx.inverse, False)
    return (dq, dk if ctx.has_k else None, *(None,) * (4 + len(ctx.config)))


def _rope_qk__impl(q, k, offsets, offset, inverse, decode, *config):
    from .rope import component

    component(config).rotate_in_place(q, k, _position(offsets, offset), inverse, decode)


def _rope_qk__fake(q, k, offsets, offset, inverse, decode, *config):
    return None


def _position(offsets, offset):
    return offset if offsets is None else offsets


def _mhc_pre_impl(phi, x, b, *config):
    from .sequence_modeling import pre_op

    return pre_op(config).direct(phi, x, b)


def _mhc_pre_fake(phi, x, b, *config):
    from .sequence_modeling import streams_of

    n = streams_of(phi.shape[1])
    batch, width = x.shape
    return (
        x.new_empty((batch, width)),
        x.new_empty((batch, width // n)),
        phi.new_empty((batch, n)),
    )


def _mhc_post_impl(x_layer_out, h_post, x_res, target):
    from .sequence_modeling import post_op

    return post_op(target).direct(x_layer_out, h_post, x_res)


def _mhc_post_fake(x_layer_out, h_post, x_res, target):
    return x_res.new_empty(x_res.shape)


# --------------------------------------------------------------------------- registration

_IMPLEMENTATIONS = {
    "rope": (_rope_impl, _rope_fake, (), (_rope_backward, _rope_setup)),
    "rope_qk": (_rope_qk_impl, _rope_qk_fake, (), (_rope_qk_backward, _rope_qk_setup)),
    "rope_qk_": (_rope_qk__impl, _rope_qk__fake, ("q", "k"), None),
    "mhc_pre": (_mhc_pre_impl, _mhc_pre_fake, (), None),
    "mhc_post": (_mhc_post_impl, _mhc_post_fake, (), None),
}


def ensure_registered() -> None:
    """Register every custom op with torch (once per process)."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        import torch

        for name, (impl, fake, mutates, autograd) in _IMPLEMENTATIONS.items():
            op = torch.library.custom_op(
                f"{NAMESPACE}::{name}", impl, mutates_args=mutates, schema=SCHEMAS[name]
            )
            op.register_fake(fake)
            if autograd is not None:
                backward, setup_context = autograd
                op.register_autograd(backward, setup_context=setup_context)
        _registered = True
