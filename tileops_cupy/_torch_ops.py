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

Under a differentiating ``torch.func`` transform or forward-mode AD, which torch's
custom-op autograd does not serve, a call goes through its op's ``torch.autograd.Function``
instead (the same backward, a forward-mode derivative, a generated vmap rule;
:func:`differentiating`).

Each custom op carries its op's configuration by value (scheme name and numbers, layout,
rotary_dim, ...), so a traced or exported graph holds no Python object; its
implementation is the op's own direct path, rebuilt from that configuration once.
"""

from __future__ import annotations

import sys
from typing import Any

from ._arrays import described  # (imports neither torch nor CuPy)
from ._cache import ForkSafeLock

NAMESPACE = "tileops_cupy"

# Schemas, one per data path. RoPE configurations travel as
#   seed ops:   scheme, scheme_args, rotary_dim (0 = head_dim), neox, inverse,
#               input_layout, max_position (0 = none), target ("" = none), flag
#   component:  scheme, scheme_args, rotary_dim, neox, head_dim, num_heads,
#               num_kv_heads, max_position (0 = none), target ("" = none), flag,
#               mrope_section ([] = none), mrope_interleaved, norm_eps, norm_weight_offset
# where flag keys the op's device error flag (_rotate.configuration_flag: one per
# configuration, so layers built alike trace to one graph), so the op rebuilt behind the
# dispatcher raises its caller's flag. The component's calls take a position as
# offsets (a [B] tensor) or offset (an int), or per-token positions ([B, T] or [N], with
# offset 0; [3, ...] under MRoPE), optionally a caller's cos_sin_cache in place of the
# scheme's table, and the fused QK-RMSNorm's weights (None without the norm).
_SEED_CONFIG = (
    "str scheme, float[] scheme_args, int rotary_dim, bool neox, bool inverse, "
    "str input_layout, int max_position, str target, int flag"
)
_COMPONENT_CONFIG = (
    "str scheme, float[] scheme_args, int rotary_dim, bool neox, int head_dim, "
    "int num_heads, int num_kv_heads, int max_position, str target, int flag, "
    "int[] mrope_section, bool mrope_interleaved, float norm_eps, float norm_weight_offset"
)
_COMPONENT_CALL = (
    "Tensor? offsets, SymInt offset, Tensor? positions, Tensor? cos_sin_cache, bool inverse, "
    "bool decode, Tensor? q_norm_weight, Tensor? k_norm_weight"
)
_MHC_PRE_CONFIG = (
    "float alpha_pre, float alpha_post, float alpha_res, int sinkhorn_repeat, "
    "float sinkhorn_eps, str target"
)
SCHEMAS = {
    "rope": f"(Tensor x, Tensor? position_ids, {_SEED_CONFIG}) -> Tensor",
    "rope_qk": f"(Tensor q, Tensor? k, {_COMPONENT_CALL}, {_COMPONENT_CONFIG}) -> (Tensor, Tensor)",
    "rope_qk_": f"(Tensor(a!) q, Tensor(b!)? k, {_COMPONENT_CALL}, {_COMPONENT_CONFIG}) -> ()",
    "mhc_pre": f"(Tensor phi, Tensor x, Tensor b, {_MHC_PRE_CONFIG}) -> (Tensor, Tensor, Tensor)",
    "mhc_post": "(Tensor x_layer_out, Tensor h_post, Tensor x_res, str target) -> Tensor",
    "mhc_pre_bwd": (
        "(Tensor phi, Tensor x, Tensor b, Tensor grad_x_res, Tensor grad_x_layer, "
        f"Tensor grad_h_post, {_MHC_PRE_CONFIG}) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "mhc_post_bwd": (
        "(Tensor x_layer_out, Tensor h_post, Tensor x_res, Tensor grad_x_out, str target) "
        "-> (Tensor, Tensor)"
    ),
}


def _tensor_arguments(schema: str) -> tuple[tuple[int, str], ...]:
    """(index, name) of each Tensor argument of ``schema``, named as the public calls name
    it for their errors."""
    public = {"offsets": "position_offset"}
    arguments = schema[1 : schema.index(") ->")].split(", ")
    named = ((index, argument.rsplit(" ", 1)[1]) for index, argument in enumerate(arguments))
    return tuple(
        (index, public.get(name, name))
        for index, name in named
        if arguments[index].startswith("Tensor")
    )


_TENSOR_ARGUMENTS = {name: _tensor_arguments(schema) for name, schema in SCHEMAS.items()}

_registered = False
_lock = ForkSafeLock()
_guards: Any = None  # the library holding rope_qk_'s autograd kernels (alive while it is)


# --------------------------------------------------------------------------- routing

DISPATCH = "dispatch"
# The layout key of an argument that is neither a plain torch tensor nor None nor an int (a
# NumPy or CuPy array, a list, a tensor subclass outside the dispatcher): equal to no key a
# launch is recorded under, and unlike an absent argument's None, so that a call passing
# one where the recorded call passed nothing takes the validated path.
FOREIGN = "not a plain torch tensor"


def is_torch_key(key: Any) -> bool:
    """Whether ``key`` (of :func:`layouts`) is a plain torch tensor's."""
    return type(key) is tuple


def all_torch(keys: tuple) -> bool:
    """Whether every one of ``keys`` is a plain torch tensor's: what a recorded launch
    needs, since it re-runs with the arguments' addresses alone."""
    return all(map(is_torch_key, keys))


# torch's per-call entry points, bound once torch is imported: attribute chains such as
# torch._C._len_torch_dispatch_stack cost a visible share of a decode call
_Tensor: Any = None
_Parameter: Any = None
_is_compiling: Any = None
_dispatch_depth: Any = None
_profiling: Any = None
_grad_enabled: Any = None
_increment_version: Any = None
_raw_stream: Any = None
_empty_like: Any = None
_contiguous_format: Any = None
_functorch_active: Any = None
_interpreter_stack: Any = None
_differentiating_transforms: Any = None
_forward_ad: Any = None
_jit_tracing: Any = None
_functorch_wrapped: Any = None
_functorch_unwrapped: Any = None
_has_storage: Any = None
_inference_mode: Any = None


