"""Serving loop with the in-place Q/K component: chunked prefill, then batched decode.

Runs on the GPU when torch sees one (CUDA kernels, CUDA-graph replay of decode), else on
the host (numpy path, through torch CPU tensors).

    python examples/serving_loop.py
"""

import torch

from tileops_cupy import cuda_available
from tileops_cupy.rope import Llama31, RoPE, table_cache_info

device = "cuda" if torch.cuda.is_available() and cuda_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
heads, kv_heads, head_dim, prompt, batch = 32, 8, 128, 1024, 8
width = (heads + 2 * kv_heads) * head_dim

layers = [RoPE(head_dim, heads, kv_heads, scheme=Llama31(), max_position=8192) for _ in range(4)]
print("layers share", len(table_cache_info()["entries"]), "table(s)")

# prefill: each layer rotates q and k in place inside its fused QKV buffer, chunk by chunk
qkv = torch.randn(batch, prompt, width, device=device, dtype=dtype)
q, k = qkv[..., : heads * head_dim], qkv[..., heads * head_dim : (heads + kv_heads) * head_dim]
for rope in layers:
    for start in range(0, prompt, 256):
        rope.prefill(q[:, start : start + 256], k[:, start : start + 256], start)

# decode: one token per sequence, each sequence at its own length
lengths = torch.arange(prompt, prompt + batch, device=device)
step = torch.randn(batch, 1, width, device=device, dtype=dtype)
q1, k1 = step[..., : heads * head_dim], step[..., heads * head_dim : (heads + kv_heads) * head_dim]
for _ in range(3):
    for rope in layers:
        rope.decode(q1, k1, lengths)
    lengths += 1

if device == "cuda":  # capture one decode step and replay it with new positions
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layers[0].decode(q1, k1, lengths)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers[0].decode(q1, k1, lengths)
    for _ in range(3):
        lengths += 1
        graph.replay()
    layers[0].check()
print("served", batch, "sequences on", device, "up to position", int(lengths.max()))
