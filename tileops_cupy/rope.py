"""Rotary position embedding: the TileOPs RoPE ops (Fwd and Bwd) and the in-place Q/K component.

Every op here is one path: validate -> pick the place from where the data lives -> the
``rotate`` primitive (numpy body on the host, one CUDA launch on a device) with the shared
cos/sin table of the op's frequency scheme. The variants differ only in their scheme; a
Bwd op differs from its Fwd twin only in the sign of sin.

Example (host, runs anywhere)::

    >>> import numpy as np
    >>> from tileops_cupy.rope import RoPEFwdOp, RoPEBwdOp
    >>> x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    >>> y = RoPEFwdOp()(x)
    >>> bool(np.allclose(RoPEBwdOp()(y), x, atol=1e-5))
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from typing import Any, NamedTuple

import numpy as np

from . import _torch_ops as torch_ops
from ._arrays import (
    BUILTIN,
    Operand,
    as_operand,
    contiguous,
    contiguous_strides,
    empty_like,
    select_place,
    to_caller,
    upload,
)
from ._cache import TWINS, LaunchRecords, ProcessLocal
from ._rotate import (
    ROPE_PARAMS,
    CosSinCache,
    HeadRows,
    Positions,
    RowNorm,
    configuration_flag,
    grouped_table_order,
    rotate,
)
from ._tables import combined_bytes, existing_table, shared_table, table_bytes, table_cache_info
from ._validate import (
    MAX_POSITIONS,
    check_bool,
    check_choice,
    check_cos_sin_cache,
    check_float_dtype,
    check_float_layout,
    check_float_operand,
    check_head_dim_rotary_dim,
    check_host_positions,
    check_in_place,
    check_max_position,
    check_mrope_section,
    check_position_ids,
    check_positive_int,
    check_real,
    check_rotary_dim,
    check_target,
    cos_sin_cache_width,
    is_dense,
    is_int,
    with_contiguous_last_dim,
)
from .schemes import Llama31, LongRoPE, Scheme, Standard, YaRN, scheme_args, scheme_from_args

__all__ = [
    "BUILTIN",
    "Standard",
    "Llama31",
    "YaRN",
    "LongRoPE",
    "RoPEFwdOp",
    "RoPEBwdOp",
    "RoPENeoxPositionIdsFwdOp",
    "RoPENeoxPositionIdsBwdOp",
    "RoPELlama31FwdOp",
    "RoPELlama31BwdOp",
    "YaRNFwdOp",
    "YaRNBwdOp",
    "LongRoPEFwdOp",
    "LongRoPEBwdOp",
    "RoPE",
    "apply_rope",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "table_cache_info",
]

ROPE_LAYOUTS = ("neox", "interleaved")
# the fields a repeated call of one layout changes (see _torch_ops' fast direct calls)
RELAUNCH_X = ROPE_PARAMS.field_writer("q_in", "q_out")
RELAUNCH_IDS = ROPE_PARAMS.field_writer("q_in", "q_out", "k_in", "k_out", "ids")
RELAUNCH_QK = ROPE_PARAMS.field_writer(
    "q_in",
    "q_out",
    "k_in",
    "k_out",
    "ids",
    "offsets",
    "position_offset",
    "cos_sin_cache",
    "q_norm_weight",
    "k_norm_weight",
)
INPUT_LAYOUTS = ("1d", "2d")


# --------------------------------------------------------------------------- seed ops


class _RotaryOp(ProcessLocal):
    """Rotation of ``x`` by its sequence positions with one scheme; see the subclasses."""

    _inverse = False
    _argument = "x"  # what errors call the rotated input: the Bwd twins' is "grad"
    _process_state = frozenset({"_tables", "_relaunches", "_flag", "config"})

    def _setup(
        self,
        scheme: Scheme,
        rope_layout: str,
        input_layout: str,
        target: Any,
        rotary_dim=None,
        max_position: int | None = None,
        flag: int | None = None,
    ) -> None:
        self.scheme = scheme
        self.rope_layout = check_choice("rope_layout", rope_layout, ROPE_LAYOUTS)
        self.input_layout = check_choice("input_layout", input_layout, INPUT_LAYOUTS)
        self.target = check_target(target)
        self.rotary_dim = check_rotary_dim(rotary_dim)
        self.max_position = None if max_position is None else check_max_position(max_position)
        self._start(flag)

    def _start(self, flag: int | None = None) -> None:
        """This process's state (see :class:`ProcessLocal`); ``flag``: the key of the device
        error flag to use (None: the one of this op's configuration)."""
        self._tables: dict[int, Any] = {}
        self._relaunches = LaunchRecords()  # torch CUDA layout -> its first call's launch
        # the op by value: what its torch custom op carries (its device error flag by key)
        arguments = (
            *scheme_args(self.scheme), self.rotary_dim or 0, self.rope_layout == "neox",
            self._inverse, self.input_layout, self.max_position or 0, self.target or "",
        )  # fmt: skip
        flag, self._flag = configuration_flag(arguments, flag)
        self.config = (*arguments, flag)
        torch_ops.register_if_torch_imported()

    def _rows(self, operand: Operand, name: str) -> HeadRows:
        """``operand`` as [batch, seq, heads, head_dim] rows for this op's input layout."""
        two_d = self.input_layout == "2d"
        if operand.ndim != (4 if two_d else 2):
            expected = "[batch, seq, heads, head_dim]" if two_d else "[seq, head_dim]"
            raise ValueError(
                f"{name} must be {expected} for input_layout={self.input_layout!r}, "
                f"got shape {operand.shape}"
            )
        if not two_d:
            (seq, head_dim), (seq_stride, _) = operand.shape, operand.strides
            return HeadRows(operand, (1, seq, 1, head_dim), (0, seq_stride, 0, 1))
        return HeadRows(operand, operand.shape, (*operand.strides[:3], 1))

    def forward(self, x: Any) -> Any:
        """Rotate ``x`` (``[seq, head_dim]`` for "1d", ``[batch, seq, heads, head_dim]``
        for "2d"; the row's seq index is its position). Returns a new array of x's shape,
        dtype, framework and device; x is not modified. On torch tensors that require
        grad the result carries a ``grad_fn`` (the Bwd twin's rotation)."""
        layout = torch_ops.classify(x)
        if layout is torch_ops.DISPATCH:
            return torch_ops.rope(self.config, x, None)
        return self.direct(x, None, layout)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def direct(self, x: Any, position_ids: Any = None, layout: tuple | None = None) -> Any:
        """:meth:`forward` without the torch dispatcher (what the custom op runs);
        ``layout``: ``_torch_ops.layouts(x)`` when the caller has it."""
        keys, (x_ptr,) = layout or torch_ops.layouts(x)
        fast = self._relaunches.get(keys)
        if fast is not None:  # this layout was validated and planned by an earlier call
            result = torch_ops.new_contiguous(x)
            stream = torch_ops.current_stream(fast.device)
            fast.relaunch(stream, RELAUNCH_X, x_ptr, result.data_ptr())
            return result
        source = check_float_operand(x, self._argument)
        rows = self.checked_rows(source)
        select_place(self.target, {self._argument: source})
        seq = rows.shape[1]
        positions = Positions(limit=max(seq, 1), cover=max(seq, 1))
        result, launch = self._run(source, rows, positions)
        if launch is not None and torch_ops.all_torch(keys) and source.obj is x:
            self._relaunches[keys] = launch
        return to_caller(result)

    def checked_rows(self, source: Operand, ids: Operand | None = None) -> HeadRows:
        """``source`` (x) as head rows, its dtype, layout, head_dim, rotary_dim and
        positions checked: every check of a call that needs no memory, which the op's fake
        implementation (meta tensors, torch.compile) runs too."""
        name = self._argument
        check_float_dtype(source, name)
        rows = self._rows(source, name)
        if rows.shape[1] > MAX_POSITIONS:
            raise ValueError(f"{name} has {rows.shape[1]} positions; at most 2**24 are supported")
        check_head_dim_rotary_dim(name, rows.shape[3], self.rotary_dim)
        return rows

    def _run(
        self, source: Operand, rows: HeadRows, positions: Positions, flag=None
    ) -> tuple[Operand, Any]:
        """(the rotated copy, the CUDA launch or None) of rows :meth:`checked_rows` gave."""
        rotary_dim = rows.shape[3] if self.rotary_dim is None else self.rotary_dim
        table = self._tables.get(rotary_dim)
        if table is None:  # the shared registry's table, remembered per head size
            table = self._tables[rotary_dim] = shared_table(self.scheme, rotary_dim)
        result = empty_like(source, source.shape)
        out_rows = HeadRows(result, rows.shape, contiguous_strides(rows.shape))
        launch = None
        if math.prod(rows.shape):
            launch = rotate(
                table, self.rope_layout == "neox", self._inverse, (rows, out_rows), None,
                positions, flag,
            )  # fmt: skip
        return result, launch

    def __repr__(self) -> str:
        partial = "" if self.rotary_dim is None else f", rotary_dim={self.rotary_dim}"
        return f"{type(self).__name__}({self.scheme}, rope_layout={self.rope_layout!r}{partial})"


class RoPEFwdOp(_RotaryOp):
    """RoPE with standard frequencies ``base ** (-2j/d)``, in either rotation convention.

    Args:
        rope_layout: "neox" rotates the two halves of a head against each other (pairs
            ``(j, j + d/2)``); "interleaved" rotates adjacent pairs ``(2j, 2j+1)``.
        input_layout: "1d" for ``x`` of shape ``[seq, head_dim]``, "2d" for
            ``[batch, seq, heads, head_dim]``. A row's position is its seq index.
        base: frequency base, > 0.
        rotary_dim: partial rotary (HF ``partial_rotary_factor``): the first rotary_dim
            columns of each head rotate, with frequencies computed over rotary_dim (even,
            <= head_dim); the rest are copied unchanged. None rotates all of them.
        target: None or BUILTIN (run where the data lives), "cuda" or "cpu" (must match
            where the data lives: a mismatch raises ValueError, never copies).

    ``forward(x)``: x float16, bfloat16 or float32 (float64 on the host); strided views
    with a contiguous last dim are read in place. Returns a new array like x.

    Raises ValueError for a bad layout name, base <= 0, a wrong rank, an odd head_dim, an
    odd rotary_dim or one above head_dim, or a target that does not match the data;
    TypeError for non-float data.

    Example::

        >>> import numpy as np
        >>> x = np.ones((2, 8, 4, 64), np.float32)
        >>> RoPEFwdOp(input_layout="2d")(x).shape
        (2, 8, 4, 64)
        >>> y = RoPEFwdOp(rotary_dim=16)(np.ones((5, 64), np.float32))  # Phi-style partial
        >>> bool((y[:, 16:] == 1).all())
        True
    """

    def __init__(
        self,
        rope_layout: str = "neox",
        input_layout: str = "1d",
        base: float = 10000.0,
        *,
        rotary_dim: int | None = None,
        target: Any = None,
    ) -> None:
        self._setup(Standard(base), rope_layout, input_layout, target, rotary_dim)


_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_INPUT_LAYOUT_PARAMETER = inspect.Parameter(
    "input_layout", _POSITIONAL, default="1d", annotation="str"
)


class _SchemeOp(_RotaryOp):
    """A neox op of one frequency scheme (the class keyword ``scheme``), constructed as
    ``(input_layout="1d", <the scheme's fields, in order, with its defaults>, *,
    rotary_dim=None, target=None)``: the scheme dataclass declares those parameters once,
    and the op's signature (``inspect.signature``, ``help``) is derived from it."""

    _scheme_type: type

    def __init_subclass__(cls, scheme: type | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if scheme is None:  # a Bwd twin: its Fwd op's scheme and signature
            return
        cls._scheme_type = scheme
        keyword = inspect.Parameter.KEYWORD_ONLY
        parameters = [_INPUT_LAYOUT_PARAMETER]
        parameters += [
            inspect.Parameter(f.name, _POSITIONAL, default=f.default, annotation=f.type)
            for f in dataclasses.fields(scheme)
        ]
        parameters += [
            inspect.Parameter("rotary_dim", keyword, default=None, annotation="int | None"),
            inspect.Parameter("target", keyword, default=None, annotation="Any"),
        ]
        cls.__signature__ = inspect.Signature(parameters, return_annotation="None")

    def __init__(
        self,
        input_layout: str = "1d",
        *scheme_args: Any,
        rotary_dim: int | None = None,
        target: Any = None,
        **scheme_kwargs: Any,
    ) -> None:
        scheme = self._scheme_type(*scheme_args, **scheme_kwargs)
        self._setup(scheme, "neox", input_layout, target, rotary_dim)
        if self.rotary_dim is not None:
            scheme.inv_freq(self.rotary_dim)  # a count the scheme fixes (LongRoPE's factors), now


class RoPELlama31FwdOp(_SchemeOp, scheme=Llama31):
    """Neox RoPE with Llama 3.1 piecewise frequency scaling (HF ``rope_type="llama3"``).

    Args:
        input_layout: "1d" (``[seq, head_dim]``) or "2d" (``[batch, seq, heads, head_dim]``).
        base: frequency base, > 0.
        scale_factor: divisor of the low frequencies (wavelength > original/low_freq_factor).
        low_freq_factor, high_freq_factor: wavelength thresholds; between them the
            frequency blends linearly.
        original_max_position: the context length the model was trained at.
        rotary_dim, target: as in RoPEFwdOp.

    ``forward(x)`` as in RoPEFwdOp. Example::

        >>> import numpy as np
        >>> RoPELlama31FwdOp()(np.ones((4, 128), np.float32)).shape
        (4, 128)
    """


class YaRNFwdOp(_SchemeOp, scheme=YaRN):
    """Neox RoPE with YaRN frequencies and attention amplitude, as vLLM's
    ``YaRNScalingRotaryEmbedding`` and HF ``rope_type="yarn"`` (TileOPs' own kernel drifted
    from that reference; see ``schemes.YaRN``). cos and sin carry the amplitude
    ``(0.1*ln(scale) + 1) * attn_factor`` (vLLM's ``attn_factor``, a multiplier; HF's
    ``attention_factor`` replaces the amplitude instead, see ``schemes.YaRN``).

    Args:
        input_layout: "1d" or "2d", as in RoPEFwdOp.
        base: frequency base, > 0.
        scale: context extension factor.
        original_max_position: the context length the model was trained at.
        beta_fast, beta_slow: rotation counts bounding the interpolation ramp.
        attn_factor: extra factor on the amplitude.
        rotary_dim, target: as in RoPEFwdOp (the correction range is computed over
            rotary_dim, as vLLM does for a partial rotary).

    ``forward(x)`` as in RoPEFwdOp. Example::

        >>> import numpy as np
        >>> YaRNFwdOp()(np.ones((4, 64), np.float32)).shape
        (4, 64)
    """


class LongRoPEFwdOp(_SchemeOp, scheme=LongRoPE):
    """Neox RoPE with per-pair rescaled frequencies ``inv0 / rescale_factors`` and the
    amplitude ``sqrt(1 + ln(s)/ln(original))``, ``s = max/original`` (HF ``longrope``).

    Args:
        input_layout: "1d" or "2d", as in RoPEFwdOp.
        base: frequency base, > 0.
        rescale_factors: ``[rotary_dim/2]`` divisors of the frequencies (list, numpy or
            any tensor; rotary_dim is head_dim unless given); None means ones. Zero, NaN or
            infinite factors raise ValueError.
        max_position_embeddings: extended context length.
        original_max_position_embeddings: trained context length.
        rotary_dim, target: as in RoPEFwdOp. A rotary_dim that is not 2 *
            len(rescale_factors) raises ValueError here.

    ``forward(x)`` as in RoPEFwdOp; the rotary_dim (x's head_dim unless given) must be
    2 * len(rescale_factors). Example::

        >>> import numpy as np
        >>> op = LongRoPEFwdOp(rescale_factors=[1.0] * 32, max_position_embeddings=8192)
        >>> op(np.ones((4, 64), np.float32)).shape
        (4, 64)
        >>> LongRoPEFwdOp(rescale_factors=[1.0] * 8, rotary_dim=16)(np.ones((4, 64))).shape
        (4, 64)
    """


class RoPENeoxPositionIdsFwdOp(_RotaryOp):
    """Neox RoPE for packed tokens (THD) at explicit positions, with partial rotary_dim.

    Args:
        max_position: every id must lie in ``[0, max_position)``; at most 2**24.
        base: frequency base, > 0.
        rotary_dim: the first rotary_dim columns of each head rotate (even, <= head_dim);
            None rotates all of them. The rest are copied.
        target: as in RoPEFwdOp.

    ``forward(x, position_ids)``: x ``[tokens, heads, head_dim]`` float16/bfloat16/float32
    (float64 on the host); position_ids ``[tokens]`` int32 or int64 on x's device, read
    natively. Host ids outside ``[0, max_position)`` raise ValueError before the launch
    (int64 ids are compared as int64). Device ids are not read on the host, since that
    would need a sync: the kernel clamps an out-of-range id (no table is ever read out of
    bounds) and raises a device flag, which surfaces as ValueError at this op's next call
    (once the faulty kernel has finished; or at the next call of any op built alike, which
    shares the flag) or at :meth:`check`, which synchronises. So a call with device ids
    never waits for the device and can be captured in a CUDA graph.

    Example::

        >>> import numpy as np
        >>> op = RoPENeoxPositionIdsFwdOp(max_position=4096, rotary_dim=32)
        >>> x = np.ones((3, 2, 64), np.float32)
        >>> op(x, np.array([7, 0, 4095])).shape
        (3, 2, 64)
    """

    def __init__(
        self,
        max_position: int,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        *,
        target: Any = None,
    ) -> None:
        max_position = check_max_position(max_position)  # required here: ids are bounded by it
        self._setup(Standard(base), "neox", "2d", target, rotary_dim, max_position)

    def forward(self, x: Any, position_ids: Any) -> Any:
        layout = torch_ops.classify(x, position_ids)
        if layout is torch_ops.DISPATCH:
            return torch_ops.rope(self.config, x, position_ids)
        return self.direct(x, position_ids, layout)

    def check(self) -> None:
        """Wait for the device and raise ValueError if a kernel of this op met an id outside
        ``[0, max_position)`` since the last look."""
        self._flag.check(self._flagged_message)

    def _flagged_message(self) -> str:
        return (
            f"position_ids given as a device tensor in an earlier call were outside [0, "
            f"max_position={self.max_position}) (the kernel clamped them; that call's output "
            "is not valid)"
        )

    def direct(self, x: Any, position_ids: Any = None, layout: tuple | None = None) -> Any:
        self._flag.raise_if_set(self._flagged_message)
        keys, (x_ptr, ids_ptr) = layout or torch_ops.layouts(x, position_ids)
        fast = self._relaunches.get(keys)
        if fast is not None:  # this layout was validated and planned by an earlier call
            result = torch_ops.new_contiguous(x)
            stream = torch_ops.current_stream(fast.device)
            fast.relaunch(stream, RELAUNCH_IDS, x_ptr, result.data_ptr(), 0, 0, ids_ptr)
            return result
        source = check_float_operand(x, self._argument)
        ids = as_operand(position_ids, "position_ids")
        rows = self.checked_rows(source, ids)
        tokens = source.shape[0]
        place = select_place(self.target, {self._argument: source, "position_ids": ids})
        if place == "cpu":
            check_host_positions("position_ids", ids.host, self.max_position)
        elif ids.strides[0] != 1 and tokens > 1:
            ids = contiguous(ids, source)
        # device ids are bounded by the kernel (clamped, flagged): no sync, capturable
        positions = Positions(ids=ids, limit=self.max_position, cover=self.max_position)
        result, launch = self._run(source, rows, positions, self._flag)
        recorded = launch is not None and torch_ops.all_torch(keys)
        if recorded and source.obj is x and ids.obj is position_ids:  # nothing was copied
            self._relaunches[keys] = launch
        return to_caller(result)

    def checked_rows(self, source: Operand, ids: Operand | None = None) -> HeadRows:
        """x ``[tokens, heads, head_dim]`` as head rows, checked with its ``ids`` (see
        :meth:`_RotaryOp.checked_rows`)."""
        name = self._argument
        check_float_dtype(source, name)
        if source.ndim != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {source.shape}")
        if ids is None:
            raise TypeError("position_ids must be an int32/int64 array [tokens], got None")
        tokens, heads, head_dim = source.shape
        if ids.dtype not in ("int32", "int64"):
            raise TypeError(f"position_ids must be int32 or int64, got {ids.dtype}")
        if ids.shape != (tokens,):
            raise ValueError(
                f"position_ids must have shape [tokens] = ({tokens},) to match {name}, got "
                f"{ids.shape}"
            )
        check_head_dim_rotary_dim(name, head_dim, self.rotary_dim)
        return HeadRows(source, (1, tokens, heads, head_dim), (0, *source.strides[:2], 1))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_position={self.max_position}, {self.scheme})"


def _make_backward(forward: type[_RotaryOp]) -> type[_RotaryOp]:
    """The Bwd twin of a Fwd op: same constructor, the inverse rotation (sin negated).
    With an amplitude ``a``, Bwd(Fwd(x)) == a*a*x."""
    name = forward.__name__.replace("FwdOp", "BwdOp")
    doc = (
        f"Backward of :class:`{forward.__name__}`: same constructor and call, applies the "
        "inverse rotation (sin negated) to the incoming gradient ``grad`` (the first "
        "argument of ``forward(grad, ...)``, in x's place). With an amplitude ``a`` (YaRN, "
        "LongRoPE), Bwd(Fwd(x)) == a*a*x.\n\n"
        f"{forward.__name__}'s documentation:\n\n{forward.__doc__}"
    )

    def backward_forward(self: _RotaryOp, grad: Any, *args: Any, **kwargs: Any) -> Any:
        """The inverse rotation of ``grad``; the other arguments as the Fwd op's."""
        return forward.forward(self, grad, *args, **kwargs)

    # a method named and signed as the Fwd op's, its first argument grad (pickle finds a
    # bound method by its name; help() shows the parameters)
    backward_forward.__name__ = "forward"
    backward_forward.__qualname__ = f"{name}.forward"
    signature = inspect.signature(forward.forward)
    self_parameter, data, *rest = signature.parameters.values()
    backward_forward.__signature__ = signature.replace(
        parameters=[self_parameter, data.replace(name="grad"), *rest]
    )
    attributes = {
        "_inverse": True, "_argument": "grad", "forward": backward_forward, "__doc__": doc,
        "__module__": __name__,
    }  # fmt: skip
    return type(name, (forward,), attributes)


RoPEBwdOp = _make_backward(RoPEFwdOp)
RoPELlama31BwdOp = _make_backward(RoPELlama31FwdOp)
YaRNBwdOp = _make_backward(YaRNFwdOp)
LongRoPEBwdOp = _make_backward(LongRoPEFwdOp)
RoPENeoxPositionIdsBwdOp = _make_backward(RoPENeoxPositionIdsFwdOp)


# --------------------------------------------------------------------------- Q/K component


class _CheckedCall(NamedTuple):
    """What :meth:`RoPE._checked` learned of a call: whether its tokens are packed ([N]
    positions), and q's and k's head rows (k's None without k), before any copy."""

    packed: bool
    q_rows: HeadRows
    k_rows: HeadRows | None


class RoPE(ProcessLocal):
    """In-place rotary embedding of Q and K for inference and training stacks.

    Rotates q ``[B, T, num_heads*head_dim]`` or ``[B, T, num_heads, head_dim]`` and k (the
    same with ``num_kv_heads``, or None) in place, in one launch, at positions
    ``offset .. offset+T-1``. q and k may be strided views into one fused QKV buffer (last
    dim contiguous): the rotation writes through the views and leaves v untouched. The
    cos/sin table is the process-wide one of (scheme, rotary_dim): every layer of a model
    shares it (see :func:`table_cache_info`).

    Args:
        head_dim: size of one head (even).
        num_heads: query heads; a multiple of num_kv_heads.
        num_kv_heads: key heads (GQA); None means num_heads.
        scheme: ``Standard()`` (default), ``Llama31(...)``, ``YaRN(...)`` or ``LongRoPE(...)``.
        rotary_dim: leading columns of each head that rotate (even, <= head_dim); None = all.
        rope_layout: "neox" or "interleaved".
        max_position: positions must lie below it (ValueError otherwise). None bounds
            them by 2**24, the range of the accuracy contract; a device tensor of
            positions then grows the shared table to that range once (~9 MB at
            rotary_dim 128).
        target: None/BUILTIN (where the data lives), "cuda" or "cpu".
        mrope_section: multimodal RoPE (Qwen2-VL / Qwen3-VL): ``(t, h, w)``, three
            non-negative ints summing to rotary_dim/2. Per-token ``positions`` then have
            shape ``(3, *token_shape)`` (temporal, height, width rows) and frequency pair
            j takes its position from one row: sectioned (default, HF
            ``Qwen2VLRotaryEmbedding``), the first t pairs row 0, the next h row 1, the
            last w row 2; ``mrope_interleaved=True`` (HF ``Qwen3VLTextRotaryEmbedding``),
            row 1 if j % 3 == 1 and j < 3h, row 2 if j % 3 == 2 and j < 3w, else row 0.
            ``prefill``/``decode`` offsets give all three rows the same position (text
            tokens), where MRoPE is the plain rotation.
        mrope_interleaved: see mrope_section.
        norm_eps: epsilon of the fused QK-RMSNorm (>= 0 and within float32's range; used
            only by calls that pass ``q_norm_weight``).
        norm_weight_offset: added to the norm weights: 0 for Qwen3 (``Qwen3RMSNorm``), 1
            for Gemma (``Gemma3RMSNorm``, which scales by ``1 + weight``); within float32's
            range.

    Fused QK-RMSNorm (Qwen3, Gemma 3): ``forward``, ``prefill``, ``decode`` and
    :func:`apply_rope` take ``q_norm_weight`` and ``k_norm_weight`` (``[head_dim]``, of the
    data's dtype or float32, contiguous, where the data lives). With them, each head row of
    q (and k) is first normalised over its whole head_dim, ``x / sqrt(mean(x**2) + eps) *
    (weight + norm_weight_offset)`` in float32, then rotated, and rounded once; the
    columns past rotary_dim are written normalised but not rotated. Still one launch for q
    and k, in place on fused-QKV views (on CUDA, in-place calls of bf16/fp16 rows rotated
    whole at head_dim 64 or 128, 16-byte aligned, take the fastest lane layout from a few
    thousand tokens up: about 91% of the copy ceiling at 32768 tokens on an H200, 78% at
    8192; other views take the general one). As in HF Qwen3 both norms always come together: a
    call with k needs both weights, a call without k only ``q_norm_weight``. ``backward``
    takes no weights (it is the transpose rotation alone); under autograd (torch) the
    gradient flows through the norm too, to the data and to both weights.

    In place: q and k must be writable (not read-only, nor an inference tensor outside
    ``torch.inference_mode``, which torch forbids to change), must not share memory, nor
    share it with what the call reads (positions, offsets, a cos_sin_cache, norm weights),
    and neither may address an element twice (an expanded view); under autograd they must be
    tensors torch lets change in place (not a leaf that requires grad, a view of one, one of
    the views ``split`` returns). Each is refused with a ValueError naming it before
    anything is written; torch.func transforms included, and ``torch.compile`` when the
    graph runs. One case goes unchecked: a compiled call that autograd records (q or k
    requires grad) rotates copies and writes them back, traced with no memory to compare,
    so memory shared there is not detected (the later write wins).

    Positions: ``position_offset``/``position`` is a Python int or an integer tensor
    ``[B]`` (one per sequence). ``forward(q, k, positions=...)`` (and ``backward``,
    :func:`apply_rope`) take one position per token instead: an int32/int64 tensor
    ``[B, T]``, or ``[N]`` for packed tokens, q ``[N, num_heads*head_dim]`` and k
    ``[N, num_kv_heads*head_dim]`` (any scheme: the schemes differ only in the table).
    Ints and host tensors are validated before the launch. A device tensor is not (that
    would need a sync): the kernel clamps an out-of-range position so no table is read
    out of bounds, raises a device flag, and the flag surfaces as ValueError at this
    component's next call (once the faulty kernel has finished; or at the next call of any
    component built alike, every layer's say, which share the flag) or at :meth:`check`,
    which synchronises. This keeps calls with device tensors free of host syncs and of
    allocations (a non-contiguous positions tensor is copied once, by its framework), so
    a CUDA graph can capture them and replay them with new positions written into the
    same tensor.

    Example (host; on a GPU pass torch CUDA tensors instead)::

        >>> import numpy as np
        >>> mrope = RoPE(head_dim=64, num_heads=4, mrope_section=(8, 12, 12))
        >>> thw = np.array([[0, 1, 2], [0, 5, 5], [0, 3, 4]])  # (3, N) for 3 packed tokens
        >>> _ = mrope.forward(np.ones((3, 4 * 64), np.float32), positions=thw)
        >>> rope = RoPE(head_dim=64, num_heads=4, num_kv_heads=2)
        >>> qkv = np.random.default_rng(0).standard_normal((1, 5, 8 * 64)).astype(np.float32)
        >>> q, k = qkv[..., : 4 * 64], qkv[..., 4 * 64 : 6 * 64]
        >>> _ = rope.prefill(q, k, position_offset=0)   # rotates inside qkv
        >>> step = np.ones((1, 1, 8 * 64), np.float32)
        >>> _ = rope.decode(step[..., :256], step[..., 256:384], position=5)
        >>> packed = np.ones((3, 8 * 64), np.float32)  # 3 tokens of any sequences
        >>> _ = rope.forward(packed[:, :256], packed[:, 256:384], positions=np.array([7, 0, 2]))
        >>> w = np.ones(64, np.float32)  # fused QK-RMSNorm (Qwen3's q_norm / k_norm weights)
        >>> _ = rope.prefill(q, k, 5, q_norm_weight=w, k_norm_weight=w)
    """

    _process_state = frozenset({"table", "_flag", "config", "_relaunches"})

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        scheme: Scheme | None = None,
        rotary_dim: int | None = None,
        rope_layout: str = "neox",
        max_position: int | None = None,
        target: Any = None,
        mrope_section: Any = None,
        mrope_interleaved: bool = False,
        norm_eps: float = 1e-6,
        norm_weight_offset: float = 0.0,
    ) -> None:
        head_dim = check_positive_int("head_dim", head_dim, even=True)
        num_heads = check_positive_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        if scheme is not None and not isinstance(scheme, Scheme):
            raise TypeError(
                "scheme must be a scheme instance (Standard(), Llama31(...), YaRN(...), "
                f"LongRoPE(...) from tileops_cupy.schemes), got {scheme!r}"
            )
        self.scheme = Standard() if scheme is None else scheme
        self.rotary_dim = check_head_dim_rotary_dim("q", head_dim, check_rotary_dim(rotary_dim))
        self.rope_layout = check_choice("rope_layout", rope_layout, ROPE_LAYOUTS)
        self.max_position = None if max_position is None else check_max_position(max_position)
        self.target = check_target(target)
        self.mrope_section = check_mrope_section(mrope_section, self.rotary_dim)
        mrope_interleaved = check_bool("mrope_interleaved", mrope_interleaved)
        if mrope_interleaved and self.mrope_section is None:
            raise ValueError("mrope_interleaved=True needs an mrope_section (t, h, w)")
        self.mrope_interleaved = mrope_interleaved
        self.norm_eps = check_real("norm_eps", norm_eps, float32=True)
        if self.norm_eps < 0:
            raise ValueError(f"norm_eps must be >= 0, got {norm_eps!r}")
        self.norm_weight_offset = check_real("norm_weight_offset", norm_weight_offset, float32=True)
        self._start()

    def _start(self) -> None:
        """This process's state (see :class:`ProcessLocal`): the shared table of (scheme,
        rotary_dim), its configuration's device error flag, no recorded launches."""
        self.table = shared_table(self.scheme, self.rotary_dim)
        self._adopt_flag(None)
        self._relaunches = LaunchRecords()  # see _direct
        torch_ops.register_if_torch_imported()

    # ---- public calls: all in place, all one launch for q and k

    def forward(
        self,
        q: Any,
        k: Any = None,
        *,
        positions: Any = None,
        q_norm_weight: Any = None,
        k_norm_weight: Any = None,
    ) -> tuple[Any, Any]:
        """Rotate at positions 0..T-1 (a training forward), or at ``positions``: one
        int32/int64 position per token, ``[B, T]`` for q ``[B, T, ...]`` or ``[N]`` for
        packed q ``[N, num_heads*head_dim]`` or ``[N, num_heads, head_dim]`` (k likewise
        with num_kv_heads); with an mrope_section, ``[3, B, T]`` or ``[3, N]``. With
        ``q_norm_weight``/``k_norm_weight`` (``[head_dim]``), each head row is RMS-normalised
        first (see the class). Returns (q, k), the same objects."""
        weights = (q_norm_weight, k_norm_weight)
        self._in_place(q, k, 0, False, False, positions, weights)
        return q, k

    def prefill(
        self,
        q: Any,
        k: Any,
        position_offset: Any,
        *,
        q_norm_weight: Any = None,
        k_norm_weight: Any = None,
    ) -> tuple[Any, Any]:
        """Rotate a chunk at positions ``position_offset .. position_offset+T-1`` (norm
        weights as in :meth:`forward`)."""
        self._in_place(q, k, position_offset, False, False, None, (q_norm_weight, k_norm_weight))
        return q, k

    def decode(
        self, q: Any, k: Any, position: Any, *, q_norm_weight: Any = None, k_norm_weight: Any = None
    ) -> tuple[Any, Any]:
        """Rotate one token per sequence (T must be 1) at ``position`` (int or ``[B]``; norm
        weights as in :meth:`forward`)."""
        self._in_place(q, k, position, False, True, None, (q_norm_weight, k_norm_weight))
        return q, k

    def backward(
        self, grad_q: Any, grad_k: Any, position_offset: Any = 0, *, positions: Any = None
    ) -> tuple[Any, Any]:
        """Transpose rotation of the incoming gradients, in place, at the forward's positions
        (``position_offset``, or per-token ``positions`` as in :meth:`forward`; amplitude
        included: ``backward(forward(x)) == a*a*x``)."""
        self._in_place(grad_q, grad_k, position_offset, True, False, positions)
        return grad_q, grad_k

    __call__ = forward

    def check(self) -> None:
        """Wait for the device and raise ValueError if any kernel of this component met a
        position outside its range since the last check."""
        self._flag.check(self._flagged_message)

    # ---- memory accounting

    def memory_stats(self) -> dict[str, Any]:
        """Bytes this component's tables hold. The table is shared by every component and
        op with the same (scheme, rotary_dim): ``owned`` is 0, ``shared`` is the table (with
        interleaved MRoPE sections that group, such as Qwen3-VL's, and once a CUDA call has
        made it, also the copy of its columns in the grouped order that mid-sized calls
        read)."""
        tables = [self.table]
        order = self._grouped_order()
        grouped = None if order is None else existing_table(self.scheme, self.rotary_dim, order)
        if grouped is not None:
            tables.append(grouped)
        return {
            "owned": 0,
            "shared": combined_bytes(tables),
            "shared_key": (self.scheme, self.rotary_dim),
            "positions": self.table.capacity,
        }

    def _grouped_order(self) -> tuple[int, ...] | None:
        """The column order of the grouped table this component's mid-sized CUDA calls read
        (interleaved MRoPE sections that group, rows rotated whole), else None."""
        return grouped_table_order(
            self.mrope_section, self.mrope_interleaved, self.rotary_dim, self.head_dim
        )

    @staticmethod
    def required_memory(
        head_dim: int,
        max_position: int,
        *,
        scheme: Scheme | None = None,
        rotary_dim: int | None = None,
        mrope_section: tuple[int, int, int] | None = None,
        mrope_interleaved: bool = False,
    ) -> int:
        """Device bytes that building a component for these shapes would add: 0 when the
        shared table of (scheme, rotary_dim) already covers ``max_position`` on a device,
        else the whole grown table (growth uploads a new copy and keeps the old one, which
        a captured CUDA graph may still read). Interleaved MRoPE sections that group
        (Qwen3-VL's (24, 20, 20), for one), in rows rotated whole (rotary_dim = head_dim,
        64 or 128), count a second table: the same columns in the grouped order that
        mid-sized calls read, and one row more (rotary_dim * 4 bytes) giving each pair's
        column. Not additive across layers: they share."""
        scheme = Standard() if scheme is None else scheme
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        orders: list[tuple[int, ...] | None] = [None]
        section = check_mrope_section(mrope_section, rotary_dim)
        grouped = grouped_table_order(section, mrope_interleaved, rotary_dim, head_dim)
        orders += [grouped] if grouped is not None else []
        total = 0
        for order in orders:
            table = existing_table(scheme, rotary_dim, order)
            devices = () if table is None else table.bytes()["device"]
            covered = max((table.device_capacity(device) for device in devices), default=0)
            if covered < max_position:
                # growth uploads a whole new table; a replaced copy stays (graphs may read it)
                total += table_bytes(rotary_dim, max_position, permuted=order is not None)
        return total

    def __repr__(self) -> str:
        mrope = ""
        if self.mrope_section is not None:
            mrope = f", mrope_section={self.mrope_section}"
            mrope += ", mrope_interleaved=True" if self.mrope_interleaved else ""
        return (
            f"RoPE(head_dim={self.head_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, scheme={self.scheme}, "
            f"rotary_dim={self.rotary_dim}, rope_layout={self.rope_layout!r}{mrope})"
        )

    # ---- the one path

    def _adopt_flag(self, flag: int | None) -> None:
        """Use the device error flag of key ``flag`` (None: the one of this component's
        configuration, which every component built alike shares) and set :attr:`config`,
        the component by value as its torch custom ops carry it (the flag by key)."""

        def configuration(key: int | None) -> tuple:
            return _component_config(
                scheme_args(self.scheme), self.rotary_dim, self.rope_layout == "neox",
                self.head_dim, self.num_heads, self.num_kv_heads, self.max_position or 0,
                self.target or "", key, self.mrope_section or (), self.mrope_interleaved,
                self.norm_eps, self.norm_weight_offset,
            )  # fmt: skip

        flag, self._flag = configuration_flag(configuration(None), flag)
        self.config = configuration(flag)

    def _flagged_message(self) -> str:
        return (
            "a position given as a device tensor was outside [0, "
            f"{self.max_position or MAX_POSITIONS}) (or past the cos_sin_cache's rows) in an "
            "earlier call (the kernel clamped it; that call's output is not valid)"
        )

    def _in_place(
        self,
        q: Any,
        k: Any,
        position: Any,
        inverse: bool,
        decode: bool,
        ids: Any = None,
        weights: tuple[Any, Any] = (None, None),
    ) -> None:
        """The in-place calls' one entry (see :func:`_in_place_call`)."""
        _in_place_call(self.config, q, k, position, inverse, decode, ids, None, self, weights)

    def _direct(
        self,
        q: Any,
        k: Any,
        position: Any,
        inverse: bool = False,
        decode: bool = False,
        layout: tuple | None = None,
        ids: Any = None,
        cache: Any = None,
        *,
        in_place: bool,
        q_norm_weight: Any = None,
        k_norm_weight: Any = None,
    ) -> tuple[Any, Any] | None:
        """The rotation without the torch dispatcher (what the custom ops run): in place
        (:meth:`rotate_in_place`, returns None) or into new copies (:meth:`rotated`, returns
        them; k None gives None). ``layout``: ``_torch_ops.layouts(q, k, position, ids,
        cache, q_norm_weight, k_norm_weight)`` when the caller has it; ``ids``: per-token
        positions (see :meth:`forward`) or None; ``cache``: a cos_sin_cache (see
        :func:`apply_rope_with_cos_sin_cache`) or None; the norm weights as in
        :meth:`forward`.

        An in-place call whose torch layouts (q, k, the position's kind, the per-token
        positions, the cache, the norm weights, the direction) an earlier call validated and
        planned re-runs that launch with the new addresses and offset: at decode sizes the
        bookkeeping would otherwise cost more than the kernel."""
        weights = (q_norm_weight, k_norm_weight)
        if not in_place:
            q_name, k_name = _argument_names(cache, inverse)
            q_op = as_operand(q, q_name)
            q_out = empty_like(q_op, q_op.shape)
            k_op = None if k is None else as_operand(k, k_name)
            k_out = None if k_op is None else empty_like(k_op, k_op.shape)
            out = (q_out, k_out)
            self._apply(q, k, position, inverse, decode, out, ids, weights, cache)
            return to_caller(q_out), None if k_out is None else to_caller(k_out)
        keys, pointers = layout or torch_ops.layouts(q, k, position, ids, cache, *weights)
        q_ptr, k_ptr, offsets_ptr, ids_ptr, cache_ptr, q_weight_ptr, k_weight_ptr = pointers
        int_position = type(position) is int
        key = (keys, inverse, decode, int_position)
        fast = self._relaunches.get(key)
        if fast is not None:
            launch, last_position, k_gap, q_bytes, k_bytes, reads = fast
            # the first call checked q and k disjoint at this distance; at another they must
            # lie apart, and an int offset must stay within what the launch's table holds
            q_end, k_end = q_ptr + q_bytes, k_ptr + k_bytes
            apart = k is None or k_ptr - q_ptr == k_gap or k_ptr >= q_end or q_ptr >= k_end
            # what it reads besides them (positions, offsets, the cache, norm weights) must
            # lie outside what it writes, else the validated path names it (k None: k_end 0)
            for index, span in reads:
                start = pointers[index]
                end = start + span
                if (end > q_ptr and start < q_end) or (end > k_ptr and start < k_end):
                    apart = False
            # (an inference tensor outside inference mode: the validated path refuses it)
            if (
                apart
                and (not int_position or 0 <= position <= last_position)
                and not torch_ops.inference_writes_refused(q, k)
            ):
                self._flag.raise_if_set(self._flagged_message)
                launch.relaunch(
                    torch_ops.current_stream(launch.device), RELAUNCH_QK, q_ptr, q_ptr, k_ptr,
                    k_ptr, ids_ptr, offsets_ptr, position if int_position else 0, cache_ptr,
                    q_weight_ptr, k_weight_ptr,
                )  # fmt: skip
                torch_ops.bump_torch_versions((q,) if k is None else (q, k))
                return
        launch = self._apply(q, k, position, inverse, decode, None, ids, weights, cache)
        # torch q (and k) only; device positions or ints: host ones are uploaded per call
        torch_key = torch_ops.is_torch_key
        device_position = int_position or (torch_key(keys[2]) and keys[2][3].type == "cuda")
        torch_operands = torch_key(keys[0]) and (k is None or torch_key(keys[1]))
        # norm weights: torch tensors too (the launch reads them in place: never copied)
        torch_operands &= all(
            w is None or torch_key(key) for w, key in zip(weights, keys[5:], strict=True)
        )
        # per-token positions: only when the launch reads the caller's tensor itself (host
        # ones are uploaded, non-contiguous ones copied: a new address every call)
        own_ids = ids is None or (
            launch is not None and ROPE_PARAMS.read(launch.params, "ids") == ids_ptr
        )
        own_cache = cache is None or torch_key(keys[4])  # a torch tensor, read in place
        if launch is not None and torch_operands and device_position and own_ids and own_cache:
            # the highest int offset the launch's table covers; with per-token positions
            # the offset must stay 0 (the kernel bounds every position)
            last_position = ROPE_PARAMS.read(launch.params, "position_limit") - q.shape[1]
            if ids is not None:
                last_position = 0
            spans = (_byte_span(q), 0 if k is None else _byte_span(k))
            read = (position, ids, cache, *weights)  # (pointers 2 to 6)
            reads = tuple(
                (index, _byte_span(tensor))
                for index, tensor in enumerate(read, 2)
                if torch_key(keys[index]) and tensor.numel()
            )
            self._relaunches[key] = (launch, last_position, k_ptr - q_ptr, *spans, reads)
        torch_ops.bump_versions(q, k)

    # the custom ops' two entries: one signature, the copy or in-place choice by name (plain
    # methods: a functools.partialmethod costs a microsecond a call building its partial)
    def rotate_in_place(self, *arguments: Any, **weights: Any) -> None:
        self._direct(*arguments, in_place=True, **weights)

    def rotated(self, *arguments: Any, **weights: Any) -> tuple[Any, Any]:
        return self._direct(*arguments, in_place=False, **weights)

    def _rows(self, operand: Operand, name: str, heads: int, packed: bool = False) -> HeadRows:
        """``operand`` as [B, T, heads, head_dim] rows; ``packed`` (per-token positions of
        shape [N]) takes packed tokens [N, heads*head_dim] or [N, heads, head_dim] instead
        (N tokens, seen as B = 1, T = N)."""
        head_dim = self.head_dim
        shape, strides = operand.shape, operand.strides
        if packed:
            if operand.ndim == 2 and shape[1] == heads * head_dim:
                return HeadRows(
                    operand, (1, shape[0], heads, head_dim), (0, strides[0], head_dim, 1)
                )
            if operand.ndim == 3 and shape[1:] == (heads, head_dim):
                return HeadRows(operand, (1, *shape), (0, *strides[:2], 1))
            raise ValueError(
                f"{name} must be packed tokens [N, {heads}*{head_dim}] or [N, {heads}, "
                f"{head_dim}] (heads={heads}, head_dim={head_dim}) with positions of shape "
                f"[N], got shape {shape}"
            )
        if operand.ndim == 3 and shape[2] == heads * head_dim:
            return HeadRows(operand, (*shape[:2], heads, head_dim), (*strides[:2], head_dim, 1))
        if operand.ndim == 4 and shape[2:] == (heads, head_dim):
            return HeadRows(operand, shape, (*strides[:3], 1))
        raise ValueError(
            f"{name} must be [B, T, {heads}*{head_dim}] or [B, T, {heads}, {head_dim}] "
            f"(heads={heads}, head_dim={head_dim}), or packed tokens [N, {heads}*{head_dim}] "
            f"with per-token positions of shape [N], got shape {shape}"
        )

    def _positions(self, value, name, rows: HeadRows, place, ids=None, packed=False, limit=None):
        """Positions for a call that :meth:`_checked` passed: ints and host tensors checked
        here, device tensors bounded by the kernel (by ``limit``: max_position, or 2**24
        without one). ``value``: an int or the offsets' Operand; ``ids``: per-token positions
        (an Operand), with ``value`` 0."""
        batch, seq = rows.shape[:2]
        limit = limit or self.max_position or MAX_POSITIONS
        if ids is not None:
            mrope = {}
            if self.mrope_section is not None:
                mrope = dict(
                    mrope_section=self.mrope_section, mrope_interleaved=self.mrope_interleaved
                )
            if not ids.is_cuda:
                check_host_positions("positions", ids.host, limit)
                highest = int(ids.host.max(initial=0)) + 1
                if place == "cuda":
                    ids = upload(rows.operand, ids.host)
                return Positions(ids=ids, limit=limit, cover=highest, **mrope)
            if ids.device != rows.operand.device:
                raise ValueError(f"positions is on cuda:{ids.device}, the data on another device")
            if not is_dense(ids):  # the kernel reads ids[b*T + s]: copied once, as torch does
                ids = contiguous(ids, rows.operand)
            return Positions(ids=ids, limit=limit, cover=limit, **mrope)
        if not isinstance(value, Operand):  # (its range: _checked)
            value = int(value)
            return Positions(offset=value, limit=limit, cover=value + seq)
        offsets = value
        if not offsets.is_cuda:
            check_host_positions(name, offsets.host, limit)  # (first: the sum below can wrap)
            if seq:  # each sequence's last position (a chunk of T = 0 tokens has none)
                last = offsets.host.astype(np.int64) + seq - 1
                check_host_positions(f"{name} + T - 1 (a sequence's last position)", last, limit)
            highest = int(offsets.host.max(initial=0)) + seq
            if place == "cuda":
                offsets = upload(rows.operand, offsets.host)
            return Positions(offsets=offsets, limit=limit, cover=highest)
        if offsets.device != rows.operand.device:
            raise ValueError(f"{name} is on cuda:{offsets.device}, the data on another device")
        if offsets.strides[0] != 1 and batch > 1:
            raise ValueError(f"{name} must be contiguous, got strides {offsets.strides}")
        return Positions(offsets=offsets, limit=limit, cover=limit)

    def _checked(
        self,
        q: Operand,
        k: Operand | None,
        position: Any,
        inverse: bool,
        decode: bool,
        in_place: bool,
        ids: Operand | None = None,
        weights: tuple[Operand | None, Operand | None] = (None, None),
        cache: Operand | None = None,
    ) -> _CheckedCall:
        """Every check of a call that needs no memory, in the order its errors are raised:
        the shapes, dtypes and layouts of the arguments and which of them go together. What
        :meth:`_apply` runs first, and what the custom ops' fake implementations run alone
        (meta tensors, torch.compile), so that both refuse alike. ``position``: an int (or
        a traced one) or the offsets' Operand; the rest as :meth:`_apply` takes them, as
        Operands."""
        offsets = position if isinstance(position, Operand) else None
        if ids is not None and (offsets is not None or position != 0):
            given = "a tensor" if offsets is not None else repr(position)
            raise ValueError(
                "positions (one per token) and a position offset cannot be combined: "
                f"got position_offset={given}; add the offset to the positions"
            )
        # positions of one token dim ([N], or [3, N] under MRoPE): packed q and k; the
        # cos_sin_cache calls take packed tokens only, as FlashInfer's (query [N, ...])
        token_dims = (0 if ids is None else ids.ndim) - (self.mrope_section is not None)
        if self.mrope_section is not None and ids is not None and ids.shape[:1] != (3,):
            token_dims = 0  # (no leading row of 3: [B, T] is no [3, N])
        packed = ids is not None and token_dims == 1
        if cache is not None and ids is None:
            raise ValueError("a cos_sin_cache call takes per-token positions")
        token_dims_taken = (1,) if cache is not None else (1, 2)
        if ids is not None and token_dims not in token_dims_taken:
            if cache is not None:
                rows = "[N]"
            elif self.mrope_section:
                rows = "[3, B, T] or [3, N] (MRoPE rows t, h, w)"
            else:
                rows = "[B, T] or [N]"
            raise ValueError(
                f"positions must be {rows}, one position per token, got shape {tuple(ids.shape)}"
            )
        if cache is not None:
            width = check_cos_sin_cache(cache, self.head_dim).shape[1]
            if width != self.rotary_dim:
                raise ValueError(
                    f"cos_sin_cache has width {width}; this component rotates "
                    f"rotary_dim={self.rotary_dim}"
                )
        q_name, k_name = _argument_names(cache, inverse)
        check_float_layout(q, q_name, in_place=in_place)
        q_rows = self._rows(q, q_name, self.num_heads, packed)
        k_rows = None
        if k is not None:
            check_float_layout(k, k_name, in_place=in_place)
            k_rows = self._rows(k, k_name, self.num_kv_heads, packed)
            if k_rows.shape[:2] != q_rows.shape[:2]:
                tokens, first = ("[N]", 1) if packed else ("[B, T]", 0)  # (packed: B = 1)
                raise ValueError(
                    f"{q_name} and {k_name} must share {tokens}, got {q_name} "
                    f"{q_rows.shape[first:2]} and {k_name} {k_rows.shape[first:2]}"
                )
            if k.dtype != q.dtype:
                raise TypeError(
                    f"{q_name} and {k_name} must share a dtype, got {q.dtype} and {k.dtype}"
                )
        self._check_norm_weights(weights, q.dtype, k is not None, inverse)
        batch, seq = q_rows.shape[:2]
        if decode and seq != 1:
            raise ValueError(f"decode takes one token per sequence (T == 1), got T={seq}")
        if ids is not None:
            shape, layout = ((seq,), "[N]") if packed else ((batch, seq), "[B, T]")
            if self.mrope_section is not None:
                shape, layout = (3, *shape), "[3, " + layout[1:]
            check_position_ids("positions", ids, shape, layout)
        name = _position_name(decode)
        if ids is None and is_int(position):  # (a traced int is checked as the graph runs)
            limit = self.max_position or MAX_POSITIONS
            position = int(position)  # (a NumPy int's sum could wrap)
            if position < 0 or position + seq > limit:
                raise ValueError(
                    f"{name} must keep positions in [0, {limit}): got {name}={position} with "
                    f"T={seq}"
                )
        if offsets is not None:
            if offsets.dtype not in ("int32", "int64"):
                raise TypeError(
                    f"{name} must be an int or an int32/int64 tensor, got {offsets.dtype}"
                )
            if offsets.shape != (batch,):
                raise ValueError(
                    f"{name} must be an int or a tensor of shape [B] = ({batch},), got "
                    f"{offsets.shape}"
                )
        return _CheckedCall(packed, q_rows, k_rows)

    def _apply(
        self,
        q: Any,
        k: Any,
        position: Any,
        inverse: bool,
        decode: bool = False,
        out: tuple[Any, Any] | None = None,
        ids: Any = None,
        weights: tuple[Any, Any] = (None, None),
        cache: Any = None,
    ) -> Any:
        """Rotate (q, k) at ``position`` (or at per-token positions ``ids``, ``position``
        then 0), each head row first normalised when norm ``weights`` (of q, of k) are given:
        in place, or into ``out`` (same shapes, contiguous), with the scheme's table or a
        caller's cos_sin_cache ``cache`` (per-token positions only). Returns the CUDA launch
        (None on the host or for an empty call). :meth:`_checked` first, then what needs the
        memory: strided inputs copied, in-place operands and norm weights checked apart,
        host positions' values."""
        self._flag.raise_if_set(self._flagged_message)
        in_place = out is None
        name = _position_name(decode)
        q_name, k_name = _argument_names(cache, inverse)
        q_op = as_operand(q, q_name)
        k_op = None if k is None else as_operand(k, k_name)
        ids = None if ids is None else as_operand(ids, "positions")  # (described once)
        cache = None if cache is None else as_operand(cache, "cos_sin_cache")
        weight_names = ("q_norm_weight", "k_norm_weight")
        weights = tuple(
            None if w is None else as_operand(w, n)
            for w, n in zip(weights, weight_names, strict=True)
        )
        if not is_int(position):  # (real values here: a traced int reaches only the fakes)
            _refuse_scalar_position(position, name)
            position = as_operand(position, name)
        packed, q_rows, k_rows = self._checked(
            q_op, k_op, position, inverse, decode, in_place, ids, weights, cache
        )
        if not in_place:  # a read-only input with a strided last dimension: copied once
            q_copy = with_contiguous_last_dim(q_op)
            if q_copy is not q_op:
                q_rows = self._rows(q_copy, q_name, self.num_heads, packed)
            k_copy = k_op if k_op is None else with_contiguous_last_dim(k_op, q_rows.operand)
            if k_copy is not k_op:
                k_rows = self._rows(k_copy, k_name, self.num_kv_heads, packed)
        operands = {q_name: q_rows.operand}
        if k_rows is not None:
            operands[k_name] = k_rows.operand
        if in_place:  # every operand checked before anything is written
            offsets = position if isinstance(position, Operand) else None
            check_in_place(operands, _read_only(name, offsets, ids, cache, weights))
        table = self.table
        if cache is not None:
            table = CosSinCache(cache)
            operands["cos_sin_cache"] = cache
        norm = None
        if weights[0] is not None:
            norm = RowNorm(weights[0], weights[1], self.norm_eps, self.norm_weight_offset)
            named = zip(weight_names, weights, strict=True)
            operands.update((n, w) for n, w in named if w is not None)
        place = select_place(self.target, operands)
        limit = table.capacity if cache is not None else None
        positions = self._positions(position, name, q_rows, place, ids, packed, limit)
        if cache is None:
            table.ensure(positions.cover)
        if math.prod(q_rows.shape[:2]) == 0:
            return None
        q_out = q_rows if out is None else self._rows(out[0], "out", self.num_heads, packed)
        k_pair = None
        if k_rows is not None:
            k_out = k_rows if out is None else self._rows(out[1], "out", self.num_kv_heads, packed)
            k_pair = (k_rows, k_out)
        q_pair = (q_rows, q_out)
        return rotate(
            table, self.rope_layout == "neox", inverse, q_pair, k_pair, positions, self._flag,
            norm=norm,
        )  # fmt: skip

    def _check_norm_weights(
        self,
        weights: tuple[Operand | None, Operand | None],
        dtype: str,
        has_k: bool,
        inverse: bool,
    ) -> None:
        """The fused norm's weights (of q, of k; None without), validated: both or neither
        (k's only with k), ``[head_dim]``, the data's ``dtype`` or float32, contiguous. (That
        they lie apart from what an in-place call writes, :meth:`_apply` checks; their place
        is checked with the data's.)"""
        q_weight, k_weight = weights
        if q_weight is None and k_weight is None:
            return
        if inverse:
            raise ValueError(
                "q_norm_weight/k_norm_weight apply to the forward rotation only; the backward "
                "(transpose) rotation takes no norm weights"
            )
        if q_weight is None:
            raise ValueError(
                "k_norm_weight was given without q_norm_weight; expected both (q and k are "
                "normalised together, as in HF Qwen3)"
            )
        if k_weight is not None and not has_k:
            raise ValueError("k_norm_weight was given without k; expected None")
        if k_weight is None and has_k:
            raise ValueError(
                "k_norm_weight is None but k was given; expected both norm weights (q and k "
                "are normalised together, as in HF Qwen3)"
            )
        for name, weight in (("q_norm_weight", q_weight), ("k_norm_weight", k_weight)):
            if weight is None:
                continue
            if weight.dtype not in (dtype, "float32"):
                raise TypeError(
                    f"{name} must be float32 or the data's dtype {dtype}, got {weight.dtype}"
                )
            if weight.shape != (self.head_dim,):
                raise ValueError(
                    f"{name} must have shape [head_dim] = ({self.head_dim},), got {weight.shape}"
                )
            if weight.strides != (1,) and self.head_dim > 1:
                raise ValueError(f"{name} must be contiguous, got strides {weight.strides}")


