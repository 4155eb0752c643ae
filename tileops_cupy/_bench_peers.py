"""Peer rows: TileOPs, Liger and FlashInfer beside our op on the same inputs, same timer.

Peers are never dependencies: a peer that does not import (or whose call fails) is named
and skipped. Each row is one workload: our median time and % of the copy ceiling, the
peer's, and ours/peer (below 1 means we are faster). Each timed run of either side takes the
next of several copies of the row's inputs (:func:`_input_sets`): TileOPs' neox RoPE loads
its input under an L2 evict-last policy, whose lines do_bench's flush leaves in L2, so on
one input its next run read part of it from there (H100, B2 S2048: 27.1 µs against 27.8 on
fresh inputs; the performance log, thirty-second session), and on two inputs in turn too.
(What is timed after it on the same tensors reads them from L2 too; the timer resets those
lines before each measurement.)
``../shared/PERF.md`` says how to carry the peers' wheels to a machine without network.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from functools import partial

from ._bench_harness import flush_us, host_us, median_us, torch_module

PEER_HEADER = (
    "| workload (peer)                                        |   ours µs | % ceil |   peer µs "
    "| % ceil | ours/peer |\n|---|---|---|---|---|---|"
)


def _peer(module: str) -> object | None:
    try:
        return importlib.import_module(module)
    except Exception as error:  # a broken peer install must not stop the bench
        print(f"peer {module} unavailable: {type(error).__name__}: {str(error)[:160]}")
        return None


# Inputs a row rotates through: at least this many bytes and _MIN_INPUT_SETS sets, at most
# _MAX_INPUT_SETS. L2's persisting set-aside (9.8 MB by default on an H100, at most 32.8 MB)
# seems to keep the evict-last lines of the first set read after the timer's reset, a full
# set-aside taking later hinted loads as normal ones, so 1 run in N still reads part of its
# input from L2. Two sets left TileOPs' neox B2 S2048 at its one-input time (26.6-26.8 µs
# against 26.8-27.0; its interleaved kernel, unhinted, 28.1); four in turn gave its time
# under a reset before every run (27.8 against 27.7): the performance log, thirty-second and
# thirty-third sessions. From three sets on such runs are never the median.
_ROTATED_BYTES = 64 << 20
_MIN_INPUT_SETS = 4
_MAX_INPUT_SETS = 64


def _input_sets(*tensors) -> list[tuple]:
    """``tensors`` and copies of them: ``_MIN_INPUT_SETS`` sets at least, and as many as hold
    ``_ROTATED_BYTES`` up to ``_MAX_INPUT_SETS``."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    wanted = max(_MIN_INPUT_SETS, -(-_ROTATED_BYTES // max(nbytes, 1)))
    count = min(_MAX_INPUT_SETS, wanted)
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(count - 1)]


def _rotating(call: Callable, input_sets: Sequence[tuple], *keywords: str) -> Callable[[], object]:
    """``call(*input_sets[i])`` with i = 0, 1, 2, ... in turn, a call each run; the last
    ``len(keywords)`` items of a set passed by those names."""
    sets = itertools.cycle(input_sets)
    split = len(input_sets[0]) - len(keywords)

    def run():
        arguments = next(sets)
        return call(*arguments[:split], **dict(zip(keywords, arguments[split:], strict=True)))

    return run


def _row(name: str, peer: str, ours: Callable, theirs: Callable, bytes_moved: int, ceiling: float):
    """Time both (the peer first), print and return the row; None if the peer's call fails.
    A side whose host dispatch outlasts do_bench's flush is named as host-bound: its time
    counts host time (the likely reason why TileOPs' mHC pre at B1 read 16.1 µs in one H100
    run and 109.5 in the next; the performance log, thirty-third session)."""
    try:
        theirs()
        peer_us = median_us(theirs)
        peer_host_us = host_us(theirs)
    except Exception as error:
        print(f"peer {peer} failed on {name}: {type(error).__name__}: {str(error)[:160]}")
        return None
    ours()
    ours_us = median_us(ours)
    ours_host_us = host_us(ours)
    flush = flush_us()

    def pct(us: float) -> float:
        return 100 * bytes_moved / (us * 1e-6) / 1e9 / ceiling

    row = {
        "name": f"{name} ({peer})",
        "ours_us": ours_us,
        "peer": peer,
        "peer_us": peer_us,
        "pct_ceiling": pct(ours_us),
        "peer_pct_ceiling": pct(peer_us),
        "ours_over_peer": ours_us / peer_us,
        "ours_host_us": ours_host_us,
        "peer_host_us": peer_host_us,
        "flush_us": flush,
    }
    dispatch = {"ours": ours_host_us, peer: peer_host_us}
    row["host_bound"] = [side for side, us in dispatch.items() if us > flush]
    note = "".join(
        f" host-bound: {side}'s dispatch {dispatch[side]:.1f} µs a call, the flush {flush:.1f} µs;"
        for side in row["host_bound"]
    )
    print(
        f"| {row['name']:<54} | {ours_us:9.1f} | {row['pct_ceiling']:5.1f}% | {peer_us:9.1f} "
        f"| {row['peer_pct_ceiling']:5.1f}% | {row['ours_over_peer']:9.2f} |{note}",
        flush=True,
    )
    return row


