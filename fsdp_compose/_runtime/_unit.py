"""One fully_shard unit: its modules, flat groups, settings and training state.

[Note: who decides] A unit acts on its own groups and writes only its own
fields; it never calls the root. The hooks are the root's (``_state.py``):
each enters ``RootContext``, which *decides* what is gathered, freed and
reduced, issues it through ``_group_ops``, and calls the unit's acts
(``wait_for_unshard``, ``reshard``) and bookkeeping (``start_backward``,
``end_backward``, ``note_use`` ...). Each event moves the unit's
``TrainingState`` along ``_MOVES`` or raises:

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
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .._base import _compat
from .._base._common import (Kept, ReduceSettings, RootSettings, ShardedState,
                      TrainingState, UnitSettings, trace, unit_error)
from .._group._flat_group import FlatGroup

if TYPE_CHECKING:
    from ._state import RootContext

_REDUCE_FIELDS = {f.name for f in fields(ReduceSettings)}
# where a backward hook may find the unit (not inside its own forward)
IN_BACKWARD = (TrainingState.IDLE, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
# the states each state is entered from (Unit.enter); the root's reset moves
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
                 device: torch.device = torch.device("cpu")):
        self.modules = modules
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
        """Find the trainable groups. Again after a cast or move re-made every
        group's flat (FSDPModule._apply): which groups are direct may have
        changed. (Their flat gradients' hooks are the root's: ``_state.hook_grads``.)"""
        self.trainable = [g for g in self.groups if g.requires_grad and not g.direct]
        self.trains = tuple(g.requires_grad for g in self.groups)
        self._ready.clear()
        for g in self.groups:
            g.grad.settings = self.settings.reduce

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

    def assert_state(self, *states: TrainingState, where: str) -> None:
        if self.state not in states:
            raise unit_error(self.fqn, f"{where} expected state {[s.name for s in states]}, "
                             f"got {self.state.name}.")

    def enter(self, state: TrainingState, where: str) -> None:
        """The state machine: every hook moves the unit along ``_MOVES`` or raises."""
        if self.state not in _MOVES[state]:
            self.assert_state(*_MOVES[state], where=where)  # (raises)
        self.state = state

    # ----------------------------------------------------------- unshard/reshard
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
            if g.on_meta or (g.direct and not direct):
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
    # (the hooks are the root's, _state.py: it calls these acts and reads)
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

    def cast_inputs(self, args, kwargs):
        """``(args, kwargs)`` cast to the policy's dtype (None: no cast)."""
        return self._cast(self._cast_inputs, (args, kwargs))

    def cast_outputs(self, output):
        """``output`` cast to the policy's output dtype, if it has one."""
        return output if self._cast_outputs is None else self._cast(self._cast_outputs, output)

    def in_forward(self) -> bool:
        """A module of this unit runs its forward now (not a recomputation)."""
        return self._forward_depth > 0

    def enter_module(self) -> None:
        """A module of this unit starts its forward (after the pre-forward's work)."""
        self._forward_depth += 1

    def leave_module(self) -> bool:
        """A module of this unit ended its forward (its post-forward); returns
        whether another module of the unit still runs."""
        self._forward_depth -= 1
        self._posted = True
        return self._forward_depth > 0

    def note_use(self) -> None:
        """A forward call this step whose outputs will see a backward."""
        self.uses += 1

    def note_use_seen(self) -> None:
        """A use's output gradient arrived (its pre-backward)."""
        self._uses_seen += 1

    def note_grads_hooked(self) -> None:
        """A group's split node reports its gradients this backward (gloo)."""
        self.grads_hooked = True

    def group_ready(self, group: FlatGroup) -> bool:
        """``group``'s flat gradient accumulated; returns whether every
        trainable group's has, in this backward."""
        self._ready.add(group)
        return len(self._ready) == len(self.trainable)

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
    def start_backward(self) -> None:
        """Its backward (again, after POST_BACKWARD: another use's gradient)
        starts; the gradients arrived so far are a part."""
        if self.state is TrainingState.POST_BACKWARD:
            self._ready.clear()
        self.enter(TrainingState.PRE_BACKWARD, "pre_backward")

    def more_uses_to_come(self) -> bool:
        """Forward uses of this step whose output gradient has not arrived yet."""
        return self._uses_seen < self.uses

    def keep_accumulating(self) -> None:
        """The gradients arrived are a part (a reentrant checkpoint): the next
        post-backward waits for every group again."""
        self._ready.clear()

    def end_backward(self) -> None:
        """All its gradients are in (the schedule reduces them now)."""
        self.enter(TrainingState.POST_BACKWARD, "post_backward")

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