def _in_place_call(
    config, q, k, position, inverse, decode, ids=None, cache=None, rope=None, weights=(None, None)
):
    """Every in-place call's one entry, for the component ``config`` describes (``rope``:
    that component, when the caller has it; else it is rebuilt, once, from ``config``):
    the direct path, or torch's dispatcher when autograd or a tracer must see the call.
    ``ids``: per-token positions (or None); ``cache``: a caller's cos_sin_cache in place of
    the table (or None); ``weights``: the fused norm's weights of q and k (or None).

    Through the dispatcher: the in-place custom op, or, on tensors autograd tracks, the
    call recorded as torch's own in-place ops are: the rotation out of place (its backward
    is the inverse rotation), copied back into q and k, so their grad_fn and version
    counters are right. A leaf that requires grad cannot change in place; torch refuses,
    and so do we, before any write. With norm weights the backward needs q and k as they
    were: the op then reads copies of them (the copy_ below overwrites the originals)."""
    layout = torch_ops.classify(q, k, position, ids, cache, *weights)
    if layout is not torch_ops.DISPATCH:  # (no component is built while a tracer watches)
        (rope or component(config))._direct(
            q, k, position, inverse, decode, layout, ids, cache, in_place=True,
            q_norm_weight=weights[0], k_norm_weight=weights[1],
        )  # fmt: skip
        return
    offsets, offset = _split_position(position, _position_name(decode))
    arguments = (q, k, offsets, offset, ids, cache, inverse, decode, *weights)
    named, read = _named_arguments(arguments)
    _require_tensors(named, read)
    _refuse_differentiated_cache(cache)
    if not torch_ops.requires_grad(q, k, *weights) and not torch_ops.transformed():
        torch_ops.rope_qk(config, *arguments, in_place=True)
        return
    for name, tensor in named:
        if tensor is not None and tensor.requires_grad and tensor.is_leaf:
            copy = (
                "apply_rope_with_cos_sin_cache" if cache is not None else "apply_rope(q, k, rope)"
            )
            raise ValueError(
                f"{name} is a leaf tensor that requires grad, which cannot be rotated in "
                f"place (autograd forbids it); use {copy} for a rotated copy, or rotate "
                "under torch.no_grad()"
            )
    memory = {name: torch_ops.memory_of(tensor) for name, tensor in named if tensor is not None}
    read = {name: torch_ops.memory_of(tensor) for name, tensor in read.items()}
    # (a traced graph has no memory to compare; `is`, since `None in` would call tensor ==)
    if all(tensor is not None for tensor in (*memory.values(), *read.values())):
        with torch_ops.outside_transforms():
            check_in_place(
                {name: as_operand(tensor, name) for name, tensor in memory.items()},
                {name: as_operand(tensor, name) for name, tensor in read.items()},
            )
    q_in, k_in = q, k
    if weights[0] is not None or weights[1] is not None:
        q_in, k_in = q.clone(), None if k is None else k.clone()
    q_rot, k_rot = torch_ops.rope_qk(config, q_in, k_in, *arguments[2:])
    for (name, tensor), rotated in zip(named, (q_rot, k_rot), strict=True):
        if tensor is not None:
            _refuse_unwritable(name, tensor, rotated)
    q.copy_(q_rot)
    if k is not None:
        k.copy_(k_rot)


