"""GPU self-check of the mHC backward CUDA kernels (not collected by pytest).

Run on a machine with a CUDA device::

    python tests/gpu_check_mhc_backward.py          # accuracy, determinism, timings
    python tests/gpu_check_mhc_backward.py --quick  # fewer shapes, no timings
    python tests/gpu_check_mhc_backward.py --host   # the same checks on the numpy path

For a set of shapes, dtypes and settings it runs MHCPreBwdOp / MHCPostBwdOp on torch CUDA
tensors and compares every output with torch float64 autograd of SPEC section 4 (its own
reference, independent of the tests' oracle), printing each output's worst error relative
to its scale (grad_x: per row, of the row's max |grad|; grad_phi, grad_b, grad_alpha: of the
output's max |grad|) against SPEC 8's bound, checks that a second run gives the same bits,
and checks the forward's h_post on rows whose sum of squares overflows float32. It ends with
one line, ALL OK or FAILED, and exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from _mhc_oracle import GRAD_SUM_TOLERANCE, GRAD_X_TOLERANCE, torch_pre_reference

from tileops_cupy.sequence_modeling import MHCPostBwdOp, MHCPreBwdOp, MHCPreFwdOp

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
failures: list[str] = []
DEVICE = "cuda"  # --host: the same checks on the numpy path (a dry run of this script)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reference_pre_grads(phi, x, b, alphas, repeat, eps, upstream):
    leaves = [t.detach().to("cpu", torch.float64).requires_grad_() for t in (phi, x, b)]
    as_float32 = [float(torch.tensor(a, dtype=torch.float32)) for a in alphas]  # as the op
    alpha_leaves = [torch.tensor(a, dtype=torch.float64).requires_grad_() for a in as_float32]
    eps64 = float(torch.tensor(eps, dtype=torch.float32))
    outputs = torch_pre_reference(*leaves, alpha_leaves, repeat, eps64)
    grads_out = [u.detach().to("cpu", torch.float64) for u in upstream]
    grads = torch.autograd.grad(outputs, [*leaves, *alpha_leaves], grads_out, allow_unused=True)
    grad_phi, grad_x, grad_b, *grad_alpha = grads
    return grad_phi, grad_x, grad_b, torch.stack(grad_alpha)


def worst(got, ref, per_row: bool) -> float:
    """Largest |got - ref| relative to ref's max |.| (per row when asked); inf on NaN."""
    got = got.detach().to("cpu", torch.float64)
    error = (got - ref).abs()
    if torch.isnan(error).any():
        return math.inf
    if per_row:
        scale = ref.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        return float((error / scale).max())
    return float(error.max() / ref.abs().max().clamp_min(1e-30))


def report(label: str, results: dict[str, tuple[float, float]]) -> None:
    bad = [name for name, (value, bound) in results.items() if not value <= bound]
    text = "  ".join(f"{name} {value:.2e}/{bound:.0e}" for name, (value, bound) in results.items())
    print(f"{'FAIL' if bad else 'ok  '} {label}: {text}", flush=True)
    if bad:
        failures.append(f"{label}: {', '.join(bad)}")


def make_pre_case(generator, n, c_x, batch, dtype, saturated=False, huge_rows=0):
    width, q = n * c_x, n * n + 2 * n
    scale = 1.0 if saturated else 1 / math.sqrt(width)
    phi = torch.randn(width, q, generator=generator) * scale
    b = (1.0 if saturated else 0.5) * torch.randn(q, generator=generator)
    x = torch.randn(batch, width, generator=generator)
    if huge_rows:  # sum(x*x) overflows float32 in these rows
        x[:huge_rows] *= 1e19
    upstream = (
        torch.randn(batch, width, generator=generator),
        torch.randn(batch, c_x, generator=generator),
        torch.randn(batch, n, generator=generator),
    )
    cast = DTYPES[dtype]
    x = x.to(cast)
    upstream = (upstream[0].to(cast), upstream[1].to(cast), upstream[2])
    return phi, x, b, upstream


