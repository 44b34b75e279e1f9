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
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from fsdp_compose import fully_shard, param_info
from fsdp_compose._registry import SHARDED as _SHARDED

from ._pieces import local_piece
from ._support import Scenarios, compare_step

D, HEAD, T, IN, OUT = 8, 2, 4, 4, 2
BATCH = 4   # global, split over dp
STEPS = 3
MAX_NORM = 0.1


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(D, D) for _ in range(3))
        # no key bias: its true gradient is 0 (softmax ignores a shift shared by
        # all keys), and AdamW would blow rounding noise up to full-size steps
        self.k = nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x) for f in (self.q, self.k, self.v))
        heads = q.shape[-1] // HEAD  # local heads under TP
        q, k, v = (y.view(b, t, heads, HEAD).transpose(1, 2) for y in (q, k, v))
        y = torch.softmax(q @ k.transpose(-1, -2) / HEAD ** 0.5, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, heads * HEAD))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(D), Attention()
        self.norm2, self.mlp = nn.LayerNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, D)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, OUT)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def _tp_plan(sequence_parallel: bool) -> dict:
    if not sequence_parallel:
        return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"norm1": SequenceParallel(), "attn": gather,
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(), "mlp": gather,
            "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=Shard(1))}


def _parallelize(model: Net, mesh, sequence_parallel: bool) -> None:
    tp = mesh["tp"]
    for layer in model.layers:
        parallelize_module(layer, tp, _tp_plan(sequence_parallel))
    if sequence_parallel:
        parallelize_module(model, tp, {
            "inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


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
    _parallelize(model, mesh, sequence_parallel)
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
