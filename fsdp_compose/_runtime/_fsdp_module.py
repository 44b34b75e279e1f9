"""What a sharded module is: the ``FSDPModule`` mixin that fully_shard puts
into its class (the user's methods: ``unshard``, ``reshard``, the ``set_*``
settings), its forward hooks, and a cast or move after fully_shard
(``FSDPModule._apply``, [Note: casts after fully_shard]).

The entry point, fully_shard (_fully_shard.py), builds a unit and attaches
it here: ``add_forward_hooks`` and ``make_fsdp_module``.
"""
from __future__ import annotations

import functools
from typing import cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule

from .._base._common import Gather, Kept, TrainingState, root_setting_fix, unit_error
from .._group._flat_group import FlatGroup
from .._base._registry import SHARDED, unit_of
from .._group._row_dtensor import local_of
from ._state import hook_grads, post_forward, pre_forward, root_of
from ._unit import Unit


class FSDPModule(_TorchFSDPModule):
    """Mixed into the class of every module ``fully_shard`` was applied to.

    ``isinstance(m, FSDPModule)`` tells a sharded module, and so does
    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` (a stack that checks
    for FSDP2's class finds ours: every public method of torch's is defined
    here, with FSDP2's meaning or an error saying why it cannot apply);
    ``isinstance(m, OriginalClass)`` still holds. A list unit's modules share
    one unit, so any of them unshards/reshards all of it.
    """

    def __new__(cls, *args, **kwargs):
        # (torch's FSDPModule.__new__ strips its own class by MRO position)
        return object.__new__(cls)

    def _unit(self) -> Unit:
        return unit_of(self)  # type: ignore[arg-type, return-value]

    def _units(self, recurse: bool) -> list[Unit]:
        """This module's unit and, with ``recurse``, every unit below it."""
        me = cast(nn.Module, self)  # (a mixin: the instance is the module)
        found = (unit_of(m) for m in (me.modules() if recurse else [me]))
        return list(dict.fromkeys(u for u in found if u is not None))

    def _root_setting(self, where: str, **changes) -> None:
        """Apply a root-only setter (``where``) with ``changes`` to this unit's
        model settings; this unit must be the root. Known only after lazy
        init: a setter called earlier on a unit that does not become the root
        is an error at the first forward (``_state._check_root_settings``),
        never silently ignored."""
        unit = self._unit()
        if unit.ctx is not None and not unit.is_root:
            raise unit_error(unit.fqn, f"{where}() is a setting of the whole model, read on "
                             f"the root unit '{unit.ctx.root.fqn or '<root>'}' only; this "
                             "unit is not the root.", root_setting_fix(where),
                             exc=ValueError)
        unit.update_root_settings(where, **changes)

    def _apply(self, fn, recurse: bool = True):
        """``to`` / ``cuda`` / ``cpu`` / ``half`` / ``float`` / ``double`` /
        ``to_empty`` ... after fully_shard cast or move the shards, as in FSDP2:
        see [Note: casts after fully_shard]."""
        global _APPLYING
        if _APPLYING:  # inside an outer module's _apply, which adopts the result
            return super(_TorchFSDPModule, self)._apply(fn, recurse)  # type: ignore[misc]  # (not FSDP2's)
        units = self._units(recurse)
        _before_apply(units)
        _APPLYING = True
        try:
            out = super(_TorchFSDPModule, self)._apply(fn, recurse)  # type: ignore[misc]
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

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":  # type: ignore[override]
        """All-gather this unit's parameters and install full-shape views.

        With ``async_op=True`` returns a handle whose ``wait()`` completes it.
        The unit stays unsharded until ``reshard()`` (or the end of the next
        backward).
        """
        unit = self._unit()
        root_of(unit).gather(unit, Gather.USER)
        unit.keep(Kept.USER)
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the modules see the sharded Parameters again."""
        unit = self._unit()
        unit.keep(Kept.NO)
        unit.reshard()

    def set_reshard_after_forward(  # type: ignore[override]
            self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether to free the parameters after forward (True) or keep them for backward."""
        for u in self._units(recurse):
            u.update_settings(reshard_after_forward=bool(reshard_after_forward))


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
            u.update_settings(requires_gradient_sync=bool(requires_gradient_sync))

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with False, gradients are reduce-scattered within the shard
        group but not all-reduced across replicas; the reduce-scattered sum is
        kept and the next backward with True all-reduces it once (``p.grad`` is
        updated then). Every rank must use the same setting."""
        for u in self._units(recurse):
            u.update_settings(requires_all_reduce=bool(requires_all_reduce))

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With False, backward does not all-gather this unit's parameters: for
        a unit whose backward needs none of their values (an embedding needs
        only the indices and the output gradient). Its gradients are reduced as
        usual. Only for such units: a backward that reads the parameters then
        reads freed memory (as in torch FSDP2). A forward recomputed in
        backward (activation checkpointing) still gathers them. Not recursive,
        as in FSDP2; every rank must use the same setting."""
        self._unit().update_settings(unshard_in_backward=bool(unshard_in_backward))

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """With False, parameters stay gathered after backward, so the next
        forward (another microbatch) all-gathers nothing. Costs the unsharded
        parameters' memory between steps. Safe across an optimizer step: a unit
        whose shard changed since it was gathered is gathered again."""
        for u in self._units(recurse):
            u.update_settings(reshard_after_backward=bool(reshard_after_backward))

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Call on the root. With False, the backward does not wait for its last
        reduce-scatter: it overlaps the next microbatch's forward and is folded
        into ``p.grad`` by the next backward. Set True before the last
        microbatch's backward (its end makes every ``p.grad`` final)."""
        self._root_setting("set_is_last_backward", is_last_backward=bool(is_last_backward))

    def set_modules_to_forward_prefetch(  # type: ignore[override]
            self, modules: list[nn.Module]) -> None:
        """All-gather these sharded modules' units when this one's forward starts.

        Overrides the default (the next ``prefetch_depth`` units of the last
        step's order). Every rank must pass the same list.
        """
        self._unit().update_settings(
            forward_prefetch=_units_of(modules, "set_modules_to_forward_prefetch"))

    def set_modules_to_backward_prefetch(  # type: ignore[override]
            self, modules: list[nn.Module]) -> None:
        """All-gather these sharded modules' units when this one's backward starts.

        Backward all-gathers keep their rank-independent order: prefetching
        unit w also gathers the units between this one and w in that order.
        """
        self._unit().update_settings(
            backward_prefetch=_units_of(modules, "set_modules_to_backward_prefetch"))

    def set_overlap_reduce_scatter(self, overlap: bool) -> None:
        """Call on the root. True (default): a unit's reduce-scatter runs while
        backward computes the next unit's gradients. False: wait for it right
        away, so its flat gradient is freed before the next one is made (one
        unsharded gradient less at the peak; backward no longer overlaps it).
        With ``set_prefetch_depth(0)`` this is the lowest-memory schedule."""
        self._root_setting("set_overlap_reduce_scatter", overlap_reduce_scatter=bool(overlap))

    def set_reduce_scatter_bucket_bytes(self, nbytes: int) -> None:
        """Call on the root. Reduce-scatter the gradients of consecutive units
        (in the backward's reduce order) together: one collective for a run of
        units whose flat gradients add up to at most ``nbytes`` (default 1 MiB;
        a larger unit is reduced alone; 0: one collective per unit). For many
        small units, where each collective's latency dominates its bytes; costs
        one copy of the bucket's flat gradients (a rank-major ``cat``), and a
        unit's gradient waits until its bucket is complete."""
        _check_bucket_bytes(self._unit(), nbytes)
        self._root_setting("set_reduce_scatter_bucket_bytes", bucket_bytes=nbytes)

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
        self._root_setting("set_all_gather_bucket_bytes", gather_bucket_bytes=nbytes)

    def set_forward_order_dynamic(self, dynamic: bool) -> None:
        """Call on the root. Units may run on some ranks only (an expert no
        token was routed to here, an ``if`` on data): every rank follows one
        order of unit forwards, learned from the first training forward(s),
        and a rank that skips a unit still takes part in its all-gathers where
        the order has it. A model whose order changes by design (units that
        run in another order, or more often, than learned; units not run in
        any of the first training forwards) gets an error naming the unit.
        With True, the ranks agree on the order in every forward instead: one
        small all-reduce per unit forward start and end (a host sync each on
        NCCL). Every rank must use the same setting."""
        self._root_setting("set_forward_order_dynamic", forward_order_dynamic=bool(dynamic))

    def set_prefetch_depth(self, depth: int) -> None:
        """How many units to all-gather ahead in forward and backward (default 1).

        Call on the root. In-flight unsharded memory is at most the current
        unit plus ``depth`` units (plus explicit prefetches); 0 disables
        prefetching.
        """
        if not isinstance(depth, int) or depth < 0:
            raise unit_error(self._unit().fqn, f"prefetch depth must be an int >= 0, got "
                             f"{depth!r}.", exc=ValueError)
        self._root_setting("set_prefetch_depth", prefetch_depth=depth)


    # ------------------------------------------ the rest of FSDP2's FSDPModule
    def reset_iter_state(self) -> None:
        """FSDP2's recovery call after an exception aborted a forward or
        backward. Here the next forward recovers by itself (see "When ranks
        diverge" in the README), so this only checks that it is called on the
        root, as FSDP2 does."""
        unit = self._unit()
        if unit.ctx is not None and not unit.is_root:
            raise unit_error(unit.fqn, "reset_iter_state() must be called on the root module.",
                             "Call it on the module the top-level fully_shard was applied to.",
                             exc=RuntimeError)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by ``factor`` instead of by the
        number of data-parallel ranks (1.0: a plain sum, as torchtitan uses when
        it normalises the loss by the global token count). Not recursive, as in
        FSDP2; every rank must use the same factor."""
        factor = float(factor)
        if not factor > 0:
            raise unit_error(self._unit().fqn, f"gradient divide factor {factor} must be > 0.",
                             exc=ValueError)
        self._unit().update_settings(divide_factor=factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """The same as ``set_gradient_divide_factor`` (FSDP2's older name)."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """With True, this unit's reductions use ``ReduceOp.SUM`` only, followed by
        a division (never an average or pre-multiplied sum on the wire). Not
        recursive, as in FSDP2."""
        self._unit().update_settings(force_sum=bool(enable))

    def set_post_optim_event(self, event) -> None:
        """FSDP2 waits its all-gathers on ``event`` instead of the current
        stream. Our all-gathers always wait the current (compute) stream, which
        the optimizer step ran on, so the event's ordering already holds: it is
        accepted and needs no further wait."""
        self._root_setting("set_post_optim_event")
        if not (hasattr(event, "record") and hasattr(event, "wait")):
            raise unit_error(self._unit().fqn, f"set_post_optim_event needs an event, got "
                             f"{type(event).__name__}.", exc=TypeError)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Always on here: a unit or parameter without a gradient on a rank
        takes part in the reduce-scatter with zeros (README, "Where we differ
        from FSDP2"); False cannot turn that off, because it is what keeps ranks
        that used different parameters from hanging."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """FSDP2's cap on its reduce-scatter copy-in buffers. There are none here:
        the reduce-scatter reads the flat gradient autograd produced (zero-copy),
        so nothing is capped; accepted for a drop-in."""
        if int(max_input_buffers) < 1:
            raise unit_error(self._unit().fqn, "max_input_buffers must be >= 1.", exc=ValueError)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """Reduce-scatters already run on their own process group here (see
        docs/design.md, "Collective order"); accepted for a drop-in."""

    def set_custom_all_gather(self, comm) -> None:
        """Not supported: the all-gather writes straight into the unit's flat
        buffer, which the parameters are views of (zero-copy); FSDP2's custom
        comm allocates its own output buffers, which our parameters cannot view."""
        raise _unsupported(self, "set_custom_all_gather", "the all-gather writes into the flat "
                           "buffer the parameters are views of; a custom comm's own buffers "
                           "cannot be.")

    def set_custom_reduce_scatter(self, comm) -> None:
        """Not supported (see ``set_custom_all_gather``): the reduce-scatter reads
        the flat gradient autograd produced and writes the gradient shard."""
        raise _unsupported(self, "set_custom_reduce_scatter", "the reduce-scatter reads the flat "
                           "gradient autograd produced and writes the gradient shard in place.")

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Not supported: the HSDP all-reduce and the used-flags share the
        reduction here, so a user hook cannot replace it."""
        raise _unsupported(self, "set_all_reduce_hook", "the HSDP all-reduce carries the "
                           "used-flags that decide which p.grad stay None.")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """False (the default) is accepted. True is not supported: the collectives
        read and write the flat buffers themselves, which the caching allocator
        owns."""
        if enable:
            raise _unsupported(self, "set_allocate_memory_from_process_group_for_comm(True)",
                               "the collectives use the flat buffers themselves (zero-copy), "
                               "which the caching allocator owns.")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported: symmetric-memory staging buffers are FSDP2's copy-in
        buffers; here the all-gather output is the flat buffer itself."""
        raise _unsupported(self, "set_symm_mem_for_comm", "the all-gather output is the flat "
                           "buffer the parameters view, not a staging buffer.")


def _unsupported(module, what: str, why: str) -> NotImplementedError:
    return unit_error(module._unit().fqn,  # type: ignore[return-value]
                      f"{what} is not supported by fsdp_compose: {why}",
                      "Leave it unset; the default path is the one this library optimises.",
                      exc=NotImplementedError)


def _check_bucket_bytes(unit, nbytes) -> None:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise unit_error(unit.fqn, f"bucket size must be an int >= 0 (bytes), got {nbytes!r}.",
                         exc=ValueError)


def _units_of(modules, where: str) -> tuple[Unit, ...]:
    units = []
    for m in modules:
        u = unit_of(m)
        if u is None:
            raise ValueError(f"fsdp_compose.{where}: {type(m).__name__} is not sharded; pass "
                             "modules that fully_shard was applied to.")
        units.append(u)
    return tuple(units)


# [Note: casts after fully_shard]
# ``nn.Module._apply`` (``to``, ``cuda``, ``half``, ``to_empty`` ...) replaces
# what each ``_parameters`` slot holds (``p.data = fn(p)`` by default; a new
# Parameter, or swapped contents, under torch.__future__'s flags), cutting it
# off from our shard. FSDP2 re-reads its sharded parameters after ``_apply``;
# so do we, per unit:
# - before: every unit below the outermost module ``_apply`` runs on must be
#   idle; in-flight reduce-scatters are folded, units resharded, and, for
#   swap_tensors (which refuses them), our weak references dropped;
# - after: each group whose Parameters changed (object, dtype, device or
#   storage) gets a new shard built from them (``FlatGroup.adopt_params``),
#   keeping the Parameter objects the modules hold; they must all have changed
#   alike, else an error names them. A changed unit re-makes and re-hooks every
#   group, and its root context is dropped: the next forward runs lazy init.
# Nested ``_apply`` calls (the children of the outermost module) only recurse.
_APPLYING = False  # process-wide: set for the outermost _apply call only, never kept after it


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
        # a reduce-scatter left in flight (set_is_last_backward(False))
        ctx.reductions.finish_in_flight()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    for u in units:
        u.keep(Kept.NO)
        u.reshard()
        if swap:
            for g in u.groups:  # (swap_tensors refuses tensors with weak references)
                for e in g.entries:
                    SHARDED.pop(e.sharded)


def _changed(g: FlatGroup, e, p: torch.Tensor) -> bool:
    if p is not e.sharded or p.dtype != g.dtype or p.device != g.shard.device:
        return True
    local = local_of(p)  # (a RowParam's storage is its local tensor's)
    return (not p.is_meta and local.untyped_storage().data_ptr()
            != g.shard.untyped_storage().data_ptr())


def _after_apply(units: list[Unit]) -> None:
    try:
        rebuilt = [u for u in units if _adopt_unit(u)]
    finally:
        _register_sharded(units)
    for ctx in {id(u.ctx): u.ctx for u in rebuilt if u.ctx is not None}.values():
        for v in ctx.units:  # lazy init again at the next forward
            v.set_root(None)
            if not v.hook_handles:  # a passive unit's, removed by lazy init
                for m in v.modules:
                    add_forward_hooks(v, m)


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
    hook_grads(u)
    return True


def _register_sharded(units: list[Unit]) -> None:
    for u in units:
        SHARDED.add_groups(u.groups)


class UnshardHandle:
    def __init__(self, unit: Unit):
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_for_unshard()


_CLASS_CACHE: dict[type, type] = {}  # class -> its FSDP class: process-wide, as classes are


def original_class(module: nn.Module) -> type:
    """The class ``module`` had before fully_shard (``FSDP<Name>`` is
    ``(FSDPModule, <Name>)``)."""
    cls = type(module)
    return cls.__bases__[1] if issubclass(cls, FSDPModule) else cls


def make_fsdp_module(module: nn.Module) -> None:
    cls = type(module)
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls


# [Note: torch.compile]
# The forward hooks all-gather, wait, free storage and keep Python state: none
# of it can be in a graph, so they are ``torch.compiler.disable``d, as FSDP2's
# are; the compiled region is the module's own math (docs/design.md).
# - ``block.compile()`` compiles ``_call_impl``: a disabled hook in its hook
#   loop makes dynamo run that frame eagerly (a skipped frame, not a break)
#   and compile ``forward`` alone: one graph per block code, 0 breaks.
# - ``torch.compile(model)``: a break at each sharded child's hooks (in a loop
#   over blocks, the root frame runs eagerly): FSDP2's breaks and graphs;
#   ``fullgraph=True`` fails, as for FSDP2 and DDP.
# Guards hold across steps although ``refresh_views`` makes new views at every
# training forward: dynamo guards a module's tensors by their properties, not
# their identity. The backward hooks run in the autograd engine, outside
# dynamo (compiled autograd is not supported).
_EAGER = ("fsdp_compose's forward hooks gather and free parameters with collectives; they run "
          "eagerly around the compiled forward (README, 'torch.compile')")


def add_forward_hooks(unit: Unit, m: nn.Module) -> None:
    unit.hook_handles += [
        m.register_forward_pre_hook(_pre_forward_hook(unit), prepend=True, with_kwargs=True),
        m.register_forward_hook(_post_forward_hook(unit))]


def _pre_forward_hook(unit: Unit, entry: str = "forward"):
    def hook(module, args, kwargs):
        return pre_forward(unit, args, kwargs, entry)
    return torch.compiler.disable(hook, reason=_EAGER)  # see [Note: torch.compile]


def _post_forward_hook(unit: Unit):
    def hook(module, args, output):
        return post_forward(unit, output)
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

    # (a root forward through it follows its own forward order: see
    # set_forward_order_dynamic)
    pre, post = _pre_forward_hook(unit, method_name), _post_forward_hook(unit)

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        cast = pre(module, args, kwargs)
        if cast is not None:
            args, kwargs = cast
        out = method(*args, **kwargs)
        return post(module, args, out)

    module.__dict__[method_name] = wrapped
