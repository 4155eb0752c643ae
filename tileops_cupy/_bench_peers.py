"""Peer rows: TileOPs, Liger and FlashInfer beside our op on the same inputs, same timer.

Peers are never dependencies: a peer that does not import (or whose call fails) is named
and skipped. Each row is one workload: our median time and % of the copy ceiling, the
peer's, and ours/peer (below 1 means we are faster). ``../shared/PERF.md`` says how to
carry the peers' wheels to a machine without network.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from functools import partial

from ._bench_harness import median_us, torch_module

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


def _row(name: str, peer: str, ours: Callable, theirs: Callable, bytes_moved: int, ceiling: float):
    """Time both (ours first), print and return the row; None if the peer's call fails."""
    try:
        theirs()
        peer_us = median_us(theirs)
    except Exception as error:
        print(f"peer {peer} failed on {name}: {type(error).__name__}: {str(error)[:160]}")
        return None
    ours()
    ours_us = median_us(ours)

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
    }
    print(
        f"| {row['name']:<54} | {ours_us:9.1f} | {row['pct_ceiling']:5.1f}% | {peer_us:9.1f} "
        f"| {row['peer_pct_ceiling']:5.1f}% | {row['ours_over_peer']:9.2f} |",
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
        for name, op_class, layout in cases:
            ours = getattr(rope, op_class)(input_layout="2d", **layout)
            theirs = getattr(peer_rope, op_class)(input_layout="2d", **layout)
            yield _row(
                f"rope {name} B{batch} S{seq} H32 D128 bf16", "tileops",
                partial(ours, x), partial(theirs, x),
                2 * x.numel() * 2, ceiling,
            )  # fmt: skip
    for tokens in (32768, 4096, 32):
        x = torch.randn(tokens, 32, 128, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, 32768, (tokens,), device="cuda")
        ours = rope.RoPENeoxPositionIdsFwdOp(32768)
        theirs = peer_rope.RoPENeoxPositionIdsFwdOp(max_position=32768)
        yield _row(
            f"rope position ids N{tokens} H32 D128 bf16", "tileops", partial(ours, x, ids),
            partial(theirs, x, ids), 2 * x.numel() * 2 + ids.numel() * 8, ceiling,
        )  # fmt: skip


def _tileops_mhc(peer_module, ceiling: float) -> Iterator[dict | None]:
    from . import sequence_modeling as ours_module

    torch = torch_module()
    for batch, n, c_x in ((1, 4, 1280), (128, 4, 4096), (4096, 4, 4096), (16384, 4, 7168)):
        width = n * c_x
        phi = torch.randn(width, n * n + 2 * n, device="cuda") * 0.02
        x = torch.randn(batch, width, device="cuda").to(torch.bfloat16)
        b = torch.randn(n * n + 2 * n, device="cuda") * 0.1
        gates = (1.0, 1.0, 1.0, 20, 0.02)
        ours, theirs = ours_module.MHCPreFwdOp(*gates), peer_module.MHCPreFwdOp(*gates)
        pre_bytes = 2 * x.numel() * 2 + phi.numel() * 4 + batch * (c_x * 2 + n * 4)
        shape = f"B{batch} n{n} c_x{c_x} bf16"
        yield _row(
            f"mhc pre {shape}", "tileops", partial(ours, phi, x, b), partial(theirs, phi, x, b),
            pre_bytes, ceiling,
        )  # fmt: skip
        layer = torch.randn(batch, c_x, device="cuda").to(torch.bfloat16)
        h_post = torch.rand(batch, n, device="cuda") * 2
        post_ours, post_theirs = ours_module.MHCPostFwdOp(), peer_module.MHCPostFwdOp()
        yield _row(
            f"mhc post {shape}", "tileops", partial(post_ours, layer, h_post, x),
            partial(post_theirs, layer, h_post, x),
            layer.numel() * 2 + h_post.numel() * 4 + 2 * x.numel() * 2, ceiling,
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
        q_heads_first, k_heads_first = q.transpose(1, 2), k.transpose(1, 2)  # Liger: [B, H, S, D]
        yield _row(
            f"rope q+k in place B{batch} S{seq} 32q/32kv D128 bf16", "liger",
            partial(component.prefill, q, k, 0),
            partial(liger_rope.LigerRopeFunction.apply, q_heads_first, k_heads_first, cos, sin),
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
        component = rope.RoPE(head_dim, heads, kv_heads, max_position=32768)
        q_heads, k_heads = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
        yield _row(
            f"rope positions q+k in place {name}", "flashinfer",
            partial(component.forward, q, k, positions=positions),
            partial(
                flashinfer_rope.apply_rope_pos_ids_inplace,
                q_heads, k_heads, positions, rotary_dim=head_dim, interleave=False,
                rope_theta=1e4,
            ),
            nbytes, ceiling,
        )  # fmt: skip
        llama = rope.RoPE(
            head_dim, heads, kv_heads, scheme=rope.Llama31(base=5e5), max_position=32768
        )
        yield _row(
            f"llama31 positions q+k in place {name}", "flashinfer",
            partial(llama.forward, q, k, positions=positions),
            partial(
                flashinfer_rope.apply_llama31_rope_pos_ids_inplace,
                q_heads, k_heads, positions, rotary_dim=head_dim, rope_scale=8,
                rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192,
            ),
            nbytes, ceiling,
        )  # fmt: skip
        if ours_cache is not None:
            long_positions = positions.long()
            yield _row(
                f"cos_sin_cache q+k in place {name}", "flashinfer",
                partial(ours_cache, long_positions, q, k, head_dim, cache, True),
                partial(
                    flashinfer_rope.apply_rope_with_cos_sin_cache_inplace,
                    long_positions, q, k, head_dim, cache, True,
                ),
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