def _tileops_rope(peer_rope, ceiling: float) -> Iterator[dict | None]:
    from . import rope

    torch = torch_module()
    for batch, seq in ((8, 4096), (1, 8192), (2, 2048)):
        x = torch.randn(batch, seq, 32, 128, device="cuda").to(torch.bfloat16)
        cases = [("neox", "RoPEFwdOp", {"rope_layout": "neox"})]
        cases += [("interleaved", "RoPEFwdOp", {"rope_layout": "interleaved"})]
        if batch == 8:
            cases += [
                (name, op_class, {})
                for name, op_class in (
                    ("llama31", "RoPELlama31FwdOp"), ("yarn", "YaRNFwdOp"),
                    ("longrope", "LongRoPEFwdOp"),
                )
            ]  # fmt: skip
        inputs = _input_sets(x)
        for name, op_class, layout in cases:
            ours = getattr(rope, op_class)(input_layout="2d", **layout)
            theirs = getattr(peer_rope, op_class)(input_layout="2d", **layout)
            yield _row(
                f"rope {name} B{batch} S{seq} H32 D128 bf16", "tileops",
                _rotating(ours, inputs), _rotating(theirs, inputs),
                2 * x.numel() * 2, ceiling,
            )  # fmt: skip
    for tokens in (32768, 4096, 32):
        x = torch.randn(tokens, 32, 128, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, 32768, (tokens,), device="cuda")
        inputs = _input_sets(x, ids)
        ours = rope.RoPENeoxPositionIdsFwdOp(32768)
        theirs = peer_rope.RoPENeoxPositionIdsFwdOp(max_position=32768)
        yield _row(
            f"rope position ids N{tokens} H32 D128 bf16", "tileops", _rotating(ours, inputs),
            _rotating(theirs, inputs), 2 * x.numel() * 2 + ids.numel() * 8, ceiling,
        )  # fmt: skip


def _tileops_mhc(peer_module, ceiling: float) -> Iterator[dict | None]:
    from . import sequence_modeling as ours_module
    from ._bench_mhc import _post_inputs, _pre_inputs

    for batch, n, c_x in ((1, 4, 1280), (128, 4, 4096), (4096, 4, 4096), (16384, 4, 7168)):
        phi, x, b = _pre_inputs(batch, n, c_x)
        gates = (1.0, 1.0, 1.0, 20, 0.02)
        ours, theirs = ours_module.MHCPreFwdOp(*gates), peer_module.MHCPreFwdOp(*gates)
        pre_bytes = 2 * x.numel() * 2 + phi.numel() * 4 + batch * (c_x * 2 + n * 4)
        shape = f"B{batch} n{n} c_x{c_x} bf16"
        inputs = _input_sets(phi, x, b)
        yield _row(
            f"mhc pre {shape}", "tileops", _rotating(ours, inputs), _rotating(theirs, inputs),
            pre_bytes, ceiling,
        )  # fmt: skip
        del inputs  # (the pre row's copies, before post's are made)
        layer, h_post, x_res = _post_inputs(batch, n, c_x)
        inputs = _input_sets(layer, h_post, x_res)
        post_ours, post_theirs = ours_module.MHCPostFwdOp(), peer_module.MHCPostFwdOp()
        yield _row(
            f"mhc post {shape}", "tileops", _rotating(post_ours, inputs),
            _rotating(post_theirs, inputs),
            layer.numel() * 2 + h_post.numel() * 4 + 2 * x_res.numel() * 2, ceiling,
        )  # fmt: skip


