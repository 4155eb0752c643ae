"""Training steps through mHC and RoPE with torch autograd: every gradient comes from the
ops' backward kernels (on the host, their numpy bodies). Each block learns its phi, b and
the three mHC alphas (folded into phi's columns, so the op is built with 1.0) and rotates
q and k with a YaRN-scaled RoPE.

    python examples/training_step.py
"""

import torch

from tileops_cupy import cuda_available
from tileops_cupy.rope import RoPE, YaRN, apply_rope
from tileops_cupy.sequence_modeling import MHCPostFwdOp, MHCPreFwdOp

device = "cuda" if torch.cuda.is_available() and cuda_available() else "cpu"
n, c_x, heads, kv_heads, head_dim = 4, 256, 8, 2, 32  # n residual streams of width c_x


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        q = n * n + 2 * n  # phi's width: h_pre, h_post, the n x n mixing logits
        self.phi = torch.nn.Parameter(torch.randn(n * c_x, q, device=device) / (n * c_x) ** 0.5)
        self.b = torch.nn.Parameter(torch.zeros(q, device=device))
        self.alphas = torch.nn.Parameter(torch.ones(3, device=device))  # pre, post, res
        self.pre, self.post = MHCPreFwdOp(1.0, 1.0, 1.0, sinkhorn_repeat=20), MHCPostFwdOp()
        self.qk = torch.nn.Linear(c_x, (heads + kv_heads) * head_dim, device=device)
        self.out = torch.nn.Linear(heads * head_dim, c_x, device=device)
        self.rope = RoPE(head_dim, heads, kv_heads, scheme=YaRN(scale=4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [tokens, n*c_x]
        a_pre, a_post, a_res = self.alphas
        scale = torch.cat([a_pre.expand(n), a_post.expand(n), a_res.expand(n * n)])
        x_res, x_layer, h_post = self.pre(self.phi * scale, x, self.b)
        q, k = self.qk(x_layer).split([heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = apply_rope(q[None], k[None], self.rope)  # the tokens as one sequence
        mixed = q[0] * k[0].repeat(1, heads // kv_heads)  # (a stand-in for attention)
        return self.post(self.out(mixed), h_post, x_res)


model = torch.nn.Sequential(Block(), Block())
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
tokens, target = (torch.randn(64, n * c_x, device=device) for _ in range(2))
for step in range(3):
    optimizer.zero_grad()
    loss = (model(tokens) - target).square().mean()
    loss.backward()
    optimizer.step()
    alphas = model[0].alphas.grad.norm().item()
    print(f"step {step}: loss {loss.item():.4f}, |d loss / d alphas| {alphas:.2e} on {device}")
