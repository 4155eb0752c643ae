"""Bench rows of the host (NumPy) path, which runs without a GPU (``--only host``): RoPE
B1 S4096 H32 D128 through :class:`~tileops_cupy.rope.RoPEFwdOp` on NumPy arrays, beside
torch's CPU eager of the same math (``torch_rope``: float32 rotation, one rounding) on the
same machine. Target (issue 10): at or below torch's time for bf16 and fp32. The ceiling is
this host's memory copy (``np.copyto`` of 256 MiB, bytes read plus written); times are
medians of whole calls.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from ._bench_harness import format_row, make_row, rope_tables, torch_module, torch_rope


def wall_us(fn: Callable[[], object], runs: int = 7) -> float:
    """Median wall time of one call, in µs, after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[runs // 2] * 1e6


def host_copy_ceiling_gbs() -> float:
    source = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8)
    target = np.empty_like(source)
    return 2 * source.nbytes / (wall_us(lambda: np.copyto(target, source)) * 1e-6) / 1e9


def host_rows() -> list[dict]:
    import ml_dtypes

    from . import rope

    torch = torch_module()
    ceiling = host_copy_ceiling_gbs()
    print(
        f"host: {os.cpu_count()} CPUs, torch on {torch.get_num_threads()} threads, "
        f"copy ceiling {ceiling:.0f} GB/s",
        flush=True,
    )
    batch, seq, heads, head_dim = 1, 4096, 32, 128
    cos, sin = rope_tables(rope.Standard(), seq, head_dim, device="cpu")
    reference = torch_rope(cos[:, None, :], sin[:, None, :], neox=True)
    op = rope.RoPEFwdOp("neox", "2d")
    rows = []
    for dtype in ("bfloat16", "float32"):
        x = torch.randn(batch, seq, heads, head_dim).to(getattr(torch, dtype))
        if dtype == "bfloat16":  # (numpy has no bfloat16: the bits, seen as ml_dtypes')
            x_host = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            x_host = x.numpy()
        ours_us = wall_us(lambda x_host=x_host: op(x_host))
        eager_us = wall_us(lambda x=x: reference(x))
        ratio = ours_us / eager_us
        note = f"{ratio:.2f}x torch CPU eager; target <= 1x: {'met' if ratio <= 1 else 'MISSED'}"
        name = f"host rope neox B{batch} S{seq} H{heads} D{head_dim} {dtype}"
        row = make_row(name, ours_us, eager_us, None, 2 * x_host.nbytes, ceiling, note)
        print(format_row(row), flush=True)
        rows.append(row)
    return rows
