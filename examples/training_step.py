"""A training step through RoPE with torch autograd (gradients from the Bwd kernel).

python examples/training_step.py
"""

import torch

from tileops_cupy import cuda_available
from tileops_cupy.rope import RoPE, YaRN, apply_rope

device = "cuda" if torch.cuda.is_available() and cuda_available() else "cpu"
rope = RoPE(head_dim=64, num_heads=8, num_kv_heads=2, scheme=YaRN(scale=4.0))
proj = torch.nn.Linear(256, (8 + 2) * 64, device=device)
optimizer = torch.optim.SGD(proj.parameters(), lr=0.1)

tokens = torch.randn(4, 128, 256, device=device)
qk = proj(tokens)
q, k = qk[..., : 8 * 64], qk[..., 8 * 64 :]
q_rot, k_rot = apply_rope(q, k, rope)
loss = (q_rot.unflatten(-1, (8, 64))[:, :, ::4] * k_rot.unflatten(-1, (2, 64))).sum()
loss.backward()
optimizer.step()
print(f"loss {loss.item():.3f}, grad norm {proj.weight.grad.norm().item():.3f} on {device}")
