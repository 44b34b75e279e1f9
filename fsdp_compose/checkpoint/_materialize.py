"""materialize(): give a model built on the meta device, then sharded, real
storage and the values eager construction would have given it.

[Note: meta init parity]
Eager construction under a seed draws random numbers module by module, a
parent's ``reset_parameters()`` after its children's ``__init__``. So modules
are visited in *post-order* (children first, in registration order), and each
module owning a parameter or buffer that was on meta gets ``reset_parameters()``
(or ``init_fn(module)``) with its own parameters as full-shape, NaN-filled
temporaries on the real device: every rank draws the same numbers and copies
its flat range into its shard. No collective; peak extra memory is one
module's parameters. A parameter tied to an earlier module (a head sharing the
embedding's weight) gets a scratch tensor of its shape, so the later module
draws from the RNG exactly as eager construction did. A floating-point
parameter or buffer still NaN afterwards is an error naming it (give the
module a ``reset_parameters()``, or pass ``init_fn``); integer buffers are
not checked.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ._checkpoint import _units
from .._base._registry import ORIGINAL_ENTRY, REPLACED, SHARDED, state_dict_slots
from .._group._row_dtensor import local_of
from .._base._common import default_device
from .._base._common import rank as _rank


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out, seen = [], set()
    stack = [("", model, False)]
    while stack:
        name, m, expanded = stack.pop()
        if expanded:
            out.append((name, m))
            continue
        if id(m) in seen:
            continue
        seen.add(id(m))
        stack.append((name, m, True))
        kids = [(f"{name}.{n}" if name else n, c) for n, c in m._modules.items() if c is not None]
        stack.extend((n, c, False) for n, c in reversed(kids))
    return out


def _blank(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    return t


def _has_nan(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any())


def materialize(model: nn.Module, *, device: torch.device | str | None = None,
                init_fn=None) -> nn.Module:
    """Allocate and initialise a model that was built on the meta device and sharded.

    ``device``: where the shards (and meta buffers) go; default: the device of
    the mesh each unit was sharded on (the current CUDA device for a CUDA
    mesh), and for anything outside the units that of the first unit. (With
    CPU offload the shards stay on CPU.)
    ``init_fn``: called as ``init_fn(module)`` instead of
    ``module.reset_parameters()``, for every module that owns something that
    was on meta.

    Modules are initialised in post-order (children, then the parent), with
    full-shape parameters and the same RNG stream on every rank, so that
    ``torch.manual_seed(s); with torch.device("meta"): m = Build(); shard(m);
    materialize(m)`` gives bit-identical parameters to ``torch.manual_seed(s);
    m = Build()`` at any world size (see the Note in ``_materialize.py``).
    Build optimizers after this: the sharded Parameters are new objects.
    """
    units = _units(model)
    if device is not None:
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("fsdp_compose.materialize: device must be a real device, not meta.")
    group_device = {id(g): device or u.device for u in units for g in u.groups}
    # parameters and buffers outside the units: where the first unit lives
    device = device or (units[0].device if units else default_device())
    meta_groups = [g for u in units for g in u.groups if g.device.type == "meta"]
    unit_of_group = {id(g): u for u in units for g in u.groups}
    for g in meta_groups:
        old = [e.sharded for e in g.entries]
        g.materialize_(group_device[id(g)])
        SHARDED.add_groups([g])
        for o, e in zip(old, g.entries):  # (refused if an optimizer built before holds them)
            REPLACED[o] = unit_of_group[id(g)]
            ORIGINAL_ENTRY[o] = weakref.ref(e)
    fresh = {id(g) for g in meta_groups}
    done: set[int] = set()           # entries initialised
    uninit: list[str] = []
    for mname, m in _post_order(model):
        slots = state_dict_slots(m) or {}
        pieces: list[tuple] = []     # (name, entry or None, temp, scratch)
        temps: dict[int, torch.Tensor] = {}
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            hit = slots.get(name)
            if hit is not None and id(hit[1]) in fresh:
                _, g, e = hit
                scratch = id(e) in done
                if id(e) not in temps:
                    where = group_device[id(g)]
                    temps[id(e)] = (torch.empty(e.shape, dtype=g.dtype, device=where) if scratch
                                    else _blank(e.shape, g.dtype, where))
                t = temps[id(e)]
                m._parameters[name] = nn.Parameter(t, requires_grad=e.sharded.requires_grad)
                pieces.append((name, e, t, scratch))
            elif hit is None and p.is_meta:  # not sharded by us: a real full Parameter
                t = _blank(p.shape, p.dtype, device)
                m._parameters[name] = nn.Parameter(t, requires_grad=p.requires_grad)
                pieces.append((name, None, t, False))
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = _blank(b.shape, b.dtype, device)
                pieces.append((name, None, m._buffers[name], False))
        if not pieces:
            continue
        try:
            with torch.no_grad():
                if init_fn is not None:
                    init_fn(m)
                elif callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()  # type: ignore[operator]
            for name, e, t, scratch in pieces:
                if scratch:
                    continue
                if _has_nan(t):
                    uninit.append(f"{mname}.{name}" if mname else name)
                if e is not None:
                    a, b = e.local_range
                    with torch.no_grad():
                        local_of(e.sharded).detach().view(-1).copy_(t.reshape(-1)[a:b])
                    done.add(id(e))
        finally:
            for name, e, _t, _scratch in pieces:
                if e is not None:
                    m._parameters[name] = e.sharded
    missing = [e.fqn for g in meta_groups for e in g.entries if id(e) not in done]
    bad = list(dict.fromkeys(uninit + missing))
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise RuntimeError(
            f"fsdp_compose [rank {_rank()}] materialize: {len(bad)} parameter(s)/buffer(s) were "
            f"not initialised: {shown}. Their module has no reset_parameters() or it left them "
            "untouched; give the module a reset_parameters() that initialises them, or pass "
            "materialize(model, init_fn=fn) with fn(module) initialising each module's own "
            "parameters and buffers.")
    return model
