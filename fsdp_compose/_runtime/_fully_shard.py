"""fully_shard(): the entry point.

It checks its arguments, collects the parameters the new unit owns (not a
sub-unit's, not ignored), builds the unit's flat groups (process groups,
layout: _flat_group.py) and its ``Unit`` (_unit.py), records its Parameters
(_registry.py) and makes each module an ``FSDPModule`` (_fsdp_module.py).
The first forward then makes a root (_state.py, ``lazy_init_root``).
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..checkpoint._checkpoint import register_hooks as register_state_dict_hooks
from .._base._common import default_device, unit_error
from ..api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, ParamInfo
from .._group import _extension
from .._group._flat_group import FlatGroup, PostForward
from ._fsdp_module import add_forward_hooks, make_fsdp_module, original_class
from .._base._job import job
from .._plan._layout import GRANULARITIES
from .._base._registry import ORIGINAL_ENTRY, REPLACED, SHARDED, set_unit, unit_of
from ._state import assign_fqns, hook_grads
from .._optim import _torch_hooks
from ._unit import Unit


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fsdp_compose.fully_shard: torch.distributed is not initialised. "
                           "Call torch.distributed.init_process_group() first (torchrun sets "
                           "the environment), or pass mesh=.")
    return init_device_mesh(default_device().type, (dist.get_world_size(),))


def _as_mesh(label: str, mesh) -> DeviceMesh:
    """``mesh``, or a 1-D DeviceMesh over a ProcessGroup given instead (on
    ``cuda`` when the group sends CUDA tensors to NCCL, else ``cpu``, as the
    default mesh)."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, dist.ProcessGroup):
        return DeviceMesh.from_group(mesh, default_device(mesh).type)
    raise unit_error(label, f"mesh must be a DeviceMesh (or a ProcessGroup), got "
                     f"{type(mesh).__name__}.", "Pass e.g. init_device_mesh('cuda', (world,)) "
                     "or mesh['dp'].", exc=TypeError)


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _describe(modules: list[nn.Module]) -> str:
    """The unit's FQN once a parent was sharded, else its modules' class names."""
    names = []
    for m in modules:
        u = unit_of(m)
        cls = original_class(m)
        names.append(u.fqn if u is not None and u.fqn else cls.__name__)
    return ", ".join(names)


def _name_unit(unit: Unit) -> str:
    """Words that identify ``unit`` before the root names it: its FQN if a
    parent was sharded already, else fully_shard(<its modules' classes>)."""
    if unit.fqn:
        return f"'{unit.fqn}'"
    classes = ", ".join((original_class(m)).__name__
                        for m in unit.modules)
    return f"the one made by fully_shard({classes})" if len(unit.modules) == 1 \
        else f"the one made by fully_shard([{classes}])"


def _collect(modules: list[nn.Module], ignored: set[int], label: str):
    """The parameters this unit owns: not in a sub-unit, not ignored.

    Returns ``[(param, [(module, name), ...], rel_fqn)]`` with each parameter
    once (a parameter tied inside the unit gets several slots).
    """
    found: dict[int, tuple] = {}
    order: list[int] = []
    # iterative walk: a recursive closure would form a reference cycle that
    # keeps the original (full-size) parameters alive until the next gc run
    stack = [(m, f"{i}." if len(modules) > 1 else "", True) for i, m in enumerate(modules)]
    stack.reverse()
    while stack:
        m, prefix, top = stack.pop()
        if not top and unit_of(m) is not None:
            continue  # a sub-unit owns this subtree
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored or p in SHARDED:
                continue
            if p in REPLACED:
                other = REPLACED[p]
                raise unit_error(
                    label, f"parameter '{prefix}{name}' is already sharded by another unit, "
                    f"{_name_unit(other)} (a weight tied across two fully_shard units).",
                    "Put every module that uses it in one unit: fully_shard([module_a, module_b]), "
                    "or leave one of them to the parent unit.", exc=ValueError)
            if id(p) not in found:
                found[id(p)] = (p, [], f"{prefix}{name}")
                order.append(id(p))
            found[id(p)][1].append((m, name))
        children = [(c, f"{prefix}{n}.", False) for n, c in m._modules.items() if c is not None]
        stack.extend(reversed(children))
    return [found[i] for i in order]