def _named_arguments(arguments: tuple) -> tuple[tuple[tuple[str, Any], ...], dict]:
    """``rope_qk``'s ``arguments`` by the names the caller's API gives them: ``((q's name,
    q), (k's name, k))``, and what the call reads besides them (:func:`_read_only`)."""
    q, k, offsets, _, ids, cache, inverse, decode, q_weight, k_weight = arguments
    q_name, k_name = _argument_names(cache, inverse)
    read = _read_only(_position_name(decode), offsets, ids, cache, (q_weight, k_weight))
    return ((q_name, q), (k_name, k)), read


def _require_tensors(named: tuple, read: dict) -> None:
    """TypeError naming, as the caller's API does (:func:`_named_arguments`), an argument
    that is not a torch tensor: the dispatcher takes torch tensors only, and its own check
    knows only the schema's names (``k`` for the cos_sin_cache calls' ``key``,
    ``position_offset`` for decode's ``position``)."""
    for name, value in (*named, *read.items()):
        torch_ops.require_tensor(name, value)


def apply_rope(
    q: Any,
    k: Any,
    rope: RoPE,
    position_offset: Any = 0,
    *,
    positions: Any = None,
    q_norm_weight: Any = None,
    k_norm_weight: Any = None,
) -> tuple[Any, Any]:
    """Out-of-place RoPE: new rotated ``(q, k)`` (k may be None, giving None) at
    ``position_offset`` (int or ``[B]``) or at per-token ``positions`` (``[B, T]``, or
    ``[N]`` for packed q ``[N, num_heads*head_dim]``; see :meth:`RoPE.forward`), q and k
    untouched; with ``q_norm_weight``/``k_norm_weight`` each head row is RMS-normalised
    first (fused QK-RMSNorm, see :class:`RoPE`). On torch tensors that require grad the
    results carry a ``grad_fn``; the gradient is the inverse rotation (the Bwd kernels) at
    the same positions, then through the norm (to the data and both weights). Any
    framework works; this is the form to use inside autograd.

    Example::

        >>> import torch
        >>> rope = RoPE(head_dim=8, num_heads=2)
        >>> q = torch.randn(1, 3, 16, dtype=torch.float64, requires_grad=True)
        >>> q_rot, _ = apply_rope(q, None, rope)
        >>> q_rot.sum().backward()
        >>> q_rot, _ = apply_rope(q, None, rope, positions=torch.tensor([[40, 2, 9]]))
    """
    if not isinstance(rope, RoPE):
        raise TypeError(f"rope must be a RoPE component, got {type(rope).__name__}")
    weights = (q_norm_weight, k_norm_weight)
    if torch_ops.classify(q, k, position_offset, positions, *weights) is not torch_ops.DISPATCH:
        return rope.rotated(
            q, k, position_offset, ids=positions, q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
        )  # fmt: skip
    offsets, offset = _split_position(position_offset)
    arguments = (q, k, offsets, offset, positions, None, False, False, *weights)
    _require_tensors(*_named_arguments(arguments))
    q_rot, k_rot = torch_ops.rope_qk(rope.config, *arguments)
    return q_rot, None if k is None else k_rot


