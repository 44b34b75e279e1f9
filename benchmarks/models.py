"""Benchmark models and data: the same for every implementation.

Imports torch: only the rank processes import this module (the orchestrating
parent in ``benchmarks.peers`` stays torch-free, so a spawned rank's
``ru_maxrss`` is not inflated by the parent's memory).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from benchmarks.shapes import SHAPES, Shape  # noqa: F401  (re-exported)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.ReLU() if act == "relu" else nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class MLPStack(nn.Module):
    """``blocks`` residual MLP blocks, then a LayerNorm owned by the root."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.shape = shape
        self.blocks = nn.ModuleList(MLPBlock(shape.dim, shape.hidden, shape.act)
                                    for _ in range(shape.blocks))
        self.norm = nn.LayerNorm(shape.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)

    def example_input(self) -> torch.Tensor:
        """One rank's batch (``python -m tools.plan --measure``)."""
        return torch.randn(self.shape.batch, self.shape.dim)


def stack(name: str) -> MLPStack:
    """The benchmark model of shape ``name``, for ``python -m tools.plan --model
    "benchmarks.models:stack('deep')"`` (built on the current default device)."""
    return MLPStack(SHAPES[name])


def build_model(shape: Shape, seed: int, device: torch.device) -> MLPStack:
    """Same init on every rank and for every implementation (CPU RNG, then moved)."""
    torch.manual_seed(seed)
    model = MLPStack(shape)
    return model.to(device)


def make_data(shape: Shape, seed: int, rank: int, n_steps: int, device: torch.device):
    """Per-rank (input, target) pairs for ``n_steps`` steps; independent of the
    implementation, so every implementation sees exactly the same batches."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (rank + 1))
    out = []
    for _ in range(n_steps):
        x = torch.randn(shape.batch, shape.dim, generator=g)
        y = torch.randn(shape.batch, shape.dim, generator=g)
        out.append((x.to(device), y.to(device)))
    return out
