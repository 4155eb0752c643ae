"""The bench harness (a leaf: every rows module imports it, it imports none of them).

Method (../shared/PERF.md): the copy ceiling is measured first, in the same process
(``y.copy_(x)`` on 512 MiB, bytes read plus written over the median time); every row then
reports our median time, GB/s and % of that ceiling, beside torch eager and
``torch.compile`` of the same math in the same run, and (bandwidth rows) the % that a copy of
the same bytes reaches, timed the same way. Bandwidth rows use random data larger
than L2 and ``triton.testing.do_bench`` (which flushes L2 between runs); decode-sized rows
report the end-to-end time of one Python call, host dispatch included. Bytes: each input
read once, each output written once; RoPE tables are op state and not counted.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import numpy as np


def torch_module():
    import torch

    return torch


@functools.cache
def _reset_persisting_lines() -> Callable[[], None]:
    """``reset()``: the device idle, then L2's persisting lines back to normal.

    do_bench's flush (a 256 MB write) does not evict lines that a kernel loaded under an
    evict-last policy (TileOPs' neox RoPE loads so): up to the persisting set-aside (9.8
    MB by default on an H100) they stay in L2, and whatever is timed next on the same tensors
    reads them from there. On an H100 (the performance log, thirty-second session) our RoPE
    B2 S2048 took 28.6 µs alone and 25.7 right after TileOPs' on the same x, a plain copy of
    its bytes 28.1 alone and 24.6 right after an evict-last copy of them. (The reset acts at
    once, not in stream order: hence the idle device first.)"""
    import ctypes

    torch = torch_module()
    reset_persisting_l2 = ctypes.CDLL("libcuda.so.1").cuCtxResetPersistingL2Cache

    def reset() -> None:
        torch.cuda.synchronize()
        status = reset_persisting_l2()
        if status != 0:
            raise RuntimeError(f"cuCtxResetPersistingL2Cache failed: CUresult {status}")

    return reset


def median_us(fn: Callable[[], object]) -> float:
    """Device time of one call (CUDA events, L2 flushed between runs), median, in µs. L2's
    persisting lines are reset first (:func:`_reset_persisting_lines`), so that no earlier
    measurement's evict-last loads are still in L2."""
    from triton.testing import do_bench

    _reset_persisting_lines()()
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """End-to-end wall time of one Python call (host dispatch included), in µs."""
    torch = torch_module()
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


# What triton.testing.do_bench zeroes before each timed run, to flush L2.
_FLUSH_BYTES = 256 << 20


@functools.cache
def flush_us() -> float:
    """Device time of do_bench's flush (:func:`median_us` of the same write), in µs, once a
    process. A call whose host dispatch takes longer than this leaves the device idle inside
    its timed span (the start event follows the flush in the stream, the call's kernels
    arrive later), so its time then counts host time: :func:`host_us` tells such calls
    apart."""
    torch = torch_module()
    cache = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    return median_us(cache.zero_)


def host_us(fn: Callable[[], object], calls: int = 20) -> float:
    """Host time of one call, from the call to its return, median, in µs: the device idle
    before each, so that no call waits for room in the launch queue."""
    torch = torch_module()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return float(np.median(times))


