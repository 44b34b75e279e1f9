"""The blocks and the small model of tests/test_grad_semantics.py, which
tests/test_user_api.py trains too, with its batches, optimizer and sharding.

``Blk``: two ``D``-wide linears, the second's output optional (``use_l2``);
``FreezeNet``: an input layer, three ``Blk`` (``skip``: those not run) and
an output layer. ``batch(step, rank, micro)``: this rank's ``(x, y)`` of a
step (and microbatch); ``adamw``: weight decay and momentum, so that a zero
gradient moves a parameter and ``None`` does not.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_compose import fully_shard

from ._support import per_unit_collectives

D = 6


class Blk(nn.Module):
    """``scalar``: with a 0-dim parameter, which keeps the unit on the flat
    path at world size 1 (a 0-dim parameter's shard stays 1-D)."""

    def __init__(self, scalar=False):
        super().__init__()
        self.l1 = nn.Linear(D, D)
        self.l2 = nn.Linear(D, D)
        self.s = nn.Parameter(torch.tensor(0.9)) if scalar else None

    def forward(self, x, use_l2=True):
        h = torch.tanh(self.l1(x))
        z = self.l2(h)  # computed either way
        y = x + (z if use_l2 else h)
        return y * self.s if self.s is not None else y


class FreezeNet(nn.Module):
    def __init__(self, scalar=False):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.layers = nn.ModuleList([Blk(scalar) for _ in range(3)])
        self.out = nn.Linear(D, 1)

    def forward(self, x, skip=()):
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            if i not in skip:
                h = layer(h)
        return self.out(h)


def shard_units(model, units, per_unit, **kw):
    for u in units:
        fully_shard(u, **kw)
    fully_shard(model, **kw)
    if per_unit:
        per_unit_collectives(model)
    return model


def adamw(params):
    # weight decay and momentum: a zero gradient moves a parameter, None does not
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def batch(step, rank, micro=0, rows=4, din=3):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(rows, din, generator=g), torch.randn(rows, 1, generator=g)
