"""clip_grad_norm_: the true global gradient norm across every mesh dim.

Each parameter's gradient contributes ``Σ|g|^p`` over the elements this rank
holds, and that sum must be reduced over exactly the ranks that hold
*different* elements of it, never over ranks that hold copies:

- a parameter sharded by ``fully_shard``: over its shard group (not over HSDP
  replicas, which hold copies), and, if it is a tensor-parallel DTensor, also
  over every TP mesh dim on which it is ``Shard``-placed (``Replicate`` dims
  hold copies);
- a DTensor parameter not sharded by us: over its ``Shard`` mesh dims;
- any other parameter: replicated, counted once, no reduction.

So parameters fall into a few classes by the tuple of process groups to reduce
over; each class's partial sum is all-reduced over its groups (in the order
the classes first appear in ``parameters``, the same on every rank because
every rank holds every parameter), and the classes are added. torch's own
``clip_grad_norm_`` cannot mix plain and DTensor gradients of different meshes.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .._comm import _collectives
from .._base._common import rank as _rank
from .._base._registry import SHARDED


def _shard_groups(mesh, placements) -> tuple:
    return tuple(mesh.get_group(d) for d, pl in enumerate(placements) if isinstance(pl, Shard))


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip gradients in place by their global norm; return that norm (a plain tensor).

    Works for any mix of parameters sharded by ``fully_shard`` (row or tensor
    granularity, HSDP, tensor-parallel inside units), DTensor parameters, and
    plain replicated parameters. The ranks' pieces of a parameter partition
    its elements (a rank holding none of it has an empty ``p.grad``), and padding is
    in no parameter, so every element counts once. Every rank must pass the
    same parameters (as ``model.parameters()`` gives).

    ``error_if_nonfinite`` and ``foreach`` are torch's. The norm is global,
    so with ``error_if_nonfinite=True`` every rank sees the same non-finite
    value and raises, after the last collective (no rank is left in one),
    before any gradient is scaled.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    total = _global_norm([(_key(p), p.grad) for p in params], norm_type, foreach)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"fsdp_compose [rank {_rank()}] clip_grad_norm_: the total norm of order {norm_type} "
            f"of the gradients over every rank is non-finite ({total.item()}), so it cannot be "
            "clipped; every rank raises this. To scale the gradients by the non-finite norm "
            "anyway, set error_if_nonfinite=False.")
    # plain gradients (ours included): torch's foreach path; epsilon added once
    plain = [p for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    torch.nn.utils.clip_grads_with_norm_(plain, max_norm, total, foreach=foreach)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if isinstance(p.grad, DTensor):
                local = p.grad.to_local()
                local.mul_(coef.to(local.device, local.dtype))
    return total


def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` over gradients of which some belong to
    sharded parameters: the global norm, as DDP would compute it (what
    ``torch.nn.utils.get_total_norm`` is routed to, see [Note:
    torch.nn.utils.clip_grad_norm_] in _torch_hooks.py). Tensors that are not
    such gradients count as replicated (a DTensor by its Shard dims). Every
    rank must pass the gradients of the same parameters, except that a rank
    holding none of a parameter may leave its (absent) gradient out."""
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    owners = SHARDED.grad_owners(ts)
    items = [(_key(owners[id(t)]) if id(t) in owners else _key(t), t) for t in ts]
    norm_type = float(norm_type)
    total = _global_norm(items, norm_type, foreach, canonical=True)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"fsdp_compose [rank {_rank()}] get_total_norm: the total norm of order {norm_type} "
            f"of the gradients over every rank is non-finite ({total.item()}); every rank "
            "raises this. Set error_if_nonfinite=False to get it anyway.")
    return total


def _key(p: torch.Tensor) -> tuple:
    """The process groups to sum ``p``'s gradient's partial norm over."""
    hit = SHARDED.get(p)
    if hit is not None:
        g, e = hit
        key = (g.pg,) + (_shard_groups(e.tp.mesh, e.tp.placements) if e.tp else ())
    elif isinstance(p, DTensor):
        key = _shard_groups(p.device_mesh, p.placements)
    else:
        key = ()
    return tuple(pg for pg in key if dist.get_world_size(pg) > 1)


_DOING = "clip_grad_norm_() / get_total_norm(): the gradient norm"


def _global_norm(items: list, norm_type: float, foreach, canonical: bool = False) -> torch.Tensor:
    """The norm of every gradient in ``items`` (``(key, grad or None)``): each
    class of equal keys is reduced over its groups, in the order the classes
    first appear (every rank lists the same parameters), or, ``canonical``,
    in an order of the groups' ranks (the same on every rank whatever the
    tensors it was given)."""
    inf = norm_type == float("inf")
    classes: dict[tuple, list[torch.Tensor]] = {}
    device = None
    for key, grad in items:
        grads = classes.setdefault(key, [])  # every rank gets the same classes
        if grad is not None:
            grad = grad.to_local() if isinstance(grad, DTensor) else grad
            grads.append(grad)
            device = device or grad.device
    device = device or torch.device("cpu")
    order = list(classes)
    if canonical:
        order.sort(key=lambda k: [tuple(dist.get_process_group_ranks(pg)) for pg in k])
    total = None
    for key in order:
        grads = classes[key]
        part = _local_norm(grads, norm_type, device, foreach)
        if inf:
            part = _all_reduce_max(part, key)
        else:
            part = part.pow(norm_type)  # a NaN or inf survives the SUM on every rank
            for pg in key:
                _collectives.reduce_small(part, dist.ReduceOp.SUM, pg, _DOING)
        total = part if total is None else (torch.maximum(total, part) if inf else total + part)
    if total is None:
        total = torch.zeros((), device=device)
    elif not inf:
        total = total.pow(1.0 / norm_type)
    return total


def _local_norm(tensors: list[torch.Tensor], norm_type: float, device, foreach) -> torch.Tensor:
    # a rank may hold 0 elements of a parameter; the inf-norm of nothing is undefined
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros((), device=device, dtype=torch.float32)
    get = torch.nn.utils.get_total_norm
    get = getattr(get, "__wrapped__", get)  # torch's own (ours routes sharded gradients here)
    norm = get(tensors, norm_type, foreach=foreach)
    return norm.to(device, torch.float32)


def _all_reduce_max(part: torch.Tensor, groups: tuple) -> torch.Tensor:
    """MAX over ``groups`` that keeps a NaN (gloo's MAX may drop one: see
    docs/design.md, "clip_grad_norm_"): "some rank saw a NaN" travels as a
    second element of the same collective."""
    if not groups:
        return part
    both = torch.stack([part, torch.isnan(part).to(part.dtype)])
    for pg in groups:
        _collectives.reduce_small(both, dist.ReduceOp.MAX, pg, _DOING)
    return torch.where(both[1] > 0, torch.full_like(both[0], float("nan")), both[0])
