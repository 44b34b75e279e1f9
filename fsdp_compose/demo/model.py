"""A small Llama-style decoder-only transformer for the demo.

Pre-norm residual blocks (RMSNorm -> causal attention with rotary position
embeddings -> RMSNorm -> SwiGLU MLP), a final norm, and an output head whose
weight is tied to the token embedding. The blocks live in ``self.layers`` so
the demo can ``fully_shard`` each one and then the root.

Shape letters: b batch, s sequence, d model dim, h heads, k head dim,
f MLP hidden dim, v vocabulary. Under tensor parallelism (``train.py --tp``)
h and f are this rank's share; attention and MLP code is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    vocab_size: int = 128
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 256
    ffn_hidden_dim: int | None = None  # None: about 8/3 * dim, rounded up to 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into {self.n_heads} heads of even size")
        if self.ffn_hidden_dim is None:
            self.ffn_hidden_dim = 32 * math.ceil(8 * self.dim / 3 / 32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (b, s, 1)
        return x * rms * self.weight  # (b, s, d)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angle for each (position, frequency pair)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (k/2,)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (s, k/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + k/2]) of every head by its position's angle."""
    x1, x2 = x.chunk(2, dim=-1)  # (b, h, s, k/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # (b, h, s, k)


class Attention(nn.Module):
    """Causal self-attention. q, k and v are separate projections so a tensor-parallel
    plan can shard each by output features (whole heads per rank); the head count
    is read off the projection's output, so a rank computes just its local heads."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, h, s, k) each; h = n_heads, or n_heads / tp on a tensor-parallel rank
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (b, h, s, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, s, k)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # (b, s, d)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = args.ffn_hidden_dim
        assert hidden is not None  # (ModelArgs.__post_init__ sets it)
        self.w_gate = nn.Linear(args.dim, hidden, bias=False)
        self.w_up = nn.Linear(args.dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))  # (b, s, d)


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (b, s, d)
        return x + self.feed_forward(self.ffn_norm(x))  # (b, s, d)


class Transformer(nn.Module):
    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied: one parameter, two names
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_s, k/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_s, k/2)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) everywhere, residual-output projections scaled down
        by sqrt(2 * n_layers) so the residual stream does not grow with depth."""
        std = self.args.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w_down.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.args.n_layers))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if s > self.args.max_seq_len:
            raise ValueError(f"sequence length {s} > max_seq_len {self.args.max_seq_len}")
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]  # (s, k/2)
        h = self.tok_embeddings(tokens)  # (b, s, d)
        for layer in self.layers:
            h = layer(h, cos, sin)  # (b, s, d)
        return self.output(self.norm(h))  # (b, s, v)
