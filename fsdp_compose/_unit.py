"""One fully_shard unit: its modules, flat groups, hooks, settings and training state.

[Note: who decides] A unit *reports* its hooks' events to the root
(``record_forward``, ``forward_end``, ``on_backward_hook``, ``pre_backward``,
``grads_computed``, ``grads_ready``); the schedule (``RootContext``,
``BackwardSchedule``) *decides* what is gathered, freed and reduced and issues
it through ``_group_ops``. The unit's acts (``wait_for_unshard``, ``reshard``)
touch only its own groups, never calling back into the root; it writes only
its own fields; each hook moves its ``TrainingState`` along ``_MOVES`` or raises:

    pre_forward    all-gathered, full-shape views installed      IDLE -> FORWARD
    post_forward   pre-backward hook on the outputs; the root's
                   AFTER_FORWARD reshard decision                FORWARD -> IDLE
    pre_backward   gathered again if it was resharded            -> PRE_BACKWARD
    post_backward  every trainable group's flat gradient is in:
                   reshard decision, then the reduce-scatter     -> POST_BACKWARD
    final          (root callback) what is left; reset            -> IDLE

[Note: recomputation] A forward that runs *inside* backward is activation-
checkpoint recomputation: pre_forward only makes sure the unit is unsharded;
post_forward neither reshards nor registers hooks. The unit then stays
unsharded until its post-backward (or the root's final callback).
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from . import _compat
from ._common import (Gather, Kept, ReduceSettings, RootSettings, ShardedState,
                      TrainingState, UnitSettings, label, trace, unit_error, weak_hook)
from ._flat_group import FlatGroup
from ._forward_order import GRAD, ISLAND, NO_BACKWARD

if TYPE_CHECKING:
    from ._state import RootContext

_REDUCE_FIELDS = {f.name for f in fields(ReduceSettings)}
# where a backward hook may find the unit (not inside its own forward)
_IN_BACKWARD = (TrainingState.IDLE, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
# the states each state is entered from (Unit._enter); the root's reset moves
# any state to IDLE (finish_backward)
_MOVES = {
    TrainingState.FORWARD: (TrainingState.IDLE,),
    TrainingState.IDLE: (TrainingState.FORWARD,),
    TrainingState.PRE_BACKWARD: (TrainingState.IDLE, TrainingState.PRE_BACKWARD,
                                 TrainingState.POST_BACKWARD),
    # (IDLE, POST_BACKWARD: a no-grad island recomputed in backward has no
    # pre-backward hook, see [Note: recomputation])
    TrainingState.POST_BACKWARD: (TrainingState.IDLE, TrainingState.PRE_BACKWARD,
                                  TrainingState.POST_BACKWARD),
}


class Unit:
    def __init__(self, modules: list[nn.Module], groups: list[FlatGroup], *,
                 reshard_after_forward: bool | None, label: str, mp_policy=None,
                 device: torch.device = torch.device("cpu"),
                 lazy_init_root: Callable[["Unit"], None]):
        self.modules = modules
        # _state.lazy_init_root, passed in by fully_shard: _state imports this
        # module, so this one never imports _state (docs/architecture.md)
        self._lazy_init_root = lazy_init_root
        self.groups = groups
        self.device = device  # its mesh's device (a root without parameters takes it)
        # groups whose flat gradient we reduce (a direct group's Parameters get
        # their gradients from autograd, see [Note: world size 1]); follows
        # requires_grad_() on the Parameters (see _sync_requires_grad); see hook_groups
        self.trainable: list[FlatGroup] = []
        self.trains: tuple[bool, ...] = ()  # each group's requires_grad (see hook_groups)
        self.fqn = label
        # the user's settings (resolved: reshard_after_forward), see update_settings
        self.settings = UnitSettings(reshard_after_forward=reshard_after_forward)
        self.kept = Kept.NO  # left unsharded between steps, and why (see keep)
        mp = mp_policy
        self._cast_inputs = mp.param_dtype if mp is not None and mp.cast_forward_inputs else None
        self._cast_outputs = mp.output_dtype if mp is not None else None
        self.state = TrainingState.IDLE
        self.ctx: RootContext | None = None
        self.hook_handles: list = []  # its forward pre/post hooks (see passive)
        self._forward_depth = 0   # >0 while inside any module of this unit
        self._posted = False      # post_forward ran for the call ending now (see forward_ended)
        # the model's settings, on the root, or where a root setter was called
        # on this unit before lazy init (see RootSettings): None on every other unit
        self.root_settings: RootSettings | None = None
        self.grads_hooked = False  # _grads_computed will run this backward (gloo)
        self.uses = 0             # forward calls this step that will see a backward
        self._uses_seen = 0       # ... whose output gradient arrived in this backward
        self._ready: set[FlatGroup] = set()  # trainable groups whose grad arrived this backward
        self.hook_groups()

    def hook_groups(self) -> None:
        """Find the trainable groups and hook their flat gradients. Again after
        a cast or move re-made every group's flat (FSDPModule._apply): which
        groups are direct may have changed."""
        self.trainable = [g for g in self.groups if g.requires_grad and not g.direct]
        self.trains = tuple(g.requires_grad for g in self.groups)
        self._ready.clear()
        for g in self.groups:
            g.grad.settings = self.settings.reduce
            if not g.direct:  # (registered on the flat whenever it requires grad)
                g.set_grad_hook(weak_hook(self, "_on_grad_accumulated", g))

    def __repr__(self) -> str:
        return f"Unit({self.fqn or '<root>'!r}, groups={len(self.groups)}, {self.state.name})"

    @property
    def passive(self) -> bool:
        """Its hooks would do nothing: every group is direct (see [Note: world
        size 1] in _flat_group.py) and nothing is cast. In a model where no unit
        communicates, the root removes a passive unit's forward hooks at lazy
        init (its own stay: they run the step's bookkeeping)."""
        return (all(g.direct for g in self.groups) and self._cast_inputs is None
                and self._cast_outputs is None)

    def remove_forward_hooks(self) -> None:
        for h in self.hook_handles:
            h.remove()
        self.hook_handles = []

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    def update_settings(self, **changes) -> None:
        """The one way a unit's settings change (fully_shard, FSDPModule's
        setters): a new ``UnitSettings`` with ``changes``; the fields of
        ``ReduceSettings`` go to its ``reduce``, which the groups' gradient
        paths then read. Every rank must make the same changes (the step
        checks compare them: ``SettingsFingerprint``)."""
        reduce = {k: changes.pop(k) for k in _REDUCE_FIELDS & changes.keys()}
        settings = replace(self.settings, **changes)
        if reduce:
            settings = replace(settings, reduce=replace(settings.reduce, **reduce))
            for g in self.groups:
                g.grad.settings = settings.reduce
        self.settings = settings

    def update_root_settings(self, where: str, **changes) -> None:
        """The one way the model's settings change: a root setter (``where``)
        called on this unit (FSDPModule._root_setting checks it is the root,
        where that is known)."""
        settings = self.root_settings or RootSettings()
        self.root_settings = replace(settings, called=settings.called | {where}, **changes)

    @property
    def reshard_after_forward(self) -> bool:
        """Free the parameters after forward: see resolve_reshard_after_forward."""
        return self.resolve_reshard_after_forward(self.is_root)

    def resolve_reshard_after_forward(self, is_root: bool) -> bool:
        """The setting, resolved: None (the default) is True except for the
        root. Never where every group's flat is its shard (world size 1, no
        cast or offload): resharding would free nothing, and the swap out and
        in per step is skipped."""
        if self.groups and all(g.aliased for g in self.groups):
            return False
        value = self.settings.reshard_after_forward
        return not is_root if value is None else bool(value)

    def set_fqn(self, fqn: str, prefix: dict[int, str]) -> None:
        """Named by the root (lazy init): its FQN, and each parameter's from
        ``prefix`` (id(module) -> its FQN below the root)."""
        self.fqn = fqn
        for g in self.groups:
            g.unit_fqn = fqn
            for e in g.entries:
                m, attr = e.slots[0]
                if id(m) in prefix:
                    e.fqn = f"{prefix[id(m)]}.{attr}" if prefix[id(m)] else attr
                    if e.row is not None:  # (a RowParam names itself in its errors)
                        e.sharded._fsdp_name = e.fqn  # type: ignore[attr-defined]

    def set_root(self, ctx: "RootContext | None") -> None:
        """Made part of a root's units by lazy init; None: lazy init again at
        the next forward (a cast or move re-made the groups)."""
        self.ctx = ctx

    def make_root(self) -> None:
        """Lazy init made this unit a root: its model settings exist from now
        on (the defaults unless a root setter was called)."""
        if self.root_settings is None:
            self.root_settings = RootSettings()

    def keep(self, why: Kept) -> None:
        """Whether (and why) the unit stays unsharded between steps; read by
        ``RootContext.reshard`` at a new step."""
        self.kept = why

    def start_step(self) -> None:
        """A training root forward starts a step (after the root's NEW_STEP
        reshard decision)."""
        self.uses = 0
        if self.kept is Kept.BACKWARD:
            self.keep(Kept.NO)

    def _assert_state(self, *states: TrainingState, where: str) -> None:
        if self.state not in states:
            raise unit_error(self.fqn, f"{where} expected state {[s.name for s in states]}, "
                             f"got {self.state.name}.")

    def _enter(self, state: TrainingState, where: str) -> None:
        """The state machine: every hook moves the unit along ``_MOVES`` or raises."""
        if self.state not in _MOVES[state]:
            self._assert_state(*_MOVES[state], where=where)  # (raises)
        self.state = state

    # ----------------------------------------------------------- unshard/reshard
    def root_context(self) -> "RootContext":
        """Its root's context, made by lazy init at the first use."""
        if self.ctx is None:
            self._lazy_init_root(self)
        return self.ctx  # type: ignore[return-value]

    def would_gather(self) -> bool:
        """Gathering it now issues a collective: some group is sharded (or
        PARTIAL) over more than one rank."""
        return any(g.world > 1 and (g.state is ShardedState.SHARDED
                                    or g.state is ShardedState.PARTIAL) for g in self.groups)

    def gather_bytes(self) -> int | None:
        """Bytes its all-gathers write, if every group would be gathered by a
        plain all-gather now (sharded, world > 1); else None."""
        keys = [g.gather_key() for g in self.groups]
        if not keys or None in keys:
            return None
        return sum(g.padded_numel * g.compute_dtype.itemsize for g in self.groups)

    def wait_for_unshard(self) -> None:
        for g in self.groups:
            g.wait_for_unshard()

    def reshard(self, to_post_forward: bool = False) -> None:
        if any(g.state is not ShardedState.SHARDED for g in self.groups):
            trace("reshard", self.fqn, self.state.name)
        for g in self.groups:
            g.reshard(to_post_forward)

    @property
    def is_unsharded(self) -> bool:
        return any(g.state is not ShardedState.SHARDED for g in self.groups)

    def is_stale(self) -> bool:
        """An optimizer step (any in-place write) changed a shard since it was gathered."""
        return any(g.state is not ShardedState.SHARDED and g.shard._version != g.unsharded_version
                   for g in self.groups)

    def check_params(self, direct: bool = True) -> None:
        """Every parameter is still ours: the module holds its sharded (or
        unsharded) Parameter, and the sharded one's data is still its piece
        of the shard; else RuntimeError naming the parameter. At lazy init and
        at every forward of the unit, before any collective (a ``p.data = ...``,
        cast or ``to_empty`` inside the unit would leave the optimizer stepping
        a copy no all-gather reads). Not ``direct``: skip the groups whose
        Parameters are autograd's own leaves ([Note: world size 1] in
        _flat_group.py), where a replaced ``.data`` trains as in plain PyTorch."""
        for g in self.groups:
            if g.device.type == "meta" or (g.direct and not direct):
                continue  # (lazy init refuses a forward on meta: _check_not_meta)
            shard_ptr = g.shard.untyped_storage().data_ptr()
            for e in g.entries:
                for m, attr in e.slots:
                    held = m._parameters.get(attr)
                    if held is not e.sharded and held is not e.unsharded:
                        raise unit_error(
                            self.fqn, f"parameter '{e.fqn}' was replaced after fully_shard.",
                            "Assign or re-initialise parameters before calling fully_shard, "
                            "not after (in place, under torch.no_grad(), is fine); cast or "
                            "move the module fully_shard was applied to (or the whole model), "
                            "not a module inside it.")
                if e.storage_ptr() != shard_ptr:
                    raise unit_error(
                        self.fqn, f"parameter '{e.fqn}' no longer aliases its shard (its .data "
                        "was replaced: p.data = ..., or .to() / to_empty() on a module inside "
                        "the unit).", "Cast or move the module fully_shard was applied to (or "
                        "the whole model), which casts the shards; or do it before fully_shard.")

    # ------------------------------------------------------------------ forward
    def pre_forward(self, module: nn.Module, args, kwargs, entry: str = "forward"):
        """``entry``: the method run (``forward``, or one registered with
        register_fsdp_forward_method)."""
        ctx = self.root_context()
        if _compat.in_backward():  # see [Note: recomputation]
            trace("pre_forward_recompute", self.fqn, self.state.name)
            if not ctx.expects_backward(self):  # reentrant: this use's gradient comes next
                self._uses_seen += 1
            with _compat.functorch_disabled():
                ctx.gather(self, Gather.RECOMPUTE)
                self._refresh_views()
                self.wait_for_unshard()
            return self._cast(self._cast_inputs, (args, kwargs))
        if self._forward_depth == 0:
            self.check_params(direct=False)
            if self.is_root:
                ctx.root_pre_forward(entry)
            self._assert_state(TrainingState.IDLE, where="pre_forward")
            with label("pre_forward", self.fqn), _compat.functorch_disabled():
                gather = ctx.record_forward(self)  # (first: units skipped here, _forward_walk.py)
                trace("pre_forward", self.fqn, self.state.name)
                self.sync_requires_grad()
                self._enter(TrainingState.FORWARD, "pre_forward")
                if gather:
                    ctx.gather(self, Gather.FORWARD)
                self._refresh_views()
                self.wait_for_unshard()
        self._forward_depth += 1
        return self._cast(self._cast_inputs, (args, kwargs))

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad_()`` called on the sharded Parameters since the
        last forward (see FlatGroup.sync_requires_grad)."""
        changed = False
        for g in self.groups:
            changed |= g.sync_requires_grad()
        if changed:
            self.trainable = [g for g in self.groups if g.requires_grad and not g.direct]
            self.trains = tuple(g.requires_grad for g in self.groups)

    @staticmethod
    def _cast(dtype, tree):
        """``tree`` with its floating-point tensors cast to ``dtype``; None if no cast."""
        if dtype is None:
            return None

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

        return _compat.tree_map_tensors(cast, tree)

    def _refresh_views(self) -> None:
        """After ``unshard()`` (views need the storage), under grad: new views
        for each trainable group, and for any whose ``requires_grad`` changed.
        An aliased group (world size 1, no cast) reuses its views: its
        post-backward, late with an old split node ([Note: tensor vocabulary]
        in _flat_group.py), frees and reduce-scatters nothing. On gloo each new
        split node reports to ``_grads_computed``."""
        if torch.is_grad_enabled():
            hook = self.ctx.streams.waits_block_cpu  # type: ignore[union-attr]
            for g in self.groups:
                trains = g.requires_grad and not g.direct
                # (any group whose requires_grad changed: its views must follow)
                if not (g._views_stale or (trains and not g.aliased)):
                    continue
                g.refresh_views()
                if hook and g.world > 1 and g.split_node is not None:  # a new node each time
                    if g.grad.on_grads_computed is None:  # (called by the split node's pre-hook)
                        g.grad.set_grads_computed_hook(weak_hook(self, "_grads_computed", g))
                    self.grads_hooked = True

    @_compat.outside_functorch
    def _grads_computed(self, group: FlatGroup, _grad_outputs) -> None:
        """``group``'s split node is about to assemble its flat gradient (gloo):
        see [Note: gloo backward] in _backward_schedule.py."""
        self._assert_state(*_IN_BACKWARD, where="grads_computed")
        self.ctx.grads_computed(self, group)  # type: ignore[union-attr]

    def post_forward(self, module: nn.Module, args, output):
        with label("post_forward", self.fqn):  # (hook time: benchmarks/gpu_check.py)
            return self._post_forward(output)

    def _post_forward(self, output):
        if self._cast_outputs is not None:  # (recomputation too: same saved tensors)
            output = self._cast(self._cast_outputs, output)
        if _compat.in_backward():  # see [Note: recomputation]
            return output
        self._forward_depth -= 1
        self._posted = True
        if isinstance(output, torch.Tensor):  # fast path: skip the pytree walk
            outs = [output] if output.requires_grad else []
        else:
            outs = [t for t in _compat.tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(outs) == 1:  # the common case: a plain tensor hook is cheaper
            outs[0].register_hook(self._pre_backward)
        elif outs:
            register_multi_grad_hook(outs, self._pre_backward, mode="any")
        if outs and torch.is_grad_enabled():
            self.uses += 1
        elif not torch.is_grad_enabled() and self.ctx.in_training_forward:  # type: ignore[union-attr]
            self.uses += 1  # a no-grad island in a training step: maybe a reentrant region
        if self._forward_depth > 0:  # another module of this unit is still running
            return output
        self._assert_state(TrainingState.FORWARD, where="post_forward")
        grad_follows = torch.is_grad_enabled() and bool(outs)
        island = not torch.is_grad_enabled() and self.ctx.in_training_forward  # type: ignore[union-attr]
        with _compat.functorch_disabled():  # (first: units skipped here, _forward_walk.py)
            self.ctx.forward_end(  # type: ignore[union-attr]
                self, GRAD if grad_follows else ISLAND if island else NO_BACKWARD)
        self._enter(TrainingState.IDLE, "post_forward")
        return output

    def forward_ended(self) -> None:
        """After each forward of the root's modules, also one that raised (an
        ``always_call`` hook, registered at lazy init after post_forward). A
        forward that raised ran no post_forward: it is no longer running, but
        its units stay in FORWARD, so the root's next forward runs its
        pre-forward and finds the step left half-done (see
        RootContext.root_pre_forward)."""
        if not self._posted and not _compat.in_backward():
            self._forward_depth = max(0, self._forward_depth - 1)
        self._posted = False

    # ----------------------------------------------------------------- backward
    @_compat.outside_functorch
    def _pre_backward(self, _grad) -> None:
        """A gradient reached its outputs: report it (the schedule gathers and
        decides, ``BackwardSchedule.pre_backward``)."""
        self.ctx.on_backward_hook()  # type: ignore[union-attr]
        self._uses_seen += 1
        self.ctx.pre_backward(self)  # type: ignore[union-attr]

    def start_backward(self) -> None:
        """Its backward (again, after POST_BACKWARD: another use's gradient)
        starts; the gradients arrived so far are a part."""
        if self.state is TrainingState.POST_BACKWARD:
            self._ready.clear()
        self._enter(TrainingState.PRE_BACKWARD, "pre_backward")

    @_compat.outside_functorch
    def _on_grad_accumulated(self, group: FlatGroup, _flat: torch.Tensor) -> None:
        with label("post_backward", self.fqn):
            self._assert_state(*_IN_BACKWARD, where="post_backward")
            ctx = self.root_context()
            ctx.on_backward_hook(grad_arrived=True)
            self._ready.add(group)
            if len(self._ready) == len(self.trainable):  # all in: the schedule decides
                ctx.grads_ready(self)

    def more_uses_to_come(self) -> bool:
        """Forward uses of this step whose output gradient has not arrived yet."""
        return self._uses_seen < self.uses

    def keep_accumulating(self) -> None:
        """The gradients arrived are a part (a reentrant checkpoint): the next
        post-backward waits for every group again."""
        self._ready.clear()

    def end_backward(self) -> None:
        """All its gradients are in (the schedule reduces them now)."""
        self._enter(TrainingState.POST_BACKWARD, "post_backward")

    def completes_reduction(self) -> bool:
        """Reducing now ends in p.grad: gradient sync on and, with HSDP, the
        all-reduce across replicas on (else the reduction stays pending)."""
        s = self.settings
        return s.requires_gradient_sync and (
            s.reduce.requires_all_reduce or all(g.replicate_pg is None for g in self.trainable))

    def finish_backward(self, resharded: bool) -> None:
        """The end of a backward (``RootContext.reset``, for every unit, after
        its BACKWARD_END reshard decision): left unsharded unless
        ``resharded``, until the next step (see Kept.BACKWARD)."""
        self.grads_hooked = False
        self._uses_seen = 0
        if resharded:
            self.keep(Kept.NO)
        else:
            for g in self.groups:
                g.keep_unsharded()
            self.keep(Kept.BACKWARD)
        self._ready.clear()
        self._forward_depth = 0
        self.state = TrainingState.IDLE
