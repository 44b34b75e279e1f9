"""gloo's collectives, in place on our own buffers (CPU tensors on gloo).

[Note: gloo collectives]
gloo's tensor all-gather and reduce-scatter are not in place (temporaries of
the whole input or output, page-faulted in each time), so for CPU tensors on
gloo we issue what they are made of, in place on our own buffers:
* all-gather = one ``broadcast`` per rank of that rank's chunk of the output;
* reduce-scatter = ``all_reduce`` of the flat gradient in place, our chunk
  copied out when the caller waits (the rest is garbage the caller drops);
* over 2 ranks, input at most ``P2P_MAX_BYTES``: a point-to-point exchange
  (``isend`` the peer's chunk, ``irecv`` ours into the result, our own chunk
  added at the wait: one addition, the all-reduce's bits), which leaves no
  scratch in gloo's worker-thread heaps. Larger inputs and more ranks keep
  the all-reduce (memory in flight; a 3-term sum in another order changes
  bits). Messages match by (peer, tag) in issue order, so the group carries
  no one else's: it is fully_shard's own (_fully_shard._reduce_scatter_group).
NCCL keeps its reduce-scatter and all-gather. Measurements: docs/design.md,
"Choosing the collective (gloo)" and "Peak RSS of small units".
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .._base._job import job

P2P_MAX_BYTES = 1 << 20  # 2-rank gloo reduce-scatters up to this input: an exchange (the Note)


def in_place(t: torch.Tensor, group) -> tuple[int, int] | None:
    """(rank, size) when ``t`` takes the in-place gloo path (see the Note), else None."""
    if t.device.type != "cpu":
        return None
    key = group if group is not None else dist.group.WORLD
    cache = job().gloo  # (process group -> (rank, size) in it if it is gloo, else None)
    if key not in cache:
        gloo = dist.get_backend(group) == "gloo"
        cache[key] = (dist.get_rank(group), dist.get_world_size(group)) if gloo else None
    return cache[key]


def uneven(group, t: torch.Tensor) -> tuple[int, int] | None:
    """(rank, size) when uneven pieces of ``t`` go through these collectives
    (gloo's list collectives take equal sizes only), else None."""
    gloo = in_place(t, group)
    if gloo is not None or dist.get_backend(group) != "gloo":
        return gloo
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather(chunks: list[torch.Tensor], shard: torch.Tensor, group, rank: int,
               async_op: bool, skip_empty: bool) -> list:
    """Every rank's chunk of the output (``chunks``) from its owner: one
    ``broadcast`` per rank, this rank's ``shard`` copied into its chunk
    first (unless it is that chunk). ``skip_empty``: no broadcast of an
    empty piece. Returns the works (``async_op``)."""
    if chunks[rank].data_ptr() != shard.data_ptr():
        chunks[rank].copy_(shard)
    return [dist.broadcast(c, group=group, group_src=r, async_op=async_op)
            for r, c in enumerate(chunks) if not skip_empty or c.numel()]


def exchanges(world: int, nbytes: int) -> bool:
    """A reduce-scatter of ``nbytes`` over ``world`` ranks is an exchange."""
    return world == 2 and nbytes <= P2P_MAX_BYTES


def reduce_scatter(flat_grad: torch.Tensor, mine: torch.Tensor, group, op,
                   out: torch.Tensor | None, world: int, async_op: bool) -> tuple:
    """An all-reduce of ``flat_grad`` in place; ``finish()`` (call it once
    the work is waited) gives this rank's part (``mine``, a view of it),
    averaged for AVG, in ``out`` if given. Returns (work, finish)."""
    finish: Callable[[], torch.Tensor]
    if out is not None:
        def finish():
            return torch.div(mine, world, out=out) if op == dist.ReduceOp.AVG else out.copy_(mine)
    elif op == dist.ReduceOp.AVG:
        def finish():
            return torch.div(mine, world)
    else:
        finish = mine.clone
    work = dist.all_reduce(flat_grad, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return work, finish


def exchange(chunks: list[torch.Tensor], group, op, out: torch.Tensor | None,
             rank: int) -> tuple[list, Callable[[], torch.Tensor]]:
    """A small reduce-scatter over 2 ranks as a point-to-point exchange (see
    the Note): the peer's chunk out, ours in, one addition. Returns (works,
    finish)."""
    res = out if out is not None else chunks[rank].new_empty(chunks[rank].numel())
    peer = 1 - rank
    works = [dist.isend(chunks[peer], group=group, group_dst=peer),
             dist.irecv(res, group=group, group_src=peer)]

    def finish() -> torch.Tensor:
        res.add_(chunks[rank])  # (a + b == b + a: the all-reduce's bits)
        if op == dist.ReduceOp.AVG:
            res.div_(2)
        return res

    return works, finish