def _bind(torch: Any) -> None:
    global _Tensor, _Parameter, _is_compiling, _dispatch_depth, _profiling, _grad_enabled
    global _increment_version, _raw_stream, _empty_like, _contiguous_format
    global _functorch_active, _interpreter_stack, _differentiating_transforms, _forward_ad
    global _jit_tracing, _functorch_wrapped, _functorch_unwrapped, _has_storage, _inference_mode
    _is_compiling, _dispatch_depth = torch.compiler.is_compiling, torch._C._len_torch_dispatch_stack
    _profiling, _jit_tracing = torch._C._autograd._profiler_enabled, torch._C._is_tracing
    _functorch_active = torch._C._are_functorch_transforms_active
    _interpreter_stack = torch._C._functorch.get_interpreter_stack
    _functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    _functorch_unwrapped = torch._C._functorch.get_unwrapped
    _has_storage = torch._C._has_storage
    _inference_mode = torch.is_inference_mode_enabled
    transform = torch._C._functorch.TransformType
    _differentiating_transforms = frozenset((transform.Grad, transform.Jvp))
    _forward_ad = torch.autograd.forward_ad  # (its _current_level: -1 outside a dual_level)
    _grad_enabled, _increment_version = torch.is_grad_enabled, torch._C._increment_version
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds only
    _empty_like, _contiguous_format = torch.empty_like, torch.contiguous_format
    _Parameter = torch.nn.Parameter  # a plain tensor's memory (norm weights are parameters)
    _Tensor = torch.Tensor  # last: the others are bound once this is


def _torch_bound() -> bool:
    if _Tensor is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        _bind(torch)
    return True


def classify(*args: Any) -> Any:
    """How a call on ``args`` runs: :data:`DISPATCH` when the torch dispatcher must see it
    (some argument is a torch tensor and autograd must record the call, or a tracer such as
    Dynamo, export, ``torch.jit.trace`` (which would record the direct path's output as a
    constant), a dispatch mode or a tensor subclass watches it, or a ``torch.func``
    transform or forward-mode AD is active (:func:`transformed`), or the torch profiler
    records, which then shows each call as its op, or the tensors are all on meta, for
    their fake implementations); otherwise :func:`layouts` of the arguments, for the direct
    path. One pass: this runs every call."""
    if not _torch_bound():
        return (None,) * len(args), [0] * len(args)
    if _watched() and any(isinstance(arg, _Tensor) for arg in args):
        ensure_registered()
        return DISPATCH
    return _layouts(args, _grad_enabled())


def _watched() -> bool:
    """True while something besides eager autograd must see each call through the
    dispatcher: Dynamo, a dispatch mode (export, fake tensors), the profiler,
    ``torch.jit.trace``, or a ``torch.func`` transform or forward-mode AD (the last two are
    :func:`transformed`'s test, inlined: a call of it costs ~40 ns). Torch bound."""
    return bool(
        _is_compiling() or _dispatch_depth() or _profiling() or _jit_tracing()
        or _functorch_active() or _forward_ad._current_level >= 0
    )  # fmt: skip


def is_compiling() -> bool:
    """True while Dynamo traces the caller."""
    return _torch_bound() and _is_compiling()


def transformed() -> bool:
    """True while a ``torch.func`` transform (grad, vjp, jacrev, jvp, vmap, functionalize,
    ...) or forward-mode AD (``torch.autograd.forward_ad.dual_level``) is active: calls then
    take the dispatcher (the transforms' tensors are wrappers), and in-place calls are
    recorded as a rotated copy and ``copy_``, which every transform supports."""
    return _torch_bound() and (_functorch_active() or _forward_ad._current_level >= 0)


def differentiating() -> bool:
    """True while forward-mode AD or a ``torch.func`` transform that differentiates (grad,
    vjp, jacrev, jvp, jacfwd, hessian; at any depth of the transform stack) is active.
    torch's custom-op autograd serves neither (the transforms raise in it; dual tensors'
    tangents are dropped), so calls then take the op's ``torch.autograd.Function``
    (:func:`_call`), which has a ``setup_context``, a vmap rule and a forward-mode
    derivative. The other transforms (vmap, functionalize) take the custom op itself: torch
    functionalizes no autograd.Function."""
    if not _torch_bound():
        return False
    if _forward_ad._current_level >= 0:
        return True
    return _functorch_active() and any(
        layer.key() in _differentiating_transforms for layer in _interpreter_stack()
    )


def memory_of(tensor: Any) -> Any:
    """The torch tensor whose memory ``tensor`` addresses: itself, or the one that a
    ``torch.func`` transform's wrappers (grad tracking, a vmap batch) hold; None where no
    memory can be described (Dynamo's fake tensors, a wrapper without storage inside) or
    ``tensor`` is no torch tensor (which the dispatcher then names)."""
    if is_compiling() or not isinstance(tensor, _Tensor):
        return None
    while _functorch_wrapped(tensor):
        tensor = _functorch_unwrapped(tensor)
    return tensor if _has_storage(tensor) else None


def outside_transforms() -> Any:
    """A context in which ``torch.func`` transforms see no op: reading :func:`memory_of`'s
    tensors there (``detach``, ``numpy``) gives plain tensors, not new wrappers."""
    import torch

    return torch._C._DisableFuncTorch()


def layouts(*args: Any) -> tuple[tuple, list[int]]:
    """``(keys, addresses)``: per argument, the layout key of a plain torch tensor (shape,
    True if contiguous else its strides (and negative bit where the last stride is not 1),
    dtype, device, address mod 16; a key equal to no other for a sparse or nested tensor),
    None for None or an int, :data:`FOREIGN` for anything else; and its address (0 but for
    a tensor).
    Contiguity stands for the strides because it costs a third of reading them on every
    call; two contiguous tensors of one shape differ at most in the strides of dimensions
    of size 1 (or of an empty tensor), which address no element but the first, so a launch
    planned for one serves the other.

    An op remembers, per keys of its arguments, the launch its first call made; a later
    call with equal keys was validated and planned by that call and only patches the
    addresses into the launch (:meth:`_cuda.Launch.relaunch`)."""
    if not _torch_bound():
        return (None,) * len(args), [0] * len(args)
    return _layouts(args, None)


