"""Lazy root initialisation and the state every unit below a root shares.

The first forward (or ``unshard()``) of any sharded module makes that module's
unit the *root*: it walks its subtree once, names every unit and parameter by
FQN, checks the parameters, and builds the ``RootContext`` all units then
reference: the recorded forward order, the stream manager, and the backward
bookkeeping (reduce-scatter order, the final callback).

``RootContext`` here is the step lifecycle (a training root forward starts a
step, the first pre-backward queues the final callback, which ends it; a step
an exception left half-done is aborted at the next root forward; ``reset``
ends both), the two decisions every unit event leads to (``gather``: whether
and how a unit is all-gathered; ``reshard``: whether it frees its parameters
after an event; see [Note: who decides] in _unit.py), and it sets every
attribute a step uses. Its concerns are mixins, each in its own file:

- ``ForwardWalk`` (_forward_walk.py): the forward order, followed or agreed
  on ([Note: forward order]), forward prefetch and gather buckets,
  ``LastStepOrder``;
- ``BackwardSchedule`` (_backward_schedule.py): the gather and reduce
  orders, slots, reduce-scatters, buckets, drain ([Note: collective order],
  [Note: one order across communicators]);
- ``RootStepChecks`` (_step_checks.py): what the divergence step checks
  compare, and a step left half-done ([Note: divergence]).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _compat, _divergence
from ._backward_schedule import BackwardSchedule
from ._common import (META_FIX, Gather, Kept, Reshard, ShardedState,
                      TrainingState, label, root_setting_fix, trace, unit_error)
from ._forward_order import ForwardOrder
from ._forward_walk import ForwardWalk, LastStepOrder, _Learned, _Walk
from ._registry import units_below
from ._step_checks import RootStepChecks
from ._streams import StreamManager
from ._unit import Unit


class RootContext(ForwardWalk, BackwardSchedule, RootStepChecks):
    def __init__(self, root: Unit, units: list[Unit], device: torch.device,
                 communicates: bool):
        self.root = root
        self.units = units
        self.last_step_order = LastStepOrder()
        # the model's settings (FSDPModule's root setters; see RootSettings)
        # (on the root unit, so a lazy init again after a cast keeps them)
        self.settings = root.settings_for_root()
        self.streams = StreamManager(device)
        # per step (from a root forward after a backward, to the next one)
        self._new_step = True
        self._step_order: dict[Unit, None] = {}  # units in first-forward order this step
        self._grad_follows: dict[Unit, None] = {}  # ... whose outputs will see a backward,
                                                   # in last-post-forward order
        self._clock = 0                             # forward events this step, and when:
        self._first_pre: dict[Unit, int] = {}       # ... a unit's first pre-forward
        self._last_post: dict[Unit, int] = {}       # ... its last post-forward (grad follows)
        self._regions: dict[Unit, set] = {}         # checkpoint regions its forwards ran in
        # ... and those that ran as a no-grad island of the training forward
        # (a reentrant checkpoint recomputes them in backward): the units of
        # the two backward orders, see [Note: collective order] in
        # _backward_schedule.py
        self._in_orders: dict[Unit, None] = {}
        # per backward
        self._callback_queued = False
        self._outer_task = -1                   # graph task of the backward we finish
        self._gather_order: list[Unit] | None = None  # see that Note
        self._gather_pos: dict[Unit, int] = {}
        self._gather_next = 0                   # next index in it to all-gather
        self._order: list[Unit] | None = None   # the reduce order, see that Note
        self._next = 0                          # next index in it to reduce-scatter
        self._slots: list[int] | None = None    # per reduce-order index: its slot (see Note)
        self._gets_grad: dict[Unit, bool] | None = None  # will the engine give it one
        self._ready: set[Unit] = set()
        self._launched: set[Unit] = set()
        self._in_flight: list = []
        self._bucket: list[Unit] = []            # units waiting to be reduced as one bucket
        self._bucket_bytes = 0                   # ... and their flat gradients' size
        self._following: list | None = None      # see _next_reduced_bytes
        self.accumulated = False                # a flat gradient arrived in this backward
        # units in the reduce order of a backward that did not finish their
        # reduction (Unit.completes_reduction), not finished since: every rank
        # alike (see that Note)
        self._pending: dict[Unit, None] = {}
        self.in_training_forward = False        # inside a grad-enabled forward of the root
        self.communicates = communicates        # some group has world > 1
        # the lazy-init and step checks of [Note: divergence] in _divergence.py
        # (None: nothing communicates; see start_checks)
        self.checks: _divergence.StepChecks | None = None
        self._settings: tuple = (-1, None)  # (settings_generation, _make_settings())
        # the forward orders (see [Note: forward order] in _forward_walk.py), per
        # kind of root forward: (method, training)
        self._orders: dict[tuple, _Learned] = {}
        self._walk: _Walk | None = None         # the root forward now running
        self._unit_index = {u: i for i, u in enumerate(units)}
        self._order_pgs: tuple | None = None    # the groups the agreement all-reduces in

    def start_checks(self, checks: "_divergence.StepChecks") -> None:
        """Lazy init, where some group communicates: [Note: divergence]."""
        self.checks = checks

    # ------------------------------------------------------------------ forward
    def root_pre_forward(self, entry: str = "forward") -> None:
        if self.checks is not None:
            _divergence.raise_if_stopped(self.root.fqn, self.checks)
        if self._callback_queued or any(u.state is not TrainingState.IDLE for u in self.units):
            if self.checks is not None:
                self._left_half_done()  # raises unless every rank left it alike
            self.reset(abort=True)  # a previous forward or backward raised before finishing
        if self.checks is not None:
            self.checks.before(_divergence.FORWARD if torch.is_grad_enabled()
                               else _divergence.EVAL_FORWARD, *self._schedule_settings())
        self.in_training_forward = torch.is_grad_enabled()
        if self._new_step and torch.is_grad_enabled():  # eval forwards start no step
            self._new_step = False
            self._step_order.clear()
            self._grad_follows.clear()
            self._first_pre.clear()
            self._last_post.clear()
            self._regions.clear()
            self._in_orders.clear()
            for u in self.units:
                self.reshard(u, Reshard.NEW_STEP)
                u.start_step()
        self._walk = None
        if self.communicates:
            learned = self._orders.setdefault((entry, self.in_training_forward), _Learned())
            trained = self._orders.get((entry, True))
            if not self.in_training_forward and trained is not None and not trained.learning():
                follow = trained  # eval follows the training order: [Note: forward order]
            else:
                follow = learned
            agree = self.settings.forward_order_dynamic or follow.learning()
            self._walk = _Walk(ForwardOrder() if agree else follow.order, agree, self._clock,
                               learned)

    # ------------------------------------------------------- the two decisions
    def gather(self, unit: Unit, why: Gather) -> None:
        """Whether and how ``unit`` is all-gathered now, asked by a unit's event
        (``why``); the one place that decides it (issuing only: the unit waits).

        - FORWARD, SKIPPED: gathered (the forward order said so), then the
          forward prefetch; PREFETCH: only if still sharded;
        - BACKWARD, RECOMPUTE: first every unit before it in the gather order
          (see [Note: collective order] in _backward_schedule.py), then it,
          except in BACKWARD a unit with ``unshard_in_backward`` False;
          IN_ORDER, AGAIN: it, with the same exception;
        - USER: it.
        Gathered with the units after it as one bucket where gather buckets
        are on (``_gather_bucket``), else alone (``Unit.unshard``)."""
        if why is Gather.BACKWARD or why is Gather.RECOMPUTE:
            if unit in self._in_orders:
                # On gloo a unit resharded after forward prefetches once its
                # gradients are computed, see [Note: gloo backward] in
                # _backward_schedule.py; a unit that kept its parameters (the
                # root), or whose gradients have no hook (frozen), prefetches now.
                late = unit.grads_hooked and unit.reshard_after_forward
                self._gather_up_to(self._prefetch_stop(unit, prefetch=not late))
        if not unit.unshard_in_backward and why in _NOT_IN_BACKWARD:
            return
        if why is Gather.PREFETCH:
            if unit.is_unsharded:
                return
            trace("prefetch", unit.fqn, "forward")
        if not self._gather_bucket(unit):
            unit.unshard(self.streams)
        if why is Gather.FORWARD or why is Gather.SKIPPED:
            self.prefetch_forward(unit)

    def reshard(self, unit: Unit, event: Reshard, grad_follows: bool = False,
                group=None) -> bool:
        """Whether ``unit`` frees its unsharded parameters after ``event``
        (and frees them): the one policy table. Returns whether it did.

        - AFTER_FORWARD (``grad_follows``: a backward follows): if
          reshard_after_forward, else kept for backward; an eval forward (no
          backward follows, and not inside a training forward of the root,
          where a no-grad island is e.g. a reentrant checkpoint whose
          recomputation wants the parameters) frees them whatever the
          setting: the optimizer never steps under a stale copy. With a
          backward to follow, reshard_after_forward=N keeps 1/N (PARTIAL);
        - GRADS_COMPUTED (``group``, gloo): that group, once its parameters'
          gradients exist, for a unit used once outside a nested backward
          (see [Note: gloo backward] in _backward_schedule.py);
        - AFTER_BACKWARD, BACKWARD_END: if reshard_after_backward;
        - NEW_STEP: a unit left unsharded by a forward with no backward (may
          be stale after optimizer.step()), unless the user unsharded it
          (Kept.USER); kept by set_reshard_after_backward(False) only if no
          shard changed since."""
        if event is Reshard.AFTER_FORWARD:
            in_training_step = self.in_training_forward and unit is not self.root
            if not (unit.reshard_after_forward or not (grad_follows or in_training_step)):
                return False
            with _compat.functorch_disabled():
                unit.reshard(to_post_forward=grad_follows)
            return True
        if event is Reshard.GRADS_COMPUTED:
            if not (unit.reshard_after_backward and unit.uses == 1
                    and not self.in_nested_backward() and group.state is not ShardedState.SHARDED):
                return False
            trace("reshard", unit.fqn, "grads computed")
            group.reshard()
            return True
        if event is Reshard.NEW_STEP:
            if not unit.is_unsharded or unit.kept is Kept.USER \
                    or (unit.kept is Kept.BACKWARD and not unit.is_stale()):
                return False
        elif not unit.reshard_after_backward:  # AFTER_BACKWARD, BACKWARD_END
            return False
        unit.reshard()
        return True

    # ----------------------------------------------------------------- backward
    def on_backward_hook(self, grad_arrived: bool = False) -> None:
        """A unit's pre-backward (or, ``grad_arrived``, a flat gradient
        accumulated): the first of a backward queues the final callback."""
        if grad_arrived:
            self.accumulated = True
        if not self._callback_queued:
            if self.checks is not None:
                _divergence.raise_if_stopped(self.root.fqn, self.checks)
                self.checks.before(_divergence.BACKWARD, *self._schedule_settings())
            self._callback_queued = True
            self._outer_task = _compat.graph_task_id()
            self.last_step_order.set_order(list(self._step_order))
            _compat.queue_final_callback(self._final_callback)

    def in_nested_backward(self) -> bool:
        """Inside a backward that runs within ours (a reentrant checkpoint)."""
        return _compat.graph_task_id() != self._outer_task

    @_compat.outside_functorch
    def _final_callback(self) -> None:
        with label("final_callback", self.root.fqn):
            trace("final_callback", self.root.fqn)
            # All-gathers this rank's graph never asked for (a unit whose
            # backward did not reach it here) may be awaited by another rank:
            # finish the one sequence (see [Note: one order across communicators]),
            # zero-filling what is left.
            self._gather_up_to(len(self._gather_positions()) - 1, final=True)
            self._issue_reductions(final=True)
            if self.accumulated:  # else e.g. autograd.grad(loss, inputs): p.grad untouched
                for u in self.reduce_order():
                    if u.trainable and not u.completes_reduction():
                        self._pending[u] = None
                    else:
                        self._pending.pop(u, None)
            if self.settings.is_last_backward or self.streams.host_work_pending:
                self._drain()
            # CUDA: the compute stream waits every post-reduce; offload or
            # used-flags to read: the one sync
            self.streams.finish_backward()
            # else (set_is_last_backward(False)): the last reduce-scatter stays in
            # flight, overlapping the next microbatch's forward; the next
            # backward's first launch (or a last backward) folds it into p.grad
            self.reset()

    def reset(self, abort: bool = False) -> None:
        """End the backward, and the step: every unit's BACKWARD_END reshard
        decision and ``finish_backward``, then every per-backward field; the one
        place they are cleared. ``abort``: a step an exception left half-done
        (see root_pre_forward): first drop what it had in flight and every
        gradient it accumulated (its reduce-scatters are abandoned, never
        dropped while a side stream still writes them)."""
        if abort:
            for launch in self._in_flight:
                launch.used.release()  # (the compute stream waits its used-flags' all-reduce)
            self._in_flight = []
            self.streams.abort()  # (and every post-reduce: see StreamManager.abort)
            self._pending.clear()  # (drop_grad below forgets what they accumulated)
        for u in self.units:
            if abort:
                for g in u.groups:
                    g.drop_grad()
            u.finish_backward(resharded=self.reshard(u, Reshard.BACKWARD_END))
        self._callback_queued = False
        self.accumulated = False
        self._order = None
        self._gather_order = None
        self._gather_next = 0
        self._next = 0
        self._slots = None
        self._gets_grad = None
        self._ready.clear()
        self._launched.clear()
        self._bucket, self._bucket_bytes, self._following = [], 0, None
        self._new_step = True


# in backward, a unit with set_unshard_in_backward(False) is not gathered for these
_NOT_IN_BACKWARD = (Gather.BACKWARD, Gather.IN_ORDER, Gather.AGAIN)


def assign_fqns(module: nn.Module) -> None:
    """Name every unit and parameter below ``module`` relative to it."""
    prefix = {id(m): name for name, m in module.named_modules()}
    for fqn, u in units_below(module):
        u.set_fqn(fqn, prefix)


def lazy_init_root(unit: Unit) -> None:
    """Make ``unit`` the root of every unit in its subtree."""
    root_module = unit.modules[0]
    if len(unit.modules) == 1:
        assign_fqns(root_module)
    units = list(dict.fromkeys(u for m in unit.modules for _, u in units_below(m)))
    _check_not_meta(unit, units)
    _check_root_settings(unit, units)
    for u in units:
        u.check_params()
    # a root without parameters of its own (a Sequential of sharded blocks)
    # communicates where its mesh lives, like the units it holds
    device = unit.groups[0].device if unit.groups else unit.device
    pgs = _check_groups(units)
    ctx = RootContext(unit, units, device, communicates=any(g.world > 1 for u in units
                                                            for g in u.groups))
    for u in units:
        u.set_root(ctx)
    if pgs:  # see [Note: divergence] in _divergence.py
        for m in unit.modules:  # (removed with the unit's other hooks)
            unit.hook_handles.append(m.register_forward_hook(_forward_ended(unit),
                                                             always_call=True))
        ctx.start_checks(_divergence.StepChecks(unit.fqn, pgs, units, ctx.streams.runtime))
        ctx.checks.lazy_init(_layout_lines(units) + [
            f"step check (FSDP_COMPOSE_STEP_CHECK) {'on' if ctx.checks.enabled else 'off'}"])
    # world size 1: plain PyTorch's forward and backward for the passive units
    passive = [u for u in units if u is not unit and u.passive and not ctx.communicates]
    for u in passive:
        u.remove_forward_hooks()
    trace("lazy_init", unit.fqn, f"units={len(units)}"
          + (f", {len(passive)} without hooks" if passive else ""))


def _forward_ended(unit: Unit):
    def hook(module, args, output):
        unit.forward_ended()
        # a step check not waited for yet (a forward without collectives): now,
        # not at some later collective (see StepChecks.settle)
        _divergence.settle()
    return torch.compiler.disable(hook, reason="fsdp_compose's forward hooks run eagerly")


def _check_groups(units: list[Unit]) -> list:
    """[(process group, device)]: the groups the units communicate on (HSDP:
    the replicas' too), each with the device its collectives run on."""
    pgs: dict = {}
    for u in units:
        for g in u.groups:
            for pg in (g.pg, g.replicate_pg):
                if pg is not None and dist.get_world_size(pg) > 1:
                    pgs.setdefault(pg, g.device)
    return list(pgs.items())


def _layout_lines(units: list[Unit]) -> list[str]:
    """One line per unit: what every rank must have alike (the lazy-init check)."""
    lines = []
    for u in units:
        parts = []
        for g in u.groups:
            params = ", ".join(f"{e.fqn} {tuple(e.shape)}" for e in g.entries)
            pf = f", kept over {g.post_forward.size} after forward" if g.post_forward else ""
            parts.append(f"{str(g.dtype).replace('torch.', '')}"
                         f"{'' if g.requires_grad else ' frozen'} over {g.world} ranks{pf}: "
                         f"{params}")
        lines.append(f"unit '{u.fqn or '<root>'}': " + ("; ".join(parts) or "no parameters"))
    return lines


def _check_not_meta(root: Unit, units: list[Unit]) -> None:
    meta = [e.fqn for u in units for g in u.groups if g.device.type == "meta" for e in g.entries]
    if meta:
        shown = ", ".join(meta[:8]) + (f" and {len(meta) - 8} more" if len(meta) > 8 else "")
        raise unit_error(root.fqn, f"{len(meta)} parameters are still on the meta device at "
                         f"the first forward: {shown}.", META_FIX)


def _check_root_settings(root: Unit, units: list[Unit]) -> None:
    """A root-only setting (FSDPModule._root_setting) called on a unit that did
    not become the root would be silently ignored: say so instead."""
    for u in units:
        if u is not root and u.root_settings is not None and u.root_settings.called:
            where = sorted(u.root_settings.called)[0]
            raise unit_error(u.fqn, f"{where}() was called on this unit, but it is not the "
                             f"root ('{root.fqn or '<root>'}' is): the setting would be ignored.",
                             root_setting_fix(where), exc=ValueError)
