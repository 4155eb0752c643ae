"""Bench rows of host dispatch: the CPU time of one eager call in a tight loop, as a ratio to
one torch elementwise launch (``small * 2``) measured in the same process (../shared/PERF.md:
host time on the lent machine varies 3-5x between runs, so only the ratio is comparable).

Shapes are small, and the loop synchronises the device between short timed batches, so it
measures what the Python side costs (validation and launch included), never the device.
Targets: every op <= 2x a torch launch, the component's decode <= 1.5x.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ._bench_harness import make_row, torch_module

_CALLS = 3000
# Calls timed per batch, the device synchronised (untimed) between batches: far fewer launches
# than the driver queues (about a thousand), so the host never waits for a queue slot. A
# longer loop measures the device instead wherever a call's kernels take longer than its
# host work (mHC pre at B4 runs ~10 µs of Sinkhorn and reductions on the device; its
# backward more).
_BATCH = 50


def host_us(fn: Callable[[], object], calls: int = _CALLS) -> float:
    """Host time of one call, in µs: ``calls`` calls in batches of _BATCH, only the issuing
    timed."""
    torch = torch_module()
    torch.cuda.synchronize()
    elapsed = 0.0
    for _ in range(calls // _BATCH):
        start = time.perf_counter()
        for _ in range(_BATCH):
            fn()
        elapsed += time.perf_counter() - start
        torch.cuda.synchronize()
    return elapsed / (calls // _BATCH * _BATCH) * 1e6


def host_ratio(fn: Callable[[], object], reference: Callable[[], object]) -> tuple[float, float]:
    """(µs of ``fn``, µs of ``reference``) of the round, of 5, with the median ratio; each
    round times both back to back, so that a change of host speed during the run moves
    both (the ratio is what compares across runs)."""
    for _ in range(200):
        fn()
        reference()
    torch_module().cuda.synchronize()
    rounds = [(host_us(fn), host_us(reference)) for _ in range(5)]
    ratios = sorted(range(5), key=lambda i: rounds[i][0] / rounds[i][1])
    return rounds[ratios[2]]


def dispatch_rows() -> list[dict]:
    from .rope import RoPE, RoPEBwdOp, RoPEFwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp
    from .sequence_modeling import MHCPostBwdOp, MHCPostFwdOp, MHCPreBwdOp, MHCPreFwdOp

    torch = torch_module()

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda").to(dtype)

    small = randn(1024)
    x2d = randn(1, 16, 8, 128)
    x1d = randn(16, 128)
    tokens = randn(32, 8, 128)
    ids = torch.randint(0, 4096, (32,), device="cuda")
    rope = RoPE(128, 32, 8, max_position=1 << 16)
    step = randn(64, 1, 48 * 128)
    q, k = step[..., : 32 * 128], step[..., 32 * 128 : 40 * 128]
    positions = torch.randint(0, 4096, (64,), device="cuda")
    n, c_x = 4, 256
    phi = randn(n * c_x, n * n + 2 * n, dtype=torch.float32) / 32
    b = randn(n * n + 2 * n, dtype=torch.float32)
    x = randn(4, n * c_x)
    x_res, x_layer, h_post = MHCPreFwdOp(1.0, 1.0, 1.0, 20)(phi, x, b)
    cases = {
        "RoPEFwdOp 2d B1 S16 H8 D128": (RoPEFwdOp(input_layout="2d"), (x2d,), 2.0),
        "YaRNFwdOp 1d S16 D128": (YaRNFwdOp(), (x1d,), 2.0),
        "RoPENeoxPositionIdsFwdOp N32": (
            RoPENeoxPositionIdsFwdOp(4096, rotary_dim=64),
            (tokens, ids),
            2.0,
        ),
        "component decode B64 (positions [B])": (rope.decode, (q, k, positions), 1.5),
        "component decode B64 (int position)": (rope.decode, (q, k, 100), 1.5),
        "component prefill B64 T1 (int offset)": (rope.prefill, (q, k, 7), 2.0),
        "MHCPreFwdOp B4 n4 c_x256": (MHCPreFwdOp(1.0, 1.0, 1.0, 20), (phi, x, b), 2.0),
        "MHCPostFwdOp B4 n4 c_x256": (MHCPostFwdOp(), (x_layer, h_post, x_res), 2.0),
        "RoPEBwdOp 2d B1 S16 H8 D128": (RoPEBwdOp(input_layout="2d"), (x2d,), 2.0),
        "MHCPostBwdOp B4 n4 c_x256": (MHCPostBwdOp(), (x_layer, h_post, x_res, x_res), 2.0),
        # one cooperative launch and four output allocations a call (mhc_bwd_fused), which
        # alone cost about 1.7 torch launches, and six arguments to read
        "MHCPreBwdOp B4 n4 c_x256": (
            MHCPreBwdOp(1.0, 1.0, 1.0, 20),
            (phi, x, b, x_res, x_layer, h_post),
            2.0,
        ),
    }
    rows = []
    for name, (op, args, target) in cases.items():
        ours, torch_us = host_ratio(lambda op=op, args=args: op(*args), lambda: small * 2)
        ratio = ours / torch_us
        verdict = "met" if ratio <= target else "MISSED"
        note = f"{ratio:.2f}x a torch launch ({torch_us:.1f} µs host)"
        note += f"; target <= {target}x: {verdict}"
        row = make_row(f"dispatch {name}", ours, torch_us, None, 0, 1.0, note)
        row.update(gbs=float("nan"), pct_ceiling=float("nan"), ratio_to_torch_launch=ratio)
        rows.append(row)
    rope.check()
    return rows