def _layouts(args: tuple, grad: bool | None) -> Any:
    """:func:`layouts` of ``args``; with ``grad`` not None (grad mode on or off), instead
    :data:`DISPATCH` at the first argument that autograd would record or that is a tensor
    subclass (:func:`classify`)."""
    tensor = _Tensor
    keys, pointers = [], []
    on_meta = 0  # tensors on the meta device
    for arg in args:
        kind = type(arg)
        if kind is tensor or kind is _Parameter:
            try:
                pointer = arg.data_ptr()
                strides = arg.is_contiguous() or arg.stride()
                if strides is not True and strides[-1:] != (1,):
                    # a negative view's elements are minus its memory's, and validation
                    # refuses it: z.conj().imag, every other float of z's memory (with a
                    # unit last stride, only torch's private _neg_view makes one)
                    strides = (strides, arg.is_neg())
                key = (arg.shape, strides, arg.dtype, arg.device, pointer & 15)
            except RuntimeError:  # not one block of strided memory (sparse, nested): a key
                pointer, key = 0, object()  # equal to none, so validation names the argument
            else:  # (such a tensor stays on the direct path even if it requires grad: the
                # dispatcher has no kernel for its layout, the direct path names it)
                if grad and arg.requires_grad:
                    ensure_registered()
                    return DISPATCH
            if not pointer and arg.is_meta:  # (tested only at address 0: meta, or empty)
                on_meta += 1
            keys.append(key)
            pointers.append(pointer)
        elif arg is None or kind is int:  # (isinstance on torch.Tensor is slow for these)
            keys.append(None)
            pointers.append(0)
        elif grad is not None and isinstance(arg, tensor):  # a subclass: FakeTensor, ...
            ensure_registered()
            return DISPATCH
        else:
            keys.append(FOREIGN)
            pointers.append(0)
    if on_meta and grad is not None and on_meta == sum(isinstance(a, tensor) for a in args):
        ensure_registered()  # every tensor on meta: shapes alone, from the fake implementations
        return DISPATCH  # (some on meta, some not: the direct path names the one on meta)
    return tuple(keys), pointers


def current_stream(device: int) -> int:
    """torch's current raw stream on ``device``."""
    return _raw_stream(device)


def shape_template(tensor: Any, shape: tuple[int, ...]) -> Any:
    """A tensor of ``shape`` with ``tensor``'s dtype and device over at most one element:
    ``torch.empty_like`` of it is a fresh contiguous tensor, and costs less than
    ``new_empty(shape)`` (no shape to parse: a visible share of a decode step). Stride 0
    along every dimension longer than 1 makes its elements overlap, which empty_like
    answers with contiguous strides (a one-element shape gets torch's own)."""
    if 0 in shape:
        return tensor.new_empty(shape)
    return tensor.new_empty_strided(shape, tuple(0 if size > 1 else 1 for size in shape))


def new_contiguous(tensor: Any) -> Any:
    """A fresh contiguous tensor of ``tensor``'s shape, dtype and device."""
    return _empty_like(tensor, memory_format=_contiguous_format)