def copy_ceiling_gbs() -> float:
    torch = torch_module()
    x = torch.empty(512 << 20, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    return 2 * x.numel() / (median_us(lambda: y.copy_(x)) * 1e-6) / 1e9


_copy_pct: dict[tuple[int, float], float] = {}


def copy_pct(bytes_moved: int, ceiling: float) -> float:
    """% of the ceiling that ``y.copy_(x)`` reaches moving ``bytes_moved`` (read plus
    written), timed as the rows are: what a kernel of that size can hope for, since the L2
    flush between runs leaves dirty lines whose write-back (2-6 µs) lands in every timed
    launch, and a launch's ramp-up and last wave weigh more the less it moves (67 MB: about
    75-82%). Once per size."""
    key = (bytes_moved, ceiling)
    if key not in _copy_pct:
        torch = torch_module()
        x = torch.empty(bytes_moved // 2, dtype=torch.uint8, device="cuda").random_()
        y = torch.empty_like(x)
        us = median_us(lambda: y.copy_(x))
        _copy_pct[key] = 100 * 2 * x.numel() / (us * 1e-6) / 1e9 / ceiling
    return _copy_pct[key]


def add_copy_reference(row: dict, bytes_moved: int, ceiling: float) -> None:
    """Add to a bandwidth row (and its note) the % a copy of its bytes reaches."""
    row["copy_pct_ceiling"] = copy_pct(bytes_moved, ceiling)
    same = f"a copy of these bytes {row['copy_pct_ceiling']:.1f}%"
    row["note"] = f"{row['note']}; {same}" if row.get("note") else same


def compiled(fn):
    """``fn`` under ``torch.compile`` (static shapes)."""
    return torch_module().compile(fn, dynamic=False)


def measure_row(
    name: str,
    ours: Callable[[], object],
    reference: Callable[[], object] | None,
    bytes_moved: int,
    ceiling: float,
    small: bool = False,
    with_compile: bool = True,
    note: str | Callable[[dict], str] = "",
) -> dict:
    """Time ``ours`` and the torch ``reference`` (eager and compiled), print and return a row.

    ``small`` rows are latency rows: end-to-end time of one Python call. ``note``: its text,
    or a function that makes it from the row (its times and floor) before it is printed."""
    timer = call_us if small else median_us
    ours_us = timer(ours)
    eager_us = timer(reference) if reference is not None else None
    compile_us = None
    if with_compile and reference is not None:
        reference_compiled = compiled(reference)
        reference_compiled()
        compile_us = timer(reference_compiled)
    row = make_row(name, ours_us, eager_us, compile_us, bytes_moved, ceiling)
    row["note"] = note(row) if callable(note) else note
    if not small and bytes_moved:
        add_copy_reference(row, bytes_moved, ceiling)
    print(format_row(row), flush=True)
    return row


def make_row(
    name: str,
    ours_us: float,
    eager_us: float | None,
    compile_us: float | None,
    bytes_moved: int,
    ceiling: float,
    note: str = "",
) -> dict:
    """One row: times, and the bandwidth and floor that ``bytes_moved`` gives them."""
    gbs = bytes_moved / (ours_us * 1e-6) / 1e9
    return {
        "name": name,
        "ours_us": ours_us,
        "eager_us": eager_us,
        "compile_us": compile_us,
        "gbs": gbs,
        "pct_ceiling": 100 * gbs / ceiling,
        "floor_us": bytes_moved / (ceiling * 1e3),
        "note": note,
    }


# --------------------------------------------------------------------------- RoPE rows


def torch_rope(cos, sin, neox: bool, inverse: bool = False):
    """The same math as our kernels, in torch: float32 rotation, one rounding."""
    torch = torch_module()
    sign = -1.0 if inverse else 1.0

    def rope(x):
        xf = x.float()
        if neox:
            x1, x2 = xf.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin * sign, x2 * cos + x1 * sin * sign], -1).to(
                x.dtype
            )
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        y = torch.stack([x1 * cos - x2 * sin * sign, x2 * cos + x1 * sin * sign], -1)
        return y.flatten(-2).to(x.dtype)

    return rope


def rope_tables(scheme, seq: int, head_dim: int, positions=None, device: str = "cuda"):
    torch = torch_module()
    inv = scheme.inv_freq(head_dim)
    pos = np.arange(seq) if positions is None else positions
    angles = pos[:, None].astype(np.float64) * inv
    a = scheme.amplitude(head_dim)
    cos = torch.tensor(a * np.cos(angles), dtype=torch.float32, device=device)
    sin = torch.tensor(a * np.sin(angles), dtype=torch.float32, device=device)
    return cos, sin


def format_row(r: dict) -> str:
    def num(v, fmt="{:9.1f}"):
        return fmt.format(v) if v is not None and not math.isnan(v) else " " * 8 + "-"

    return (
        f"| {r['name']:<44} | {num(r['ours_us'])} | {num(r['gbs'], '{:7.0f}')} | "
        f"{num(r['pct_ceiling'], '{:5.1f}')}% | {num(r['eager_us'])} | {num(r['compile_us'])} |"
        + (f" {r['note']}" if r.get("note") else "")
    )


HEADER = (
    "| workload                                     |   ours µs |    GB/s | % ceil |  eager µs "
    "| compile µs |\n|---|---|---|---|---|---|"
)