def apply_rope_with_cos_sin_cache(
    positions: Any, query: Any, key: Any, head_size: int, cos_sin_cache: Any, is_neox: bool = True
) -> tuple[Any, Any]:
    """FlashInfer's ``apply_rope_with_cos_sin_cache``: new rotated ``(query, key)`` (key may
    be None, giving None) with cos/sin read from the caller's table, inputs untouched.

    Args:
        positions: ``[N]`` int32/int64, one position per token, each in
            ``[0, max_position)``: host positions outside are refused before the launch;
            device ones are clamped by the kernel (never read out of bounds) and raise
            ValueError at a later cos_sin_cache call (the error flag, as :class:`RoPE`).
        query: ``[N, num_q_heads*head_size]`` or ``[N, num_q_heads, head_size]``.
        key: the same with num_k_heads (a divisor of num_q_heads), or None.
        head_size: the size of one head.
        cos_sin_cache: float32 ``[max_position, rotary_dim]``, contiguous: row p holds
            cos of the rotary_dim/2 pairs at position p, then their sin. The first
            rotary_dim columns of each head rotate; the rest are copied.
        is_neox: pairs ``(j, j + rotary_dim/2)`` (True) or ``(2j, 2j+1)`` (False).

    Any framework (the results in query's and key's: positions come first only by
    FlashInfer's order); on torch tensors that require grad the results carry a ``grad_fn``
    (the transpose rotation at the same positions). No gradient flows to the cache: one that
    requires grad (or carries a forward-mode tangent) is refused with ValueError.

    Example::

        >>> import numpy as np
        >>> angles = np.arange(16)[:, None] * 10000.0 ** (-np.arange(4) / 4)
        >>> cache = np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
        >>> q = np.ones((3, 2 * 16), np.float32)
        >>> q_rot, k_rot = apply_rope_with_cos_sin_cache(np.array([0, 5, 15]), q, None, 16, cache)
        >>> q_rot.shape, k_rot
        ((3, 32), None)
    """
    config, rope = _cache_component(query, key, head_size, cos_sin_cache, is_neox)
    if torch_ops.classify(query, key, positions, cos_sin_cache) is not torch_ops.DISPATCH:
        return (rope or component(config)).rotated(
            query, key, 0, ids=positions, cache=cos_sin_cache
        )
    arguments = (query, key, None, 0, positions, cos_sin_cache, False, False, None, None)
    _require_tensors(*_named_arguments(arguments))
    _refuse_differentiated_cache(cos_sin_cache)
    q_rot, k_rot = torch_ops.rope_qk(config, *arguments)
    return q_rot, None if key is None else k_rot