def requires_grad(*tensors: Any) -> bool:
    """True when autograd would record an op on any of the (torch) ``tensors``."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def differentiated(tensor: Any) -> bool:
    """True when autograd (grad mode on, ``tensor`` requires grad) or forward-mode AD (a
    tangent on ``tensor``) would carry a derivative with this torch ``tensor``."""
    if not isinstance(tensor, _Tensor):
        return False
    if tensor.requires_grad and _grad_enabled():
        return True
    return _forward_ad._current_level >= 0 and _forward_ad.unpack_dual(tensor).tangent is not None


def inference_writes_refused(q: Any, k: Any = None) -> bool:
    """True when torch tensor ``q`` or ``k`` (k may be None) is an inference tensor (made
    under ``torch.inference_mode``) while inference mode is off: torch refuses to write one
    in place there, and so does every in-place call of this package, before writing
    anything (the validated path's check and the in-place relaunch's). The mode is read
    first: under it, what serving runs in, no tensor is asked."""
    if _inference_mode is None:
        _torch_bound()
    if _inference_mode():
        return False
    return q.is_inference() or (k is not None and k.is_inference())


def inference_write_message(name: str) -> str:
    """The ValueError text for :func:`inference_writes_refused` of ``name``."""
    return (
        f"{name} is an inference tensor (made under torch.inference_mode) and this call "
        "writes into it in place outside inference mode, which torch forbids; call it under "
        f"torch.inference_mode(), or pass {name}.clone()"
    )


def bump_torch_versions(tensors: tuple) -> None:
    """:func:`bump_versions` for tensors known to be plain torch tensors."""
    _increment_version(tensors)


def bump_versions(*tensors: Any) -> None:
    """Tell autograd that the direct path wrote into these (torch) tensors in place, so a
    tensor saved for backward before the write makes that backward raise."""
    if _torch_bound():
        written = [t for t in tensors if isinstance(t, _Tensor)]
        if written:
            _increment_version(written)


def register_if_torch_imported() -> None:
    """Bind torch's entry points and register the ops now when torch is already imported
    (op constructors call this): a function compiled before any eager call then meets them
    ready, instead of guarding on their lazy first use (which the next call would fail: a
    recompile)."""
    if sys.modules.get("torch") is not None:
        _torch_bound()
        if not _registered:
            ensure_registered()


# --------------------------------------------------------------------------- the calls


def _require_tensors(name: str, arguments: tuple) -> None:
    """TypeError naming the first of op ``name``'s tensor arguments that holds something
    else (a NumPy or CuPy array, a list): the direct path takes any framework's arrays, but
    the dispatcher takes torch tensors only, and its own error names a schema type."""
    for index, argument in _TENSOR_ARGUMENTS[name]:
        require_tensor(argument, arguments[index])


def require_tensor(argument: str, value: Any) -> None:
    """:func:`_require_tensors` of one argument (None passes), for callers that read a
    tensor's attributes before the op's own check."""
    if value is not None and not isinstance(value, _Tensor):
        kind = type(value)
        raise TypeError(
            f"{argument} must be a torch tensor, got {kind.__module__}.{kind.__qualname__}: "
            "this call goes through torch's dispatcher (a torch argument requires grad, "
            "or a tracer or transform watches), which takes torch tensors only; "
            "torch.from_numpy or torch.from_dlpack give one without a copy"
        )


def _call(name: str, arguments: tuple, config: tuple) -> Any:
    """The custom op ``name`` on the call's ``arguments`` then its ``config``; under a
    differentiating ``torch.func`` transform or forward-mode AD (:func:`differentiating`),
    and for eager autograd (:func:`_recorded_eagerly`), through its
    ``torch.autograd.Function``, which takes the configuration as one opaque
    :class:`_Configuration` and runs the op inside, where nothing records it."""
    _require_tensors(name, arguments)
    if name in _FUNCTIONS and (_recorded_eagerly(arguments) or differentiating()):
        return _FUNCTIONS[name].apply(*arguments, _Configuration(config))
    import torch

    return getattr(torch.ops.tileops_cupy, name)(*arguments, *config)


def _recorded_eagerly(arguments: tuple) -> bool:
    """True when eager autograd records this call: grad mode on, a tensor argument that
    requires grad, and no tracer, dispatch mode, transform or profiler watching. The op's
    autograd.Function then records it, with the same backward and context as the custom
    op's registered formula, which costs more per call: torch's custom-op autograd rebuilds
    the schema's argument list once per argument (``torch._library.utils.fill_defaults``,
    quadratic in the ~24 arguments: about 140 us a call on a CI-sized host). Traced
    graphs keep the custom op and its formula."""
    if not _grad_enabled() or not any(
        isinstance(a, _Tensor) and a.requires_grad for a in arguments
    ):
        return False
    return not _watched()


class _Configuration:
    """An op's configuration as one argument of its autograd.Function. torch's generated
    vmap rules take a list or tuple argument for a tree of inputs and fail on it under
    ``torch.func.hessian`` ("flat_bdims must not be None"), and the configurations hold
    lists (scheme arguments, MRoPE sections): so the configuration travels opaque."""

    __slots__ = ("values",)

    def __init__(self, values: tuple) -> None:
        self.values = tuple(values)


def rope(config: tuple, x: Any, position_ids: Any) -> Any:
    return _call("rope", (x, position_ids), config)


def rope_qk(config: tuple, *arguments: Any, in_place: bool = False) -> Any:
    """The component's op on ``(q, k, offsets, offset, positions, cos_sin_cache, inverse,
    decode, q_norm_weight, k_norm_weight)``: rotated copies of q and k (``rope_qk``), or the
    rotation in place (``rope_qk_``, which autograd and the transforms never see: the
    caller records in-place calls as a rotated copy and ``copy_``)."""
    if in_place:
        import torch

        _require_tensors("rope_qk_", arguments)
        return torch.ops.tileops_cupy.rope_qk_(*arguments, *config)
    return _call("rope_qk", arguments, config)


def mhc_pre(config: tuple, phi: Any, x: Any, b: Any) -> Any:
    return _call("mhc_pre", (phi, x, b), config)


def mhc_post(target: str, x_layer_out: Any, h_post: Any, x_res: Any) -> Any:
    return _call("mhc_post", (x_layer_out, h_post, x_res), (target,))


def mhc_pre_bwd(config: tuple, *tensors: Any) -> Any:
    return _call("mhc_pre_bwd", tensors, config)


def mhc_post_bwd(target: str, *tensors: Any) -> Any:
    """``(grad_x_layer_out, grad_h_post, grad_x_res)``: the op computes the first two;
    grad_x_res is grad_x_out itself (a custom op may not return its input)."""
    grad_layer, grad_gates = _call("mhc_post_bwd", tensors, (target,))
    return grad_layer, grad_gates, tensors[-1]


# --------------------------------------------------------------------------- implementations
# Each is the public op's direct path; the ops module rebuilds the op from its configuration.


def _save(ctx, *tensors):
    """Keep ``tensors`` for the backward and for the jvp alike (one set, so that torch's
    generated vmap rules, which track one set of saved tensors, see the same in both)."""
    ctx.save_for_backward(*tensors)
    ctx.save_for_forward(*tensors)


def _rope_impl(x, position_ids, *config):
    from .rope import seed_op

    return seed_op(config).direct(x, position_ids)


def _rope_fake(x, position_ids, *config):
    # the direct path's checks that need no memory: a traced call (or one on meta tensors)
    # refuses what an eager one does, with the same error
    from .rope import seed_op

    seed_op(config).checked_rows(
        described(x), None if position_ids is None else described(position_ids)
    )
    return x.new_empty(x.shape)


def _rope_setup(ctx, inputs, output):
    # the positions saved as tensors, not kept as attributes: autograd then refuses a
    # backward after the caller changed them in place (a reused positions buffer), where
    # the gradient would otherwise be taken at the new positions
    _save(ctx, inputs[1])
    ctx.config = inputs[2:]


def _rope_backward(ctx, grad):
    # y = a R x  =>  dx = a R^T dy: the same op with the rotation inverted
    scheme, args, rotary_dim, neox, inverse, *rest = ctx.config
    flipped = (scheme, args, rotary_dim, neox, not inverse, *rest)
    (position_ids,) = ctx.saved_tensors
    return (rope(flipped, grad, position_ids), None, *(None,) * len(ctx.config))


def _rope_qk_impl(
    q, k, offsets, offset, positions, cache, inverse, decode, q_weight, k_weight, *config
):
    from .rope import component

    position = _position(offsets, offset)
    q_out, k_out = component(config).rotated(
        q, k, position, inverse, decode, ids=positions, cache=cache, q_norm_weight=q_weight,
        k_norm_weight=k_weight,
    )  # fmt: skip
    return q_out, (q.new_empty(0) if k_out is None else k_out)


def _rope_qk_fake(q, k, *arguments_and_config):
    _check_rope_qk(q, k, *arguments_and_config, in_place=False)
    return q.new_empty(q.shape), (q.new_empty(0) if k is None else k.new_empty(k.shape))


def _check_rope_qk(
    q, k, offsets, offset, positions, cache, inverse, decode, q_weight, k_weight, *config,
    in_place,
):  # fmt: skip
    """The component's checks that need no memory (``RoPE._checked``) on the arguments of
    rope_qk or rope_qk_: a traced call (or one on meta tensors) refuses what an eager one
    does, with the same error."""
    from .rope import component

    def described_or_none(tensor):
        return None if tensor is None else described(tensor)

    position = offset if offsets is None else described(offsets)
    weights = (described_or_none(q_weight), described_or_none(k_weight))
    component(config)._checked(
        described(q), described_or_none(k), position, inverse, decode, in_place,
        described_or_none(positions), weights, described_or_none(cache),
    )  # fmt: skip


def _rope_qk_setup(ctx, inputs, output):
    q, k, offsets, offset, positions, cache, inverse, decode, q_weight, k_weight, *config = inputs
    ctx.has_k, ctx.offset, ctx.inverse, ctx.config = k is not None, offset, inverse, tuple(config)
    ctx.normed = q_weight is not None
    # the positions and the cache saved as tensors (see _rope_setup); the norm's backward
    # reads the inputs too
    normed = (q, k, q_weight, k_weight) if ctx.normed else (None,) * 4
    _save(ctx, offsets, positions, cache, *normed)


def _rope_qk_backward(ctx, grad_q, grad_k):
    # the transpose rotation at the same positions (of the same cos_sin_cache, if any: the
    # transpose, sin negated, whatever the cache holds); decode's T == 1 was checked forward
    grad_k = grad_k if ctx.has_k else None
    offsets, positions, cache, q, k, q_weight, k_weight = ctx.saved_tensors
    dq, dk = rope_qk(
        ctx.config, grad_q, grad_k, offsets, ctx.offset, positions, cache, not ctx.inverse,
        False, None, None,
    )  # fmt: skip
    dk = dk if ctx.has_k else None
    dq_weight = dk_weight = None
    if ctx.normed:  # then through the norm, to the data and the weights
        head_dim, eps, offset = ctx.config[4], *ctx.config[-2:]
        dq, dq_weight = _rms_norm_backward(q, q_weight, dq, head_dim, eps, offset)
        if ctx.has_k:
            dk, dk_weight = _rms_norm_backward(k, k_weight, dk, head_dim, eps, offset)
    no_grads = (None,) * 6  # offsets, offset, positions, cache, inverse, decode
    return (dq, dk, *no_grads, dq_weight, dk_weight, *(None,) * len(ctx.config))


def _rms_norm_backward(x, weight, grad, head_dim, eps, offset):
    """Gradients of ``n = x / sqrt(mean(x**2) + eps) * (weight + offset)`` per head row of
    ``x`` (``[..., heads*head_dim]`` or ``[..., heads, head_dim]``) for the gradient ``grad``
    of n: ``(grad_x, grad_weight)``, in float32 (float64 for float64 data)."""
    compute, inverse_rms, normed = _normed_rows(x, head_dim, eps)
    grad_rows = _head_rows(grad.to(compute), head_dim)
    weighted = grad_rows * (weight.to(compute) + offset)
    grad_x = inverse_rms * (weighted - normed * (weighted * normed).mean(-1, keepdim=True))
    grad_weight = (grad_rows * normed).reshape(-1, head_dim).sum(0)
    return grad_x.reshape(x.shape).to(x.dtype), grad_weight.to(weight.dtype)


def _normed_rows(x, head_dim, eps):
    """``(compute, inverse_rms, normed)`` of the norm's head rows of ``x``: the dtype it
    computes in (float32; float64 for float64 data), ``1 / sqrt(mean(x**2) + eps)`` per row
    and the rows times it, as ``[..., heads, head_dim]``."""
    import torch

    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = _head_rows(x.to(compute), head_dim)
    inverse_rms = torch.rsqrt(rows.square().mean(-1, keepdim=True) + eps)
    return compute, inverse_rms, rows * inverse_rms


def _head_rows(x, head_dim):
    """``x`` (``[..., heads*head_dim]`` or ``[..., heads, head_dim]``) as ``[..., heads,
    head_dim]`` rows (reshape, which every vmap has a rule for, unlike unflatten)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def _rope_qk__impl(
    q, k, offsets, offset, positions, cache, inverse, decode, q_weight, k_weight, *config
):
    from .rope import component

    position = _position(offsets, offset)
    component(config).rotate_in_place(
        q, k, position, inverse, decode, ids=positions, cache=cache, q_norm_weight=q_weight,
        k_norm_weight=k_weight,
    )  # fmt: skip


