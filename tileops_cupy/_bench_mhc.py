"""Bench rows of mHC pre and post and their backward (../shared/PERF.md), beside torch eager
and torch.compile of the same float32 math.

Bytes: pre reads x and phi (and b) once and writes x_res, x_layer and h_post once; its
one-pass floor is those bytes over the copy ceiling. Post reads x_layer_out, h_post and
x_res once and writes x_out once. Batches of at most 128 tokens are latency rows: the
end-to-end time of one Python call (host dispatch included), with the device time in the
note. The backward rows time torch's autograd of the same math as forward+backward minus
forward; pre backward's one-pass floor reads x, the three upstream gradients and phi once and
writes grad_x and grad_phi once.
"""

from __future__ import annotations

import math

from ._bench_harness import (
    add_copy_reference,
    format_row,
    make_row,
    measure_row,
    median_us,
    torch_module,
)

_ALPHAS = (0.8, 1.2, 1.0)
_REPEAT, _EPS = 20, 0.02


def torch_pre(phi, x, b, n: int, alphas=_ALPHAS, repeat: int = _REPEAT, eps: float = _EPS):
    """SPEC section 4 in torch, float32 throughout (no TF32: ``x @ phi`` must be float32)."""
    torch = torch_module()
    batch, width = x.shape
    xf = x.float()
    h = xf @ phi
    rms = xf.square().sum(-1, keepdim=True).sqrt() / math.sqrt(width) + 1e-4
    pre = torch.sigmoid(alphas[0] * h[:, :n] / rms + b[:n])
    post = 2 * torch.sigmoid(alphas[1] * h[:, n : 2 * n] / rms + b[n : 2 * n])
    logits = (alphas[2] * h[:, 2 * n :] / rms + b[2 * n :]).view(batch, n, n)
    m = torch.exp(logits - logits.amax(-1, keepdim=True))
    for _ in range(repeat):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    streams = xf.view(batch, n, width // n)
    x_layer = (pre.unsqueeze(1) @ streams).squeeze(1).to(x.dtype)
    x_res = (m @ streams).reshape(batch, width).to(x.dtype)
    return x_res, x_layer, post


def torch_post(x_layer_out, h_post, x_res):
    batch, c_x = x_layer_out.shape
    n = h_post.shape[1]
    mixed = h_post[:, :, None] * x_layer_out.float()[:, None, :] + x_res.float().view(batch, n, c_x)
    return mixed.view(batch, n * c_x).to(x_res.dtype)


def _pre_inputs(batch: int, n: int, c_x: int, dtype: str = "bfloat16") -> tuple:
    """(phi float32 [n*c_x, Q] scaled to unit logits, x [batch, n*c_x] of ``dtype``, b
    float32 [Q]) on the device."""
    torch = torch_module()
    width, q = n * c_x, n * n + 2 * n
    phi = torch.randn(width, q, device="cuda") / math.sqrt(width)
    x = torch.randn(batch, width, device="cuda").to(getattr(torch, dtype))
    return phi, x, 0.5 * torch.randn(q, device="cuda")


def _pre_row(ceiling: float, batch: int, n: int, c_x: int, with_compile: bool) -> dict:
    from .sequence_modeling import MHCPreFwdOp

    phi, x, b = _pre_inputs(batch, n, c_x)
    width, q = phi.shape
    op = MHCPreFwdOp(*_ALPHAS, _REPEAT, _EPS)
    moved = x.numel() * 2 + phi.numel() * 4 + q * 4 + batch * (width + c_x) * 2 + batch * n * 4
    small = batch <= 128

    def note(row: dict) -> str:  # (printed with the row: the targets are in these figures)
        text = f"{row['ours_us'] / row['floor_us']:.2f}x one-pass floor"
        if small:
            text += f"; device {median_us(lambda: op(phi, x, b)):.1f} us"
        return text

    return measure_row(
        f"mhc pre B{batch} n{n} c_x{c_x} bf16",
        lambda: op(phi, x, b),
        lambda: torch_pre(phi, x, b, n),
        moved,
        ceiling,
        small=small,
        with_compile=with_compile,
        note=note,
    )


def _post_inputs(batch: int, n: int, c_x: int) -> tuple:
    """(x_layer_out bf16, h_post float32 in (0, 2), x_res bf16) on the device."""
    torch = torch_module()
    layer = torch.randn(batch, c_x, device="cuda").bfloat16()
    gates = 2 * torch.rand(batch, n, device="cuda")
    return layer, gates, torch.randn(batch, n * c_x, device="cuda").bfloat16()


def _post_row(ceiling: float, batch: int, n: int, c_x: int, with_compile: bool) -> dict:
    from .sequence_modeling import MHCPostFwdOp

    layer, gates, res = _post_inputs(batch, n, c_x)
    op = MHCPostFwdOp()
    moved = layer.numel() * 2 + gates.numel() * 4 + 2 * res.numel() * 2
    row = measure_row(
        f"mhc post B{batch} n{n} c_x{c_x} bf16",
        lambda: op(layer, gates, res),
        lambda: torch_post(layer, gates, res),
        moved,
        ceiling,
        with_compile=with_compile,
    )
    row["floor_us"] = None
    return row


def _backward_us(forward, leaves, upstream) -> float:
    """Device time of torch autograd's backward of ``forward(*leaves)`` for the gradients
    ``upstream``: forward+backward minus forward (both median, L2 flushed)."""
    torch = torch_module()
    forward(*leaves)  # compiles, when forward is compiled

    def forward_backward():
        return torch.autograd.grad(forward(*leaves), leaves, upstream)

    return median_us(forward_backward) - median_us(lambda: forward(*leaves))


def _backward_row(
    name: str, ours, forward, leaves, upstream, moved: int, ceiling: float, with_compile: bool
) -> dict:
    """A row for a backward op: ours against torch autograd of ``forward`` (eager and
    torch.compile), printed like measure_row's."""
    torch = torch_module()
    ours_us = median_us(ours)
    eager_us = _backward_us(forward, leaves, upstream)
    compile_us = None
    if with_compile:
        compile_us = _backward_us(torch.compile(forward, dynamic=False), leaves, upstream)
    row = make_row(name, ours_us, eager_us, compile_us, moved, ceiling)
    add_copy_reference(row, moved, ceiling)
    return row


def _pre_backward_row(ceiling: float, batch: int, n: int, c_x: int, with_compile: bool) -> dict:
    from .sequence_modeling import MHCPreBwdOp

    torch = torch_module()
    phi, x, b = _pre_inputs(batch, n, c_x)
    width = phi.shape[0]
    upstream = (
        torch.randn(batch, width, device="cuda").bfloat16(),  # grad_x_res
        torch.randn(batch, c_x, device="cuda").bfloat16(),  # grad_x_layer
        torch.randn(batch, n, device="cuda"),  # grad_h_post
    )
    op = MHCPreBwdOp(*_ALPHAS, _REPEAT, _EPS)
    # read once: x, the upstream gradients, phi; written once: grad_x, grad_phi
    moved = 2 * x.numel() * 2 + sum(u.numel() * u.element_size() for u in upstream)
    moved += 2 * phi.numel() * 4
    leaves = [t.clone().requires_grad_() for t in (phi, x, b)]
    leaves += [torch.tensor(a, device="cuda", requires_grad=True) for a in _ALPHAS]

    def forward(phi, x, b, *alphas):
        return torch_pre(phi, x, b, n, alphas)

    row = _backward_row(
        f"mhc pre-bwd B{batch} n{n} c_x{c_x} bf16",
        lambda: op(phi, x, b, *upstream),
        forward,
        leaves,
        upstream,
        moved,
        ceiling,
        with_compile,
    )
    row["note"] = f"{row['ours_us'] / row['floor_us']:.2f}x one-pass floor; {row['note']}"
    print(format_row(row), flush=True)
    return row


def _post_backward_row(ceiling: float, batch: int, n: int, c_x: int, with_compile: bool) -> dict:
    from .sequence_modeling import MHCPostBwdOp

    torch = torch_module()
    layer, gates, res = _post_inputs(batch, n, c_x)
    grad_out = torch.randn(batch, n * c_x, device="cuda").bfloat16()
    op = MHCPostBwdOp()
    # read once: x_layer_out, h_post, grad_x_out; written once: the gradients of the first
    # two (grad_x_res is grad_x_out itself)
    moved = 2 * (layer.numel() * 2 + gates.numel() * 4) + grad_out.numel() * 2
    leaves = [t.clone().requires_grad_() for t in (layer, gates, res)]
    row = _backward_row(
        f"mhc post-bwd B{batch} n{n} c_x{c_x} bf16",
        lambda: op(layer, gates, res, grad_out),
        torch_post,
        leaves,
        (grad_out,),
        moved,
        ceiling,
        with_compile,
    )
    row["floor_us"] = None
    print(format_row(row), flush=True)
    return row


def mhc_rows(copy_ceiling_gbs: float, with_compile: bool = True) -> list[dict]:
    """PERF.md's mHC rows plus a B4 decode row and the backward rows, each a dict with name,
    ours_us, eager_us, compile_us, gbs, pct_ceiling, floor_us (pre and pre-bwd) and note."""
    torch = torch_module()
    rows = []
    for batch, c_x in ((1, 1280), (4, 7168), (128, 4096), (4096, 4096), (16384, 7168)):
        rows.append(_pre_row(copy_ceiling_gbs, batch, 4, c_x, with_compile))
        torch.cuda.empty_cache()  # the row's tensors are gone; give the next row the memory
    for batch, c_x in ((4096, 4096), (16384, 7168)):
        rows.append(_post_row(copy_ceiling_gbs, batch, 4, c_x, with_compile))
        torch.cuda.empty_cache()
    for batch, c_x in ((4096, 4096), (16384, 7168)):
        rows.append(_pre_backward_row(copy_ceiling_gbs, batch, 4, c_x, with_compile))
        torch.cuda.empty_cache()
        rows.append(_post_backward_row(copy_ceiling_gbs, batch, 4, c_x, with_compile))
        torch.cuda.empty_cache()
    return rows
