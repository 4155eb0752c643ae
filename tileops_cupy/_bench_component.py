"""Bench rows of the in-place Q/K component: prefill, decode and graph replay; per-token
positions for every scheme; its serving calls: MRoPE, the cos_sin_cache drop-in, and the
fused QK-RMSNorm + RoPE beside ``torch.compile`` of the unfused HF math."""

from __future__ import annotations

from ._bench_harness import measure_row, rope_tables, torch_module, torch_rope


def component_rows(ceiling: float, with_compile: bool = True) -> list[dict]:
    from .rope import RoPE

    torch = torch_module()
    rows = []
    q_heads, kv_heads, head_dim = 32, 8, 128

    # prefill: q and k are views into one fused QKV buffer, rotated in place in one launch
    seq = 8192
    qkv = torch.randn(1, seq, (q_heads + 2 * kv_heads) * head_dim, device="cuda").bfloat16()
    q = qkv[..., : q_heads * head_dim].unflatten(-1, (q_heads, head_dim))
    k = qkv[..., q_heads * head_dim : (q_heads + kv_heads) * head_dim].unflatten(
        -1, (kv_heads, head_dim)
    )
    rope = RoPE(head_dim, q_heads, kv_heads, max_position=1 << 16)
    cos, sin = rope_tables(rope.scheme, seq, head_dim)
    reference = torch_rope(cos[:, None, :], sin[:, None, :], neox=True)

    def torch_prefill():
        q.copy_(reference(q))
        k.copy_(reference(k))

    moved = 2 * (q.numel() + k.numel()) * 2
    rows.append(
        measure_row(
            f"component prefill B1 T{seq} {q_heads}q/{kv_heads}kv D128 bf16",
            lambda: rope.prefill(q, k, 0),
            torch_prefill,
            moved,
            ceiling,
            with_compile=with_compile,
        )
    )

    # decode: one token for each of 64 sequences, each at its own position (device tensor)
    batch = 64
    step = torch.randn(batch, 1, (q_heads + 2 * kv_heads) * head_dim, device="cuda").bfloat16()
    q1 = step[..., : q_heads * head_dim]
    k1 = step[..., q_heads * head_dim : (q_heads + kv_heads) * head_dim]
    positions = torch.randint(0, 4096, (batch,), device="cuda")
    moved = 2 * (q1.numel() + k1.numel()) * 2
    rows.append(
        measure_row(
            f"component decode B{batch} T1 {q_heads}q/{kv_heads}kv D128 bf16 (positions [B])",
            lambda: rope.decode(q1, k1, positions),
            None,
            moved,
            ceiling,
            small=True,
        )
    )
    rows.append(
        measure_row(
            f"component decode B{batch} T1 {q_heads}q/{kv_heads}kv D128 bf16 (int position)",
            lambda: rope.decode(q1, k1, 100),
            None,
            moved,
            ceiling,
            small=True,
        )
    )

    # the same decode captured once in a CUDA graph and replayed with new positions
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rope.decode(q1, k1, positions)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope.decode(q1, k1, positions)
    rows.append(
        measure_row(
            f"component decode B{batch} graph replay",
            graph.replay,
            None,
            moved,
            ceiling,
            small=True,
            note="one graph launch",
        )
    )
    rope.check()
    return (
        rows + per_token_rows(ceiling) + serving_rows(ceiling) + qk_norm_rows(ceiling, with_compile)
    )


def per_token_rows(ceiling: float) -> list[dict]:
    """Packed tokens q [N, 32*128], k [N, 8*128] at random per-token positions (device
    tensor), rotated in place in one launch, for every scheme (they differ in the table
    alone). Target: >= 85% of the copy ceiling (q+k bytes) at N >= 8192."""
    from .rope import Llama31, LongRoPE, RoPE, Standard, YaRN

    torch = torch_module()
    q_heads, kv_heads, head_dim = 32, 8, 128
    rows = []
    schemes = {
        "standard": Standard(),
        "llama31": Llama31(),
        "yarn": YaRN(),
        "longrope": LongRoPE(max_position_embeddings=131072),
    }
    for tokens in (8192, 32768):
        q = torch.randn(tokens, q_heads * head_dim, device="cuda").bfloat16()
        k = torch.randn(tokens, kv_heads * head_dim, device="cuda").bfloat16()
        positions = torch.randint(0, 32768, (tokens,), device="cuda")
        for name, scheme in schemes.items():
            if tokens == 8192 and name != "standard":
                continue
            rope = RoPE(head_dim, q_heads, kv_heads, scheme=scheme, max_position=1 << 16)
            rows.append(
                measure_row(
                    f"component positions N{tokens} {q_heads}q/{kv_heads}kv D128 bf16 {name}",
                    lambda rope=rope, q=q, k=k, positions=positions: rope.forward(
                        q, k, positions=positions
                    ),
                    None,
                    2 * (q.numel() + k.numel()) * 2 + positions.numel() * 8,
                    ceiling,
                    note="target >= 85%",
                )
            )
            rope.check()
    return rows