def _rope_qk__fake(q, k, *arguments_and_config):
    _check_rope_qk(q, k, *arguments_and_config, in_place=True)


def _rope_qk__autograd(*arguments):
    """rope_qk_'s autograd kernel. The op has no gradient formula (the public in-place calls
    never let autograd see it: they record a rotated copy and ``copy_``), and torch's
    default kernel for a custom op that returns nothing attaches nothing, so gradients would
    pass it as the identity: a graph traced or exported without grad, replayed on tensors
    that require it, would reach that. So it refuses, before any write."""
    q, k, q_weight, k_weight = arguments[0], arguments[1], arguments[8], arguments[9]
    tracked = (q, k, q_weight, k_weight)
    if _grad_enabled() and any(t is not None and t.requires_grad for t in tracked):
        raise RuntimeError(
            "tileops_cupy::rope_qk_ (the in-place rotation) got tensors that require grad "
            "with grad mode on: it has no gradient formula, so autograd cannot record it. "
            "The public in-place calls record such calls as a rotated copy; a graph traced "
            "or exported without grad holds the raw op: trace or export with grad on, or "
            "call apply_rope"
        )
    import torch

    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.tileops_cupy.rope_qk_.default(*arguments)


def _position(offsets, offset):
    return offset if offsets is None else offsets


