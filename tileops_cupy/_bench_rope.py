"""Bench rows of the RoPE seed ops (and the cold start of their first call)."""

from __future__ import annotations

import numpy as np

from ._bench_harness import measure_row, rope_tables, torch_module, torch_rope


def rope_rows(ceiling: float, with_compile: bool = True) -> list[dict]:
    from . import rope

    torch = torch_module()
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
    shapes = [(8, 4096, 32, 128), (1, 8192, 32, 128), (2, 2048, 32, 128)]
    cases = [("rope", layout, dt) for layout in ("neox", "interleaved") for dt in dtypes]
    cases += [(op, "neox", "bf16") for op in ("llama31", "yarn", "longrope", "rope-bwd")]
    for shape in shapes:
        batch, seq, heads, head_dim = shape
        for op_name, layout, dt in cases:
            op, scheme = ops[op_name](layout)
            x = torch.randn(shape, device="cuda").to(dtypes[dt])
            cos, sin = rope_tables(scheme, seq, head_dim)
            cos, sin = cos[:, None, :], sin[:, None, :]
            ref = torch_rope(cos, sin, layout == "neox", op_name.endswith("bwd"))
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
    cos, sin = rope_tables(rope.Standard(), 1, 128)
    ref = torch_rope(cos[:, None, :], sin[:, None, :], True)
    row("rope decode B64 S1 H32 D128 bf16", lambda: op(x), lambda: ref(x), x.numel() * 2, True)

    # packed tokens at explicit positions (ids validated on the device, one stream sync)
    for tokens in (32768, 4096, 32):
        for dt in ("bf16",) if tokens != 32768 else tuple(dtypes):
            x = torch.randn(tokens, 32, 128, device="cuda").to(dtypes[dt])
            max_position = max(tokens, 8192)
            ids_host = np.random.default_rng(0).integers(0, max_position, tokens)
            ids = torch.tensor(ids_host, device="cuda")
            op = rope.RoPENeoxPositionIdsFwdOp(max_position)
            cos, sin = rope_tables(rope.Standard(), tokens, 128, ids_host)
            ref = torch_rope(cos[:, None, :], sin[:, None, :], True)
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
