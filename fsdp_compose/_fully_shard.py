"""fully_shard() and the FSDPModule mixin."""
from __future__ import annotations

import functools
import weakref
from typing import Iterable, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.weak import WeakIdKeyDictionary

from ._checkpoint import register_hooks as register_state_dict_hooks
from ._common import TrainingState, default_device, rank as _rank, root_setting_fix, unit_error
from .api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._flat_group import FlatGroup, PostForward
from ._layout import GRANULARITIES
from ._state import assign_fqns, unit_of
from . import _torch_hooks
from ._unit import Unit


class _ShardedParams:
    """Every sharded Parameter we created -> (group, entry).

    Weak both ways: a key is held only by its entry, so a value holding the
    entry (or its group) strongly would keep the key, and with it the whole
    model, alive for the life of the process. ``get`` gives None once the
    model is gone.
    """

    def __init__(self):
        self._refs: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __setitem__(self, param: nn.Parameter, hit: tuple) -> None:
        g, e = hit
        self._refs[param] = (weakref.ref(g), weakref.ref(e))

    def get(self, param):
        refs = self._refs.get(param)
        if refs is None:
            return None
        g, e = refs[0](), refs[1]()
        return None if g is None or e is None else (g, e)

    def __contains__(self, param) -> bool:
        return self.get(param) is not None

    def __getitem__(self, param) -> tuple:
        hit = self.get(param)
        if hit is None:
            raise KeyError("not a Parameter sharded by fully_shard (or its model is gone)")
        return hit

    def pop(self, param) -> None:
        self._refs.pop(param, None)


# Every sharded Parameter we created -> (group, entry); and every original
# Parameter we replaced -> the unit that owns it (to catch ties across units,
# and an optimizer built before fully_shard: check_no_replaced_params). A unit holds
# no original Parameter, so the second map holds no key of its own either.
_SHARDED = _ShardedParams()
_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_ORIGINAL_ENTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original -> weakref(entry)


# ------------------------------------------------------------------------
# An optimizer built before fully_shard holds the original Parameters, which
# no module uses any more: it would step tensors without gradients and the
# model would silently never train. Refused at its first step, on every rank
# alike (each rank built its optimizer the same way), by the optimizer check
# in _torch_hooks.py (torch.optim's global step pre-hook, cached there per
# optimizer and parameter list).
def _replaced_name(p) -> str | None:
    """The FQN of ``p`` if fully_shard or materialize replaced it, else None."""
    if p in _REPLACED:
        ref = _ORIGINAL_ENTRY.get(p)
        e = ref() if ref is not None else None
        return e.fqn if e is not None else f"a parameter of unit '{_REPLACED[p].fqn}'"
    hit = _SHARDED.get(p)
    if hit is not None and hit[1].sharded is not p:  # a meta Parameter before materialize
        return hit[1].fqn
    return None