def apply_rope_with_cos_sin_cache_inplace(
    positions: Any, query: Any, key: Any, head_size: int, cos_sin_cache: Any, is_neox: bool = True
) -> None:
    """:func:`apply_rope_with_cos_sin_cache` in place (FlashInfer's ``..._inplace``):
    rotates query and key (None: query only) inside their memory, strided views included
    (last dim contiguous), and returns None. Torch tensors autograd tracks are recorded as
    torch's in-place ops are (a leaf that requires grad is refused). Positions or a cache
    that share memory with query or key are refused (a ValueError naming both) before
    anything is written.

    Example::

        >>> import numpy as np
        >>> cache = np.tile(np.float32([1, 1, 0, 0]), (8, 1))  # cos 1, sin 0: the identity
        >>> q, k = np.ones((2, 4), np.float32), np.ones((2, 1, 4), np.float32)
        >>> apply_rope_with_cos_sin_cache_inplace(np.array([1, 7]), q, k, 4, cache)
        >>> bool((q == 1).all() and (k == 1).all())
        True
    """
    config, rope = _cache_component(query, key, head_size, cos_sin_cache, is_neox)
    _in_place_call(config, query, key, 0, False, False, positions, cos_sin_cache, rope)


def _cache_component(
    query: Any, key: Any, head_size: Any, cache: Any, is_neox: Any
) -> tuple[tuple, RoPE | None]:
    """The configuration of the component that runs a cos_sin_cache call
    (:func:`_cache_config`) and that component, remembered by all they depend on: the
    shapes past the token count, ``head_size`` and ``is_neox`` with their types (``128.0``
    and ``1`` are refused where ``128`` and ``True`` pass). A decode step then checks its
    shapes once, not at every call, where checking and looking up the component cost
    about as much host time as the kernel of a small batch. While Dynamo traces, or where
    shapes are symbolic (``torch.export``): the configuration alone, checked, and no
    component (the trace runs once, and a component is built of concrete shapes only)."""
    if torch_ops.is_compiling():
        return _cache_config(query, key, head_size, cache, is_neox), None
    try:
        memo_key = (  # (a shape's tail tells its length too)
            query.shape[1:], None if key is None else key.shape[1:], cache.shape,
            type(head_size), head_size, type(is_neox), is_neox,
        )  # fmt: skip
        found = _CACHE_COMPONENTS.get(memo_key)
    except (AttributeError, TypeError):  # no shape, an unhashable or a symbolic one
        memo_key = found = None
    if found is not None:
        return found
    config = _cache_config(query, key, head_size, cache, is_neox)
    if memo_key is None:  # symbolic shapes (torch.export): the custom op will build the
        return config, None  # component, of concrete ones
    found = config, component(config)
    if len(_CACHE_COMPONENTS) >= TWINS:  # (shapes of every model a process serves)
        _CACHE_COMPONENTS.clear()
    _CACHE_COMPONENTS[memo_key] = found
    return found


