"""A/B of kernel source variants on one GPU, in alternating processes: what to run, in one
device call, before a kernel change lands (device time is short; run it on the card the
targets are set on, since the H100 and the H200 have ranked layouts differently).

    python tools/kernel_ab.py export main prof/base       # a revision's kernels_cu, as a folder
    python tools/kernel_ab.py export --checkout main prof/main     # its Python too
    python tools/kernel_ab.py run --rounds 2 prof/base tree            # the rows of every group
    python tools/kernel_ab.py run --rows rope,norm prof/base prof/try  # some groups
    python tools/kernel_ab.py run --rows small tree tree prof/try      # with an A/A control

A variant is ``tree`` (the checkout's own ``kernels_cu``), a folder whose files (``rope.cu``,
``mhc.cu``, ``mhc_backward.cu``, ``common.cuh``) replace the shipped ones of the same name, or
a checkout folder (one holding ``tileops_cupy/``: its own Python and kernels, for a change
whose host side differs too, such as a launch geometry that the kernels assert). Every
variant's kernels are compiled first, in parallel processes (the disk cache of
``tileops_cupy._cuda`` keeps them). Then each round runs every variant once, one process
each, in turn, so that drift of the machine during the run moves every variant alike. A
process times the rows as the bench does (``median_us``: CUDA events, L2 flushed between
runs) and prints one JSON line (passed on to stderr, so that stdout holds the table alone);
the table gives each row's median over the rounds (min-max) in % of the copy ceiling, and
what a copy of the same bytes reaches (latency rows: device µs). A row whose outputs' bits
differ from the first variant's (the same seed makes the same inputs in every process) is
marked ``!bits``. A variant named twice (``run tree tree prof/try``) gets a column of its own
each time, ``tree`` and ``tree#2``: an A/A control, how far identical code drifts in that run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (fn, bytes moved) of each row, built on the device; rows of a group share one builder. A
# row that moves too little for bandwidth to mean anything (decode) has 0 bytes: its figure
# is device µs, not % of the copy ceiling. fn returns the tensors whose bits are compared
# (an in-place row returns what it wrote).
Row = tuple[Callable[[], object], int]


def use_variant(variant: str) -> None:
    """Make this process import ``variant``'s package and kernels (see the module docstring);
    call it before anything of ``tileops_cupy`` or ``kernels_cu`` is imported or compiled."""
    if variant == "tree":
        sys.path.insert(0, str(ROOT))
        return
    folder = Path(variant)
    if not folder.is_dir():
        raise SystemExit(f"variant {variant!r} is neither 'tree' nor a folder")
    if (folder / "tileops_cupy").is_dir():  # a checkout: its Python and its kernels
        sys.path.insert(0, str(folder.resolve()))
        return
    sys.path.insert(0, str(ROOT))
    import kernels_cu

    shipped_source = kernels_cu.source.__wrapped__
    shipped_common = kernels_cu.common.__wrapped__

    def source(name: str) -> str:
        path = folder / f"{name}.cu"
        return path.read_text() if path.exists() else shipped_source(name)

    def common() -> str:
        path = folder / "common.cuh"
        return path.read_text() if path.exists() else shipped_common()

    kernels_cu.source, kernels_cu.common = source, common


def _git(*arguments: str) -> str:
    return subprocess.run(
        ["git", *arguments], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def export(revision: str, folder: Path, checkout: bool = False) -> list[str]:
    """Write ``revision``'s kernel sources (every ``.cu`` and ``.cuh`` of its ``kernels_cu``)
    into ``folder``, or with ``checkout`` its ``tileops_cupy`` and ``kernels_cu`` as they lie
    in the repository (git, here: the device machine gets the working tree without the
    repository); returns the paths written, relative to ``folder``."""
    if checkout:
        paths = _git("ls-tree", "-r", "--name-only", revision, "tileops_cupy/", "kernels_cu/")
        written = paths.split()
        sources = {path: f"{revision}:{path}" for path in written}
    else:
        paths = _git("ls-tree", "--name-only", revision, "kernels_cu/").split()
        written = [Path(path).name for path in paths if path.endswith((".cu", ".cuh"))]
        sources = {name: f"{revision}:kernels_cu/{name}" for name in written}
    for path, source in sources.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(_git("show", source))
    return written


# ------------------------------------------------------------------------------ the rows


def _rope_rows(torch) -> dict[str, Row]:
    rows = {}
    shapes = {  # (batch, seq, heads, head_dim, dtype) of each layout's rows
        "neox": ((8, 4096, 32, 128, "bfloat16"), (1, 8192, 32, 128, "bfloat16"),
                 (2, 2048, 32, 128, "bfloat16"), (8, 4096, 32, 128, "float32"),
                 (1, 8192, 32, 128, "float32"), (4, 8192, 8, 128, "bfloat16"),
                 (8, 4096, 32, 64, "bfloat16")),
        "interleaved": ((8, 4096, 32, 128, "bfloat16"), (1, 8192, 32, 128, "bfloat16"),
                        (2, 2048, 32, 128, "bfloat16"), (8, 4096, 32, 128, "float32")),
    }  # fmt: skip
    for layout, cases in shapes.items():
        for case in cases:
            rows.update([_rope_row(torch, layout, *case)])
    return rows


def _rope_row(
    torch, layout: str, batch: int, seq: int, heads: int, head_dim: int, dtype: str
) -> tuple[str, Row]:
    """(name, row) of RoPEFwdOp on x [batch, seq, heads, head_dim] of ``dtype``."""
    from tileops_cupy.rope import RoPEFwdOp

    x = torch.randn(batch, seq, heads, head_dim, device="cuda").to(getattr(torch, dtype))
    op = RoPEFwdOp(layout, "2d")
    name = f"rope {layout} B{batch} S{seq} H{heads} D{head_dim}"
    if dtype != "bfloat16":
        name += f" {dtype}"
    moved = 2 * x.numel() * x.element_size()  # x read, y written
    return name, (lambda op=op, x=x: op(x), moved)


def _qkv(torch, tokens: int, dtype: str = "bfloat16", head_dim: int = 128):
    """q [N, 32*D] and k [N, 8*D] as views of one fused QKV buffer, and their bytes read plus
    written."""
    qkv = torch.randn(tokens, 48 * head_dim, device="cuda").to(getattr(torch, dtype))
    q, k = qkv[:, : 32 * head_dim], qkv[:, 32 * head_dim : 40 * head_dim]
    return q, k, 2 * qkv.element_size() * (q.numel() + k.numel())


def _positions_row(torch, tokens: int) -> tuple[str, Row]:
    """(name, row) of the component (32q/8kv D128 bf16) rotating q and k in place in a fused
    QKV row at random per-token positions below 32768 (their int64 ids read too)."""
    from tileops_cupy.rope import RoPE

    q, k, moved = _qkv(torch, tokens)
    positions = torch.randint(0, 32768, (tokens,), device="cuda")
    rope = RoPE(128, 32, 8, max_position=1 << 16)
    return f"positions N{tokens}", (
        lambda rope=rope, q=q, k=k, p=positions: rope.forward(q, k, positions=p),
        moved + 8 * tokens,
    )


def _component_rows(torch) -> dict[str, Row]:
    rows = dict(_positions_row(torch, tokens) for tokens in (4096, 8192, 32768))
    rows.update([_cache_row(torch, 8192)])
    for name, rope in _mrope_ropes().items():
        rows.update([_mrope_row(torch, name, rope, 8192)])
    return rows


def _cache_row(torch, tokens: int) -> tuple[str, Row]:
    """(name, row) of apply_rope_with_cos_sin_cache_inplace on q and k (32q/8kv D128 bf16) in
    a fused QKV row at random positions of a float32 cache of 2**17 positions."""
    from tileops_cupy.rope import apply_rope_with_cos_sin_cache_inplace

    q, k, moved = _qkv(torch, tokens)
    angles = torch.rand(1 << 17, 64, device="cuda") * 1e4
    cache = torch.cat([angles.cos(), angles.sin()], -1).contiguous()
    ids = torch.randint(0, 1 << 17, (tokens,), device="cuda")
    return f"cos_sin_cache N{tokens}", (
        lambda q=q, k=k: (apply_rope_with_cos_sin_cache_inplace(ids, q, k, 128, cache), q, k)[1:],
        moved,
    )


def _mrope_ropes() -> dict[str, object]:
    """The component (32q/8kv D128) with Qwen2-VL's sections and Qwen3-VL's interleaved ones."""
    from tileops_cupy.rope import RoPE

    return {
        "sectioned": RoPE(128, 32, 8, mrope_section=(16, 24, 24)),
        "interleaved": RoPE(128, 32, 8, mrope_section=(24, 20, 20), mrope_interleaved=True),
    }


def _mrope_row(
    torch,
    name: str,
    rope,
    tokens: int,
    dtype: str = "bfloat16",
    head_dim: int = 128,
    norm: bool = False,
) -> tuple[str, Row]:
    """(name, row) of ``rope`` (MRoPE, 32q/8kv; ``norm``: with the fused norm's weights) on q
    and k in place in a fused QKV row of their own (timed calls, as many as fit the timing's
    window, rewrite them, so a row's first call would otherwise find another row's work) at
    random positions below 2**20."""
    q, k, moved = _qkv(torch, tokens, dtype, head_dim)
    thw = torch.randint(0, 1 << 20, (3, tokens), device="cuda")
    weights = _norm_weights(torch, head_dim, q.dtype) if norm else {}
    return f"MRoPE {name} N{tokens}", (
        lambda rope=rope, q=q, k=k, p=thw, w=weights: rope.forward(q, k, positions=p, **w),
        moved,
    )


def _small_rows(torch) -> dict[str, Row]:
    """Chunked-prefill sizes about the whole-row layout's lower bound (_rotate's
    _PACK_MIN_HEAD_ROWS, 2**13 head rows): q alone (B1, H32 D128 bf16) and q and k in place
    in a fused QKV row (32q/8kv) at a prefill's offset and at random per-token positions, and
    at 1024 tokens the fused norm, MRoPE and the cos_sin_cache."""
    from tileops_cupy.rope import RoPE

    rows = dict(
        _rope_row(torch, layout, 1, seq, 32, 128, "bfloat16")
        for seq in (128, 256, 512, 1024, 2048)
        for layout in ("neox", "interleaved")
    )
    rope = RoPE(128, 32, 8, max_position=1 << 16)
    for tokens in (128, 256, 512, 1024, 2048):
        rows.update([_positions_row(torch, tokens)])
        q, k, moved = _qkv(torch, tokens)
        q, k = q[None], k[None]  # (one sequence: [1, T, H*D])
        rows[f"prefill N{tokens}"] = (lambda q=q, k=k: rope.prefill(q, k, 7), moved)
    rows.update([_norm_row(torch, RoPE(128, 32, 8, norm_eps=1e-6), 1024)])
    rows.update([_cache_row(torch, 1024)])
    for name, mrope in _mrope_ropes().items():
        rows.update([_mrope_row(torch, name, mrope, 1024)])
    return rows


def _mrope_rows(torch) -> dict[str, Row]:
    """MRoPE, q and k in place in a fused QKV row (32q/8kv) at random positions below 2**20:
    Qwen3-VL's interleaved rows over the whole-row layout's sizes and past them, sections on
    and off its lanes' boundaries, fp16, float32, D64, and with the fused norm."""
    from tileops_cupy.rope import RoPE

    interleaved, aligned, split = ((24, 20, 20), True), ((16, 24, 24), False), ((17, 23, 24), False)
    cases = (  # name, (section, interleaved), tokens, dtype, head_dim, norm
        ("interleaved", interleaved, 4096, "bfloat16", 128, False),
        ("interleaved", interleaved, 8192, "bfloat16", 128, False),
        ("interleaved", interleaved, 16384, "bfloat16", 128, False),
        ("interleaved", interleaved, 32768, "bfloat16", 128, False),
        ("sectioned", aligned, 8192, "bfloat16", 128, False),
        ("sections off lanes", split, 8192, "bfloat16", 128, False),
        ("interleaved fp16", interleaved, 8192, "float16", 128, False),
        ("interleaved fp32", interleaved, 8192, "float32", 128, False),
        ("interleaved D64", ((12, 10, 10), True), 8192, "bfloat16", 64, False),
        ("interleaved + norm", interleaved, 8192, "bfloat16", 128, True),
        ("sectioned + norm", aligned, 8192, "bfloat16", 128, True),
    )
    rows = {}
    for name, (section, inter), tokens, dtype, head_dim, norm in cases:
        extra = dict(norm_eps=1e-6) if norm else {}
        rope = RoPE(head_dim, 32, 8, mrope_section=section, mrope_interleaved=inter, **extra)
        rows.update([_mrope_row(torch, name, rope, tokens, dtype, head_dim, norm)])
    return rows


