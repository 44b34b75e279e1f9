"""Gradient accumulation: set_requires_gradient_sync(False) over microbatches.

Four microbatches (sync off for the first three) must give the same
gradients, parameters and losses as one large batch in a single process, and
only the last backward may reduce-scatter: per unit, and with the default
reduce-scatter buckets (into whose output views the shards then accumulate).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fsdp_compose import comm_stats, fully_shard, reset_comm_stats

from ._dist import run_distributed
from ._support import Block, compare_step, per_unit_collectives

MICRO = 4
ROWS = 4  # per microbatch per rank


class Net(nn.Module):
    """``side`` contributes only when ``use_side``: in one microbatch of four."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.side = Block()
        self.out = nn.Linear(6, 1)

    def forward(self, x, use_side=True):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        s = self.side(x)
        return self.out(x + s if use_side else x + s.detach() * 0)


def _accumulate(rank, world, raf, side_once, per_unit):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    for m in [*model.layers, model.side]:
        fully_shard(m, reshard_after_forward=raf)
    fully_shard(model)
    if per_unit:
        per_unit_collectives(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    problems, reduces = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(MICRO, world, ROWS, 3, generator=g)  # (micro, rank, rows, 3)
        y = torch.randn(MICRO, world, ROWS, 1, generator=g)
        use = [not side_once or k == 0 for k in range(MICRO)]
        step_reduces = []
        for k in range(MICRO):
            model.set_requires_gradient_sync(k == MICRO - 1)
            reset_comm_stats()
            loss = (model(x[k, rank], use[k]) - y[k, rank]).pow(2).mean() / MICRO
            loss.backward()
            step_reduces.append(comm_stats().reduce_scatter_calls)
        reduces.append(step_reduces)
        # reference: every microbatch of every rank, one process, averaged over ranks
        ref_loss = sum((ref(x[k].reshape(-1, 3), use[k]) - y[k].reshape(-1, 1)).pow(2).mean()
                       for k in range(MICRO)) / MICRO
        ref_loss.backward()
        problems += compare_step(model, ref, opt, ref_opt, f"step {step}", rtol=1e-5, atol=1e-6)
    return problems, reduces


def _both(rank, world, raf, side_once):
    return {per_unit: _accumulate(rank, world, raf, side_once, per_unit)
            for per_unit in (True, False)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("raf,side_once", [(True, False), (False, False), (True, True)])
def test_accumulation_matches_one_large_batch(world, raf, side_once):
    units = 5  # 3 layers + side + root
    for per_rank in run_distributed(_both, world, raf, side_once):
        problems, reduces = per_rank[True]
        assert problems == []
        # only the synced (last) backward reduce-scatters, once per unit
        assert reduces == [[0, 0, 0, units]] * 3
        problems, reduces = per_rank[False]
        assert problems == []
        # default buckets: the 5 units' flat gradients (about 3 KiB) are one bucket
        assert reduces == [[0, 0, 0, 1]] * 3
