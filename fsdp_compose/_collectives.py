"""Collectives as free functions, with byte counters.

Every call is issued with ``async_op=True`` and returns the work handle; the
caller decides where to ``wait()``. On NCCL that makes the current CUDA stream
wait for the collective; on gloo it blocks the CPU until the data is there.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .api import CommStats

_stats = CommStats()

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn).
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def comm_stats() -> CommStats:
    """A snapshot of the collectives this process issued."""
    return dataclasses.replace(_stats)


def reset_comm_stats() -> None:
    global _stats
    _stats = CommStats()



def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(output: torch.Tensor, shard: torch.Tensor, group) -> dist.Work:
    """``output`` (world·S) ← every rank's ``shard`` (S), in rank order."""
    _stats.all_gather_calls += 1
    _stats.all_gather_bytes += _nbytes(output)
    return _all_gather_tensor(output, shard, group=group, async_op=True)


def reduce_scatter(output: torch.Tensor, flat_grad: torch.Tensor, group,
                   op=dist.ReduceOp.AVG) -> dist.Work:
    """``output`` (S) ← ``op`` (mean by default) over ranks of this rank's chunk of
    ``flat_grad`` (world·S)."""
    _stats.reduce_scatter_calls += 1
    _stats.reduce_scatter_bytes += _nbytes(flat_grad)
    return _reduce_scatter_tensor(output, flat_grad, op=op, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, op, group) -> None:
    """Blocking all-reduce (small tensors: norms, flags)."""
    _stats.all_reduce_calls += 1
    _stats.all_reduce_bytes += _nbytes(tensor)
    dist.all_reduce(tensor, op=op, group=group)
