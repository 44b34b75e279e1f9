"""The 2-D model of tests/test_tp.py and tests/test_tp_checkpoint.py.

Two transformer blocks (attention with ``HEAD``-wide heads, an MLP, two
LayerNorms) between an input and an output layer; ``parallelize`` makes each
block tensor-parallel over ``mesh["tp"]`` (``tp_plan``) and then shards every
block and the root with ``fully_shard`` over ``mesh["dp"]``. Batches are
``(BATCH, T, IN)`` inputs and ``(BATCH, T, OUT)`` targets (``BATCH`` global,
split over dp).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from fsdp_compose import fully_shard

D, HEAD, T, IN, OUT = 8, 2, 4, 4, 2
BATCH = 4   # global, split over dp


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


def tp_plan(sequence_parallel: bool) -> dict:
    """A block's plan: Colwise/Rowwise attention and MLP, the norms plain;
    ``sequence_parallel``: SequenceParallel norms, the sublayers' inputs
    gathered, their outputs sharded on the sequence."""
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


def parallelize(model: Net, mesh, sequence_parallel: bool) -> None:
    """Each block tensor-parallel over ``mesh["tp"]`` (``tp_plan``; with
    ``sequence_parallel`` the root's input, norm and output too), then
    ``fully_shard`` every block and the root over ``mesh["dp"]``."""
    tp = mesh["tp"]
    for layer in model.layers:
        parallelize_module(layer, tp, tp_plan(sequence_parallel))
    if sequence_parallel:
        parallelize_module(model, tp, {
            "inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
