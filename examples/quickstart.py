"""Quickstart: every op on NumPy arrays (the host path, no GPU needed).

On a machine with a GPU, pass torch CUDA tensors or CuPy arrays instead: the same calls
run the CUDA kernels on the caller's current stream and return the caller's framework.

    python examples/quickstart.py
"""

import numpy as np

from tileops_cupy.rope import (
    RoPE,
    RoPEBwdOp,
    RoPEFwdOp,
    RoPENeoxPositionIdsFwdOp,
    YaRN,
    YaRNFwdOp,
    table_cache_info,
)

rng = np.random.default_rng(0)

# 1. Out-of-place RoPE on [batch, seq, heads, head_dim]; the Bwd twin inverts it.
x = rng.standard_normal((2, 128, 8, 64)).astype(np.float32)
y = RoPEFwdOp(rope_layout="neox", input_layout="2d")(x)
x_back = RoPEBwdOp(rope_layout="neox", input_layout="2d")(y)
print("RoPE fwd/bwd round trip, max error:", float(np.abs(x_back - x).max()))

# 2. Scaled frequencies: YaRN carries an amplitude a, so Bwd(Fwd(x)) = a*a*x.
y = YaRNFwdOp(input_layout="1d", scale=4.0)(x[0, :, 0, :])
print("YaRN output", y.shape, y.dtype)

# 3. Packed tokens at explicit positions, rotating the first 32 of 64 columns.
tokens = rng.standard_normal((5, 8, 64)).astype(np.float32)
position_ids = np.array([0, 1, 2, 0, 1])  # two sequences packed together
op = RoPENeoxPositionIdsFwdOp(max_position=4096, rotary_dim=32)
print("position ids op", op(tokens, position_ids).shape)

# 4. The in-place Q/K component: rotate q and k inside a fused QKV buffer (GQA 8q/2kv),
#    prefill a prompt in two chunks, then decode one token per sequence.
rope = RoPE(head_dim=64, num_heads=8, num_kv_heads=2, scheme=YaRN(scale=4.0))
qkv = rng.standard_normal((2, 48, (8 + 2 + 2) * 64)).astype(np.float32)
q, k = qkv[..., : 8 * 64], qkv[..., 8 * 64 : 10 * 64]
rope.prefill(q[:, :32], k[:, :32], position_offset=0)
rope.prefill(q[:, 32:], k[:, 32:], position_offset=32)
step = rng.standard_normal((2, 1, (8 + 2 + 2) * 64)).astype(np.float32)
rope.decode(step[..., : 8 * 64], step[..., 8 * 64 : 10 * 64], position=np.array([48, 48]))
print("component tables:", rope.memory_stats()["shared"]["host"], "host bytes, shared")
print("shared tables in this process:", len(table_cache_info()["entries"]))

# 5. mHC: reduce a 4-stream hyper-connection to the layer input, then mix the layer output
#    back. phi is [n*c_x, n*n+2n] float32; x is [batch, n*c_x] (bf16 in models, any float here).
from tileops_cupy.sequence_modeling import MHCPostFwdOp, MHCPreFwdOp  # noqa: E402

n, c_x, batch = 4, 256, 8
phi = (rng.standard_normal((n * c_x, n * n + 2 * n)) * 0.02).astype(np.float32)
bias = np.zeros(n * n + 2 * n, np.float32)
streams = rng.standard_normal((batch, n * c_x)).astype(np.float32)
pre = MHCPreFwdOp(alpha_pre=1.0, alpha_post=1.0, alpha_res=1.0, sinkhorn_repeat=20)
x_res, x_layer, h_post = pre(phi, streams, bias)
layer_out = np.tanh(x_layer)  # stands in for the transformer layer
x_next = MHCPostFwdOp()(layer_out, h_post, x_res)
print("mHC: layer input", x_layer.shape, "-> next streams", x_next.shape)