def serving_rows(ceiling: float) -> list[dict]:
    """MRoPE (sectioned and interleaved, positions [3, N]) and the cos_sin_cache call on
    packed tokens, in place on fused-QKV views: % of the copy ceiling (q + k bytes)."""
    from .rope import RoPE, apply_rope_with_cos_sin_cache_inplace

    torch = torch_module()
    rows = []
    q_heads, kv_heads, head_dim = 32, 8, 128
    mrope = {
        "sectioned": RoPE(head_dim, q_heads, kv_heads, mrope_section=(16, 24, 24)),
        "interleaved": RoPE(
            head_dim, q_heads, kv_heads, mrope_section=(24, 20, 20), mrope_interleaved=True
        ),
    }
    max_position = 1 << 17
    angles = torch.rand(max_position, head_dim // 2, device="cuda") * 1e4
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).contiguous()
    for tokens in (8192, 32768):
        qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device="cuda").bfloat16()
        q = qkv[:, : q_heads * head_dim]
        k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim]
        moved = 2 * (q.numel() + k.numel()) * 2
        thw = torch.randint(0, 1 << 20, (3, tokens), device="cuda")
        for name, rope in mrope.items():
            rows.append(
                measure_row(
                    f"MRoPE {name} N{tokens} {q_heads}q/{kv_heads}kv D128 bf16 (positions [3, N])",
                    lambda rope=rope, q=q, k=k, thw=thw: rope.forward(q, k, positions=thw),
                    None,
                    moved,
                    ceiling,
                )
            )
            rope.check()
        positions = torch.randint(0, max_position, (tokens,), device="cuda")
        rows.append(
            measure_row(
                f"cos_sin_cache inplace N{tokens} {q_heads}q/{kv_heads}kv D128 bf16",
                lambda q=q, k=k, positions=positions: apply_rope_with_cos_sin_cache_inplace(
                    positions, q, k, head_dim, cache
                ),
                None,
                moved,
                ceiling,
            )
        )
    return rows


def qk_norm_rows(ceiling: float, with_compile: bool = True) -> list[dict]:
    """Fused QK-RMSNorm + RoPE on packed tokens at random per-token positions, q and k as
    views of one fused QKV buffer, beside the HF math unfused (``Qwen3RMSNorm``: float32
    variance, rounded to the data's dtype, times the weight; then ``apply_rotary_pos_emb``
    with cos/sin gathered per token), eager and compiled."""
    from .rope import RoPE

    torch = torch_module()
    q_heads, kv_heads, head_dim, eps = 32, 8, 128, 1e-6
    rope = RoPE(head_dim, q_heads, kv_heads, norm_eps=eps)
    q_weight = (1 + 0.1 * torch.randn(head_dim, device="cuda")).bfloat16()
    k_weight = (1 + 0.1 * torch.randn(head_dim, device="cuda")).bfloat16()
    rows = []
    for tokens in (8192, 32768):
        width = (q_heads + 2 * kv_heads) * head_dim
        qkv = torch.randn(tokens, width, device="cuda").bfloat16()
        q = qkv[:, : q_heads * head_dim]
        k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim]
        positions = torch.randint(0, 1 << 16, (tokens,), device="cuda")
        cos, sin = rope_tables(rope.scheme, tokens, head_dim, positions.cpu().numpy())
        # HF's tables: (cos, cos) and (sin, sin) over the whole head, in the data's dtype
        cos, sin = (torch.cat([t, t], -1)[:, None].bfloat16() for t in (cos, sin))

        def hf_unfused(q=q, k=k, cos=cos, sin=sin):
            for x, weight in ((q, q_weight), (k, k_weight)):
                head_rows = x.unflatten(-1, (-1, head_dim))
                variance = head_rows.float().pow(2).mean(-1, keepdim=True)
                normed = weight * (head_rows.float() * torch.rsqrt(variance + eps)).bfloat16()
                x1, x2 = normed.chunk(2, dim=-1)
                rotated = normed * cos + torch.cat([-x2, x1], -1) * sin
                x.copy_(rotated.flatten(-2))

        def fused(q=q, k=k, positions=positions):
            rope.forward(q, k, positions=positions, q_norm_weight=q_weight, k_norm_weight=k_weight)

        moved = 2 * (q.numel() + k.numel()) * 2
        rows.append(
            measure_row(
                f"qk-norm+rope N{tokens} {q_heads}q/{kv_heads}kv D128 bf16 (positions [N])",
                fused,
                hf_unfused,
                moved,
                ceiling,
                with_compile=with_compile,
                note="torch columns: HF RMSNorm then rotary, unfused",
            )
        )
    rope.check()
    return rows
