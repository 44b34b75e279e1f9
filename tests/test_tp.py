"""2-D parallelism: tensor-parallel (DTensor) parameters inside fully_shard units.

``parallelize_module(block, mesh["tp"], plan)`` then ``fully_shard(block,
mesh=mesh["dp"])``, trained against one process on the global batch, every
step: each rank's gradient and parameter slices (the ``param_info`` range of
its TP shard, ``chunk``-ed from the reference like DTensor shards evenly
divisible tensors), the loss, and ``clip_grad_norm_`` against torch's on the
reference. Plans: Colwise/Rowwise attention and MLP with plain (replicated)
norms mixed into the same units; and a sequence-parallel plan (SequenceParallel
norms, Rowwise embedding-like input, Colwise output head).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from fsdp_compose import param_info
from fsdp_compose._base._registry import SHARDED as _SHARDED

from ._pieces import local_piece
from ._support import Scenarios, compare_step
from ._tp_net import BATCH, IN, OUT, T, Net, parallelize

STEPS = 3
MAX_NORM = 0.1


def _ref_piece(ref_t: torch.Tensor, info, tp_rank: int, tp: int, dp: int) -> torch.Tensor:
    """This rank's piece of a reference tensor: the rows ``local_range`` of its TP
    shard (of the whole tensor for a parameter that is not TP)."""
    t = ref_t.detach()
    for pl in info.placements or ():
        if isinstance(pl, Shard):
            t = t.chunk(tp, dim=pl.dim)[tp_rank]
    return local_piece(t, info.local_range, dp, tp=info.placements is not None)


def _train(rank, world, dp, tp, sequence_parallel):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    parallelize(model, mesh, sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    problems = []
    n_tp = sum(param_info(p).placements is not None for p in model.parameters())
    if tp > 1 and n_tp == 0:
        problems.append("no tensor-parallel parameter in the units")
    for name, p in model.named_parameters():  # a TP shard is never a whole matrix
        pl = param_info(p).placements
        if pl and not all(x.is_replicate() for x in pl) and _SHARDED[p][1].holds_whole():
            problems.append(f"{name} ({pl}): holds_whole() on a TP shard")

    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, T, IN, generator=g), torch.randn(BATCH, T, OUT, generator=g)
        per = BATCH // dp
        xs, ys = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        loss = (model(xs) - ys).pow(2).mean()
        loss.backward()
        ref_local = (ref(xs) - ys).pow(2).mean()
        if not torch.allclose(loss.detach(), ref_local.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"step {step} loss {loss.item()} vs {ref_local.item()}")
        (ref(x) - y).pow(2).mean().backward()
        problems += compare_step(
            model, ref, opt, ref_opt, f"step {step}", max_norm=MAX_NORM, rtol=1e-4, atol=1e-5,
            piece=lambda full, p: _ref_piece(full, param_info(p), tp_rank, tp, dp))
    # TP shards and plain parameters share one flat group per unit, so one
    # collective per unit (test_demo's call counts rely on it)
    several = [u.fqn for u in model._unit().ctx.units if len(u.groups) != 1]
    if several:
        problems.append(f"units with several flat groups: {several}")
    return problems


def _run_one(layout, rank, world):
    return _train(rank, world, *layout)


LAYOUTS = {4: ((2, 2, False), (2, 2, True)), 2: ((1, 2, False), (2, 1, False), (1, 2, True))}
_LAUNCHES = Scenarios(_run_one)


@pytest.mark.parametrize("world,layout", [(w, lay) for w, lays in LAYOUTS.items() for lay in lays],
                         ids=lambda v: str(v))
def test_tp_inside_units(world, layout):
    _LAUNCHES.assert_no_problems(world, layout, LAYOUTS[world])
