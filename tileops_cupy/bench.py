"""Benchmark: ``python -m tileops_cupy.bench [--json] [--only rope|component|mhc|dispatch]``.

Method (../shared/PERF.md): the copy ceiling is measured first, in the same process
(``y.copy_(x)`` on 512 MiB, bytes read plus written over the median time); every row then
reports our median time, GB/s and % of that ceiling, beside torch eager and
``torch.compile`` of the same math in the same run. Bandwidth rows use random data larger
than L2 and ``triton.testing.do_bench`` (which flushes L2 between runs); decode-sized rows
report the end-to-end time of one Python call, host dispatch included. Bytes: each input
read once, each output written once; RoPE tables are op state and not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable

import numpy as np


def _torch():
    import torch

    return torch


def median_us(fn: Callable[[], object]) -> float:
    """Device time of one call (CUDA events, L2 flushed between runs), median, in µs."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """End-to-end wall time of one Python call (host dispatch included), in µs."""
    torch = _torch()
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def copy_ceiling_gbs() -> float:
    torch = _torch()
    x = torch.empty(512 << 20, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    return 2 * x.numel() / (median_us(lambda: y.copy_(x)) * 1e-6) / 1e9


def _compiled(fn):
    torch = _torch()
    compiled = torch.compile(fn, dynamic=False)
    return compiled


def measure_row(
    name: str,
    ours: Callable[[], object],
    reference: Callable[[], object] | None,
    bytes_moved: int,
    ceiling: float,
    small: bool = False,
    with_compile: bool = True,
    note: str = "",
) -> dict:
    """Time ``ours`` and the torch ``reference`` (eager and compiled), print and return a row.

    ``small`` rows are latency rows: end-to-end time of one Python call."""
    timer = call_us if small else median_us
    ours_us = timer(ours)
    eager_us = timer(reference) if reference is not None else None
    compile_us = None
    if with_compile and reference is not None:
        compiled = _compiled(reference)
        compiled()
        compile_us = timer(compiled)
    gbs = bytes_moved / (ours_us * 1e-6) / 1e9
    row = {
        "name": name,
        "ours_us": ours_us,
        "eager_us": eager_us,
        "compile_us": compile_us,
        "gbs": gbs,
        "pct_ceiling": 100 * gbs / ceiling,
        "floor_us": bytes_moved / (ceiling * 1e3),
        "note": note,
    }
    print(_format_row(row), flush=True)
    return row


# --------------------------------------------------------------------------- RoPE rows


def _torch_rope(cos, sin, neox: bool, inverse: bool = False):
    """The same math as our kernels, in torch: float32 rotation, one rounding."""
    torch = _torch()
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


def _rope_tables(scheme, seq: int, head_dim: int, positions=None):
    torch = _torch()
    inv = scheme.inv_freq(head_dim)
    pos = np.arange(seq) if positions is None else positions
    angles = pos[:, None].astype(np.float64) * inv
    a = scheme.amplitude(head_dim)
    cos = torch.tensor(a * np.cos(angles), dtype=torch.float32, device="cuda")
    sin = torch.tensor(a * np.sin(angles), dtype=torch.float32, device="cuda")
    return cos, sin


def rope_rows(ceiling: float, with_compile: bool = True) -> list[dict]:
    from . import rope

    torch = _torch()
    rows = []
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

    def row(name, ours, ref, x_bytes, small=False, compile_ref=True, extra_bytes=0):
        rows.append(
            measure_row(name, ours, ref, 2 * x_bytes + extra_bytes, ceiling, small,
                        with_compile and compile_ref)
        )  # fmt: skip

    ops = {
        "rope": lambda layout: (rope.RoPEFwdOp(layout, "2d"), rope.Standard()),
        "llama31": lambda layout: (rope.RoPELlama31FwdOp("2d"), rope.Llama31()),
        "yarn": lambda layout: (rope.YaRNFwdOp("2d"), rope.YaRN()),
        "longrope": lambda layout: (
            rope.LongRoPEFwdOp("2d", max_position_embeddings=131072),
            rope.LongRoPE(max_position_embeddings=131072),
        ),
        "rope-bwd": lambda layout: (rope.RoPEBwdOp(layout, "2d"), rope.Standard()),
    }
    shapes = [(8, 4096, 32, 128), (2, 2048, 32, 128)]
    cases = [("rope", layout, dt) for layout in ("neox", "interleaved") for dt in dtypes]
    cases += [(op, "neox", "bf16") for op in ("llama31", "yarn", "longrope", "rope-bwd")]
    for shape in shapes:
        batch, seq, heads, head_dim = shape
        for op_name, layout, dt in cases:
            op, scheme = ops[op_name](layout)
            x = torch.randn(shape, device="cuda").to(dtypes[dt])
            cos, sin = _rope_tables(scheme, seq, head_dim)
            cos, sin = cos[:, None, :], sin[:, None, :]
            ref = _torch_rope(cos, sin, layout == "neox", op_name.endswith("bwd"))
            is_perf_row = op_name == "rope" and (dt == "bf16" or shape[0] == 2)
            row(
                f"{op_name} {layout} B{batch} S{seq} H{heads} D{head_dim} {dt}",
                lambda op=op, x=x: op(x),
                lambda ref=ref, x=x: ref(x),
                x.numel() * x.element_size(),
                compile_ref=is_perf_row,
            )

    # decode: one token per sequence, latency of a Python call
    x = torch.randn(64, 1, 32, 128, device="cuda").to(torch.bfloat16)
    op = rope.RoPEFwdOp("neox", "2d")
    cos, sin = _rope_tables(rope.Standard(), 1, 128)
    ref = _torch_rope(cos[:, None, :], sin[:, None, :], True)
    row("rope decode B64 S1 H32 D128 bf16", lambda: op(x), lambda: ref(x), x.numel() * 2, True)

    # packed tokens at explicit positions (ids validated on the device, one stream sync)
    for tokens in (32768, 4096, 32):
        for dt in ("bf16",) if tokens != 32768 else tuple(dtypes):
            x = torch.randn(tokens, 32, 128, device="cuda").to(dtypes[dt])
            max_position = max(tokens, 8192)
            ids_host = np.random.default_rng(0).integers(0, max_position, tokens)
            ids = torch.tensor(ids_host, device="cuda")
            op = rope.RoPENeoxPositionIdsFwdOp(max_position)
            cos, sin = _rope_tables(rope.Standard(), tokens, 128, ids_host)
            ref = _torch_rope(cos[:, None, :], sin[:, None, :], True)
            small = tokens <= 32
            row(
                f"rope position ids N{tokens} H32 D128 {dt}",
                lambda op=op, x=x, ids=ids: op(x, ids),
                lambda ref=ref, x=x: ref(x),
                x.numel() * x.element_size(),
                small,
                compile_ref=dt == "bf16",
                extra_bytes=ids.numel() * ids.element_size(),
            )
    return rows


_COLD_START_SCRIPT = """
import time, torch
from tileops_cupy.rope import RoPEFwdOp
x = torch.randn(4, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
op = RoPEFwdOp("neox", "2d")
torch.cuda.synchronize()
start = time.perf_counter()
op(x)
torch.cuda.synchronize()
print(time.perf_counter() - start)
"""


def cold_start() -> dict:
    """First-call time of a fresh process with an empty CuPy kernel cache (one module
    compiled: every layout and vector width of bf16, rotary_dim 128), then of a second
    process with that cache, and how many files the second process added to it (0 means
    it compiled nothing)."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUPY_CACHE_DIR=cache)

        def first_call_s() -> float:
            out = subprocess.check_output([sys.executable, "-c", _COLD_START_SCRIPT], env=env)
            return float(out.decode().split()[-1])

        def cache_files() -> int:
            return sum(len(files) for _, _, files in os.walk(cache))

        cold = first_call_s()
        files = cache_files()
        warm = first_call_s()
        added = cache_files() - files
    print(
        f"cold start: first call {cold:.2f} s with an empty kernel cache, {warm:.3f} s in a "
        f"second process ({added} kernel files added: {'no' if added == 0 else 'some'} compiles)",
        flush=True,
    )
    return {"cold_first_call_s": cold, "second_process_first_call_s": warm, "files_added": added}


def _format_row(r: dict) -> str:
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


def _run(args: argparse.Namespace) -> tuple[float, list[dict], dict]:
    """Measure the rows ``args`` asks for, printing the table as they come."""
    torch = _torch()
    ceiling = copy_ceiling_gbs()
    print(f"device: {torch.cuda.get_device_name()}  copy ceiling: {ceiling:.0f} GB/s")
    print(HEADER, flush=True)
    only = set(args.only or ("rope", "component", "mhc", "dispatch"))
    rows = []
    extra = {}
    if "rope" in only:
        extra["cold_start"] = cold_start()
        rows += rope_rows(ceiling, not args.no_compile)
    if "component" in only:
        from ._bench_component import component_rows

        rows += component_rows(ceiling, not args.no_compile)
    if "mhc" in only:
        from ._bench_mhc import mhc_rows

        rows += mhc_rows(ceiling, not args.no_compile)
    if "dispatch" in only:
        from ._bench_dispatch import dispatch_rows

        for row in dispatch_rows():
            print(_format_row(row), flush=True)
            rows.append(row)
    return ceiling, rows, extra


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print the rows as JSON on stdout, the table on stderr"
    )
    parser.add_argument("--only", choices=("rope", "component", "mhc", "dispatch"), action="append")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile columns")
    args = parser.parse_args(argv)
    # with --json, stdout carries the JSON alone (for a pipe); the table goes to stderr
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        ceiling, rows, extra = _run(args)
    if args.json:
        print(json.dumps({"copy_ceiling_gbs": ceiling, "rows": rows, **extra}, indent=1))


if __name__ == "__main__":
    main()
