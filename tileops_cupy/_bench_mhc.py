"""Bench rows of mHC pre and post (../shared/PERF.md), beside torch eager and torch.compile
of the same float32 math.

Bytes: pre reads x and phi (and b) once and writes x_res, x_layer and h_post once; its
one-pass floor is those bytes over the copy ceiling. Post reads x_layer_out, h_post and
x_res once and writes x_out once. Batches of at most 128 tokens are latency rows: the
end-to-end time of one Python call (host dispatch included), with the device time in the
note.
"""

from __future__ import annotations

import math

from .bench import _torch, measure_row, median_us

_ALPHAS = (0.8, 1.2, 1.0)
_REPEAT, _EPS = 20, 0.02


def torch_pre(phi, x, b, n: int, alphas=_ALPHAS, repeat: int = _REPEAT, eps: float = _EPS):
    """SPEC section 4 in torch, float32 throughout (no TF32: ``x @ phi`` must be float32)."""
    torch = _torch()
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


def _pre_row(ceiling: float, batch: int, n: int, c_x: int, with_compile: bool) -> dict:
    from .sequence_modeling import MHCPreFwdOp

    torch = _torch()
    width, q = n * c_x, n * n + 2 * n
    phi = torch.randn(width, q, device="cuda") / math.sqrt(width)
    b = 0.5 * torch.randn(q, device="cuda")
    x = torch.randn(batch, width, device="cuda").bfloat16()
    op = MHCPreFwdOp(*_ALPHAS, _REPEAT, _EPS)
    moved = x.numel() * 2 + phi.numel() * 4 + q * 4 + batch * (width + c_x) * 2 + batch * n * 4
    small = batch <= 128
    row = measure_row(
        f"mhc pre B{batch} n{n} c_x{c_x} bf16",
        lambda: op(phi, x, b),
        lambda: torch_pre(phi, x, b, n),
        moved,
        ceiling,
        small=small,
        with_compile=with_compile,
    )
    row["note"] = f"{row['ours_us'] / row['floor_us']:.2f}x one-pass floor"
    if small:
        row["note"] += f"; device {median_us(lambda: op(phi, x, b)):.1f} us"
    return row


def _post_row(ceiling: float, batch: int, n: int, c_x: int, with_compile: bool) -> dict:
    from .sequence_modeling import MHCPostFwdOp

    torch = _torch()
    layer = torch.randn(batch, c_x, device="cuda").bfloat16()
    gates = 2 * torch.rand(batch, n, device="cuda")
    res = torch.randn(batch, n * c_x, device="cuda").bfloat16()
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


def mhc_rows(copy_ceiling_gbs: float, with_compile: bool = True) -> list[dict]:
    """PERF.md's mHC rows plus a B4 decode row, each a dict with name, ours_us, eager_us,
    compile_us, gbs, pct_ceiling, floor_us (pre only) and note."""
    torch = _torch()
    rows = []
    for batch, c_x in ((1, 1280), (4, 7168), (128, 4096), (4096, 4096), (16384, 7168)):
        rows.append(_pre_row(copy_ceiling_gbs, batch, 4, c_x, with_compile))
        torch.cuda.empty_cache()  # the row's tensors are gone; give the next row the memory
    for batch, c_x in ((4096, 4096), (16384, 7168)):
        rows.append(_post_row(copy_ceiling_gbs, batch, 4, c_x, with_compile))
        torch.cuda.empty_cache()
    return rows