def _norm_rows(torch) -> dict[str, Row]:
    from tileops_cupy.rope import RoPE

    rope = RoPE(128, 32, 8, norm_eps=1e-6)
    return dict(_norm_row(torch, rope, tokens) for tokens in (4096, 8192, 32768))


def _norm_row(torch, rope, tokens: int) -> tuple[str, Row]:
    """(name, row) of ``rope`` (the fused QK-norm, 32q/8kv D128 bf16) on q and k in place in
    a fused QKV row at random positions below 2**16."""
    weights = _norm_weights(torch, 128, torch.bfloat16)
    q, k, moved = _qkv(torch, tokens)
    positions = torch.randint(0, 1 << 16, (tokens,), device="cuda")
    return f"qk-norm N{tokens}", (
        lambda q=q, k=k, p=positions, w=weights: rope.forward(q, k, positions=p, **w),
        moved,
    )


def _norm_weights(torch, head_dim: int, dtype) -> dict[str, object]:
    """The fused norm's q and k weights as keyword arguments: 1 + 0.1 * N(0, 1) a column."""
    return {
        f"{operand}_norm_weight": (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
        for operand in "qk"
    }


def _mhc_rows(torch) -> dict[str, Row]:
    from tileops_cupy._bench_mhc import _post_inputs
    from tileops_cupy.sequence_modeling import MHCPostBwdOp, MHCPostFwdOp, MHCPreFwdOp

    n, rows = 4, {}
    for batch, c_x in ((4096, 4096), (16384, 7168)):
        layer, gates, res = _post_inputs(batch, n, c_x)
        grad = torch.randn(batch, n * c_x, device="cuda").bfloat16()
        post, post_bwd = MHCPostFwdOp(), MHCPostBwdOp()
        rows[f"mhc post B{batch} c_x{c_x}"] = (
            lambda post=post, a=(layer, gates, res): post(*a),
            2 * layer.numel() + 4 * gates.numel() + 4 * res.numel(),
        )
        rows[f"mhc post-bwd B{batch} c_x{c_x}"] = (
            lambda op=post_bwd, a=(layer, gates, res, grad): op(*a),
            4 * layer.numel() + 8 * gates.numel() + 2 * grad.numel(),
        )
        phi = torch.randn(n * c_x, n * n + 2 * n, device="cuda") / (n * c_x) ** 0.5
        b = torch.randn(n * n + 2 * n, device="cuda")
        x = res
        pre = MHCPreFwdOp(1.0, 1.0, 1.0, 20)
        # (its one-pass floor's bytes, as the bench's: x, phi and b read, x_res, x_layer and
        # h_post written)
        rows[f"mhc pre B{batch} c_x{c_x}"] = (
            lambda pre=pre, a=(phi, x, b): pre(*a),
            4 * x.numel() + 4 * (phi.numel() + b.numel()) + 2 * layer.numel() + 4 * gates.numel(),
        )
    return rows


def _decode_rows(torch) -> dict[str, Row]:
    """mHC pre at decode batches (bf16 n4), as the bench's decode rows, and post at three of
    them (TileOPs' post took 4.3 µs at B1 c_x1280 where ours took 5.2-5.9, a torch add of
    x_res's bytes 4.8: the performance log, thirty-second session): device µs."""
    from tileops_cupy._bench_mhc import _post_inputs, _pre_inputs
    from tileops_cupy.sequence_modeling import MHCPostFwdOp, MHCPreFwdOp

    n, pre, post, rows = 4, MHCPreFwdOp(1.0, 1.0, 1.0, 20), MHCPostFwdOp(), {}
    for batch, c_x in ((1, 1280), (4, 7168), (16, 4096), (64, 1280), (128, 4096)):
        arguments = _pre_inputs(batch, n, c_x)
        rows[f"mhc pre B{batch} c_x{c_x} (µs)"] = (lambda a=arguments: pre(*a), 0)
    for batch, c_x in ((1, 1280), (4, 7168), (128, 4096)):
        arguments = _post_inputs(batch, n, c_x)
        rows[f"mhc post B{batch} c_x{c_x} (µs)"] = (lambda a=arguments: post(*a), 0)
    return rows


def _prebwd_rows(torch) -> dict[str, Row]:
    """mHC pre backward, whole call (its five kernels), device µs: bf16 n4 at the bench's
    B4096 c_x4096 and a smaller batch, float32 n4, bf16 n2 (two grad blocks a multiprocessor),
    and past n = 4 (float32 n5 and n8, whose grad pass runs 2x slower a byte than n = 4's,
    and bf16 n7 and n8); the bench's alphas, repeat and eps."""
    from tileops_cupy._bench_mhc import _ALPHAS, _EPS, _REPEAT, _pre_inputs
    from tileops_cupy.sequence_modeling import MHCPreBwdOp

    op, rows = MHCPreBwdOp(*_ALPHAS, _REPEAT, _EPS), {}
    for dtype, n, batch, c_x in (
        ("bfloat16", 4, 4096, 4096),
        ("bfloat16", 4, 1024, 4096),
        ("float32", 4, 2048, 2048),
        ("bfloat16", 2, 4096, 4096),
        ("float32", 5, 2048, 2048),
        ("float32", 8, 1024, 1280),
        ("bfloat16", 7, 1024, 2048),
        ("bfloat16", 8, 1024, 1280),
    ):
        phi, x, b = _pre_inputs(batch, n, c_x, dtype)
        grad_x_res = torch.randn(x.shape, device="cuda").to(x.dtype)
        grad_x_layer = torch.randn(batch, c_x, device="cuda").to(x.dtype)
        arguments = (phi, x, b, grad_x_res, grad_x_layer, torch.randn(batch, n, device="cuda"))
        name = f"mhc pre-bwd {dtype} n{n} B{batch} c_x{c_x} (µs)"
        rows[name] = (lambda a=arguments: op(*a), 0)
    return rows


def _pre_rows(torch) -> dict[str, Row]:
    """mHC pre from 512 tokens (the four-kernel plans, whose projection pipeline depends on
    the batch), whole call, device µs: bf16 n4 over batches and widths, bf16 n2, fp16 n4;
    the bench's alphas, repeat and eps."""
    from tileops_cupy._bench_mhc import _ALPHAS, _EPS, _REPEAT, _pre_inputs
    from tileops_cupy.sequence_modeling import MHCPreFwdOp

    op, rows = MHCPreFwdOp(*_ALPHAS, _REPEAT, _EPS), {}
    for dtype, n, batch, c_x in (
        ("bfloat16", 4, 512, 7168),
        ("bfloat16", 4, 1024, 4096),
        ("bfloat16", 4, 2048, 4096),
        ("bfloat16", 4, 4096, 4096),
        ("bfloat16", 4, 4096, 7168),
        ("bfloat16", 4, 8192, 4096),
        ("bfloat16", 4, 16384, 7168),
        ("bfloat16", 2, 4096, 4096),
        ("float16", 4, 4096, 4096),
    ):
        arguments = _pre_inputs(batch, n, c_x, dtype)
        rows[f"mhc pre {dtype} n{n} B{batch} c_x{c_x} (µs)"] = (lambda a=arguments: op(*a), 0)
    return rows


GROUPS = {
    "rope": _rope_rows,
    "component": _component_rows,
    "norm": _norm_rows,
    "mrope": _mrope_rows,
    "small": _small_rows,
    "mhc": _mhc_rows,
    "decode": _decode_rows,
    "prebwd": _prebwd_rows,
    "pre": _pre_rows,
}


def digest(outputs: object) -> str | None:
    """A hash of the bits of a row's output tensors (a tensor or a tuple or list of them);
    None for a row that returns none."""
    tensors = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    tensors = [t for t in tensors if hasattr(t, "detach")]
    if not tensors:
        return None
    import torch

    sha = hashlib.sha1()
    for t in tensors:
        sha.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return sha.hexdigest()


Result = dict[str, float | str | None]


def measure(variant: str, groups: Iterable[str], warm_only: bool) -> Result:
    """{row: % of the copy ceiling, or device µs for a latency row} (and ``"<row> copy"``: a
    copy of its bytes, None for a latency row; ``"<row> bits"``: the digest of its first
    call's outputs, whose inputs no row before it touched) of ``groups`` under ``variant``;
    ``warm_only``: run each row once (compiling its kernels), time nothing."""
    use_variant(variant)
    import torch

    from tileops_cupy._bench_harness import copy_ceiling_gbs, copy_pct, median_us

    torch.manual_seed(0)
    ceiling = copy_ceiling_gbs() if not warm_only else 1.0
    result: Result = {"ceiling GB/s": round(ceiling, 1)}
    for group in groups:
        for name, (fn, moved) in GROUPS[group](torch).items():
            outputs = fn()  # (its bits before any timed call: in-place rows then rewrite theirs)
            torch.cuda.synchronize()
            if warm_only:
                continue
            result[f"{name} bits"] = digest(outputs)
            if not moved:  # a latency row: device µs
                result[name], result[f"{name} copy"] = round(median_us(fn), 2), None
                continue
            result[name] = round(100 * moved / (median_us(fn) * 1e-6) / 1e9 / ceiling, 2)
            result[f"{name} copy"] = round(copy_pct(moved, ceiling), 2)
    return result


def table(runs: dict[str, list[Result]]) -> str:
    """Each row's median over the rounds (min-max) for every variant, beside a copy; ``!bits``
    where a run's outputs differ from the first variant's first run's."""
    variants = list(runs)
    first = runs[variants[0]][0]
    names = [n for n in first if not n.endswith((" copy", " bits")) and n != "ceiling GB/s"]
    width = max(len(name) for name in names) + 2
    lines = ["row".ljust(width) + "".join(v[-20:].rjust(28) for v in variants) + "copy".rjust(8)]
    for name in names:
        cells = ""
        for variant in variants:
            values = [run[name] for run in runs[variant] if name in run]
            spread = f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
            bits = {run.get(f"{name} bits") for run in runs[variant] if name in run}
            cells += (spread + (" !bits" if bits != {first.get(f"{name} bits")} else "")).rjust(28)
        copy = first[name + " copy"]
        lines.append(name.ljust(width) + cells + ("-" if copy is None else f"{copy:.1f}").rjust(8))
    ceilings = {v: [run["ceiling GB/s"] for run in runs[v]] for v in variants}
    lines.append(f"copy ceilings (GB/s): {ceilings}")
    return "\n".join(lines)


def columns(variants: list[str]) -> dict[str, str]:
    """Each column of the table, in order, to the variant it runs: a variant named again runs
    again in a column of its own (``tree#2``), so that two columns of identical code show the
    run's own scatter beside a change's (the performance log, forty-fourth session: up to 3
    points of the copy ceiling between medians of identical code at 1024 tokens)."""
    named: dict[str, str] = {}
    for variant in variants:
        column, repeat = variant, 1
        while column in named:  # (a folder could itself be named like a repeat's column)
            repeat += 1
            column = f"{variant}#{repeat}"
        named[column] = variant
    return named


def run(variants: list[str], groups: list[str], rounds: int) -> str:
    """Warm every variant in parallel, then ``rounds`` rounds of one process a column."""
    me = [sys.executable, str(Path(__file__).resolve())]
    rows = ["--rows", ",".join(groups)]
    warming = [
        subprocess.Popen([*me, "measure", variant, *rows, "--warm"], stdout=subprocess.DEVNULL)
        for variant in dict.fromkeys(variants)
    ]
    if any([process.wait() for process in warming]):  # (every process waited for)
        raise SystemExit("a variant failed to build or run (its error is above)")
    named = columns(variants)
    runs: dict[str, list[Result]] = {column: [] for column in named}
    for _ in range(rounds):
        for column, variant in named.items():
            line = (
                subprocess.run(
                    [*me, "measure", variant, *rows], check=True, stdout=subprocess.PIPE, text=True
                )
                .stdout.strip()
                .splitlines()[-1]
            )  # (its errors pass through to stderr)
            runs[column].append(json.loads(line))
            print(column, line, file=sys.stderr, flush=True)  # (stdout: the table alone)
    return table(runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export_command = commands.add_parser("export", help="a revision's kernels_cu into a folder")
    export_command.add_argument("revision")
    export_command.add_argument("folder", type=Path)
    export_command.add_argument(
        "--checkout", action="store_true", help="its tileops_cupy and kernels_cu both"
    )
    run_command = commands.add_parser("run", help="the A/B: a table of the variants' rows")
    run_command.add_argument(
        "variants", nargs="+", help="'tree', folders of kernel files, or checkout folders"
    )
    run_command.add_argument("--rounds", type=int, default=2)
    measure_command = commands.add_parser("measure", help="one variant's rows, as JSON (run's)")
    measure_command.add_argument("variant")
    measure_command.add_argument("--warm", action="store_true", help="compile only, time nothing")
    groups_help = "comma-separated groups of rows: " + ", ".join(GROUPS)
    for command in (run_command, measure_command):
        command.add_argument("--rows", default=",".join(GROUPS), help=groups_help)
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.revision, args.folder, args.checkout)
        return
    groups = args.rows.split(",")
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise SystemExit(f"unknown row groups {unknown}; known: {sorted(GROUPS)}")
    if args.command == "measure":
        print(json.dumps(measure(args.variant, groups, args.warm)))
    else:
        print(run(args.variants, groups, args.rounds))


if __name__ == "__main__":
    main()