def _cache_config(query: Any, key: Any, head_size: Any, cache: Any, is_neox: Any) -> tuple:
    """The configuration of the component that runs a cos_sin_cache call of these shapes
    (the scheme's table unused; every such component raises one device error flag)."""
    head_size = check_positive_int("head_size", head_size, even=True)
    is_neox = check_bool("is_neox", is_neox)
    heads = _packed_heads("query", query, head_size)
    kv_heads = heads if key is None else _packed_heads("key", key, head_size)
    if heads % kv_heads:
        raise ValueError(
            f"query's heads ({heads}) must be a multiple of key's ({kv_heads}), each "
            f"head_size={head_size} wide"
        )
    rotary_dim = cos_sin_cache_width(cache, head_size)
    return _component_config(
        _STANDARD_ARGS, int(rotary_dim), is_neox, head_size, heads, kv_heads, 0, "", _CACHE_FLAG,
        (), False, 0.0, 0.0,  # (no fused norm in the cos_sin_cache calls)
    )  # fmt: skip


def _packed_heads(name: str, tensor: Any, head_size: int) -> int:
    """Heads of packed tokens ``[N, heads*head_size]`` or ``[N, heads, head_size]``."""
    shape = tuple(getattr(tensor, "shape", ()))
    if len(shape) == 3 and shape[2] == head_size and shape[1] > 0:
        return shape[1]
    if len(shape) == 2 and shape[1] % head_size == 0 and shape[1] > 0:
        return shape[1] // head_size
    raise ValueError(
        f"{name} must be [N, heads*head_size] or [N, heads, head_size] with head_size="
        f"{head_size}, got shape {shape if shape else type(tensor).__name__}"
    )