def _liger(liger_rope, ceiling: float) -> Iterator[dict | None]:
    from . import rope

    torch = torch_module()
    for batch, seq in ((8, 4096), (1, 8192), (2, 2048)):
        q = torch.randn(batch, seq, 32, 128, device="cuda").to(torch.bfloat16)
        k = torch.randn(batch, seq, 32, 128, device="cuda").to(torch.bfloat16)
        component = rope.RoPE(128, 32, 32)
        angles = torch.arange(seq, device="cuda", dtype=torch.float64)[:, None] * torch.tensor(
            rope.Standard().inv_freq(128), device="cuda"
        )
        cos = torch.cat([angles.cos()] * 2, -1).float()[None]
        sin = torch.cat([angles.sin()] * 2, -1).float()[None]
        inputs = _input_sets(q, k)
        heads_first = [(q.transpose(1, 2), k.transpose(1, 2), cos, sin) for q, k in inputs]
        yield _row(
            f"rope q+k in place B{batch} S{seq} 32q/32kv D128 bf16", "liger",
            _rotating(component.prefill, [(q, k, 0) for q, k in inputs]),
            _rotating(liger_rope.LigerRopeFunction.apply, heads_first),  # Liger: [B, H, S, D]
            4 * q.numel() * 2, ceiling,
        )  # fmt: skip


def _flashinfer(flashinfer_rope, ceiling: float) -> Iterator[dict | None]:
    from . import rope

    torch = torch_module()
    heads, kv_heads, head_dim = 32, 8, 128
    inv_freq = torch.tensor(rope.Standard().inv_freq(head_dim), device="cuda")
    angles = torch.arange(32768, device="cuda", dtype=torch.float64)[:, None] * inv_freq
    cache = torch.cat([angles.cos(), angles.sin()], -1).float()
    ours_cache = getattr(rope, "apply_rope_with_cos_sin_cache_inplace", None)
    for tokens in (32, 4096, 8192, 32768):
        q = torch.randn(tokens, heads * head_dim, device="cuda").to(torch.bfloat16)
        k = torch.randn(tokens, kv_heads * head_dim, device="cuda").to(torch.bfloat16)
        positions = torch.randint(0, 32768, (tokens,), device="cuda", dtype=torch.int32)
        nbytes = 2 * (q.numel() + k.numel()) * 2
        name = f"N{tokens} 32q/8kv D128 bf16"
        inputs = _input_sets(q, k, positions)
        by_heads = [
            (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), p)
            for q, k, p in inputs
        ]  # (FlashInfer's pos_ids calls take [N, H, D])
        component = rope.RoPE(head_dim, heads, kv_heads, max_position=32768)
        yield _row(
            f"rope positions q+k in place {name}", "flashinfer",
            _rotating(component.forward, inputs, "positions"),
            _rotating(
                partial(
                    flashinfer_rope.apply_rope_pos_ids_inplace,
                    rotary_dim=head_dim, interleave=False, rope_theta=1e4,
                ),
                by_heads,
            ),
            nbytes, ceiling,
        )  # fmt: skip
        llama = rope.RoPE(
            head_dim, heads, kv_heads, scheme=rope.Llama31(base=5e5), max_position=32768
        )
        yield _row(
            f"llama31 positions q+k in place {name}", "flashinfer",
            _rotating(llama.forward, inputs, "positions"),
            _rotating(
                partial(
                    flashinfer_rope.apply_llama31_rope_pos_ids_inplace,
                    rotary_dim=head_dim, rope_scale=8, rope_theta=5e5, low_freq_factor=1,
                    high_freq_factor=4, old_context_len=8192,
                ),
                by_heads,
            ),
            nbytes, ceiling,
        )  # fmt: skip
        if ours_cache is not None:
            cache_calls = [(p.long(), q, k, head_dim, cache, True) for q, k, p in inputs]
            yield _row(
                f"cos_sin_cache q+k in place {name}", "flashinfer",
                _rotating(ours_cache, cache_calls),
                _rotating(flashinfer_rope.apply_rope_with_cos_sin_cache_inplace, cache_calls),
                nbytes, ceiling,
            )  # fmt: skip


_PEERS = (
    ("tileops", "tileops.rope", _tileops_rope),
    ("tileops", "tileops.sequence_modeling", _tileops_mhc),
    ("liger", "liger_kernel.ops.rope", _liger),
    ("flashinfer", "flashinfer.rope", _flashinfer),
)


def peer_rows(ceiling: float) -> list[dict]:
    """Every peer that imports, on its workloads beside ours; [] when none imports."""
    rows: list[dict] = []
    header_printed = False
    for _, module_name, workloads in _PEERS:
        module = _peer(module_name)
        if module is None:
            continue
        if not header_printed:
            print(PEER_HEADER, flush=True)
            header_printed = True
        rows += [row for row in workloads(module, ceiling) if row is not None]
    return rows