def check_no_replaced_params(optimizer) -> None:
    """Raise if ``optimizer`` holds Parameters that fully_shard or materialize replaced."""
    stale = [name for g in optimizer.param_groups for p in g["params"]
             if (name := _replaced_name(p)) is not None]
    if stale:
        shown = ", ".join(repr(s) for s in stale[:8]) + (
            f" and {len(stale) - 8} more" if len(stale) > 8 else "")
        raise RuntimeError(
            f"fsdp_compose [rank {_rank()}]: {type(optimizer).__name__}.step(): the "
            f"optimizer holds {len(stale)} parameter(s) that fully_shard (or materialize) "
            f"replaced: {shown}. No module uses them any more, so they get no gradient and "
            "the model would never train. Build the optimizer after fully_shard (and after "
            "materialize), from model.parameters().")


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to.

    ``isinstance(m, FSDPModule)`` tells a sharded module; ``isinstance(m,
    OriginalClass)`` still holds. A list unit's modules share one unit, so any
    of them unshards/reshards all of it.
    """

    def _unit(self) -> Unit:
        return unit_of(self)

    def _units(self, recurse: bool) -> list[Unit]:
        """This module's unit and, with ``recurse``, every unit below it."""
        found = (unit_of(m) for m in (self.modules() if recurse else [self]))
        return list(dict.fromkeys(u for u in found if u is not None))

    def _root_setting(self, where: str) -> Unit:
        """The unit a root-only setting (``where``) is stored on: this one, which
        must be the root. Known only after lazy init: a setting called earlier on
        a unit that does not become the root is an error at the first forward
        (``_state._check_root_settings``), never silently ignored."""
        unit = self._unit()
        if unit.ctx is not None and not unit.is_root:
            raise unit_error(unit.fqn, f"{where}() is a setting of the whole model, read on "
                             f"the root unit '{unit.ctx.root.fqn or '<root>'}' only; this "
                             "unit is not the root.", root_setting_fix(where),
                             exc=ValueError)
        unit.root_settings_called.add(where)
        return unit

    def _apply(self, fn, recurse: bool = True):
        """``to`` / ``cuda`` / ``cpu`` / ``half`` / ``float`` / ``double`` /
        ``to_empty`` ... after fully_shard cast or move the shards, as in FSDP2:
        see [Note: casts after fully_shard]."""
        global _APPLYING
        if _APPLYING:  # inside an outer module's _apply, which adopts the result
            return super()._apply(fn, recurse)
        units = self._units(recurse)
        _before_apply(units)
        _APPLYING = True
        try:
            out = super()._apply(fn, recurse)
        except BaseException:
            _register_sharded(units)
            raise
        finally:
            _APPLYING = False
        _after_apply(units)
        return out

    def __deepcopy__(self, memo):
        # (copy.deepcopy would otherwise fail on pickling a ProcessGroup)
        raise unit_error(self._unit().fqn, "copy.deepcopy of a sharded module is not "
                         "supported (as in FSDP2): the copy would share or lose the process "
                         "groups, shards and hooks.", "Deepcopy the model before fully_shard (e.g. "
                         "an EMA copy, then shard both), or build and shard a new model and load "
                         "fsdp_compose.get_state_dict(model, ...) into it.", exc=TypeError)

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gather this unit's parameters and install full-shape views.

        With ``async_op=True`` returns a handle whose ``wait()`` completes it.
        The unit stays unsharded until ``reshard()`` (or the end of the next
        backward).
        """
        unit = self._unit()
        unit.unshard()
        unit.pinned = True
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the modules see the sharded Parameters again."""
        unit = self._unit()
        unit.pinned = False
        unit.reshard()

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether to free the parameters after forward (True) or keep them for backward."""
        for u in self._units(recurse):
            u.user_reshard_after_forward = bool(reshard_after_forward)
            u.reshard_after_forward = bool(reshard_after_forward)


    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Gradient accumulation: with False, backward reduces nothing.

        Each unit keeps summing its unsharded flat gradient (one buffer, made
        by the first backward, accumulated in place by autograd); the next
        backward with True reduce-scatters the sum once. Costs one unsharded
        gradient per unit of memory while accumulating; saves every
        reduce-scatter but the last. Every rank must use the same setting.
        """
        for u in self._units(recurse):
            u.requires_gradient_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with False, gradients are reduce-scattered within the shard
        group but not all-reduced across replicas; the reduce-scattered sum is
        kept and the next backward with True all-reduces it once (``p.grad`` is
        updated then). Every rank must use the same setting."""
        for u in self._units(recurse):
            for g in u.groups:
                g.requires_all_reduce = bool(requires_all_reduce)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With False, backward does not all-gather this unit's parameters: for
        a unit whose backward needs none of their values (an embedding needs
        only the indices and the output gradient). Its gradients are reduced as
        usual. Only for such units: a backward that reads the parameters then
        reads freed memory (as in torch FSDP2). A forward recomputed in
        backward (activation checkpointing) still gathers them. Not recursive,
        as in FSDP2; every rank must use the same setting."""
        self._unit().unshard_in_backward = bool(unshard_in_backward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """With False, parameters stay gathered after backward, so the next
        forward (another microbatch) all-gathers nothing. Costs the unsharded
        parameters' memory between steps. Safe across an optimizer step: a unit
        whose shard changed since it was gathered is gathered again."""
        for u in self._units(recurse):
            u.reshard_after_backward = bool(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Call on the root. With False, the backward does not wait for its last
        reduce-scatter: it overlaps the next microbatch's forward and is folded
        into ``p.grad`` by the next backward. Set True before the last
        microbatch's backward (its end makes every ``p.grad`` final)."""
        self._root_setting("set_is_last_backward").is_last_backward = bool(is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """All-gather these sharded modules' units when this one's forward starts.

        Overrides the default (the next ``prefetch_depth`` units of the last
        step's order). Every rank must pass the same list.
        """
        self._unit().forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """All-gather these sharded modules' units when this one's backward starts.

        Backward all-gathers keep their rank-independent order: prefetching
        unit w also gathers the units between this one and w in that order.
        """
        self._unit().backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def set_overlap_reduce_scatter(self, overlap: bool) -> None:
        """Call on the root. True (default): a unit's reduce-scatter runs while
        backward computes the next unit's gradients. False: wait for it right
        away, so its flat gradient is freed before the next one is made (one
        unsharded gradient less at the peak; backward no longer overlaps it).
        With ``set_prefetch_depth(0)`` this is the lowest-memory schedule."""
        self._root_setting("set_overlap_reduce_scatter").overlap_reduce_scatter = bool(overlap)

    def set_reduce_scatter_bucket_bytes(self, nbytes: int) -> None:
        """Call on the root. Reduce-scatter the gradients of consecutive units
        (in the backward's reduce order) together: one collective for a run of
        units whose flat gradients add up to at most ``nbytes`` (default 1 MiB;
        a larger unit is reduced alone; 0: one collective per unit). For many
        small units, where each collective's latency dominates its bytes; costs
        one copy of the bucket's flat gradients (a rank-major ``cat``), and a
        unit's gradient waits until its bucket is complete."""
        _check_bucket_bytes(self._unit(), nbytes)
        self._root_setting("set_reduce_scatter_bucket_bytes").bucket_bytes = nbytes

    def set_all_gather_bucket_bytes(self, nbytes: int) -> None:
        """Call on the root. All-gather consecutive units (in the last step's
        forward order, and in backward's gather order) together: one collective
        for a run of sharded units whose unsharded sizes add up to at most
        ``nbytes`` (default 1 MiB; a larger unit is gathered alone; 0: one
        collective per unit). For many small units, where each collective's
        latency dominates its bytes; costs two copies of the bucket, and the
        bucket's units are unsharded together (at most ``nbytes`` more in
        flight). The first step's forward has no recorded order yet and
        gathers per unit."""
        _check_bucket_bytes(self._unit(), nbytes)
        self._root_setting("set_all_gather_bucket_bytes").gather_bucket_bytes = nbytes

    def set_prefetch_depth(self, depth: int) -> None:
        """How many units to all-gather ahead in forward and backward (default 1).

        Call on the root. In-flight unsharded memory is at most the current
        unit plus ``depth`` units (plus explicit prefetches); 0 disables
        prefetching.
        """
        if not isinstance(depth, int) or depth < 0:
            raise unit_error(self._unit().fqn, f"prefetch depth must be an int >= 0, got "
                             f"{depth!r}.", exc=ValueError)
        self._root_setting("set_prefetch_depth").prefetch_depth = depth


def _check_bucket_bytes(unit, nbytes) -> None:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise unit_error(unit.fqn, f"bucket size must be an int >= 0 (bytes), got {nbytes!r}.",
                         exc=ValueError)


def _units_of(modules, where: str) -> list[Unit]:
    units = []
    for m in modules:
        u = unit_of(m)
        if u is None:
            raise ValueError(f"fsdp_compose.{where}: {type(m).__name__} is not sharded; pass "
                             "modules that fully_shard was applied to.")
        units.append(u)
    return units


# [Note: casts after fully_shard]
# ``nn.Module._apply`` (behind ``to``, ``cuda``, ``cpu``, ``half``, ``double``,
# ``float``, ``to_empty`` ...) replaces what each module's ``_parameters`` slot
# holds: by default it sets ``p.data`` to ``fn(p)`` (the Parameter object stays,
# but no longer views our shard); with
# ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` it puts
# a new Parameter in the slot; with ``set_swap_module_params_on_conversion(True)``
# it swaps the object's contents (``torch.utils.swap_tensors``, which refuses
# tensors with weak references). FSDP2 re-reads its sharded parameters after
# ``_apply`` (``FSDPParam.reset_sharded_param``); so do we, per unit:
# - before: every unit below the outermost module ``_apply`` runs on must be
#   idle; in-flight reduce-scatters are folded, units resharded (the modules
#   then hold the sharded Parameters), and, for swap_tensors, our weak
#   references to the Parameters and their gradients are dropped;
# - after: each group whose Parameters ``_apply`` changed (other object, dtype,
#   device, or storage) gets a new shard built from them
#   (``FlatGroup.adopt_params``), keeping the Parameter objects the modules now
#   hold: an optimizer built after the cast steps the new shard. All of a
#   group's Parameters must have changed alike, else the error names them (a
#   module *inside* a unit was cast alone). Once any group of a unit changed,
#   every group of it is re-made (their flats are new leaves) and the unit
#   re-hooks them; the units' root context is dropped, so the next forward
#   runs lazy init again (which groups are direct, passive units and
#   ``reshard_after_forward`` at world size 1 may have changed).
# Nested ``_apply`` calls (the children of the outermost module) only recurse.
_APPLYING = False


def _held(e) -> torch.Tensor:
    m, name = e.slots[0]
    return m._parameters[name]


def _before_apply(units: list[Unit]) -> None:
    for u in units:
        if u.state is not TrainingState.IDLE:
            raise unit_error(u.fqn, f"a cast or move (nn.Module._apply: to / cuda / half / "
                             f"to_empty ...) inside forward or backward (state {u.state.name}).",
                             "Cast or move the model between steps.")
    for ctx in {id(u.ctx): u.ctx for u in units if u.ctx is not None}.values():
        ctx.finish_in_flight()  # a reduce-scatter left in flight (set_is_last_backward(False))
    swap = torch.__future__.get_swap_module_params_on_conversion()
    for u in units:
        u.pinned = False
        u.kept_after_backward = False
        u.reshard()
        if swap:
            for g in u.groups:  # (swap_tensors refuses tensors with weak references)
                for e in g.entries:
                    _SHARDED.pop(e.sharded)


def _changed(g: FlatGroup, e, p: torch.Tensor) -> bool:
    if p is not e.sharded or p.dtype != g.dtype or p.device != g.shard.device:
        return True
    return (not p.is_meta and p.untyped_storage().data_ptr()
            != g.shard.untyped_storage().data_ptr())


def _after_apply(units: list[Unit]) -> None:
    try:
        rebuilt = [u for u in units if _adopt_unit(u)]
    finally:
        _register_sharded(units)
    for ctx in {id(u.ctx): u.ctx for u in rebuilt if u.ctx is not None}.values():
        for v in ctx.units:  # lazy init again at the next forward
            v.ctx = None
            if not v.hook_handles:  # a passive unit's, removed by lazy init
                for m in v.modules:
                    _add_forward_hooks(v, m)


def _adopt_unit(u: Unit) -> bool:
    """Rebuild ``u``'s groups from what ``_apply`` left in the modules; False
    if it changed nothing of this unit."""
    held = [[_held(e) for e in g.entries] for g in u.groups]
    changed = [[_changed(g, e, p) for e, p in zip(g.entries, ps)]
               for g, ps in zip(u.groups, held)]
    if not any(any(c) for c in changed):
        return False
    for g, ps, cs in zip(u.groups, held, changed):
        kinds = {(p.dtype, p.device) for p in ps}
        if any(cs) and (not all(cs) or len(kinds) > 1):
            shown = ", ".join(f"'{e.fqn}' ({p.dtype}, {p.device})" for e, p in zip(g.entries, ps))
            raise unit_error(u.fqn, f"only some of this unit's parameters were cast or moved: "
                             f"{shown}.", "Cast or move the module fully_shard was applied to "
                             "(or the whole model), not a module inside it; or do it before "
                             "fully_shard.", exc=ValueError)
        dev = ps[0].device
        if not g.offload and dev.type not in ("meta", g.mesh_device.type):
            raise unit_error(u.fqn, f"moving its parameters to {dev}, but its mesh communicates "
                             f"on {g.mesh_device.type}.", "Move the model before fully_shard, or "
                             f"shard it on a {dev.type} mesh (CPUOffloadPolicy() keeps shards on "
                             "CPU).", exc=ValueError)
    for g, ps in zip(u.groups, held):
        g.adopt_params(ps)
    u.hook_groups()
    return True


def _register_sharded(units: list[Unit]) -> None:
    for u in units:
        for g in u.groups:
            for e in g.entries:
                _SHARDED[e.sharded] = (g, e)


class UnshardHandle:
    def __init__(self, unit: Unit):
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_for_unshard()


_CLASS_CACHE: dict[type, type] = {}


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls


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
        cls = type(m).__mro__[2] if isinstance(m, FSDPModule) else type(m)
        names.append(u.fqn if u is not None and u.fqn else cls.__name__)
    return ", ".join(names)


def _name_unit(unit: Unit) -> str:
    """Words that identify ``unit`` before the root names it: its FQN if a
    parent was sharded already, else fully_shard(<its modules' classes>)."""
    if unit.fqn:
        return f"'{unit.fqn}'"
    classes = ", ".join((type(m).__mro__[2] if isinstance(m, FSDPModule) else type(m)).__name__
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
            if p is None or id(p) in ignored or p in _SHARDED:
                continue
            if p in _REPLACED:
                other = _REPLACED[p]
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


_RS_GROUPS: dict = {}


def _reduce_scatter_group(pg):
    """A second process group over the same ranks, for reduce-scatters.

    See [Note: collective order] in _state.py: all-gathers and reduce-scatters
    each follow their own rank-independent order, so they must not share a
    group. Created at fully_shard time (every member calls fully_shard in the
    same order); only the members take part. Nothing but fully_shard's
    reduce-scatters (and their used-flags) runs on it: on gloo, small ones
    are point-to-point exchanges (see [Note: gloo collectives]).

    Over every rank of the default group (the usual 1-D mesh) it is made
    without ``use_local_synchronization``: every rank is a member, so every
    rank calls ``new_group`` here, and torch then names the group by a
    counter instead of a SHA-1 of its ranks, which initialises OpenSSL in
    every rank (about 1-1.5 MiB of RSS, measured; docs/design.md, "Peak RSS
    of small units").
    """
    if dist.get_world_size(pg) == 1:
        return pg
    key = dist.get_process_group_ranks(pg)
    key = (tuple(key), dist.get_backend(pg))
    if key not in _RS_GROUPS:
        world = key[0] == tuple(range(dist.get_world_size()))
        _RS_GROUPS[key] = dist.new_group(list(key[0]), use_local_synchronization=not world)
    return _RS_GROUPS[key]


def _build_groups(params: list, label: str, device, mesh: DeviceMesh, mp_policy,
                  offload, post_forward_size: int | None, granularity: str) -> list[FlatGroup]:
    by_key: dict[tuple, list] = {}
    for item in params:
        p = item[0]
        by_key.setdefault((p.dtype, p.requires_grad), []).append(item)
    shard_dim = mesh.ndim - 1
    world, rank, pg = mesh.size(shard_dim), mesh.get_local_rank(shard_dim), mesh.get_group(shard_dim)
    replicate_pg = mesh.get_group(0) if mesh.ndim == 2 and mesh.size(0) > 1 else None
    rs_pg = _reduce_scatter_group(pg)
    post_forward = _post_forward_group(pg, post_forward_size) if post_forward_size else None
    mp = mp_policy or MixedPrecisionPolicy()
    return [FlatGroup(label, items, device=device, world=world, rank=rank, pg=pg, rs_pg=rs_pg,
                      param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                      offload=offload is not None,
                      pin_memory=bool(offload is not None and offload.pin_memory),
                      replicate_pg=replicate_pg, post_forward=post_forward,
                      granularity=granularity)
            for items in by_key.values()]


def _check_policies(label: str, mp_policy, offload_policy):
    if mp_policy is not None:
        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise unit_error(label, f"mp_policy must be a fsdp_compose.MixedPrecisionPolicy, got "
                             f"{mp_policy!r}.", exc=TypeError)
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = getattr(mp_policy, name)
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise unit_error(label, f"MixedPrecisionPolicy.{name} must be a floating-point "
                                 f"torch.dtype or None, got {dt!r}.", exc=ValueError)
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise unit_error(label, f"offload_policy must be fsdp_compose.CPUOffloadPolicy() (or "
                         f"OffloadPolicy() for none), got {offload_policy!r}.", exc=TypeError)
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    return mp_policy, offload


def _check_reshard_after_forward(label: str, raf, shard_world: int):
    """Returns (bool | None, N or None): N when parameters reshard to N-rank groups."""
    if raf is None or isinstance(raf, bool):
        return raf, None
    if not isinstance(raf, int) or raf < 1 or shard_world % raf != 0:
        raise unit_error(label, f"reshard_after_forward={raf!r} must be a bool, None, or an int "
                         f"that divides the shard world size {shard_world}.",
                         f"Use one of {[d for d in range(1, shard_world + 1) if shard_world % d == 0]}"
                         " (e.g. the number of ranks per node).", exc=ValueError)
    if raf == 1:
        return False, None
    if raf == shard_world:
        return True, None
    return True, raf


_PF_GROUPS: dict = {}


def _post_forward_group(pg, size: int) -> PostForward:
    """This rank's group of ``size`` consecutive ranks of ``pg`` (reshard_after_forward=int).

    Only the members of each group create it (``use_local_synchronization``).
    """
    ranks = dist.get_process_group_ranks(pg)
    me = ranks.index(dist.get_rank())
    block = tuple(ranks[me // size * size:(me // size + 1) * size])
    key = (block, dist.get_backend(pg))
    if key not in _PF_GROUPS:
        _PF_GROUPS[key] = dist.new_group(list(block), use_local_synchronization=True)
    group = _PF_GROUPS[key]
    return PostForward(group, size, dist.get_rank(group))


@overload
def fully_shard(module: nn.Module, **kw) -> nn.Module: ...
@overload
def fully_shard(module: list[nn.Module], **kw) -> list[nn.Module]: ...


def fully_shard(module, *, mesh: DeviceMesh | None = None,
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

    _torch_hooks.install()  # once: the optimizer check and clip_grad_norm_ routing
    mesh = _as_mesh(label, mesh) if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise unit_error(label, f"mesh must be 1-D (FSDP) or 2-D (replicate, shard) for HSDP, "
                         f"got a {mesh.ndim}-D mesh {tuple(mesh.mesh_dim_names or ())}.",
                         "Pass the data-parallel sub-mesh, e.g. mesh['dp'] or "
                         "mesh['dp_replicate', 'dp_shard'].", exc=ValueError)
    mp_policy, offload = _check_policies(label, mp_policy, offload_policy)
    if shard_granularity not in GRANULARITIES:
        raise unit_error(label, f"shard_granularity must be one of {GRANULARITIES}, got "
                         f"{shard_granularity!r}.", "Use \"row\" (the default: each rank holds "
                         "whole dim-0 rows of every parameter) or \"tensor\" (each parameter "
                         "whole on one rank, for optimizers such as Muon or Adafactor).",
                         exc=ValueError)

    # One model-wide set may be passed to every call (as FSDP2 accepts): a
    # parameter outside these modules is simply not this unit's business.
    ignored = list(ignored_params or ())
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) \
                else f"a {type(p).__name__}"
            raise unit_error(label, f"ignored_params contains {what}, not an nn.Parameter.",
                             "Pass parameters from module.parameters().", exc=ValueError)

    device = _mesh_device(mesh)
    shard_world = mesh.size(mesh.ndim - 1)
    reshard_after_forward, post_forward_size = _check_reshard_after_forward(
        label, reshard_after_forward, shard_world)
    params = _collect(modules, {id(p) for p in ignored}, label)
    groups = (_build_groups(params, label, device, mesh, mp_policy, offload, post_forward_size,
                            shard_granularity) if params else [])
    unit = Unit(modules, groups, reshard_after_forward=reshard_after_forward, label=label,
                mp_policy=mp_policy, device=device)
    for g in groups:
        g.install_sharded()
        for e in g.entries:
            _SHARDED[e.sharded] = (g, e)
    register_state_dict_hooks(unit)
    entry_of = {id(e.slots): e for g in groups for e in g.entries}
    for p, slots, _ in params:
        _REPLACED[p] = unit
        _ORIGINAL_ENTRY[p] = weakref.ref(entry_of[id(slots)])
    for m in modules:
        _move_buffers(m, device)
        m.__dict__["_fsdp_unit"] = unit
        _add_forward_hooks(unit, m)
        _swap_class(m)
        assign_fqns(m)
    return module


def _move_buffers(m: nn.Module, device: torch.device) -> None:
    for sub in m.modules():
        for name, b in sub._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                sub._buffers[name] = b.to(device)


# [Note: torch.compile]
# The forward hooks all-gather, wait, free storage and keep Python state (the
# training state, the step's order): none of it can be in a graph, and dynamo
# tracing into it broke the graph at every storage check, collective wait and
# autograd-node access. So the hooks are ``torch.compiler.disable``d, as
# FSDP2's are: dynamo never traces them, and the compiled region is the
# module's own math.
# - ``block.compile()`` (before or after fully_shard) compiles ``_call_impl``:
#   a disabled hook in its hook loop makes dynamo run that frame eagerly
#   (counted as a skipped frame, not a graph break) and compile ``forward``
#   alone: one graph for all blocks of one code, 0 breaks, fullgraph=True too.
# - ``torch.compile(model)``: the root's ``forward`` reaches each sharded
#   child's hooks: a break there (or, inside a loop over blocks, the whole root
#   frame runs eagerly and each block's ``forward`` is compiled alone). The
#   same breaks and graphs as FSDP2 on the same model; ``fullgraph=True``
#   fails here, as it does for FSDP2 and DDP (README, "torch.compile").
# Guards hold across steps although ``refresh_views`` makes new view objects
# at every training forward: dynamo guards a module's tensors by their
# properties (dtype, device, shape, stride, requires_grad), not their identity
# (measured: no recompile after the first step; docs/design.md).
# The backward hooks run in the autograd engine, outside dynamo (compiled
# autograd is not supported). Disabling costs ~0.4 us per hook call in eager.
_EAGER = ("fsdp_compose's forward hooks gather and free parameters with collectives; they run "
          "eagerly around the compiled forward (README, 'torch.compile')")


def _add_forward_hooks(unit: Unit, m: nn.Module) -> None:
    unit.hook_handles += [
        m.register_forward_pre_hook(_pre_forward_hook(unit), prepend=True, with_kwargs=True),
        m.register_forward_hook(_post_forward_hook(unit))]


def _pre_forward_hook(unit: Unit):
    def hook(module, args, kwargs):
        return unit.pre_forward(module, args, kwargs)
    return torch.compiler.disable(hook, reason=_EAGER)  # see [Note: torch.compile]


def _post_forward_hook(unit: Unit):
    def hook(module, args, output):
        return unit.post_forward(module, args, output)
    return torch.compiler.disable(hook, reason=_EAGER)  # see [Note: torch.compile]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` like ``forward``: parameters unsharded around it.

    For methods such as ``generate`` that use the parameters without going
    through ``forward``. Calls of ``forward`` nested inside it are fine.
    """
    unit = unit_of(module)
    if unit is None:
        raise ValueError(f"fsdp_compose.register_fsdp_forward_method: {type(module).__name__} "
                         "is not sharded; call fully_shard on it first.")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise unit_error(unit.fqn, f"has no method {method_name!r}.",
                         "Pass the name of a method of the module.", exc=ValueError)

    pre, post = _pre_forward_hook(unit), _post_forward_hook(unit)

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        cast = pre(module, args, kwargs)
        if cast is not None:
            args, kwargs = cast
        out = method(*args, **kwargs)
        return post(module, args, out)

    module.__dict__[method_name] = wrapped


def param_info(param: torch.Tensor):
    """FQN, global shape and local range of a parameter sharded by fully_shard."""
    from .api import ParamInfo
    hit = _SHARDED.get(param)
    if hit is None:
        raise ValueError("fsdp_compose.param_info: this tensor is not a parameter sharded by "
                         f"fully_shard (shape {tuple(param.shape)}). Pass one of "
                         "model.parameters() after fully_shard, while the model is sharded.")
    g, e = hit
    rank_bytes = tuple(n * g.dtype.itemsize for n in g.layout.rank_numel())
    tp = (e.tp.placements, e.tp.shape) if e.tp is not None else (None, None)
    return ParamInfo(e.fqn, e.shape, e.local_range, g.unit_fqn, *tp, rows=e.rows,
                     granularity=g.granularity, rank_bytes=rank_bytes)
