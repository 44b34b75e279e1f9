"""clip_grad_norm_: the true global gradient norm across ranks."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from . import _collectives
from ._fully_shard import _SHARDED


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients in place by their global norm; return that norm.

    Each rank holds disjoint slices of the sharded parameters, so the global
    norm is ``(Σ_ranks Σ_local |g|^p)^(1/p)`` (max for ``inf``). Padding is in
    no parameter, so it never counts. Parameters not sharded by fully_shard
    are treated as replicated: counted once, not once per rank.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    sharded, replicated = [], []
    group = None
    for p in params:
        if p.grad is None:
            continue
        hit = _SHARDED.get(p)
        if hit is None:
            replicated.append(p.grad)
            continue
        g = hit[0].pg
        if group is not None and g is not group:
            raise ValueError("fsdp_compose.clip_grad_norm_: parameters are sharded over different "
                             "process groups; pass the parameters of one mesh at a time.")
        group = g
        sharded.append(p.grad)
    device = (sharded or replicated or [torch.zeros(0)])[0].device
    local = _norm(sharded, norm_type, device)
    if group is not None:
        if norm_type == float("inf"):
            _collectives.all_reduce(local, dist.ReduceOp.MAX, group)
        else:
            local = local.pow(norm_type)
            _collectives.all_reduce(local, dist.ReduceOp.SUM, group)
            local = local.pow(1.0 / norm_type)
    if replicated:
        total = _norm([local.reshape(1), _norm(replicated, norm_type, device).reshape(1)],
                      norm_type, device)
    else:
        total = local
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _norm(tensors: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    # a rank may hold 0 elements of a parameter; the inf-norm of nothing is undefined
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros((), device=device)
    return torch.nn.utils.get_total_norm(tensors, norm_type).to(torch.float32)