# one device error flag for every cos_sin_cache call, held here: its twins come and go
_CACHE_FLAG, _CACHE_ERRORS = configuration_flag(("apply_rope_with_cos_sin_cache",))
_STANDARD_ARGS = scheme_args(Standard())
_CACHE_COMPONENTS: dict[tuple, tuple[tuple, RoPE]] = {}  # see _cache_component


def _refuse_unwritable(name: str, tensor: Any, rotated: Any) -> None:
    """torch's own checks of the in-place write of ``rotated`` into ``tensor`` under
    autograd or a transform (a view of a leaf that requires grad, one of several views a
    function such as ``split`` returned, a view made under no_grad, an inference tensor,
    an unbatched tensor written from a batched one under vmap), run by the same ``copy_``
    on empty slices of both, which writes nothing. The rotated q and k are copied in one
    after the other, so k must be refused before q's copy rather than fail at its own; and
    q too, since an inference tensor's copy fails only after writing (at its version
    counter).

    The rehearsal writes nothing, so the version counter it bumps (shared with every view
    of the same memory) is put back: a call refused after it must not leave a tensor saved
    for backward looking modified, nor a view made under no_grad unusable. (Inference
    tensors keep no counter; under vmap the one put back is the batched wrapper's, not its
    base's.)"""
    import torch

    # (Dynamo traces the preserving context but not the inference questions)
    inference = not torch_ops.is_compiling() and (
        torch.is_inference_mode_enabled() or tensor.is_inference()
    )
    keeps_version = not inference
    unchanged = torch.autograd._unsafe_preserve_version_counter
    try:
        with unchanged(tensor) if keeps_version else contextlib.nullcontext():
            tensor.narrow(-1, 0, 0).copy_(rotated.narrow(-1, 0, 0))
    except RuntimeError as error:
        raise ValueError(f"{name} cannot be rotated in place here: {error}") from error