def check_pre(generator, n, c_x, batch, dtype, *, repeat=20, eps=0.02, saturated=False,
              huge_rows=0, offset=0, alphas=(0.8, 1.2, 1.0)):  # fmt: skip
    phi, x, b, upstream = make_pre_case(generator, n, c_x, batch, dtype, saturated, huge_rows)
    width = n * c_x
    if offset:  # rows sliced out of a wider buffer at an element offset: unaligned rows
        wide = torch.zeros(batch, width + offset + 3, dtype=x.dtype)
        wide[:, offset : offset + width] = x
        x_dev = wide.to(DEVICE)[:, offset : offset + width]
        wide_res = torch.zeros(batch, width + offset + 1, dtype=x.dtype)
        wide_res[:, offset : offset + width] = upstream[0]
        res_dev = wide_res.to(DEVICE)[:, offset : offset + width]
    else:
        x_dev, res_dev = x.to(DEVICE), upstream[0].to(DEVICE)
    upstream_dev = (res_dev, upstream[1].to(DEVICE), upstream[2].to(DEVICE))
    op = MHCPreBwdOp(*alphas, repeat, eps)
    args = (phi.to(DEVICE), x_dev, b.to(DEVICE), *upstream_dev)
    got = op(*args)
    again = op(*args)
    sync()
    ref = reference_pre_grads(phi, x, b, alphas, repeat, eps, upstream)
    label = (
        f"pre-bwd n{n} c_x{c_x} B{batch} {dtype} repeat{repeat} eps{eps}"
        + (" saturated" if saturated else "")
        + (f" huge_rows{huge_rows}" if huge_rows else "")
        + (f" offset{offset}" if offset else "")
    )
    results = {
        "grad_x": (worst(got[1], ref[1], per_row=True), GRAD_X_TOLERANCE[dtype]),
        "grad_phi": (worst(got[0], ref[0], per_row=False), GRAD_SUM_TOLERANCE),
        "grad_b": (worst(got[2], ref[2], per_row=False), GRAD_SUM_TOLERANCE),
        "grad_alpha": (worst(got[3], ref[3], per_row=False), GRAD_SUM_TOLERANCE),
    }
    identical = all(torch.equal(a, c) for a, c in zip(got, again, strict=True))
    results["repeat_bits"] = (0.0 if identical else 1.0, 0.0)
    report(label, results)


def check_post(generator, n, c_x, batch, dtype, offset=0):
    cast = DTYPES[dtype]
    layer = torch.randn(batch, c_x, generator=generator).to(cast)
    gates = 2 * torch.rand(batch, n, generator=generator)
    res = torch.randn(batch, n * c_x, generator=generator).to(cast)
    grad_out = torch.randn(batch, n * c_x, generator=generator).to(cast)
    if offset:
        wide = torch.zeros(batch, n * c_x + offset, dtype=cast)
        wide[:, offset:] = grad_out
        grad_dev = wide.to(DEVICE)[:, offset:]
    else:
        grad_dev = grad_out.to(DEVICE)
    op = MHCPostBwdOp()
    got = op(layer.to(DEVICE), gates.to(DEVICE), res.to(DEVICE), grad_dev)
    again = op(layer.to(DEVICE), gates.to(DEVICE), res.to(DEVICE), grad_dev)
    sync()
    g = grad_out.double().reshape(batch, n, c_x)
    ref_layer = (gates.double()[:, :, None] * g).sum(dim=1)
    ref_gates = (g * layer.double()[:, None, :]).sum(dim=2)
    unit = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-22}[dtype]
    results = {
        "grad_x_layer_out": (worst(got[0], ref_layer, per_row=True), unit),
        "grad_h_post": (worst(got[1], ref_gates, per_row=True), 2.0**-16),
        "grad_x_res": (0.0 if torch.equal(got[2].cpu(), grad_out) else 1.0, 0.0),
        "repeat_bits": (
            0.0 if all(torch.equal(a, c) for a, c in zip(got, again, strict=True)) else 1.0,
            0.0,
        ),
    }
    report(f"post-bwd n{n} c_x{c_x} B{batch} {dtype}" + (f" offset{offset}" if offset else ""),
           results)  # fmt: skip


def check_forward_overflow(generator, dtype):
    """The forward's h_post on rows with |x| ~ 1e19 (sum(x*x) overflows float32)."""
    n, c_x = 4, 32
    for batch in (3, 300):  # fused (cooperative) and split-K paths
        phi, x, b, _ = make_pre_case(generator, n, c_x, batch, dtype, huge_rows=2)
        _, _, h_post = MHCPreFwdOp(0.8, 1.2, 1.0, 20)(phi.to(DEVICE), x.to(DEVICE), b.to(DEVICE))
        with torch.no_grad():
            ref = torch_pre_reference(
                phi.double(), x.double(), b.double(), (0.8, 1.2, 1.0), 20, 0.02
            )
        error = float((h_post.cpu().double() - ref[2]).abs().max())
        report(f"forward h_post huge rows B{batch} {dtype}", {"h_post_abs": (error, 5e-5)})


