"""What a parameter sharded by fully_shard should hold, from a reference tensor.

Written from the documented rule, not from the library's internals: a sharded
parameter (and its gradient and per-element optimizer state) holds elements
``local_range`` of the row-major flattening of the full tensor. It is 1-D,
except at shard world size 1, where a parameter that is not a DTensor and has
at least one dimension keeps its own shape (docs/design.md, "World size 1").
"""
from __future__ import annotations

import torch


def expected_shape(full_shape, local_range, shard_world: int, tp: bool = False) -> tuple:
    a, b = local_range
    if shard_world == 1 and not tp and len(full_shape) > 0:
        return tuple(full_shape)
    return (b - a,)


def local_piece(full: torch.Tensor, local_range, shard_world: int, tp: bool = False):
    """``full``'s elements ``local_range`` (of its flattening), shaped as ours."""
    a, b = local_range
    piece = full.detach().reshape(-1)[a:b]
    return piece.view(expected_shape(full.shape, local_range, shard_world, tp))
