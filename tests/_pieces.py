"""What a parameter sharded by fully_shard should hold, from a reference tensor.

Written from the documented rule, not from the library's internals: a sharded
parameter (and its gradient and per-element optimizer state) holds elements
``local_range`` of the row-major flattening of the full tensor, which are
whole dim-0 rows; it is shaped ``(rows, *full_shape[1:])`` at every world size
(the full shape at shard world size 1). A 0-d parameter's piece is 1-D
(docs/design.md, "Row-granular shards"). For a tensor-parallel parameter,
``full`` is this rank's TP shard.
"""
from __future__ import annotations

import math

import torch


def expected_shape(full_shape, local_range, shard_world: int = 0, tp: bool = False) -> tuple:
    a, b = local_range
    full_shape = tuple(full_shape)
    if not full_shape:
        return (b - a,)
    inner = math.prod(full_shape[1:])
    if inner == 0:
        return (0,) + full_shape[1:] if shard_world != 1 else full_shape
    assert a % inner == 0 and b % inner == 0, (full_shape, local_range)
    return ((b - a) // inner,) + full_shape[1:]


def local_piece(full: torch.Tensor, local_range, shard_world: int = 0, tp: bool = False):
    """``full``'s elements ``local_range`` (of its flattening), shaped as ours."""
    a, b = local_range
    piece = full.detach().reshape(-1)[a:b]
    return piece.view(expected_shape(full.shape, local_range, shard_world, tp))


def piece_close(got, full: torch.Tensor, local_range, **tol) -> bool:
    """``got`` (a sharded parameter's tensor or gradient) equals ``full``'s
    piece, within ``tol`` (``torch.allclose``). A gradient is never None
    where ``full`` (the reference's) is not: where this rank holds none of
    the parameter it is empty (docs/design.md, "Row-granular shards": empty
    pieces)."""
    if got is None:
        return False
    from fsdp_compose._group._row_dtensor import local_of  # (a RowParam: its rows)
    return torch.allclose(local_of(got), local_piece(full, local_range), **tol)