def time_us(fn, runs: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return sorted(times)[len(times) // 2]


def time_shape(ceiling: float, batch: int, c_x: int, n: int = 4) -> None:
    width, q = n * c_x, n * n + 2 * n
    phi = torch.randn(width, q, device="cuda") / math.sqrt(width)
    b = torch.randn(q, device="cuda")
    x = torch.randn(batch, width, device="cuda").bfloat16()
    grad_res = torch.randn(batch, width, device="cuda").bfloat16()
    grad_layer = torch.randn(batch, c_x, device="cuda").bfloat16()
    grad_post = torch.randn(batch, n, device="cuda")
    pre = MHCPreBwdOp(0.8, 1.2, 1.0, 20)
    us = time_us(lambda: pre(phi, x, b, grad_res, grad_layer, grad_post))
    moved = 2 * x.numel() * 2 + grad_res.numel() * 2 + grad_layer.numel() * 2
    moved += 2 * phi.numel() * 4
    floor = moved / ceiling / 1e3
    print(f"pre-bwd  B{batch} c_x{c_x}: {us:8.1f} us, {us / floor:.2f}x one-pass floor")
    layer = torch.randn(batch, c_x, device="cuda").bfloat16()
    gates = torch.rand(batch, n, device="cuda")
    post = MHCPostBwdOp()
    us = time_us(lambda: post(layer, gates, grad_res, grad_res))
    moved = 2 * (layer.numel() * 2 + gates.numel() * 4) + 2 * grad_res.numel() * 2
    gbs = moved / us / 1e3
    print(f"post-bwd B{batch} c_x{c_x}: {us:8.1f} us, {gbs:.0f} GB/s ({100 * gbs / ceiling:.0f}%)")


def timings() -> None:
    """Median device time of the bench shapes (no L2 flush: a first look, not the bench)."""
    source = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ceiling = 2 * source.numel() / (time_us(lambda: target.copy_(source)) * 1e-6) / 1e9
    print(f"copy ceiling ~{ceiling:.0f} GB/s")
    for batch, c_x in ((4096, 4096), (16384, 7168)):
        time_shape(ceiling, batch, c_x)
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, no timings")
    parser.add_argument("--host", action="store_true", help="dry run on the numpy path")
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.host else "cuda"
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    dtypes = ("bfloat16",) if args.quick else tuple(DTYPES)
    for dtype in dtypes:
        # (n, c_x, batch): odd c_x (element path), batch 1, split K (small batch), several
        # tiles and chunks, n without a power of two
        shapes = [(4, 256, 37), (4, 130, 5), (1, 64, 1), (3, 200, 129), (8, 136, 40)]
        if not args.quick:
            shapes += [(2, 1000, 3), (5, 72, 64), (6, 48, 33), (7, 40, 17), (4, 1024, 300)]
            shapes += [(4, 4096, 100)]  # second-pass blocks spanning chunks, many K splits
        for n, c_x, batch in shapes:
            check_pre(generator, n, c_x, batch, dtype)
        check_pre(generator, 4, 128, 16, dtype, saturated=True)
        if dtype != "float16":  # |x| ~ 1e19 is past float16's range (whose squares fit)
            check_pre(generator, 4, 64, 8, dtype, huge_rows=3)
            check_forward_overflow(generator, dtype)
        check_pre(generator, 4, 256, 9, dtype, offset=1)
        check_post(generator, 4, 256, 7, dtype)
        check_post(generator, 3, 130, 5, dtype, offset=1)
        if not args.quick:
            check_post(generator, 12, 64, 3, dtype)  # n > 8: the generic kernel
            check_post(generator, 1, 4096, 2, dtype)
    for repeat, eps in ((0, 0.02), (1, 0.02), (20, 0.0), (37, 0.02)):
        check_pre(generator, 4, 96, 12, "bfloat16", repeat=repeat, eps=eps)
    print(f"checks took {time.perf_counter() - start:.1f} s")
    if not args.quick and not args.host:
        timings()
    print("ALL OK" if not failures else "FAILED:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
