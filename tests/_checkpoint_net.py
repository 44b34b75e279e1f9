"""The model of tests/test_checkpoint.py, which tests/test_checkpoint_safe_load.py
and tests/test_drop_in.py train too, with its batches, optimizer and sharding.

What makes checkpoints hard: a tied embedding/head (one list unit), a float64
parameter (``Scale``) next to float32 ones and a frozen parameter in the
root unit, a buffer, parameters whose rows are split across ranks, and ranks
that hold no rows of a parameter. ``batch(step, rank, world)`` is this
rank's rows of the global batch of ``ROWS`` rows of ``T`` tokens (vocabulary
``V``, width ``D``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compose import fully_shard

from ._support import Block

V, D, ROWS, T = 13, 8, 8, 5   # vocab, width, global batch rows, tokens per row


class Scale(nn.Module):
    """A float64 parameter (mixed dtypes in the root unit)."""

    def __init__(self, d: int = D):
        super().__init__()
        self.w = nn.Parameter(torch.empty(d, dtype=torch.float64))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.w, 0.5, 1.5)

    def forward(self, x):
        return x * self.w.to(x.dtype)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(D) for _ in range(2)])
        self.scale = Scale()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.head.weight = self.embed.weight          # tied embedding / head
        self.norm.bias.requires_grad_(False)          # frozen
        self.register_buffer("pos", torch.arange(D, dtype=torch.float32) / D)

    def reset_parameters(self):  # the buffer, for materialize (eager: set above)
        self.pos.copy_(torch.arange(D, dtype=torch.float32) / D)

    def forward(self, tok):
        x = self.embed(tok) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(self.scale(x)))


def shard_ours(model: Net, granularity: str = "row") -> Net:
    g = {"shard_granularity": granularity}
    for layer in model.layers:
        fully_shard(layer, **g)
    fully_shard([model.embed, model.head], **g)       # the tied pair: one list unit
    return fully_shard(model, **g)                    # scale (f64) + norm (frozen bias)


def shard_fsdp2(model: Net) -> Net:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    for layer in model.layers:
        fsdp2_shard(layer)
    fsdp2_shard(model.scale)                          # FSDP2 wants one dtype per unit
    return fsdp2_shard(model)


def make_optim(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(V, (ROWS, T), generator=g)
    tgt = torch.randint(V, (ROWS, T), generator=g)
    k = ROWS // world
    return tok[rank * k:(rank + 1) * k], tgt[rank * k:(rank + 1) * k]


def train(model, opt, steps, rank, world) -> list[float]:
    """Local losses (the mean over ranks is the global loss: equal rows per rank)."""
    losses = []
    for s in steps:
        tok, tgt = batch(s, rank, world)
        loss = F.cross_entropy(model(tok).reshape(-1, V), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def ours_fresh(seed: int, granularity: str = "row"):
    torch.manual_seed(seed)
    model = shard_ours(Net(), granularity)
    return model, make_optim(model)