def _mhc_pre_impl(phi, x, b, *config):
    from .sequence_modeling import rebuilt_op

    return rebuilt_op("MHCPreFwdOp", config).direct(phi, x, b)


def _mhc_pre_fake(phi, x, b, *config):
    # the direct path's validation on the shapes and dtypes: a traced call (or one on meta
    # tensors) refuses what an eager one does, with the same error
    from .sequence_modeling import _check_pre

    _check_pre(described(phi), described(x), described(b))
    return _mhc_pre_outputs(phi, x)


def _mhc_pre_outputs(phi, x):
    """Empty ``(x_res, x_layer, h_post)`` of mHC pre on validated ``phi`` and ``x``."""
    from .sequence_modeling import streams_of

    n = streams_of(phi.shape[1])
    batch, width = x.shape
    return (
        x.new_empty((batch, width)),
        x.new_empty((batch, width // n)),
        phi.new_empty((batch, n)),
    )


def _mhc_pre_setup(ctx, inputs, output):
    phi, x, b, *config = inputs
    _save(ctx, phi, x, b)
    ctx.config = tuple(config)


def _mhc_pre_backward(ctx, grad_x_res, grad_x_layer, grad_h_post):
    # an output autograd did not reach has no gradient: zeros of its layout
    phi, x, b = ctx.saved_tensors
    outputs = _mhc_pre_outputs(phi, x)  # (the forward validated them)
    upstream = [
        output.zero_() if grad is None else grad.contiguous()
        for grad, output in zip((grad_x_res, grad_x_layer, grad_h_post), outputs, strict=True)
    ]
    grad_phi, grad_x, grad_b, _ = mhc_pre_bwd(ctx.config, phi, x, b, *upstream)
    return (grad_phi, grad_x, grad_b, *(None,) * len(ctx.config))


def _mhc_post_impl(x_layer_out, h_post, x_res, target):
    from .sequence_modeling import rebuilt_op

    return rebuilt_op("MHCPostFwdOp", (target,)).direct(x_layer_out, h_post, x_res)


def _mhc_post_fake(x_layer_out, h_post, x_res, target):
    from .sequence_modeling import _check_post

    _check_post(described(x_layer_out), described(h_post), described(x_res))
    return x_res.new_empty(x_res.shape)


def _mhc_post_setup(ctx, inputs, output):
    *tensors, ctx.target = inputs
    _save(ctx, *tensors)


def _mhc_post_backward(ctx, grad_x_out):
    grads = mhc_post_bwd(ctx.target, *ctx.saved_tensors, grad_x_out.contiguous())
    return (*grads, None)


def _mhc_pre_bwd_impl(phi, x, b, grad_x_res, grad_x_layer, grad_h_post, *config):
    from .sequence_modeling import rebuilt_op

    upstream = (grad_x_res, grad_x_layer, grad_h_post)
    return rebuilt_op("MHCPreBwdOp", config).direct(phi, x, b, *upstream)


def _mhc_pre_bwd_fake(phi, x, b, grad_x_res, grad_x_layer, grad_h_post, *config):
    from .sequence_modeling import _check_pre_backward

    tensors = (phi, x, b, grad_x_res, grad_x_layer, grad_h_post)
    _check_pre_backward(*(described(tensor) for tensor in tensors))
    return phi.new_empty(phi.shape), x.new_empty(x.shape), b.new_empty(b.shape), b.new_empty(3)


def _mhc_post_bwd_impl(x_layer_out, h_post, x_res, grad_x_out, target):
    from .sequence_modeling import rebuilt_op

    op = rebuilt_op("MHCPostBwdOp", (target,))
    return op.direct(x_layer_out, h_post, x_res, grad_x_out)[:2]


def _mhc_post_bwd_fake(x_layer_out, h_post, x_res, grad_x_out, target):
    from .sequence_modeling import _check_post_backward

    _check_post_backward(*(described(t) for t in (x_layer_out, h_post, x_res, grad_x_out)))
    return x_layer_out.new_empty(x_layer_out.shape), h_post.new_empty(h_post.shape)


def _no_second_order(op_name: str, forward_name: str) -> tuple:
    """The autograd formula of a backward op (mhc_pre_bwd, mhc_post_bwd): once
    differentiable, as ``torch.autograd.function.once_differentiable``, with an error that
    says so. A gradient taken with ``create_graph=True`` is right; backpropagating through
    it raises instead of returning a silently wrong (or zero) second-order gradient."""

    def backward(ctx, *grads):
        raise RuntimeError(
            f"{op_name} (the gradient of {forward_name}) has no derivative: second-order "
            f"gradients through {forward_name} are not supported (a gradient taken with "
            "create_graph=True cannot be backpropagated again); take first-order gradients "
            "only, or differentiate the float64 torch reference for higher orders"
        )

    def setup_context(ctx, inputs, output):
        pass

    return backward, setup_context


# --------------------------------------------------------------------------- forward mode
# The tangents of the ops' outputs, for their autograd.Functions (differentiating()). The
# RoPE ops are linear in the data, so a tangent rotates as the data does (after the fused
# norm's derivative, when there is one); mHC post is bilinear; mHC pre (Sinkhorn) and the
# backward ops have no forward-mode derivative and say so.


def _rope_jvp(ctx, x_tangent, *_):
    (position_ids,) = ctx.saved_tensors
    return rope(ctx.config, x_tangent, position_ids)


def _rope_qk_jvp(ctx, q_tangent, k_tangent, *tangents):
    # (tensors without a tangent come as zeros; k None comes as None)
    offsets, positions, cache, q, k, q_weight, k_weight = ctx.saved_tensors
    if ctx.normed:
        q_weight_tangent, k_weight_tangent = tangents[6:8]
        head_dim, eps, offset = ctx.config[4], *ctx.config[-2:]
        norm = (head_dim, eps, offset)
        q_tangent = _rms_norm_jvp(q, q_weight, q_tangent, q_weight_tangent, *norm)
        if ctx.has_k:
            k_tangent = _rms_norm_jvp(k, k_weight, k_tangent, k_weight_tangent, *norm)
    return rope_qk(
        ctx.config, q_tangent, k_tangent, offsets, ctx.offset, positions, cache, ctx.inverse,
        False, None, None,
    )  # fmt: skip


def _rms_norm_jvp(x, weight, x_tangent, weight_tangent, head_dim, eps, offset):
    """The tangent of ``n = x / sqrt(mean(x**2) + eps) * (weight + offset)`` per head row
    (:func:`_rms_norm_backward`'s forward) for tangents of x and weight, in x's dtype."""
    compute, inverse_rms, normed = _normed_rows(x, head_dim, eps)
    rows_tangent = _head_rows(x_tangent.to(compute), head_dim)
    normed_tangent = inverse_rms * (rows_tangent - normed * (normed * rows_tangent).mean(-1, True))
    tangent = normed_tangent * (weight.to(compute) + offset) + normed * weight_tangent.to(compute)
    return tangent.reshape(x.shape).to(x.dtype)


def _mhc_post_jvp(ctx, layer_tangent, gates_tangent, res_tangent, _target):
    # x_out = h_post (x) x_layer_out + x_res
    import torch

    layer, gates, res = ctx.saved_tensors
    tangent = mhc_post(ctx.target, layer_tangent, gates, res_tangent)
    return tangent + mhc_post(ctx.target, layer, gates_tangent, torch.zeros_like(res))


def _no_forward_mode(op_name: str) -> Any:
    def jvp(ctx, *tangents):
        raise RuntimeError(
            f"{op_name} has no forward-mode derivative (torch.func.jvp, torch.func.jacfwd, "
            "torch.autograd.forward_ad); take its gradients in reverse mode (backward(), "
            "torch.autograd.grad, torch.func.grad, vjp or jacrev)"
        )

    return jvp


# --------------------------------------------------------------------------- vmap
# torch.vmap of an op (also what torch.func's per-sample gradients run). Where each output
# element depends only on its own row (the RoPE seed ops' rotation, mHC post), the vmapped
# dimension joins the rows' leading dimension and the op runs once: the same bits as a loop,
# since no row's arithmetic can see the others. Every other op runs once per slice, as
# torch's fallback would (without its "performance drop" warning): its plans and sums
# depend on the batch (mHC pre's K splits and its host matmul, the backward ops' batch-wide
# grad_phi, the fused norm's lane layouts), so joined rows could round differently from
# a loop of the same calls.

_SEED_FIELDS = tuple(field.split()[-1] for field in _SEED_CONFIG.split(", "))


def _leading(argument: Any, dim: int | None, size: int) -> Any:
    """``argument`` with its vmapped dimension first (an unbatched one expanded to it)."""
    return argument.movedim(dim, 0) if dim is not None else argument.expand(size, *argument.shape)


def _joined(argument: Any, dim: int | None, size: int) -> Any:
    """``argument``'s vmapped dimension merged into its first: [size * rows, ...]."""
    return _leading(argument, dim, size).flatten(0, 1)


def _split(size: int) -> Any:
    """What makes a joined call's results [size, rows, ...] again."""

    def split(results):
        if isinstance(results, tuple):
            return tuple(r.unflatten(0, (size, -1)) for r in results)
        return results.unflatten(0, (size, -1))

    return split


def _fold_rows(rows: int) -> Any:
    """The fold of an op whose first ``rows`` arguments are per-row tensors [rows, ...] and
    whose outputs are all per-row."""

    def fold(size, in_dims, arguments):
        pairs = zip(arguments[:rows], in_dims[:rows], strict=True)
        joined = [_joined(a, d, size) for a, d in pairs]
        return (*joined, *arguments[rows:]), _split(size)

    return fold


def _fold_rope(size, in_dims, arguments):
    x, position_ids, *config = arguments
    if position_ids is not None:  # [tokens, heads, head_dim] at ids [tokens]
        joined_ids = _joined(position_ids, in_dims[1], size)
        return (_joined(x, in_dims[0], size), joined_ids, *config), _split(size)
    layout = _SEED_FIELDS.index("input_layout")
    if config[layout] == "2d":  # [batch, seq, heads, head_dim]
        return (_joined(x, in_dims[0], size), None, *config), _split(size)
    # "1d" [seq, head_dim] slices: [size, seq, 1, head_dim] in the 2d layout, at the same
    # positions (each row's seq index)
    config[layout] = "2d"
    rows = _leading(x, in_dims[0], size).unsqueeze(2)
    return (rows, None, *config), lambda result: result.squeeze(2)


def _slice(arguments: tuple, in_dims: tuple, index: int) -> list:
    """The arguments of one slice (a list argument's in_dims entry is a list of Nones)."""
    pairs = zip(arguments, in_dims, strict=True)
    return [a.select(d, index) if isinstance(d, int) else a for a, d in pairs]


def _no_slices(op: Any, in_dims: tuple, arguments: tuple) -> Any:
    """The results of a vmap over an empty batch: each one [0, ...] of the dtype, the shape
    and the device of one slice's, which the op's fake implementation gives on meta tensors
    (there is no slice to run, and the joined rows of none say nothing of a slice's)."""
    import torch

    device = next(a.device for a in arguments if isinstance(a, torch.Tensor))
    pairs = zip(arguments, in_dims, strict=True)
    shapes = [
        torch.empty(a.shape[:d] + a.shape[d + 1 :], dtype=a.dtype, device="meta")
        if isinstance(d, int)
        else a.to("meta") if isinstance(a, torch.Tensor) else a
        for a, d in pairs
    ]  # fmt: skip
    results = op(*shapes)
    if isinstance(results, tuple):
        return tuple(torch.empty(0, *r.shape, dtype=r.dtype, device=device) for r in results)
    return torch.empty(0, *results.shape, dtype=results.dtype, device=device)


def _vmap_rule(op: Any, fold: Any) -> Any:
    """torch.library.register_vmap's rule for the custom op ``op``: ``fold(size, in_dims,
    arguments)`` gives the arguments of one call on the joined rows and what makes its
    results the vmapped ones ([size, ...]); without a fold (None), slice by slice."""
    import torch

    def rule(info, in_dims, *arguments):
        size = info.batch_size
        if size == 0:
            results = _no_slices(op, in_dims, arguments)
        elif fold is not None:
            call, finish = fold(size, in_dims, list(arguments))
            results = finish(op(*call))
        else:
            slices = [op(*_slice(arguments, in_dims, i)) for i in range(size)]
            if isinstance(slices[0], tuple):
                results = tuple(torch.stack(r) for r in zip(*slices, strict=True))
            else:
                results = torch.stack(slices)
        if isinstance(results, tuple):
            return results, (0,) * len(results)
        return results, 0

    return rule


# name: how its rows join (None: slice by slice); every functional op has a rule (rope_qk_,
# in place, is never vmapped: transforms record in-place calls as a copy and copy_)
_VMAP_FOLDS = {
    "rope": _fold_rope,
    "rope_qk": None,
    "mhc_pre": None,
    "mhc_post": _fold_rows(3),
    "mhc_pre_bwd": None,
    "mhc_post_bwd": None,
}


# --------------------------------------------------------------------------- registration

# name: (implementation, fake, mutated arguments, (backward, setup_context) or None, the
#        forward-mode derivative (jvp) or None)
_IMPLEMENTATIONS = {
    "rope": (_rope_impl, _rope_fake, (), (_rope_backward, _rope_setup), _rope_jvp),
    "rope_qk": (
        _rope_qk_impl,
        _rope_qk_fake,
        (),
        (_rope_qk_backward, _rope_qk_setup),
        _rope_qk_jvp,
    ),
    "rope_qk_": (_rope_qk__impl, _rope_qk__fake, ("q", "k"), None, None),
    "mhc_pre": (
        _mhc_pre_impl,
        _mhc_pre_fake,
        (),
        (_mhc_pre_backward, _mhc_pre_setup),
        _no_forward_mode("MHCPreFwdOp"),
    ),
    "mhc_post": (
        _mhc_post_impl,
        _mhc_post_fake,
        (),
        (_mhc_post_backward, _mhc_post_setup),
        _mhc_post_jvp,
    ),
    "mhc_pre_bwd": (
        _mhc_pre_bwd_impl,
        _mhc_pre_bwd_fake,
        (),
        _no_second_order("MHCPreBwdOp", "MHCPreFwdOp"),
        _no_forward_mode("MHCPreBwdOp"),
    ),
    "mhc_post_bwd": (
        _mhc_post_bwd_impl,
        _mhc_post_bwd_fake,
        (),
        _no_second_order("MHCPostBwdOp", "MHCPostFwdOp"),
        _no_forward_mode("MHCPostBwdOp"),
    ),
}

# name: the op as a torch.autograd.Function, for calls under torch.func transforms and
# forward-mode AD (_call); filled by ensure_registered
_FUNCTIONS: dict[str, Any] = {}


def _autograd_function(name: str, op: Any, autograd: tuple, jvp: Any) -> Any:
    """The custom op ``op`` as a ``torch.autograd.Function`` on ``(*arguments,
    _Configuration)``: the same backward and context as its registered autograd formula
    (whose tensors :func:`_save` keeps for the jvp too), a forward-mode derivative, and a
    vmap rule torch generates (its forward under vmap is the op's own vmap rule)."""
    import torch

    backward, setup = autograd

    def forward(*inputs):
        *arguments, configuration = inputs
        return op(*arguments, *configuration.values)

    def setup_context(ctx, inputs, output):
        *arguments, configuration = inputs
        ctx.arguments, ctx.configured = len(arguments), len(configuration.values)
        setup(ctx, (*arguments, *configuration.values), output)

    def backward_through(ctx, *grads):  # (no gradient for the configuration)
        return (*backward(ctx, *grads)[: ctx.arguments], None)

    def jvp_through(ctx, *tangents):  # (the configuration's entries have no tangents)
        return jvp(ctx, *tangents[: ctx.arguments], *(None,) * ctx.configured)

    return type(
        f"{name}_function",
        (torch.autograd.Function,),
        {
            "generate_vmap_rule": True,
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward_through),
            "jvp": staticmethod(jvp_through),
        },
    )


def ensure_registered() -> None:
    """Register every custom op with torch (once per process)."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        import torch

        for name, (impl, fake, mutates, autograd, jvp) in _IMPLEMENTATIONS.items():
            op = torch.library.custom_op(
                f"{NAMESPACE}::{name}", impl, mutates_args=mutates, schema=SCHEMAS[name]
            )
            op.register_fake(fake)
            overload = getattr(torch.ops.tileops_cupy, name)
            if name in _VMAP_FOLDS:
                torch.library.register_vmap(op, _vmap_rule(overload, _VMAP_FOLDS[name]))
            if autograd is not None:
                backward, setup_context = autograd
                op.register_autograd(backward, setup_context=setup_context)
                _FUNCTIONS[name] = _autograd_function(name, overload, autograd, jvp)
        # rope_qk_ refuses tracked tensors (the dispatch keys of the devices it runs on
        # and meta; a key of its own overrides the Autograd alias that custom_op filled)
        global _guards
        _guards = torch.library.Library(NAMESPACE, "FRAGMENT")
        for key in ("AutogradCPU", "AutogradCUDA", "AutogradMeta"):
            _guards.impl("rope_qk_", _rope_qk__autograd, key)
        _registered = True


# torch imported before this package: its entry points bound and the ops registered now, so
# that even a function-only caller (apply_rope_with_cos_sin_cache) compiled first finds them
register_if_torch_imported()