def _reduce_scatter_group(pg):
    """A second process group over the ranks of ``pg`` (``pg`` itself at
    world size 1), for fully_shard's reduce-scatters and their used-flags
    only: all-gathers and reduce-scatters each follow their own
    rank-independent order, so they must not share a group ([Note:
    collective order] in _backward_plan.py), and the point-to-point
    exchanges of [Note: gloo collectives] (_gloo.py) must meet no one
    else's messages there.

    Made once per (ranks, backend) in a job (_job.py), at fully_shard time:
    every member calls fully_shard in the same order. Only the members take
    part, except over every rank of the default group, where every rank
    calls ``new_group`` (so torch names it by a counter, not a SHA-1 of its
    ranks: docs/design.md, "Peak RSS of small units").
    """
    if dist.get_world_size(pg) == 1:
        return pg
    key = (tuple(dist.get_process_group_ranks(pg)), dist.get_backend(pg))
    groups = job().rs_groups
    if key not in groups:
        world = key[0] == tuple(range(dist.get_world_size()))
        groups[key] = dist.new_group(list(key[0]), use_local_synchronization=not world)
    return groups[key]


def _rank_loads(pg) -> list[int] | None:
    """The bytes of shards each rank of ``pg`` holds from the groups built over
    the same ranks so far in this job (_job.py), updated by each new group:
    uneven row layouts place their boundaries to even out these sums (see
    [Note: shard layout] in _layout.py). Every member builds the same groups
    in the same order (the collectives require it), so every member sees the
    same loads. None at world size 1."""
    if dist.get_world_size(pg) == 1:
        return None
    key = (tuple(dist.get_process_group_ranks(pg)), dist.get_backend(pg))
    return job().loads.setdefault(key, [0] * dist.get_world_size(pg))


def _build_groups(params: list, label: str, device, mesh: DeviceMesh, mp_policy,
                  offload, post_forward_size: int | None, granularity: str) -> list[FlatGroup]:
    by_key: dict[tuple, list] = {}
    for item in params:
        p = item[0]
        # a parameter whose class defines the all-gather extension: a group of its own
        key = (("extension", id(p)) if _extension.defines_extension(p)
               else (p.dtype, p.requires_grad))
        by_key.setdefault(key, []).append(item)
    shard_dim = mesh.ndim - 1
    world, rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    pg = mesh.get_group(shard_dim)
    replicate_pg = mesh.get_group(0) if mesh.ndim == 2 and mesh.size(0) > 1 else None
    rs_pg = _reduce_scatter_group(pg)
    post_forward = _post_forward_group(pg, post_forward_size) if post_forward_size else None
    mp = mp_policy or MixedPrecisionPolicy()
    loads = _rank_loads(pg)
    kw = dict(device=device, world=world, rank=rank, pg=pg, rs_pg=rs_pg,
              param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
              offload=offload is not None,
              pin_memory=bool(offload is not None and offload.pin_memory),
              replicate_pg=replicate_pg, post_forward=post_forward,
              granularity=granularity, mesh=mesh, loads=loads)
    return [_extension.ExtensionGroup(label, items, mp_policy=mp_policy, **kw)
            if key[0] == "extension" else FlatGroup(label, items, **kw)
            for key, items in by_key.items()]


def _from_torch_policies(mp_policy, offload_policy):
    """torch FSDP2's ``MixedPrecisionPolicy`` / ``OffloadPolicy`` /
    ``CPUOffloadPolicy`` objects as ours (the same fields and meaning), so a
    stack that builds torch's policies and calls our ``fully_shard`` works."""
    from torch.distributed import fsdp as tfsdp
    if isinstance(mp_policy, tfsdp.MixedPrecisionPolicy):
        mp_policy = MixedPrecisionPolicy(param_dtype=mp_policy.param_dtype,
                                         reduce_dtype=mp_policy.reduce_dtype,
                                         output_dtype=mp_policy.output_dtype,
                                         cast_forward_inputs=mp_policy.cast_forward_inputs)
    if isinstance(offload_policy, tfsdp.CPUOffloadPolicy):
        offload_policy = CPUOffloadPolicy(pin_memory=offload_policy.pin_memory)
    elif isinstance(offload_policy, tfsdp.OffloadPolicy):
        offload_policy = OffloadPolicy()
    return mp_policy, offload_policy


def _check_policies(label: str, mp_policy, offload_policy):
    mp_policy, offload_policy = _from_torch_policies(mp_policy, offload_policy)
    if mp_policy is not None:
        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise unit_error(label, f"mp_policy must be a MixedPrecisionPolicy (fsdp_compose's or "
                             f"torch.distributed.fsdp's), got "
                             f"{mp_policy!r}.", exc=TypeError)
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = getattr(mp_policy, name)
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise unit_error(label, f"MixedPrecisionPolicy.{name} must be a floating-point "
                                 f"torch.dtype or None, got {dt!r}.", exc=ValueError)
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise unit_error(label, f"offload_policy must be CPUOffloadPolicy() (or OffloadPolicy() "
                         f"for none; fsdp_compose's or torch.distributed.fsdp's), got "
                         f"{offload_policy!r}.", exc=TypeError)
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    return mp_policy, offload


