"""Every CUDA path once at small, awkward shapes, for ``compute-sanitizer --tool memcheck``
(not collected by pytest): ``compute-sanitizer --tool memcheck python tests/gpu_memcheck.py``.
Odd sizes, strided views, partial rotary, out-of-range device positions (clamped), MRoPE,
the cos_sin_cache drop-in and the fused QK-norm (misaligned weights included; both of its lane
layouts)."""

import contextlib

import torch

from tileops_cupy import _mhc, _rotate
from tileops_cupy.rope import (
    RoPE,
    RoPEBwdOp,
    RoPEFwdOp,
    RoPENeoxPositionIdsFwdOp,
    YaRNFwdOp,
    apply_rope,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)
from tileops_cupy.sequence_modeling import MHCPostBwdOp, MHCPostFwdOp, MHCPreBwdOp, MHCPreFwdOp

torch.manual_seed(0)
cuda = "cuda"
for dtype in (torch.bfloat16, torch.float32):
    x = torch.randn(2, 37, 3, 72, device=cuda, dtype=dtype)
    RoPEFwdOp("interleaved", "2d")(x[:, :, :, :64])
    RoPEBwdOp("neox", "1d")(torch.randn(1030, 48, device=cuda, dtype=dtype)[:, 2:])
    YaRNFwdOp("2d", rotary_dim=32)(x)
    ids = torch.tensor([0, 5, 4095, 9999, -3], device=cuda)  # two out of range: clamped
    ids_op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=16)
    ids_op(torch.randn(5, 3, 40, device=cuda, dtype=dtype), ids)
    rope = RoPE(64, 4, 2, max_position=2048, rotary_dim=48)
    qkv = torch.randn(3, 5, 8 * 64 + 1, device=cuda, dtype=dtype)[..., 1:]
    q, k = qkv[..., : 4 * 64], qkv[..., 4 * 64 : 6 * 64]
    rope.prefill(q, k, torch.tensor([0, 2000, 7], device=cuda))
    rope.decode(q[:, :1], k[:, :1], torch.tensor([1, 2047, 3000], device=cuda, dtype=torch.int32))
    with contextlib.suppress(ValueError):  # 3000 was clamped and flagged
        rope.check()
    rope.forward(q, k, positions=torch.randint(0, 2048, (3, 5), device=cuda))
    apply_rope(q, k, rope, 11)
    weights = torch.randn(2, 64 + 1, device=cuda, dtype=dtype)[:, 1:]  # misaligned rows
    rope.prefill(q, k, 5, q_norm_weight=weights[0], k_norm_weight=weights[1])
    apply_rope(q, k, rope, 9, q_norm_weight=weights[0], k_norm_weight=weights[1])
    mrope = RoPE(64, 4, 2, rotary_dim=48, mrope_section=(8, 8, 8), mrope_interleaved=True)
    mrope.forward(q, k, positions=torch.randint(0, 4096, (3, 3, 5), device=cuda))
    mrope.forward(q, k, positions=torch.randint(0, 4096, (3, 3, 5), device=cuda),
                  q_norm_weight=weights[0], k_norm_weight=weights[1])  # fmt: skip
    # the norm in place on 16-byte aligned rows (16-byte accesses): head_dim 80 with a tail
    # wider than the rotated part (32 columns past rotary_dim 48), three q heads and one k head
    # (a round left short); one block, and many blocks whose last runs past the last token
    norms = {  # q's weight in float32, k's in the data's dtype
        "q_norm_weight": torch.rand(80, device=cuda),
        "k_norm_weight": torch.rand(80, device=cuda, dtype=dtype),
    }
    for rope_layout in ("neox", "interleaved"):
        normed = RoPE(80, 3, 1, rotary_dim=48, rope_layout=rope_layout)
        for tokens in (3, 8192):
            rows = torch.randn(tokens, 4 * 80, device=cuda, dtype=dtype)
            positions = torch.randint(0, 4096, (tokens,), device=cuda)
            normed.forward(rows[:, :240], rows[:, 240:], positions=positions, **norms)
    # NORM_ROWS (one pack of a row a lane): bf16 rows rotated whole, in place, in a launch
    # large enough for that layout; an odd token count, so the last block's second token is
    # past the last one (it reads the last token, writes nothing); plain and MRoPE tables.
    # (float32 rows take NORM_CHUNKS's large layout here.)
    for rope_layout, section in (("neox", None), ("interleaved", None), ("neox", (16, 24, 24))):
        whole = RoPE(128, 3, 1, rope_layout=rope_layout, mrope_section=section)
        tokens = 32769
        rows = torch.randn(tokens, 5 * 128, device=cuda, dtype=dtype)
        shape = (tokens,) if section is None else (3, tokens)
        positions = torch.randint(0, 1 << 20, shape, device=cuda)
        whole.forward(rows[:, :384], rows[:, 384:512], positions=positions, **{
            "q_norm_weight": torch.rand(128, device=cuda),
            "k_norm_weight": torch.rand(128, device=cuda, dtype=dtype),
        })  # fmt: skip
    # rope_rotate_shared (a chunk of one row a thread; a block's token's cos/sin in shared
    # memory) and rope_rotate_packs (rows rotated whole, 16 bytes of a row a lane): launches
    # large enough for them, 9 row groups of an odd token count (in bf16 its last warp half
    # past the last row), rows of a wider buffer, both layouts, forward and backward; a
    # prefill of q and k in a fused QKV row (10 q row groups, then 1 of k: in bf16 the last
    # warp half past k's last row; shared: 44 rows a token, blocks of 15, 15 and 14); the same
    # at per-token positions, a few past max_position (read clamped, flagged), MRoPE in
    # sections on lane boundaries or interleaved in groups (Qwen3-VL's: the grouped tables),
    # and from a cos_sin_cache; MRoPE sections that split a lane's pairs at the same size
    # (rope_rotate's chunks). Each
    # twice: with the shipped bounds (rope_rotate_packs), then with rope_rotate_packs out of
    # reach and rope_rotate_shared from any size on any device (the sequential launches; their
    # tokens in grid rows of 1000, the last partial).
    names = (
        "_PACK_MIN_HEAD_ROWS",
        "_SHARED_MIN_HEAD_ROWS",
        "_MAX_GRID_Y",
        "_SHARED_MAX_SM_BANDWIDTH",
    )
    shipped = tuple(getattr(_rotate, name) for name in names)
    for bounds in (shipped, (1 << 62, 0, 1000, float("inf"))):
        for name, bound in zip(names, bounds, strict=True):
            setattr(_rotate, name, bound)
        _rotate._plans.clear()
        wide = torch.randn(1, 4097, 37, 128, device=cuda, dtype=dtype)[:, :, 1:]  # 36 heads
        for rope_layout in ("neox", "interleaved"):
            RoPEFwdOp(rope_layout, "2d")(wide)
            RoPEBwdOp(rope_layout, "2d")(wide)
        qkv = torch.randn(1, 4097, 48, 128, device=cuda, dtype=dtype)
        RoPE(128, 40, 4).prefill(qkv[:, :, :40], qkv[:, :, 40:44], 5)
        ids = torch.randint(0, 1 << 16, (4097,), device=cuda)
        ids[::97] = (1 << 16) + 5
        for rope_layout in ("neox", "interleaved"):
            packed = RoPE(128, 40, 4, rope_layout=rope_layout, max_position=1 << 16)
            packed.forward(qkv[0, :, :40], qkv[0, :, 40:44], positions=ids)
            torch.cuda.synchronize()
            with contextlib.suppress(ValueError):  # the flag of the clamped positions
                packed.check()
            three_rows = torch.randint(0, 4096, (3, 4097), device=cuda)
            for section, interleaved in (((16, 24, 24), False), ((17, 23, 24), False),
                                         ((24, 20, 20), True)):  # fmt: skip
                sectioned = RoPE(128, 40, 4, rope_layout=rope_layout, mrope_section=section,
                                 mrope_interleaved=interleaved)  # fmt: skip
                sectioned.forward(qkv[0, :, :40], qkv[0, :, 40:44], positions=three_rows)
            cache = torch.randn(5000, 128, device=cuda)
            apply_rope_with_cos_sin_cache_inplace(
                ids % 5000, qkv[0, :, :40], qkv[0, :, 40:44], 128, cache, rope_layout == "neox"
            )
            if dtype != torch.float32:  # the fused norm in the same layout, misaligned weights
                normed = RoPE(128, 40, 4, rope_layout=rope_layout, max_position=1 << 16)
                w = torch.rand(2, 129, device=cuda, dtype=dtype)[:, 1:]
                normed.forward(qkv[0, :, :40], qkv[0, :, 40:44], positions=ids % (1 << 16),
                               q_norm_weight=w[0], k_norm_weight=w[1])  # fmt: skip
                for interleaved in (False, True):
                    normed = RoPE(128, 40, 4, rope_layout=rope_layout, mrope_section=(24, 20, 20),
                                  mrope_interleaved=interleaved)  # fmt: skip
                    normed.forward(qkv[0, :, :40], qkv[0, :, 40:44], positions=three_rows,
                                   q_norm_weight=w[0], k_norm_weight=w[1])  # fmt: skip
    for name, bound in zip(names, shipped, strict=True):
        setattr(_rotate, name, bound)
    _rotate._plans.clear()
    cache = torch.randn(100, 40, device=cuda)
    tokens = torch.randn(15, 4 * 64 + 1, device=cuda, dtype=dtype)[:, 1:]
    token_ids = torch.tensor([0, 99, 100, -1, 7] * 3, device=cuda)  # two out of range: clamped
    apply_rope_with_cos_sin_cache(token_ids, tokens, tokens[:, :128], 64, cache, False)
    torch.cuda.synchronize()
    with contextlib.suppress(ValueError):  # the flag of the clamped ids: this call stops
        apply_rope_with_cos_sin_cache_inplace(token_ids, tokens, None, 64, cache)
    apply_rope_with_cos_sin_cache_inplace(
        token_ids % 100, tokens[:, :128], tokens[:, 128:], 64, cache
    )
    torch.cuda.synchronize()
    for check in (ids_op.check, rope.check):
        with contextlib.suppress(ValueError):
            check()
    # decode-sized, cooperative (fused: 129 and 200 tokens), and four-kernel launches (K
    # tails, a partial last tile, rows that are not 16-byte vectors: c_x 100)
    shapes = (
        (4, 130, 3), (3, 64, 300), (1, 24, 1), (2, 512, 40), (2, 100, 300), (4, 200, 520),
        (4, 264, 129), (2, 100, 200),
    )  # fmt: skip
    for n, c_x, batch in shapes:
        phi = torch.randn(n * c_x, n * n + 2 * n, device=cuda) / 8
        b = torch.randn(n * n + 2 * n, device=cuda)
        xm = torch.randn(batch, n * c_x + 8, device=cuda, dtype=dtype)[:, 8:]
        pre, post, post_backward = MHCPreFwdOp(1.0, 0.9, 1.1, 20), MHCPostFwdOp(), MHCPostBwdOp()
        for _ in range(2):  # the second call of a layout relaunches the first's launch
            x_res, x_layer, h_post = pre(phi, xm, b)
            post(x_layer, h_post, x_res)
            post_backward(x_layer, h_post, x_res, torch.randn_like(x_res))
        # every pipeline of the projection compiled for this dtype and n, each forced (fp16
        # too: its x takes two bf16 pieces)
        shipped = _mhc.project_pipelines
        for x_dtype in (dtype, torch.float16):
            name = str(x_dtype).removeprefix("torch.")
            for pipeline in shipped(name, n):
                _mhc.project_pipelines, _mhc._pre_plans = lambda *_, p=pipeline: (p,), {}
                MHCPreFwdOp(1.0, 0.9, 1.1, 20)(phi, xm.to(x_dtype), b)
        _mhc.project_pipelines, _mhc._pre_plans = shipped, {}
        # mhc_coefficients with one thread a token (planned from 4096 tokens), forced
        threshold, _mhc._MIN_TOKEN_COEFFICIENT_ROWS = _mhc._MIN_TOKEN_COEFFICIENT_ROWS, 0
        MHCPreFwdOp(1.0, 0.9, 1.1, 20)(phi, xm, b)
        _mhc._MIN_TOKEN_COEFFICIENT_ROWS, _mhc._pre_plans = threshold, {}
        upstream = (torch.randn_like(x_res), torch.randn_like(x_layer), torch.randn_like(h_post))
        pre_backward = MHCPreBwdOp(1.0, 0.9, 1.1, 20)
        for _ in range(2):
            pre_backward(phi, xm, b, *upstream)
torch.cuda.synchronize()
print("memcheck script done")