def _refuse_differentiated_cache(cache: Any) -> None:
    """The cos_sin_cache calls differentiate query and key only: a cache that requires grad
    (or carries a tangent) is refused, before any write, rather than left without its
    gradient."""
    if cache is not None and torch_ops.differentiated(cache):
        raise ValueError(
            "cos_sin_cache requires grad (or carries a forward-mode tangent), but no gradient "
            "flows to it (the rotation is differentiated with respect to query and key only); "
            "pass cos_sin_cache.detach()"
        )


def _read_only(position_name: str, offsets: Any, ids: Any, cache: Any, weights: tuple) -> dict:
    """The arguments an in-place call reads besides q and k, by name (those given): what
    must lie apart from the memory it writes (:func:`check_in_place`)."""
    named = (
        (position_name, offsets), ("positions", ids), ("cos_sin_cache", cache),
        ("q_norm_weight", weights[0]), ("k_norm_weight", weights[1]),
    )  # fmt: skip
    return {name: value for name, value in named if value is not None}


def _position_name(decode: bool) -> str:
    """What the caller's API calls the position argument, for its errors: ``decode``'s
    ``position`` (one per sequence), ``position_offset`` elsewhere."""
    return "position" if decode else "position_offset"


def _argument_names(cache: Any, inverse: bool) -> tuple[str, str]:
    """What the caller's API calls q and k, for its errors: FlashInfer's ``query`` and
    ``key`` in the cos_sin_cache calls (``cache`` given), :meth:`RoPE.backward`'s
    ``grad_q`` and ``grad_k`` for the inverse rotation, ``q`` and ``k`` elsewhere."""
    if cache is not None:
        return "query", "key"
    return ("grad_q", "grad_k") if inverse else ("q", "k")


def _byte_span(tensor: Any) -> int:
    """Bytes from a torch tensor's first element to just past its last."""
    extents = zip(tensor.shape, tensor.stride(), strict=True)
    last = sum((size - 1) * stride for size, stride in extents)
    return (last + 1) * tensor.element_size()


def _split_position(position: Any, name: str = "position_offset") -> tuple[Any, Any]:
    """(offsets tensor or None, int offset): a position as the custom ops take it (their
    schema's int is int64; a tensor argument is checked as the call dispatches)."""
    if is_int(position):
        if not -(2**63) <= position < 2**63:
            raise ValueError(
                f"{name} must be a position in [0, max_position) (2**24 without one), got "
                f"{position}"
            )
        return None, position
    if type(position).__name__ == "SymInt":
        return None, position
    _refuse_scalar_position(position, name)
    return position, 0


def _refuse_scalar_position(position: Any, name: str) -> None:
    """TypeError for a bool or a non-integral number given as a position offset (a bool is
    an int to Python, and a float is no array: either would otherwise be misread)."""
    if isinstance(position, (bool, np.bool_, float, complex, np.floating, np.complexfloating)):
        raise TypeError(
            f"{name} must be an int or an int32/int64 tensor of shape [B], got "
            f"{type(position).__name__} {position!r}"
        )


# --------------------------------------------------------------------------- rebuilt by value


@functools.lru_cache(maxsize=TWINS)  # (see _cache.TWINS)
def _seed_op(config: tuple) -> _RotaryOp:
    scheme, numbers, rotary_dim, neox, inverse, input_layout, max_position, target, flag = config
    if max_position:
        cls = RoPENeoxPositionIdsBwdOp if inverse else RoPENeoxPositionIdsFwdOp
    else:
        cls = RoPEBwdOp if inverse else RoPEFwdOp
    op = cls.__new__(cls)
    op._setup(
        scheme_from_args(scheme, numbers), "neox" if neox else "interleaved", input_layout,
        target or None, rotary_dim or None, max_position or None, flag,
    )  # fmt: skip
    return op


def seed_op(config: tuple) -> _RotaryOp:
    """The seed op a torch custom op's configuration describes (its twin)."""
    return _seed_op((config[0], tuple(config[1]), *config[2:]))  # (the schema's float[]: a list)


def _component_config(
    scheme: tuple[str, tuple[float, ...]],
    rotary_dim: int,
    neox: bool,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    max_position: int,
    target: str,
    flag: int,
    mrope_section: tuple[int, ...],
    mrope_interleaved: bool,
    norm_eps: float,
    norm_weight_offset: float,
) -> tuple:
    """A component by value, in the order of the custom ops' schema (_torch_ops
    ``_COMPONENT_CONFIG``); ``scheme``: ``scheme_args`` of its scheme."""
    return (
        *scheme, rotary_dim, neox, head_dim, num_heads, num_kv_heads, max_position, target,
        flag, mrope_section, mrope_interleaved, norm_eps, norm_weight_offset,
    )  # fmt: skip


@functools.lru_cache(maxsize=TWINS)  # (see _cache.TWINS)
def _component(config: tuple) -> RoPE:
    (
        scheme, numbers, rotary_dim, neox, head_dim, heads, kv_heads, max_position, target,
        flag, mrope_section, mrope_interleaved, norm_eps, norm_weight_offset,
    ) = config  # fmt: skip
    twin = RoPE(
        head_dim, heads, kv_heads, scheme=scheme_from_args(scheme, numbers),
        rotary_dim=rotary_dim, rope_layout="neox" if neox else "interleaved",
        max_position=max_position or None, target=target or None,
        mrope_section=mrope_section or None, mrope_interleaved=mrope_interleaved,
        norm_eps=norm_eps, norm_weight_offset=norm_weight_offset,
    )  # fmt: skip
    twin._adopt_flag(flag)
    return twin


def component(config: tuple) -> RoPE:
    """The component a torch custom op's configuration describes (its twin; every
    cos_sin_cache call's, one per configuration)."""
    section = tuple(config[10])  # lists (the schema's int[]) are not hashable
    return _component((config[0], tuple(config[1]), *config[2:10], section, *config[11:]))