def _check_reshard_after_forward(label: str, raf,
                                 shard_world: int) -> tuple[bool | None, int | None]:
    """Returns (bool | None, N or None): N when parameters reshard to N-rank groups."""
    if raf is None or isinstance(raf, bool):
        return raf, None
    if not isinstance(raf, int) or raf < 1 or shard_world % raf != 0:
        raise unit_error(label, f"reshard_after_forward={raf!r} must be a bool, None, or an int "
                         f"that divides the shard world size {shard_world}.",
                         "Use one of "
                         f"{[d for d in range(1, shard_world + 1) if shard_world % d == 0]}"
                         " (e.g. the number of ranks per node).", exc=ValueError)
    if raf == 1:
        return False, None
    if raf == shard_world:
        return True, None
    return True, raf


def _post_forward_group(pg, size: int) -> PostForward:
    """This rank's group of ``size`` consecutive ranks of ``pg`` (reshard_after_forward=int).

    Only the members of each group create it (``use_local_synchronization``).
    """
    ranks = dist.get_process_group_ranks(pg)
    me = ranks.index(dist.get_rank())
    block = tuple(ranks[me // size * size:(me // size + 1) * size])
    key = (block, dist.get_backend(pg))
    groups = job().pf_groups
    if key not in groups:
        groups[key] = dist.new_group(list(block), use_local_synchronization=True)
    group = groups[key]
    return PostForward(group, size, dist.get_rank(group))


@overload
def fully_shard(module: nn.Module, **kw) -> nn.Module: ...
@overload
def fully_shard(module: list[nn.Module], **kw) -> list[nn.Module]: ...


def fully_shard(module, *, mesh: DeviceMesh | None = None,  # type: ignore[misc]
                reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy: OffloadPolicy | None = None,
                ignored_params: Iterable[nn.Parameter] | None = None,
                shard_granularity: str = "row"):
    """Shard ``module``'s parameters across the ranks of ``mesh``, in place.

    Call it bottom-up: on each block, then on the root. The parameters of
    ``module`` not already owned by a sub-unit (and not in ``ignored_params``)
    are laid end to end in one flat buffer per (dtype, requires_grad) and
    sharded; each rank keeps a contiguous slice.

    Args:
        module: a module, or a list of modules that form ONE unit (e.g. a tied
            embedding and output head). Returned as given, changed in place:
            its class becomes a subclass that is also an ``FSDPModule``.
        mesh: a 1-D ``DeviceMesh`` (shard over it), or a 2-D one
            ``(replicate, shard)`` for HSDP: shard within the second dim,
            replicate across the first (gradient shards are all-reduced over
            it). Default: all ranks, on ``cuda`` when the default process group
            sends CUDA tensors to NCCL (``init_process_group()`` with no backend
            on a GPU machine, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``), else ``cpu``.
        reshard_after_forward: free the full parameters after forward (True)
            or keep them until backward (False). ``None``: True, except for
            the root, whose parameters are needed first in backward. An int
            N (dividing the shard size): after forward keep them sharded over
            groups of N consecutive ranks, so the backward all-gather runs
            within N ranks (N=1 is False, N=shard size is True).
        mp_policy: ``MixedPrecisionPolicy`` for this unit (default: none).
        offload_policy: ``CPUOffloadPolicy()`` keeps this unit's shards,
            gradient shards and optimizer state on CPU.
        ignored_params: parameters to leave alone (not sharded, not reduced).

        shard_granularity: ``"row"`` (default): each rank holds a block of
            whole dim-0 rows of each parameter. ``"tensor"``: each parameter
            lives whole on one rank (balanced by size; the other ranks hold
            an empty piece), so optimizers that need whole matrices (Muon,
            Adafactor) run exactly, each matrix on one rank.

    Differences from torch FSDP2: while sharded, a parameter is a plain tensor
    holding this rank's dim-0 rows, shape ``(rows, *shape[1:])`` (possibly 0
    rows), not a DTensor: ``p.ndim`` and ``p.shape[1:]`` are the original's;
    ``p.shape[0]`` is the rows this rank holds (the full shape at shard world
    size 1). Where a rank holds no rows of a parameter, its ``p.grad`` stays
    None. ``fsdp_compose.param_info(p)`` tells its FQN, global shape and rows
    at any world size. Build the optimizer after ``fully_shard``.
    """
    modules, label = _check_modules(module)
    _torch_hooks.install()  # once: the optimizer check and clip_grad_norm_ routing
    mesh = _check_mesh(label, mesh)
    mp_policy, offload = _check_policies(label, mp_policy, offload_policy)
    _check_granularity(label, shard_granularity)
    ignored = _check_ignored(label, ignored_params)

    device = _mesh_device(mesh)
    shard_world = mesh.size(mesh.ndim - 1)
    reshard_after_forward, post_forward_size = _check_reshard_after_forward(
        label, reshard_after_forward, shard_world)
    params = _collect(modules, ignored, label)
    _extension.check_params(label, params, mesh=mesh, post_forward_size=post_forward_size,
                            granularity=shard_granularity)
    groups = (_build_groups(params, label, device, mesh, mp_policy, offload, post_forward_size,
                            shard_granularity) if params else [])
    unit = Unit(modules, groups, reshard_after_forward=reshard_after_forward, label=label,
                mp_policy=mp_policy, device=device)
    hook_grads(unit)
    _attach(unit, modules, params, device)
    return module


def _check_modules(module) -> tuple[list[nn.Module], str]:
    """The unit's modules, and the label that names it in errors until the root names it."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError("fsdp_compose.fully_shard expects an nn.Module or a non-empty list of "
                         f"nn.Modules, got {module!r}.")
    label = _describe(modules)
    for m in modules:
        if unit_of(m) is not None:
            raise unit_error(label, "fully_shard was already applied to this module.",
                             "Call fully_shard once per module (to change a setting use the "
                             "FSDPModule methods, e.g. set_reshard_after_forward).", exc=ValueError)
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise unit_error(label, f"{type(m).__name__} has no forward, so its parameters "
                             "would never be gathered.", "Call fully_shard on each block inside "
                             "it (or on the module that calls them).", exc=ValueError)
    if len({id(m) for m in modules}) != len(modules):
        raise unit_error(label, "the same module appears twice in the list.", exc=ValueError)
    return modules, label


def _check_mesh(label: str, mesh) -> DeviceMesh:
    mesh = _as_mesh(label, mesh) if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise unit_error(label, f"mesh must be 1-D (FSDP) or 2-D (replicate, shard) for HSDP, "
                         f"got a {mesh.ndim}-D mesh {tuple(mesh.mesh_dim_names or ())}.",
                         "Pass the data-parallel sub-mesh, e.g. mesh['dp'] or "
                         "mesh['dp_replicate', 'dp_shard'].", exc=ValueError)
    return mesh


def _check_granularity(label: str, shard_granularity) -> None:
    if shard_granularity not in GRANULARITIES:
        raise unit_error(label, f"shard_granularity must be one of {GRANULARITIES}, got "
                         f"{shard_granularity!r}.", "Use \"row\" (the default: each rank holds "
                         "whole dim-0 rows of every parameter) or \"tensor\" (each parameter "
                         "whole on one rank, for optimizers such as Muon or Adafactor).",
                         exc=ValueError)


def _check_ignored(label: str, ignored_params) -> set[int]:
    """The ids of ``ignored_params``. One model-wide set may be passed to every
    call (as FSDP2 accepts): a parameter outside these modules is simply not
    this unit's business."""
    ignored = list(ignored_params or ())
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) \
                else f"a {type(p).__name__}"
            raise unit_error(label, f"ignored_params contains {what}, not an nn.Parameter.",
                             "Pass parameters from module.parameters().", exc=ValueError)
    return {id(p) for p in ignored}


def _attach(unit: Unit, modules: list[nn.Module], params: list, device: torch.device) -> None:
    """Install the sharded Parameters, record them and the originals they
    replace (_registry.py), and make each module an FSDPModule of ``unit``."""
    for g in unit.groups:
        g.install_sharded()
    SHARDED.add_groups(unit.groups)
    register_state_dict_hooks(unit)
    entry_of = {id(e.slots): e for g in unit.groups for e in g.entries}
    for p, slots, _ in params:
        REPLACED[p] = unit
        ORIGINAL_ENTRY[p] = weakref.ref(entry_of[id(slots)])
    for m in modules:
        _move_buffers(m, device)
        set_unit(m, unit)
        add_forward_hooks(unit, m)
        make_fsdp_module(m)
        assign_fqns(m)


def _move_buffers(m: nn.Module, device: torch.device) -> None:
    for sub in m.modules():
        for name, b in sub._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                sub._buffers[name] = b.to(device)


def param_info(param: torch.Tensor):
    """FQN, global shape and local range of a parameter sharded by fully_shard."""
    hit = SHARDED.get(param)
    if hit is None:
        raise ValueError("fsdp_compose.param_info: this tensor is not a parameter sharded by "
                         f"fully_shard (shape {tuple(param.shape)}). Pass one of "
                         "model.parameters() after fully_shard, while the model is sharded.")
    g, e = hit
    rank_bytes = tuple(n * g.dtype.itemsize for n in g.layout.rank_numel())
    tp: tuple[Any, Any] = (e.tp.placements, e.tp.shape) if e.tp is not None else (None, None)
    return ParamInfo(e.fqn, e.shape, e.local_range, g.unit_fqn, *tp, rows=e.rows,
                     granularity=g.granularity, rank_bytes=rank_bytes)
